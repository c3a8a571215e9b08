"""The validator's read-only HTTP API and web dashboard (aiohttp), bound to 127.0.0.1 unless told otherwise.

The API's paths, answer types and limits are p2p/validator_api.py's (its docstring lists the routes); this is
their server. A verdict belongs to (file hash, sender): a sender fetches its own to learn, verifiably, why
its file was refused; another node's delivery of the same bytes has its own. `/api/swarm` and
`/api/rewards` are fed by sources the validator service passes in (the swarm: trainer/validator/swarm_view.py;
the curve: `ledger_rewards`, the mean recomputed task reward per policy step of the accepted files, persisted
in the ledger); without one they answer `available: false` and the page shows a placeholder. Errors are
`{"error": text}` with their status.
- `/`: the dashboard page (plain HTML + JS from trainer/validator/dashboard_static/, no external resources; the
  Content-Security-Policy forbids any).

Ledger reads run in worker threads (`asyncio.to_thread`), never on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from ...node.runtime.metrics import PORTS
from ...p2p.validator_api import (
    DEFAULT_TOP,
    HISTORY_PATH,
    LEADERBOARD_PATH,
    MAX_TOP,
    NODE_PATH,
    REWARDS_PATH,
    SWARM_PATH,
    VERDICT_BY_HASH_PATH,
    VERDICT_PATH,
    ErrorAnswer,
    Leaderboard,
    RewardCurve,
    RewardPoint,
    SwarmView,
)
from ...p2p.wire import WireFormatError, is_hex64, parse_uint
from ..ledger import Ledger
from ..ledger.activity import node_history
from ..ledger.leaderboard import NodeLookupError, leaderboard, node_detail, ranked_count

STATIC_DIR = Path(__file__).with_name("dashboard_static")
DEFAULT_PORT = PORTS["validator"]  # the fixed ports of every role: node/runtime/metrics.py
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class DashboardSettings(BaseModel):
    """Where the leaderboard API and dashboard listen (section `dashboard` of the validator)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Listen address of the leaderboard API and dashboard; 0.0.0.0 exposes it to the network.",
    )
    port: int = Field(
        DEFAULT_PORT,
        ge=0,
        le=65535,
        description="TCP port of the leaderboard API and dashboard; 0 picks one.",
    )
    window_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="Window of the swarm view: a node with accepted work decided within it is active; "
        "throughput and the verdict rate are averaged over it.",
    )
    stale_after_s: float | None = Field(
        None,
        gt=0,
        le=86400,
        description="A node unheard for this long is stale (shown red); default: the swarm's heartbeat_ttl_s.",
    )
    trainer_stall_s: float = Field(
        900.0,
        gt=0,
        le=7 * 86400,
        description="The trainer is stalled when no new policy step was announced for this long.",
    )
    trainer_stopped_s: float = Field(
        360.0,
        gt=0,
        le=7 * 86400,
        description="The trainer is stopped when neither a policy re-announcement nor a trainer heartbeat came "
        "for this long (3x the trainer's default announce_interval_s of 120 s).",
    )


SwarmSource = Callable[[], Awaitable[SwarmView]]
RewardSource = Callable[[], Awaitable[RewardCurve]]
REWARD_STEPS = 1000  # newest policy steps on the curve


def ledger_rewards(ledger: Ledger, last_steps: int = REWARD_STEPS) -> RewardSource:
    """The reward curve from the ledger: the validator recomputed every accepted file's rewards."""

    async def source() -> RewardCurve:
        points = await asyncio.to_thread(ledger.reward_curve, last_steps)
        return RewardCurve.outgoing(
            available=True,
            points=[
                RewardPoint.outgoing(step=p.step, reward=p.reward, samples=p.samples, files=p.files)
                for p in points
            ],
        )

    return source


LEDGER_KEY: web.AppKey[Ledger] = web.AppKey("ledger")
SWARM_KEY: web.AppKey[SwarmSource | None] = web.AppKey("swarm_source")
REWARDS_KEY: web.AppKey[RewardSource | None] = web.AppKey("reward_source")


