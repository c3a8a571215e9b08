"""A pipelined group's id and the per-formation nonce bound into it (docs/pipeline.md, "Groups").

A group id is the SHA-256 of its run, policy step, members in stage order, stage layout (its digest) and the
**formation nonce** the operator's coordinator drew when it formed the group. Every party computes it here: the
node before it joins a record (node/pipeline/membership.py), the coordinator when it forms one
(trainer/groups/plan.py), a stream's opening and a stage record (proofs/pipeline/records.GroupSpec), a stage file
and a report's claim (proofs/pipeline/stage_file.py, reports.py) and the validator's formed-groups index.

Why a nonce: without one, the same members at the same step under the same layout were the same group, so a
re-formed group took up the old one's batch numbers, and a node had to keep the mark of every group it ever ran
at a step for as long as that step could come back; in a frozen run (a synthetic run's step never advances) that
was for good, and the node's bounded marks file filled up and refused every new group. With the nonce each
formation is its own id: a re-formed group starts its batch numbers at 0 under a new id, and no opening of the
old one can be signed again. A standing group keeps its nonce (the coordinator re-signs it every round
unchanged), so its id does not change while it stands.

The nonce is 48 lowercase hex digits: the formation time in milliseconds since the epoch (16 digits, a u64 in
big-endian hex), then 16 random bytes (32 digits). The time part orders formations, which is what lets a node
forget marks with bounded state (node/pipeline/batch_marks.py): it drops the oldest formations' marks first and
refuses for good any group formed no later than the newest formation it dropped. The random part keeps two
formations of one member list apart even in the same millisecond (a trainer restarted with its clock set back).
The group record checks that the time part is its `formed_at` (p2p/swarm/group_records.py).
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
from collections.abc import Sequence
from typing import Annotated

from pydantic import StringConstraints

NONCE_TIME_DIGITS = 16  # a u64 of milliseconds, hex
NONCE_RANDOM_BYTES = 16
NONCE_DIGITS = NONCE_TIME_DIGITS + 2 * NONCE_RANDOM_BYTES
# A pydantic pattern is matched by Rust's regex crate, whose $ is the very end of the text (as in p2p/wire.py).
NONCE_PATTERN = rf"^[0-9a-f]{{{NONCE_DIGITS}}}$"
_NONCE_RE = re.compile(rf"[0-9a-f]{{{NONCE_DIGITS}}}")
# A group's formation nonce on the wire (group records, report claims; stage files check it with is_nonce).
GroupNonce = Annotated[str, StringConstraints(pattern=NONCE_PATTERN)]


def is_nonce(text: object) -> bool:
    """Whether `text` is a well-formed formation nonce (48 lowercase hex digits)."""
    return isinstance(text, str) and _NONCE_RE.fullmatch(text) is not None


def formed_ms(formed_at: float) -> int:
    """A formation time in whole milliseconds, as a nonce carries it (the one rounding every party uses)."""
    return math.floor(formed_at * 1000)


def new_nonce(formed_at: float) -> str:
    """A fresh nonce for a group formed at `formed_at` (seconds since the epoch): its time, then random bytes."""
    return f"{formed_ms(formed_at):0{NONCE_TIME_DIGITS}x}{secrets.token_hex(NONCE_RANDOM_BYTES)}"


def nonce_formed_ms(nonce: str) -> int:
    """The formation time (milliseconds) a well-formed nonce carries; ValueError for one that is not a nonce."""
    if not is_nonce(nonce):
        raise ValueError(f"formation nonce {nonce[:64]!r} is not {NONCE_DIGITS} lowercase hex digits")
    return int(nonce[:NONCE_TIME_DIGITS], 16)


def group_id_of(run_id: str, policy_step: int, members: Sequence[str], layout_sha256: str, nonce: str) -> str:
    """A group's id: the digest of its run, policy step, members in stage order, the digest of its stage layout
    (layout.layout_digest) and its formation nonce. Bound in, the layout makes a group formed under another
    layout (a trainer restarted with another batch shape under the same run id) another group, and the nonce
    makes each formation of the same members another group. The text's fields are separated by `|`, which no
    run id, node id, digest or nonce contains, so two lists of fields never give one text."""
    text = f"{run_id}|{policy_step}|{','.join(members)}|{layout_sha256}|{nonce}"
    return hashlib.sha256(text.encode()).hexdigest()
