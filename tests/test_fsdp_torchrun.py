"""`prime-node trainer --fsdp` under torchrun: 2 CPU ranks (gloo) train exactly what one process trains.

The same validator-accepted rollout files go to two trainers: one process without --fsdp, and a torchrun job
of 2 ranks with --fsdp; both train two rollout steps and stop. Each step's saved weights and optimizer moments
must match the single-process ones to float summation order, both runs must train the same groups, and rank
0's published checkpoint must verify and load. (Resuming a sharded trainer from a state with AdamW moments is
checked in-process by tests/test_fsdp.py; a second torchrun launch would double this test's time.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prime_node.node.engine.hf import load_hf_model
from prime_node.p2p.identity import Identity
from prime_node.p2p.processes import end_pids
from prime_node.p2p.weights.store import Store
from prime_node.proofs.rollout_file import signature_path

from support.attack import make_checkpoint
from support.trainer_service import RUN_ID, make_accepted_files, trainer_env

pytestmark = pytest.mark.slow

# Two files of 2 prompts x 3 samples make one batch of 12. The files are reproducible (a fixed node identity
# seeds assignment and sampling); with this seed every group of the first four files has reward spread, and a
# fifth file gives slack should a CPU sample differently. Each batch is split into 4 optimizer steps of 3
# samples; a sample (60-70 tokens) fills an 80-token row alone, so each optimizer step has 3 micro-batches:
# rank 0 trains two, rank 1 one plus a padding one (FSDP needs the same number of forwards on every rank).
BATCH = "12"
ENV = {
    "PRIME_NODE_TRAINER__MICRO_BATCH_TOKENS": "80",
    "PRIME_NODE_TRAINER__OPTIMIZER_STEPS_PER_BATCH": "4",
    "PRIME_NODE_TRAINER__KL_COEF": "0.01",
    "PRIME_NODE_TRAINER__LR": "0.001",
}


def _argv(model: Path, key: Path, data: Path, max_steps: int, *extra: str) -> list[str]:
    return [
        "-m",
        "prime_node.node.cli.main",
        "trainer",
        "--model",
        str(model),
        "--key",
        str(key),
        "--data-dir",
        str(data),
        "--run-id",
        RUN_ID,
        "--threads",
        "1",
        "--http-port",
        "0",
        "--metrics-port",
        "0",
        "--no-dht",
        "--batch-size",
        BATCH,
        "--async-level",
        "8",
        "--max-steps",
        str(max_steps),
        "--quiet",
        *extra,
    ]


def _run(argv: list[str], log: Path, timeout: float = 150.0, env: dict[str, str] | None = None) -> None:
    """Run a trainer (or torchrun and its ranks, one process group) to its end; kill the group if it hangs."""
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**trainer_env(), **ENV, **(env or {})},
            start_new_session=True,
        )
    try:
        code = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            end_pids([proc.pid], 10.0)
    assert code == 0, log.read_text()[-6000:]


def _deliver_copies(staged: list[Path], inboxes: list[Path]) -> None:
    """The same files, in the same order, into every inbox (copies keep the modification time that orders
    the inbox), signature first as the validator does."""
    for inbox in inboxes:
        inbox.mkdir(parents=True, exist_ok=True)
        for path in staged:
            shutil.copy2(signature_path(path), inbox / f"{path.name}.sig")
            shutil.copy2(path, inbox / path.name)


def _state(data: Path, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    directory = data / "trainer" / "states" / f"step-{step:08d}"
    blob = torch.load(directory / "optimizer.pt", map_location="cpu", weights_only=True)
    return load_file(directory / "model.safetensors"), blob


def _assert_same_state(single: Path, sharded: Path, step: int) -> None:
    weights, blob = _state(single, step)
    got_weights, got_blob = _state(sharded, step)
    assert weights.keys() == got_weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(got_weights[name], tensor, rtol=0, atol=2e-6, msg=name)
    assert got_blob["scheduler"] == blob["scheduler"]
    state, got_state = blob["optimizer"]["state"], got_blob["optimizer"]["state"]
    assert state.keys() == got_state.keys() and len(state) > 0
    for index, moments in state.items():
        assert float(got_state[index]["step"]) == float(moments["step"])
        torch.testing.assert_close(got_state[index]["exp_avg"], moments["exp_avg"], rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(
            got_state[index]["exp_avg_sq"], moments["exp_avg_sq"], rtol=1e-4, atol=1e-12
        )
    groups, got_groups = blob["optimizer"]["param_groups"], got_blob["optimizer"]["param_groups"]
    assert [g["params"] for g in got_groups] == [g["params"] for g in groups]


def _metrics(data: Path) -> list[dict]:
    return [json.loads(line) for line in (data / "trainer" / "metrics.jsonl").read_text().splitlines()]


def _torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]


def _two_trainers(tmp_path: Path) -> tuple[Path, Path, Identity, Path, Path]:
    """(model, operator key file, operator, single data dir, sharded data dir), both inboxes holding the same
    accepted files."""
    model = make_checkpoint(tmp_path / "model")
    key = tmp_path / "op.key"
    operator = Identity.generate()
    operator.save(key)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    node = Identity.from_seed(b"fsdp-test-node-1".ljust(32, b"\0"))
    staged = make_accepted_files(model, 0, 5, tmp_path / "stage", node=node)
    _deliver_copies(staged, [single / "accepted", sharded / "accepted"])
    return model, key, operator, single, sharded


def test_two_gloo_ranks_train_and_publish_like_one_process(tmp_path: Path) -> None:
    model, key, operator, single, sharded = _two_trainers(tmp_path)
    _run([sys.executable, *_argv(model, key, single, 2)], tmp_path / "single.log")
    _run([*_torchrun(2), *_argv(model, key, sharded, 2, "--fsdp")], tmp_path / "sharded.log")
    _assert_same_state(single, sharded, 1)
    _assert_same_state(single, sharded, 2)
    want, got = _metrics(single), _metrics(sharded)
    assert [r["groups_used"] for r in got] == [r["groups_used"] for r in want] and len(want) == 2
    for a, b in zip(want, got, strict=True):  # the ranks' loss metrics are summed into the whole batch's
        assert b["tokens"] == a["tokens"]
        for name in ("policy_loss", "ratio", "clip_fraction", "kl", "entropy", "grad_norm"):
            assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-7), name

    # Rank 0 published each step: a signed manifest over files that load as a model equal to the state.
    store = Store(sharded / "weights")
    assert store.high_water() == 2
    manifest = store.load_manifest(2, operator.node_id)
    assert manifest.step == 2
    loaded = load_hf_model(store.checkpoint_dir(2), "cpu", torch.float32)
    weights, _ = _state(sharded, 2)
    for name, tensor in loaded.state_dict().items():
        if name in weights:
            assert torch.equal(tensor, weights[name]), name


@pytest.mark.gpu
def test_one_nccl_rank_on_cuda_trains_like_a_cpu_process(tmp_path: Path) -> None:
    """../shared/GPU_CHECKS.md item 5: `--fsdp` on NCCL (one GPU, world size 1) against one CPU process.

    CUDA and CPU float32 kernels sum in other orders, and AdamW's first steps move a weight by about the
    learning rate whatever its gradient's size, so a weight can differ by up to 2 steps x lr where a gradient
    is near zero; almost all must agree far closer (the mean bound), and both runs train the same groups.
    """
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, key, operator, single, sharded = _two_trainers(tmp_path)
    _run(
        [sys.executable, *_argv(model, key, single, 2)],
        tmp_path / "single.log",
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    _run([*_torchrun(1), *_argv(model, key, sharded, 2, "--fsdp")], tmp_path / "sharded.log", timeout=300.0)
    for step in (1, 2):
        weights, _ = _state(single, step)
        got, _ = _state(sharded, step)
        assert weights.keys() == got.keys()
        diffs = torch.cat([(got[n].float().cpu() - t.float()).abs().flatten() for n, t in weights.items()])
        print(f"step {step}: |CUDA NCCL - CPU| max {diffs.max():.3e}, mean {diffs.mean():.3e}")
        assert float(diffs.max()) <= 2 * float(ENV["PRIME_NODE_TRAINER__LR"]) + 1e-6
        assert float(diffs.mean()) <= 1e-5
    want, got_metrics = _metrics(single), _metrics(sharded)
    assert [r["groups_used"] for r in got_metrics] == [r["groups_used"] for r in want] and len(want) == 2
    store = Store(sharded / "weights")
    assert store.high_water() == 2
    assert store.load_manifest(2, operator.node_id).step == 2
    load_hf_model(store.checkpoint_dir(2), "cpu", torch.float32)
