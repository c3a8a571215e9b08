"""Pinned CPU kernels: the same seed should give the same weights on every x86-64 machine, not only on one.

torch picks its vectorised CPU kernels (softmax, layer norms, element-wise ops, reductions) for the best
instruction set the processor has (ATen's "CPU capability": AVX-512, AVX2 or scalar). The kernels round
differently, and a few hundred steps of training amplify a last-bit difference into another model: the
300-step arithmetic warm start of benchmarks/learning.py, seed 0, one thread, on one AMD EPYC, gives 23.3%
held-out accuracy with the AVX-512 kernels, 30.1% with the AVX2 ones and 22.8% with the scalar ones
(docs/trainer.md, "Reproducing the figures"). Thread counts, by contrast, made no difference at this model
size (1 and 2 threads: the same bytes).

So long runs whose figures are published pin the kernels to AVX2, which every x86-64 processor of the last
decade has, and MKL's own dispatch to its conditional-numerical-reproducibility AVX2 path. Both are read
once by the libraries, when torch is first imported, so `pin_cpu_kernels` must run before that; it refuses
to run after (the pin would silently not apply). Other architectures (ARM) keep their own kernels: figures
from them are not comparable bit for bit, which `describe_cpu_kernels` records beside every figure.
"""

from __future__ import annotations

import os
import platform
import sys

from ..errors import NodeError

# ATen reads ATEN_CPU_CAPABILITY (lower case); MKL reads MKL_CBWR (conditional numerical reproducibility).
X86_64 = {"x86_64", "amd64"}


class NumericsError(NodeError):
    """The kernels could not be pinned as asked."""


def pin_cpu_kernels(capability: str = "avx2") -> dict[str, str]:
    """Set the environment that pins torch's and MKL's CPU kernels (x86-64 only); what was set is returned.

    A value already in the environment wins (an operator's explicit choice). `capability` "native" pins
    nothing. Must run before torch is imported: raises NumericsError otherwise.
    """
    if capability == "native" or platform.machine().lower() not in X86_64:
        return {}
    if "torch" in sys.modules:
        raise NumericsError("pin_cpu_kernels must run before torch is imported (its kernels are chosen then)")
    wanted = {"ATEN_CPU_CAPABILITY": capability.lower(), "MKL_CBWR": capability.upper()}
    for name, value in wanted.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in wanted}


def describe_cpu_kernels() -> dict[str, str]:
    """What the figures of this process were computed with: machine, torch's CPU capability, MKL's mode."""
    import torch  # only now: the pin above must come first

    return {
        "machine": platform.machine(),
        "torch": torch.__version__,
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "mkl_cbwr": os.environ.get("MKL_CBWR", "unset"),
        "threads": str(torch.get_num_threads()),
    }
