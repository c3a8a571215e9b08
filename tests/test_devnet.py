"""`prime-node devnet` end to end: real trainer, validator, contributors and a cheater as processes on 127.0.0.1.

One trainer, one validator, two honest nodes and one adversary (inflated rewards) for two policy steps on the
untrained tiny model: honest files accepted, the adversary slashed and banned, two steps trained, every
process (and each one's DHT child and p2pd daemon) gone at the end. Plus the pieces the devnet is made of
that need no swarm: the attack producers against the real verifier, the report's arithmetic, the task
filter. (The live view and the reward figure: tests/test_devnet_view.py, tests/test_figures.py.)
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from prime_node.node.cli.devnet import succeeded
from prime_node.node.engine import load_engine
from prime_node.node.environments import open_environment
from prime_node.node.run.producer import BatchSpec
from prime_node.node.run.settings import RunSettings, load_run_tasks, verifier_for_run
from prime_node.node.run.validation import verify_rollout_file
from prime_node.p2p.identity import Identity
from prime_node.proofs.verifier import VerifierSettings
from prime_node.trainer.devnet.attacks import EXPECTED_CHECKS, attack_producer
from prime_node.trainer.devnet.processes import descendants, still_running
from prime_node.trainer.devnet.report import format_report
from prime_node.trainer.devnet.tasks import TaskFilter

from support.devnet import SMALL, assert_all_gone, run_devnet, tiny_model


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~2 min on 2 idle cores; several times that on a shared, loaded machine
def test_devnet_two_honest_nodes_and_a_cheater(tmp_path: Path) -> None:
    # On an environment of its own (`prime-node devnet --env`), filtered for the genesis model: every party is
    # given `--env filtered:FILE` (a band of [0, 1] keeps the untrained model's 16 tasks, so there is a file).
    env = "arithmetic:levels=1/1/0/0/0,seed=3"
    keep_all = TaskFilter(env=env, count=16, low=0.0, high=1.0, max_new_tokens=4)
    report, devnet, shown = run_devnet(
        tmp_path, nodes=2, attacks=["inflated-rewards"], steps=2, task_filter=keep_all, env=env
    )
    text = format_report(report)
    assert report["error"] is None, text
    spec = devnet.layout.env_spec
    assert spec is not None and spec.startswith("filtered:"), spec
    filtered = open_environment(spec)
    assert filtered.identity.name == "arithmetic" and filtered.spec == spec and len(filtered) == 16
    assert [filtered.get(i) for i in range(16)] == [open_environment(env).get(i) for i in range(16)]
    assert report["steps"] >= 2 and [r["step"] for r in report["rewards"]][:2] == [1, 2]
    assert report["honest"]["accepted_files"] >= 2 and report["honest"]["rejected_files"] == 0, text
    (adversary,) = report["adversaries"]
    assert adversary["banned"] and adversary["accepted_files"] == 0 and adversary["rejected_files"] >= 1, text
    (slash, *_) = [s for s in report["slashed"] if s["name"] == adversary["name"]]
    assert slash["failed_check"] == "rewards" and slash["class"] == "fraud"
    assert not [s for s in report["slashed"] if s["attack"] is None], "an honest node was slashed"
    honest_rows = [r for r in report["leaderboard"] if r["attack"] is None and r["name"].startswith("node-")]
    assert {r["name"] for r in honest_rows if r["accepted_files"] > 0} == {"node-1", "node-2"}
    # Only contributors are ranked: the operator's trainer and validator heartbeat too, but are not listed.
    assert {r["name"] for r in report["leaderboard"]} == {"node-1", "node-2", adversary["name"]}, text
    assert [r["rank"] for r in report["leaderboard"]] == [1, 2, 3]
    # The first step's rollouts were read for it; a later step may be cut entirely from samples buffered
    # before the previous step (nothing new read in between), and then reports no rollout reward (None).
    assert report["rewards"][0].get("rollout_reward") is not None, report["rewards"]
    assert succeeded(report)
    # Every process stopped cleanly (exit 0) and nothing is left below them.
    assert set(report["processes"]["exit_codes"].values()) == {0}, report["processes"]
    assert_all_gone(devnet, report)
    # The timings were measured, the plot written, the live view showed the ban.
    t = report["timings"]
    assert t["broadcast_s"] and t["broadcast_s"]["count"] >= 2 and t["validation_latency_s"]["count"] >= 3
    # (broadcast -> first rollout needs a file of step >= 1 received before the stop: not always in 2 steps)
    assert "broadcast_to_first_rollout_s" in t and 0 <= t["trainer_idle_fraction"] <= 1
    assert Path(report["plot"]).read_bytes().startswith(b"\x89PNG")
    assert "BANNED" in shown and "step 2/2" in shown
    assert json.loads((devnet.layout.root / "report.json").read_text())["steps"] == report["steps"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sigterm_stops_the_devnet_and_everything_below_it(tmp_path: Path) -> None:
    # A service manager or `kill` sends SIGTERM, a closed terminal SIGHUP: the children live in their own
    # sessions, so unless the devnet stops them itself they run on with no one left to stop them.
    command = [
        sys.executable,
        "-m",
        "prime_node.node.cli.main",
        "devnet",
        "--data-dir",
        str(tmp_path / "data"),
        "--model",
        str(tiny_model(tmp_path / "model")),
        "--nodes",
        "1",
        "--adversaries",
        "0",
        "--steps",
        "50",
        "--all-tasks",
        "--batch-size",
        "8",
        "--prompts",
        "2",
        "--samples",
        "2",
        "--max-new-tokens",
        "16",
        "--json",
    ]
    devnet = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    seen: dict[int, float] = {}
    out = err = ""
    try:
        deadline = time.monotonic() + 150
        # The signal lands as the contributor's first helper appears: the node is starting its DHT (torch's
        # shared-memory manager, then the DHT child), the moment a stop is most easily mishandled; the trainer
        # and validator are serving.
        node_started = False
        while not node_started and devnet.poll() is None and time.monotonic() < deadline:
            seen.update(descendants(devnet.pid))
            nodes = [pid for pid in seen if b"\0start\0" in _cmdline(pid)]
            node_started = bool(nodes) and bool(descendants(*nodes))
            time.sleep(0.1)
        seen.update(descendants(devnet.pid))
        assert node_started and devnet.poll() is None, f"the devnet did not start its swarm: {seen}"
        devnet.send_signal(signal.SIGTERM)
        out, err = devnet.communicate(timeout=100)
    finally:
        seen.update(descendants(devnet.pid))
        if devnet.poll() is None:
            devnet.kill()
        for pid, started in seen.items():  # never leave a swarm behind a failed test
            if still_running(pid, started):
                os.kill(pid, signal.SIGKILL)
    assert out, err[-3000:]
    report = json.loads(out)
    assert report["stopped_by"] == "terminated (SIGTERM)", err[-3000:]
    assert not report["processes"]["alive"] and set(report["processes"]["exit_codes"].values()) == {0}, (
        report["processes"]
    )
    assert devnet.returncode == 0, err[-3000:]
    alive = [pid for pid, started in seen.items() if still_running(pid, started)]
    assert not alive, f"still running after the devnet stopped: {alive}"


def _cmdline(pid: int) -> bytes:
    """The command line as the kernel holds it, NUL-separated (empty once the process is gone)."""
    try:
        return "".join(arg + "\0" for arg in psutil.Process(pid).cmdline()).encode()
    except psutil.Error:
        return b""


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    checkpoint = tiny_model(tmp_path_factory.mktemp("devnet") / "model")
    run = RunSettings(
        run_id="devnet-unit", samples=2, max_new_tokens=16, length_targets=list(SMALL.length_targets or ())
    )
    return checkpoint, load_engine(checkpoint, threads=1), load_run_tasks(run, checkpoint), run


@pytest.mark.parametrize("kind", sorted(EXPECTED_CHECKS))
def test_each_attack_file_is_rejected_by_the_expected_check(world, tmp_path: Path, kind: str) -> None:
    """The adversaries' producers write files the real verifier rejects, for the reason the attack targets."""
    _, engine, tasks, run = world
    identity = Identity.generate()
    spec = BatchSpec(
        run_id=run.run_id,
        run_seed=0,
        policy_step=0,
        batch_counter=0,
        prompts=2,
        samples=2,
        temperature=run.temperature,
        max_new_tokens=run.max_new_tokens,
    )
    out = tmp_path / f"{kind}.parquet"
    attack_producer(kind)(engine, tasks, identity, spec, out)
    verifier = verifier_for_run(VerifierSettings(), run)  # as a validator of this run checks
    report = verify_rollout_file(out, engine, tasks, verifier, rng=random.Random(0))
    failed = [c.name.replace("-", "_") for c in report.checks if c.status == "failed"]
    assert not report.accepted and failed, report.reasons
    assert failed[0] in EXPECTED_CHECKS[kind], (kind, report.reasons)


