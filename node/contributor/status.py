"""The local status API of a running node: GET /status (JSON) and GET /metrics (Prometheus).

It binds 127.0.0.1 unless the operator says otherwise, on an ephemeral port by default; the chosen port is
written to <data-dir>/status.json (with the pid) so that `prime-node status` finds the daemon without
configuration. The file is removed on a clean shutdown; a stale one (dead pid) reads as "not running".
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from ...p2p.processes import pid_alive
from ..errors import NodeError
from ..runtime.ports import Listener, port_in_use
from .metrics import CONTENT_TYPE_LATEST, NodeMetrics

STATUS_FILE = "status.json"
MAX_STATUS_BYTES = 1 << 20


class RolloutCounts(BaseModel):
    generated: int = 0  # files written and signed
    handed_off: int = 0  # files a validator acknowledged with a receipt
    accepted: int = 0  # files with an accepting verdict
    rejected: int = 0  # files with a rejecting verdict
    stale: int = 0  # files dropped unsent: their checkpoint fell out of the async window while they waited


class LeaderboardEntry(BaseModel):
    """This node's row of a validator's leaderboard (cached by the daemon, refreshed periodically)."""

    rank: int  # 1-based, over all nodes the validator knows
    score: float
    accepted_tokens: int = 0
    accepted_files: int = 0
    rejected_files: int = 0
    banned: bool = False
    validator_url: str = ""  # the API it came from
    fetched_at: float = 0.0  # unix time of the answer


class PipelineStatus(BaseModel):
    """A pipeline node's stage (`start --pipeline`)."""

    model_config = ConfigDict(extra="forbid")

    group_id: str | None = Field(None, description="The group this node runs a stage of, if any.")
    stage: int | None = None
    batches: int = Field(0, description="Batches its stage finished (each a stage file).")
    abandoned: int = Field(0, description="Batches its stage abandoned.")
    stage_files: int = 0
    fraud_reports: int = 0
    partial_records: int = 0
    withheld: int = Field(
        0, description="Broken batches no file was written about (outbox full, or a per-group/peer limit)."
    )


class NodeStatus(BaseModel):
    """What `prime-node status` shows; also the JSON body of GET /status."""

    model_config = ConfigDict(extra="forbid")

    node_id: str
    version: str
    uptime_s: float
    state: str = Field(description="What the node is doing now, in a few words.")
    peers_seen: int = 0
    operator_key: str | None = None
    announced_step: int | None = None
    local_step: int | None = None
    local_verified: bool = False
    rollouts: RolloutCounts = Field(default_factory=RolloutCounts)
    tokens_per_second: float | None = None
    last_error: str | None = None
    leaderboard: LeaderboardEntry | None = None
    leaderboard_status: str = Field(
        "not asked yet", description='"ok", "not ranked yet at URL" or "validator unreachable: why".'
    )
    awaiting_verdicts: int = Field(0, description="Handed-off files whose verdict is not known yet.")
    serving_weights: str | None = Field(
        None, description="URL of this node's weights server, when it serves."
    )
    pipeline: PipelineStatus | None = Field(None, description="The pipeline stage, on a --pipeline node.")


class DaemonNotRunning(NodeError):
    """No daemon answers for this data directory."""


class StatusServer:
    def __init__(
        self,
        data_dir: Path,
        status: Callable[[], NodeStatus],
        metrics: NodeMetrics,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.data_dir = Path(data_dir)
        self._status = status
        self._metrics = metrics
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/status", self._get_status)
        app.router.add_get("/metrics", self._get_metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        try:
            await site.start()
        except OSError as exc:  # taken since the command's probe (node/runtime/ports.py)
            await self._runner.cleanup()
            listener = Listener(self._host, self._port, "--status-port", "the status API and /metrics")
            raise port_in_use(listener, exc) from None
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        record = {"pid": os.getpid(), "host": self._host, "port": self.port, "started_at": time.time()}
        tmp = self.data_dir / f".{STATUS_FILE}.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.data_dir / STATUS_FILE)

    async def stop(self) -> None:
        (self.data_dir / STATUS_FILE).unlink(missing_ok=True)
        if self._runner is not None:
            await self._runner.cleanup()

    async def _get_status(self, request: web.Request) -> web.Response:
        return web.json_response(self._status().model_dump(mode="json"))

    async def _get_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def fetch_status(data_dir: Path, timeout: float = 5.0) -> NodeStatus:
    """Ask the daemon that owns `data_dir` for its status; DaemonNotRunning when none answers."""
    path = Path(data_dir) / STATUS_FILE
    try:
        record = json.loads(path.read_text()[:MAX_STATUS_BYTES])
        pid, host, port = int(record["pid"]), str(record["host"]), int(record["port"])
    except FileNotFoundError:
        raise DaemonNotRunning(
            f"no node is running for data directory {data_dir} (start one with `prime-node start`)"
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise DaemonNotRunning(f"{path} is unreadable ({exc}); is a node running?") from None
    if not pid_alive(pid):
        raise DaemonNotRunning(
            f"no node is running for data directory {data_dir} (the last one, pid {pid}, has exited)"
        )
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(f"http://{connect_host}:{port}/status") as resp:
                resp.raise_for_status()
                body = await resp.content.read(MAX_STATUS_BYTES)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise DaemonNotRunning(
            f"the node (pid {pid}) does not answer on {connect_host}:{port}: {exc}"
        ) from None
    return NodeStatus.model_validate_json(body)
