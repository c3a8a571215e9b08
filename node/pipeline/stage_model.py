"""One stage's slice of a decoder-only model: its decoder layers, plus the embedding on the first stage and
the final norm and LM head on the last.

Its forward is the body of the architecture's own model forward (transformers' Qwen2Model.forward: causal
mask, rotary embeddings, the layers in order) restricted to the stage's layers, with the stage's own
sub-config (its layer count and layer types) so that its KV cache holds only its layers. Given the same
inputs, every layer therefore runs the same kernels on the same tensors as in a monolithic forward, which is
what makes pipelined float32 generation bit-identical to one node's (tests/test_pipeline_generation.py).
"""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, DynamicCache, PretrainedConfig
from transformers.masking_utils import create_causal_mask

from ...p2p.pipeline.layout import StageLayout
from ..engine.hf import resolve_dtype
from ..errors import EngineError
from .weights import load_stage_tensors

# model_type -> (module, class prefix) of architectures whose decoder layers take (hidden, mask, positions,
# cache, rotary embeddings) as Qwen2's do. Only qwen2 (the embedded model) is tested.
ARCHITECTURES = {
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
}


def stage_config(config: PretrainedConfig, layout: StageLayout, stage: int) -> PretrainedConfig:
    """The model's config cut to the stage's layers (its own layer count and layer types)."""
    layers = layout.layer_range(stage)
    if layout.layers != config.num_hidden_layers:
        raise EngineError(
            f"the stage layout ends at layer {layout.layers} but the model has {config.num_hidden_layers} layers; "
            "set run.pipeline.boundaries to end at the model's layer count"
        )
    sub = copy.deepcopy(config)
    sub.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None) is not None:
        sub.layer_types = list(config.layer_types[layers.start : layers.stop])
    return sub


class StageModel(nn.Module):
    """Decoder layers [start, stop) of a model, with the embedding (first stage) or norm and head (last)."""

    def __init__(
        self, config: PretrainedConfig, layout: StageLayout, stage: int, state: dict[str, torch.Tensor]
    ) -> None:
        super().__init__()
        if config.model_type not in ARCHITECTURES:
            raise EngineError(
                f"pipelining supports {', '.join(ARCHITECTURES)} models, not {config.model_type!r}"
            )
        module_name, prefix = ARCHITECTURES[config.model_type]
        classes = importlib.import_module(module_name)
        self.layout, self.stage = layout, stage
        self.first, self.last = stage == 0, stage == layout.stages - 1
        self.config = stage_config(config, layout, stage)
        self.embed = nn.Embedding.from_pretrained(state["embed.weight"], freeze=True) if self.first else None
        with torch.device("meta"):  # no memory for random weights that the checkpoint's replace at once
            layers = [
                getattr(classes, f"{prefix}DecoderLayer")(self.config, i)
                for i in range(len(layout.layer_range(stage)))
            ]
            norm = getattr(classes, f"{prefix}RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(layers)
        self.layers.load_state_dict(_prefixed(state, "layers."), strict=True, assign=True)
        self.rotary = getattr(classes, f"{prefix}RotaryEmbedding")(config=self.config)
        self.norm = None
        self.head_weight: torch.Tensor | None = None
        if self.last:
            norm.load_state_dict({"weight": state["norm.weight"]}, strict=True, assign=True)
            self.norm = norm
            self.head_weight = state["head.weight"]
        self.eval()

    @classmethod
    def load(cls, checkpoint: Path, layout: StageLayout, stage: int, *, dtype: str = "float32") -> StageModel:
        """The stage from a verified checkpoint directory, reading only its own tensors."""
        config = AutoConfig.from_pretrained(checkpoint, local_files_only=True)
        config._attn_implementation = "sdpa"  # what from_pretrained picks for a monolithic load on CPU
        tied = bool(getattr(config, "tie_word_embeddings", False))
        state = load_stage_tensors(checkpoint, layout, stage, resolve_dtype(dtype, "cpu"), tied=tied)
        return cls(config, layout, stage, state)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    @torch.inference_mode()
    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, cache: DynamicCache | None
    ) -> torch.Tensor:
        """Token ids (first stage) or the previous stage's hidden states -> this stage's output: the residual
        stream after its last layer, normed on the last stage (what the head reads)."""
        hidden = self.embed(x) if self.embed is not None else x
        causal = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=mask, cache=cache, position_ids=positions
        )
        rotary = self.rotary(hidden, positions)
        for layer in self.layers:
            hidden = layer(
                hidden,
                attention_mask=causal,
                position_ids=positions,
                cache=cache,
                use_cache=cache is not None,
                position_embeddings=rotary,
            )
        return self.norm(hidden) if self.norm is not None else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the last stage's normed hidden states."""
        if self.head_weight is None:
            raise EngineError(f"stage {self.stage} is not the last stage; it has no LM head")
        return nn.functional.linear(hidden, self.head_weight).float()


def _prefixed(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name[len(prefix) :]: tensor for name, tensor in state.items() if name.startswith(prefix)}