def create_app(
    ledger: Ledger, *, swarm: SwarmSource | None = None, rewards: RewardSource | None = None
) -> web.Application:
    """The dashboard application over `ledger`; the validator service supplies the two live sources."""
    app = web.Application(middlewares=[_headers_middleware])
    app[LEDGER_KEY] = ledger
    app[SWARM_KEY] = swarm
    app[REWARDS_KEY] = rewards
    app.router.add_get(LEADERBOARD_PATH, _leaderboard)
    app.router.add_get(NODE_PATH, _node)
    app.router.add_get(HISTORY_PATH, _history)
    app.router.add_get(VERDICT_BY_HASH_PATH, _verdict_by_hash)
    app.router.add_get(VERDICT_PATH, _verdict)
    app.router.add_get(SWARM_PATH, _swarm)
    app.router.add_get(REWARDS_PATH, _rewards)
    app.router.add_get("/", _index)
    app.router.add_static("/static/", STATIC_DIR, show_index=False, follow_symlinks=False)
    return app


async def serve(
    app: web.Application, host: str = "127.0.0.1", port: int = DEFAULT_PORT
) -> tuple[web.AppRunner, str]:
    """Start `app`; returns the runner (call `await runner.cleanup()` to stop) and its base URL."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, f"http://{bound_host}:{bound_port}"


@web.middleware
async def _headers_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        response = await handler(request)
    except NodeLookupError as exc:
        answer = ErrorAnswer.outgoing(error=str(exc))
        response = web.json_response(answer.model_dump(mode="json"), status=exc.status)
    response.headers.update(SECURITY_HEADERS)
    return response


async def _leaderboard(request: web.Request) -> web.Response:
    raw = request.query.get("top", str(DEFAULT_TOP))
    try:
        top = parse_uint(raw, "top", maximum=MAX_TOP, minimum=1)
    except WireFormatError:
        raise NodeLookupError(f"top must be an integer from 1 to {MAX_TOP}, got {raw[:20]!r}", 400) from None
    ledger = request.app[LEDGER_KEY]
    rows = await asyncio.to_thread(leaderboard, ledger, top=top)
    ranked = await asyncio.to_thread(ranked_count, ledger)
    board = Leaderboard.outgoing(generated_at=time.time(), ranked=ranked, nodes=rows)
    return web.json_response(board.model_dump(mode="json"))


async def _node(request: web.Request) -> web.Response:
    detail = await asyncio.to_thread(node_detail, request.app[LEDGER_KEY], request.match_info["node_id"])
    return web.json_response(detail.model_dump(mode="json"))


async def _history(request: web.Request) -> web.Response:
    history = await asyncio.to_thread(node_history, request.app[LEDGER_KEY], request.match_info["node_id"])
    return web.json_response(history.model_dump(mode="json"))


def _hex64(request: web.Request, name: str, what: str) -> str:
    value = request.match_info[name]
    if not is_hex64(value):
        raise NodeLookupError(f"a {what} is 64 lowercase hex digits", 400)
    return value


async def _verdict(request: web.Request) -> web.Response:
    file_hash = _hex64(request, "file_hash", "file hash (its SHA-256)")
    node_id = _hex64(request, "node_id", "node id (its Ed25519 public key)")
    signed = await asyncio.to_thread(request.app[LEDGER_KEY].verdict_for, file_hash, node_id)
    if signed is None:
        raise NodeLookupError(
            f"no verdict for file {file_hash[:16]}… from node {node_id[:16]}… (not received, or not "
            "decided yet)",
            404,
        )
    return web.json_response(signed.envelope())


async def _verdict_by_hash(request: web.Request) -> web.Response:
    file_hash = _hex64(request, "file_hash", "file hash (its SHA-256)")
    found = await asyncio.to_thread(request.app[LEDGER_KEY].verdicts_for, file_hash, 2)
    if not found:
        raise NodeLookupError(
            f"no verdict for file {file_hash[:16]}… (not received, or not decided yet)", 404
        )
    if len(found) > 1:
        raise NodeLookupError(
            f"several nodes delivered file {file_hash[:16]}…, each with its own verdict: ask "
            f"/api/verdict/{file_hash}/<node id>",
            409,
        )
    return web.json_response(found[0].envelope())


async def _swarm(request: web.Request) -> web.Response:
    source = request.app[SWARM_KEY]
    view = await source() if source is not None else SwarmView(available=False)
    return web.json_response(view.model_dump(mode="json"))


async def _rewards(request: web.Request) -> web.Response:
    source = request.app[REWARDS_KEY]
    curve = await source() if source is not None else RewardCurve(available=False)
    return web.json_response(curve.model_dump(mode="json"))


async def _index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html")
