"""Asynchronous batch assembly from accepted rollouts, inside the async window, without zero-signal groups.

Rollout files arrive (already accepted by a validator) in any order and from policies of various ages. The
buffer groups each file's samples by prompt, recomputes the group statistics, drops groups with all-zero
advantages at once (online filtering), and, when asked for the batch of step N (the trainer holds weights
N), evicts groups from policies older than N - async_level and returns whole groups, oldest policy first
(they expire first), until the batch holds `batch_size` samples. A group is one prompt's completions from
ONE file: completions of the same prompt from two files were sampled independently, possibly by different
policies, so their rewards are not pooled.

Every decision is written to the ConsumedLedger (trainer/service/consumed.py) so a restarted trainer that re-reads
its accepted-rollouts directory skips what it already used or discarded. A group any of whose samples (by
identity, proofs/work_identity.py) is already recorded or buffered is skipped whole: two accepted files that
carry the same work (two validators' copies, in two encodings or cut differently) give it to training once.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import TrainerError
from ..grpo.advantages import GroupStats, group_advantages
from ..grpo.packing import TrainSample
from .consumed import ConsumedLedger, GroupKey

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutSample:
    """One completion as the validator accepted it (rewards recomputed by the validator)."""

    prompt_key: str  # which prompt (e.g. the task index); equal keys in one file form a group
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    task_reward: float
    length_penalty: float = 0.0  # alpha * |length - target|, 0 when length rewards are off
    sample_id: str | None = (
        None  # SampleId.key() of the row (trainer/service/inbox.py); None: known by file only
    )

    @property
    def reward(self) -> float:
        return self.task_reward - self.length_penalty


@dataclass(frozen=True)
class RolloutRecord:
    """The contents of one accepted rollout file."""

    file_id: str  # SHA-256 (hex) of the file: the identity the consumed record uses
    policy_step: int  # step of the checkpoint that generated every sample in the file
    samples: tuple[RolloutSample, ...]


@dataclass(frozen=True)
class ScoredGroup:
    file_id: str
    prompt_key: str
    policy_step: int
    samples: tuple[RolloutSample, ...]
    stats: GroupStats

    @property
    def key(self) -> GroupKey:
        return (self.file_id, self.prompt_key)

    def sample_keys(self) -> list[tuple[str, GroupKey]]:
        """(sample identity, this group's key) for each sample that has an identity: what the record keeps."""
        return [(s.sample_id, self.key) for s in self.samples if s.sample_id is not None]

    def train_samples(self) -> list[TrainSample]:
        return [
            TrainSample(s.prompt_ids, s.completion_ids, a)
            for s, a in zip(self.samples, self.stats.advantages, strict=True)
        ]


@dataclass(frozen=True)
class Batch:
    step: int  # the policy step the batch trains (weights step -> step + 1)
    groups: tuple[ScoredGroup, ...]

    def train_samples(self) -> list[TrainSample]:
        return [t for g in self.groups for t in g.train_samples()]

    @property
    def num_samples(self) -> int:
        return sum(len(g.samples) for g in self.groups)

    def reward_metrics(self) -> dict[str, float]:
        """Means over the batch's samples: task reward, length penalty, and policy lag in steps."""
        samples = [(s, g.policy_step) for g in self.groups for s in g.samples]
        n = max(len(samples), 1)
        return {
            "task_reward": sum(s.task_reward for s, _ in samples) / n,
            "length_penalty": sum(s.length_penalty for s, _ in samples) / n,
            "policy_lag": sum(self.step - step for _, step in samples) / n,
            "groups": float(len(self.groups)),
            "samples": float(len(samples)),
        }


@dataclass(frozen=True)
class AddReport:
    accepted: bool  # False: the buffer is full; keep the file and offer it again later
    kept: int = 0  # groups now waiting for a batch
    filtered: int = 0  # groups dropped for all-zero advantages
    stale: int = 0  # groups dropped as older than the async window
    already_known: int = 0  # groups the ledger (or the buffer) already had


class BatchBuffer:
    def __init__(
        self,
        ledger: ConsumedLedger,
        *,
        batch_size: int,
        async_level: int,
        advantage_eps: float = 1e-6,
        max_buffered_samples: int = 65_536,
    ) -> None:
        if batch_size < 1 or async_level < 0 or max_buffered_samples < batch_size:
            raise TrainerError(
                "need batch_size >= 1, async_level >= 0 and max_buffered_samples >= batch_size"
            )
        self.ledger = ledger
        self.batch_size = batch_size
        self.async_level = async_level
        self.advantage_eps = advantage_eps
        self.max_buffered_samples = max_buffered_samples
        self._groups: OrderedDict[GroupKey, ScoredGroup] = OrderedDict()
        self._samples = 0
        self._buffered_ids: set[str] = set()  # sample identities of the buffered groups

    @property
    def buffered_samples(self) -> int:
        return self._samples

    def pending_keys(self) -> list[GroupKey]:
        """Keys of the groups waiting for a batch, in arrival order."""
        return list(self._groups)

    def oldest_usable_step(self, current_step: int) -> int:
        return current_step - self.async_level

    def add(self, record: RolloutRecord, current_step: int) -> AddReport:
        """Group, score and filter one accepted file; the trainer holds weights `current_step`."""
        if record.policy_step > current_step:
            # Only checkpoints the trainer saved can be announced, and it resumes from its latest, so this
            # is a validator bug; refuse loudly rather than train on data from an unknown policy.
            raise TrainerError(
                f"rollout file {record.file_id} claims policy step {record.policy_step}, "
                f"newer than the trainer's {current_step}; the validator must check it against published "
                "checkpoints"
            )
        if self._samples > 0 and self._samples + len(record.samples) > self.max_buffered_samples:
            return AddReport(accepted=False)
        by_prompt: dict[str, list[RolloutSample]] = {}
        for s in record.samples:
            by_prompt.setdefault(s.prompt_key, []).append(s)
        known = self.ledger.known(record.file_id)
        ids = [s.sample_id for s in record.samples if s.sample_id is not None]
        seen = self.ledger.seen_samples(ids) | (self._buffered_ids & set(ids))
        stale = record.policy_step < self.oldest_usable_step(current_step)
        kept = filtered = dropped_stale = already = 0
        zero: list[ScoredGroup] = []
        old: list[ScoredGroup] = []
        for prompt_key, samples in by_prompt.items():
            key = (record.file_id, prompt_key)
            if prompt_key in known or key in self._groups or any(s.sample_id in seen for s in samples):
                already += 1
                continue
            group = ScoredGroup(
                record.file_id,
                prompt_key,
                record.policy_step,
                tuple(samples),
                group_advantages([s.reward for s in samples], self.advantage_eps),
            )
            if not group.stats.informative:
                zero.append(group)
                filtered += 1
            elif stale:
                old.append(group)
                dropped_stale += 1
            else:
                self._keep(group)
                kept += 1
        for groups, reason in ((zero, "zero_advantage"), (old, "stale")):
            if groups:
                self.ledger.drop(
                    current_step,
                    [g.key for g in groups],
                    reason,
                    [k for g in groups for k in g.sample_keys()],
                )
        return AddReport(True, kept, filtered, dropped_stale, already)

    def _keep(self, group: ScoredGroup, *, front: bool = False) -> None:
        self._groups[group.key] = group
        if front:
            self._groups.move_to_end(group.key, last=False)
        self._samples += len(group.samples)
        self._buffered_ids.update(sid for sid, _ in group.sample_keys())

    def _forget(self, key: GroupKey) -> ScoredGroup:
        group = self._groups.pop(key)
        self._samples -= len(group.samples)
        self._buffered_ids.difference_update(sid for sid, _ in group.sample_keys())
        return group

    def evict_stale(self, current_step: int) -> int:
        """Drop (and record) buffered groups from policies older than the async window allows."""
        limit = self.oldest_usable_step(current_step)
        old = [self._forget(k) for k, g in list(self._groups.items()) if g.policy_step < limit]
        if old:
            self.ledger.drop(
                current_step, [g.key for g in old], "stale", [k for g in old for k in g.sample_keys()]
            )
            logger.info("dropped %d rollout groups older than policy step %d", len(old), limit)
        return len(old)

    def take(self, current_step: int) -> Batch | None:
        """The batch for step `current_step`, reserved in the ledger; None until enough samples wait."""
        self.evict_stale(current_step)
        if self._samples < self.batch_size:
            return None
        order = sorted(
            self._groups.values(), key=lambda g: g.policy_step
        )  # stable: arrival order within a step
        chosen: list[ScoredGroup] = []
        total = 0
        for g in order:
            if total >= self.batch_size:
                break
            chosen.append(g)
            total += len(g.samples)
        self.ledger.reserve(
            current_step, [g.key for g in chosen], [k for g in chosen for k in g.sample_keys()]
        )
        for g in chosen:
            self._forget(g.key)
        return Batch(step=current_step, groups=tuple(chosen))

    def commit(self, batch: Batch) -> None:
        """The checkpoint trained on `batch` is durable: its groups are consumed for good."""
        self.ledger.commit(batch.step)

    def release(self, batch: Batch) -> None:
        """Training on `batch` failed before its checkpoint: return its groups to the buffer, front first."""
        self.ledger.release(batch.step)
        for g in reversed(batch.groups):
            self._keep(g, front=True)
