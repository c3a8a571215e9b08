"""Every mistake an operator makes at the command line gets one line naming what was wrong, and an exit status.

Each case runs the real `prime-node` command in its own process, as a person would, and holds it to the
one error path of node/cli/main.py: one line on stderr (no traceback, no log lines before it), the
documented exit status (1 a failure to run, 2 a bad flag value), and with --json a JSON object on stdout.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prime_node.node.cli.main import build_parser, settings_models
from prime_node.node.config import check_env_names
from prime_node.node.contributor.status import DaemonNotRunning, fetch_status
from prime_node.node.errors import ConfigError
from prime_node.p2p.identity import Identity
from prime_node.p2p.processes import end_pids
from prime_node.trainer.devnet.layout import NODE_ENV, SWARM_ENV, TRAINER_ENV

from support.validator import running_validator, validator_settings

ADVICE = (
    "give an HF model directory (config.json, *.safetensors, tokenizer files), e.g. one made by "
    "`prime-node model init --out DIR`"
)


def _env(**extra: str) -> dict[str, str]:
    # The test runner's own PRIME_NODE_* variables must not leak into the command under test.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_NODE_")}
    return {**env, **extra}


def _run(*argv: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prime_node.node.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(**env),
    )


def one_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The command failed with `code` and said so on exactly one stderr line; that line."""
    lines = result.stderr.splitlines()
    assert (result.returncode, len(lines)) == (code, 1), (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.fixture
def key(tmp_path: Path) -> Path:
    path = tmp_path / "op.key"
    Identity.generate().save(path)
    return path


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process listens on (this one, for the test)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_port_in_use_is_refused_before_the_swarm_is_joined(
    tmp_path: Path, key: Path, taken_port: int
) -> None:
    operator = Identity.load(key).node_id
    node_key = tmp_path / "node.key"
    Identity.generate().save(node_key)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cases = [
        (
            ["start", "--key", str(node_key), "--operator-key", operator, "--status-port", str(taken_port)],
            "prime-node start",
            "the status API and /metrics, --status-port",
        ),
        (
            ["validator", "--key", str(key), "--http-port", str(taken_port)],
            "prime-node validator",
            "the API, dashboard and /metrics, --http-port",
        ),
        (
            # The port is probed before the model loads: a directory that only looks like one is enough.
            [
                "trainer",
                "--model",
                str(model),
                "--key",
                str(key),
                "--http-port",
                "0",
                "--metrics-port",
                str(taken_port),
            ],
            "prime-node trainer",
            "the trainer's /metrics, --metrics-port",
        ),
        (
            ["weights", "serve", str(tmp_path / "store"), "--port", str(taken_port)],
            "prime-node weights serve",
            "the weights server, --port",
        ),
    ]
    for argv, command, what in cases:
        result = _run(*argv, "--data-dir", str(tmp_path / "data"))
        # One line and nothing else: no "joined swarm" log line before it, no traceback after it.
        assert one_line(result, 1) == (
            f"{command}: error: port {taken_port} on 127.0.0.1 is already in use ({what}); stop the process that "
            f"holds it (`ss -ltnp 'sport = :{taken_port}'` names it) or choose another port with "
            f"{what.rpartition(', ')[2]}"
        )
    # The DHT never started, so no swarm state was written.
    assert not (tmp_path / "data" / "status.json").exists()


def test_a_missing_model_directory_names_the_flag(tmp_path: Path, key: Path) -> None:
    missing = tmp_path / "nonexistent"
    result = _run("trainer", "--model", str(missing), "--key", str(key), "--data-dir", str(tmp_path))
    assert one_line(result, 1) == f"prime-node trainer: error: --model {missing}: no such directory; {ADVICE}"
    # Not a repo id message from the hub client, and for rollout not "--model": its flag is --checkpoint.
    for bad, why in [
        (missing, "no such directory"),
        (key, "a file, not a directory"),
        (tmp_path, "not an HF model directory (no config.json)"),
    ]:
        result = _run(
            "rollout",
            "--checkpoint",
            str(bad),
            "--key",
            str(key),
            "--step",
            "0",
            "--out",
            str(tmp_path / "r.parquet"),
        )
        assert one_line(result, 1) == f"prime-node rollout: error: --checkpoint {bad}: {why}; {ADVICE}"


def test_peer_errors_name_the_peers_flag(tmp_path: Path, key: Path) -> None:
    # `prime-node start`'s are in tests/test_cli_flags.py; the trainer and the validator take the same flag.
    for argv, error in [
        (
            ["trainer", "--model", str(tmp_path), "--key", str(key), "--peers", "garbage"],
            "'garbage' is not a multiaddr",
        ),
        (
            ["validator", "--key", str(key), "--peers", "/ip4/1.2.3.4/tcp/1"],
            "initial peer '/ip4/1.2.3.4/tcp/1' lacks its /p2p/<peer id> part",
        ),
    ]:
        line = one_line(_run(*argv, "--data-dir", str(tmp_path)), 2)
        assert line.startswith(f"prime-node {argv[0]}: error: argument --peers: {error}"), line
        assert "initial-peers" not in line and "initial_peers" not in line


def test_a_malformed_key_names_the_flag_and_what_a_key_looks_like(tmp_path: Path, key: Path) -> None:
    for argv, expected in [
        (
            ["start", "--operator-key", "abc"],
            "prime-node start: error: argument --operator-key: must be the operator's node id: 64 lowercase hex "
            "digits (got 'abc')",
        ),
        (
            ["validator", "--key", str(key), "--operator-key", "abc"],
            "prime-node validator: error: argument --operator-key: operator key 'abc' is not 64 lowercase hex "
            "digits (a node id)",
        ),
        (
            [
                "weights",
                "fetch",
                "--source",
                "http://127.0.0.1:1",
                "--trainer-key",
                "abc",
                "--out",
                str(tmp_path),
            ],
            "prime-node weights fetch: error: argument --trainer-key: must be the trainer's node id: 64 hex digits, "
            "as `prime-node identity --key TRAINER_KEY` prints (got 'abc')",
        ),
    ]:
        line = one_line(_run(*argv, "--data-dir", str(tmp_path)), 2)
        assert line == expected
        assert "{" not in line  # not the whole settings dict


def test_a_misspelt_environment_variable_is_refused_with_the_closest_name(tmp_path: Path) -> None:
    for name, closest in [
        ("PRIME_NODE_STAUS_PORT", "PRIME_NODE_STATUS_PORT"),
        ("PRIME_NODE_SWARM__INTIAL_PEERS", "PRIME_NODE_SWARM__INITIAL_PEERS"),
    ]:
        result = _run("status", "--data-dir", str(tmp_path), **{name: "1"})
        assert one_line(result, 1) == (
            f"prime-node status: error: environment variable {name} is not a setting of any command; "
            f"did you mean {closest}?"
        )
    # Another command's setting is fine for every command (one environment may serve the trainer and a node):
    # status goes on to its own answer.
    result = _run("status", "--data-dir", str(tmp_path), PRIME_NODE_TRAINER__LR="0.001")
    assert "no node is running" in one_line(result, 1)


def test_every_variable_the_project_sets_is_a_setting() -> None:
    """What the devnet gives its children and the Dockerfile bakes in must pass the check that refuses typos
    (or every devnet and container would stop at start-up); the check itself, not a copy of its list."""
    parser = build_parser()
    models = list(settings_models(parser))
    dockerfile = (Path(__file__).resolve().parents[1] / "Dockerfile").read_text()
    baked = {name: "x" for name in re.findall(r"\b(PRIME_NODE_[A-Z0-9_]+)=", dockerfile)}
    assert "PRIME_NODE_DATA_DIR" in baked and len(baked) >= 10
    for env in (SWARM_ENV, NODE_ENV, TRAINER_ENV, baked):
        check_env_names(models, env)
    with pytest.raises(ConfigError, match="did you mean PRIME_NODE_TRAINER__LR"):
        check_env_names(models, {"PRIME_NODE_TRAINER_LR": "1"})  # the honest control: a typo is refused


def test_status_json_without_a_node_is_a_json_error(tmp_path: Path) -> None:
    result = _run("status", "--json", "--data-dir", str(tmp_path))
    message = (
        f"no node is running for data directory {tmp_path.resolve()} (start one with `prime-node start`)"
    )
    assert one_line(result, 1) == f"prime-node status: error: {message}"
    assert json.loads(result.stdout) == {"command": "status", "error": message, "exit_code": 1}


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            check=True,
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): {exc}")


