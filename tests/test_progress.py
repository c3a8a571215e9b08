"""Progress bars of the long steps (node/runtime/progress.py): drawn on stderr when it is a terminal, never
under --json, never into a log or a pipe.

The terminal is a real pseudo-terminal (os.openpty, 100 columns), put in place of sys.stderr; a thread
drains it so a bar can never block on a full buffer. Each case has its control: the same step with stderr a
plain file (as under a service manager or the devnet's per-process logs) or with --json, which must write no
bar at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from prime_node.node.cli.main import main
from prime_node.node.contributor.checkpoints import CheckpointKeeper
from prime_node.node.contributor.state import NodeState
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import PolicyAnnouncement
from prime_node.p2p.weights.store import Store
from prime_node.trainer.devnet.tasks import TaskFilter, filtered_tasks

from support.devnet import tiny_model
from support.swarm import RUN_PARAMETERS
from support.weights import operator, publish_steps, serving


@contextlib.contextmanager
def terminal(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], str]]:
    """sys.stderr on a pseudo-terminal; yields a function returning everything written to it so far."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    stream = os.fdopen(slave, "w", buffering=1)
    seen = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the slave side closed
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=drain, name="pty-drain", daemon=True)
    reader.start()
    monkeypatch.setattr(sys, "stderr", stream)

    def written() -> str:
        stream.flush()
        time.sleep(0.2)  # the drain thread's last read
        return seen.decode(errors="replace")

    try:
        yield written
    finally:
        monkeypatch.undo()
        stream.close()
        reader.join(5)
        os.close(master)


@pytest.fixture
def plain_stderr(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Callable[[], str]]:
    """sys.stderr on an ordinary file: not a terminal."""
    path = tmp_path / "stderr.log"
    with path.open("w") as stream:
        monkeypatch.setattr(sys, "stderr", stream)
        yield lambda: (stream.flush(), path.read_text())[1]


def test_the_devnet_task_filter_shows_a_bar_on_a_terminal_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model(tmp_path / "tiny")
    spec = TaskFilter(count=16, low=0.0, high=1.0, max_new_tokens=4)
    with terminal(monkeypatch) as written:
        path, summary = filtered_tasks(model, spec, progress=True)
        shown = written()
    assert path is not None and "kept 16" in summary
    assert "filtering tasks" in shown and "16/16" in shown, shown
    # The control: into a log file, the same filtering draws nothing (a new spec: the first one is cached).
    log = tmp_path / "log"
    with log.open("w") as stream:
        monkeypatch.setattr(sys, "stderr", stream)
        filtered_tasks(model, TaskFilter(count=8, low=0.0, high=1.0, max_new_tokens=4), progress=True)
    assert "filtering tasks" not in log.read_text()


def test_model_init_shows_the_warm_start_bar_on_a_terminal_but_not_under_json_or_in_a_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRIME_NODE_WARM_START__EVAL_SIZE", "16")
    argv = ["model", "init", "--sft-steps", "3"]
    with terminal(monkeypatch) as written:
        assert main([*argv, "--out", str(tmp_path / "tty")]) == 0
        shown = written()
    assert "warm start: 100%" in shown and "3/3" in shown, shown
    with terminal(monkeypatch) as written:
        assert main([*argv, "--out", str(tmp_path / "json"), "--json"]) == 0
        quiet = written()
    assert "warm start" in quiet and "3/3" not in quiet, quiet  # --json: its log line, but no bar
    # A log (stderr a pipe), as a separate process would run it: no bar, though --no-progress was not given,
    # and none of transformers' own ("Writing model shards": milliseconds, one per save).
    logged = subprocess.run(
        [sys.executable, "-m", "prime_node.node.cli.main", *argv, "--out", str(tmp_path / "log")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert logged.returncode == 0, logged.stderr
    assert "warm start: 3 steps" in logged.stderr and "3/3" not in logged.stderr, logged.stderr
    assert "Writing model shards" not in logged.stderr and "\r" not in logged.stderr, logged.stderr


async def test_the_node_shows_a_bar_while_it_downloads_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = operator()
    manifests = publish_steps(tmp_path, key, [0, 1], megabytes=0.3)

    def keeper(name: str, after_s: float | None) -> CheckpointKeeper:
        state = NodeState(node_id=Identity.generate().node_id, operator_key=key.node_id)
        return CheckpointKeeper(
            Store(tmp_path / name), key.node_id, state, async_level=2, download_bar_after_s=after_s
        )

    def policy(step: int, source: str) -> PolicyAnnouncement:
        digest = manifests[step].digest
        return PolicyAnnouncement(
            step=step, manifest_sha256=digest, sources=[source], published_at=time.time(), run=RUN_PARAMETERS
        )

    async with serving(tmp_path / "origin", key.node_id) as server:
        with terminal(monkeypatch) as written:
            watched = keeper("watched", 0.0)
            assert await watched.try_fetch(policy(1, server.url))
            # --log-json: no bar, on the same terminal.
            logged = keeper("logged", None)
            before = written()
            assert await logged.try_fetch(policy(1, server.url))
            after = written()
    size = manifests[1].body.total_size
    # The bar was sized by the manifest (310k of 0.3 MiB); leave=False clears it once the download is done.
    assert "checkpoint step 1" in before and "310k" in before, before
    assert watched.state.metrics.download_bytes._value.get() >= size  # the metric is still fed
    assert "B/s" not in after[len(before) :], after[len(before) :]  # log lines perhaps, no bar
    assert logged.verified_steps() == [1]
