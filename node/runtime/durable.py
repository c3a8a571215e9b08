"""Durability helpers: make a rename or a write survive a power cut, not only a process crash.

os.replace is atomic, but neither the file's data nor the directory entry is on disk until fsync'ed;
every component that promises "acknowledged means kept" (the outbox, the validator's spool, the
trainer's checkpoints) uses these.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file's data or a directory's entries (open read-only works for both on Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file below `path`, then `path` itself."""
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            fsync_path(p)
    fsync_path(path)
