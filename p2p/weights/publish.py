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
from .store import CHECKPOINT_NAME, MANIFEST_NAME, PARTIAL, Store, version_name, write_atomic

logger = logging.getLogger(__name__)

DEFAULT_SHARD_SIZE = 16 << 20
CHUNK = 4 << 20


def list_checkpoint_files(ckpt_dir: Path) -> list[tuple[str, Path]]:
    """(relative POSIX path, absolute path) of every regular file, sorted; hidden entries are skipped."""
    ckpt_dir = Path(ckpt_dir).expanduser().resolve()
    if not ckpt_dir.is_dir():
        raise PublishError(f"checkpoint directory {ckpt_dir} does not exist or is not a directory")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(ckpt_dir, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if name.startswith("."):
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(ckpt_dir).as_posix()
            if not path.is_file():
                raise PublishError(f"{path} is not a regular file (or a link to one); only regular files are published")
            try:
                check_relative_path(rel)
            except ValueError as exc:
                raise PublishError(f"cannot publish {path}: {exc}; rename the file") from None
            found.append((rel, path))
    if not found:
        raise PublishError(f"checkpoint directory {ckpt_dir} holds no files")
    if len(found) > MAX_FILES:
        raise PublishError(f"checkpoint directory {ckpt_dir} holds {len(found)} files, over the {MAX_FILES} limit")
    return sorted(found)


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
        self.futures.append((len(chunk), self.pool.submit(lambda b=chunk: hashlib.sha256(b).hexdigest())))
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
    total = sum(path.stat().st_size for _, path in files)
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
            for rel, src in files:
                dest = staging / CHECKPOINT_NAME / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                file_hash, size = hashlib.sha256(), 0
                with open(src, "rb") as fin, open(dest, "wb") as fout:
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
    logger.info("published step %d: %d files, %d shards, %d bytes -> %s", step, len(entries), len(shard_entries), body.total_size, final)
    return manifest, final
