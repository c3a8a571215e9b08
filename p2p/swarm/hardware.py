"""What a node says about itself in its heartbeat: software version and hardware (read from /proc)."""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .records import Hardware


def software_version() -> str:
    try:
        return version("prime-node")[:64]
    except PackageNotFoundError:
        return "0.0.0+unknown"


def local_hardware(gpu_model: str | None = None, gpu_memory_mb: int = 0) -> Hardware:
    """CPU and RAM from /proc; the GPU is passed in by the caller (probing it here would initialise CUDA)."""
    cpu, ram_mb = "", 0
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "")
        ram_mb = next((int(ln.split()[1]) // 1024 for ln in meminfo if ln.startswith("MemTotal")), 0)
    except (OSError, ValueError, IndexError):
        pass  # not Linux, or an unusual /proc: the heartbeat just carries less detail
    # Names from the driver and /proc are shown to peers, who refuse control characters: `outgoing` makes
    # them printable and short enough (p2p/wire.py FreeText).
    return Hardware.outgoing(
        gpu_model=gpu_model,
        gpu_memory_mb=gpu_memory_mb,
        cpu=cpu,
        cpu_cores=os.cpu_count() or 0,
        ram_mb=ram_mb,
    )
