"""Weight tampering on any loaded checkpoint (not only the seed-rebuilt tiny model), shared by the
warm-start proof tests and benchmarks/calibrate_proofs.py: what a cheating node runs instead of the
claimed weights. Each function returns a fresh engine and leaves the given one untouched."""

from __future__ import annotations

import copy

import torch

from prime_node.node.engine import HFEngine
from prime_node.trainer.devnet.attacks import perturb_layer_, quantize_decoder_


def perturbed_copy(
    engine: HFEngine, relative_noise: float, *, layer: int | None = None, seed: int = 0
) -> HFEngine:
    """The engine's weights with every parameter of one decoder layer multiplied by (1 + noise * N(0, 1))."""
    generator = torch.Generator().manual_seed(seed)
    model = perturb_layer_(copy.deepcopy(engine.model), relative_noise, generator, layer)
    return HFEngine(model, max_batch_size=engine.max_batch_size)


def quantized_copy(engine: HFEngine, bits: int) -> HFEngine:
    """The engine's weights with every linear layer of the decoder rounded to `bits`-bit integers and back:
    symmetric, one scale per output channel, round to nearest (the devnet's int4 cheater's rounding)."""
    return HFEngine(
        quantize_decoder_(copy.deepcopy(engine.model), bits), max_batch_size=engine.max_batch_size
    )


def float64_copy(engine: HFEngine, max_batch_size: int = 16) -> HFEngine:
    """The same weights computed in float64: an honest node on other float32 hardware differs from this
    validator by float32 rounding, which a float64 computation bounds from above (its hidden states are
    rounded to bf16 for the proof like any others)."""
    return HFEngine(copy.deepcopy(engine.model).double(), max_batch_size=max_batch_size)
