"""The validator's view of a group's batch: one monolithic prefill with hooks at every stage boundary.

One forward pass of the whole checkpoint over each full sequence (prompt + output) yields, at once, what every
honest stage should have sent: the residual stream after the last layer of each stage but the last, and the
final normed hidden states and float32 logits the last stage samples from. The same right-padded, unmasked
prefill as HFEngine's (node/engine/hf.py _prefill_batch): causal attention keeps every real position away
from the pads after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ...p2p.pipeline.layout import StageLayout
from ..errors import EngineError


@dataclass(frozen=True)
class SampleBoundaries:
    """One sequence's states at every boundary: states[j] is what stage j - 1 sends (j = 1 .. stages - 1) and,
    for j = stages, the final normed hidden states; each (len(sequence), hidden), float32 on CPU."""

    states: list[torch.Tensor]
    logits: torch.Tensor  # (len(sequence), vocab) float32


class BoundaryOracle:
    def __init__(self, model: PreTrainedModel, layout: StageLayout, *, max_batch_size: int = 16) -> None:
        if model.config.num_hidden_layers != layout.layers:
            raise EngineError(
                f"the layout covers {layout.layers} layers, the model has {model.config.num_hidden_layers}"
            )
        self.model, self.layout, self.max_batch_size = model.eval(), layout, max_batch_size
        self.layers: torch.nn.ModuleList = model.base_model.layers  # type: ignore[assignment]
        self.head = model.get_output_embeddings()
        self.pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    @torch.inference_mode()
    def prefill(self, sequences: Sequence[Sequence[int]]) -> list[SampleBoundaries]:
        results: list[SampleBoundaries] = []
        for start in range(0, len(sequences), self.max_batch_size):
            results.extend(self._batch(sequences[start : start + self.max_batch_size]))
        return results

    def _batch(self, sequences: Sequence[Sequence[int]]) -> list[SampleBoundaries]:
        lengths = [len(s) for s in sequences]
        ids = torch.full((len(sequences), max(lengths)), self.pad, dtype=torch.long)
        for b, sequence in enumerate(sequences):
            ids[b, : len(sequence)] = torch.tensor(list(sequence), dtype=torch.long)
        positions = torch.arange(ids.shape[1]).expand(len(sequences), -1)
        captured: list[torch.Tensor] = []
        hooks = [
            self.layers[boundary - 1].register_forward_hook(
                lambda _module, _inputs, output: captured.append(
                    output[0] if isinstance(output, tuple) else output
                )
            )
            for boundary in self.layout.boundaries[1:-1]
        ]
        try:
            final = self.model.base_model(
                input_ids=ids, position_ids=positions, use_cache=False
            ).last_hidden_state
        finally:
            for hook in hooks:
                hook.remove()
        logits = self.head(final).float()
        stack = [*captured, final]
        return [
            SampleBoundaries([s[b, :n].float() for s in stack], logits[b, :n]) for b, n in enumerate(lengths)
        ]
