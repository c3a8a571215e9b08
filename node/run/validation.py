"""The run's task rules as both sides apply them, and verification of rollout files with a real model.

`RunTasks` is the one place that turns an assigned (task index, sample seed) into prompt tokens and a
completion into rewards, so the contributor that writes a rollout file and the validator that checks it
compute the same values. Task rewards come from the run's environment through its ScoringLimits
(node/environments/rewards.py: inline, or bounded in a worker). Length rewards follow
trainer/grpo/advantages.py: the target is drawn from the sample seed, the prompt carries the thinking
instruction, and the penalty is alpha * |len(output) - target| with len(output) counting every output
token (EOS included).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from ...proofs.checks import default_checks
from ...proofs.rollout_schema import RolloutRow
from ...proofs.verifier import (
    ModelOracle,
    VerificationContext,
    VerificationReport,
    VerifierSettings,
    run_checks,
)
from ..environments import Environment
from ..environments.length import draw_target_length, length_penalty, thinking_suffix
from ..environments.rewards import EnvironmentScorer


class RunTasks:
    """Prompts and rewards of a run: its environment, tokenizer and length-reward settings."""

    def __init__(
        self,
        environment: Environment,
        tokenizer: PreTrainedTokenizerBase,
        *,
        length_targets: Sequence[int] = (),
        length_alpha: float = 0.0,
    ) -> None:
        self.environment = environment
        self.tokenizer = tokenizer
        self.length_targets = tuple(length_targets)
        self.length_alpha = length_alpha
        self.task_count = len(environment)
        self.scorer = EnvironmentScorer(environment)

    @property
    def environment_pin(self) -> str:
        """What every row of this run carries as `environment` (the validator compares it)."""
        return self.environment.identity.pin

    @property
    def prompt_format(self) -> str:
        """What every row carries as `prompt_format`: "raw" while prompts are the task text as it is (with
        the length instruction); a chat template makes it the hash of (template, system prompt, mode)."""
        return "raw"

    def target_length(self, sample_seed: int) -> int | None:
        return draw_target_length(sample_seed, self.length_targets) if self.length_targets else None

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (one RunTasks lives as long as its run)
    def _encoded_prompt(self, sample_index: int, target: int | None) -> tuple[int, ...]:
        text = self.environment.get(sample_index).prompt
        if target is not None:
            text += thinking_suffix(target)
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, sample_index: int, sample_seed: int) -> tuple[int, ...]:
        return self._encoded_prompt(sample_index, self.target_length(sample_seed))

    def rewards_for(
        self, sample_index: int, sample_seed: int, output_ids: Sequence[int]
    ) -> tuple[float, float, int | None]:
        """(task reward, length penalty, target length) of one completion."""
        task = self.environment.get(sample_index)
        text = str(self.tokenizer.decode(list(output_ids), skip_special_tokens=True))
        task_reward = self.scorer(text, task)
        target = self.target_length(sample_seed)
        penalty = length_penalty(len(output_ids), target, self.length_alpha) if target is not None else 0.0
        return task_reward, penalty, target

    def rewards(self, row: RolloutRow) -> tuple[float, float, int | None]:
        return self.rewards_for(row.sample_index, row.sample_seed, row.output_ids)


def verify_rollout_file(
    path: Path,
    model: ModelOracle,
    tasks: RunTasks,
    settings: VerifierSettings | None = None,
    rng: random.Random | None = None,
) -> VerificationReport:
    """Run every check on the rollout file at `path` against the claimed checkpoint (`model`)."""
    ctx = VerificationContext(
        path=Path(path),
        settings=settings or VerifierSettings(),
        model=model,
        tasks=tasks,
        rng=rng or random.SystemRandom(),  # a node must not predict which rows get the expensive checks
    )
    return run_checks(default_checks(), ctx)
