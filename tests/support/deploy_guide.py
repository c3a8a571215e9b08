"""docs/deploy.md as a script: its marked shell blocks, run each on its "machine" as the guide says.

The guide marks every block a person types with an HTML comment (invisible when rendered) naming where it
runs and what it gives back:

    <!-- deploy-test: on=trainer prints=OPERATOR_KEY -->   run on the trainer; its last stdout line is
                                                          the run sheet's OPERATOR_KEY from then on
    <!-- deploy-test: sheet -->                            the run sheet: `export NAME=value` lines
    <!-- deploy-test: on=contributor until=REGEX -->       re-run until its output matches (a check)
    <!-- deploy-test: on=validator phase=stop -->          run at the end, in the order written

A machine is a home directory of its own (so `~/.prime-node` is its own data directory); every block runs
in a fresh `bash -euo pipefail` in that home, after the run sheet, in its own session so that whatever it
leaves running (the guide's `nohup ... &`) can be found and stopped. The run sheet is the only thing a test
changes: `GuideRun(values=...)` replaces the value of sheet variables, and refuses names the sheet has not.
A variable the sheet leaves empty (`export TRAINER_PEER=  # printed by ...`) is left out until the block that
prints it has run, so a block that needs it earlier fails on an unbound variable instead of using "".
`scp FILE HOST:` between machines is a small stand-in that copies into HOST's home directory (with `-p`'s
modes), the only ssh use the guide makes. Nothing from the test's own environment that could configure
prime-node (`PRIME_NODE_*`) reaches the blocks.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"

_BLOCK = re.compile(r"^<!-- deploy-test: (?P<marker>[^\n]*?) -->\n```bash\n(?P<body>.*?)^```$", re.M | re.S)
_EXPORT = re.compile(r"^export (?P<name>[A-Z][A-Z0-9_]*)=(?P<value>.*)$")
_SCP = """#!{python}
# scp for tests/support/deploy_guide.py: `scp [-p] FILE... HOST:[DIR/]` copies into HOST's home directory.
import os, shutil, sys
args = [a for a in sys.argv[1:] if a != "-p"]
*sources, dest = args
host, sep, where = dest.partition(":")
if not sep or not sources or any(":" in s for s in sources):
    sys.exit(f"scp stand-in: only FILE... HOST:[DIR/] is supported, not {{sys.argv[1:]}}")
target = os.path.join({root!r}, host, where)
for source in sources:
    shutil.copy2(source, target)
"""


@dataclass(frozen=True)
class Block:
    body: str
    on: str | None = None  # the machine; None for the run sheet
    prints: str | None = None  # the run-sheet variable its last stdout line gives
    until: re.Pattern[str] | None = None  # re-run until the output matches
    stop: bool = False  # runs at the end (phase=stop)
    line: int = 0  # where it starts in the guide

    @property
    def sheet(self) -> bool:
        return self.on is None


def blocks(text: str | None = None) -> list[Block]:
    """The guide's marked blocks, in order; ValueError on a marker it does not understand."""
    text = GUIDE.read_text() if text is None else text
    found = []
    for match in _BLOCK.finditer(text):
        line = text.count("\n", 0, match.start()) + 2
        words = match["marker"].split()
        if words == ["sheet"]:
            found.append(Block(match["body"], line=line))
            continue
        options = dict(word.split("=", 1) for word in words if "=" in word)
        if len(options) != len(words) or not set(options) <= {"on", "prints", "until", "phase"}:
            raise ValueError(f"docs/deploy.md:{line}: marker not understood: {match['marker']!r}")
        if "on" not in options or options.get("phase", "stop") != "stop":
            raise ValueError(f"docs/deploy.md:{line}: a marker needs on=MACHINE (and phase=stop, if any)")
        until = options.get("until")
        found.append(
            Block(
                match["body"],
                on=options["on"],
                prints=options.get("prints"),
                until=re.compile(until) if until else None,
                stop="phase" in options,
                line=line,
            )
        )
    return found


def sheet_values(sheet: Block) -> dict[str, str]:
    """The run sheet's variables with their values as written (placeholders included)."""
    values = {}
    for raw in sheet.body.splitlines():
        if not raw.strip():
            continue
        match = _EXPORT.match(raw)
        if match is None:
            raise ValueError(f"docs/deploy.md:{sheet.line}: the run sheet holds only export lines: {raw!r}")
        value = match["value"].split(" #", 1)[0].strip()
        values[match["name"]] = value
    return values


def is_placeholder(value: str) -> bool:
    """A run-sheet value left empty, for a step to print."""
    return value == ""


@dataclass
class Ran:
    block: Block
    machine: str
    stdout: str
    stderr: str
    returncode: int
    seconds: float  # wall time of the block


