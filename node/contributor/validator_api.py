"""Where a contributor finds the validators' HTTP APIs, and what it asks them: its verdicts and its row.

Where to ask comes from the validators' operator-signed DHT announcements (`api_url`); how to ask is the
API's one client (p2p/validator_api.py: a wall-clock deadline and a byte limit on every request, answers
parsed into wire types). Nothing the API answers is trusted on its say-so: a verdict counts only when it is
signed by the validator that signed the file's receipt and names this node and this file (the client's
`verdict`, through p2p/verdicts.py `open_signed`). The leaderboard row is unsigned and only shown.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...p2p.swarm import Swarm, SwarmError, ValidatorAnnouncement
from ...p2p.urls import routable_url
from ...p2p.validator_api import ApiRefused, LeaderboardRow, ValidatorApiClient, ValidatorApiError
from ...p2p.verdicts import Signed, Verdict


def api_base(announcement: ValidatorAnnouncement) -> str | None:
    """The validator's API base URL, or None when it announces none (or only an undialable one).

    A validator bound to every interface announces e.g. http://0.0.0.0:8471; such a host is replaced by
    the first IP address of its libp2p addresses (the same signed announcement), which is where it runs.
    """
    if announcement.api_url is None:
        return None
    return routable_url(announcement.api_url, list(announcement.addresses))


@dataclass(frozen=True)
class ValidatorEndpoint:
    node_id: str  # the validator's key: the signer of its receipts and verdicts
    url: str


class ValidatorApi:
    """This node's questions to every validator over one client; `endpoints()` re-reads the announcements
    (cached by the swarm)."""

    def __init__(self, swarm: Swarm, node_id: str, timeout_s: float) -> None:
        self.swarm = swarm
        self.node_id = node_id
        self.client = ValidatorApiClient(timeout_s)

    async def close(self) -> None:
        await self.client.close()

    async def endpoints(self) -> dict[str, ValidatorEndpoint]:
        """Announced validators with an API, by node id; ValidatorApiError when the DHT cannot be read."""
        try:
            announced = await self.swarm.list_validators()
        except (SwarmError, OSError, EOFError) as exc:
            raise ValidatorApiError(f"cannot read the validator announcements: {exc}") from exc
        found = {}
        for node_id, announcement in announced.items():
            url = api_base(announcement)
            if url is not None:
                found[node_id] = ValidatorEndpoint(node_id, url)
        return found

    async def verdict(self, endpoint: ValidatorEndpoint, sha256: str) -> Signed[Verdict]:
        """The checked verdict on this node's file `sha256`; VerdictNotReady while undecided.

        Asked for by (file hash, this node): another node that delivered the same bytes (re-signed) has its
        own verdict, which says nothing about this node's delivery.
        """
        return await self.client.verdict(endpoint.url, sha256, self.node_id, endpoint.node_id)

    async def node_row(self, endpoint: ValidatorEndpoint) -> LeaderboardRow | None:
        """This node's leaderboard row at `endpoint`; None when the validator does not know the node yet."""
        try:
            return (await self.client.node(endpoint.url, self.node_id)).node
        except ApiRefused as exc:
            if exc.status == 404:
                return None
            raise
