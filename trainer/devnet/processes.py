"""A group of child processes that is always cleaned up: the devnet's (and the tests') process harness.

Each child runs in its own session (so a Ctrl-C in the terminal reaches only the parent, which then stops
the children in order), writes its output to its own log file, and is stopped in reverse order of start:
SIGTERM, a grace period, then SIGKILL for the whole process group (hivemind's p2pd children included).
`alive()` answers by PID, which is what the end-to-end tests check at the end.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ...p2p.processes import pid_alive

__all__ = ["Child", "ProcessGroup", "StopResult", "descendants", "pid_alive", "start_time", "still_running"]

logger = logging.getLogger(__name__)


def start_time(pid: int) -> float | None:
    """The process's start time (psutil's create_time, from the kernel's start tick and the boot time, so the
    same number every time it is asked): with the PID, it names one process even after the PID is reused.
    None when there is no such process."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def descendants(*roots: int) -> dict[int, float]:
    """Every live process below `roots` (children, grandchildren: a DHT child and its p2pd daemon) with its
    start time."""
    found: dict[int, float] = {}
    for root in roots:
        try:
            below = psutil.Process(root).children(recursive=True)
        except psutil.Error:
            continue
        for process in below:
            try:
                found.setdefault(process.pid, float(process.create_time()))
            except psutil.Error:
                continue  # ended while we looked
    return found


def still_running(pid: int, started: float) -> bool:
    """The same process (PID and start time) is still alive: a reused PID is not mistaken for it."""
    return start_time(pid) == started and pid_alive(pid)


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


@dataclass
class StopResult:
    exit_codes: dict[str, int] = field(default_factory=dict)
    killed: list[str] = field(default_factory=list)  # children that ignored SIGTERM within the grace period


class ProcessGroup:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []

    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None
    ) -> Child:
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "ab")
        try:
            process = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            log.close()  # the child holds its own descriptor
        child = Child(name, process, log_path)
        self.children.append(child)
        logger.debug("started %s (pid %d)", name, process.pid)
        return child

    def get(self, name: str) -> Child:
        for child in self.children:
            if child.name == name:
                return child
        raise KeyError(name)

    def exited(self) -> dict[str, int]:
        """Children that have exited on their own, with their exit codes."""
        return {c.name: c.process.returncode for c in self.children if c.process.poll() is not None}

    def stop(self, child: Child, grace: float = 10.0) -> tuple[int, bool]:
        """SIGTERM, wait up to `grace` s, then SIGKILL the child's process group; returns (exit code, killed)."""
        killed = False
        if child.process.poll() is None:
            self._signal_group(child, signal.SIGTERM)
            try:
                child.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "%s (pid %d) ignored SIGTERM for %.0f s; killing it", child.name, child.pid, grace
                )
                killed = True
        self._signal_group(child, signal.SIGKILL)  # leftovers in its group (e.g. a p2pd daemon) go too
        return child.process.wait(timeout=30), killed

    def stop_together(self, children: Sequence[Child], grace: float = 10.0) -> StopResult:
        """SIGTERM all of `children` at once (peers shut down in parallel), then wait for each in turn."""
        result = StopResult()
        for child in children:
            if child.process.poll() is None:
                self._signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in children:  # no second SIGTERM: a daemon may take a second signal as "exit at once"
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning(
                    "%s (pid %d) ignored SIGTERM for %.0f s; killing it", child.name, child.pid, grace
                )
                result.killed.append(child.name)
            self._signal_group(child, signal.SIGKILL)  # leftovers in its group (e.g. a p2pd daemon) go too
            result.exit_codes[child.name] = child.process.wait(timeout=30)
        return result

    def stop_all(self, grace: float = 10.0) -> StopResult:
        result = StopResult()
        for child in reversed(self.children):
            code, killed = self.stop(child, grace)
            result.exit_codes[child.name] = code
            if killed:
                result.killed.append(child.name)
        return result

    def alive(self) -> list[Child]:
        return [c for c in self.children if pid_alive(c.pid)]

    @staticmethod
    def _signal_group(child: Child, sig: signal.Signals) -> None:
        try:
            os.killpg(child.pid, sig)  # start_new_session made the child its group's leader
        except ProcessLookupError:
            pass

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all(grace=5.0)

    def wait_until(self, predicate: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
        """Poll `predicate()` until true or `timeout` s pass (a bounded loop for harnesses and tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(interval)
        return bool(predicate())
