"""A contributor's client of the validators' HTTP API: signed verdicts and the node's leaderboard row.

Where to ask comes from the validators' operator-signed DHT announcements (`api_url`); nothing the API
answers is trusted on its say-so: a verdict counts only when it is signed by the validator that signed the
file's receipt and names this node and this file (p2p/verdicts.py `open_signed`, which checks the size,
the signer and the signature before it parses anything). The leaderboard row is unsigned and only shown.
Every read is bounded in time and bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import aiohttp
from pydantic import ConfigDict, ValidationError

from ...p2p.swarm import Swarm, SwarmError, ValidatorAnnouncement
from ...p2p.verdicts import MAX_ENVELOPE_BYTES, DocumentError, Signed, Verdict, open_signed
from ...p2p.wire import WireModel, describe
from ..errors import NodeError
from .urls import routable_url

logger = logging.getLogger(__name__)

MAX_NODE_BYTES = 256 * 1024  # /api/node/{id}: one row, 20 recent verdicts, slash and ban logs


class ValidatorApiError(NodeError):
    """A validator's HTTP API could not be reached or answered something unusable."""


class VerdictNotReady(ValidatorApiError):
    """The validator has no verdict for the file yet (404): ask again later."""


class NodeRow(WireModel):
    """The fields of the validator's leaderboard row (trainer/ledger/leaderboard.py LeaderboardRow) a node shows."""

    # The row has more fields than a node shows; a newer validator may add some. Everything else of a
    # WireModel holds: strict types, finite numbers.
    model_config = ConfigDict(extra="ignore")

    rank: int
    score: float
    accepted_tokens: int
    accepted_files: int
    rejected_files: int
    banned: bool


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
    """One HTTP session for every validator; `endpoints()` re-reads the announcements (cached by the swarm)."""

    def __init__(self, swarm: Swarm, node_id: str, timeout_s: float) -> None:
        self.swarm = swarm
        self.node_id = node_id
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

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

    async def _get(self, url: str, limit: int) -> tuple[int, bytes]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        try:
            async with self._session.get(url, allow_redirects=False) as resp:
                if (resp.content_length or 0) > limit:
                    raise ValidatorApiError(
                        f"{url} announces {resp.content_length} bytes; at most {limit} accepted"
                    )
                body = bytearray()
                async for chunk in resp.content.iter_chunked(64 * 1024):
                    body += chunk
                    if len(body) > limit:
                        raise ValidatorApiError(f"{url} sent more than {limit} bytes; refused")
                return resp.status, bytes(body)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise ValidatorApiError(f"{url}: {type(exc).__name__}: {exc}") from exc

    async def verdict(self, endpoint: ValidatorEndpoint, sha256: str) -> Signed[Verdict]:
        """The signed verdict on this node's file `sha256`, checked; VerdictNotReady while undecided.

        Asked for by (file hash, this node): another node that delivered the same bytes (re-signed) has its
        own verdict, which says nothing about this node's delivery.
        """
        url = f"{endpoint.url}/api/verdict/{sha256}/{self.node_id}"
        status, body = await self._get(url, MAX_ENVELOPE_BYTES)
        if status == 404:
            raise VerdictNotReady(f"validator {endpoint.node_id[:16]}… has no verdict for {sha256[:16]}… yet")
        if status != 200:
            raise ValidatorApiError(f"{url} answered HTTP {status}")
        try:
            signed = open_signed(body, Verdict, {endpoint.node_id})
        except DocumentError as exc:
            raise ValidatorApiError(f"the verdict from {url} is not valid: {exc}") from None
        doc = signed.document
        if doc.file_hash != sha256 or doc.node_id != self.node_id:
            raise ValidatorApiError(f"the verdict from {url} is about another file or node; ignored")
        return signed

    async def node_row(self, endpoint: ValidatorEndpoint) -> NodeRow | None:
        """This node's leaderboard row at `endpoint`; None when the validator does not know the node yet."""
        url = f"{endpoint.url}/api/node/{self.node_id}"
        status, body = await self._get(url, MAX_NODE_BYTES)
        if status == 404:
            return None
        if status != 200:
            raise ValidatorApiError(f"{url} answered HTTP {status}")
        try:
            return parse_node_detail(body)
        except ValidationError as exc:
            raise ValidatorApiError(f"{url} sent a malformed node entry {describe(exc)}") from None


class NodeDetail(WireModel):
    """The part of the validator's /api/node/{id} answer (trainer/ledger/leaderboard.py NodeDetail) a node reads."""

    model_config = ConfigDict(extra="ignore")

    node: NodeRow


def parse_node_detail(body: bytes) -> NodeRow:
    """The node's row from a /api/node/{id} body; ValidationError naming the field when malformed."""
    return NodeDetail.model_validate_json(body).node
