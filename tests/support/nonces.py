"""Formation nonces (p2p/pipeline/group_ids.py) for groups the tests make up without a coordinator: fixed
"random" bytes, so a test's group ids are the same on every run."""

from __future__ import annotations

from prime_node.p2p.pipeline.group_ids import formed_ms, nonce_formed_ms


def nonce_at(formed_at: float, salt: int = 0x5A) -> str:
    """The nonce of a group formed at `formed_at` (what a group record with that `formed_at` must carry)."""
    return f"{formed_ms(formed_at):016x}" + f"{salt:02x}" * 16


def formed_at_of(nonce: str) -> float:
    """A `formed_at` whose whole milliseconds are `nonce`'s: the middle of that millisecond, so no float rounding
    moves it to a neighbour."""
    return (nonce_formed_ms(nonce) + 0.5) / 1000


# Formed at 1.7e9 s (2023-11-14).
NONCE = nonce_at(1_700_000_000.0)
