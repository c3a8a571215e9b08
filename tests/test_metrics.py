"""Every role's /metrics, read as Prometheus reads it, and the documents that name those metrics.

The live test starts the trainer as a real process (`prime-node trainer`, its weights server asked once),
a contributor as a real process (`prime-node start`, waiting for a run), a standalone weights server
(`prime-node weights serve --metrics-port 0`), a validator in this process (its swarm, API and dashboard
server) and a contributor's status server with counted batches, and parses each /metrics with
prometheus-client's own parser. The document tests hold docs/metrics.md and the
Grafana dashboard (docs/grafana/prime-node.json) to the metric names the roles' modules expose.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prime_node.node.cli.weights import RelayMetrics
from prime_node.node.contributor.metrics import NodeMetrics
from prime_node.node.contributor.state import NodeState
from prime_node.node.contributor.status import StatusServer
from prime_node.p2p.identity import Identity
from prime_node.p2p.processes import end_pids
from prime_node.trainer.service.metrics import TrainerMetrics
from prime_node.trainer.validator.metrics import ValidatorMetrics

from support.attack import make_checkpoint
from support.trainer_service import read_ready, start_trainer, trainer_argv
from support.validator import running_validator, validator_settings

DOCS = Path(__file__).resolve().parents[1] / "docs"
ROLES = {
    "contributor": NodeMetrics,
    "trainer": TrainerMetrics,
    "validator": ValidatorMetrics,
    "weights": RelayMetrics,
}
SHARED = {"prime_node_build_info": "gauge", "process_cpu_seconds": "counter", "python_info": "gauge"}
# What an operator alerts on, by role: each must be there with this type.
REQUIRED = {
    "validator": {
        "prime_node_validator_queue_depth": "gauge",
        "prime_node_validator_files_received": "counter",
        "prime_node_validator_files_accepted": "counter",
        "prime_node_validator_files_rejected": "counter",
        "prime_node_validator_verdict_latency_seconds": "histogram",
        "prime_node_validator_verification_seconds": "histogram",
        "prime_node_validator_bans": "counter",
        "prime_node_validator_receive_slots_in_use": "gauge",
    },
    "trainer": {
        "prime_node_trainer_step_seconds": "histogram",
        "prime_node_trainer_batch_wait_seconds": "histogram",
        "prime_node_trainer_publish_seconds": "histogram",
        "prime_node_trainer_samples_trained": "counter",
        "prime_node_trainer_tokens_trained": "counter",
        "prime_node_trainer_policy_step": "gauge",
        "prime_node_trainer_tokens_per_second": "gauge",
        "prime_node_weights_requests": "counter",
        "prime_node_weights_request_seconds": "histogram",
        "prime_node_weights_sent_bytes": "counter",
        "prime_node_weights_active_connections": "gauge",
    },
    "weights": {
        "prime_node_weights_requests": "counter",
        "prime_node_weights_request_seconds": "histogram",
        "prime_node_weights_sent_bytes": "counter",
        "prime_node_weights_active_connections": "gauge",
        "prime_node_weights_served_versions": "gauge",
    },
    "contributor": {
        "prime_node_contributor_rollout_files": "counter",
        "prime_node_contributor_verdicts": "counter",
        "prime_node_contributor_batch_seconds": "histogram",
        "prime_node_contributor_tokens_per_second": "gauge",
    },
}


def families(text: str) -> dict[str, tuple[str, list]]:
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def check_exposition(role: str, text: str) -> None:
    """Conventional names and types, and complete histograms and counters, in one role's /metrics."""
    found = families(text)
    wanted = families(ROLES[role]().render().decode())  # what the role's module declares
    assert {n: t for n, (t, _) in found.items()} == {n: t for n, (t, _) in wanted.items()}, role
    for name, kind in {**SHARED, **REQUIRED[role]}.items():
        assert found.get(name, ("missing",))[0] == kind, (role, name)
    build = found["prime_node_build_info"][1]
    assert build[0].labels["role"] == role and build[0].labels["version"] and build[0].value == 1
    for name, (kind, samples) in found.items():
        assert re.fullmatch(r"(prime_node|process|python)_[a-z_]+", name), name
        assert "per_s" not in name.replace("per_second", ""), name  # one spelling of a rate's unit
        if kind == "counter":
            assert all(s.name == name + "_total" for s in samples), (role, name)  # labelled: maybe none yet
        if kind == "histogram" and samples:  # a labelled histogram has samples once a label set is used
            names = {s.name for s in samples}
            assert names == {name + "_bucket", name + "_sum", name + "_count"}, (role, name)
            assert any(s.labels.get("le") == "+Inf" for s in samples), (role, name)
        if kind == "histogram" and name in REQUIRED[role]:
            assert samples, f"{role}: histogram {name} has no series"


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PRIME_NODE_")}


def _cli(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "prime_node.node.cli.main", *argv],
            stdout=subprocess.PIPE,
            stderr=err,
            env=_env(),
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    end_pids([proc.pid], 10.0)
    assert proc.stdout is not None
    proc.stdout.close()


