"""Publishing: copy a checkpoint directory into a store, cut it into shards, hash, sign the manifest.

One read of every byte: each chunk is written to the staging copy and fed to its file's SHA-256 on
this thread, while completed shards are hashed on a thread pool (hashlib releases the GIL), so shard
hashing uses the other cores instead of doubling the time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from pydantic import ValidationError

from ..identity import Identity
from .errors import PublishError, StoreError
from .manifest import (
    FORMAT,
    FORMAT_VERSION,
    MAX_FILES,
    FileEntry,
    ManifestBody,
    ShardEntry,
    SignedManifest,
    check_relative_path,
    checkpoint_digest,
    sign_manifest,
)
from .store import MANIFEST_NAME, PARTIAL, Store, checkpoint_dir_in, version_name, write_atomic

logger = logging.getLogger(__name__)

DEFAULT_SHARD_SIZE = 16 << 20
CHUNK = 4 << 20


def _kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: Path, kind: str) -> PublishError:
    return PublishError(
        f"{path} is {kind}; only regular files inside the checkpoint directory are published "
        "(copy the file itself in, e.g. with cp -L, or move it out of the directory)"
    )


def _walk_error(exc: OSError) -> None:
    # os.walk skips a directory it cannot read unless told otherwise: that would publish a partial checkpoint.
    raise PublishError(f"cannot read {exc.filename}: {exc.strerror}") from None


def list_checkpoint_files(ckpt_dir: Path) -> list[tuple[str, Path]]:
    """(relative POSIX path, absolute path) of every regular file, sorted; hidden entries are skipped.

    Only what the operator put in the directory is published: a symbolic link (to a file or a directory,
    inside or outside), a FIFO, a socket or a device anywhere below it is refused, naming it. The directory
    itself may be given through a link (e.g. a `latest` link to the newest checkpoint).
    """
    ckpt_dir = Path(ckpt_dir).expanduser().resolve()
    if not ckpt_dir.is_dir():
        raise PublishError(f"checkpoint directory {ckpt_dir} does not exist or is not a directory")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(ckpt_dir, followlinks=False, onerror=_walk_error):
        kept = []
        for name in sorted(dirnames):  # os.walk lists a link to a directory here, and would skip it silently
            if name.startswith("."):
                continue
            path = Path(dirpath) / name
            mode = os.lstat(path).st_mode
            if not stat.S_ISDIR(mode):
                raise _refuse(path, _kind_of(mode))
            kept.append(name)
        dirnames[:] = kept
        for name in filenames:
            if name.startswith("."):
                continue
            path = Path(dirpath) / name
            mode = os.lstat(path).st_mode
            if not stat.S_ISREG(mode):
                raise _refuse(path, _kind_of(mode))
            rel = path.relative_to(ckpt_dir).as_posix()
            try:
                check_relative_path(rel)
            except ValueError as exc:
                raise PublishError(f"cannot publish {path}: {exc}; rename the file") from None
            found.append((rel, path))
    if not found:
        raise PublishError(f"checkpoint directory {ckpt_dir} holds no files")
    if len(found) > MAX_FILES:
        raise PublishError(
            f"checkpoint directory {ckpt_dir} holds {len(found)} files, over the {MAX_FILES} limit"
        )
    return sorted(found)


def _open_inside(root: Path, rel: str) -> tuple[int, os.stat_result]:
    """Open root/rel for reading without following a link at any step; the fd and its stat.

    Listing and opening are two moments: a file or a directory swapped for a link (or a FIFO) in between
    is refused here rather than followed. O_NONBLOCK: opening a FIFO would otherwise wait for a writer.
    """
    parts = rel.split("/")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            try:
                next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                raise _refuse(
                    root / rel, f"under {part!r}, no longer a plain directory ({exc.strerror})"
                ) from None
            os.close(fd)
            fd = next_fd
        try:
            file_fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError as exc:
            raise _refuse(root / rel, f"no longer a regular file ({exc.strerror})") from None
    finally:
        os.close(fd)
    info = os.fstat(file_fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(file_fd)
        raise _refuse(root / rel, _kind_of(info.st_mode))
    return file_fd, info


def published_mode(source_mode: int) -> int:
    """Permissions of a published copy: the source's, less any execute or group/other write bit (at most 0644).

    A copy is never more open than its source: a 0600 file stays 0600 (readable by the server, which runs as
    the same user). Serving it still publishes its bytes to every fetcher: that is what putting it in the
    checkpoint directory means, so keep secrets out of it.
    """
    return stat.S_IMODE(source_mode) & 0o644


def _sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _ShardHasher:
    """Cuts the concatenated stream into fixed-size shards and hashes each one on a pool."""

    def __init__(self, shard_size: int, pool: ThreadPoolExecutor, max_in_flight: int) -> None:
        self.shard_size = shard_size
        self.pool = pool
        self.max_in_flight = max_in_flight
        self.buffer = bytearray()
        self.futures: list[tuple[int, Future[str]]] = []

    def feed(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self.shard_size - len(self.buffer))
            self.buffer += data[:take]
            data = data[take:]
            if len(self.buffer) == self.shard_size:
                self._submit()

    def _submit(self) -> None:
        chunk = bytes(self.buffer)
        self.buffer = bytearray()
        self.futures.append((len(chunk), self.pool.submit(_sha256_hex, chunk)))
        pending = [f for _, f in self.futures if not f.done()]
        if len(pending) > self.max_in_flight:  # bound memory: wait for the oldest shard buffers
            pending[0].result()

    def finish(self) -> list[ShardEntry]:
        if self.buffer:
            self._submit()
        return [ShardEntry(size=size, sha256=f.result()) for size, f in self.futures]


def _body(**fields: object) -> ManifestBody:
    try:
        return ManifestBody(**fields)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise PublishError(f"cannot build the manifest: {exc.errors()[0]['msg']}") from None


def publish(
    ckpt_dir: Path,
    *,
    step: int,
    identity: Identity,
    out_dir: Path,
    shard_size: int = DEFAULT_SHARD_SIZE,
    run_id: str = "default",
    workers: int | None = None,
) -> tuple[SignedManifest, Path]:
    """Copy `ckpt_dir` into the store at `out_dir` as version `step`, signed by `identity`."""
    store = Store(out_dir)
    if step <= store.high_water():
        raise StoreError(
            f"{store.root} already holds step {store.high_water()}; publish a newer step (steps only go forward)"
        )
    files = list_checkpoint_files(ckpt_dir)
    root = Path(ckpt_dir).expanduser().resolve()
    total = sum(os.lstat(path).st_size for _, path in files)
    if total == 0:
        raise PublishError(f"checkpoint directory {ckpt_dir} holds only empty files")
    store.ensure_free_space(total)
    staging = store.root / PARTIAL / f"publish-{version_name(step)}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    entries: list[FileEntry] = []
    workers = workers or max(1, (os.cpu_count() or 2))
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="publish-hash") as pool:
            shards = _ShardHasher(shard_size, pool, max_in_flight=workers * 2)
            for rel, _ in files:
                dest = checkpoint_dir_in(staging) / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                file_hash, size = hashlib.sha256(), 0
                src_fd, info = _open_inside(root, rel)
                with open(src_fd, "rb") as fin:
                    os.set_blocking(src_fd, True)
                    dest_fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                    with open(dest_fd, "wb") as fout:
                        os.fchmod(dest_fd, published_mode(info.st_mode))  # explicit: not left to the umask
                        while block := fin.read(CHUNK):
                            view = memoryview(block)
                            file_hash.update(view)
                            shards.feed(view)
                            fout.write(view)
                            size += len(view)
                entries.append(FileEntry(path=rel, size=size, sha256=file_hash.hexdigest()))
            shard_entries = shards.finish()
        body = _body(
            format=FORMAT,
            format_version=FORMAT_VERSION,
            run_id=run_id,
            step=step,
            created_at=int(time.time()),
            signer=identity.node_id,
            shard_size=shard_size,
            total_size=sum(e.size for e in entries),
            checkpoint_sha256=checkpoint_digest([s.sha256 for s in shard_entries]),
            files=entries,
            shards=shard_entries,
        )
        manifest = sign_manifest(body, identity)
        write_atomic(staging / MANIFEST_NAME, manifest.to_bytes())
        final = store.install(staging, step)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info(
        "published step %d: %d files, %d shards, %d bytes -> %s",
        step,
        len(entries),
        len(shard_entries),
        body.total_size,
        final,
    )
    return manifest, final