@dataclass
class GuideRun:
    """Runs the guide's blocks on machines under `root`; `values` replace run-sheet values."""

    root: Path
    values: dict[str, str] = field(default_factory=dict)
    tools: Path | None = None  # prepended to PATH: where `prime-node` is (default: this Python's bin)
    timeout_s: float = 420.0  # one block (the guide's own waits are 300 s at most)
    sessions: list[int] = field(default_factory=list)  # one per block run: what it left running
    known: dict[str, str] = field(default_factory=dict)  # values printed by blocks so far
    ran: list[Ran] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all = blocks()
        sheets = [b for b in self.all if b.sheet]
        if len(sheets) != 1:
            raise ValueError(f"docs/deploy.md has {len(sheets)} run sheets; one expected")
        self.sheet = sheets[0]
        written = sheet_values(self.sheet)
        unknown = sorted(set(self.values) - set(written))
        if unknown:
            raise ValueError(f"not run-sheet variables of docs/deploy.md: {unknown}")
        printed = {b.prints for b in self.all if b.prints}
        missing = sorted(printed - set(written))
        if missing:
            raise ValueError(f"docs/deploy.md prints {missing}, which its run sheet does not name")
        for machine in self.machines():  # the machines exist before the guide starts
            self.home(machine)
        self.bin = self.root / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        scp = self.bin / "scp"
        scp.write_text(_SCP.format(python=sys.executable, root=str(self.root)))
        scp.chmod(0o755)

    def home(self, machine: str) -> Path:
        path = self.root / machine
        path.mkdir(parents=True, exist_ok=True)
        return path

    def sheet_script(self) -> str:
        lines = []
        for raw in self.sheet.body.splitlines():
            match = _EXPORT.match(raw)
            if match is None:
                continue
            name = match["name"]
            value = self.known.get(name, self.values.get(name))
            if value is not None:
                lines.append(f"export {name}={shlex.quote(value)}")
            elif not is_placeholder(match["value"].split(" #", 1)[0].strip()):
                lines.append(raw)
        return "\n".join(lines)

    def env(self, machine: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_NODE_")}
        tools = str(self.tools or Path(sys.executable).parent)
        env.update(HOME=str(self.home(machine)), PATH=f"{self.bin}:{tools}:{env.get('PATH', '')}")
        env.pop("VIRTUAL_ENV", None)
        return env

    def run(self, block: Block, machine: str | None = None, *, check: bool = True) -> Ran:
        """Run `block` once on `machine` (default its own); AssertionError, with its output, when it fails
        (unless `check` is false: a check that is re-run may fail while what it checks is starting)."""
        machine = machine or block.on
        assert machine is not None
        script = f"{self.sheet_script()}\ncd ~\n{block.body}"
        started = time.monotonic()
        process = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=self.home(machine),
            env=self.env(machine),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its pid is the session of whatever it leaves running
        )
        self.sessions.append(process.pid)
        try:
            out, err = process.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            raise AssertionError(
                f"docs/deploy.md:{block.line} on {machine}: still running after {self.timeout_s:.0f} s\n"
                f"{out[-2000:]}\n{err[-3000:]}"
            ) from None
        ran = Ran(block, machine, out, err, process.returncode, time.monotonic() - started)
        self.ran.append(ran)
        if check and process.returncode != 0:
            raise AssertionError(
                f"docs/deploy.md:{block.line} on {machine} exited {process.returncode}:\n{block.body}\n"
                f"--- stdout\n{out[-2000:]}\n--- stderr\n{err[-3000:]}\n{self.logs(machine)}"
            )
        if block.prints:
            lines = [line for line in out.splitlines() if line.strip()]
            assert lines, f"docs/deploy.md:{block.line} printed nothing for {block.prints}:\n{err[-3000:]}"
            self.known[block.prints] = lines[-1].strip()
        return ran

    def run_until(self, block: Block, deadline_s: float, interval_s: float = 3.0) -> Ran:
        """Re-run a check block until its output matches its `until` pattern, for at most `deadline_s`."""
        assert block.until is not None
        end = time.monotonic() + deadline_s
        while True:
            ran = self.run(block, check=False)
            if ran.returncode == 0 and block.until.search(ran.stdout):
                return ran
            if time.monotonic() > end:
                raise AssertionError(
                    f"docs/deploy.md:{block.line} on {block.on}: no match for {block.until.pattern!r} in "
                    f"{deadline_s:.0f} s; last output:\n{ran.stdout}\n{ran.stderr[-2000:]}\n"
                    + "\n".join(self.logs(m) for m in self.machines())
                )
            time.sleep(interval_s)

    def timeline(self) -> str:
        """One line per block run: where, how long, its first line (for a failure message or -s)."""
        return "\n".join(
            f"{r.seconds:6.1f} s  {r.machine:<11} docs/deploy.md:{r.block.line}  {r.block.body.splitlines()[0]}"
            for r in self.ran
        )

    def machines(self) -> list[str]:
        return sorted({b.on for b in self.all if b.on})

    def logs(self, machine: str, lines: int = 25) -> str:
        """The tail of every log file the guide wrote in `machine`'s home (for failure messages)."""
        parts = []
        for path in sorted(self.home(machine).glob("*.log")) + sorted(self.home(machine).glob("*.ready")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {machine}:~/{path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def alive(self) -> list[int]:
        """PIDs of live processes in the sessions of the blocks run so far (what the guide left running)."""
        wanted = set(self.sessions)
        found = []
        for process in psutil.process_iter():
            try:
                # A zombie has nothing left to stop.
                if os.getsid(process.pid) in wanted and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process.pid)
            except (OSError, psutil.Error):
                continue  # ended while we looked
        return found

    def wait_all_gone(self, timeout_s: float) -> list[int]:
        """Wait until nothing the guide started is alive; returns what still is after `timeout_s`."""
        end = time.monotonic() + timeout_s
        while (left := self.alive()) and time.monotonic() < end:
            time.sleep(0.5)
        return left

    def kill_all(self) -> None:
        """SIGKILL whatever the guide's blocks left running (a failed test must not leave a swarm behind)."""
        for pid in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
