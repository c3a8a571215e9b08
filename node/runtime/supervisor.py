"""Named, supervised asyncio tasks with a bounded, ordered shutdown.

Every long-running activity of a process (heartbeat, policy watcher, rollout loop, status API) runs as a
named task under one Supervisor: spawned by it, or, when a lower-layer component (p2p/) starts its own
background tasks, handed to it with `supervise` (the component names them and exposes them; it keeps no
crash bookkeeping of its own). A task that crashes is not lost in the background: the supervisor
records it and `wait()` re-raises it in the main coroutine, which then shuts everything down. Shutdown
cancels tasks in reverse order of start, gives each a deadline, runs the registered cleanups (also in
reverse order), collects every error, and reports them together.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from ..errors import OperatorActionNeeded

logger = logging.getLogger(__name__)

Cleanup = Callable[[], Awaitable[None]]


class TaskCrashed(Exception):
    """A supervised task raised; `task_name` says which, __cause__ holds the original exception."""

    def __init__(self, task_name: str, error: BaseException) -> None:
        super().__init__(f"task {task_name!r} crashed: {type(error).__name__}: {error}")
        self.task_name = task_name


@dataclass
class ShutdownReport:
    """What happened during shutdown: errors by step, tasks that ignored cancellation, time taken."""

    errors: list[tuple[str, BaseException]] = field(default_factory=list)
    stuck_tasks: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not self.errors and not self.stuck_tasks


class Supervisor:
    def __init__(self, name: str = "supervisor") -> None:
        self.name = name
        self._tasks: list[asyncio.Task[Any]] = []
        self._cleanups: list[tuple[str, Cleanup]] = []
        self._stop = asyncio.Event()
        self._crash: TaskCrashed | None = None
        self._needs_operator: OperatorActionNeeded | None = None
        self.stop_reason: str | None = None

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Start `coro` as a named task; if it raises, the whole process stops and the error surfaces."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._on_done)
        self._tasks.append(task)
        logger.debug("started task %s", name)
        return task

    def supervise(self, *tasks: asyncio.Task[Any]) -> None:
        """Supervise tasks a component started itself (the swarm's heartbeat, a weights server's rescans) exactly
        as if spawned here: a crash stops the process, shutdown cancels them in their place in the order."""
        for task in tasks:
            task.add_done_callback(self._on_done)
            self._tasks.append(task)
            logger.debug("supervising task %s", task.get_name())

    def on_shutdown(self, name: str, cleanup: Cleanup) -> None:
        """Register an async cleanup (close a server, leave the DHT); they run in reverse order."""
        self._cleanups.append((name, cleanup))

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        # A finished task is dropped: a daemon that starts one task per pipeline group it joins would otherwise
        # hold every task it ever ran (a crash is kept in self._crash, not through the task).
        if task in self._tasks:
            self._tasks.remove(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            return
        if isinstance(error, OperatorActionNeeded):
            if self._needs_operator is None:
                self._needs_operator = error
                logger.error("%s", error)
            self.request_stop(f"task {task.get_name()} stopped: the operator must act")
            return
        if self._crash is None:
            self._crash = TaskCrashed(task.get_name(), error)
            self._crash.__cause__ = error
            logger.error("task %s crashed", task.get_name(), exc_info=error)
        self.request_stop(f"task {task.get_name()} crashed")

    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            logger.info("stopping: %s", reason)
            self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def install_signal_handlers(self) -> None:
        """SIGINT and SIGTERM request a graceful stop; a second signal is left to the default handler."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):

            def handler(sig: signal.Signals = sig) -> None:
                loop.remove_signal_handler(sig)  # a second Ctrl-C kills at once, as an operator expects
                self.request_stop(f"received {sig.name}")

            loop.add_signal_handler(sig, handler)

    async def wait(self) -> None:
        """Block until a stop is requested; raise TaskCrashed if a task crashed (a bug outranks the rest),
        else the OperatorActionNeeded error a task raised."""
        await self._stop.wait()
        if self._crash is not None:
            raise self._crash
        if self._needs_operator is not None:
            raise self._needs_operator

    async def sleep_or_stop(self, seconds: float) -> bool:
        """Sleep up to `seconds`; return True early (and True) if a stop was requested."""
        try:
            async with asyncio.timeout(seconds):
                await self._stop.wait()
        except TimeoutError:
            return False
        return True

    async def shutdown(self, timeout: float = 20.0) -> ShutdownReport:
        """Cancel tasks (reverse start order), then run cleanups (reverse order), all within `timeout` s."""
        started = time.monotonic()
        deadline = started + timeout
        report = ShutdownReport()
        self.request_stop(self.stop_reason or "shutdown")
        for task in reversed(list(self._tasks)):  # a copy: tasks leave the list as they finish
            if task.done():
                continue
            # Cancel again every little while: before Python 3.12, asyncio.wait_for swallows a cancellation
            # that arrives as its inner future completes, and the task would then run on (bpo-42130).
            while not task.done() and time.monotonic() < deadline:
                task.cancel()
                await asyncio.wait({task}, timeout=min(0.25, max(0.0, deadline - time.monotonic())))
            if not task.done():
                report.stuck_tasks.append(task.get_name())
                logger.error("task %s did not stop in time", task.get_name())
            elif not task.cancelled() and task.exception() is not None:
                # the task failed while being cancelled: keep going, report it
                report.errors.append((task.get_name(), task.exception()))
        for name, cleanup in reversed(self._cleanups):
            try:
                await asyncio.wait_for(cleanup(), timeout=max(0.5, deadline - time.monotonic()))
            except Exception as exc:  # collect, so one failing cleanup does not skip the others
                report.errors.append((name, exc))
                logger.error("cleanup %s failed: %s", name, exc)
        report.seconds = time.monotonic() - started
        return report
