"""Checks a node runs before it starts working, each with a clear message and advice when it fails.

They run before anything expensive so that an operator learns at once, in one readable list, what to fix:
the key file and its mode, a writable data directory, free disk for the checkpoints of the async window,
RAM, and for --gpu a CUDA device with enough memory. Whether a device is there at all is asked first, without
initialising CUDA (`check_cuda_visible`); the memory check (`check_cuda`) must run after hivemind's DHT child
process has started, because forking after CUDA is initialised is unsafe. Each checkpoint is checked again
for room on the GPU before it is loaded (`check_cuda_for_model`).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil

from ...p2p.errors import KeyFileError
from ...p2p.identity import Identity
from ..errors import NodeError
from ..runtime.disk import free_bytes

GIB = 1024**3


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    message: str
    fatal: bool = True  # a failed fatal check stops the node; a failed non-fatal one is a warning


class PreflightError(NodeError):
    """One or more fatal preflight checks failed; the message lists every one with its advice."""

    def __init__(self, failures: list[CheckResult]) -> None:
        lines = "\n".join(f"  - {f.name}: {f.message}" for f in failures)
        super().__init__(f"the node cannot start:\n{lines}")
        self.failures = failures


def check_key(key_path: Path) -> CheckResult:
    try:
        ident = Identity.load(key_path)
    except KeyFileError as exc:
        return CheckResult("key file", False, str(exc))
    return CheckResult("key file", True, f"{key_path} (node id {ident.node_id[:16]}…)")


def check_data_dir(data_dir: Path) -> CheckResult:
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=data_dir, prefix=".write-test-"):
            pass
    except OSError as exc:
        return CheckResult(
            "data directory",
            False,
            f"{data_dir} is not writable ({exc.strerror}); choose another with --data-dir",
        )
    return CheckResult("data directory", True, str(data_dir))


def check_disk(data_dir: Path, needed_bytes: int) -> CheckResult:
    free = free_bytes(data_dir)
    if free < needed_bytes:
        return CheckResult(
            "free disk",
            False,
            f"{free / GIB:.1f} GiB free in {data_dir}, {needed_bytes / GIB:.1f} GiB needed for the checkpoints of the "
            "async window; free space or point --data-dir at a larger disk",
        )
    return CheckResult("free disk", True, f"{free / GIB:.1f} GiB free")


def check_memory(needed_bytes: int) -> CheckResult:
    available = psutil.virtual_memory().available
    if available < needed_bytes:
        return CheckResult(
            "memory",
            False,
            f"{available / GIB:.1f} GiB RAM available, {needed_bytes / GIB:.1f} GiB needed; close other programs",
        )
    return CheckResult("memory", True, f"{available / GIB:.1f} GiB available")


def check_cuda_visible() -> CheckResult:
    """For --gpu, before anything starts: a CUDA build of torch and a visible device, without initialising CUDA.

    With PYTORCH_NVML_BASED_CUDA_CHECK=1, torch answers is_available() from NVML, which is fork-safe (the
    DHT's child process is forked after this); the memory check (`check_cuda`) comes after that fork.
    """
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    if not torch.backends.cuda.is_built():
        return CheckResult(
            "cuda",
            False,
            f"--gpu was given but this torch ({torch.__version__}) is built without CUDA; install a "
            "CUDA build of torch, or start without --gpu to generate on the CPU",
        )
    if not torch.cuda.is_available():
        return CheckResult(
            "cuda",
            False,
            "--gpu was given but no CUDA device is visible (check the driver, CUDA_VISIBLE_DEVICES), "
            "or start without --gpu to generate on the CPU",
        )
    return CheckResult("cuda", True, "a CUDA device is visible")


def check_cuda(needed_bytes: int) -> CheckResult:
    """For --gpu: a CUDA device with enough free memory. Call only after the DHT child process started."""
    import torch

    if not torch.cuda.is_available():
        return CheckResult(
            "cuda",
            False,
            "--gpu was given but no CUDA device is visible (check the driver, CUDA_VISIBLE_DEVICES)",
        )
    free, total = torch.cuda.mem_get_info()
    name = torch.cuda.get_device_name()
    if free < needed_bytes:
        return CheckResult(
            "cuda",
            False,
            f"{name} has {free / GIB:.1f} GiB free of {total / GIB:.1f}, {needed_bytes / GIB:.1f} GiB needed",
        )
    return CheckResult("cuda", True, f"{name}, {free / GIB:.1f} GiB free")


def model_gpu_bytes(model_dir: Path) -> int:
    """GPU memory a checkpoint needs: its weight files plus a quarter for activations and the KV cache.

    The files' size is the weights' size in their stored dtype (an upper bound when the engine loads a
    float32 checkpoint in bfloat16), which keeps the check simple and on the safe side.
    """
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    return weights + weights // 4


def check_cuda_for_model(model_dir: Path, min_bytes: int) -> CheckResult:
    """Before a checkpoint is loaded on CUDA: enough free GPU memory for it (and at least `min_bytes`)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the previous model's cached blocks are free for the next one
    result = check_cuda(max(min_bytes, model_gpu_bytes(model_dir)))
    if result.ok:
        return result
    return CheckResult(
        "cuda",
        False,
        f"the checkpoint in {model_dir} does not fit: {result.message}; "
        "free GPU memory (other processes?) or run without --gpu",
    )


def run_checks(checks: list[CheckResult]) -> list[CheckResult]:
    """Raise PreflightError listing every fatal failure; return the results for logging otherwise."""
    failures = [c for c in checks if not c.ok and c.fatal]
    if failures:
        raise PreflightError(failures)
    return checks


def directory_size(path: Path) -> int:
    """Bytes under `path` (used to size the disk check from a checkpoint already on disk)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if os.path.isdir(path) else 0
