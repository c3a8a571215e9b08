"""Stage-only weight loading: a stage reads only the tensors of its layers from the verified checkpoint.

The embedding goes to the first stage; the final norm and the LM head to the last (with tied embeddings the
head is the embedding matrix, so the last stage reads that tensor too). Tensors are read through
safetensors' lazy reader: the bytes of other stages' layers are never loaded. The checkpoint directory is the
one the node verified against the signed manifest (p2p/weights), as for a monolithic load, or the version a
pipeline node fetched only in part: `StageSelection` is the fetch's plan (p2p/weights/selection.py) that names
the shards of the stages it offers, from the verified manifest and the safetensors headers read from verified
shards, and a stage loaded from such a version is first checked to lie in shards it holds (`check_held`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig

from ...p2p.pipeline.layout import StageLayout
from ...p2p.weights.errors import PlanError, WeightsError
from ...p2p.weights.manifest import SignedManifest
from ...p2p.weights.selection import Selection, describe_shards
from ...p2p.weights.store import holdings
from ...p2p.wire import loads_strict
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


def tensor_files(checkpoint: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it, relative to the checkpoint (the files an index names, or
    the one file)."""
    checkpoint = Path(checkpoint)
    weight_map = read_weight_map(checkpoint)
    if weight_map is not None:
        return weight_map
    single = checkpoint / SINGLE_FILE
    if not single.is_file():
        raise EngineError(f"{checkpoint} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    try:
        with safe_open(single, framework="pt") as handle:
            return dict.fromkeys(handle.keys(), SINGLE_FILE)  # noqa: SIM118 (safe_open is not a mapping)
    except (OSError, SafetensorError) as exc:
        raise EngineError(f"cannot open {single}: {exc}") from None


def read_weight_map(checkpoint: Path) -> dict[str, str] | None:
    """The index's tensor name -> file (relative to the checkpoint), None when there is no index: then every
    tensor is read from SINGLE_FILE. The one reading of the index, for the loader and for the shard plan."""
    index = Path(checkpoint) / INDEX_FILE
    if not index.is_file():
        return None
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise EngineError(f"{index} is larger than {MAX_INDEX_BYTES} bytes")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineError(f"cannot read the weight map of {index}: {exc}") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) and isinstance(file, str) for name, file in weight_map.items()
    ):
        raise EngineError(f"the weight map of {index} is not an object of tensor names to file names")
    return weight_map


def stage_reads(
    file_of: dict[str, str], layout: StageLayout, stage: int, tied: bool
) -> dict[str, tuple[str, str]]:
    """What stage `stage` reads: checkpoint tensor name -> (the file it is read from, its name inside the
    stage), given every tensor's file (`file_of`: the index's weight map, or SINGLE_FILE for each tensor of
    its header). The loader reads exactly these pairs, and a version held in part is checked and fetched for
    exactly these (`StageSelection`, `check_held`), so that no tensor is read from a shard not held."""
    return {
        name: (file_of[name], inside)
        for name, inside in stage_tensor_names(set(file_of), layout, stage, tied).items()
    }


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
    """The stage's tensors under their stage names, in `dtype`; nothing else is read. From a version held in
    part, only once every byte read is known to lie in a verified shard (EngineError naming the others)."""
    check_held(checkpoint, layout, stage, tied=tied)
    checkpoint = Path(checkpoint)
    reads = stage_reads(tensor_files(checkpoint), layout, stage, tied)
    by_file: dict[Path, list[str]] = {}
    for name, (file, _) in reads.items():
        by_file.setdefault(checkpoint / file, []).append(name)
    state: dict[str, torch.Tensor] = {}
    for path, names in sorted(by_file.items()):
        try:
            with safe_open(path, framework="pt") as handle:
                for name in names:
                    state[reads[name][1]] = handle.get_tensor(name).to(dtype)
        except (OSError, SafetensorError) as exc:
            raise EngineError(f"cannot read stage {stage}'s tensors from {path}: {exc}") from None
    return state


# ---------------------------------------------------------------------------- which shards a stage needs

MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit on its JSON header
LENGTH_BYTES = 8  # a safetensors file opens with its header's length, a little-endian u64


def safetensors_header_size(prefix: bytes, file_size: int | None = None) -> int:
    """Bytes of a safetensors file before its tensor data (8-byte length + JSON header), from its first 8 bytes;
    bounded by MAX_SAFETENSORS_HEADER and by the file's size when given."""
    if len(prefix) < LENGTH_BYTES:
        raise EngineError("a safetensors file is shorter than its 8-byte header length")
    size = int.from_bytes(prefix[:LENGTH_BYTES], "little")
    if size > MAX_SAFETENSORS_HEADER:
        raise EngineError(f"a safetensors header claims {size} bytes; at most {MAX_SAFETENSORS_HEADER}")
    if file_size is not None and LENGTH_BYTES + size > file_size:
        raise EngineError(f"a safetensors header claims {size} bytes; its file has {file_size}")
    return LENGTH_BYTES + size


