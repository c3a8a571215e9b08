"""The Gumbel-max logits processor for vLLM (imported only where vLLM is installed; UNTESTED here).

Written against vLLM's documented V1 custom-logits-processor interface
(`vllm.v1.sample.logits_processor.LogitsProcessor`: validate_params / update_state / apply /
is_argmax_invariant, per-request arguments in `SamplingParams.extra_args`). vLLM instantiates this class
inside its engine process from the fully qualified name `prime_node.node.engine.vllm_gumbel:
GumbelLogitsProcessor`, so it must stay a module-level class.

A request opts in with extra_args {"gumbel_seed": int, "gumbel_temperature": float} and is sent with
temperature 0 (greedy). This processor replaces its row of raw logits by logits / T + g(seed, t), t being
the number of output tokens the request already has, so vLLM's greedy argmax is exactly the engine-wide
rule token = argmax(logits / T + g) of node/engine/types.py.
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from ...proofs.gumbel import MAX_SEED, gumbel_noise

SEED_ARG = "gumbel_seed"
TEMPERATURE_ARG = "gumbel_temperature"


class GumbelLogitsProcessor(LogitsProcessor):
    """Adds the replayable Gumbel noise of each opted-in request to its row of the batch's logits."""

    def __init__(self, vllm_config: object, device: torch.device, is_pin_memory: bool) -> None:
        # Persistent-batch row -> (seed, temperature, the request's live list of output token ids).
        self.rows: dict[int, tuple[int, float, list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        extra = sampling_params.extra_args or {}
        if SEED_ARG not in extra:
            return
        seed, temperature = extra[SEED_ARG], extra.get(TEMPERATURE_ARG)
        if not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise ValueError(f"{SEED_ARG} must be an int in [0, 2^63), got {seed!r}")
        if not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"{TEMPERATURE_ARG} must be a number > 0, got {temperature!r}")
        if sampling_params.temperature != 0:
            raise ValueError(
                "Gumbel sampling requests must use temperature=0 (greedy over the perturbed logits)"
            )

    def is_argmax_invariant(self) -> bool:
        return False  # it changes the argmax: that is the point, so vLLM must apply it under greedy sampling

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        # vLLM's documented order: removed, then added, then moved.
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            extra = params.extra_args or {}
            if SEED_ARG in extra:
                self.rows[index] = (int(extra[SEED_ARG]), float(extra[TEMPERATURE_ARG]), output_ids)
            else:
                self.rows.pop(index, None)
        for source, target, direction in batch_update.moved:
            moving, displaced = self.rows.pop(source, None), self.rows.pop(target, None)
            if moving is not None:
                self.rows[target] = moving
            if direction == MoveDirectionality.SWAP and displaced is not None:
                self.rows[source] = displaced

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        indices = list(self.rows)
        entries = [self.rows[i] for i in indices]
        device = logits.device
        rows = torch.tensor(indices, dtype=torch.long, device=device)
        seeds = torch.tensor([seed for seed, _, _ in entries], dtype=torch.int64, device=device)
        positions = torch.tensor([len(output) for _, _, output in entries], dtype=torch.int64, device=device)
        temperatures = torch.tensor([t for _, t, _ in entries], dtype=torch.float32, device=device)
        noise = gumbel_noise(seeds, positions, logits.shape[-1])
        perturbed = logits[rows].to(torch.float32) / temperatures[:, None] + noise
        logits[rows] = perturbed.to(logits.dtype)
        return logits
