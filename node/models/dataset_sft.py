"""`prime-node sft`: a model fine-tuned on a verified dataset's SFT subset (INTELLECT-MATH's initialisation).

The student learns the dataset's correct completions (sft.parquet, written by `prime-node dataset build`)
with the shared SFT loop (sft_loop.py, the one the warm starts use): prompt and completion are tokenized
again with the student's own tokenizer, in the run's prompt format (a chat template where the student has
one), the loss covers the completion and its EOS (when the sample ended on one). Batches are a pure
function of the step (a seeded permutation per epoch), so a run resumed after a kill takes the same steps
as one never interrupted and ends with the same weights (deterministic kernels, fixed thread count).

Every `save_every` steps the weights (safetensors) and the optimizer and schedule (a torch file written and
read only by this command, never received from anyone) go into a state directory beside --out, under a
fingerprint of the inputs; a rerun with the same inputs resumes from the newest state, one with other
inputs stops and says so. The result is an HF directory as `prime-node model init` writes one (config.json,
model.safetensors, tokenizer, prime_node.json), which `prime-node trainer --model` takes as its genesis.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from pydantic import BaseModel
from safetensors.torch import load_model, save_model
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..engine.hf import load_hf_model
from ..errors import ModelError, NodeError
from ..run.prompts import PromptBuilder
from ..runtime.progress import progress_bar
from .sft_config import SftConfig
from .sft_loop import SftLoop, SftRecipe
from .warmstart import IGNORE_INDEX, RUN_INFO_FILE, WEIGHTS_FILE, deterministic_torch, file_sha256

logger = logging.getLogger(__name__)

SFT_FILE = "sft.parquet"  # the subset `prime-node dataset build` writes (trainer/dataset/card.py FILES)
MAX_ROWS = 1_000_000
MAX_SEQUENCE_TOKENS = 16_384


class SftResult(BaseModel):
    out: str
    steps: int
    resumed_from: int
    samples: int  # rows of the SFT subset
    final_loss: float | None
    model_sha256: str
    wall_seconds: float
    cpu_seconds: float


def _examples(dataset: Path, tokenizer: PreTrainedTokenizerBase) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) of every SFT row, tokenized by the student."""
    path = dataset / SFT_FILE
    try:
        meta = pq.ParquetFile(path).metadata
        if meta.num_rows > MAX_ROWS:
            raise ModelError(f"{path}: {meta.num_rows} rows, more than {MAX_ROWS}")
        table = pq.read_table(path, columns=["prompt", "completion", "finish_reason"])
    except (OSError, pa.ArrowException, KeyError) as exc:
        raise ModelError(f"cannot read {path} (a directory of prime-node dataset build): {exc}") from None
    prompts_of = PromptBuilder(tokenizer)  # the run's format for this model: raw text or its chat template
    eos = tokenizer.eos_token_id
    out = []
    for prompt, completion, finish in zip(
        *(table.column(c).to_pylist() for c in table.column_names), strict=True
    ):
        ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
        if finish == "eos":
            ids.append(eos)
        pair = (list(prompts_of.ids(prompt)), ids)
        if ids and len(pair[0]) + len(ids) <= MAX_SEQUENCE_TOKENS:
            out.append(pair)
    if not out:
        raise ModelError(
            f"{path} has no correct rows to learn from: build the dataset from more samples, or widen its bands"
        )
    return out


def _batch(examples: list[tuple[list[int], list[int]]], pad: int) -> dict[str, torch.Tensor]:
    width = max(len(p) + len(c) for p, c in examples)
    input_ids = torch.full((len(examples), width), pad, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (prompt, completion) in enumerate(examples):
        seq = prompt + completion
        input_ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(prompt) : len(seq)] = torch.tensor(completion)
        attention[row, : len(seq)] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def batches_from(
    examples: list[tuple[list[int], list[int]]], config: SftConfig, first_step: int, pad: int
) -> Iterator[dict[str, torch.Tensor]]:
    """The batches of steps first_step, first_step + 1, ...: sample j of the run is position j of the stream of
    per-epoch permutations, each seeded by (seed, epoch)."""
    n = len(examples)
    orders: dict[int, list[int]] = {}
    for step in range(first_step, config.steps):
        picked = []
        for j in range(step * config.batch_size, (step + 1) * config.batch_size):
            epoch, at = divmod(j, n)
            if epoch not in orders:
                orders.clear()  # a batch spans at most two epochs: keep the current one only
                orders[epoch] = random.Random(f"{config.seed}:{epoch}").sample(range(n), n)
            picked.append(examples[orders[epoch][at]])
        yield _batch(picked, pad)


