"""Start and stop a validator: the swarm, the service's supervised tasks, and the dashboard.

Named tasks under one Supervisor (node/runtime/supervisor.py): verification worker, hold expiry, policy
follower (fetches checkpoints), validator announcement, ban re-publication, peer bookkeeping, and a watch
on the swarm's own heartbeat task. Cleanups run in reverse order: dashboard, swarm, ledger. The dashboard's
server also answers GET /metrics (trainer/validator/metrics.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from ...node.run.announcement import run_parameters
from ...node.run.settings import open_run_environment
from ...node.runtime.supervisor import Supervisor
from ...p2p.errors import P2PError
from ...p2p.identity import Identity
from ...p2p.swarm import Swarm
from ...p2p.urls import loopback_behind, routable_url
from ..errors import TrainerError
from .assignment import first_step
from .config import ValidatorSettings
from .dashboard import create_app, ledger_rewards, serve
from .metrics import CONTENT_TYPE_LATEST
from .run_confirmation import RunConfirmation
from .service import ValidatorService
from .swarm_view import SwarmViewSource

logger = logging.getLogger(__name__)

PEER_SCAN_S = 30.0


@dataclass(frozen=True)
class RunningValidator:
    service: ValidatorService
    swarm: Swarm
    dashboard_url: str
    maddrs: list[str]


def check_operator(settings: ValidatorSettings, identity: Identity) -> ValidatorSettings:
    """Pin this key as the operator when none is given; refuse a key the pinned operators do not include."""
    keys = settings.swarm.operator_keys
    if not keys:
        swarm = settings.swarm.model_copy(update={"operator_keys": [identity.node_id]})
        return settings.model_copy(update={"swarm": swarm})
    if identity.node_id not in keys:
        raise TrainerError(
            f"the validator's key {identity.node_id[:16]}… is not a pinned operator key; the validator "
            "announcement and bans must be signed by one. Start it with the operator's key (--key), or add "
            "this key to --operator-key / swarm.operator_keys"
        )
    return settings


async def start_validator(
    settings: ValidatorSettings, identity: Identity, supervisor: Supervisor
) -> RunningValidator:
    settings = check_operator(settings, identity)
    # The run's environment, opened once (a file is read and hashed; an unreadable one stops the validator before
    # it joins): its identity is what policies must announce, and the checks draw from this same object.
    environment = await asyncio.to_thread(open_run_environment, settings.run)
    ours = run_parameters(settings.run, environment)
    swarm = Swarm(settings.swarm, identity, roles=("validator",))
    # No heartbeat yet: whether the previous run's is still live decides which batches it takes (first_step).
    await swarm.join(heartbeat=False)
    service = ValidatorService(settings, identity, swarm, environment)
    supervisor.on_shutdown("ledger", service.ledger.close)
    supervisor.on_shutdown("swarm", swarm.leave)
    # A validator pinned to other run parameters than the trainer's would reject (and slash) every honest file:
    # it verifies nothing before a policy confirms its own, and stops at one that announces others.
    confirmation = await asyncio.to_thread(RunConfirmation, settings.resolved_data_dir(), ours)
    try:
        current = await swarm.current_policy()
    except (OSError, EOFError, P2PError) as exc:
        logger.warning("policy lookup failed: %s; the policy watch will look again", exc)
        current = None
    if current is not None:
        await confirmation.admit(current)  # a mismatch stops it here, before it accepts any file
    await service.recover()
    service.receiver = await swarm.serve_rollouts(service.spool.directory, service.accept, service.admit)
    app = create_app(
        service.ledger.ledger,
        swarm=SwarmViewSource(service, settings.dashboard),
        rewards=ledger_rewards(service.ledger.ledger),
    )
    app.router.add_get("/metrics", metrics_handler(service))  # Prometheus, beside the API (docs/metrics.md)
    runner, url = await serve(app, settings.dashboard.host, settings.dashboard.port)
    supervisor.on_shutdown("dashboard", runner.cleanup)
    # Announced, so that senders can fetch their verdicts and rank (node/contributor/verdicts.py). A dashboard
    # bound to every interface is announced at the first --announce-maddrs IP; without one, senders take the
    # first address of the announcement (p2p/urls.py).
    swarm.api_url = routable_url(url, settings.swarm.announce_maddrs) or url
    far = loopback_behind(url, settings.swarm.announce_maddrs)
    if far is not None:
        logger.warning(
            "the validator's API listens on %s only, but the validator announces %s: contributors on other "
            "machines cannot read their verdicts or rank; bind it with --http-host 0.0.0.0 (docs/deploy.md)",
            url,
            far,
        )
    # The first step whose batches it judges (trainer/validator/assignment.py), kept across restarts: a validator
    # joining a running swarm, or coming back after its batches moved, takes nothing another may already have
    # judged. Chosen before its first heartbeat, which would hide an absence, and announced before that
    # heartbeat makes it live in peers' views, so that no peer routes by the previous announcement.
    swarm.from_step = await first_step(swarm, settings.resolved_data_dir(), settings.swarm.run_id)
    await swarm.publish_validator()
    await swarm.start_heartbeats()
    supervisor.spawn("validator-verify", service.run_worker(confirmation.confirmed))
    supervisor.spawn("validator-holds", service.run_holds())
    supervisor.spawn("validator-groups", service.run_groups(confirmation.confirmed))
    supervisor.spawn("validator-group-arrivals", service.run_arrivals(confirmation.confirmed))
    supervisor.spawn("validator-group-records", service.run_group_records())
    supervisor.spawn("validator-policy", service.keeper.follow(confirmation.policies(swarm.watch_policy())))
    supervisor.spawn("validator-checkpoint-fetch", service.keeper.fetch_newest())
    supervisor.spawn("validator-announce", announce_forever(service))
    supervisor.spawn("validator-bans", service.bans.run())
    supervisor.spawn("validator-peers", note_peers(service))
    supervisor.supervise(*swarm.tasks.values())  # its heartbeat: a crash there stops the validator
    logger.info(
        "validator %s ready (judges its batches from policy step %d on); dashboard at %s",
        identity.node_id[:16],
        swarm.from_step,
        url,
    )
    return RunningValidator(service, swarm, url, await swarm.maddrs())


def metrics_handler(service: ValidatorService) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=service.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handler


async def announce_forever(service: ValidatorService) -> None:
    while True:
        await asyncio.sleep(service.settings.validator.announce_interval_s)
        try:
            await service.swarm.publish_validator()
        except (P2PError, OSError, EOFError) as exc:
            logger.warning("validator announcement not re-published: %s", exc)


async def note_peers(service: ValidatorService) -> None:
    """Record each live contributor's hardware and last-seen time for the leaderboard (the operator's own
    trainer and validators heartbeat too, but they are not contributors and have nothing to rank)."""
    while True:
        try:
            peers = await service.swarm.list_peers()
        except (P2PError, OSError, EOFError) as exc:
            logger.debug("peer scan failed: %s", exc)
            peers = {}
        now = time.time()
        for hb in peers.values():
            if "contributor" not in hb.roles:
                continue
            await service.ledger.touch_node(
                hb.node_id, seen_at=min(hb.sent_at, now), hardware=hb.hardware.model_dump()
            )
        await asyncio.sleep(PEER_SCAN_S)
