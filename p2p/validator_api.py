"""The validator's HTTP API, in one place: its paths, its answers as wire types, its limits, and its client.

The validator serves it (trainer/validator/dashboard.py, from these paths and models); a contributor reads
its own verdicts and leaderboard row (node/contributor/validator_api.py), `prime-node leaderboard` and the
devnet's monitor read the ranking, all through `ValidatorApiClient`. Routes (all GET):

- `/api/leaderboard?top=N` (N in 1..MAX_TOP, default DEFAULT_TOP): a `Leaderboard`
- `/api/node/{node_id}`: a `NodeDetail`, for a node id or a unique prefix of at least MIN_PREFIX hex digits
  (400 malformed, 404 unknown, 409 ambiguous)
- `/api/verdict/{file_hash}/{node_id}`: the signed verdict envelope (p2p/verdicts.py) on that node's delivery
  of the file; 404 until decided. `/api/verdict/{file_hash}` (nodes of earlier versions ask it): the same
  while exactly one node delivered those bytes, 409 when several did
- `/api/swarm`, `/api/rewards`: a `SwarmView` and a `RewardCurve`, for the dashboard page
- `/api/node/{node_id}/history`: a `NodeHistory` (accepted and rejected files per policy step), same ids
- an error is `{"error": text}` (`ErrorAnswer`) with its HTTP status

Whoever answers an announced `api_url` or a `--validator URL` may be hostile (plain HTTP, or simply the
wrong server). The client bounds each request by one wall-clock deadline (connection, headers and a body
dripped a byte at a time all count), reads at most the route's byte limit, refuses redirects and compressed
bodies, decodes with `loads_strict` and parses through the models here (WireModels: strict types, finite
numbers, printable text, timestamps within MAX_UNIX_TIME, so nothing it returns can overflow a date or put
a control character on a terminal). Every failure is one `ValidatorApiError` whose message is printable.
Answers ignore fields they do not know (a newer validator may add some); the server fills its free text
with `outgoing`, so it never serves what its readers refuse.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Annotated, Literal, TypeVar
from urllib.parse import quote

import aiohttp
from pydantic import ConfigDict, Field, ValidationError

from .errors import P2PError
from .verdicts import MAX_ENVELOPE_BYTES, MAX_REASON_CHARS, DocumentError, Signed, Verdict, open_signed
from .wire import (
    FreeText,
    NodeId,
    Sha256Hex,
    Timestamp,
    WireFormatError,
    WireModel,
    describe,
    loads_strict,
    printable,
)

LEADERBOARD_PATH = "/api/leaderboard"
NODE_PATH = "/api/node/{node_id}"
VERDICT_PATH = "/api/verdict/{file_hash}/{node_id}"
VERDICT_BY_HASH_PATH = "/api/verdict/{file_hash}"
SWARM_PATH = "/api/swarm"
REWARDS_PATH = "/api/rewards"
HISTORY_PATH = "/api/node/{node_id}/history"

MAX_TOP = 1000  # rows of one leaderboard answer
DEFAULT_TOP = 100  # when `top` is not given
MIN_PREFIX = 6  # hex digits of a node id prefix accepted by /api/node
RECENT_LIMIT = 20  # verdicts, slashes and bans of one node in a NodeDetail
HISTORY_STEPS = 500  # newest policy steps of one node's history
MAX_HARDWARE_TEXT = 256  # characters of one hardware value (trainer/ledger/records.py checks the same)
# Byte limits of the answers a client reads: MAX_TOP rows of at most ~5 KB (hardware is at most 4 KiB in the
# ledger); a node's row with RECENT_LIMIT verdicts, slashes and bans whose reasons may be escaped non-ASCII.
MAX_LEADERBOARD_BYTES = 16 << 20
MAX_NODE_BYTES = 2 << 20
MAX_MESSAGE_CHARS = 400  # of an error message built from what a server said

Count = Annotated[int, Field(ge=0, lt=1 << 63)]  # a SQLite integer that counts something
CheckName = Annotated[
    str, FreeText(48)
]  # trainer/ledger check names (p2p/verdicts.py CHECK_NAME on the wire)
Reason = Annotated[str, FreeText(MAX_REASON_CHARS)]
Hardware = dict[
    Annotated[str, FreeText(64)], Annotated[str, FreeText(MAX_HARDWARE_TEXT)] | int | float | bool | None
]


class ValidatorApiError(P2PError):
    """A validator's HTTP API could not be reached in time, or answered something unusable."""

    def __init__(self, message: str) -> None:
        # Messages quote servers (error texts, bad headers): one printable line, whatever they sent.
        super().__init__(" ".join(printable(message).split())[:MAX_MESSAGE_CHARS])


class ApiUnreachable(ValidatorApiError):
    """No answer: the connection failed, or the whole answer did not arrive before the deadline."""