class _States:
    """Resumable states beside the output: `<state dir>/step-N/{weights.safetensors,loop.pt}` and `latest`."""

    def __init__(self, root: Path, fingerprint: str) -> None:
        self.root, self.fingerprint = root, fingerprint

    def latest(self) -> Path | None:
        marker = self.root / "latest.json"
        if not marker.is_file():
            return None
        record = json.loads(marker.read_text())
        if record.get("fingerprint") != self.fingerprint:
            raise ModelError(
                f"{self.root} holds the state of an SFT run with other inputs or settings; remove it, or give "
                "the same dataset, model and settings to resume it"
            )
        return self.root / str(record["state"])

    def save(self, loop: SftLoop) -> None:
        target = self.root / f"step-{loop.step}"
        tmp = self.root / f".step-{loop.step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_model(loop.model, str(tmp / "weights.safetensors"))  # tied weights (embeddings = head) once
        torch.save(loop.state_dict(), tmp / "loop.pt")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        marker = self.root / ".latest.json.tmp"
        marker.write_text(json.dumps({"fingerprint": self.fingerprint, "state": target.name}))
        os.replace(marker, self.root / "latest.json")  # the switch: a kill before it keeps the previous state
        for old in self.root.glob("step-*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, where: Path, loop: SftLoop) -> None:
        load_model(loop.model, str(where / "weights.safetensors"), strict=True)
        # Our own file, written by save() above on this machine; weights_only refuses any code in it anyway.
        loop.load_state_dict(torch.load(where / "loop.pt", weights_only=True))


def _fingerprint(dataset: Path, model_dir: Path, config: SftConfig) -> str:
    parts = {
        "sft": file_sha256(dataset / SFT_FILE),
        "model": file_sha256(model_dir / WEIGHTS_FILE)
        if (model_dir / WEIGHTS_FILE).is_file()
        else str(model_dir),
        "config": config.model_dump(mode="json"),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _load(model_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        model = load_hf_model(model_dir, "cpu", torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (NodeError, OSError, ValueError) as exc:
        raise ModelError(f"cannot load the model in {model_dir}: {exc}") from None
    return model, tokenizer


def sft_from_dataset(
    dataset: Path,
    model_dir: Path,
    out: Path,
    config: SftConfig,
    *,
    progress: bool = False,
    force: bool = False,
) -> SftResult:
    """Fine-tune the model of `model_dir` on `dataset`'s SFT subset and write it to `out` (module docstring)."""
    dataset, model_dir, out = (Path(p).expanduser().resolve() for p in (dataset, model_dir, out))
    if out.exists() and any(out.iterdir()) and not force:
        raise ModelError(f"{out} is not empty; choose another --out or pass --force")
    cpu0, wall0 = time.process_time(), time.perf_counter()
    model, tokenizer = _load(model_dir)
    examples = _examples(dataset, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    states = _States(out.parent / f".{out.name}.sft-state", _fingerprint(dataset, model_dir, config))
    loop = SftLoop(model, SftRecipe.of(config))
    resumed = states.latest()
    if resumed is not None:
        states.load(resumed, loop)
        logger.info("resuming SFT from step %d (%s)", loop.step, resumed)
    first = loop.step
    with deterministic_torch(config.threads):
        with progress_bar(config.steps, "sft", "step", enabled=progress, initial=first) as bar:

            def after(done: SftLoop) -> None:
                bar.update(1)
                bar.set_postfix(loss=f"{done.mean_loss:.3f}")
                if done.step % config.save_every == 0 and done.step < config.steps:
                    states.save(done)

            final_loss = loop.run(batches_from(examples, config, first, int(pad)), after)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging, save_jinja_files=False)
        info = {
            "format": 1,
            "sft": {
                "dataset": str(dataset),
                "dataset_sft_sha256": file_sha256(dataset / SFT_FILE),
                "from_model_sha256": file_sha256(model_dir / WEIGHTS_FILE)
                if (model_dir / WEIGHTS_FILE).is_file()
                else None,
                "samples": len(examples),
                "config": config.model_dump(mode="json"),
                "final_loss": final_loss,
            },
            "model_sha256": file_sha256(staging / WEIGHTS_FILE),
            "torch_version": torch.__version__,
        }
        (staging / RUN_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(states.root, ignore_errors=True)  # done: nothing left to resume
    return SftResult(
        out=str(out),
        steps=config.steps,
        resumed_from=first,
        samples=len(examples),
        final_loss=final_loss,
        model_sha256=str(info["model_sha256"]),
        wall_seconds=round(time.perf_counter() - wall0, 3),
        cpu_seconds=round(time.process_time() - cpu0, 3),
    )
