"""Free disk space where a command is about to write, asked before the work that produces the bytes.

`prime-node model init` used to train for minutes and then die inside safetensors on a full disk; a
contributor used to find out while downloading a checkpoint. Both now ask here first.
"""

from __future__ import annotations

from pathlib import Path

import psutil

MIB = 1024**2


def existing_ancestor(path: Path) -> Path:
    """`path` or its nearest existing parent: the file system a directory not yet made will live on."""
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged process can still write on the file system of `path` (made or not)."""
    return int(psutil.disk_usage(str(existing_ancestor(path))).free)


def describe(size: int) -> str:
    """A size for a message: MiB below a GiB, GiB above."""
    return f"{size / MIB:.1f} MiB" if size < 1024 * MIB else f"{size / (1024 * MIB):.1f} GiB"
