"""FSDP2 pieces of the trainer in one process: dealing micro-batches, the sharded step and its state formats,
and `prime-node trainer --fsdp` outside torchrun. The 2-rank run is tests/test_fsdp_torchrun.py (slow)."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from prime_node.node.cli.main import main
from prime_node.node.engine.hf import load_hf_model
from prime_node.node.models.tiny import build_tiny_model
from prime_node.p2p.identity import Identity
from prime_node.trainer.grpo.config import TrainerSettings
from prime_node.trainer.grpo.distributed import World
from prime_node.trainer.grpo.fsdp import ShardedPolicy, deal_rows
from prime_node.trainer.grpo.packing import TrainSample, pack_samples
from prime_node.trainer.grpo.schedule import build_optimizer, build_scheduler
from prime_node.trainer.grpo.step import train_rollout_step

SETTINGS = TrainerSettings(
    micro_batch_tokens=24, warmup_steps=3, batch_size=8, kl_coef=0.01, lr=1e-3, optimizer_steps_per_batch=2
)


def _samples(seed: int, count: int = 8) -> list[TrainSample]:
    rng = random.Random(seed)
    return [
        TrainSample(
            tuple(rng.randrange(3, 60) for _ in range(rng.randrange(2, 8))),
            tuple(rng.randrange(3, 60) for _ in range(rng.randrange(2, 12))),
            rng.uniform(-1.5, 1.5),
        )
        for _ in range(count)
    ]


@pytest.fixture
def one_rank() -> Iterator[World]:
    """A real gloo process group of one rank: FSDP2, DTensor and the distributed state-dict calls all run."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield World(rank=0, world_size=1, local_rank=0)
    finally:
        dist.destroy_process_group()


def test_micro_batches_are_dealt_round_robin_and_padded_to_equal_counts() -> None:
    rows = pack_samples(_samples(1, 7), 16, pad_id=0)[:5]  # odd: one rank needs a padding micro-batch
    assert len(rows) == 5
    first, second = (deal_rows(rows, World(rank, 2, rank)) for rank in (0, 1))
    assert len(first) == len(second) == (len(rows) + 1) // 2
    assert all(a is b for a, b in zip(first, rows[0::2], strict=True))
    assert all(a is b for a, b in zip(second, rows[1::2], strict=False))
    padding = second[-1]
    assert padding.loss_tokens == 0 and padding.input_ids.shape == rows[0].input_ids.shape
    assert not padding.advantages.any() and bool((padding.sample_index == -1).all())
    # Every real micro-batch is trained by exactly one rank.
    assert sum(r.loss_tokens for r in first + second) == sum(r.loss_tokens for r in rows)


@pytest.mark.usefixtures("one_torch_thread")
def test_sharded_policy_resumes_trains_and_gathers_like_one_process(one_rank: World, tmp_path: Path) -> None:
    model, _ = build_tiny_model(0)
    reference, _ = build_tiny_model(0)
    reference.requires_grad_(False)
    optimizer = build_optimizer(model, SETTINGS)
    scheduler = build_scheduler(optimizer, SETTINGS)
    train_rollout_step(model, optimizer, scheduler, _samples(2), SETTINGS, 0, reference)  # moments exist

    # Resume a sharded policy from that state (weights + single-process optimizer state), then both train on.
    policy = ShardedPolicy(
        copy.deepcopy(model),
        SETTINGS,
        one_rank,
        copy.deepcopy(optimizer.state_dict()),
        scheduler.state_dict(),
        copy.deepcopy(reference),
    )
    want = train_rollout_step(model, optimizer, scheduler, _samples(3), SETTINGS, 0, reference)
    got = policy.train(_samples(3), 0)
    assert got.loss.tokens == want.loss.tokens
    assert got.summary()["lr"] == want.summary()["lr"]  # the warmup schedule resumed where it was
    assert got.summary()["grad_norm"] == pytest.approx(want.summary()["grad_norm"], rel=1e-5)

    gathered = policy.gather()
    assert gathered is not None
    weights, saved = gathered
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-6, msg=name)
    # The gathered optimizer state is in the single-process format: it loads into a plain AdamW.
    plain = build_optimizer(model, SETTINGS)
    plain.load_state_dict(saved)
    for index, moments in optimizer.state_dict()["state"].items():
        assert float(saved["state"][index]["step"]) == float(moments["step"]) == 4.0
        torch.testing.assert_close(
            saved["state"][index]["exp_avg"], moments["exp_avg"], rtol=1e-5, atol=1e-10
        )

    # The exported model is an ordinary HF checkpoint with the gathered weights (tied head included).
    policy.export(weights).save_pretrained(tmp_path / "out")
    loaded = load_hf_model(tmp_path / "out", "cpu", torch.float32)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def test_fsdp_flag_outside_torchrun_fails_with_a_clear_message(tmp_path: Path, monkeypatch, capsys) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    key = tmp_path / "op.key"
    Identity.generate().save(key)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # passes the CLI's model-directory check
    code = main(
        [
            "trainer",
            "--model",
            str(tmp_path / "model"),
            "--key",
            str(key),
            "--data-dir",
            str(tmp_path / "data"),
            "--no-dht",
            "--fsdp",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "torchrun" in err and "RANK" in err and "Traceback" not in err