class ApiRefused(ValidatorApiError):
    """The API answered with an HTTP status other than 200 (`status`), e.g. 404 for an unknown node."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class VerdictNotReady(ApiRefused):
    """The validator has no verdict on the file yet (404): ask again later."""


# ----- answers --------------------------------------------------------------------------------------------


class _Answer(WireModel):
    """An API answer: a WireModel that ignores fields it does not know (a newer validator may add some)."""

    model_config = ConfigDict(extra="ignore")


class LeaderboardRow(_Answer):
    """One node's row of the ranking (docs/validator.md, "Leaderboard JSON")."""

    rank: int = Field(ge=1, lt=1 << 63, description="1-based position over all nodes.")
    node_id: NodeId
    accepted_tokens: Count
    accepted_samples: Count
    accepted_files: Count
    rejected_files: Count = Field(description="Files rejected for the node's own fault.")
    score: float
    slashes: Count = Field(description="Number of slashes.")
    slashed: float = Field(description="Total score removed by slashes.")
    banned: bool
    ban_permanent: bool
    banned_until: Timestamp | None = Field(
        description="End of the ban in force; null when none or permanent."
    )
    last_step: Count | None = Field(description="Latest policy step of an accepted file.")
    first_seen: Timestamp
    last_seen: Timestamp
    hardware: Hardware = Field(description="The node's heartbeat hardware; {} if never seen.")


class Leaderboard(_Answer):
    generated_at: Timestamp
    ranked: Count = Field(description="Nodes in the ranking: a row's `rank` is out of this many.")
    nodes: list[LeaderboardRow] = Field(max_length=MAX_TOP, description="Best first.")


class ContributionRow(_Answer):
    """One verdict on one of the node's files."""

    file_hash: Sha256Hex
    step: Count
    samples: Count
    tokens: Count
    accepted: bool
    failed_check: CheckName | None
    reason: Reason
    decided_at: Timestamp


class SlashEntry(_Answer):
    file_hash: Sha256Hex | None
    amount: float = Field(ge=0, description="Score removed.")
    check_class: Literal["fault", "fraud"]
    failed_check: CheckName
    reason: Reason
    created_at: Timestamp


class BanEntry(_Answer):
    id: Count
    reason: Reason
    created_at: Timestamp
    until: Timestamp | None = Field(description="End of the ban; null is permanent.")
    lifted_at: Timestamp | None
    file_hash: Sha256Hex | None


class NodeDetail(_Answer):
    node: LeaderboardRow
    ranked: Count = Field(description="Nodes in the ranking: `node.rank` is out of this many.")
    recent: list[ContributionRow] = Field(
        max_length=RECENT_LIMIT, description=f"The last {RECENT_LIMIT} verdicts, newest first."
    )
    slash_log: list[SlashEntry] = Field(max_length=RECENT_LIMIT, description="Newest first.")
    bans: list[BanEntry] = Field(max_length=RECENT_LIMIT, description="Newest first.")


NodeState = Literal["active", "idle", "stale", "banned"]
Reachability = Literal["direct", "relayed", "unreachable", "unknown"]
TrainerState = Literal["moving", "stalled", "stopped", "unknown"]
Hint = Annotated[str, FreeText(240)]


class NodeBan(_Answer):
    """Why and until when a node is banned: the ban in force, and the slash that led to it."""

    reason: Reason = Field(description="The ban's own reason, e.g. 'fraud: rewards check failed'.")
    failed_check: CheckName | None = Field(None, description="The check of the node's latest slash.")
    slash_reason: Reason | None = Field(None, description="That slash's reason (the verdict's, once).")
    since: Timestamp
    until: Timestamp | None = Field(None, description="End of the ban; null is permanent.")


class SwarmNode(_Answer):
    """One row of the swarm table: a node in one role (a key running trainer and validator has two rows)."""

    node_id: NodeId
    role: Annotated[str, FreeText(32)] = Field("contributor", description="This row's role.")
    roles: list[Annotated[str, FreeText(32)]] = Field(
        default_factory=list, description="Every role its heartbeat announces, e.g. contributor, relay."
    )
    state: NodeState = Field(
        "stale",
        description="active: live with accepted work in the window; idle: live without; stale: no heartbeat "
        "for stale_after_s; banned: a ban is in force.",
    )
    version: Annotated[str, FreeText(64)] | None = Field(None, description="Its software version.")
    reachability: Reachability = "unknown"
    reachability_hint: Hint = Field("", description="What the reachability means and how to improve it.")
    hardware: Hardware = Field(default_factory=dict)
    step: Count | None = Field(None, description="Policy step the node works on.")
    last_seen: Timestamp | None = None
    accepted_files: Count = 0
    rejected_files: Count = 0
    accepted_tokens: Count = 0
    tokens_per_s: float = Field(0.0, ge=0, description="Accepted tokens per second over the window.")
    rollouts_per_min: float = Field(
        0.0, ge=0, description="Accepted rollouts (samples) per minute, same window."
    )
    slashes: Count = 0
    ban: NodeBan | None = None