def _ready_line(proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 120.0) -> str:
    """The first line a command prints on stdout when it is ready (bounded by `timeout_s`)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            return proc.stdout.readline().decode()
    raise AssertionError(f"no ready line: {log.read_text()[-2000:]}")


def _node_metrics(data_dir: Path, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 180.0) -> str:
    """A running contributor's /metrics, at the port its status file names once its status API is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            port = json.loads((data_dir / "status.json").read_text())["port"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.5)
            continue
        return _get(f"http://127.0.0.1:{port}/metrics")
    raise AssertionError(f"the node's status API never came up: {log.read_text()[-2000:]}")


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
async def test_every_role_serves_prometheus_metrics_that_parse(tmp_path: Path) -> None:
    # The trainer, a real process: its /metrics carries its weights server's requests too.
    model = make_checkpoint(tmp_path / "model")
    key, log = tmp_path / "op.key", tmp_path / "trainer.log"
    Identity.generate().save(key)
    proc = start_trainer(trainer_argv(model, key, tmp_path / "trainer", "--no-dht"), log)
    try:
        ready = await asyncio.to_thread(read_ready, proc, log)
        assert ready["metrics"].endswith("/metrics"), ready
        await asyncio.to_thread(_get, ready["weights"] + "/v1/weights/0/manifest")
        text = await asyncio.to_thread(_get, ready["metrics"])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        end_pids([proc.pid], 10.0)
        assert proc.stdout is not None
        proc.stdout.close()
    check_exposition("trainer", text)
    assert 'prime_node_weights_requests_total{route="/v1/weights/{step}/manifest",status="200"} 1.0' in text

    # The validator: /metrics beside its API (a 404 before).
    async with running_validator(validator_settings(tmp_path / "validator"), announce=False) as running:
        text = await asyncio.to_thread(_get, running.dashboard_url + "/metrics")
    check_exposition("validator", text)

    # A contributor's status server, with one batch and one verdict counted.
    state = NodeState("ab" * 32, None)
    state.record_batch(100, 0.5)
    state.count_rollout("generated")
    state.count_rollout("rejected")
    server = StatusServer(tmp_path / "node", state.to_status, state.metrics, port=0)
    (tmp_path / "node").mkdir()
    await server.start()
    try:
        text = await asyncio.to_thread(_get, f"http://127.0.0.1:{server.port}/metrics")
    finally:
        await server.stop()
    check_exposition("contributor", text)
    assert 'prime_node_contributor_rollout_files_total{stage="generated"} 1.0' in text
    assert 'prime_node_contributor_verdicts_total{verdict="rejected"} 1.0' in text

    # A contributor as a person starts one: the same names and types from a real `prime-node start`.
    node_dir, log = tmp_path / "real-node", tmp_path / "node.log"
    Identity.generate().save(node_dir / "node.key")
    operator = Identity.generate().node_id
    proc = _cli(["start", "--data-dir", str(node_dir), "--operator-key", operator, "--status-port", "0"], log)
    try:
        text = await asyncio.to_thread(_node_metrics, node_dir, proc, log)
    finally:
        _stop(proc)
    check_exposition("contributor", text)

    # A standalone weights server (a relay's server too): its /metrics beside its public port, asked once.
    log = tmp_path / "weights.log"
    proc = _cli(["weights", "serve", str(tmp_path / "store"), "--port", "0", "--metrics-port", "0"], log)
    try:
        line = await asyncio.to_thread(_ready_line, proc, log)
        weights_url, metrics_url = re.fullmatch(r"serving \S+ at (\S+), metrics at (\S+)\n", line).groups()
        await asyncio.to_thread(
            lambda: urllib.request.urlopen(weights_url + "/v1/weights/versions", timeout=10).read()
        )
        text = await asyncio.to_thread(_get, metrics_url)
    finally:
        _stop(proc)
    check_exposition("weights", text)
    assert 'prime_node_weights_requests_total{route="/v1/weights/versions",status="200"} 1.0' in text


def exposed_series() -> set[str]:
    """Every series name the roles can expose: family names, `_total`, and a histogram's three series."""
    names: set[str] = set()
    for make in ROLES.values():
        for name, (kind, _) in families(make().render().decode()).items():
            names.add(name)
            if kind == "counter":
                names.add(name + "_total")
            if kind == "histogram":
                names |= {name + "_bucket", name + "_sum", name + "_count"}
    return names


def test_grafana_dashboard_uses_only_metrics_the_roles_expose() -> None:
    dashboard = json.loads((DOCS / "grafana" / "prime-node.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    exposed = exposed_series()
    used = set()
    for expr in exprs:
        without_labels = re.sub(r"\{[^}]*\}|\"[^\"]*\"", "", expr)  # label matchers and strings are not names
        used |= {
            n for n in re.findall(r"[a-z_:][a-z0-9_:]*", without_labels) if "_" in n and n.count("_") > 1
        }
    unknown = {n for n in used if n.startswith(("prime_node_", "process_", "python_")) and n not in exposed}
    assert not unknown, f"the dashboard queries metrics no role exposes: {sorted(unknown)}"
    assert any(n.startswith("prime_node_validator_") for n in used)
    assert any(n.startswith("prime_node_trainer_") for n in used)
    assert any(n.startswith("prime_node_contributor_") for n in used)


def test_metrics_doc_lists_every_metric_and_no_other() -> None:
    text = (DOCS / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `((?:prime_node|process|python)_[a-z_]+)`", text, re.M))
    declared = set()
    for make in ROLES.values():
        for name, (kind, _) in families(make().render().decode()).items():
            declared.add(name + "_total" if kind == "counter" else name)
    assert documented == declared, (
        f"undocumented: {sorted(declared - documented)}; documented but absent: {sorted(documented - declared)}"
    )
