"""The inference engine's interface: what the node asks for and what the validator re-checks.

Conventions every backend follows, because the proofs depend on them:
- Sampling is Gumbel-max (proofs/gumbel.py): output token t of a sample is
  argmax(logits_t / T + gumbel_noise(sample_seed, t)), where t counts output tokens from 0 and logits_t
  are the logits at the position that produced it (the last prompt position for t = 0).
- `hidden_states` has one row per position of prompt + output, the last layer's output after the final
  norm (what the LM head reads). Row i is the state at input position i; the state that produced output
  token t is row len(prompt) - 1 + t. The final output token's own row exists only after a prefill.
- A sample finishes with "eos" when it emits the EOS token (kept as the last output token) and with
  "length" when it has produced max_new_tokens tokens without EOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:  # annotations only: the CLI imports these types without loading torch
    import torch

FinishReason = Literal["eos", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; identical for every sample of one request."""

    max_new_tokens: int  # stop after this many output tokens (finish reason "length")
    temperature: float  # > 0; Gumbel-max sampling at T is exact sampling from softmax(logits / T)


@dataclass(frozen=True)
class SampleRequest:
    """One completion to generate."""

    prompt_ids: tuple[int, ...]  # token ids of the prompt, no padding
    seed: int  # per-sample seed in [0, 2^63), keys the Gumbel noise


@dataclass(frozen=True)
class Completion:
    """One generated sample."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]  # generated ids, EOS included when finish_reason == "eos"
    finish_reason: FinishReason
    seed: int
    # float32 log-probabilities under softmax(logits / T) of each output token, len == len(output_ids)
    output_logprobs: tuple[float, ...]
    # (len(prompt_ids) + len(output_ids) - 1, hidden) on CPU in the model's compute dtype: every position
    # that was fed to the model (the final output token is never fed during generation); None when not
    # captured.
    hidden_states: torch.Tensor | None


@dataclass(frozen=True)
class PrefillResult:
    """The model's view of a full sequence (prompt + output), computed in one forward pass."""

    # Rows are positions first_position .. L - 1 of the sequence (first_position: the caller's keep_from, 0 by
    # default): row i is position first_position + i, and its logits predict the token after it.
    hidden_states: (
        torch.Tensor
    )  # (L - first_position, hidden) last hidden states after the final norm, on CPU
    logits: torch.Tensor  # (L - first_position, vocab) float32 logits, on CPU
    first_position: int = 0


class InferenceEngine(Protocol):
    """What the node (generation) and the validator (prefill) need from a backend."""

    eos_token_id: int
    vocab_size: int  # rows of the logits (the model's embedding size, may exceed the tokenizer's)
    device: str

    def generate(
        self, requests: Sequence[SampleRequest], params: SamplingParams, *, capture_hidden: bool = True
    ) -> list[Completion]:
        """Generate one completion per request (batched internally); order is preserved."""
        ...

    def prefill(
        self, sequences: Sequence[Sequence[int]], keep_from: Sequence[int] | None = None
    ) -> list[PrefillResult]:
        """One forward pass per sequence (batched internally), for verification. `keep_from[i]`: the first
        position of sequence i whose hidden state and logits are returned (0 for all): a verifier reads only
        the output's positions, and a prompt's logits are 594 KiB per token at a 152k vocabulary."""
        ...
