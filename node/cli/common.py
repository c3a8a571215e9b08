"""Pieces every command shares: JSON output and the life of a long-running service (the flags and the
settings they load: flags.py)."""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ..errors import NodeError
from ..runtime.supervisor import Supervisor


class ModelDirError(NodeError):
    """A flag names no HF model directory: said before anything loads (transformers would read the path
    as a hub repo id and answer about that)."""


def model_dir(path: Path, flag: str) -> Path:
    """`path` if it is a local HF model directory (it has config.json); ModelDirError naming `flag` if not."""
    path = Path(path).expanduser()
    advice = "give an HF model directory (config.json, *.safetensors, tokenizer files), e.g. one made by "
    advice += "`prime-node model init --out DIR`"
    if not path.exists():
        raise ModelDirError(f"{flag} {path}: no such directory; {advice}")
    if not path.is_dir():
        raise ModelDirError(f"{flag} {path}: a file, not a directory; {advice}")
    if not (path / "config.json").is_file():
        raise ModelDirError(f"{flag} {path}: not an HF model directory (no config.json); {advice}")
    return path


def print_json(payload: Any) -> None:
    json.dump(payload, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


async def run_until_stopped(
    name: str, start: Callable[[Supervisor], Awaitable[str]], shutdown_s: float
) -> int:
    """Run a long-lived service under one Supervisor: start it, print its ready line, wait for SIGINT, SIGTERM
    or a crashed task, then shut down within `shutdown_s`. Exit code 0 only after a clean shutdown."""
    supervisor = Supervisor(name)
    supervisor.install_signal_handlers()
    try:
        ready_line = await start(supervisor)
        print(ready_line, flush=True)
        await supervisor.wait()
    finally:
        report = await supervisor.shutdown(shutdown_s)
        for step, error in report.errors:
            print(f"shutdown: {step}: {error}", file=sys.stderr)
    return 0 if report.clean else 1
