"""Helpers shared by the ledger, slashing, verdict and leaderboard tests: real keys, real signed verdicts."""

from __future__ import annotations

import hashlib
import itertools

from prime_node.p2p.identity import Identity
from prime_node.p2p.verdicts import Signed, Verdict, sign

T0 = 1_800_000_000.0  # a fixed clock, so tests do not depend on when they run
VALIDATOR = Identity.from_seed(bytes(range(32)))
_counter = itertools.count()


def node_id(n: int) -> str:
    return Identity.from_seed(bytes([n + 1]) * 32).node_id


def fresh_hash() -> str:
    return hashlib.sha256(f"rollout-file-{next(_counter)}".encode()).hexdigest()


def make_verdict(
    node: str,
    *,
    accepted: bool = True,
    failed_check: str | None = None,
    at: float = T0,
    samples: int = 8,
    tokens: int = 256,
    step: int = 3,
    file_hash: str | None = None,
    reason: str | None = None,
) -> Verdict:
    return Verdict(
        file_hash=file_hash or fresh_hash(),
        node_id=node,
        step=step,
        samples=samples,
        tokens=tokens,
        accepted=accepted,
        failed_check=failed_check,
        reason=reason if reason is not None else ("" if accepted else f"{failed_check} check failed"),
        validator_id=VALIDATOR.node_id,
        decided_at=at,
    )


def signed_verdict(node: str, **kwargs: object) -> Signed[Verdict]:
    return sign(make_verdict(node, **kwargs), VALIDATOR)  # type: ignore[arg-type]
