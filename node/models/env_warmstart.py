"""Warm start on any environment: supervised fine-tuning of a model on the environment's own reference
answers, then held-out accuracy scored by the environment's own scorer.

The arithmetic warm start (warmstart.py) generalised to an `Environment` (a reasoning-gym family, a task
file): RL needs a model that already answers some held-out prompts, and a procedural environment generates
as many (prompt, answer) pairs as training needs. Held-out prompts are chosen by content
(node/environments/split.py): a held-out prompt is never trained on, whatever index it comes under, and
evaluation takes held-out problems from the end of the index range. Accuracy is the share of greedy
completions the environment scores 1.0 (`exact`); the mean reward is reported beside it, since some
families give partial credit. Deterministic for a given (model, environment, config, torch build, threads).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..environments.environment import Environment
from ..environments.split import ContentSplit
from ..environments.types import Task
from ..errors import ModelError
from ..run.prompts import PromptBuilder
from .sft_loop import SftLoop, SftRecipe
from .tiny import build_tiny_model, save_model_dir
from .warmstart import (
    RUN_INFO_FILE,
    WEIGHTS_FILE,
    _encode_batch,
    deterministic_torch,
    file_sha256,
    greedy_complete,
)

logger = logging.getLogger(__name__)


class EnvWarmStartConfig(BaseModel):
    """How the warm start on an environment trains and evaluates."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(
        600, ge=0, le=1_000_000, description="Optimizer steps of supervised training (0: none)."
    )
    batch_size: int = Field(64, ge=1, le=4096, description="Problems per optimizer step.")
    lr: float = Field(3e-3, gt=0, le=1.0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(
        50, ge=0, description="Steps of linear learning-rate warm-up before cosine decay."
    )
    weight_decay: float = Field(0.01, ge=0, le=1.0, description="AdamW decoupled weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    heldout_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="Share of prompt texts held out by content: never trained on."
    )
    eval_size: int = Field(500, ge=1, le=100_000, description="Held-out problems scored after training.")
    eval_max_new_tokens: int = Field(16, ge=1, le=1024, description="Greedy decoding budget per problem.")
    threads: int = Field(
        1, ge=1, le=256, description="torch CPU threads; the weights' hash can depend on it."
    )


class EnvWarmStartReport(BaseModel):
    """What a warm start on an environment did, and how well the result answers held-out prompts."""

    steps: int
    final_loss: float | None  # mean loss over the last 20 steps; None without training
    heldout_exact: float  # share of held-out greedy completions the environment scores 1.0
    heldout_mean_reward: float
    eval_size: int
    train_seconds: float
    eval_seconds: float


def heldout_tasks(environment: Environment, config: EnvWarmStartConfig) -> list[Task]:
    """The evaluation problems: the last `eval_size` held-out prompts, scanning down from the end."""
    split = ContentSplit(config.heldout_fraction)
    scan = min(len(environment), int(config.eval_size / config.heldout_fraction * 4) + 1000)
    found = split.heldout_from_end(environment, config.eval_size, scan)
    if len(found) < config.eval_size:
        raise ModelError(f"only {len(found)} held-out problems among the last {scan}; lower eval_size")
    return found


def _batches(environment: Environment, config: EnvWarmStartConfig) -> Iterator[list[Task]]:
    problems = ContentSplit(config.heldout_fraction).trainable(environment)
    for _ in range(config.steps):
        batch = [task for _, task in zip(range(config.batch_size), problems)]
        if len(batch) < config.batch_size:
            raise ModelError(f"{environment.spec} ran out of training problems; raise its size")
        yield batch


def train(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    environment: Environment,
    config: EnvWarmStartConfig,
) -> float | None:
    """Supervised training in place on prompt -> reference answer + EOS; the mean loss of the last 20 steps."""
    prompts_of = PromptBuilder(tokenizer)  # the run's format (raw text or the chat template)
    batches = (_encode_batch(tokenizer, prompts_of, batch) for batch in _batches(environment, config))
    return SftLoop(model, SftRecipe.of(config)).run(batches)


def greedy_rewards(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    environment: Environment,
    tasks: Sequence[Task],
    max_new_tokens: int,
) -> list[float]:
    """The environment's rewards of greedy completions of `tasks` (the model's own text: scored in-process)."""
    prompts_of = PromptBuilder(tokenizer)  # as in training, and as a run gives prompts to this model
    completions = greedy_complete(
        model, tokenizer, [prompts_of.text(t.prompt) for t in tasks], max_new_tokens
    )
    return [environment.score(c, t) for c, t in zip(completions, tasks)]


def warm_start_environment(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    environment: Environment,
    config: EnvWarmStartConfig | None = None,
) -> EnvWarmStartReport:
    """Train `model` in place on `environment`'s reference answers, then measure held-out accuracy."""
    config = config or EnvWarmStartConfig()
    heldout = heldout_tasks(environment, config)
    with deterministic_torch(config.threads):
        started = time.perf_counter()
        final_loss = train(model, tokenizer, environment, config)
        trained = time.perf_counter()
        rewards = greedy_rewards(model, tokenizer, environment, heldout, config.eval_max_new_tokens)
        evaluated = time.perf_counter()
    exact = sum(r == 1.0 for r in rewards) / len(rewards)
    logger.info(
        "warm start on %s: %d steps, loss %s, held-out exact %.1f%%",
        environment.spec,
        config.steps,
        final_loss,
        100 * exact,
    )
    return EnvWarmStartReport(
        steps=config.steps,
        final_loss=final_loss,
        heldout_exact=exact,
        heldout_mean_reward=sum(rewards) / len(rewards),
        eval_size=len(heldout),
        train_seconds=trained - started,
        eval_seconds=evaluated - trained,
    )


def init_env_model_dir(
    out_dir: Path, environment: Environment, seed: int = 0, config: EnvWarmStartConfig | None = None
) -> EnvWarmStartReport:
    """The tiny model from `seed`, warm-started on `environment`, saved as an HF directory whose prime_node.json
    records the environment and the split (benchmarks/learning.py refuses a --model warm-started otherwise)."""
    config = config or EnvWarmStartConfig()
    model, tokenizer = build_tiny_model(seed)
    report = warm_start_environment(model, tokenizer, environment, config)
    save_model_dir(model, tokenizer, out_dir)
    info = {
        "format": 1,
        "seed": seed,
        "env": environment.spec,
        "warm_start": config.model_dump(mode="json"),
        "heldout_exact": report.heldout_exact,
        "heldout_mean_reward": report.heldout_mean_reward,
        "final_loss": report.final_loss,
        "model_sha256": file_sha256(Path(out_dir) / WEIGHTS_FILE),
        "torch_version": torch.__version__,
    }
    (Path(out_dir) / RUN_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return report