class SwarmTotals(_Answer):
    nodes: Count = Field(0, description="Rows of the swarm table (one per node and role).")
    active: Count = 0
    idle: Count = 0
    stale: Count = 0
    banned: Count = 0
    accepted_files: Count = 0
    rejected_files: Count = Field(0, description="Rejected for the sender's own fault.")
    accepted_tokens: Count = 0
    accepted_samples: Count = 0


class QueueState(_Answer):
    """The validator's own backlog and speed."""

    depth: Count = Field(0, description="Received files waiting for verification.")
    held: Count = Field(0, description="Files waiting for their checkpoint.")
    verdict_latency_s: float | None = Field(
        None, ge=0, description="Mean receipt-to-verdict time of the last verdicts; null before any."
    )
    latency_over: Count = Field(0, description="How many verdicts that mean is over.")
    verdicts_per_min: float = Field(0.0, ge=0, description="Verdicts per minute over the window.")


class TrainerStatus(_Answer):
    """Is the trainer moving: read from the operator's policy announcements and the trainer's heartbeat."""

    state: TrainerState
    node_id: NodeId | None = None
    step: Count | None = Field(None, description="The newest announced policy step.")
    step_at: Timestamp | None = Field(None, description="When that step was first seen announced.")
    announced_at: Timestamp | None = Field(None, description="The newest (re-)announcement of the policy.")
    stall_after_s: float = Field(gt=0, description="No new step for this long is a stall.")
    hint: Hint = ""


class SwarmView(_Answer):
    available: bool = Field(description="False until the validator service supplies a swarm source.")
    policy_step: Count | None = Field(None, description="Latest announced policy step.")
    nodes: list[SwarmNode] = Field(default_factory=list, max_length=MAX_TOP + 8)
    generated_at: Timestamp | None = None
    window_s: float = Field(600.0, gt=0, description="The window of `active`, throughput and verdict rate.")
    stale_after_s: float = Field(60.0, gt=0, description="A node unheard for this long is stale.")
    totals: SwarmTotals = Field(default_factory=SwarmTotals)
    queue: QueueState | None = None
    trainer: TrainerStatus | None = None


class HistoryPoint(_Answer):
    step: Count
    accepted: Count = Field(description="Files accepted at this policy step.")
    rejected: Count = Field(description="Files rejected for the node's fault at this step.")
    tokens: Count = Field(description="Accepted tokens at this step.")


class NodeHistory(_Answer):
    """One node's accepted and rejected files per policy step (`/api/node/{node_id}/history`)."""

    node_id: NodeId
    points: list[HistoryPoint] = Field(
        default_factory=list, max_length=HISTORY_STEPS, description="Oldest step first."
    )


class RewardPoint(_Answer):
    step: Count
    reward: float = Field(description="Mean task reward of the accepted rollouts of this step.")
    samples: Count = Field(0, description="Accepted samples (rows) the mean is over.")
    files: Count = Field(0, description="Accepted files of this step.")


class RewardCurve(_Answer):
    available: bool = Field(description="False when the dashboard has no reward source.")
    points: list[RewardPoint] = Field(default_factory=list, description="Oldest step first.")


class ErrorAnswer(_Answer):
    error: Annotated[str, FreeText(MAX_MESSAGE_CHARS)]


Model = TypeVar("Model", bound=WireModel)


def parse_answer(body: bytes, model: type[Model], what: str) -> Model:
    """`body` as `model`: strict JSON, then the model; ValidatorApiError naming the field otherwise."""
    try:
        return model.model_validate(loads_strict(body, what))
    except WireFormatError as exc:
        raise ValidatorApiError(f"{exc}; is that a prime-node validator?") from None
    except ValidationError as exc:
        raise ValidatorApiError(f"{what} is malformed {describe(exc)}") from None


# ----- URLs -----------------------------------------------------------------------------------------------


def leaderboard_url(base: str, top: int) -> str:
    return f"{base.rstrip('/')}{LEADERBOARD_PATH}?top={int(top)}"


def node_url(base: str, node: str) -> str:
    return base.rstrip("/") + NODE_PATH.format(node_id=quote(node, safe=""))


def verdict_url(base: str, file_hash: str, node_id: str) -> str:
    return base.rstrip("/") + VERDICT_PATH.format(
        file_hash=quote(file_hash, safe=""), node_id=quote(node_id, safe="")
    )


# ----- the client -----------------------------------------------------------------------------------------


