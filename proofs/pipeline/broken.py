"""Blame in a batch that broke mid-way: which stage, if any, provably relayed other rows than it was given.

When a batch breaks (a stage refuses a frame: stage 0 finds the tokens of other rows than it fed; a stage
stops), the members hand the validator their **partial** records: the streams they received and sent so far,
each prefix signed by its sender through the chain head, and the tokens they know. What stage k sent is signed
by k: the longest validly signed copy (k's own, or k + 1's) is k's output. What k was given is what its own
signed output acknowledges: every frame header carries the head of the stream k had received when it sent the
frame, with k - 1's signature over that head (`Acknowledgement`), all under k's own chain. So k's successor's
copy of k's output proves k's input too, even when k withholds its record: the input is the prefix of k - 1's
signed stream (k's own copy, or, without k's record, k - 1's) that ends at the acknowledged head; a head fixes
its prefix, so neither neighbour can substitute another input. k - 1 signs each head with its index and its
stream's opening (group, batch, stage), so an acknowledgement whose signature is not k - 1's for this batch's
stream (a head replayed from an earlier batch or another group included) is k's own lie, as is one its own
record's copy does not reach, or one that goes back; one whose index a signed copy holds but whose head differs
there is k - 1's equivocation; only one beyond every copy at hand (k - 1 may have signed more than its record
shows) ends what is judged of k. Stage k's output
frames are checked against its input frames (`blame_broken`):

- a relay stage (0 < k < last) sends, for each frame it received, the frame of the same kind, micro-batch and
  step with exactly the same rows;
- the last stage sends the tokens of step s for exactly the rows of the activation of step s - 1 it received
  (of the prefill at s = 0);
- stage 0 sends a prefill per micro-batch with exactly the batch's cut, and the decode of step t for exactly the
  rows of the tokens of step t it received whose token is not EOS (none at t = max_new_tokens - 1); the token
  values come from a record whose outputs match the token frames' signed hashes (stage 0's or the last stage's);
- every stage ends its stream with an end frame carrying the batch's completions: stage 0's those the token frames
  it received carry, a middle stage's its predecessor's end frame's (a middle stage refuses one without a
  well-formed completion for every sample, which breaks the batch), the last stage's after its predecessor's.

An output frame without an input frame it had acknowledged by then, or with other rows, is that stage's own signed
deviation against the input it acknowledges: it alone is blamed. Two validly signed copies of one hop that diverge
are the sender's equivocation; a copy not signed by its sender is its holder's forgery. A stage that merely
stops sends nothing wrong and is never blamed here (a silent peer proves nothing: the network may have failed
it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...p2p.pipeline.frames import FrameHeader, completions_sha256, verify_chain
from .acknowledgements import acknowledged, forged_acknowledgement, prefix_heads
from .blame import GroupVerdict
from .records import GroupSpec, HopRecord, SignedStageRecord
from .schedule import micro_batches

NO_BLAME = GroupVerdict(None, "no stage provably deviated before the batch broke")


def _signed(hop: HopRecord, sender: str) -> bool:
    try:
        return verify_chain(
            sender, hop.opening, list(hop.headers), bytes.fromhex(hop.head), bytes.fromhex(hop.signature)
        )
    except ValueError:
        return False


def _hop(
    spec: GroupSpec, records: Sequence[SignedStageRecord | None], k: int
) -> tuple[list[FrameHeader] | None, GroupVerdict | None]:
    """The longest validly signed copy of hop k -> k + 1 (None when no member holds one), or a verdict: a copy
    its holder forged, or two copies that diverge (the sender signed both)."""
    stages = spec.layout.stages
    receiver = (k + 1) % stages
    copies: list[list[FrameHeader]] = []
    for holder, hop in ((k, "sent"), (receiver, "received")):
        signed = records[holder]
        if signed is None:
            continue
        copy: HopRecord = getattr(signed.record, hop)
        if copy.opening != spec.opening(k) or not _signed(copy, spec.members[k]):
            return None, GroupVerdict(
                holder, f"stage {holder}: its copy of hop {k} -> {receiver} is not signed by {k}"
            )
        copies.append(list(copy.headers))
    if not copies:
        return None, None
    longest = max(copies, key=len)
    if any(c != longest[: len(c)] for c in copies):
        return None, GroupVerdict(k, f"stage {k}: it signed two different streams on hop {k} -> {receiver}")
    return longest, None


def _tokens(
    records: Sequence[SignedStageRecord | None], tokens_stream: list[FrameHeader] | None
) -> list[list[int]] | None:
    """The sampled tokens, from a record whose outputs the token frames' signed hashes confirm."""
    if tokens_stream is None:
        return None
    for signed in (records[-1], records[0]):
        if signed is None:
            continue
        outputs = signed.record.outputs
        try:
            if all(
                hashlib.sha256(
                    np.array([outputs[r][h.step] for r in h.rows], dtype="<i8").tobytes()
                ).hexdigest()
                == h.tensor_sha256
                for h in tokens_stream
                if h.kind == "tokens"
            ):
                return [list(o) for o in outputs]
        except IndexError:
            continue
    return None