def tensor_ranges(header: bytes, file_size: int | None = None) -> dict[str, tuple[int, int]]:
    """Tensor name -> [start, end) byte range in the file, from the file's header bytes (at least
    safetensors_header_size of them). The header comes from the signed checkpoint, so it is trusted for
    content, but it is parsed strictly all the same: every offset an integer, lying after the header and, when
    the file's size is given, inside the file."""
    start = safetensors_header_size(header, file_size)
    if len(header) < start:
        raise EngineError(f"{len(header)} header bytes given, the header has {start}")
    try:  # duplicate names, NaN and bad UTF-8 refused: one reading of the header, the same as safetensors'
        entries = loads_strict(bytes(header[LENGTH_BYTES:start]), "safetensors header")
    except ValueError as exc:  # WireFormatError is a ValueError
        raise EngineError(f"a safetensors header is not strict JSON: {exc}") from None
    if not isinstance(entries, dict):
        raise EngineError("a safetensors header is not a JSON object")
    limit = None if file_size is None else file_size - start
    ranges = {}
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list) or len(offsets) != 2 or not all(type(x) is int for x in offsets)  # noqa: E721 (bool is an int, and no offset)
        ):
            raise EngineError(f"tensor {name[:80]!r} has no pair of integer data offsets")
        begin, end = offsets
        if not 0 <= begin <= end or (limit is not None and end > limit):
            raise EngineError(f"tensor {name[:80]!r} has data offsets {begin}, {end} outside its file")
        ranges[name] = (start + begin, start + end)
    return ranges