def test_model_init_on_a_full_disk_stops_before_training(tmp_path: Path) -> None:
    disk = tmp_path / "small"
    _mount_tmpfs(disk, "1m")  # the tiny model's weights alone are 3.2 MiB
    try:
        # So many warm-start steps that training first would run for hours: the bounded run shows it did not.
        result = _run("model", "init", "--out", str(disk / "model"), "--sft-steps", "1000000", timeout=120)
        line = one_line(result, 1)
        assert line.startswith(
            f"prime-node model init: error: not enough free disk for the model in {disk / 'model'}: "
        )
        assert f"MiB free on {disk}, " in line and line.endswith(
            "MiB needed; free space or choose another --out"
        )
        assert list(disk.iterdir()) == []  # no half-written model, no staging directory
    finally:
        subprocess.run(["umount", str(disk)], check=False, capture_output=True, timeout=30)


async def test_a_closed_pipe_ends_the_command_quietly(tmp_path: Path) -> None:
    """`prime-node leaderboard --json | head -c 10`: the reader is gone before the JSON is written."""
    async with running_validator(validator_settings(tmp_path / "validator"), announce=False) as running:
        argv = [sys.executable, "-m", "prime_node.node.cli.main", "leaderboard", "--json"]
        argv += ["--validator", running.dashboard_url]
        with open(tmp_path / "stderr", "wb") as err:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=_env())
            assert proc.stdout is not None
            proc.stdout.close()  # as `head` exits: every write to the pipe now fails
            try:
                code = await asyncio.to_thread(proc.wait, 120)  # the validator answers on this loop
            finally:
                if proc.poll() is None:
                    proc.kill()
        assert (code, (tmp_path / "stderr").read_text()) == (141, "")  # as a process ended by SIGPIPE
        # The honest control: read, the same command prints the leaderboard's JSON.
        result = await asyncio.to_thread(_run, *argv[3:])
        assert result.returncode == 0 and json.loads(result.stdout)["nodes"] == []


