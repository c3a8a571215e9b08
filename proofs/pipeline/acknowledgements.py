"""What a stage's own frames say it had received: each sent frame header acknowledges the head of its input
stream (its predecessor's) with the predecessor's signature (p2p/pipeline/frames.py `Acknowledgement`).

A head fixes the stream prefix that leads to it, so an acknowledgement found in a signed copy of the input names
exactly the frames the stage had when it sent the frame. The stage signs its acknowledgements with its frames:
one its predecessor never signed, one that goes back, or one its own record's copy of its input does not reach
is its own contradiction (docs/pipeline.md, "Broken batches").
"""

from __future__ import annotations

from ...p2p.pipeline.frames import DOMAIN, FrameHeader, StreamOpening, chain_next, chain_start
from ...p2p.signing import canonical_json, is_valid_signature


def prefix_heads(opening: StreamOpening, headers: list[FrameHeader]) -> dict[bytes, int]:
    """Every chain head of the stream, with how many frames lead to it (0: the opening's head)."""
    current = chain_start(canonical_json(opening.model_dump(mode="json")))
    heads = {current: 0}
    for position, header in enumerate(headers, 1):
        current = chain_next(current, canonical_json(header.model_dump(mode="json")))
        heads.setdefault(current, position)
    return heads


def forged_acknowledgement(sent: list[FrameHeader], predecessor: str, stage: int) -> str | None:
    """Why one of the sent frames acknowledges a head `predecessor` (the node of stage `stage`) never signed, or
    None: provable from the sender's signed frames alone, whoever else is missing."""
    for header in sent:
        ack = header.acknowledged
        if not is_valid_signature(
            predecessor, DOMAIN + bytes.fromhex(ack.head), bytes.fromhex(ack.signature)
        ):
            return f"frame {header.index} acknowledges a chain head stage {stage} never signed"
    return None


def acknowledged(sent: list[FrameHeader], heads: dict[bytes, int], own: bool) -> tuple[list[int], str | None]:
    """How many input frames each sent frame acknowledges, for the frames whose acknowledgement lies in the input
    copy at hand (`heads`, of `prefix_heads`); or why the acknowledgements are the sender's own contradiction:
    one that goes back, or, when the copy is the sender's own record's (`own`), one that copy does not reach
    (it received what it acknowledged). Another's copy may fall short of what the predecessor signed: from the
    first acknowledgement beyond it, nothing more is returned."""
    acked: list[int] = []
    for header in sent:
        position = heads.get(bytes.fromhex(header.acknowledged.head))
        if position is None:
            if own:
                return acked, f"frame {header.index} acknowledges input its own record does not show"
            break
        if acked and position < acked[-1]:
            return acked, f"frame {header.index} acknowledges {position} input frames, after {acked[-1]}"
        acked.append(position)
    return acked, None


def contradiction(
    sent: list[FrameHeader], opening: StreamOpening, received: list[FrameHeader], predecessor: str
) -> str | None:
    """Why a stage's sent frames contradict its own record's copy of its input (the predecessor's `opening` and
    `received` headers, already found signed by `predecessor`), or None: what a complete batch's check needs."""
    forged = forged_acknowledgement(sent, predecessor, opening.stage)
    if forged is not None:
        return forged
    return acknowledged(sent, prefix_heads(opening, received), own=True)[1]