def _index(headers: list[FrameHeader]) -> dict[tuple[str, int, int], tuple[int, FrameHeader]]:
    """Frames by (kind, micro-batch, step), the first of each with its position (1, 2, ... in the stream): a stage
    refuses a repeat, so it computed on the first (and a repeat appended by the sender cannot stand for it)."""
    index: dict[tuple[str, int, int], tuple[int, FrameHeader]] = {}
    for position, h in enumerate(headers, 1):
        if h.kind != "end":
            index.setdefault((h.kind, h.micro_batch, h.step), (position, h))
    return index


def _source(
    index: dict[tuple[str, int, int], tuple[int, FrameHeader]], key: tuple[str, int, int], limit: int
) -> FrameHeader | None:
    """The input frame of `key` if it is among the first `limit` input frames (those the output frame
    acknowledges: it cannot have computed on a later one), else None."""
    found = index.get(key)
    return found[1] if found is not None and found[0] <= limit else None


def _deviation(
    k: int,
    stages: int,
    given: list[FrameHeader],
    sent: list[FrameHeader],
    acked: list[int],
    run: BatchRules,
    tokens: list[list[int]] | None,
) -> str | None:
    """Why stage k's output frames do not follow from its input frames, or None. `acked[j]`: how many input
    frames sent[j] acknowledges; it may follow only from one of those."""
    index = _index(given)
    for header, limit in zip(sent, acked, strict=True):
        if header.kind == "end":
            reason = _end_deviation(k, stages, given[:limit], header, run, tokens)
            if reason is not None:
                return f"frame {header.index} (end): {reason}"
            continue
        what = f"frame {header.index} ({header.kind} of micro-batch {header.micro_batch}, step {header.step})"
        if k == 0:
            if header.kind == "prefill":
                if run.cut is None:  # nobody vouches for the batch's cut: stage 0's prefills are not judged
                    continue
                due: list[int] | None = (
                    run.cut[header.micro_batch] if header.micro_batch < len(run.cut) else None
                )
            elif header.kind == "decode":
                source = _source(index, ("tokens", header.micro_batch, header.step), limit)
                due = None
                if source is not None and tokens is not None and header.step < run.max_new_tokens - 1:
                    due = [r for r in source.rows if tokens[r][header.step] != run.eos_token_id]
                elif source is not None and tokens is None:  # no confirmed token values: added rows only
                    if not set(header.rows) <= set(source.rows):
                        return f"{what} feeds rows it never received tokens for"
                    continue
            else:
                due = None
        elif k == stages - 1:
            if header.kind != "tokens":
                due = None
            elif header.step == 0:
                source = _source(index, ("prefill", header.micro_batch, 0), limit)
                due = None if source is None else list(source.rows)
            else:
                source = _source(index, ("decode", header.micro_batch, header.step - 1), limit)
                due = None if source is None else list(source.rows)
        else:
            source = _source(index, (header.kind, header.micro_batch, header.step), limit)
            due = None if source is None else list(source.rows)
        if due is None:
            return f"{what} follows from no frame it received"
        if list(header.rows) != due:
            return f"{what} carries rows {list(header.rows)[:8]}, its input calls for {due[:8]}"
    return None


