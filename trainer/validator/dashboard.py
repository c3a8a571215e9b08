"""The validator's read-only HTTP API and web dashboard (aiohttp), bound to 127.0.0.1 unless told otherwise.

Routes (all GET):
- `/api/leaderboard?top=N`: `{"generated_at", "ranked", "nodes": [LeaderboardRow...]}`
- `/api/node/{id}`: NodeDetail for a node id or a unique prefix of at least 6 hex digits (400/404/409)
- `/api/verdict/{sha256}/{node_id}`: the signed verdict envelope on one sender's delivery of a rollout file
  (404 until it is decided); a sender fetches its own to learn, verifiably, why its file was refused. A
  verdict belongs to (file hash, sender): another node's delivery of the same bytes has its own.
- `/api/verdict/{sha256}` (kept for nodes of earlier versions): the verdict when exactly one sender delivered
  these bytes; 409 when several did (ask with the node id).
- `/api/swarm`, `/api/rewards`: the live swarm and the reward curve, fed by sources the validator service
  passes in (the curve: `ledger_rewards`, the mean recomputed task reward per policy step of the accepted
  files, persisted in the ledger); without one they answer `available: false` and the page shows a
  placeholder.
- `/`: the dashboard page (plain HTML + JS from trainer/validator/dashboard_static/, no external resources; the
  Content-Security-Policy forbids any).

Ledger reads run in worker threads (`asyncio.to_thread`), never on the event loop.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from ...p2p.wire import WireFormatError, parse_uint
from ..ledger import Ledger
from ..ledger.leaderboard import MAX_TOP, NodeLookupError, leaderboard, node_detail, ranked_count

STATIC_DIR = Path(__file__).with_name("dashboard_static")
DEFAULT_PORT = 8471  # 8470 is the weights server's; a trainer and a validator often share a host
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
        "127.0.0.1", min_length=1, description="Listen address; 0.0.0.0 exposes it to the network."
    )
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="TCP port; 0 picks a free one.")


class SwarmNode(BaseModel):
    node_id: str
    roles: list[str] = Field(default_factory=list, description="e.g. contributor, relay, validator")
    hardware: dict[str, str | int | float | bool | None] = Field(default_factory=dict)
    step: int | None = Field(None, description="Policy step the node works on.")
    last_seen: float | None = None


class SwarmView(BaseModel):
    available: bool = Field(description="False until the validator service supplies a swarm source.")
    policy_step: int | None = Field(None, description="Latest announced policy step.")
    nodes: list[SwarmNode] = Field(default_factory=list)


class RewardPoint(BaseModel):
    step: int
    reward: float = Field(description="Mean task reward of the accepted rollouts of this step.")
    samples: int = Field(0, description="Accepted samples (rows) the mean is over.")
    files: int = Field(0, description="Accepted files of this step.")


class RewardCurve(BaseModel):
    available: bool = Field(description="False when the dashboard has no reward source.")
    points: list[RewardPoint] = Field(default_factory=list, description="Oldest step first.")


SwarmSource = Callable[[], Awaitable[SwarmView]]
RewardSource = Callable[[], Awaitable[RewardCurve]]
REWARD_STEPS = 1000  # newest policy steps on the curve


def ledger_rewards(ledger: Ledger, last_steps: int = REWARD_STEPS) -> RewardSource:
    """The reward curve from the ledger: the validator recomputed every accepted file's rewards."""

    async def source() -> RewardCurve:
        points = await asyncio.to_thread(ledger.reward_curve, last_steps)
        return RewardCurve(
            available=True,
            points=[
                RewardPoint(step=p.step, reward=p.reward, samples=p.samples, files=p.files) for p in points
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
    app.router.add_get("/api/leaderboard", _leaderboard)
    app.router.add_get("/api/node/{node_id}", _node)
    app.router.add_get("/api/verdict/{file_hash}", _verdict_by_hash)
    app.router.add_get("/api/verdict/{file_hash}/{node_id}", _verdict)
    app.router.add_get("/api/swarm", _swarm)
    app.router.add_get("/api/rewards", _rewards)
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
        response = web.json_response({"error": str(exc)}, status=exc.status)
    response.headers.update(SECURITY_HEADERS)
    return response


async def _leaderboard(request: web.Request) -> web.Response:
    raw = request.query.get("top", "100")
    try:
        top = parse_uint(raw, "top", maximum=MAX_TOP, minimum=1)
    except WireFormatError:
        raise NodeLookupError(
            f"top must be an integer between 1 and {MAX_TOP}, got {raw[:20]!r}", 400
        ) from None
    ledger = request.app[LEDGER_KEY]
    rows = await asyncio.to_thread(leaderboard, ledger, top=top)
    ranked = await asyncio.to_thread(ranked_count, ledger)
    return web.json_response(
        {"generated_at": time.time(), "ranked": ranked, "nodes": [r.model_dump(mode="json") for r in rows]}
    )


async def _node(request: web.Request) -> web.Response:
    detail = await asyncio.to_thread(node_detail, request.app[LEDGER_KEY], request.match_info["node_id"])
    return web.json_response(detail.model_dump(mode="json"))


def _hex64(request: web.Request, name: str, what: str) -> str:
    value = request.match_info[name]
    if not re.fullmatch(r"[0-9a-f]{64}", value):
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
