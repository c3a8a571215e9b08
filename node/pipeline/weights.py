"""Stage-only weight loading: a stage reads only the tensors of its layers from the verified checkpoint.

The embedding goes to the first stage; the final norm and the LM head to the last (with tied embeddings the
head is the embedding matrix, so the last stage reads that tensor too). Tensors are read through
safetensors' lazy reader: the bytes of other stages' layers are never loaded. The checkpoint directory is the
one the node verified against the signed manifest (p2p/weights), as for a monolithic load.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ...p2p.pipeline.layout import StageLayout
from ..errors import EngineError

EMBEDDING = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_INDEX_BYTES = 16 << 20
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def read_config(checkpoint: Path) -> dict[str, Any]:
    path = Path(checkpoint) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot read {path}: {exc}") from None


def tensor_files(checkpoint: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or the files an index names)."""
    checkpoint = Path(checkpoint)
    index = checkpoint / INDEX_FILE
    if index.is_file():
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise EngineError(f"{index} is larger than {MAX_INDEX_BYTES} bytes")
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise EngineError(f"cannot read the weight map of {index}: {exc}") from None
        return {name: checkpoint / file for name, file in weight_map.items()}
    single = checkpoint / SINGLE_FILE
    if not single.is_file():
        raise EngineError(f"{checkpoint} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    try:
        with safe_open(single, framework="pt") as handle:
            return {name: single for name in handle.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    except (OSError, SafetensorError) as exc:
        raise EngineError(f"cannot open {single}: {exc}") from None


def stage_tensor_names(available: set[str], layout: StageLayout, stage: int, tied: bool) -> dict[str, str]:
    """Checkpoint name -> name inside the stage for every tensor the stage needs (layers renumbered from 0)."""
    layers = layout.layer_range(stage)
    wanted: dict[str, str] = {}
    for name in available:
        match = _LAYER.fullmatch(name)
        if match and int(match.group(1)) in layers:
            wanted[name] = f"layers.{int(match.group(1)) - layers.start}.{match.group(2)}"
    if stage == 0:
        wanted[EMBEDDING] = "embed.weight"
    if stage == layout.stages - 1:
        wanted[FINAL_NORM] = "norm.weight"
        wanted[LM_HEAD if LM_HEAD in available or not tied else EMBEDDING] = "head.weight"
    missing = sorted(name for name in wanted if name not in available)
    if missing:
        raise EngineError(f"the checkpoint lacks tensors stage {stage} needs: {', '.join(missing[:4])}")
    return wanted


def load_stage_tensors(
    checkpoint: Path, layout: StageLayout, stage: int, dtype: torch.dtype, *, tied: bool
) -> dict[str, torch.Tensor]:
    """The stage's tensors under their stage names, in `dtype`; nothing else is read."""
    files = tensor_files(checkpoint)
    wanted = stage_tensor_names(set(files), layout, stage, tied)
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    state: dict[str, torch.Tensor] = {}
    for path, names in sorted(by_file.items()):
        try:
            with safe_open(path, framework="pt") as handle:
                for name in names:
                    state[wanted[name]] = handle.get_tensor(name).to(dtype)
        except (OSError, SafetensorError) as exc:
            raise EngineError(f"cannot read stage {stage}'s tensors from {path}: {exc}") from None
    return state


# ---------------------------------------------------------------------------- which shards a stage needs

MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit on its JSON header


def safetensors_header_size(prefix: bytes) -> int:
    """Bytes of a safetensors file before its tensor data (8-byte length + JSON header), from its first 8 bytes."""
    if len(prefix) < 8:
        raise EngineError("a safetensors file is shorter than its 8-byte header length")
    size = int.from_bytes(prefix[:8], "little")
    if size > MAX_SAFETENSORS_HEADER:
        raise EngineError(f"a safetensors header claims {size} bytes; at most {MAX_SAFETENSORS_HEADER}")
    return 8 + size


def tensor_ranges(header: bytes) -> dict[str, tuple[int, int]]:
    """Tensor name -> [start, end) byte range in the file, from the file's header bytes (at least
    safetensors_header_size of them). The header comes from the signed checkpoint, so it is trusted for
    content, but its offsets are still checked to lie after the header."""
    start = safetensors_header_size(header)
    if len(header) < start:
        raise EngineError(f"{len(header)} header bytes given, the header has {start}")
    try:
        entries = json.loads(header[8:start])
    except ValueError as exc:
        raise EngineError(f"a safetensors header is not JSON: {exc}") from None
    ranges = {}
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end:
            raise EngineError(f"tensor {name} has data offsets {begin}, {end}")
        ranges[name] = (start + begin, start + end)
    return ranges


def stage_shards(
    files: list[tuple[str, int]],
    shard_size: int,
    headers: dict[str, bytes],
    layout: StageLayout,
    stage: int,
    *,
    tied: bool,
) -> list[int]:
    """Indices of the checkpoint's shards a stage needs: every byte of its tensors and of each safetensors
    header, and every other file whole (config, tokenizer, index). `files`: (path, size) in manifest order
    (the checkpoint is their concatenation, cut every `shard_size` bytes); `headers`: each .safetensors
    file's header bytes (its first shard holds them in practice)."""
    ranges_of = {path: tensor_ranges(headers[path]) for path, _ in files if path.endswith(".safetensors")}
    available = {name for ranges in ranges_of.values() for name in ranges}
    wanted = stage_tensor_names(available, layout, stage, tied)
    needed: list[tuple[int, int]] = []
    offset = 0
    for path, size in files:
        if path in ranges_of:
            needed.append((offset, offset + safetensors_header_size(headers[path])))
            needed += [(offset + a, offset + b) for name, (a, b) in ranges_of[path].items() if name in wanted]
        elif size:
            needed.append((offset, offset + size))
        offset += size
    shards: set[int] = set()
    for begin, end in needed:
        if end > begin:
            shards.update(range(begin // shard_size, (end - 1) // shard_size + 1))
    return sorted(shards)
