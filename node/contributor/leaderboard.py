"""The node's own leaderboard row, cached for `prime-node status` by the supervised task `leaderboard`.

Every `refresh_s` it asks the announced validators' APIs (docs/validator.md, `/api/node/{id}`) in turn
until one answers; `prime-node status` then shows the rank and score, "not ranked yet" when the validator
does not know the node, or "validator unreachable" with the reason. The row is not signed: it is shown,
never acted upon.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ...p2p.validator_api import ValidatorApiError
from .state import NodeState
from .status import LeaderboardEntry
from .validator_api import ValidatorApi

logger = logging.getLogger(__name__)


async def refresh_leaderboard(api: ValidatorApi, state: NodeState) -> None:
    """One refresh: the first validator that answers wins; the status says why when none does."""
    try:
        endpoints = list((await api.endpoints()).values())
    except ValidatorApiError as exc:
        state.set_leaderboard(None, f"validator unreachable: {exc}")
        return
    if not endpoints:
        state.set_leaderboard(None, "validator unreachable: no validator announces an HTTP API")
        return
    problems = []
    for endpoint in endpoints:
        try:
            row = await api.node_row(endpoint)
        except ValidatorApiError as exc:
            problems.append(str(exc))
            continue
        if row is None:
            state.set_leaderboard(None, f"not ranked yet at {endpoint.url}")
        else:
            entry = LeaderboardEntry(
                rank=row.rank,
                score=row.score,
                accepted_tokens=row.accepted_tokens,
                accepted_files=row.accepted_files,
                rejected_files=row.rejected_files,
                banned=row.banned,
                validator_url=endpoint.url,
                fetched_at=time.time(),
            )
            state.set_leaderboard(entry, "ok")
        return
    state.set_leaderboard(None, "validator unreachable: " + "; ".join(problems)[:400])


async def run_leaderboard(api: ValidatorApi, state: NodeState, refresh_s: float) -> None:
    while True:
        await refresh_leaderboard(api, state)
        logger.debug("leaderboard: %s", state.leaderboard_status)
        await asyncio.sleep(refresh_s)
