"""Which validator judges a batch: one owner per (run, node, policy step, batch counter) in the whole swarm.

Each validator keeps its own ledger, so the swarm credits a piece of work once only if exactly one validator
may judge it. The owner is a pure function of the batch and the validator set, computed alike by the node
that sends and by the validator that receives (rendezvous, or highest-random-weight, hashing):

    score(v) = SHA-256("prime-node/validator-assignment/v1\\0" | u16be len(run id) | run id (UTF-8) |
                       node id (32 bytes) | u64be policy step | u64be batch counter | v's node id (32 bytes))
    owner    = the validator with the highest score among those eligible for the step

A validator is *live* when it is announced by a pinned operator key and its own signed heartbeat has not
expired. Among the live validators, those *eligible* for step S are the ones whose announcement's `from_step`
is at most S, or, when none is, the ones with the smallest `from_step` (so that every step always has an
owner while any validator is live: the batches of the last eligible validator to leave are not stranded).
Rendezvous hashing moves only what it must: a validator that leaves hands each of its batches to the
runner-up of that batch, and nobody else's batch moves; one that joins takes only batches of steps from its
`from_step` on, which is past every step that exists when it announces (trainer/validator/assignment.py), so
no batch another validator may already have judged changes hands when one joins or comes back.
docs/protocol.md, "Work identity", says what a departure still allows and why.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from typing import NamedTuple

from .records import ValidatorAnnouncement

DOMAIN = b"prime-node/validator-assignment/v1\x00"


class Batch(NamedTuple):
    """The unit of work a validator owns: one node's batch at one policy step (rows carry all three), or one
    pipelined group's batch, by its group id (every stage file of it goes to one validator, which judges the
    group as a whole; a group id is a SHA-256 digest, so it names no node's batch)."""

    node_id: str  # 64 hex digits: the node's id, or the group's
    policy_step: int
    batch_counter: int

    def describe(self) -> str:
        return f"batch {self.batch_counter} of node {self.node_id[:16]}… at policy step {self.policy_step}"


def score(run_id: str, batch: Batch, validator_id: str) -> bytes:
    """The validator's rendezvous weight for the batch (compared as bytes, largest wins)."""
    run = run_id.encode()
    return hashlib.sha256(
        DOMAIN
        + struct.pack(">H", len(run))
        + run
        + bytes.fromhex(batch.node_id)
        + struct.pack(">QQ", batch.policy_step, batch.batch_counter)
        + bytes.fromhex(validator_id)
    ).digest()


def eligible(validators: Iterable[ValidatorAnnouncement], step: int) -> list[ValidatorAnnouncement]:
    """The live `validators` that take work of policy step `step` (the module docstring)."""
    live = list(validators)
    if not live:
        return []
    threshold = max(step, min(v.from_step for v in live))  # no validator takes the step: the earliest do
    return [v for v in live if v.from_step <= threshold]


def owner(
    run_id: str, batch: Batch, validators: Iterable[ValidatorAnnouncement]
) -> ValidatorAnnouncement | None:
    """The one validator that judges `batch` among the live, announced `validators`; None when there is none."""
    candidates = eligible(validators, batch.policy_step)
    if not candidates:
        return None
    return max(candidates, key=lambda v: score(run_id, batch, v.node_id))
