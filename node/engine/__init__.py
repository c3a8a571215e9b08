"""Inference engines: the interface (types.py), the transformers backend (hf.py), the optional vLLM
backend (vllm_backend.py), and `load_engine`, the one place that picks between them.

`EngineSettings` is the typed configuration the CLI loads (flags > env > TOML > defaults); its field names
are `load_engine`'s keyword arguments, so `load_engine(model_dir, **settings.model_dump())` works. Importing
this package does not import torch (the CLI builds its flags from EngineSettings and must start fast): the
backends load when `load_engine` runs or `HFEngine` is first named.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from ..config import Section
from ..errors import EngineError
from .types import Completion, InferenceEngine, PrefillResult, SampleRequest, SamplingParams

if TYPE_CHECKING:
    from .hf import HFEngine

logger = logging.getLogger(__name__)

__all__ = [
    "Completion",
    "EngineError",
    "EngineSettings",
    "HFEngine",
    "InferenceEngine",
    "PrefillResult",
    "SampleRequest",
    "SamplingParams",
    "load_engine",
]


class EngineSettings(Section):
    """How the node and the validator run the model."""

    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the model runs; --gpu sets cuda.")
    prefer_vllm: bool = Field(
        True, description="On cuda (--gpu), generate with vLLM when it is installed; ignored on cpu."
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Compute dtype; auto is float32 on cpu and bfloat16 on cuda."
    )
    max_batch_size: int = Field(16, ge=1, le=4096, description="Most samples generated in one micro-batch.")
    threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="torch CPU threads (process-wide); unset keeps torch's default (a validator on 4 cores or "
        "fewer takes 1).",
    )
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0.05,
        le=0.95,
        description="Share of GPU memory vLLM may take (the prefill model needs the rest).",
    )


def load_engine(
    model_dir: Path,
    *,
    device: Literal["cpu", "cuda"] = "cpu",
    prefer_vllm: bool = True,
    dtype: Literal["auto", "float32", "bfloat16"] = "auto",
    max_batch_size: int = 16,
    threads: int | None = None,
    gpu_memory_utilization: float = 0.5,
) -> InferenceEngine:
    """The engine for `model_dir` (a local HF directory); EngineError if it or the device is unusable.

    On cuda, vLLM generates when it is installed and `prefer_vllm` is set (the `--gpu` default, as the
    design asks); otherwise, and always on cpu, the transformers backend does.
    """
    from .hf import HFEngine, check_device

    check_device(device)
    if prefer_vllm and device == "cuda":
        from .vllm_backend import VLLMEngine, vllm_available

        if vllm_available():
            return VLLMEngine.load(
                model_dir,
                dtype=dtype,
                max_batch_size=max_batch_size,
                gpu_memory_utilization=gpu_memory_utilization,
            )
        logger.info(
            "vLLM is not installed: --gpu uses the transformers CUDA backend (pip install 'prime-node[gpu]')"
        )
    return HFEngine.load(
        model_dir, device=device, dtype=dtype, max_batch_size=max_batch_size, threads=threads
    )


def __getattr__(name: str) -> Any:
    # HFEngine imports torch and transformers: only when it is asked for (PEP 562), not with EngineSettings.
    if name == "HFEngine":
        from .hf import HFEngine

        return HFEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
