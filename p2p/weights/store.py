"""The on-disk store of checkpoint versions, shared by publishers, servers, relays and fetchers.

    ROOT/step-<12 digits>/manifest.json          a complete, verified version
    ROOT/step-<12 digits>/checkpoint/<files>     ... its files, loadable as an HF directory
    ROOT/.partial/step-<12 digits>/              a version being assembled (same layout + progress.json)
    ROOT/high-water.json                          the highest step ever completed (replay protection)

Partial data lives only under .partial/ and a version appears at its final path by one atomic rename of
its directory, so a reader never sees a half-written checkpoint. A version fetched only in part (a pipeline
stage's shards, selection.py) stays under .partial/ with its progress.json until its owner deletes it (a node's
keeper, below the async window): `versions()` never lists it, `whole_checkpoint_dir` refuses it naming the
shards it lacks, and only a loader that checks the shards it reads against `holdings` (node/pipeline/weights.py)
reads its files. progress.json records which shards are
verified and how many bytes of unfinished shards are on disk and which source sent them, so a rerun after
kill -9 resumes with Range requests (from that same source only). Every call here blocks on disk; async
callers run them in a thread.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import P2PError
from ..wire import WireFormatError, parse_uint
from .errors import IncompleteVersion, ReplayError, StoreError
from .manifest import SignedManifest, parse_signed
from .selection import describe_shards

logger = logging.getLogger(__name__)

PARTIAL = ".partial"
MANIFEST_NAME = "manifest.json"
PROGRESS_NAME = "progress.json"
CHECKPOINT_NAME = "checkpoint"
HIGH_WATER_NAME = "high-water.json"
_VERSION_PREFIX = "step-"
_STEP_DIGITS = 12
FREE_DISK_MARGIN = 64 << 20  # keep some slack so that the store never fills the disk to the last byte


def version_name(step: int) -> str:
    return f"{_VERSION_PREFIX}{step:0{_STEP_DIGITS}d}"


def step_of(name: str) -> int | None:
    """The step a version directory's name says (`step-` and exactly 12 ASCII digits), None for any other."""
    if not name.startswith(_VERSION_PREFIX):
        return None
    try:
        return parse_uint(
            name[len(_VERSION_PREFIX) :],
            "version directory",
            maximum=10**_STEP_DIGITS - 1,
            width=_STEP_DIGITS,
        )
    except WireFormatError:
        return None


def checkpoint_dir_in(version_dir: Path) -> Path:
    """The loadable HF directory of a version, complete or partial: the one place that layout is spelled."""
    return version_dir / CHECKPOINT_NAME


