"""Packing: layout, isolation of samples under Qwen2 (logits equal to solo runs), and equal losses."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from prime_node.node.models.tiny import build_tiny_model
from prime_node.trainer.errors import TrainerError
from prime_node.trainer.grpo.config import TrainerSettings
from prime_node.trainer.grpo.packing import TrainSample, check_packing_isolation, pack_samples, token_logprobs
from prime_node.trainer.grpo.schedule import build_optimizer, build_scheduler
from prime_node.trainer.grpo.step import PreparedPart, part_loss, prepare_parts, train_rollout_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAD = 0


def _samples(seed: int, n: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(2, 9, (1,), generator=g))
        c = int(torch.randint(1, 12, (1,), generator=g))
        ids = torch.randint(3, 259, (p + c,), generator=g).tolist()
        out.append(TrainSample(tuple(ids[:p]), tuple(ids[p:]), advantage=(-1.0) ** i * (0.25 + 0.1 * i)))
    return out


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny_model(seed=11)[0]


def test_layout_restarts_positions_and_masks_completion_targets() -> None:
    a = TrainSample((10, 11, 12), (20, 21), 0.5)
    b = TrainSample((30,), (40, 41, 42), -1.0)
    (rows,) = pack_samples([b, a], token_budget=12, pad_id=PAD)  # a is longer: placed first
    assert rows.input_ids.tolist() == [[10, 11, 12, 20, 21, 30, 40, 41, 42, PAD, PAD, PAD]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]]
    # position t predicts token t + 1 of the same sample; only completion tokens are learned
    assert rows.target_ids.tolist() == [[11, 12, 20, 21, 0, 40, 41, 42, 0, 0, 0, 0]]
    assert rows.loss_mask.tolist() == [
        [False, False, True, True, False, True, True, True, False, False, False, False]
    ]
    assert rows.advantages.tolist() == [[0, 0, 0.5, 0.5, 0, -1, -1, -1, 0, 0, 0, 0]]
    assert rows.sample_index.tolist() == [[-1, -1, 1, 1, -1, 0, 0, 0, -1, -1, -1, -1]]
    assert rows.loss_tokens == 5


def test_every_sample_lands_in_exactly_one_row_within_budget() -> None:
    samples = _samples(1, 40)
    micro = pack_samples(samples, token_budget=32, pad_id=PAD, rows_per_micro_batch=3)
    seen = Counter(torch.cat([m.sample_index[m.loss_mask] for m in micro]).tolist())
    assert seen == {i: len(s.completion_ids) for i, s in enumerate(samples)}
    assert all(m.input_ids.shape[1] == 32 and m.input_ids.shape[0] <= 3 for m in micro)
    assert sum(m.input_ids.shape[0] for m in micro) < len(samples) / 2  # rows are really shared
    with pytest.raises(TrainerError, match="micro_batch_tokens"):
        pack_samples(samples, token_budget=8, pad_id=PAD)


def test_packed_logits_equal_each_sample_alone(model: torch.nn.Module) -> None:
    samples = _samples(2, 6)
    (rows,) = pack_samples(samples, token_budget=sum(len(s) for s in samples) + 4, pad_id=PAD)
    starts = (rows.position_ids[0] == 0).nonzero().flatten().tolist()
    assert len(starts) == len(samples) + 1  # six samples, then the padding tail as its own segment
    with torch.no_grad():
        packed = model(input_ids=rows.input_ids, position_ids=rows.position_ids, use_cache=False).logits[0]
        found = set()
        for start, end in zip(starts, starts[1:]):
            ids = rows.input_ids[0, start:end]
            found.add(tuple(ids.tolist()))
            alone = model(input_ids=ids.unsqueeze(0), use_cache=False).logits[0]
            torch.testing.assert_close(packed[start:end], alone, atol=1e-5, rtol=1e-5)
    assert found == {s.prompt_ids + s.completion_ids for s in samples}


def test_isolation_check_passes_and_catches_a_leaking_forward(model: torch.nn.Module) -> None:
    check_packing_isolation(model)

    class DropsPositions(torch.nn.Module):  # what a backend without packed-sequence support amounts to
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs: object) -> object:
            kwargs.pop("position_ids")
            return self.inner(**kwargs)

    with pytest.raises(TrainerError, match="attend to each other"):
        check_packing_isolation(DropsPositions(model), vocab_size=288)


def test_packed_loss_and_gradients_equal_unpacked(model: torch.nn.Module) -> None:
    settings = TrainerSettings(
        kl_coef=0.0, entropy_coef=0.01, optimizer_steps_per_batch=1, micro_batch_tokens=64
    )
    samples = _samples(3, 6)
    [packed] = prepare_parts(model, samples, settings, PAD)
    assert len(packed.rows) < len(samples)  # it really packed several samples per row
    # unpacked: each sample alone in its own exact-length row, same normaliser
    solo_rows = [pack_samples([s], len(s), PAD)[0] for s in samples]
    with torch.no_grad():
        solo_old = [token_logprobs(model, r)[0] for r in solo_rows]
    solo = PreparedPart(solo_rows, solo_old, None, packed.loss_tokens, packed.tokens)
    # perturb the weights so ratios differ from 1 and several clipping branches are active
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p), alpha=0.05)

    def run(part: PreparedPart) -> tuple[float, dict[str, float], list[torch.Tensor]]:
        trained.zero_grad(set_to_none=True)
        loss, metrics = part_loss(trained, part, settings, backward=True)
        return loss, metrics.means(), [p.grad.clone() for p in trained.parameters()]

    loss_p, m_p, grads_p = run(packed)
    loss_s, m_s, grads_s = run(solo)
    assert loss_p == pytest.approx(loss_s, abs=1e-5)
    assert m_p["clip_fraction"] == pytest.approx(m_s["clip_fraction"]) and m_p["clip_fraction"] > 0
    for key in ("ratio", "entropy", "policy_loss", "tokens"):
        assert m_p[key] == pytest.approx(m_s[key], rel=1e-5)
    for gp, gs in zip(grads_p, grads_s):
        torch.testing.assert_close(gp, gs, atol=1e-5, rtol=1e-4)


def test_rollout_step_clips_and_updates(model: torch.nn.Module) -> None:
    work = copy.deepcopy(model)
    settings = TrainerSettings(
        kl_coef=0.001, optimizer_steps_per_batch=2, micro_batch_tokens=48, warmup_steps=2
    )
    reference = copy.deepcopy(model).requires_grad_(False)
    optimizer, before = build_optimizer(work, settings), [p.detach().clone() for p in work.parameters()]
    scheduler = build_scheduler(optimizer, settings)
    report = train_rollout_step(
        work, optimizer, scheduler, _samples(4, 12), settings, PAD, reference=reference
    )
    summary = report.summary()
    assert len(report.steps) == 2 and not any(s.skipped for s in report.steps)
    assert [s.lr for s in report.steps] == pytest.approx([settings.lr * 0.5, settings.lr * 1.0])
    assert summary["kl"] >= 0.0 and summary["entropy"] > 0.0 and summary["tokens_per_s"] > 0.0
    assert summary["tokens"] == sum(len(s.completion_ids) for s in _samples(4, 12))
    assert any(not torch.equal(a, b) for a, b in zip(before, work.parameters()))
