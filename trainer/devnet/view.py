"""The devnet's live terminal view: a redrawn table on a terminal, one line per change otherwise.

On a TTY the whole view is redrawn in place with plain ANSI escapes (cursor home, clear to end): no
curses, no new dependency. In a log or a pipe only the lines whose meaning changed are printed, each
once, with the elapsed time: a new policy step, a node moving to another checkpoint, a verdict, a ban.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .monitor import MemberView, Snapshot

HOME_CLEAR = "\x1b[H\x1b[J"
STATE_WIDTH = 44


def header(snapshot: Snapshot, total_steps: int) -> str:
    rollouts = "  -  " if snapshot.rollout_reward is None else f"{snapshot.rollout_reward:.3f}"
    batch = "  -  " if snapshot.task_reward is None else f"{snapshot.task_reward:.3f}"
    return (
        f"step {snapshot.step}/{total_steps}  reward: rollouts {rollouts} batch {batch}  "
        f"verdicts: {snapshot.accepted_files} "
        f"accepted, {snapshot.rejected_files} rejected  validator queue {snapshot.queue_depth}"
    )


def member_line(m: MemberView) -> str:
    role = "honest" if m.attack is None else f"attack:{m.attack}"
    step = "-" if m.local_step is None else str(m.local_step)
    verdicts = f"{m.accepted} ok / {m.rejected} rejected"
    flag = "  BANNED" if m.banned else ""
    return (
        f"  {m.name:<22} {m.node_id[:8]} {role:<23} ckpt {step:>3}  files {m.generated:>3} sent {m.handed_off:>3}  "
        f"{verdicts:<18} {m.state[:STATE_WIDTH]}{flag}"
    )


def _member_key(m: MemberView) -> tuple[object, ...]:
    """What counts as a change worth a line in a log: not every batch's state text."""
    return m.local_step, m.accepted, m.rejected, m.banned, m.state.split(" ")[0]


class LiveView:
    def __init__(self, total_steps: int, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.total_steps = total_steps
        self.started = time.monotonic()
        self._last: dict[str, tuple[object, ...]] = {}

    def message(self, text: str) -> None:
        """A one-off line (start-up progress), shown in both modes."""
        self.stream.write(f"[{self._elapsed()}] {text}\n")
        self.stream.flush()

    def update(self, snapshot: Snapshot) -> None:
        if self.tty:
            lines = [
                f"prime-node devnet  [{self._elapsed()}]  (Ctrl-C stops it and prints the report)",
                header(snapshot, self.total_steps),
                *(member_line(m) for m in snapshot.members),
            ]
            self.stream.write(HOME_CLEAR + "\n".join(lines) + "\n")
        else:
            changes = []
            key = (snapshot.step, snapshot.task_reward, snapshot.rollout_reward)
            if self._last.get("") != key:
                self._last[""] = key
                changes.append(header(snapshot, self.total_steps))
            for m in snapshot.members:
                if self._last.get(m.name) != (k := _member_key(m)):
                    self._last[m.name] = k
                    changes.append(member_line(m).strip())
            for line in changes:
                self.stream.write(f"[{self._elapsed()}] {line}\n")
        self.stream.flush()

    def _elapsed(self) -> str:
        seconds = int(time.monotonic() - self.started)
        return f"{seconds // 60:02d}:{seconds % 60:02d}"
