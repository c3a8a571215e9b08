"""The trainer's own checkpoints: weights plus optimizer and schedule state, written atomically every step.

Layout under the state root: `step-00000012/` holds an ordinary HF model directory (config.json,
safetensors, tokenizer when given; the publisher can shard and announce it as is) plus `optimizer.pt`
(AdamW and warmup state) and `trainer_state.json`, written last. Everything is written into a hidden
temporary directory, fsynced, and renamed into place, so a directory named `step-*` is always complete;
that is what makes the consumed record's "commit after the checkpoint" rule exactly-once.

`optimizer.pt` is the trainer's own local data, never received from a peer; it is still read with
`torch.load(weights_only=True)`, which unpickles tensors and plain containers only.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import torch

from ...node.runtime.durable import fsync_path, fsync_tree
from ...p2p.wire import WireFormatError, parse_uint
from ..errors import TrainerError

STATE_VERSION = 1
_STEP_PREFIX, _STEP_DIGITS = "step-", 8
_META = "trainer_state.json"
_OPTIM = "optimizer.pt"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{_STEP_PREFIX}{step:0{_STEP_DIGITS}d}"


def _step_of(name: str) -> int | None:
    """The step a state directory's name says (`step-` and exactly 8 ASCII digits), None for any other."""
    if not name.startswith(_STEP_PREFIX):
        return None
    try:
        digits = name[len(_STEP_PREFIX) :]
        return parse_uint(digits, "state directory", maximum=10**_STEP_DIGITS - 1, width=_STEP_DIGITS)
    except WireFormatError:
        return None


def save_train_state(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    tokenizer: object | None = None,
) -> Path:
    """Write the state after `step` rollout steps and return its directory (which is then complete)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    if final.exists():
        raise TrainerError(f"{final} already exists; the step counter must only move forward")
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)  # type: ignore[attr-defined]
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / _OPTIM)
        (tmp / _META).write_text(json.dumps({"version": STATE_VERSION, "step": step}))
        fsync_tree(tmp)
        os.rename(tmp, final)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def list_train_states(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete state under `root`, oldest first; temporaries are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = _step_of(child.name)
        if step is not None and (child / _META).is_file():
            found.append((step, child))
    return sorted(found)


def latest_train_state(root: Path) -> tuple[int, Path] | None:
    states = list_train_states(root)
    return states[-1] if states else None


def load_optimizer_state(
    path: Path, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler
) -> int:
    """Restore optimizer and schedule from a state directory; the model is loaded from the same directory
    with from_pretrained BEFORE the optimizer is built. Returns the step the state was saved after."""
    path = Path(path)
    try:
        meta = json.loads((path / _META).read_text())
        blob = torch.load(path / _OPTIM, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as exc:
        raise TrainerError(
            f"trainer state {path} is unreadable ({exc}); delete it to resume from the previous one"
        ) from None
    if (
        not isinstance(meta, dict)
        or meta.get("version") != STATE_VERSION
        or not isinstance(meta.get("step"), int)
        or not isinstance(blob, dict)
        or not {"optimizer", "scheduler"} <= blob.keys()
    ):
        raise TrainerError(
            f"trainer state {path} has an unknown format; delete it to resume from the previous one"
        )
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    return int(meta["step"])


def prune_train_states(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` states and any leftover temporaries; returns what was removed."""
    if keep < 1:
        raise TrainerError("keep at least one trainer state, or there is nothing to resume from")
    removed = [p for _, p in list_train_states(root)[:-keep]]
    removed += [p for p in Path(root).glob(".step-*.tmp-*") if p.is_dir()]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed
