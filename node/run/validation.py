"""The run's task rules as both sides apply them, and verification of rollout files with a real model.

`RunTasks` is the one place that turns an assigned (task index, sample seed) into prompt tokens and a
completion into rewards, so the contributor that writes a rollout file and the validator that checks it
compute the same values. Prompts are built by prompts.py (the raw task text, or the checkpoint's chat
template with the run's system prompt). Task rewards come from the run's environment through its
ScoringLimits (node/environments/rewards.py: inline, or bounded in a worker). Length rewards follow
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
from ..environments.length import draw_target_length, length_penalty
from ..environments.rewards import EnvironmentScorer
from ..errors import PromptError
from .prompts import PromptBuilder


class RunTasks:
    """Prompts and rewards of a run: its environment, tokenizer, system prompt and length-reward settings.

    Construction renders a probe prompt (PromptBuilder.check): a chat template that cannot render the run's
    prompts raises PromptError here, when a node or validator loads the checkpoint, not mid-run."""

    def __init__(
        self,
        environment: Environment,
        tokenizer: PreTrainedTokenizerBase,
        *,
        length_targets: Sequence[int] = (),
        length_alpha: float = 0.0,
        system_prompt: str = "",
    ) -> None:
        self.environment = environment
        self.tokenizer = tokenizer
        self.length_targets = tuple(length_targets)
        self.length_alpha = length_alpha
        self.task_count = len(environment)
        self.scorer = EnvironmentScorer(environment)
        self.prompts = PromptBuilder(tokenizer, system_prompt=system_prompt)
        self.prompts.check([environment.get(0).prompt] if self.task_count else [], self.length_targets)

    @property
    def environment_pin(self) -> str:
        """What every row of this run carries as `environment` (the validator compares it)."""
        return self.environment.identity.pin

    @property
    def prompt_format(self) -> str:
        """What every row carries as `prompt_format`: "sha256:<hex>" of (mode, chat template, system prompt,
        length instruction)."""
        return self.prompts.prompt_format

    def target_length(self, sample_seed: int) -> int | None:
        return draw_target_length(sample_seed, self.length_targets) if self.length_targets else None

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (one RunTasks lives as long as its run)
    def _encoded_prompt(self, sample_index: int, target: int | None) -> tuple[int, ...]:
        try:
            return self.prompts.ids(self.environment.get(sample_index).prompt, target)
        except PromptError as exc:  # a template that fails only for some texts: name the task
            raise PromptError(f"task {sample_index}: {exc}") from None

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
