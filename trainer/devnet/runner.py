"""`prime-node devnet`: the whole swarm on one machine, started, watched, stopped and reported.

Order: the model (created with `prime-node model init`'s code if missing) -> its task set (trainer/devnet/
tasks.py, offline difficulty filtering, cached) -> the trainer (origin of the
weights and first DHT peer) -> the validator (bootstrapped from the trainer) -> the contributors and the
adversaries (bootstrapped from both). Each is a separate process with its own key and data directory,
in its own session, so Ctrl-C reaches only this process, which then stops them in reverse order
(SIGTERM, a grace period, SIGKILL of the process group); a SIGTERM or SIGHUP to this process stops them the
same way. Every process ever seen below a child (the DHT's forked child, p2pd) is remembered and checked to
be gone at the end.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ...node.environments.registry import DEFAULT_ENV
from ...p2p.processes import end_pids
from ..errors import TrainerError
from .attacks import ATTACKS
from .dropout import dropout_outcome, is_dropout
from .dropout_record import read_drop_out
from .layout import DevnetLayout, Sizing
from .monitor import Monitor, Snapshot
from .pipeline_attacks import PIPELINE_ATTACKS
from .processes import Child, ProcessGroup, descendants, start_time, still_running
from .report import build_report, ledger_rows
from .synthetic import SyntheticOptions, build_devnet_dataset
from .tasks import TaskFilter, filtered_tasks, task_file_for
from .view import LiveView

logger = logging.getLogger(__name__)

STOP_GRACE_S = 25.0  # the contributors' own shutdown bound is 15 s, the validator's 20 s
DESCENDANTS_EVERY_S = 3.0


class DevnetError(TrainerError):
    pass


class Terminated(BaseException):
    """SIGTERM or SIGHUP reached the devnet (a service manager, `kill`, a closed terminal): stop as on Ctrl-C.
    Without it the default action would end this process at once and leave every child, each in its own
    session, running with no one to stop it. A BaseException, like KeyboardInterrupt, so that no `except
    Exception` on the way swallows it."""


# Signals that stop the devnet gracefully. The first raises in the main thread (Ctrl-C as KeyboardInterrupt,
# the others as Terminated); from then on all of them are ignored until the report is written, so that a
# second one (a repeated Ctrl-C; a closed terminal sends SIGHUP twice) cannot cut the stop short.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _on_stop_signal(signum: int, _frame: object) -> None:
    _set_handlers(STOP_SIGNALS, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signal.Signals(signum).name)


def _set_handlers(
    signals: Sequence[signal.Signals], handler: Any, *, keep_ignored: bool = False
) -> dict[signal.Signals, Any]:
    """Set `handler` for `signals`, returning the previous ones. `keep_ignored`: leave a signal the operator
    chose to ignore (`nohup` ignores SIGHUP) ignored. Nothing outside the main thread, where Python cannot set
    handlers (an embedding program's thread keeps the program's)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {
        sig: signal.signal(sig, handler)
        for sig in signals
        if not (keep_ignored and signal.getsignal(sig) == signal.SIG_IGN)
    }