def _end_deviation(
    k: int,
    stages: int,
    given: list[FrameHeader],
    header: FrameHeader,
    run: BatchRules,
    tokens: list[list[int]] | None,
) -> str | None:
    """Why stage k's end frame does not follow from the input it acknowledges, or None. Stage 0's carries the
    completions of the token frames it acknowledged, whichever prefix of its input that is (an honest stage 0
    acknowledges every token frame it used), and only once those frames ended every sample: at EOS or
    max_new_tokens (an honest one sends no end frame before); judged when confirmed token values cover the
    acknowledged frames and those bring each sample's tokens in step order (else an honest stage 0 would have
    refused them, and it is the last stage that is judged). A later stage's follows its predecessor's end
    frame, which a middle stage passes on unchanged (the last stage's carries what it sampled, which its
    predecessor's end frame does not decide)."""
    if k == 0:
        if tokens is None:
            return None
        steps: list[list[int]] = [[] for _ in tokens]
        for h in given:
            if h.kind == "tokens":
                for r in h.rows:
                    steps[r].append(h.step)
        if any(
            s != list(range(len(s))) or len(s) > min(len(t), run.max_new_tokens)
            for s, t in zip(steps, tokens)
        ):
            return (
                None  # not each sample's tokens in step order, or more than the confirmed values: not judged
            )
        received = [t[: len(s)] for s, t in zip(steps, tokens)]
        for sample, got in enumerate(received):
            if not got or (got[-1] != run.eos_token_id and len(got) < run.max_new_tokens):
                return (
                    f"it came before sample {sample} ended: the token frames it acknowledges bring "
                    f"{len(got)} tokens, without EOS"
                )
        if header.tensor_sha256 != completions_sha256(received, run.max_new_tokens):
            return "it carries other completions than the tokens it received"
        return None
    ends = [h for h in given if h.kind == "end"]
    if not ends:
        return "it follows from no end frame it received"
    if k < stages - 1 and header.tensor_sha256 != ends[0].tensor_sha256:
        return "it carries other completions than its predecessor's end frame"
    return None


@dataclass(frozen=True)
class BatchRules:
    """What the check needs of the batch beyond the streams: the run's EOS and max_new_tokens, and the
    micro-batch cut of the assigned work (None when no trustworthy claim of it is at hand: stage 0's prefills are
    then not judged)."""

    eos_token_id: int
    max_new_tokens: int
    cut: list[list[int]] | None


def cut_of(prompts: Sequence[Sequence[int]], micro_batch_size: int) -> list[list[int]]:
    return micro_batches([len(p) for p in prompts], micro_batch_size)


def blame_broken(
    spec: GroupSpec, records: Sequence[SignedStageRecord | None], run: BatchRules
) -> GroupVerdict:
    """The first stage whose own signed output deviates from the signed input it acknowledges in a broken batch,
    or no one. `records`: the members' partial records in stage order (None where a member handed in none);
    each must be authentic and its member's (the caller's reader checks it)."""
    stages = spec.layout.stages
    if len(records) != stages:
        return GroupVerdict(None, f"{len(records)} partial records for {stages} stages")
    hops: list[list[FrameHeader] | None] = []
    for k in range(stages):
        stream, verdict = _hop(spec, records, k)
        if verdict is not None:
            return verdict
        hops.append(stream)
    for k in range(stages):
        sent, own = hops[k], records[k]
        if sent is None:
            continue  # what it sent is not at hand: k is not judged
        predecessor = (k - 1) % stages
        lie = forged_acknowledgement(sent, spec.opening(predecessor), spec.members[predecessor])
        if lie is not None:
            return GroupVerdict(k, f"stage {k}: {lie}")
        # Its input: its own copy, else the predecessor's signed stream as far as anyone holds it; either way
        # only the prefix its own frames acknowledge (a predecessor's copy alone could reach past what it sent).
        given = list(own.record.received.headers) if own is not None else hops[predecessor]
        if given is None:
            continue  # nobody holds what it was given: k is not judged
        heads = prefix_heads(spec.opening(predecessor), given)
        acked, fault = acknowledged(sent, heads, own is not None)
        if fault is not None:
            who = predecessor if fault.by_predecessor else k
            return GroupVerdict(who, f"stage {who}: {fault.reason}")
        given = given[: acked[-1]] if acked else []
        tokens = _tokens(records, given) if k == 0 else None
        reason = _deviation(k, stages, given, sent[: len(acked)], acked, run, tokens)
        if reason is not None:
            return GroupVerdict(k, f"stage {k}: {reason}")
    return NO_BLAME
