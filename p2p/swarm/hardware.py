"""What a node says about itself in its heartbeat: software version and hardware (from psutil)."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

import psutil

from .records import Hardware


def software_version() -> str:
    try:
        return version("prime-node")[:64]
    except PackageNotFoundError:
        return "0.0.0+unknown"


def _cpu_model() -> str:
    """The CPU's model name. psutil has no call for it; the kernel's /proc/cpuinfo (Linux) or the platform's
    processor string elsewhere. Missing, the heartbeat carries less detail, nothing more."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def local_hardware(gpu_model: str | None = None, gpu_memory_mb: int = 0) -> Hardware:
    """CPU and RAM of this machine; the GPU is passed in by the caller (probing it here would initialise CUDA)."""
    # Names from the driver and the kernel are shown to peers, who refuse control characters: `outgoing` makes
    # them printable and short enough (p2p/wire.py FreeText).
    return Hardware.outgoing(
        gpu_model=gpu_model,
        gpu_memory_mb=gpu_memory_mb,
        cpu=_cpu_model(),
        cpu_cores=psutil.cpu_count(logical=True) or 0,
        ram_mb=psutil.virtual_memory().total // (1024 * 1024),
    )
