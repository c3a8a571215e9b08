"""What the devnet shows a person while it runs: the live view (rich), on a terminal and in a log.

The terminal mode is checked on what a terminal would finally show: the raw bytes rich wrote are replayed by
a small screen model (`screen`), so a message wiped by a redraw, or frames piling up below each other, would
show there; and no line of any frame may be wider than the terminal (it would wrap, and the next redraw
would leave its extra line behind).
"""

from __future__ import annotations

import io
import re

from rich.cells import cell_len
from rich.console import Console

from prime_node.trainer.devnet.monitor import MemberView, Snapshot
from prime_node.trainer.devnet.view import LiveView

URL = "http://127.0.0.1:43121/"
ESCAPE = re.compile(r"(\x1b\[[0-9;?]*[A-Za-z]|\r|\n)")


def screen(raw: str) -> list[str]:
    """The lines a terminal holds (screen and scrollback) after `raw`: text, newline, carriage return, cursor
    up (ESC[nA), erase line (ESC[2K), home (ESC[H) and erase below (ESC[J); other escapes change no text."""
    lines, row, col = [""], 0, 0
    for token in ESCAPE.split(raw):
        if token == "\n":
            row, col = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif token == "\r":
            col = 0
        elif token.startswith("\x1b["):
            arg, command = token[2:-1], token[-1]
            if command == "A":
                row = max(0, row - int(arg or 1))
            elif command == "K":
                lines[row] = ""
            elif command == "H":
                row, col = 0, 0
            elif command == "J":
                del lines[row + 1 :]
                lines[row] = lines[row][:col]
        elif token:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + token + line[col + len(token) :]
            col += len(token)
    while len(lines) > 1 and not lines[-1]:  # the cursor's line after a final newline
        lines.pop()
    return [line.rstrip() for line in lines]


def widest(raw: str) -> int:
    """The most cells any line of any frame took: a line wider than the terminal would wrap and push the
    frame's height beyond what rich moves the cursor back over."""
    col = most = 0
    for token in ESCAPE.split(raw):
        if token in ("\n", "\r"):
            col = 0
        elif token and not token.startswith("\x1b"):
            col += cell_len(token)
            most = max(most, col)
    return most


def snapshot(members: int = 3) -> Snapshot:
    return Snapshot(
        at=0,
        step=0,
        task_reward=None,
        rollout_reward=None,
        members=[
            MemberView(f"node-{i + 1}", f"{i:02x}" * 32, None, state="generating batch 0 at step 0")
            for i in range(members)
        ]
        + [MemberView("adv-1-inflated-rewards", "ef" * 32, "inflated-rewards", state="sending")],
        queue_depth=0,
        accepted_files=0,
        rejected_files=0,
        dashboard_url=URL,
    )


def terminal(width: int, height: int = 40) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=width, height=height, record=True), out


def test_terminal_view_redraws_one_table_in_place_below_the_messages_and_fits_the_width() -> None:
    console, out = terminal(width=72)
    view = LiveView(5, console)
    assert view.live
    view.message(f"validator 1234abcd: dashboard {URL}")
    snap = snapshot()
    for step in range(1, 6):  # five polls, a new step each, a verdict and at last a ban
        snap.step, snap.task_reward, snap.rollout_reward = step, 0.5, 0.25
        snap.members[0].accepted = step
        snap.members[-1].banned = step == 5
        view.update(snap)
    view.message("a message while the table is up goes above it")
    view.close()
    view.message("stopping")
    shown = screen(out.getvalue())
    # The dashboard URL was not wiped by a redraw: it is on the screen once as the message, once in the caption.
    assert shown[0].endswith(f"dashboard {URL}") and sum(URL in line for line in shown) == 2, shown
    assert shown[1] == "[00:00] a message while the table is up goes above it"
    assert shown[-1] == "[00:00] stopping"
    # One frame, the last one: nothing piled up in the scrollback.
    assert sum("node-1" in line for line in shown) == 1 and sum("step 5/5" in line for line in shown) == 1
    assert any(line.startswith("adv-1") and line.endswith("BANNED") for line in shown), shown
    row = next(line for line in shown if "node-1" in line)
    assert "honest" in row and " 5 " in row  # its accepted files
    # Every line of every frame fits the terminal: columns shrink, a row never wraps to a second line.
    assert widest(out.getvalue()) <= 72


def test_terminal_view_fits_a_narrow_and_short_terminal() -> None:
    console, out = terminal(width=48, height=12)
    view = LiveView(5, console)
    view.update(snapshot(members=30))  # taller than the terminal: cropped while it runs, not scrolled
    view.update(snapshot(members=30))
    shown = screen(out.getvalue())
    assert len(shown) <= 12 and shown[-1].strip() == "...", shown
    assert "node  role  ckpt  files  sent  ok  rej  state" in shown
    assert widest(out.getvalue()) <= 48
    view.close()  # the last frame is then printed whole, once, for the scrollback
    shown = screen(out.getvalue())
    assert sum(line.startswith("node ") for line in shown) == 1
    assert shown[-3].startswith("adv") and shown[-2].startswith("dashboard "), shown


def test_plain_view_prints_one_line_per_change_and_no_escapes() -> None:
    out = io.StringIO()
    view = LiveView(5, Console(file=out, width=60))  # not a terminal: the plain mode by itself
    assert not view.live
    view.message(f"validator 1234abcd: dashboard {URL}")
    snap = snapshot(members=1)
    view.update(snap)
    view.update(snap)  # nothing changed: nothing printed
    snap.members[0].state = "generating batch 1 at step 0"  # a new batch alone is not a change worth a line
    view.update(snap)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 + 1 + 2, lines  # the message, the header, a line per member
    assert "\x1b" not in out.getvalue()
    # A log line is never wrapped at the console's width (grep finds a whole line).
    assert all(line.startswith("[00:00] ") for line in lines) and max(len(line) for line in lines) > 60
    snap.members[-1].banned = True
    view.update(snap)
    assert out.getvalue().splitlines()[-1].endswith("BANNED")
    snap.step, snap.task_reward, snap.rollout_reward = (
        1,
        0.5,
        0.25,
    )  # a step: one header line with both rewards
    view.update(snap)
    assert "step 1/5  reward: rollouts 0.250 batch 0.500" in out.getvalue().splitlines()[-1]
    view.close()  # nothing to stop


def test_terminal_console_forced_to_lines_prints_no_table() -> None:
    # --json: the view writes to stderr, plain, even when stderr is a terminal.
    console, out = terminal(width=80)
    view = LiveView(5, console, live=False)
    view.update(snapshot(members=1))
    view.close()
    assert "┃" not in out.getvalue() and "step 0/5" in out.getvalue()