def _restore_handlers(previous: dict[signal.Signals, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def attack_kinds(count: int, kinds: Sequence[str] | None = None, *, pipeline: bool = False) -> list[str]:
    """`count` adversaries: the named kinds, or the attack list in order (cycling past its end); in a pipeline
    devnet the pipeline stages' attacks first."""
    known = [*ATTACKS, *PIPELINE_ATTACKS] if pipeline else list(ATTACKS)
    pool = list(kinds) if kinds else (list(PIPELINE_ATTACKS) if pipeline else list(ATTACKS))
    unknown = [k for k in pool if k not in known]
    if unknown:
        extra = "" if pipeline else " (the stage-* attacks need --pipeline)"
        raise DevnetError(f"unknown attack {unknown[0]!r}; choose from {', '.join(known)}{extra}")
    return [pool[i % len(pool)] for i in range(count)] if count else []


@dataclass
class DevnetOptions:
    root: Path  # this run's directory
    model_dir: Path
    nodes: int = 3
    attacks: list[str] = field(default_factory=list)
    steps: int = 10
    run_id: str = "devnet"
    sizing: Sizing = field(default_factory=Sizing)
    env: str = DEFAULT_ENV  # the run's environment (its spec)
    task_filter: TaskFilter | None = field(default_factory=TaskFilter)  # None: the whole environment
    start_timeout_s: float = 300.0  # each of trainer and validator to print its ready line
    stall_timeout_s: float = 900.0  # no new policy step for this long: something is wrong, stop
    ban_wait_s: float = 300.0  # after the last step, how long to wait for every adversary to be banned
    poll_s: float = 1.0
    progress: bool = False  # bars on stderr for the model's warm start and the task filter (a terminal only)
    synthetic: SyntheticOptions | None = None  # a synthetic run: stop on accepted files, end with a dataset
    # A pipeline devnet: this many honest `start --pipeline` nodes (0: none, a monolithic devnet). The run gets a
    # stage layout of two stages, the trainer forms groups; done needs an accepted stage file besides the steps.
    pipeline_nodes: int = 0


def _given(env: str) -> str | None:
    """The --env flag for `env`: none for the default, so a default devnet's commands are what they always were."""
    return None if env == DEFAULT_ENV else env


def ensure_model(model_dir: Path, view: LiveView, progress: bool = False) -> None:
    """Create the embedded default model (tiny Qwen2, warm-started) exactly as `prime-node model init` does."""
    if (model_dir / "config.json").is_file():
        return
    from ...node.models.warmstart import init_model_dir  # imports torch: only when needed

    view.message(f"creating the default model in {model_dir} (warm start: a few minutes on 2 cores)")
    report, _ = init_model_dir(model_dir, 0, progress=progress)
    view.message(f"model ready: {100 * report.heldout_accuracy:.1f}% held-out exact match")


def wait_ready(child: Child, key: str, timeout: float) -> dict[str, Any]:
    """The JSON ready line a service prints on stdout (in its log), e.g. {"trainer": ..., "maddrs": [...]}."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = child.log_path.read_text(errors="replace")
        except FileNotFoundError:
            text = ""
        for line in text.splitlines():
            if line.startswith("{") and f'"{key}"' in line:
                try:
                    ready = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ready, dict) and key in ready:
                    return ready
        if child.process.poll() is not None:
            raise DevnetError(
                f"the {child.name} exited ({child.process.returncode}) before it was ready:\n"
                + child.log_tail(30)
            )
        time.sleep(0.2)
    raise DevnetError(f"the {child.name} was not ready within {timeout:.0f} s:\n{child.log_tail(30)}")


class Devnet:
    def __init__(self, options: DevnetOptions, view: LiveView) -> None:
        self.options = options
        self.view = view
        o = options
        self.layout = DevnetLayout(
            o.root, o.run_id, o.model_dir, o.sizing, env_spec=_given(o.env), synthetic=o.synthetic is not None
        )
        for i in range(o.nodes):
            self.layout.add_member(f"node-{i + 1}")
        for i in range(o.pipeline_nodes):
            self.layout.add_member(f"stage-{i + 1}", pipeline=True)
        for j, kind in enumerate(o.attacks):
            self.layout.add_member(f"adv-{j + 1}-{kind}", kind)
        self.monitor = Monitor(self.layout)
        self.group = ProcessGroup(self.layout.logs)
        self.on_snapshot: Callable[[Snapshot], None] | None = None  # e.g. a benchmark sampling the run
        self.seen: dict[int, float] = {}  # pid -> start time of every process the devnet started

    def run(self) -> dict[str, Any]:
        """Run to `steps` (or Ctrl-C, or a failure), stop everything, and return the report."""
        o, began = self.options, time.time()
        ready_at = setup_s = 0.0
        stopped_by, error = f"{o.steps} steps done", None
        handlers = _set_handlers(STOP_SIGNALS, _on_stop_signal, keep_ignored=True)
        try:
            try:
                ensure_model(o.model_dir, self.view, o.progress)
                if o.task_filter is not None:
                    if not task_file_for(o.model_dir, o.task_filter).is_file():
                        self.view.message(
                            f"filtering tasks: sampling {o.task_filter.describe()} {o.task_filter.k} times "
                            "each with the model (once per model; a minute or two on 2 cores)"
                        )
                    kept, summary = filtered_tasks(o.model_dir, o.task_filter, progress=o.progress)
                    self.view.message(summary)
                    self.layout.env_spec = _given(o.env) if kept is None else f"filtered:{kept}"
                ready_at = self._start()
                setup_s = ready_at - began
                self._watch()
            except KeyboardInterrupt:
                stopped_by = "interrupted (Ctrl-C)"
            except Terminated as exc:
                stopped_by = f"terminated ({exc})"
            except DevnetError as exc:
                stopped_by, error = "failed", str(exc)
            finally:
                _set_handlers(STOP_SIGNALS, signal.SIG_IGN)  # the stop and the report run to their end
                self.view.close()  # the last frame stays; what follows is printed below it
                self.view.message(f"stopping ({stopped_by}): every process, in reverse order of start")
                stop = self._stop_all()
            ended_at = time.time()
            report = build_report(
                self.layout,
                self.monitor,
                ready_at=ready_at or ended_at,
                ended_at=ended_at,
                setup_s=setup_s,
                stop=stop,
                stopped_by=stopped_by,
            )
            report["error"] = error
            if o.synthetic is not None:
                report["dataset"] = None
                if error is None:
                    self.view.message(f"building the dataset in {self.layout.dataset_dir}")
                    try:
                        report["dataset"] = build_devnet_dataset(self.layout)
                    except TrainerError as exc:
                        report["error"] = f"dataset: {exc}"
            report["wall_s"] = round(time.time() - began, 1)
            (self.layout.root / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
            return report
        finally:
            _restore_handlers(handlers)

    def _start(self) -> float:
        o, layout, view = self.options, self.layout, self.view
        view.message(f"run directory {layout.root}; logs in {layout.logs}")
        if any(m.pipeline for m in layout.members):
            layout.boundaries = two_stages(o.model_dir)
            view.message(f"pipeline: stage layout {layout.boundaries}, groups formed by the trainer")
        # The trainer's group coordinator must outlive a drop-out: the survivors regroup after the kill, which may
        # come after the last step (once it had stopped at --max-steps, the drop-out was never grouped again). With
        # a drop-out the devnet stops the trainer itself, when it is done; it may have trained a step more.
        has_dropout = any(is_dropout(m) for m in layout.members)
        trainer = self.group.start(
            "trainer", layout.trainer_argv(None if has_dropout else o.steps), env=layout.trainer_env()
        )
        ready = wait_ready(trainer, "trainer", o.start_timeout_s)
        ready_at = time.time()
        view.message(f"trainer {ready['trainer'][:8]} serves step {ready['step']} at {ready['weights']}")
        validator = self.group.start(
            "validator", layout.validator_argv(ready["maddrs"][:1]), env=layout.validator_env()
        )
        vready = wait_ready(validator, "validator", o.start_timeout_s)
        self.monitor.dashboard_url = vready["dashboard"]
        view.message(f"validator {vready['validator'][:8]}: dashboard {vready['dashboard']}")
        peers = [*ready["maddrs"][:1], *vready["maddrs"][:1]]
        for member in layout.members:
            self.group.start(member.name, layout.member_argv(member, peers), env=layout.member_env())
        honest = sum(1 for m in layout.members if m.attack is None)
        view.message(f"started {honest} contributors and {len(layout.members) - honest} adversaries")
        return ready_at

    def _watch(self) -> None:
        o = self.options
        last_step, last_progress, last_scan = -1, time.monotonic(), 0.0
        done_at: float | None = None
        while True:
            snapshot = self.monitor.poll()
            self.view.update(snapshot)
            if self.on_snapshot is not None:
                self.on_snapshot(snapshot)
            # A synthetic run's policy never moves: its progress is the work the validator accepted.
            progress = snapshot.accepted_files if o.synthetic is not None else snapshot.step
            done = progress >= (o.synthetic.target_files if o.synthetic is not None else o.steps)
            if done:
                # Done, once every adversary has been caught (a slow one may not have sent a file yet), and
                # every drop-out has dropped out and its group-mate worked again.
                dropouts = {m.name for m in self.layout.members if is_dropout(m)}
                pending = [
                    f"{m.name} to be banned"
                    for m in snapshot.members
                    if m.attack is not None and not m.banned and m.name not in dropouts
                ]
                pending += self._dropouts_pending()
                if o.pipeline_nodes and not any(
                    m.accepted for m in snapshot.members if m.stage is not None and m.attack is None
                ):
                    pending.append("an accepted stage file of an honest pipeline node")
                if not pending:
                    return
                done_at = done_at or time.monotonic()
                if time.monotonic() - done_at > o.ban_wait_s:
                    raise DevnetError(
                        f"the run is done, but still waiting after {o.ban_wait_s:.0f} s more for: "
                        + ", ".join(pending)
                    )
            if progress != last_step:
                last_step, last_progress = progress, time.monotonic()
            elif time.monotonic() - last_progress > o.stall_timeout_s:
                what = "accepted file" if o.synthetic is not None else "policy step"
                raise DevnetError(
                    f"no new {what} for {o.stall_timeout_s:.0f} s (stuck at {last_step}); "
                    f"see the logs in {self.layout.logs}"
                )
            exited = {
                name: code
                for name, code in self.group.exited().items()
                if not (name == "trainer" and code == 0) and not self._dropped_out(name)
            }  # the trainer stops by itself after --max-steps; a drop-out kills itself
            if exited:
                name, code = next(iter(exited.items()))
                raise DevnetError(f"{name} exited on its own ({code}):\n{self.group.get(name).log_tail(30)}")
            if time.monotonic() - last_scan > DESCENDANTS_EVERY_S:
                self._scan()
                last_scan = time.monotonic()
            time.sleep(o.poll_s)

    def _dropped_out(self, name: str) -> bool:
        """`name` is a drop-out that wrote its record before it died: its exit is the attack, not a failure."""
        member = next((m for m in self.layout.members if m.name == name), None)
        return member is not None and is_dropout(member) and read_drop_out(member.data_dir) is not None

    def _dropouts_pending(self) -> list[str]:
        """What the run still waits for from its drop-outs: the drop-out itself, then a survivor's regroup."""
        dropouts = [m for m in self.layout.members if is_dropout(m)]
        if not dropouts:
            return []
        contributions, slashes, bans = ledger_rows(self.layout.ledger_path)
        pending = []
        for member in dropouts:
            outcome = dropout_outcome(self.layout, member, contributions, slashes, bans)
            if not outcome["dropped"]:
                pending.append(f"{member.name} to drop out mid-batch")
            elif outcome["regrouped"] is None:
                pending.append(
                    f"a survivor of {member.name}'s group ({', '.join(outcome['survivors']) or 'none'}) "
                    "to have a file of a new group accepted"
                )
            elif any(f["verdict"] is None for f in outcome["broken_batch_files"]):
                pending.append(f"the verdicts on the files of the batch {member.name} broke")
        return pending

    def _stop_all(self) -> dict[str, Any]:
        """Stop every child: the contributors together, then the validator, then the trainer (reverse order of
        start). Bounded; run() ignores the stop signals meanwhile."""
        self._scan()
        try:
            self.monitor.poll()  # the last verdicts and steps, while the validator still answers
        except Exception as exc:  # a strange answer must not keep the children from being stopped
            logger.warning("last look at the run before the stop failed: %r", exc)
        services = [c for c in self.group.children if c.name in ("trainer", "validator")]
        members = [c for c in self.group.children if c not in services]
        result = self.group.stop_together(members, grace=STOP_GRACE_S)
        for child in reversed(services):
            code, killed = self.group.stop(child, grace=STOP_GRACE_S)
            result.exit_codes[child.name] = code
            result.killed += [child.name] if killed else []
        leftovers = sorted(pid for pid, started in self.seen.items() if still_running(pid, started))
        if leftovers:
            described = ", ".join(f"{pid} ({_cmdline(pid)})" for pid in leftovers)
            # torch's shared-memory manager leaves its parent's session on purpose; anything else is a bug.
            expected = all("torch_shm_manager" in _cmdline(pid) for pid in leftovers)
            logger.log(
                logging.INFO if expected else logging.WARNING,
                "processes left after the stop: %s; ending them",
                described,
            )
            end_pids(leftovers, 3.0)
        return {
            "exit_codes": result.exit_codes,
            "killed": result.killed,
            "left_over": leftovers,
            "alive": sorted(pid for pid, started in self.seen.items() if still_running(pid, started)),
            "pids": sorted(self.seen),
        }

    def _scan(self) -> None:
        """Remember every process below our children (with its start time, so a reused PID is never hit)."""
        for child in self.group.children:
            if (started := start_time(child.pid)) is not None:
                self.seen.setdefault(child.pid, started)
        for pid, started in descendants(*(c.pid for c in self.group.children)).items():
            self.seen.setdefault(pid, started)


def two_stages(model_dir: Path) -> list[int]:
    """A two-stage layout of the model at `model_dir`: its decoder layers cut in half."""
    try:
        layers = int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DevnetError(f"{model_dir}/config.json names no num_hidden_layers: {exc}") from None
    if layers < 2:
        raise DevnetError(f"a pipeline devnet needs a model of at least 2 layers; {model_dir} has {layers}")
    return [0, layers // 2, layers]


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:120].strip()
    except psutil.Error:
        return "?"