@pytest.mark.slow
def test_a_node_that_finds_no_announcement_says_so(tmp_path: Path) -> None:
    """A wrong operator key and a missing trainer look alike: nothing signed by the pinned key arrives. The node
    says so in its log and its status within announcement_wait_s, naming the key, instead of waiting silently."""
    wrong = Identity.generate().node_id  # no trainer holds this key
    Identity.generate().save(tmp_path / "node.key")
    log = tmp_path / "node.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prime_node.node.cli.main", "start", "--data-dir", str(tmp_path)]
            + ["--operator-key", wrong, "--status-port", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(PRIME_NODE_ANNOUNCEMENT_WAIT_S="1"),
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = asyncio.run(fetch_status(tmp_path))
            except DaemonNotRunning:
                status = None
            if status is not None and status.last_error:
                break
            time.sleep(0.5)
        assert status is not None and status.last_error, log.read_text()
        expected = f"no run announcement signed by the operator key {wrong[:16]}… found after "
        assert (
            expected in status.last_error and "--operator-key is the trainer's node id" in status.last_error
        )
        assert "no peers seen: give --peers" in status.last_error
        assert status.state == "waiting for a run announcement" and status.announced_step is None
        warnings = [line for line in log.read_text().splitlines() if expected in line]
        assert warnings and " WARN " in warnings[0], log.read_text()
        shown = _run("status", "--data-dir", str(tmp_path))
        assert shown.returncode == 0 and "last error:     " in shown.stdout and expected in shown.stdout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            end_pids([proc.pid], 5.0)
    assert proc.returncode == 0, log.read_text()  # waiting is not a failure: a stop is still clean
