"""The devnet's process harness: children stopped gracefully, stubborn ones killed, none left behind."""

from __future__ import annotations

import sys
import textwrap

from prime_node.trainer.devnet.processes import ProcessGroup, pid_alive

GRACEFUL = textwrap.dedent(
    """
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    print("ready", flush=True)
    while True: time.sleep(0.05)
    """
)
STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(grandchild.pid, flush=True)
    while True: time.sleep(0.05)
    """
)


def test_graceful_and_stubborn_children_are_all_gone(tmp_path):
    group = ProcessGroup(tmp_path)
    good = group.start("good", [sys.executable, "-c", GRACEFUL])
    bad = group.start("bad", [sys.executable, "-c", STUBBORN])
    assert group.wait_until(
        lambda: "ready" in good.log_tail() and bad.log_tail().strip().isdigit(), timeout=30
    )
    grandchild = int(bad.log_tail().strip())
    result = group.stop_all(grace=1.0)
    assert result.exit_codes["good"] == 0
    assert result.killed == ["bad"] and result.exit_codes["bad"] == -9
    assert group.alive() == []
    assert group.wait_until(lambda: not pid_alive(grandchild), timeout=10)  # killed with its process group


def test_exited_reports_children_that_died_on_their_own(tmp_path):
    with ProcessGroup(tmp_path) as group:
        child = group.start("oops", [sys.executable, "-c", "raise SystemExit(3)"])
        assert group.wait_until(lambda: "oops" in group.exited(), timeout=30)
        assert group.exited() == {"oops": 3}
    assert not pid_alive(child.pid)
