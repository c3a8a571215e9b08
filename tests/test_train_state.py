"""The trainer's atomic checkpoints: exact resume of weights, optimizer and schedule; no partial states."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from prime_node.node.models.tiny import build_tiny_model
from prime_node.trainer.errors import TrainerError
from prime_node.trainer.grpo.config import TrainerSettings
from prime_node.trainer.grpo.packing import TrainSample
from prime_node.trainer.grpo.schedule import build_optimizer, build_scheduler
from prime_node.trainer.grpo.step import train_rollout_step
from prime_node.trainer.service.train_state import (
    latest_train_state,
    list_train_states,
    load_optimizer_state,
    prune_train_states,
    save_train_state,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SETTINGS = TrainerSettings(
    kl_coef=0.0, optimizer_steps_per_batch=2, micro_batch_tokens=32, warmup_steps=3, lr=1e-3
)
SAMPLES = [
    TrainSample((20, 21, 22), (30, 31, 1), 1.0),
    TrainSample((20, 21, 22), (32, 1), -1.0),
    TrainSample((40, 41), (50, 51, 52, 1), 0.7),
    TrainSample((40, 41), (53, 1), -0.7),
]


def _trainer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = build_optimizer(model, SETTINGS)
    return optimizer, build_scheduler(optimizer, SETTINGS)


def test_resume_continues_bit_for_bit(tmp_path: Path) -> None:
    model, tokenizer = build_tiny_model(seed=2)
    optimizer, scheduler = _trainer(model)
    train_rollout_step(model, optimizer, scheduler, SAMPLES, SETTINGS, pad_id=0)
    path = save_train_state(tmp_path, 1, model, optimizer, scheduler, tokenizer)
    assert latest_train_state(tmp_path) == (1, path)
    assert (path / "config.json").is_file() and (
        path / "tokenizer.json"
    ).is_file()  # publishable HF directory

    restored = Qwen2ForCausalLM.from_pretrained(path)
    r_opt, r_sched = _trainer(restored)
    assert load_optimizer_state(path, r_opt, r_sched) == 1
    assert r_sched.get_last_lr() == scheduler.get_last_lr()

    # the uninterrupted trainer and the resumed one take the same next step and end up identical
    train_rollout_step(model, optimizer, scheduler, SAMPLES, SETTINGS, pad_id=0)
    train_rollout_step(restored, r_opt, r_sched, SAMPLES, SETTINGS, pad_id=0)
    for (name, a), b in zip(model.state_dict().items(), restored.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_failed_save_leaves_no_state_and_steps_only_move_forward(tmp_path: Path, monkeypatch) -> None:
    model, _ = build_tiny_model(seed=2)
    optimizer, scheduler = _trainer(model)
    save_train_state(tmp_path, 4, model, optimizer, scheduler)

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError):
        save_train_state(tmp_path, 5, copy.deepcopy(model), optimizer, scheduler)
    monkeypatch.undo()
    assert [s for s, _ in list_train_states(tmp_path)] == [4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]
    with pytest.raises(TrainerError, match="only move forward"):
        save_train_state(tmp_path, 4, model, optimizer, scheduler)


def test_prune_keeps_newest_and_clears_leftovers(tmp_path: Path) -> None:
    model, _ = build_tiny_model(seed=2)
    optimizer, scheduler = _trainer(model)
    for step in (1, 2, 3):
        save_train_state(tmp_path, step, model, optimizer, scheduler)
    (tmp_path / ".step-00000004.tmp-999").mkdir()  # what a SIGKILL mid-save leaves
    assert latest_train_state(tmp_path)[0] == 3
    removed = prune_train_states(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == [".step-00000004.tmp-999", "step-00000001"]
    assert [s for s, _ in list_train_states(tmp_path)] == [2, 3]


def test_unreadable_state_is_a_clear_error(tmp_path: Path) -> None:
    model, _ = build_tiny_model(seed=2)
    optimizer, scheduler = _trainer(model)
    path = save_train_state(tmp_path, 1, model, optimizer, scheduler)
    (path / "optimizer.pt").write_bytes(b"garbage")
    with pytest.raises(TrainerError, match="unreadable"):
        load_optimizer_state(path, optimizer, scheduler)
