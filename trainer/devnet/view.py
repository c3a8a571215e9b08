"""The devnet's live view: a rich Live table on a terminal, one plain line per change otherwise.

On a terminal (`rich.live.Live`) the table is redrawn in place, sized to the terminal's width (columns shrink,
long states end in an ellipsis, a row never wraps) and cropped to its height, so no frame is ever pushed
into the scrollback. One-off messages (the run directory, the dashboard URL) are printed above the table
and stay there; the table's caption repeats the dashboard URL as well. In a log or a pipe only the lines
whose meaning changed are printed, each once, with the elapsed time: a new policy step, a node moving to
another checkpoint, a verdict, a ban.
"""

from __future__ import annotations

import time

from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .monitor import MemberView, Snapshot


def header(snapshot: Snapshot, total_steps: int) -> str:
    rollouts = "  -  " if snapshot.rollout_reward is None else f"{snapshot.rollout_reward:.3f}"
    batch = "  -  " if snapshot.task_reward is None else f"{snapshot.task_reward:.3f}"
    return (
        f"step {snapshot.step}/{total_steps}  reward: rollouts {rollouts} batch {batch}  "
        f"verdicts: {snapshot.accepted_files} "
        f"accepted, {snapshot.rejected_files} rejected  validator queue {snapshot.queue_depth}"
    )


def role(m: MemberView) -> str:
    kind = "honest" if m.attack is None else f"attack:{m.attack}"
    return kind if m.stage is None else f"{kind} ({m.stage})"


def member_line(m: MemberView) -> str:
    """One member as a log line (the plain mode)."""
    step = "-" if m.local_step is None else str(m.local_step)
    verdicts = f"{m.accepted} ok / {m.rejected} rejected"
    flag = "  BANNED" if m.banned else ""
    return (
        f"{m.name} {m.node_id[:8]} {role(m)} ckpt {step} files {m.generated} sent {m.handed_off} "
        f"{verdicts} {m.state}{flag}"
    )


def _member_key(m: MemberView) -> tuple[object, ...]:
    """What counts as a change worth a line in a log: not every batch's state text."""
    return m.local_step, m.accepted, m.rejected, m.banned, m.state.split(" ")[0]


def table(snapshot: Snapshot, total_steps: int, elapsed: str, width: int) -> Table:
    """The terminal view, `width` cells wide at most: one row per contributor, the run's totals in the title.

    Every cell stays on one line (a row never doubles): the counts keep their natural width, and node, role
    and state share what is left, each cut with an ellipsis when the terminal is too narrow for it.
    """
    rows = [
        (
            m.name,
            m.attack or "honest",  # an attack's name in magenta: "attack:" would only take room
            "-" if m.local_step is None else str(m.local_step),
            str(m.generated),
            str(m.handed_off),
            str(m.accepted),
            str(m.rejected),
            "BANNED" if m.banned else m.state,
        )
        for m in snapshot.members
    ]
    headers = ("node", "role", "ckpt", "files", "sent", "ok", "rej", "state")
    natural = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    # Two cells between columns (a padding cell and the separator); the counts are never cut.
    room = width - 2 * (len(headers) - 1) - sum(natural[2:7])
    node_w = min(natural[0], max(4, room * 3 // 10))
    role_w = min(natural[1], max(4, room * 3 // 10))
    state_w = max(5, min(natural[7], room - node_w - role_w))
    t = Table(
        title=Text(f"prime-node devnet [{elapsed}]  {header(snapshot, total_steps)}", style="bold"),
        caption=(f"dashboard {snapshot.dashboard_url}  |  " if snapshot.dashboard_url else "")
        + "Ctrl-C stops the run and prints the report",
        title_justify="left",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1, 0, 0),
    )
    for h, w in zip(headers, (node_w, role_w, *natural[2:7], state_w)):
        right = h not in ("node", "role", "state")
        t.add_column(h, width=w, justify="right" if right else "left", no_wrap=True, overflow="ellipsis")
    for m, r in zip(snapshot.members, rows):
        t.add_row(
            *r[:1],
            Text(r[1], style="green" if m.attack is None else "magenta"),
            *r[2:6],
            Text(r[6], style="red" if m.rejected else ""),
            Text(r[7], style="bold red" if m.banned else ""),
        )
    return t


class LiveView:
    """`live` None: the table on a terminal, lines otherwise (the console decides: a pipe, a file, TERM=dumb
    are not terminals); False: lines wherever (--json, whose stdout carries only the report)."""

    def __init__(self, total_steps: int, console: Console | None = None, *, live: bool | None = None) -> None:
        self.console = console or Console()
        self.live = self.console.is_terminal and not self.console.is_dumb_terminal if live is None else live
        self.total_steps = total_steps
        self.started = time.monotonic()
        self._live: Live | None = None
        self._last: dict[str, tuple[object, ...]] = {}

    def message(self, text: str) -> None:
        """A one-off line (start-up progress), shown in both modes; above the table on a terminal."""
        self._print(f"[{self._elapsed()}] {text}")

    def update(self, snapshot: Snapshot) -> None:
        if self.live:
            view = table(snapshot, self.total_steps, self._elapsed(), self.console.width)
            if self._live is None:
                self._live = Live(
                    view,
                    console=self.console,
                    auto_refresh=False,  # redrawn on each poll: no thread of its own
                    vertical_overflow="ellipsis",  # taller than the terminal: cropped, never scrolled
                )
                self._live.start(refresh=True)
            else:
                self._live.update(view, refresh=True)
            return
        changes = []
        key = (snapshot.step, snapshot.task_reward, snapshot.rollout_reward)
        if self._last.get("") != key:
            self._last[""] = key
            changes.append(header(snapshot, self.total_steps))
        for m in snapshot.members:
            if self._last.get(m.name) != (k := _member_key(m)):
                self._last[m.name] = k
                changes.append(member_line(m))
        for line in changes:
            self._print(f"[{self._elapsed()}] {line}")

    def close(self) -> None:
        """Stop redrawing; the last frame stays on the screen, and what is printed next goes below it."""
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _print(self, line: str) -> None:
        # Plain text: no markup parsing ("[00:12]" is not a tag), no highlighting, no wrapping in a log.
        self.console.print(line, markup=False, highlight=False, soft_wrap=not self.live)

    def _elapsed(self) -> str:
        seconds = int(time.monotonic() - self.started)
        return f"{seconds // 60:02d}:{seconds % 60:02d}"
