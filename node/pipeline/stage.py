"""One stage's part of a pipelined batch: turn each incoming frame into the frame for the next stage.

Per micro-batch a stage keeps what HFEngine keeps for a batch (node/engine/hf.py _generate_batch): the KV
cache of its layers, the attention mask, the next position of every row and which samples are still active;
and it applies the same operations in the same order (drop finished rows from the cache, extend the mask,
forward one position). Stage 0 embeds prompts and fed-back tokens; the last stage norms, samples with the
node's seeded Gumbel-max sampler and sends the tokens back to stage 0. Every stage's end frame carries the
batch's completions: stage 0 and the last stage know them, a middle stage learns them from its predecessor's end
frame (`on_end`) and passes them on, so every member's record lists the same outputs.

Frames come from a peer: their rows, steps and shapes are checked against the schedule every stage derives
itself (work.py), and an activation frame's signed commitment is recomputed from its tensor before use; a
frame whose commitment does not match its bytes is provable fraud by its sender (CommitmentMismatch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ...p2p.pipeline.errors import CommitmentMismatch, PipelineWireError
from ...p2p.pipeline.frames import PADDING, Frame, FrameKind, WireDtype, completions_tensor
from ...proofs.errors import ProofError
from ...proofs.gumbel import gumbel_noise, perturbed_scores
from ...proofs.toploc import build_proof
from ..engine.types import Completion, FinishReason
from .errors import PipelineError
from .stage_model import StageModel
from .work import PipelineWork, real_rows


@dataclass(frozen=True)
class Outgoing:
    """A frame for the next stage, before it is signed and encoded."""

    kind: FrameKind
    micro_batch: int
    step: int
    rows: list[int]
    tensor: torch.Tensor
    dtype: WireDtype
    commitment: bytes | None  # None on the end frame alone


@dataclass
class _MicroBatch:
    active: list[int]  # sample ids still generating, in row order
    mask: torch.Tensor
    next_position: torch.Tensor
    cache: DynamicCache
    step: int = 0  # the next decode step this stage expects (stage 0: the next tokens frame's step)


@dataclass
class _Outputs:
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    reasons: list[FinishReason] = field(default_factory=list)
    # The final normed state that produced each output token (last stage): the rollout proof's rows, as a
    # monolithic node's hidden states at proofs/toploc.py committed_rows (the last stage's file carries it).
    states: list[list[torch.Tensor]] = field(default_factory=list)


class StageProcessor:
    """The state machine of one stage for one batch."""

    def __init__(self, model: StageModel, work: PipelineWork, *, commit: bool = True) -> None:
        self.model = model
        self.work = work
        self.commit = commit
        self.dtype: WireDtype = model.layout.activation_dtype
        self._compute_dtype = torch.float32 if self.dtype == "float32" else torch.bfloat16
        self.batches: dict[int, _MicroBatch] = {}
        n = len(work.requests)
        self.outputs = _Outputs(
            [[] for _ in range(n)], [[] for _ in range(n)], ["length"] * n, [[] for _ in range(n)]
        )
        self.finished: set[int] = set()  # micro-batches done (stage 0 and the last stage know)
        # Whether this stage knows every sample's completion: stage 0 and the last stage once the batch is done, a
        # middle stage once its predecessor's end frame was read (`on_end`).
        self.learned = False
        # Per sample, how many decode frames carried it to this stage (a middle stage): an honest stage 0 feeds a
        # sample once per output token after the first, so its completion must be one token longer (`on_end`).
        self.relayed = [0] * n

    # ------------------------------------------------------------------ stage 0

    def start(self, micro_batch: int) -> Outgoing:
        """Stage 0: prefill one micro-batch of prompts."""
        self._first_only("start a micro-batch")
        rows = self.work.schedule[micro_batch]
        ids, mask = self.work.left_padded(rows)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        state = _MicroBatch(list(rows), mask, self.work.prompt_lengths(rows), self.model.new_cache())
        self.batches[micro_batch] = state
        hidden = self.model(ids, mask, positions, state.cache)
        return self._activation(
            "prefill", micro_batch, 0, rows, hidden, real_rows(hidden, state.next_position)
        )

    def on_tokens(self, frame: Frame) -> Outgoing | None:
        """Stage 0: the last stage's sampled tokens; the next decode frame, or None when the micro-batch ends."""
        self._first_only("take tokens")
        header, state = frame.header, self._state(frame)
        if header.kind != "tokens" or header.step != state.step or header.rows != state.active:
            raise PipelineError(
                f"micro-batch {header.micro_batch}: expected the tokens of step {state.step} for rows "
                f"{state.active}, got a {header.kind} frame of step {header.step}"
            )
        tokens = frame.tensor
        if tokens.shape != (len(state.active),) or bool(
            ((tokens < 0) | (tokens >= self.model.config.vocab_size)).any()
        ):
            raise PipelineError(
                f"micro-batch {header.micro_batch}: tokens frame of step {header.step} is malformed"
            )
        for sample, token in zip(state.active, tokens.tolist(), strict=True):
            self.outputs.tokens[sample].append(token)
        step = header.step
        if step == self.work.params.max_new_tokens - 1:
            self._finish(header.micro_batch)
            return None
        keep = [b for b, t in enumerate(tokens.tolist()) if t != self.work.eos_token_id]
        if not keep:
            self._finish(header.micro_batch)
            return None
        self._select(state, keep)
        hidden = self._decode(state, tokens[keep][:, None])
        state.step = step + 1
        return self._activation("decode", header.micro_batch, step, state.active, hidden, hidden[:, -1])

    # ------------------------------------------------------------------ stages 1..S-1

    def on_activation(self, frame: Frame) -> Outgoing:
        """The previous stage's activations; this stage's (or, on the last stage, the sampled tokens)."""
        if self.model.first:
            raise PipelineError("stage 0 takes tokens and prompts, not activations")
        header = frame.header
        if header.kind not in ("prefill", "decode") or header.dtype != self.dtype:
            raise PipelineError(f"frame {header.index}: expected {self.dtype} activations, got {header.kind}")
        if header.micro_batch >= len(self.work.schedule) or header.micro_batch in self.finished:
            raise PipelineError(f"frame {header.index}: micro-batch {header.micro_batch} is not in flight")
        hidden_in = frame.tensor.to(self._compute_dtype)
        width = self.model.config.hidden_size
        if header.kind == "prefill":
            rows = self.work.schedule[header.micro_batch]
            if header.micro_batch in self.batches or header.rows != rows:
                raise PipelineError(
                    f"frame {header.index}: prefill of micro-batch {header.micro_batch} is not due"
                )
            ids, mask = self.work.left_padded(rows)
            if list(hidden_in.shape) != [len(rows), ids.shape[1], width]:
                raise PipelineError(
                    f"frame {header.index}: prefill shape {list(hidden_in.shape)} is not the batch's"
                )
            self._check_commitment(frame, real_rows(hidden_in, self.work.prompt_lengths(rows)))
            state = _MicroBatch(list(rows), mask, self.work.prompt_lengths(rows), self.model.new_cache())
            self.batches[header.micro_batch] = state
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            hidden = self.model(hidden_in, mask, positions, state.cache)
            return self._emit("prefill", header.micro_batch, 0, rows, hidden, state, prefill=True)
        state = self._state(frame)
        if header.step != state.step or not _is_subsequence(header.rows, state.active) or not header.rows:
            raise PipelineError(
                f"frame {header.index}: decode step {header.step} rows do not follow the batch"
            )
        if list(hidden_in.shape) != [len(header.rows), 1, width]:
            raise PipelineError(
                f"frame {header.index}: decode shape {list(hidden_in.shape)} is not [rows, 1, {width}]"
            )
        self._check_commitment(frame, hidden_in[:, -1])
        for sample in header.rows:
            self.relayed[sample] += 1
        self._select(state, [state.active.index(r) for r in header.rows])
        hidden = self._decode(state, hidden_in)
        state.step = header.step + 1
        return self._emit(
            "decode", header.micro_batch, header.step, header.rows, hidden, state, prefill=False
        )

    # ------------------------------------------------------------------ every stage

    def on_end(self, frame: Frame) -> None:
        """The predecessor's end frame. A middle stage learns the batch's completions from it (it sees no tokens)
        and will pass them on; PipelineError (the predecessor's doing) unless the frame holds a well-formed
        completion for every sample (listing another would make this stage's own file malformed) that agrees
        with the frames the predecessor sent before it: every micro-batch's prefill came, and each sample's
        completion is one token longer than the decode frames that carried it (an honest stage 0 feeds every
        output token but the last back, `on_tokens`). Without that check an end frame sent in place of the first
        prefill would "finish" the batch here with completions nobody sampled, the successor would refuse it as
        early and charge this stage, not the predecessor. Stage 0 and the last stage know the completions
        themselves and keep them (what the predecessor's end frame claims is the validator's to judge); they
        refuse an end frame that comes before their every micro-batch ended."""
        if frame.header.kind != "end":
            raise PipelineError(
                f"frame {frame.header.index}: expected the end frame, got {frame.header.kind}"
            )
        if self.model.first or self.model.last:
            if not self.done:  # the batch would end here with samples unfinished, its record short of them
                raise PipelineError(
                    f"frame {frame.header.index}: the end frame came before every micro-batch ended"
                )
            return
        unstarted = [mb for mb in range(len(self.work.schedule)) if mb not in self.batches]
        if unstarted:
            raise PipelineError(
                f"frame {frame.header.index}: the end frame came before the prefill of micro-batch {unstarted[0]}"
            )
        self.outputs.tokens = completions_of(
            frame.tensor,
            samples=len(self.work.requests),
            max_new_tokens=self.work.params.max_new_tokens,
            eos_token_id=self.work.eos_token_id,
            vocab_size=self.model.config.vocab_size,
            lengths=[fed + 1 for fed in self.relayed],
        )
        self.outputs.reasons = [
            "eos" if tokens[-1] == self.work.eos_token_id else "length" for tokens in self.outputs.tokens
        ]
        self.learned = True

    def end_frame(self) -> Outgoing:
        """This stage's end frame: the batch's completions as this stage knows them (PipelineError if it does not
        know them yet: stage 0 and the last stage before the batch is done, a middle stage before `on_end`)."""
        if not (self.learned or self.done):
            raise PipelineError("the batch's completions are not known yet: no end frame to send")
        tensor = completions_tensor(self.outputs.tokens, self.work.params.max_new_tokens)
        return Outgoing("end", 0, 0, list(range(tensor.shape[0])), tensor, "int64", None)

    # ------------------------------------------------------------------ helpers

    def _emit(
        self,
        kind: FrameKind,
        micro_batch: int,
        step: int,
        rows: list[int],
        hidden: torch.Tensor,
        state: _MicroBatch,
        *,
        prefill: bool,
    ) -> Outgoing:
        if not self.model.last:
            committed = real_rows(hidden, state.next_position) if prefill else hidden[:, -1]
            return self._activation(kind, micro_batch, step, rows, hidden, committed)
        # Token t of a sample is argmax(logits_t / T + gumbel(seed, t)), t counting output tokens (proofs/gumbel.py).
        last = hidden[:, -1]
        logits = self.model.logits(last)
        sampled_step = 0 if prefill else step + 1
        seeds = torch.tensor([self.work.requests[r].seed for r in rows], dtype=torch.int64)
        temperature = self.work.params.temperature
        noise = gumbel_noise(seeds, torch.full_like(seeds, sampled_step), logits.shape[-1])
        tokens = perturbed_scores(logits, temperature, noise).argmax(dim=-1)
        chosen = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[:, None])[:, 0]
        for b, (sample, token, logprob) in enumerate(
            zip(rows, tokens.tolist(), chosen.tolist(), strict=True)
        ):
            self.outputs.tokens[sample].append(token)
            self.outputs.logprobs[sample].append(logprob)
            self.outputs.states[sample].append(last[b].float().clone())
            if token == self.work.eos_token_id:
                self.outputs.reasons[sample] = "eos"
        if sampled_step == self.work.params.max_new_tokens - 1 or all(
            t == self.work.eos_token_id for t in tokens.tolist()
        ):
            self.finished.add(micro_batch)
            self.batches.pop(micro_batch, None)
        commitment = build_proof(last) if self.commit else b""
        return Outgoing("tokens", micro_batch, sampled_step, list(rows), tokens, "int64", commitment)

    def _activation(
        self,
        kind: FrameKind,
        micro_batch: int,
        step: int,
        rows: list[int],
        hidden: torch.Tensor,
        committed: torch.Tensor,
    ) -> Outgoing:
        commitment = build_proof(committed) if self.commit else b""
        return Outgoing(kind, micro_batch, step, list(rows), hidden, self.dtype, commitment)

    def _check_commitment(self, frame: Frame, rows: torch.Tensor) -> None:
        if self.commit:
            check_commitment(frame, rows)

    def _decode(self, state: _MicroBatch, x: torch.Tensor) -> torch.Tensor:
        state.mask = torch.cat([state.mask, state.mask.new_ones(state.mask.shape[0], 1)], dim=1)
        hidden = self.model(x, state.mask, state.next_position[:, None], state.cache)
        state.next_position = state.next_position + 1
        return hidden

    @staticmethod
    def _select(state: _MicroBatch, keep: list[int]) -> None:
        if len(keep) == len(state.active):
            return
        index = torch.tensor(keep)
        state.cache.batch_select_indices(index)
        state.active = [state.active[k] for k in keep]
        state.mask, state.next_position = state.mask[index], state.next_position[index]

    def _state(self, frame: Frame) -> _MicroBatch:
        state = self.batches.get(frame.header.micro_batch)
        if state is None:
            raise PipelineError(
                f"frame {frame.header.index}: micro-batch {frame.header.micro_batch} is not in flight"
            )
        return state

    def _finish(self, micro_batch: int) -> None:
        self.finished.add(micro_batch)
        self.batches.pop(micro_batch, None)

    def _first_only(self, what: str) -> None:
        if not self.model.first:
            raise PipelineError(f"only stage 0 can {what}")

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.work.schedule)

    def completions(self) -> list[Completion]:
        """The batch's completions (last stage only), in request order."""
        if not self.model.last:
            raise PipelineError("only the last stage holds the sampled log-probabilities")
        return [
            Completion(
                prompt_ids=tuple(r.prompt_ids),
                output_ids=tuple(self.outputs.tokens[i]),
                finish_reason=self.outputs.reasons[i],
                seed=r.seed,
                output_logprobs=tuple(self.outputs.logprobs[i]),
                hidden_states=None,
            )
            for i, r in enumerate(self.work.requests)
        ]

    def final_states(self) -> list[torch.Tensor]:
        """Per sample, the final normed states that produced its output tokens (output_len, hidden): what the
        rollout proof commits to (last stage only)."""
        if not self.model.last:
            raise PipelineError("only the last stage holds the final hidden states")
        return [torch.stack(states) for states in self.outputs.states]