def write_atomic(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Write a small file so that readers see the old or the new content, never a mix; `durable`: the content
    and the rename are fsync'ed, so that a crash leaves the new content, not an empty or a missing file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make the renames inside `directory` survive a crash."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@dataclass(frozen=True)
class Holdings:
    """The verified shards of a version held in part (its directory under .partial/), as its journal says."""

    manifest: SignedManifest
    done: frozenset[int]

    def missing(self, needed: set[int] | frozenset[int]) -> list[int]:
        return sorted(set(needed) - self.done)


def holdings(version_dir: Path) -> Holdings | None:
    """What a version directory holds: None for a complete version (any directory not under .partial/); for a
    partial one (its parent is .partial/, symlinks resolved), the shards its journal lists as verified.

    Partial is decided by the path, never by the journal's presence: a partial version whose progress.json is
    missing or unreadable, or whose manifest is damaged, is StoreError naming it, so that no reader takes its
    sparse files for a whole checkpoint. The files are our own: the manifest was verified when it was fetched
    and is read against the signer it names, as `Store.load_manifest` does for an origin."""
    version_dir = Path(version_dir).resolve()
    if version_dir.parent.name != PARTIAL:
        return None
    manifest = _partial_manifest(version_dir)
    try:
        journal = (version_dir / PROGRESS_NAME).read_bytes()
    except FileNotFoundError:
        raise StoreError(
            f"{version_dir} is a partial version of step {manifest.step} without its journal {PROGRESS_NAME}: "
            "which of its shards verified is unknown; fetch it again"
        ) from None
    except OSError as exc:
        raise StoreError(f"cannot read {version_dir / PROGRESS_NAME}: {exc}") from None
    return Holdings(manifest, _journaled_shards(version_dir, manifest, journal))


def _partial_manifest(version_dir: Path) -> SignedManifest:
    path = version_dir / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise StoreError(f"cannot read the manifest of the partial version {version_dir}: {exc}") from None
    try:
        return parse_signed(raw, _claimed_signer(raw))
    except P2PError as exc:  # a damaged signer is a SignatureError, which is no WeightsError
        raise StoreError(f"{path} does not verify: {exc}") from None


def _journaled_shards(version_dir: Path, manifest: SignedManifest, journal: bytes) -> frozenset[int]:
    shards = manifest.body.shards
    held: set[int] = set()
    try:
        state = json.loads(journal)
        if state.get("manifest") == manifest.digest:
            for key, digest in dict(state.get("done", {})).items():
                index = parse_uint(key, "shard index", maximum=len(shards) - 1)
                if digest == shards[index].sha256:
                    held.add(index)
    except (ValueError, TypeError, AttributeError) as exc:  # WireFormatError is a ValueError
        raise StoreError(f"{version_dir / PROGRESS_NAME} is malformed: {exc}") from None
    return frozenset(held)


@dataclass
class ShardProgress:
    """Bytes of an unfinished shard already on disk, and the one source that sent every one of them.

    A shard is resumed only from the source that wrote its prefix (attempts.py): bytes of one source are never
    completed by another's, so a source that sends garbage and hangs up poisons no one else's download, and a
    digest mismatch on a resumed shard is all one source's doing (or, for a prefix from an earlier run, our
    disk's)."""

    done_bytes: int = 0
    writer: str | None = None  # the source URL that sent bytes [0, done_bytes); None: nobody may resume it
    journaled: bool = False  # the prefix comes from an earlier run's journal (not attributable to anyone)


class PartialVersion:
    """A version being assembled under ROOT/.partial/: preallocated files written shard by shard."""

    def __init__(self, directory: Path, manifest: SignedManifest) -> None:
        self.directory = directory
        self.manifest = manifest
        self.done: dict[int, str] = {}  # shard index -> hex digest computed from the bytes we received
        self.progress: dict[int, ShardProgress] = {}
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def checkpoint_dir(self) -> Path:
        return checkpoint_dir_in(self.directory)

    def file_path(self, file_index: int) -> Path:
        return self.checkpoint_dir / self.manifest.body.files[file_index].path

    def prepare(self) -> None:
        """Create the directory and sparse files of the right sizes, and load progress from a previous run."""
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.directory / MANIFEST_NAME, self.manifest.to_bytes())
        for index, entry in enumerate(self.manifest.body.files):
            path = self.file_path(index)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            if os.fstat(fd).st_size != entry.size:
                os.ftruncate(fd, entry.size)
            self._fds[index] = fd
        self._load_progress()

    def _load_progress(self) -> None:
        path = self.directory / PROGRESS_NAME
        try:
            state = json.loads(path.read_bytes())
        except FileNotFoundError:
            return
        except ValueError:
            logger.warning("ignoring unreadable %s; the version is fetched from scratch", path)
            return
        if not isinstance(state, dict) or state.get("manifest") != self.manifest.digest:
            return  # progress of another manifest for the same step: nothing of it can be trusted
        try:
            self._apply_progress(state)
        except (ValueError, TypeError, AttributeError):
            logger.warning("ignoring malformed %s; the version is fetched from scratch", path)
            self.done.clear()
            self.progress.clear()

    def _apply_progress(self, state: dict[str, object]) -> None:
        shards = self.manifest.body.shards
        last = len(shards) - 1
        for key, digest in dict(state.get("done", {})).items():  # type: ignore[call-overload]
            index = parse_uint(key, "shard index", maximum=last)
            if digest == shards[index].sha256:
                self.done[index] = digest
        for key, entry in dict(state.get("partial", {})).items():  # type: ignore[call-overload]
            index = parse_uint(key, "shard index", maximum=last)
            done_bytes = entry.get("bytes", 0)
            writer = entry.get("writer")
            if (
                index not in self.done
                and isinstance(done_bytes, int)
                and 0 < done_bytes < shards[index].size
                and isinstance(writer, str)
            ):
                self.progress[index] = ShardProgress(done_bytes, writer, journaled=True)

    def progress_snapshot(self) -> bytes:
        """The resume journal as bytes; taken on the thread that mutates `done` and `progress` (the event loop)."""
        state = {
            "manifest": self.manifest.digest,
            "done": {str(i): d for i, d in self.done.items()},
            "partial": {
                str(i): {"bytes": p.done_bytes, "writer": p.writer}
                for i, p in self.progress.items()
                if p.done_bytes > 0 and p.writer is not None
            },
        }
        return json.dumps(state).encode()

    def write_progress(self, snapshot: bytes, *, durable: bool = False) -> None:
        """Replace the journal; `durable`: it and its rename reach the disk before this returns (the journal
        that says which shards a version held in part holds, for good)."""
        with self._lock:  # journal writes from two threads must not interleave their temp files
            write_atomic(self.directory / PROGRESS_NAME, snapshot, durable=durable)

    def write(self, index: int, shard_offset: int, data: bytes | memoryview) -> None:
        """Write `data` at `shard_offset` inside shard `index`, across file boundaries."""
        view = memoryview(data)
        end = shard_offset + len(view)
        for seg in self.manifest.segments(index):
            lo, hi = max(shard_offset, seg.shard_offset), min(end, seg.shard_offset + seg.length)
            if lo < hi:
                piece = view[lo - shard_offset : hi - shard_offset]
                os.pwrite(self._fds[seg.file_index], piece, seg.file_offset + (lo - seg.shard_offset))

    def read(self, index: int, start: int, length: int) -> bytes:
        return read_shard_range(self.manifest, self._fds.__getitem__, index, start, length)

    def fsync(self) -> None:
        for fd in self._fds.values():
            os.fsync(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def read_shard_range(manifest: SignedManifest, fd_of: object, index: int, start: int, length: int) -> bytes:
    """Read bytes [start, start+length) of shard `index` through `fd_of(file_index) -> fd`."""
    parts: list[bytes] = []
    end = start + length
    for seg in manifest.segments(index):
        lo, hi = max(start, seg.shard_offset), min(end, seg.shard_offset + seg.length)
        if lo < hi:
            parts.append(os.pread(fd_of(seg.file_index), hi - lo, seg.file_offset + (lo - seg.shard_offset)))  # type: ignore[operator]
    return b"".join(parts)


class Store:
    """Versions under one root directory; see the module docstring for the layout."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser().resolve()

    def version_dir(self, step: int) -> Path:
        return self.root / version_name(step)

    def partial_dir(self, step: int) -> Path:
        return self.root / PARTIAL / version_name(step)

    def checkpoint_dir(self, step: int, *, partial: bool = False) -> Path:
        """Where version `step`'s checkpoint files lie (loadable once the version is complete)."""
        return checkpoint_dir_in(self.partial_dir(step) if partial else self.version_dir(step))

    def versions(self) -> list[int]:
        """Steps of the complete versions, oldest first."""
        if not self.root.is_dir():
            return []
        steps = []
        for entry in self.root.iterdir():
            step = step_of(entry.name)
            if step is not None and (entry / MANIFEST_NAME).is_file():
                steps.append(step)
        return sorted(steps)

    def partial_versions(self) -> list[int]:
        base = self.root / PARTIAL
        if not base.is_dir():
            return []
        return sorted(step for e in base.iterdir() if (step := step_of(e.name)) is not None)

    def manifest_bytes(self, step: int, *, partial: bool = False) -> bytes:
        directory = self.partial_dir(step) if partial else self.version_dir(step)
        return (directory / MANIFEST_NAME).read_bytes()

    def load_manifest(self, step: int, trusted_key: str | None, *, partial: bool = False) -> SignedManifest:
        """Read and re-verify a stored manifest (against its own signer when no key is pinned: an origin)."""
        raw = self.manifest_bytes(step, partial=partial)
        key = trusted_key or _claimed_signer(raw)
        manifest = parse_signed(raw, key)
        if manifest.step != step:
            raise StoreError(f"{self.version_dir(step)} holds a manifest for step {manifest.step}; remove it")
        return manifest

    def high_water(self) -> int:
        """The highest step ever completed here; manifests for older steps are refused."""
        steps = self.versions()
        best = steps[-1] if steps else -1
        try:
            recorded = json.loads((self.root / HIGH_WATER_NAME).read_bytes()).get("step", -1)
            best = max(best, int(recorded))
        except (FileNotFoundError, ValueError, AttributeError, TypeError):
            pass
        return best

    def check_not_replayed(self, manifest: SignedManifest) -> None:
        high = self.high_water()
        if manifest.step < high:
            raise ReplayError(
                f"manifest for step {manifest.step} is older than step {high} already held in {self.root}: "
                "refusing a replayed or rolled-back checkpoint"
            )

    def ensure_free_space(self, needed: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.root).free
        if free < needed + FREE_DISK_MARGIN:
            raise StoreError(
                f"not enough free disk in {self.root}: the checkpoint needs {needed / 2**20:.1f} MiB more "
                f"(plus a {FREE_DISK_MARGIN >> 20} MiB margin) and {free / 2**20:.1f} MiB are free; "
                "free some space or pass another --out"
            )

    def holdings(self, step: int) -> Holdings | None:
        """The verified shards of `step` held in part: None when no partial version of it is here, none when
        its fetch stopped before the first journal write (it has a manifest, no progress.json yet); StoreError
        when it cannot be read (`holdings`)."""
        directory = self.partial_dir(step)
        if not (directory / MANIFEST_NAME).is_file():
            return None
        if not (directory / PROGRESS_NAME).exists():
            return Holdings(_partial_manifest(directory), frozenset())
        return holdings(directory)

    def whole_checkpoint_dir(self, step: int) -> Path:
        """The checkpoint of complete version `step`, for a monolithic load; IncompleteVersion, naming the shards
        it lacks, when only part of it is held (a pipeline stage's shards), StoreError when none of it is."""
        if (self.version_dir(step) / MANIFEST_NAME).is_file():
            return self.checkpoint_dir(step)
        held = self.holdings(step)
        if held is None:
            raise StoreError(f"{self.root} holds no checkpoint step {step}")
        count = len(held.manifest.body.shards)
        missing = held.missing(frozenset(range(count)))
        raise IncompleteVersion(
            f"checkpoint step {step} is held only in part ({len(held.done)} of {count} shards: a pipeline "
            f"stage's, or a fetch not finished): shards {describe_shards(missing)} were never fetched, so it "
            "cannot be loaded as one model; fetch it whole first",
            missing,
        )

    def note_held(self, step: int) -> None:
        """Record `step` as held (in part) for replay protection, as `install` does for a complete version."""
        self._raise_high_water(step)

    def _raise_high_water(self, step: int) -> None:
        high = max(step, self.high_water())  # recorded so that deleting versions never re-opens old steps
        write_atomic(self.root / HIGH_WATER_NAME, json.dumps({"step": high, "at": int(time.time())}).encode())

    def open_partial(self, manifest: SignedManifest) -> PartialVersion:
        directory = self.partial_dir(manifest.step)
        partial = PartialVersion(directory, manifest)
        partial.prepare()
        return partial

    def finalize(self, partial: PartialVersion, *, durable: bool = True) -> Path:
        """Move a fully verified partial version into place atomically and record the high-water mark."""
        if durable:
            partial.fsync()
        partial.close()
        (partial.directory / PROGRESS_NAME).unlink(missing_ok=True)
        return self.install(partial.directory, partial.manifest.step, durable=durable)

    def install(self, staging: Path, step: int, *, durable: bool = True) -> Path:
        """Rename a complete staging directory to its version path (atomic on one filesystem)."""
        final = self.version_dir(step)
        if final.exists():
            raise StoreError(f"{final} already exists; remove it to store step {step} again")
        os.replace(staging, final)
        if durable:
            fsync_dir(self.root)  # the rename itself must survive a crash
        self._raise_high_water(step)
        return final

    def discard_partial(self, step: int) -> None:
        shutil.rmtree(self.partial_dir(step), ignore_errors=True)

    def prune(self, keep: int) -> list[int]:
        """Delete complete versions beyond the newest `keep`, and partials older than the newest complete one."""
        steps = self.versions()
        removed = steps[:-keep] if keep > 0 and len(steps) > keep else []
        for step in removed:
            # Rename first so that a crash mid-delete never leaves a half-deleted directory at a version path.
            doomed = self.root / PARTIAL / f"deleting-{version_name(step)}-{os.getpid()}"
            doomed.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.version_dir(step), doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        newest = steps[-1] if steps else -1
        for step in self.partial_versions():
            if step < newest:
                self.discard_partial(step)
        if removed:
            logger.info("removed old versions %s from %s (keeping %d)", removed, self.root, keep)
        return removed


def _claimed_signer(raw: bytes) -> str:
    try:
        signer = json.loads(raw)["body"]["signer"]
    except (ValueError, KeyError, TypeError):
        signer = None
    if not isinstance(signer, str):
        raise StoreError("stored manifest has no signer field; it was not written by prime-node")
    return signer