class ValidatorApiClient:
    """The one client of the API: each request bounded by `timeout_s` of wall-clock time and its route's
    byte limit. One HTTP session, opened at the first request; `close()` (or `async with`) ends it."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ValidatorApiClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def leaderboard(self, base: str, top: int) -> Leaderboard:
        """The first `top` rows of the ranking at `base`."""
        body = await self.get(leaderboard_url(base, top), MAX_LEADERBOARD_BYTES)
        return parse_answer(body, Leaderboard, "the leaderboard")

    async def node(self, base: str, node: str) -> NodeDetail:
        """One node's row and recent history (`node`: an id or a prefix); ApiRefused 404 when unknown."""
        body = await self.get(node_url(base, node), MAX_NODE_BYTES)
        return parse_answer(body, NodeDetail, "the node entry")

    async def verdict(self, base: str, file_hash: str, node_id: str, validator_id: str) -> Signed[Verdict]:
        """The verdict on `node_id`'s delivery of `file_hash`, signed by `validator_id` and about exactly that
        file and node (p2p/verdicts.py `open_signed` checks size, signer and signature before the schema);
        VerdictNotReady while the validator has none."""
        url = verdict_url(base, file_hash, node_id)
        try:
            body = await self.get(url, MAX_ENVELOPE_BYTES)
        except ApiRefused as exc:
            if exc.status == 404:
                raise VerdictNotReady(
                    f"validator {validator_id[:16]}… has no verdict for {file_hash[:16]}… yet", 404
                ) from None
            raise
        try:
            signed = open_signed(body, Verdict, {validator_id})
        except DocumentError as exc:
            raise ValidatorApiError(f"the verdict from {url} is not valid: {exc}") from None
        if signed.document.file_hash != file_hash or signed.document.node_id != node_id:
            raise ValidatorApiError(f"the verdict from {url} is about another file or node; ignored")
        return signed

    async def get(self, url: str, limit: int) -> bytes:
        """The body of a 200 answer to GET `url`: ApiRefused for another status, ApiUnreachable when it cannot
        be had within the deadline, ValidatorApiError for an answer over `limit` bytes or not plain HTTP."""
        try:
            async with asyncio.timeout(self.timeout_s):
                status, body = await self._fetch(url, limit)
        except TimeoutError:
            raise ApiUnreachable(f"no complete answer from {url} within {self.timeout_s:g} s") from None
        except aiohttp.ClientConnectorError as exc:
            raise ApiUnreachable(f"cannot reach the validator at {url} ({exc})") from None
        except aiohttp.ClientConnectionError as exc:
            raise ApiUnreachable(f"{url} broke off its answer ({type(exc).__name__}: {exc})") from None
        except aiohttp.ClientResponseError as exc:  # the parser's complaint; its repr repeats the URL
            raise ValidatorApiError(f"{url} did not answer in plain HTTP ({exc.message})") from None
        except aiohttp.ClientError as exc:
            raise ValidatorApiError(
                f"{url} did not answer in plain HTTP ({type(exc).__name__}: {exc})"
            ) from None
        except OSError as exc:
            raise ApiUnreachable(f"cannot reach the validator at {url} ({exc})") from None
        if status != 200:
            raise ApiRefused(f"{url} answered {status}{_error_text(body)}", status)
        return body

    async def _fetch(self, url: str, limit: int) -> tuple[int, bytes]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),  # a second guard; the deadline is above
                headers={"Accept": "application/json", "Accept-Encoding": "identity"},
                auto_decompress=False,  # a few compressed bytes must not become gigabytes before any bound
                max_headers=64,
            )
        async with self._session.get(url, allow_redirects=False) as resp:
            encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
            if encoding != "identity":
                raise ValidatorApiError(
                    f"{url} sent a {encoding[:20]}-encoded body; only identity is accepted"
                )
            if (resp.content_length or 0) > limit:
                raise ValidatorApiError(
                    f"{url} announces {resp.content_length} bytes; at most {limit} accepted"
                )
            body = bytearray()
            async for chunk in resp.content.iter_chunked(64 << 10):
                body += chunk
                if len(body) > limit:
                    raise ValidatorApiError(f"{url} sent more than {limit} bytes; refused")
            return resp.status, bytes(body)


def _error_text(body: bytes) -> str:
    """`: <the server's error text>`, or nothing when the body is not an ErrorAnswer."""
    try:
        return f": {ErrorAnswer.model_validate(loads_strict(body, 'error')).error}"
    except (WireFormatError, ValidationError):
        return ""


Result = TypeVar("Result")


def call_sync(timeout_s: float, call: Callable[[ValidatorApiClient], Awaitable[Result]]) -> Result:
    """`call(client)` on a fresh event loop, for synchronous callers (the CLI, the devnet's monitor); not
    from inside a running loop. The client is closed before this returns."""

    async def run() -> Result:
        async with ValidatorApiClient(timeout_s) as client:
            return await call(client)

    return asyncio.run(run())