def completions_of(
    table: torch.Tensor,
    *,
    samples: int,
    max_new_tokens: int,
    eos_token_id: int,
    vocab_size: int,
    lengths: Sequence[int] | None = None,
) -> list[list[int]]:
    """Every sample's output tokens from an end frame's tensor (p2p/pipeline/frames.py `completions_tensor`);
    PipelineError naming the first thing wrong: another shape than [samples, max_new_tokens], a row that is not
    tokens (ids in the vocabulary) followed by padding alone, an empty completion, a token after EOS, a
    completion that stops short of max_new_tokens without EOS (no honest generation ends so), or, given
    `lengths` (each sample's length the frames seen imply), a completion of another length.

    The table may be the run's largest (4096 rows of 8192 tokens: 256 MiB), so no full-size int64 temporary is
    made (row reductions and one-byte masks) and a row becomes Python ints only up to its length."""
    if tuple(table.shape) != (samples, max_new_tokens) or table.dtype != torch.int64:
        raise PipelineError(
            f"the end frame's completions are {list(table.shape)} {table.dtype}; the batch has "
            f"[{samples}, {max_new_tokens}] int64"
        )
    # One-byte masks and row reductions that do not widen them (a sum would make an int64 copy of the mask).
    real = (table != PADDING).view(torch.uint8)
    full = real.all(dim=1).bool()
    counts = torch.where(
        full, max_new_tokens, real.argmin(dim=1)
    )  # the first padding entry: the row's length
    last_real = max_new_tokens - 1 - real.flip(1).argmax(dim=1)
    del real
    bad = (counts == 0) | (~full & (last_real >= counts))  # none, or a token after the first padding
    bad |= (table.amin(dim=1) < PADDING) | (
        table.amax(dim=1) >= vocab_size
    )  # a -1 among tokens: caught above
    eos = (table == eos_token_id).view(torch.uint8)
    first_eos = torch.where(eos.any(dim=1).bool(), eos.argmax(dim=1), max_new_tokens)
    del eos
    bad |= first_eos < counts - 1  # EOS only as the last token
    last = table.gather(1, (counts - 1).clamp(min=0)[:, None])[:, 0]
    bad |= (last != eos_token_id) & (counts != max_new_tokens)
    if bool(bad.any()):
        sample = int(bad.nonzero()[0, 0])
        raise PipelineError(
            f"the end frame's completion of sample {sample} is malformed (tokens in the vocabulary, then padding "
            "alone; at least one; none after EOS; stopping without EOS only at max_new_tokens)"
        )
    found = counts.tolist()
    if lengths is not None:
        for sample, (n, due) in enumerate(zip(found, lengths, strict=True)):
            if n != due:
                raise PipelineError(
                    f"the end frame's completion of sample {sample} has {n} tokens; the frames before it call "
                    f"for {due} (one per decode step that carried the sample, and the prefill's)"
                )
    return [table[s, :n].tolist() for s, n in enumerate(found)]


def _is_subsequence(rows: list[int], active: list[int]) -> bool:
    it = iter(active)
    return all(r in it for r in rows)


def check_commitment(frame: Frame, rows: torch.Tensor) -> None:
    """CommitmentMismatch when the frame's signed commitment is not the one `rows` (its tensor's committed rows)
    give. A tensor no commitment can be built for (finite float32 beyond bf16's range, NaN) is a PipelineWireError:
    the batch is abandoned, not the stage loop ended by a ProofError; and no fraud report is made, since the
    validator's check_fraud could not build the commitment either, and the report would cost its honest maker."""
    try:
        commitment = build_proof(rows)
    except ProofError as exc:
        raise PipelineWireError(
            f"frame {frame.header.index}: its tensor admits no commitment ({exc})"
        ) from exc
    if commitment.hex() != (frame.header.commitment or ""):
        raise CommitmentMismatch(
            f"frame {frame.header.index}: the signed commitment is not the one its tensor gives"
        )
