"""What the devnet shows while it runs, read the way an operator would read it.

- the trainer's per-step JSONL metrics (`<trainer>/trainer/metrics.jsonl`): step, task reward, timings;
- the validator's API (`/api/leaderboard`, through p2p/validator_api.py's client): verdicts, slashes and
  bans per node;
- each contributor's status API (its port is in `<data-dir>/status.json`): state, steps, file counts;
- each contributor's checkpoint store: when each version became verified and usable there (the end of
  its broadcast), remembered here because old versions are pruned as the run moves on;
- the validator's spool: files received but not yet judged (its queue depth).
Every read is bounded by a short timeout and tolerates a process that is starting or stopping.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...p2p.validator_api import MAX_TOP, LeaderboardRow, ValidatorApiClient, ValidatorApiError, call_sync
from ...p2p.weights.store import Store
from .dropout_record import read_drop_out
from .layout import DevnetLayout, Member

logger = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 2.0


@dataclass
class MemberView:
    name: str
    node_id: str
    attack: str | None
    state: str = "starting"
    local_step: int | None = None
    generated: int = 0
    handed_off: int = 0
    accepted: int = 0  # from the validator's ledger
    rejected: int = 0
    banned: bool = False
    last_error: str | None = None
    stage: str | None = None  # a pipeline node's: "stage K of <group>" or "no group"; None for the others


@dataclass
class Snapshot:
    at: float
    step: int  # newest policy step the trainer published
    task_reward: float | None  # of the last rollout step's batch
    rollout_reward: float | None  # of every sample the trainer read for that step (filtered groups too)
    members: list[MemberView]
    queue_depth: int
    accepted_files: int
    rejected_files: int
    dashboard_url: str = ""  # the validator's web dashboard, once it is up


@dataclass
class Monitor:
    layout: DevnetLayout
    dashboard_url: str = ""
    started_at: float = field(default_factory=time.time)
    steps: list[dict[str, Any]] = field(default_factory=list)  # the trainer's JSONL records, in order
    arrivals: dict[str, dict[int, float]] = field(default_factory=dict)  # member -> step -> verified at
    leaderboard: list[LeaderboardRow] = field(default_factory=list)  # the last one read
    _metrics_offset: int = 0

    def poll(self) -> Snapshot:
        self._read_metrics()
        self._read_leaderboard()
        rows = {r.node_id: r for r in self.leaderboard}
        members = [self._member(m, rows.get(m.node_id)) for m in self.layout.members]
        last = self.steps[-1] if self.steps else None
        return Snapshot(
            at=time.time(),
            step=int(last["step"]) if last else 0,
            task_reward=float(last["task_reward"]) if last and "task_reward" in last else None,
            rollout_reward=float(last["rollout_reward"]) if last and "rollout_reward" in last else None,
            members=members,
            queue_depth=self.queue_depth(),
            accepted_files=sum(r.accepted_files for r in self.leaderboard),
            rejected_files=sum(r.rejected_files for r in self.leaderboard),
            dashboard_url=self.dashboard_url,
        )

    def queue_depth(self) -> int:
        """Received files waiting for a verdict (a spooled file is removed once judged and delivered)."""
        try:
            return sum(1 for _ in self.layout.spool_dir.glob("*.parquet"))
        except OSError:
            return 0

    def _read_metrics(self) -> None:
        path = self.layout.metrics_path
        try:
            with open(path, "rb") as f:
                f.seek(self._metrics_offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written is read next time
        self._metrics_offset += len(complete)
        for line in complete.splitlines():
            if line.strip():
                self.steps.append(json.loads(line))

    def _read_leaderboard(self) -> None:
        if not self.dashboard_url:
            return
        base = self.dashboard_url

        async def read(client: ValidatorApiClient) -> list[LeaderboardRow]:
            return (await client.leaderboard(base, MAX_TOP)).nodes

        try:
            self.leaderboard = call_sync(HTTP_TIMEOUT_S, read)
        except ValidatorApiError as exc:  # starting or stopping: the last rows stand
            logger.debug("leaderboard not read: %s", exc)

    def _member(self, member: Member, row: LeaderboardRow | None) -> MemberView:
        view = MemberView(member.name, member.node_id, member.attack)
        self._note_arrivals(member)
        status = member_status(member.data_dir)
        if status is not None:
            view.state = str(status.get("state", "?"))
            view.local_step = status.get("local_step")
            counts = status.get("rollouts") or {}
            view.generated, view.handed_off = (
                int(counts.get("generated", 0)),
                int(counts.get("handed_off", 0)),
            )
            view.last_error = status.get("last_error")
            stage = status.get("pipeline")
            if isinstance(stage, dict):
                group, k = stage.get("group_id"), stage.get("stage")
                view.stage = f"stage {k} of {str(group)[:8]}" if group else "no group"
        elif member.pipeline and (dropped := read_drop_out(member.data_dir)) is not None:
            view.state = (
                f"dropped out: killed itself mid-batch {dropped.batch} of group {dropped.group_id[:8]}"
            )
        if row is not None:
            view.accepted, view.rejected, view.banned = row.accepted_files, row.rejected_files, row.banned
        return view

    def _note_arrivals(self, member: Member) -> None:
        seen = self.arrivals.setdefault(member.name, {})
        store = Store(member.data_dir / "checkpoints")
        try:
            versions = store.versions()
        except OSError:
            return
        for step in versions:
            if step not in seen:
                seen[step] = _newest_mtime(store.checkpoint_dir(step))


def _newest_mtime(directory: Path) -> float:
    """When the last byte of a fetched checkpoint was written: the end of its download."""
    try:
        return max((p.stat().st_mtime for p in directory.rglob("*") if p.is_file()), default=time.time())
    except OSError:
        return time.time()


def get_json(url: str) -> Any:
    """A contributor's status document (its own status API on 127.0.0.1; the devnet started the process)."""
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as resp:
            return json.loads(resp.read())
    except (OSError, urllib.error.URLError, ValueError) as exc:
        logger.debug("GET %s failed: %s", url, exc)
        return None


def member_status(data_dir: Path) -> dict[str, Any] | None:
    """A running contributor's /status (None while it starts or after it stopped)."""
    try:
        port = int(json.loads((data_dir / "status.json").read_text())["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return get_json(f"http://127.0.0.1:{port}/status")
