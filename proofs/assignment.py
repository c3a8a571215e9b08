"""Deterministic work assignment: which problems a node solves, and with which sampling seeds.

A node may not choose its own samples (it would keep the easy ones). The problems of one batch and the
seed of every completion are a pure function of (run seed, node id, policy step, batch counter): a
SHA-256 key over those integers, then SHA-256 in counter mode as the random stream. No global RNG, no
platform-dependent generator, so a validator re-derives the same assignment anywhere and rejects a file
whose indices or seeds differ in any row.

Problem indices are distinct within a batch and drawn without modulo bias (rejection sampling). The
completion seeds are in [0, 2^63) as the Gumbel noise requires, one per (prompt slot, completion).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from .errors import ProofError

_DOMAIN = b"prime-node/assignment/v1\x00"
# A pipelined group's batch (node/pipeline/work.py): keyed by the group id, which is a digest of run, step and
# members (proofs/pipeline/records.py GroupSpec), under its own domain so no group id can stand for a node id.
_GROUP_DOMAIN = b"prime-node/group-assignment/v1\x00"
_U64 = 1 << 64
MAX_SEED = (1 << 63) - 1


class AssignmentError(ProofError):
    """A rollout file's problems or seeds are not the ones its node was assigned."""


@dataclass(frozen=True)
class Assignment:
    """The work of one batch: problem indices and, per problem, the seeds of its G completions."""

    sample_indices: tuple[int, ...]
    sample_seeds: tuple[tuple[int, ...], ...]  # [prompt slot][completion]

    def rows(self) -> Iterator[tuple[int, int]]:
        """(sample index, sample seed) in file row order: prompt-major, completions in seed order."""
        for index, seeds in zip(self.sample_indices, self.sample_seeds, strict=True):
            for seed in seeds:
                yield index, seed


def _key(run_seed: int, node_id: str, policy_step: int, batch_counter: int, domain: bytes = _DOMAIN) -> bytes:
    try:
        node = bytes.fromhex(node_id)
    except ValueError:
        raise AssignmentError(f"node id must be hex (an Ed25519 public key), got {node_id[:80]!r}") from None
    for name, value in (
        ("run seed", run_seed),
        ("policy step", policy_step),
        ("batch counter", batch_counter),
    ):
        if not 0 <= value < _U64:
            raise AssignmentError(f"{name} {value} is outside [0, 2^64)")
    return hashlib.sha256(
        domain
        + struct.pack(">Q", run_seed)
        + struct.pack(">H", len(node))
        + node
        + struct.pack(">QQ", policy_step, batch_counter)
    ).digest()


def _stream(key: bytes, purpose: bytes) -> Iterator[int]:
    """Unbounded 64-bit words: SHA-256(key || purpose || block counter), four words per block."""
    block = 0
    while True:
        digest = hashlib.sha256(key + purpose + struct.pack(">Q", block)).digest()
        yield from struct.unpack(">4Q", digest)
        block += 1


def assign(
    run_seed: int,
    node_id: str,
    policy_step: int,
    batch_counter: int,
    *,
    task_count: int,
    prompts: int,
    samples: int,
    group: bool = False,
) -> Assignment:
    """The assignment of one batch: `prompts` distinct problems of [0, task_count), `samples` seeds each.

    With `group`, `node_id` is a pipelined group's id (64 hex digits) and the batch is the group's: every member
    and the validator derive the same work from it, and no member can choose it."""
    if task_count < 1 or not 1 <= prompts <= task_count or samples < 1:
        raise AssignmentError(
            f"cannot assign {prompts} distinct prompts x {samples} samples from {task_count} tasks"
        )
    key = _key(run_seed, node_id, policy_step, batch_counter, _GROUP_DOMAIN if group else _DOMAIN)
    limit = _U64 - _U64 % task_count  # words at or above this would bias the modulo: drawn again
    chosen: list[int] = []
    seen: set[int] = set()
    for word in _stream(key, b"indices"):
        if word >= limit:
            continue
        index = word % task_count
        if index not in seen:
            seen.add(index)
            chosen.append(index)
            if len(chosen) == prompts:
                break
    seeds = _stream(key, b"seeds")
    sample_seeds = tuple(tuple(next(seeds) & MAX_SEED for _ in range(samples)) for _ in range(prompts))
    return Assignment(tuple(chosen), sample_seeds)


def check_assignment(
    rows: list[tuple[int, int]],
    run_seed: int,
    node_id: str,
    policy_step: int,
    batch_counter: int,
    *,
    task_count: int,
    samples: int,
    prompts: int | None = None,
    group: bool = False,
) -> None:
    """Raise AssignmentError unless `rows` ((index, seed) in file order) are exactly the assignment.

    `prompts` defaults to rows / samples: a node may do fewer prompts than configured (less work, never
    other work), but each prompt must carry all `samples` completions, so it cannot drop unlucky ones.
    """
    if not rows or len(rows) % samples:
        raise AssignmentError(f"{len(rows)} rows is not a positive multiple of {samples} samples per prompt")
    expected_prompts = prompts if prompts is not None else len(rows) // samples
    if len(rows) != expected_prompts * samples:
        raise AssignmentError(f"{len(rows)} rows, expected {expected_prompts} prompts x {samples} samples")
    expected = list(
        assign(
            run_seed,
            node_id,
            policy_step,
            batch_counter,
            task_count=task_count,
            prompts=expected_prompts,
            samples=samples,
            group=group,
        ).rows()
    )
    for row, (got, want) in enumerate(zip(rows, expected, strict=True)):
        if got[0] != want[0]:
            raise AssignmentError(f"row {row}: sample index {got[0]} was not assigned (expected {want[0]})")
        if got[1] != want[1]:
            raise AssignmentError(f"row {row}: sample seed {got[1]} was not assigned (expected {want[1]})")
