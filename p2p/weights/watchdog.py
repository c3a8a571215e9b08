"""Wall-clock deadlines and a throughput floor for the blocking requests a fetch makes to its sources.

A socket timeout bounds one read, not a request: a source that sends a byte just before each timeout keeps a
blocking read (http.client's header parsing, a buffered body read) alive for ever. So every request is
registered here as a Watch, and one watchdog thread per connection pool checks them every TICK_S: a request
past its deadline, one that got no response head in time, or one whose body fell below the floor rate over
a window, is cut by shutting its socket down. The blocked read then returns at once, and the transfer thread
raises the reason the watchdog recorded, so the failure is charged to that source with a clear message. The
same cut, with `cancelled` set, stops the losing copy of a hedged shard and every transfer of a cancelled fetch.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from ..rate_floor import RateFloor

logger = logging.getLogger(__name__)

TICK_S = 0.05  # how often deadlines are checked: the slack on every deadline and floor


class Watch:
    """One request in flight. The thread doing it adds to `received`; the watchdog (or a canceller) cuts it."""

    def __init__(
        self, *, deadline_s: float, head_s: float | None = None, min_rate: float = 0.0, window_s: float = 0.0
    ) -> None:
        now = time.monotonic()
        self.started = now
        self.deadline_s = deadline_s
        self.deadline = now + deadline_s  # the whole request: connect, head, body
        self.head_by = (
            now + head_s if head_s is not None else None
        )  # the response head must have arrived by then
        self.received = 0  # body bytes so far (written by the transfer thread only)
        self.body_since: float | None = None  # when the response head arrived
        # The body's floor (p2p/rate_floor.py), from the moment its head arrived; None: no floor.
        self.floor = RateFloor(min_rate, window_s, now) if min_rate > 0 else None
        self.sock: socket.socket | None = None
        self.reason: str | None = None  # why it was cut; set once, before the socket is shut
        self.cancelled = False  # cut because we no longer want it (not the source's fault)

    def body_begins(self) -> None:
        now = time.monotonic()
        self.body_since = now
        if self.floor is not None:
            self.floor.restart(now, self.received)

    def rate(self, now: float) -> float:
        """Body bytes per second since the request started (what a scheduler compares sources by)."""
        return self.received / max(now - self.started, 1e-6)

    def overdue(self, now: float) -> str | None:
        """Why this request must be cut now, if it must."""
        if now >= self.deadline:
            return f"missed its {self.deadline_s:.1f} s deadline ({self.received} body bytes received)"
        if self.body_since is None:
            if self.head_by is not None and now >= self.head_by:
                return f"sent no complete response head within {self.head_by - self.started:.1f} s"
            return None
        return self.floor.check(now, self.received) if self.floor is not None else None


class Watchdog:
    """The thread that cuts overdue requests; it runs only while some request is watched."""

    def __init__(self, tick_s: float = TICK_S) -> None:
        self.tick_s = tick_s
        self._watches: set[Watch] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, w: Watch) -> None:
        with self._lock:
            self._watches.add(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="weights-watchdog", daemon=True)
                self._thread.start()

    def unwatch(self, w: Watch) -> None:
        with self._lock:
            self._watches.discard(w)

    def attach(self, w: Watch, sock: socket.socket | None) -> None:
        """Bind the socket a watched request now uses; one cut meanwhile is applied at once."""
        with self._lock:
            w.sock = sock
            if w.reason is not None:
                _shut(sock)

    def cut(self, w: Watch, reason: str, *, cancelled: bool = False) -> None:
        with self._lock:
            if w.reason is None:
                w.reason = reason
                w.cancelled = cancelled
            _shut(w.sock)

    def cut_all(self, reason: str) -> None:
        with self._lock:
            watches = list(self._watches)
        for w in watches:
            self.cut(w, reason, cancelled=True)

    def _run(self) -> None:
        while True:
            time.sleep(self.tick_s)
            now = time.monotonic()
            with self._lock:
                if not self._watches:
                    self._thread = None  # under the lock: the next watch() starts a new thread
                    return
                watches = [w for w in self._watches if w.reason is None]
            for w in watches:
                reason = w.overdue(now)
                if reason is not None:
                    logger.debug("cutting a request to a weight source: %s", reason)
                    self.cut(w, reason)


def _shut(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)  # a thread blocked in recv on it returns at once
    except OSError:
        pass
