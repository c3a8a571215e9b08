"""The throughput floor a peer's body must keep, measured over windows: one rule for every byte stream.

A per-read timeout does not bound a transfer: a peer that sends one byte just before each read's timeout
holds the reader for ever. So a body that a peer sends us (a rollout file on a hand-off stream, a shard from
a weight source) must keep a floor: within each window of `window_s` seconds, at least one quota of
`min_bytes_per_s * window_s` bytes must arrive (or the rest of the body, if less). A window ends as soon as
its quota arrived, so a fast peer is never measured against a window it did not need; one that ends
without its quota fails the floor. Callers add their own wall-clock deadline for the whole body.
"""

from __future__ import annotations


class RateFloor:
    """Quota-per-window bookkeeping for one body; `check` after each arrival (or on a timer), `due` to sleep."""

    def __init__(self, min_bytes_per_s: float, window_s: float, now: float, received: int = 0) -> None:
        self.min_bytes_per_s = min_bytes_per_s
        self.window_s = window_s
        self.quota = max(1, int(min_bytes_per_s * window_s))
        self.restart(now, received)

    def restart(self, now: float, received: int) -> None:
        """Begin a fresh window now (e.g. when the body begins after the head)."""
        self.mark_time, self.mark_bytes = now, received
        self.prev_time, self.prev_bytes = now, received  # where the window before the current one began

    def _next_window(self, now: float, received: int) -> None:
        self.prev_time, self.prev_bytes = self.mark_time, self.mark_bytes
        self.mark_time, self.mark_bytes = now, received

    def due(self) -> float:
        """When the current window ends: its quota must have arrived by then."""
        return self.mark_time + self.window_s

    def check(self, now: float, received: int) -> str | None:
        """With `received` bytes in all so far: None while the floor is kept, else why it is not."""
        if received - self.mark_bytes >= self.quota:
            self._next_window(now, received)
            return None
        if now >= self.due():
            return (
                f"sent {received - self.mark_bytes} bytes in {now - self.mark_time:.1f} s, below the floor of "
                f"{self.min_bytes_per_s:.0f} bytes/s over {self.window_s:g} s"
            )
        return None

    def ended_below(self, now: float, received: int) -> str | None:
        """For a body that ended early with `received` bytes: why that ending is a cut (what arrived since the
        previous window began is below the floor pro rata), or None when the peer was keeping the floor.

        Without this, a peer could hold the reader for free by sending nothing and closing just before each
        window ends. Measured from the previous window, not the current one, so that a peer above the floor
        whose link breaks just after it completed a window's quota is not taken for a slow one."""
        recent, recent_s = received - self.prev_bytes, now - self.prev_time
        if recent < self.min_bytes_per_s * recent_s:
            return (
                f"{recent} of them in the last {recent_s:.1f} s: below the floor of "
                f"{self.min_bytes_per_s:.0f} bytes/s"
            )
        return None
