"""The embedded default model: a tiny Qwen2-architecture causal LM built deterministically from a seed.

It uses transformers' own Qwen2 classes, so the saved directory (config.json, model.safetensors,
tokenizer files) loads with AutoModelForCausalLM / AutoTokenizer and with vLLM like any Qwen2 checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from .chat_tokenizer import build_chat_tokenizer
from .tokenizer import build_char_tokenizer


class TinyModelShape(BaseModel):
    """Dimensions of the embedded model (defaults sized for a short SFT on 2 CPU cores)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(128, ge=16, description="Width of the residual stream.")
    intermediate_size: int = Field(384, ge=16, description="Width of the MLP.")
    num_hidden_layers: int = Field(4, ge=1, description="Transformer blocks.")
    num_attention_heads: int = Field(4, ge=1, description="Query heads.")
    num_key_value_heads: int = Field(2, ge=1, description="Key/value heads (grouped-query attention).")
    vocab_size: int = Field(
        288,
        ge=259,
        description="Embedding rows; at least the tokenizer's tokens (raised to fit the chat one).",
    )
    max_position_embeddings: int = Field(512, ge=64, description="Longest sequence (prompt + completion).")


def embedding_rows(shape: TinyModelShape, tokenizer: PreTrainedTokenizerFast) -> int:
    """The shape's rows, or the tokenizer's size rounded up to a multiple of 64 when the shape has too few
    (the chat tokenizer's 615 tokens; the default tokenizer's 259 fit the default 288 rows, kept as they are)."""
    return shape.vocab_size if shape.vocab_size >= len(tokenizer) else -(-len(tokenizer) // 64) * 64


def build_config(tokenizer: PreTrainedTokenizerFast, shape: TinyModelShape | None = None) -> Qwen2Config:
    shape = shape or TinyModelShape()
    return Qwen2Config(
        vocab_size=embedding_rows(shape, tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def build_tiny_model(
    seed: int, shape: TinyModelShape | None = None, *, chat: bool = False
) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """A freshly initialised model and its tokenizer; the same seed gives bit-identical weights. `chat`: the
    trained BPE tokenizer with a chat template (chat_tokenizer.py) instead of the one-token-per-byte one."""
    tokenizer = build_chat_tokenizer() if chat else build_char_tokenizer()
    config = build_config(tokenizer, shape)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)  # transformers initialises weights from the global generator
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.eval()
    return model, tokenizer


def save_model_dir(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """Write an ordinary HF directory: config.json, generation_config.json, model.safetensors, tokenizer (a
    chat template goes into tokenizer_config.json, which older readers know, not into chat_template.jinja)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
