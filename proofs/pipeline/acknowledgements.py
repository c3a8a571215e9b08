"""What a stage's own frames say it had received: each sent frame header acknowledges the head of its input
stream (its predecessor's) and that head's index, with the predecessor's signature over both, bound to the
input stream's opening (p2p/pipeline/frames.py `Acknowledgement`, `head_message`).

A head fixes the stream prefix that leads to it, so an acknowledgement found in a signed copy of the input names
exactly the frames the stage had when it sent the frame. The stage signs its acknowledgements with its frames:
one its predecessor never signed for this batch's input stream (a head replayed from another batch or group
included), one that goes back, or one its own record's copy of its input does not reach is its own
contradiction. One whose index lies in a signed copy of the input but whose head differs there is the
predecessor's: it signed two streams (docs/pipeline.md, "Broken batches").
"""

from __future__ import annotations

from dataclasses import dataclass

from ...p2p.pipeline.frames import (
    FrameHeader,
    StreamOpening,
    chain_next,
    chain_start,
    head_message,
    opening_digest,
)
from ...p2p.signing import canonical_json, is_valid_signature


@dataclass(frozen=True)
class AcknowledgementFault:
    """Why acknowledgements prove a deviation, and whose: the frames' sender (`by_predecessor` False) or its
    predecessor, when a head it signed for an index contradicts its own signed copy (equivocation)."""

    reason: str
    by_predecessor: bool = False


def prefix_heads(opening: StreamOpening, headers: list[FrameHeader]) -> list[bytes]:
    """Every chain head of the stream by index (0: the opening's head)."""
    current = chain_start(canonical_json(opening.model_dump(mode="json")))
    heads = [current]
    for header in headers:
        current = chain_next(current, canonical_json(header.model_dump(mode="json")))
        heads.append(current)
    return heads


def forged_acknowledgement(sent: list[FrameHeader], opening: StreamOpening, predecessor: str) -> str | None:
    """Why one of the sent frames acknowledges a head `predecessor` never signed on the stream of `opening` (the
    batch's input stream), or None: provable from the sender's signed frames alone, whoever else is missing. A
    head the predecessor signed on another batch's or group's stream fails here."""
    digest = opening_digest(opening)
    for header in sent:
        ack = header.acknowledged
        message = head_message(digest, ack.index, bytes.fromhex(ack.head))
        if not is_valid_signature(predecessor, message, bytes.fromhex(ack.signature)):
            return (
                f"frame {header.index} acknowledges a chain head stage {opening.stage} never signed as "
                f"head {ack.index} of this batch's stream"
            )
    return None


def acknowledged(
    sent: list[FrameHeader], heads: list[bytes], own: bool
) -> tuple[list[int], AcknowledgementFault | None]:
    """How many input frames each sent frame acknowledges, for the frames whose acknowledgement lies in the input
    copy at hand (`heads`, of `prefix_heads`, signed by the predecessor), their signatures already checked
    (`forged_acknowledgement`); or why the acknowledgements prove a deviation: one that goes back, or, when the
    copy is the sender's own record's (`own`), one that copy does not reach (it received what it acknowledged),
    are the sender's; a signed head at an index the copy holds that differs from the copy's is the
    predecessor's equivocation. Another's copy may fall short of what the predecessor signed: from the first
    acknowledgement beyond it, nothing more is returned."""
    acked: list[int] = []
    for header in sent:
        ack = header.acknowledged
        if ack.index >= len(heads):
            if own:
                return acked, AcknowledgementFault(
                    f"frame {header.index} acknowledges input its own record does not show"
                )
            break
        if heads[ack.index] != bytes.fromhex(ack.head):
            return acked, AcknowledgementFault(
                f"it signed two different heads at index {ack.index} of its stream (one acknowledged by frame "
                f"{header.index} of its successor, one in a signed copy: equivocation)",
                by_predecessor=True,
            )
        if acked and ack.index < acked[-1]:
            return acked, AcknowledgementFault(
                f"frame {header.index} acknowledges {ack.index} input frames, after {acked[-1]}"
            )
        acked.append(ack.index)
    return acked, None


def contradiction(
    sent: list[FrameHeader], opening: StreamOpening, received: list[FrameHeader], predecessor: str
) -> AcknowledgementFault | None:
    """Why a stage's sent frames contradict its own record's copy of its input (the predecessor's `opening` and
    `received` headers, already found signed by `predecessor`), or None: what a complete batch's check needs."""
    forged = forged_acknowledgement(sent, opening, predecessor)
    if forged is not None:
        return AcknowledgementFault(forged)
    return acknowledged(sent, prefix_heads(opening, received), own=True)[1]
