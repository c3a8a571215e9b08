"""Packing variable-length samples into fixed-size token rows, with no attention across samples.

Each row holds several (prompt + completion) samples end to end; position ids restart at 0 for every
sample (and for the padding tail, which is its own segment). With `attention_mask=None`, no KV cache and
restarting position ids, transformers 5 (masking_utils.find_packed_sequence_indices) builds a block-
diagonal causal mask for eager and SDPA attention, and flash-attention takes the same position ids as its
varlen boundaries; tests/test_packing.py checks that a packed row's logits equal each sample run alone.

Trap found while building this: Qwen2 in eval mode defaults to use_cache=True, creates an empty cache,
and then SKIPS the packed-sequence detection, so samples silently attend to earlier ones (logits differ by
~1). Every forward here passes use_cache=False; `check_packing_isolation` re-checks a model at start-up.

Everything is aligned to the position that PREDICTS a token: target_ids[t] = input_ids[t + 1] and
loss_mask[t] is True when that next token is a completion token of the same sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import TrainerError


@dataclass(frozen=True)
class TrainSample:
    """One completion to learn from: its prompt, its tokens, and its group-relative advantage."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    advantage: float

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch: R rows of L tokens; every tensor is (R, L)."""

    input_ids: torch.Tensor  # int64 tokens, pad_id in the tail
    position_ids: torch.Tensor  # int64, restarting at 0 per sample and for the padding tail
    target_ids: torch.Tensor  # int64, the token each position predicts (0 where there is none)
    loss_mask: torch.Tensor  # bool, True where the predicted token is a completion token
    advantages: torch.Tensor  # float32, the sample's advantage on its loss positions, else 0
    sample_index: torch.Tensor  # int64, index into the packed sample list on loss positions, else -1

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def _first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    # Longest first, each into the first row with room: close to optimal and deterministic.
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(budget - lengths[i])
    return rows


def _fill_row(samples: Sequence[TrainSample], members: Sequence[int], budget: int, pad_id: int) -> list[list]:
    ids, pos, tgt, mask, adv, idx = [], [], [], [], [], []
    for i in members:
        s = samples[i]
        tokens = list(s.prompt_ids) + list(s.completion_ids)
        n_prompt = len(s.prompt_ids)
        for t in range(len(tokens)):
            ids.append(tokens[t])
            pos.append(t)
            predicts_completion = n_prompt <= t + 1 < len(tokens)
            tgt.append(tokens[t + 1] if t + 1 < len(tokens) else 0)
            mask.append(predicts_completion)
            adv.append(s.advantage if predicts_completion else 0.0)
            idx.append(i if predicts_completion else -1)
    tail = budget - len(ids)
    ids += [pad_id] * tail
    pos += list(range(tail))  # its own segment: padding never shares a block with a sample
    tgt += [0] * tail
    mask += [False] * tail
    adv += [0.0] * tail
    idx += [-1] * tail
    return [ids, pos, tgt, mask, adv, idx]


def pack_samples(
    samples: Sequence[TrainSample], token_budget: int, pad_id: int, rows_per_micro_batch: int = 1
) -> list[PackedRows]:
    """Pack `samples` into rows of exactly `token_budget` tokens, grouped into micro-batches of rows."""
    if token_budget < 2 or rows_per_micro_batch < 1:
        raise TrainerError(
            f"bad packing shape: token_budget={token_budget}, rows_per_micro_batch={rows_per_micro_batch}"
        )
    for i, s in enumerate(samples):
        if not s.prompt_ids or not s.completion_ids:
            raise TrainerError(
                f"sample {i} has an empty prompt or completion; the validator should reject it"
            )
        if len(s) > token_budget:
            raise TrainerError(
                f"sample {i} has {len(s)} tokens but micro_batch_tokens is {token_budget}; "
                "raise micro_batch_tokens to at least the longest prompt + completion"
            )
    rows = [
        _fill_row(samples, members, token_budget, pad_id)
        for members in _first_fit_decreasing([len(s) for s in samples], token_budget)
    ]
    out = []
    for start in range(0, len(rows), rows_per_micro_batch):
        chunk = rows[start : start + rows_per_micro_batch]
        cols = list(zip(*chunk, strict=True))
        out.append(
            PackedRows(
                input_ids=torch.tensor(cols[0], dtype=torch.int64),
                position_ids=torch.tensor(cols[1], dtype=torch.int64),
                target_ids=torch.tensor(cols[2], dtype=torch.int64),
                loss_mask=torch.tensor(cols[3], dtype=torch.bool),
                advantages=torch.tensor(cols[4], dtype=torch.float32),
                sample_index=torch.tensor(cols[5], dtype=torch.int64),
            )
        )
    return out


def token_logprobs(
    model: torch.nn.Module, rows: PackedRows, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position log-prob of target_ids under `model` (and the entropy of each next-token distribution).

    Logits are divided by the rollouts' sampling temperature so the log-probs are those of the distribution
    the tokens were drawn from. Positions outside loss_mask hold meaningless values; mask them.
    Gradients flow when called with grad enabled.
    """
    if temperature <= 0.0:
        raise TrainerError(f"temperature must be positive, got {temperature}")
    device = next(model.parameters()).device
    out = model(
        input_ids=rows.input_ids.to(device),
        position_ids=rows.position_ids.to(device),
        attention_mask=None,  # a 2D mask would disable the packed-sequence mask
        use_cache=False,  # a cache also disables it (see module docstring)
    )
    logits = out.logits.float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(-1, rows.target_ids.to(device).unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy


def check_packing_isolation(
    model: torch.nn.Module, vocab_size: int | None = None, atol: float = 1e-4
) -> None:
    """Raise TrainerError unless packed samples see only themselves under this model's attention setup.

    Costs three tiny forwards; the trainer runs it once at start-up so that a model or attention backend
    without packed-sequence support fails loudly instead of training on leaked context.
    """
    if vocab_size is None:
        vocab_size = int(model.config.vocab_size)  # type: ignore[union-attr,arg-type]
    g = torch.Generator().manual_seed(0)
    first = tuple(int(t) for t in torch.randint(3, vocab_size, (7,), generator=g))
    second = tuple(int(t) for t in torch.randint(3, vocab_size, (5,), generator=g))
    a, b = TrainSample(first[:3], first[3:], 1.0), TrainSample(second[:2], second[2:], 1.0)
    with torch.no_grad():
        packed, _ = token_logprobs(model, pack_samples([a, b], len(a) + len(b) + 2, pad_id=0)[0])
        alone_b, _ = token_logprobs(model, pack_samples([b], len(b), pad_id=0)[0])
    # first-fit-decreasing puts the longer sample (a) first; b starts at offset len(a)
    got = packed[0, len(a) : len(a) + len(b) - 1]
    want = alone_b[0, : len(b) - 1]
    if not torch.allclose(got, want, atol=atol):
        raise TrainerError(
            "this model/attention backend lets packed samples attend to each other "
            f"(max log-prob difference {float((got - want).abs().max()):.3g}); use attn_implementation "
            "'sdpa', 'eager' or 'flash_attention_2' with transformers >= 5"
        )
