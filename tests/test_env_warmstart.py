"""The warm start on an environment (node/models/env_warmstart.py): supervised training on a real
reasoning-gym family's reference answers, held-out prompts never trained on, scored by the family."""

from __future__ import annotations

import math

from prime_node.node.environments.reasoning_gym import open_reasoning_gym
from prime_node.node.models.env_warmstart import (
    EnvWarmStartConfig,
    _batches,
    heldout_tasks,
    warm_start_environment,
)
from prime_node.node.models.tiny import TinyModelShape, build_tiny_model


def test_warm_start_trains_on_the_familys_answers_and_scores_unseen_prompts_with_its_scorer() -> None:
    env = open_reasoning_gym("family=spell_backward,max_word_len=4", seed=0)
    config = EnvWarmStartConfig(steps=30, batch_size=8, warmup_steps=5, eval_size=16, eval_max_new_tokens=6)
    heldout = {t.prompt for t in heldout_tasks(env, config)}
    trained = {t.prompt for batch in _batches(env, config) for t in batch}
    assert len(heldout) == 16 and trained and not heldout & trained
    model, tokenizer = build_tiny_model(0, TinyModelShape())
    report = warm_start_environment(model, tokenizer, env, config)
    assert report.steps == 30 and report.eval_size == 16
    # Training moved the model off uniform next-character guessing (ln 259 = 5.56 nats).
    assert report.final_loss is not None and report.final_loss < math.log(259) - 1.5
    assert 0.0 <= report.heldout_exact <= report.heldout_mean_reward <= 1.0
