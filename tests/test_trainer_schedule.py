"""Trainer settings (bounds, cross-checks, env/TOML loading) and the optimizer schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import Field, ValidationError

from prime_node.node.config import CommonSettings, load_config
from prime_node.node.errors import ConfigError
from prime_node.trainer.errors import TrainerError
from prime_node.trainer.grpo.config import TrainerSettings
from prime_node.trainer.grpo.schedule import (
    apply_step,
    build_optimizer,
    build_scheduler,
    lr_factor,
    split_evenly,
    warmup_factor,
)


class _Command(CommonSettings):
    trainer: TrainerSettings = Field(default_factory=TrainerSettings, description="The GRPO recipe.")


def test_defaults_follow_the_recipe() -> None:
    s = TrainerSettings()
    assert (s.eps_low, s.eps_high, s.delta, s.kl_coef, s.grad_clip, s.async_level) == (
        0.2,
        0.2,
        4.0,
        0.001,
        0.1,
        2,
    )
    for name, field in TrainerSettings.model_fields.items():
        assert field.description, f"{name} needs a description"


def test_cross_field_checks() -> None:
    with pytest.raises(ValidationError, match="delta"):
        TrainerSettings(eps_high=0.5, delta=1.4)
    with pytest.raises(ValidationError, match="optimizer_steps_per_batch"):
        TrainerSettings(batch_size=1, optimizer_steps_per_batch=2)
    with pytest.raises(ValidationError):
        TrainerSettings(grad_clip=0.0)


def test_loads_from_toml_env_and_flags(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("[trainer]\neps_high = 0.28\nwarmup_steps = 5\nasync_level = 1\n")
    env = {"PRIME_NODE_TRAINER__ASYNC_LEVEL": "3", "PRIME_NODE_TRAINER__LR": "3e-7"}
    s = load_config(_Command, toml_path=toml, env=env, cli_overrides={"trainer.batch_size": 128}).trainer
    assert (s.eps_high, s.warmup_steps, s.async_level, s.lr, s.batch_size) == (0.28, 5, 3, 3e-7, 128)
    with pytest.raises(ConfigError, match="trainer.delta"):
        load_config(_Command, env={"PRIME_NODE_TRAINER__DELTA": "0.5"})


def test_linear_warmup_then_constant() -> None:
    assert [warmup_factor(k, 4) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0
    assert [lr_factor(k, 4) for k in (0, 3, 100)] == [0.25, 1.0, 1.0]  # no decay by default


def test_linear_decay_after_warmup_to_the_floor() -> None:
    factors = [lr_factor(k, 2, decay_steps=6, min_ratio=0.2) for k in range(9)]
    assert factors == pytest.approx([0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2])
    settings = TrainerSettings(lr=1.0, warmup_steps=0, decay_steps=4, min_lr_ratio=0.0)
    opt = build_optimizer(torch.nn.Linear(2, 1), settings)
    sched = build_scheduler(opt, settings)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


def _model_with_grad(scale: float) -> torch.nn.Module:
    model = torch.nn.Linear(3, 2)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    (model(torch.ones(1, 3)).sum() * scale).backward()  # every grad entry = scale: norm = scale * sqrt(8)
    return model


def test_step_clips_the_global_norm_and_warms_up() -> None:
    settings = TrainerSettings(lr=1.0, warmup_steps=2, grad_clip=0.1, adam_beta1=0.0, adam_beta2=0.0)
    model = _model_with_grad(10.0)
    opt = build_optimizer(model, settings)
    sched = build_scheduler(opt, settings)
    grads = [p.grad.clone() for p in model.parameters()]
    clipped_norm = None

    def capture(optimizer: torch.optim.Optimizer, *args: object, **kwargs: object) -> None:
        nonlocal clipped_norm
        clipped_norm = float(
            torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
        )

    handle = opt.register_step_pre_hook(capture)
    result = apply_step(model, opt, sched, settings.grad_clip)
    handle.remove()
    assert result.grad_norm == pytest.approx(10.0 * 8**0.5)  # reported before clipping
    assert clipped_norm == pytest.approx(0.1, rel=1e-5)  # what the optimizer actually saw
    assert result.lr == pytest.approx(0.5) and not result.skipped  # first warmup step: half the peak
    assert all(p.grad is None for p in model.parameters())
    assert all(g.abs().sum() > 0 for g in grads)
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)


def test_non_finite_gradient_is_skipped() -> None:
    settings = TrainerSettings()
    model = _model_with_grad(float("inf"))
    before = [p.detach().clone() for p in model.parameters()]
    opt = build_optimizer(model, settings)
    result = apply_step(model, opt, build_scheduler(opt, settings), settings.grad_clip)
    assert result.skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(TrainerError, match="no gradients"):
        apply_step(model, opt, build_scheduler(opt, settings), settings.grad_clip)


def test_split_evenly() -> None:
    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_evenly([1], 1) == [[1]]
    with pytest.raises(TrainerError):
        split_evenly([1, 2], 3)