def _shards_of(begin: int, end: int, shard_size: int) -> set[int]:
    """The shards holding bytes [begin, end) of the concatenated checkpoint."""
    return set(range(begin // shard_size, (end - 1) // shard_size + 1)) if end > begin else set()


def stage_shards(
    files: list[tuple[str, int]],
    shard_size: int,
    headers: dict[str, bytes],
    layout: StageLayout,
    stage: int,
    *,
    tied: bool,
    weight_map: dict[str, str] | None = None,
) -> list[int]:
    """Indices of the checkpoint's shards a stage needs: every byte of the tensors it reads (`stage_reads`, from
    the files the loader reads them from: the index's `weight_map`, or SINGLE_FILE without an index), of each
    safetensors header, and every other file whole (config, tokenizer, index). `files`: (path, size) in
    manifest order (the checkpoint is their concatenation, cut every `shard_size` bytes); `headers`: each
    .safetensors file's header bytes (its first shard holds them in practice)."""
    sizes = dict(files)
    ranges_of = {
        path: tensor_ranges(headers[path], sizes[path]) for path, _ in files if path.endswith(".safetensors")
    }
    if weight_map is None:
        if SINGLE_FILE not in ranges_of:
            raise EngineError(f"the checkpoint has neither {SINGLE_FILE} nor {INDEX_FILE}")
        weight_map = dict.fromkeys(ranges_of[SINGLE_FILE], SINGLE_FILE)
    reads = stage_reads(weight_map, layout, stage, tied)
    starts, offset = {}, 0
    for path, size in files:
        starts[path] = offset
        offset += size
    needed: list[tuple[int, int]] = []
    for path, size in files:
        if path in ranges_of:
            needed.append((starts[path], starts[path] + safetensors_header_size(headers[path])))
        elif size:
            needed.append((starts[path], starts[path] + size))
    for name, (file, _) in sorted(reads.items()):
        if name not in ranges_of.get(file, {}):
            raise EngineError(
                f"tensor {name[:80]!r} is to be read from {file[:80]!r}, whose safetensors header lacks it"
            )
        begin, end = ranges_of[file][name]
        needed.append((starts[file] + begin, starts[file] + end))
    shards: set[int] = set()
    for begin, end in needed:
        shards |= _shards_of(begin, end, shard_size)
    return sorted(shards)


# ---------------------------------------------------------------------------- fetching only a stage's shards


class StageSelection:
    """The selection plan (p2p/weights/selection.py) of a pipeline node: the shards of the stages it offers.

    Asked in rounds with the shards verified so far, it names: first every file but the safetensors files
    whole (config, tokenizer, index) and the shard(s) of each safetensors file's 8-byte header length; then,
    reading those lengths from the verified bytes (each bounded by the file's size and MAX_SAFETENSORS_HEADER),
    the shards of each header; then, parsing the headers strictly, the shards of the offered stages' tensors
    (`stage_shards`). Every answer includes the ones before, and nothing is read before it verified."""

    def __init__(self, layout: StageLayout, stages: frozenset[int]) -> None:
        bad = sorted(s for s in stages if not 0 <= s < layout.stages)
        if not stages or bad:
            raise EngineError(f"stages {sorted(stages)} are not stages of the layout {layout.boundaries}")
        self.layout = layout
        self.stages = frozenset(stages)

    def choose(self, manifest: SignedManifest, checkpoint_dir: Path, held: frozenset[int]) -> Selection:
        """The fetcher's question (p2p/weights/selection.py); PlanError when the checkpoint does not fit."""
        try:
            return self.shards_to_hold(manifest, checkpoint_dir, held)
        except EngineError as exc:
            raise PlanError(f"cannot tell which shards stages {sorted(self.stages)} need: {exc}") from None

    def shards_to_hold(
        self,
        manifest: SignedManifest,
        checkpoint_dir: Path,
        held: frozenset[int],
        *,
        tied: bool | None = None,
    ) -> Selection:
        """This round's answer given the shards `held` (verified); EngineError when the checkpoint does not fit.
        `tied`: whether the head is the embedding, as the loader is told (None: as the checkpoint's config says,
        which is what the loader is told in practice, StageModel.load)."""
        body = manifest.body
        files = [(f.path, f.size) for f in body.files]
        weights = [(path, size) for path, size in files if path.endswith(".safetensors")]
        starts, offset = {}, 0
        for path, size in files:
            starts[path] = offset
            offset += size
        wanted: set[int] = set()
        for path, size in files:
            if path.endswith(".safetensors"):
                if size < LENGTH_BYTES:
                    raise EngineError(f"{path} of step {manifest.step} has {size} bytes: no safetensors file")
                wanted |= _shards_of(starts[path], starts[path] + LENGTH_BYTES, body.shard_size)
            else:
                wanted |= _shards_of(starts[path], starts[path] + size, body.shard_size)
        if not wanted <= held:
            return Selection.of(manifest, wanted)
        header_sizes = {
            path: safetensors_header_size(_read(checkpoint_dir / path, LENGTH_BYTES), size)
            for path, size in weights
        }
        for path, length in header_sizes.items():
            wanted |= _shards_of(starts[path], starts[path] + length, body.shard_size)
        if not wanted <= held:
            return Selection.of(manifest, wanted)
        headers = {path: _read(checkpoint_dir / path, length) for path, length in header_sizes.items()}
        tied = _tied(checkpoint_dir) if tied is None else tied
        weight_map = read_weight_map(checkpoint_dir) if INDEX_FILE in starts else None
        for stage in sorted(self.stages):
            wanted.update(
                stage_shards(
                    files, body.shard_size, headers, self.layout, stage, tied=tied, weight_map=weight_map
                )
            )
        return Selection.of(manifest, wanted)


def check_held(checkpoint: Path, layout: StageLayout, stage: int, *, tied: bool | None = None) -> None:
    """Nothing when `checkpoint` is a complete version (or no store's at all); for a version held in part
    (any under the store's .partial/), EngineError naming the shards of `stage` it lacks, or saying it cannot
    tell (its journal missing or damaged), so that no stage is ever built from unfetched bytes. The shards are
    those of the (file, tensor) pairs the loader reads (`stage_reads`), with the same `tied`, round by round:
    the index and headers they are found from are read only once their own shards are known to be held."""
    try:
        held = holdings(Path(checkpoint).parent)
    except WeightsError as exc:
        raise EngineError(
            f"cannot tell which shards {checkpoint} holds, so stage {stage} is not loaded from it: {exc}"
        ) from None
    if held is None:
        return
    # One answer: shards_to_hold stops at the first round whose shards are not all held (small files and header
    # lengths, then headers), so the index and headers are read only from held shards.
    needed = StageSelection(layout, frozenset({stage})).shards_to_hold(
        held.manifest, Path(checkpoint), held.done, tied=tied
    )
    missing = held.missing(needed.shards)
    if missing:
        raise EngineError(
            f"stage {stage} needs shards {describe_shards(missing)} of checkpoint step {held.manifest.step}, "
            f"which this node did not fetch (it holds {len(held.done)} of {len(held.manifest.body.shards)}: "
            "those of the stages it offers); offer this stage to fetch them"
        )


def _read(path: Path, length: int) -> bytes:
    try:
        with open(path, "rb") as handle:
            data = handle.read(length)
    except OSError as exc:
        raise EngineError(f"cannot read {path}: {exc}") from None
    if len(data) != length:
        raise EngineError(f"{path} has {len(data)} bytes where {length} were expected")
    return data


def _tied(checkpoint_dir: Path) -> bool:
    """Whether the head is the embedding matrix, as StageModel.load reads it (transformers' config defaults)."""
    try:
        config = AutoConfig.from_pretrained(checkpoint_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot read the config of {checkpoint_dir}: {exc}") from None
    return bool(getattr(config, "tie_word_embeddings", False))
