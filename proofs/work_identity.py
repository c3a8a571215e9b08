"""What a sample of work is, whatever file carries it: its identity, and repeats within one file.

A rollout row is one completion of one assigned problem. Its identity is

    (run id, node id, policy step, batch counter, sample index, sample seed)

The first four name the batch (proofs/assignment.py derives its work from them); the sample index names the
problem, and the seed names the completion, since the G completions of one problem share its index and each
has its own assigned seed. A validator's assignment check pins index and seed to the batch, so an accepted row
can only ever carry the identity of the work it really is; the bytes of the file do not enter it. Another
Parquet encoding of the same rows, a prefix of the batch, the rows reordered, or the rows mixed with new ones
all repeat the same identities: that is how the validator's ledger (trainer/ledger/ledger.py, table
`accepted_samples`) and the trainer's consumed record (trainer/service/consumed.py) recognise work already taken.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from .rollout_schema import RolloutRow


class SampleId(NamedTuple):
    """The identity of one sample (one rollout row); field meanings as in proofs/rollout_schema.py SCHEMA."""

    run_id: str
    node_id: str
    policy_step: int
    batch_counter: int
    sample_index: int
    sample_seed: int

    def key(self) -> str:
        """One string per identity, for stores keyed by text. The run id comes first with its length, so no
        choice of run id can make two identities spell the same key; the other fields hold no '/'."""
        return (
            f"{len(self.run_id)}:{self.run_id}/{self.node_id}/{self.policy_step}/{self.batch_counter}/"
            f"{self.sample_index}/{self.sample_seed}"
        )

    def describe(self) -> str:
        return (
            f"run {self.run_id!r}, node {self.node_id[:16]}…, policy step {self.policy_step}, "
            f"batch {self.batch_counter}, sample index {self.sample_index}, seed {self.sample_seed}"
        )


def sample_id(row: RolloutRow) -> SampleId:
    return SampleId(
        row.run_id, row.node_id, row.policy_step, row.batch_counter, row.sample_index, row.sample_seed
    )


def sample_ids(rows: Iterable[RolloutRow]) -> tuple[SampleId, ...]:
    return tuple(sample_id(r) for r in rows)


def first_repeat(ids: Sequence[SampleId]) -> tuple[int, int] | None:
    """(earlier row, later row) of the first identity that occurs twice, or None when all are distinct."""
    seen: dict[SampleId, int] = {}
    for row, identity in enumerate(ids):
        earlier = seen.setdefault(identity, row)
        if earlier != row:
            return earlier, row
    return None