def test_report_counts_excused_rejections_apart_and_averages_the_reward_trend() -> None:
    from prime_node.trainer.devnet.report import _excused, reward_trend

    # A file whose checkpoint the validator had already dropped is not the honest node's fault.
    assert _excused({"failed_check": "checkpoint_unavailable"}) and _excused({"failed_check": "banned"})
    assert not _excused({"failed_check": "toploc"}) and not _excused({"failed_check": "schema"})
    rows = [{"rollout_reward": r} for r in (0.2, 0.3, 0.1, 0.5, 0.5, 0.4, 0.6)] + [{"rollout_reward": None}]
    assert reward_trend(rows) == {"steps_per_window": 2, "first": 0.25, "last": 0.5, "change": 0.25}
    assert reward_trend(rows[:2]) is None


def test_task_filter_keeps_the_band_caches_by_weights_and_band_and_falls_back(tmp_path: Path) -> None:
    from prime_node.node.environments import open_environment
    from prime_node.trainer.devnet.tasks import TaskFilter, filtered_tasks

    model = tiny_model(tmp_path / "tiny")  # untrained: solves nothing
    assert filtered_tasks(model, TaskFilter(count=16, max_new_tokens=4))[0] is None  # empty band: full set
    everything = TaskFilter(count=16, low=0.0, high=1.0, max_new_tokens=4)
    path, summary = filtered_tasks(model, everything)
    assert path is not None and path.parent == tmp_path and "kept 16 of the first 16" in summary
    assert [open_environment(f"file:{path}").get(i).prompt for i in range(16)] == [
        open_environment("arithmetic").get(i).prompt for i in range(16)
    ]
    again, summary = filtered_tasks(model, everything)
    assert again == path and "cached" in summary
    assert filtered_tasks(model, TaskFilter(count=8, low=0.0, high=1.0, max_new_tokens=4))[0] != path
    # A held-out range: another file, cached apart.
    later = TaskFilter(count=4, low=0.0, high=1.0, max_new_tokens=4, offset=100)
    other, summary = filtered_tasks(model, later)
    assert other not in (None, path) and "kept 4 of the 4 built-in problems from index 100" in summary
    assert [open_environment(f"file:{other}").get(i).prompt for i in range(4)] == [
        open_environment("arithmetic").get(i).prompt for i in range(100, 104)
    ]
