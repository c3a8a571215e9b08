"""The HTTP server for manifests and shards: origins, relays and peers that hold a verified version run it.

Endpoints (pinned in docs/protocol.md, ## Weights):
    GET /v1/weights/versions                     JSON list of the versions served
    GET /v1/weights/latest                       manifest of the newest version
    GET /v1/weights/{step}/manifest              manifest of one version
    GET /v1/weights/{step}/shards/{index}        shard bytes; honours one `Range: bytes=` range (206)
    GET /v1/weights/{step}/availability          the verified shards held, signed by the node (availability.py)

`step` and `index` are ASCII digits only (p2p/wire.py parse_uint): /v1/weights/%D9%A1/manifest is a 404,
not step 1.

A version is served from its directory in the store. A relay also serves a version that is still
arriving: its manifest once verified, each shard once verified; a request for a shard not verified yet
waits for it a little (pipelining) and then gets 503 with Retry-After. A server with a node identity signs
which shards it holds (availability.py), so fetchers ask it only for those; one without answers 404 there
(an origin, or an older server: fetchers then treat it as holding what its manifest lists). Files go out with sendfile.
Requests may carry a signed access token (p2p/weights/access.py): a bad one gets 401, and so does a request
without one when `require_node_auth` is set. Banned clients (the proven node id, or the address) get 403,
clients over their request rate 429. Every connection is admitted and timed by guard.py: caps on connections
in total and per address, a deadline for each request head, and one for each response from its size and a
minimum send rate. With `metrics` (p2p/weights/metrics.py), every
answer is counted by route and status, timed, and shard bytes sent are added up, on the registry of the
process that runs it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Handler
from pydantic import BaseModel, ConfigDict, Field

from ..errors import P2PError
from ..identity import Identity
from ..rate_limit import TokenBuckets
from ..wire import WireFormatError, parse_uint
from .access import (
    AUTH_HEADER,
    AccessDenied,
    BanList,
    audience_of,
    own_audiences,
    verify_access_token,
)
from .availability import MAX_AGE_S, sign_availability
from .errors import WeightsError
from .guard import ConnectionGuard, GuardedSite, ServeLimits, client_of
from .manifest import MAX_SHARDS, MAX_STEP, SignedManifest
from .metrics import WeightsServerMetrics
from .seeding import SEED_HEADER, SeedLedger
from .store import Store
from .transfer import BUSY_HEADER, SHARD_CONTENT_TYPE

logger = logging.getLogger(__name__)

LONG_POLL_S = 2.0  # how long an availability request with `after` waits for a new shard before answering
MAX_TRACKED_CLIENTS = 10_000  # bound the rate limiter's memory under a flood of distinct addresses


class ServeSettings(BaseModel):
    """Where and how a weights server listens, and what it keeps."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(
        "127.0.0.1", description="Address the weights server binds; loopback unless the operator opens it up."
    )
    port: int = Field(
        8470, ge=0, le=65535, description="TCP port of the weights server (0 picks a free one)."
    )
    keep: int = Field(5, ge=1, description="Versions kept on disk; older ones are deleted.")
    rate_per_s: float = Field(
        200.0, ge=0, description="Requests per second per client address (0: unlimited)."
    )
    rate_burst: int = Field(400, ge=1, description="Requests a client may burst above its rate.")
    ban: list[str] = Field(
        default_factory=list, description="Banned node ids (64 hex) and IP addresses/networks."
    )
    ban_file: Path | None = Field(
        None, description="File of ban entries, one per line, re-read when it changes."
    )
    public_urls: list[str] = Field(
        default_factory=list,
        description="URLs clients reach this server by beyond its bound address (NAT, DNS); access tokens "
        "addressed to them are accepted.",
    )
    require_node_auth: bool = Field(
        False,
        description="Refuse requests without a node's signed access token (so node-id bans cannot be dodged).",
    )
    scan_interval_s: float = Field(1.0, gt=0, description="How often the store directory is rescanned.")
    shard_wait_s: float = Field(5.0, ge=0, description="How long a request waits for a shard still arriving.")
    upload_slots: int = Field(
        0,
        ge=0,
        le=65536,
        description="Shards sent at once (0: no limit); more requests get 503 with Retry-After busy_retry_s. "
        "An origin feeding a swarm of re-serving peers sends a few shards at full speed rather than every "
        "shard to everyone at a crawl.",
    )
    upload_slots_per_client: int = Field(
        1,
        ge=1,
        le=65536,
        description="Upload slots one client (one IP address) may hold at once when upload_slots is set; "
        "beyond it a request gets the same busy 503. A slot is held for the whole send, and a client that "
        "reads slowly holds one for minutes (limits.send_grace_s plus the shard at limits.min_send_rate_bytes_s): "
        "without this cap a few such connections from one address would make the server busy to everyone.",
    )
    busy_retry_s: float = Field(
        0.2, gt=0, le=5, description="Retry-After of a 503 for want of an upload slot."
    )
    super_seed: bool = Field(
        False,
        description="An origin feeding re-serving peers: while some shard of a version has never been sent, a "
        "request for one already sent gets 503 naming a never-sent shard instead (seeding.py). Only for a "
        "server that signs no availability records.",
    )
    limits: ServeLimits = Field(
        default_factory=ServeLimits, description="Connections, request-head and send deadlines per client."
    )


@dataclass
class ServedVersion:
    """One version the server answers for."""

    manifest: SignedManifest
    manifest_bytes: bytes
    checkpoint_dir: Path
    complete: bool
    ready: set[int] = field(default_factory=set)  # verified shards of an incomplete version
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # pulsed whenever a shard is verified
    record: bytes | None = None  # the signed availability record last made, while it is current
    record_key: tuple[int, float] = (-1, 0.0)  # (shards held, monotonic time) when it was signed

    def has(self, index: int) -> bool:
        return self.complete or index in self.ready

    def held(self) -> int:
        return len(self.manifest.body.shards) if self.complete else len(self.ready)


class WeightsServer:
    """Serves the versions of a store; see the module docstring."""

    def __init__(
        self,
        store: Store,
        settings: ServeSettings | None = None,
        trusted_key: str | None = None,
        metrics: WeightsServerMetrics | None = None,
        identity: Identity | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.identity = identity  # signs availability records; None: /availability answers 404
        self.settings = settings or ServeSettings()
        self.trusted_key = trusted_key
        self.versions: dict[int, ServedVersion] = {}
        self.bans = BanList(self.settings.ban, self.settings.ban_file)
        self.limiter = TokenBuckets(
            self.settings.rate_per_s, self.settings.rate_burst, max_keys=MAX_TRACKED_CLIENTS
        )
        self.guard = ConnectionGuard(self.settings.limits)
        self._runner: web.AppRunner | None = None
        self._scanner: asyncio.Task[None] | None = None
        self.port: int | None = None
        self.addresses: list[tuple[str, int]] = []
        self.audiences: set[str] = set()  # host:port names access tokens may be addressed to
        self._unservable: set[int] = set()
        self.sending = 0  # shard responses in flight (bounded by settings.upload_slots)
        # Client address -> its shard responses in flight, tracked only when upload_slots is set: an entry
        # exists only while that client holds a slot, so there are at most upload_slots of them.
        self.sending_by_client: dict[str, int] = {}
        if self.settings.super_seed and identity is not None:
            raise WeightsError(
                "serve.super_seed is for a server that signs no availability records: a node that signed it "
                "holds a shard and then refused it would be taken for a liar"
            )
        self.seeds = SeedLedger() if self.settings.super_seed else None

    # ---- lifecycle -------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        # Counted outermost, so that refusals (the guard's, 401, 403, 429) are counted too.
        inner = [self.guard.middleware, self._access]
        app = web.Application(middlewares=inner if self.metrics is None else [self._count, *inner])
        app.router.add_get("/v1/weights/versions", self._versions)
        app.router.add_get("/v1/weights/latest", self._latest)
        # [0-9], never \d (every Unicode digit); the numbers are read by parse_uint in the handlers.
        app.router.add_get(r"/v1/weights/{step:[0-9]{1,16}}/manifest", self._manifest)
        app.router.add_get(r"/v1/weights/{step:[0-9]{1,16}}/shards/{index:[0-9]{1,9}}", self._shard)
        app.router.add_get(r"/v1/weights/{step:[0-9]{1,16}}/availability", self._availability)
        return app

    async def start(self) -> str:
        """Scan the store, bind, and start the rescanning task; returns the base URL."""
        self.store.root.mkdir(parents=True, exist_ok=True)
        await self.rescan()
        # The guard's header timeout also bounds an idle keep-alive connection; aiohttp's own is a backstop.
        self._runner = runner = web.AppRunner(
            self.app(), access_log=None, keepalive_timeout=self.settings.limits.header_timeout_s
        )
        await runner.setup()
        if self.metrics is not None:
            self.metrics.watch(
                lambda: len(runner.server.connections) if runner.server is not None else 0,
                lambda: len(self.versions),
            )
        site = GuardedSite(self._runner, self.settings.host, self.settings.port, self.guard)
        await site.start()
        sockets = site.sockets
        self.addresses = [tuple(s.getsockname()[:2]) for s in sockets]  # what was actually bound
        self.port = sockets[0].getsockname()[1] if sockets else self.settings.port
        self.audiences = own_audiences(self.settings.host, self.addresses, self.port)
        for public in self.settings.public_urls:
            self.accept_audience(public)
        self._scanner = asyncio.create_task(self._scan_forever(), name="weights-server-scan")
        url = f"http://{self.settings.host}:{self.port}"
        logger.info("serving weights from %s at %s", self.store.root, url)
        return url

    def accept_audience(self, url: str) -> None:
        """Also accept access tokens addressed to `url` (a public address that reaches this server), an IP host
        also in its canonical spelling: peers fetch from the URL as node/contributor/serving.py `canonical_url`
        writes it (an IPv6 address compressed), whatever spelling the heartbeat gave."""
        parts = urlsplit(url)
        self.audiences.add(audience_of(parts.hostname, parts.port, parts.scheme))
        try:
            ip = ipaddress.ip_address(parts.hostname or "")
        except ValueError:
            return  # a DNS name: peers do not fetch from it (serving.py `peer_url_refusal`)
        self.audiences.add(audience_of(str(ip), parts.port, parts.scheme))

    async def stop(self) -> None:
        if self._scanner is not None:
            self._scanner.cancel()
            await asyncio.gather(self._scanner, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def scanner(self) -> asyncio.Task[None] | None:
        """The background rescanning task, for supervisors that want to notice if it crashes."""
        return self._scanner

    async def _scan_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.scan_interval_s)
            try:
                await self.rescan()
            except OSError as exc:  # a disk hiccup must not stop serving what is already loaded
                logger.warning("rescanning %s failed: %s", self.store.root, exc)

    async def rescan(self) -> None:
        """Prune to `keep`, load complete versions that appeared, forget the ones that went away."""
        await asyncio.to_thread(self.store.prune, self.settings.keep)
        await asyncio.to_thread(self.bans.reload)
        steps = await asyncio.to_thread(self.store.versions)
        for step in steps:
            served = self.versions.get(step)
            if served is not None and served.complete:
                continue
            if step in self._unservable:
                continue
            try:
                manifest = await asyncio.to_thread(self.store.load_manifest, step, self.trusted_key)
            except (P2PError, OSError) as exc:
                self._unservable.add(step)  # warned once, not at every scan
                logger.warning("not serving %s: %s", self.store.version_dir(step), exc)
                continue
            self.mark_complete(manifest, self.store.checkpoint_dir(step))
        for step in [s for s, v in self.versions.items() if v.complete and s not in steps]:
            del self.versions[step]
        if self.seeds is not None:
            self.seeds.keep_only(set(self.versions))
        for step, served in list(self.versions.items()):
            # A version held in part whose files were deleted (pruned, or discarded) is no longer served; one
            # that just moved into place is marked complete by its fetch.
            gone = not served.checkpoint_dir.exists() and not self.store.version_dir(step).exists()
            if not served.complete and gone:
                self.drop(step)

    # ---- used by relays ----------------------------------------------------------------------------------

    def add_partial(self, manifest: SignedManifest, checkpoint_dir: Path) -> None:
        """Advertise a version whose manifest verified and whose shards are arriving."""
        if manifest.step not in self.versions:
            self.versions[manifest.step] = ServedVersion(
                manifest, manifest.to_bytes(), checkpoint_dir, complete=False
            )

    def shard_ready(self, step: int, index: int) -> None:
        served = self.versions.get(step)
        if served is not None and not served.complete:
            served.ready.add(index)
            served.arrived.set()
            served.arrived = (
                asyncio.Event()
            )  # waiters hold the old event; new waiters wait for the next shard

    def mark_complete(self, manifest: SignedManifest, checkpoint_dir: Path) -> None:
        old = self.versions.get(manifest.step)
        self.versions[manifest.step] = ServedVersion(
            manifest, manifest.to_bytes(), checkpoint_dir, complete=True
        )
        if old is not None:
            old.arrived.set()

    def drop(self, step: int) -> None:
        """Stop advertising an incomplete version (its fetch failed verification or was abandoned)."""
        served = self.versions.get(step)
        if served is not None and not served.complete:
            del self.versions[step]
            served.arrived.set()

    # ---- handlers ----------------------------------------------------------------------------------------

    @web.middleware
    async def _count(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        assert self.metrics is not None  # installed only with metrics
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"  # bounded label values
        loop = asyncio.get_running_loop()
        started = loop.time()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            self.metrics.requests.labels(route=route, status=str(status)).inc()
            self.metrics.request_seconds.labels(route=route).observe(loop.time() - started)

    @web.middleware
    async def _access(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        node_id: str | None = None
        token = request.headers.get(AUTH_HEADER)
        if token is not None:
            # The Host header names the audience, but the client chooses it: it must be one of this server's
            # own names, or a server that received a token could replay it here under its own name.
            audience = audience_of(request.url.host, request.url.port, request.scheme)
            if audience not in self.audiences:
                return web.json_response(
                    {
                        "error": f"request addressed to {audience}, which is not this server "
                        "(behind NAT or DNS, list the public URL in serve.public_urls)"
                    },
                    status=401,
                )
            try:
                node_id = verify_access_token(token, audience)
            except AccessDenied as exc:
                return web.json_response({"error": str(exc)}, status=401)
        elif self.settings.require_node_auth:
            return web.json_response(
                {"error": f"this server needs a node access token ({AUTH_HEADER})"}, status=401
            )
        if self.bans.is_banned(request.remote, node_id):
            return web.json_response({"error": "banned"}, status=403)
        retry = self.limiter.take(client_of(request.remote))
        if retry > 0:
            return web.json_response(
                {"error": "rate limited"}, status=429, headers={"Retry-After": f"{retry:.2f}"}
            )
        return await handler(request)

    def _version(self, request: web.Request) -> ServedVersion:
        served = self.versions.get(_number(request, "step", MAX_STEP))
        if served is None:
            raise web.HTTPNotFound(
                text=json.dumps({"error": "no such version"}), content_type="application/json"
            )
        return served

    async def _versions(self, request: web.Request) -> web.Response:
        listing = [
            {
                "step": s,
                "manifest_sha256": v.manifest.digest,
                "complete": v.complete,
                "shards_ready": len(v.manifest.body.shards) if v.complete else len(v.ready),
            }
            for s, v in sorted(self.versions.items())
        ]
        return web.json_response({"versions": listing})

    async def _latest(self, request: web.Request) -> web.Response:
        if not self.versions:
            return web.json_response({"error": "no version yet"}, status=404)
        served = self.versions[max(self.versions)]
        return web.Response(body=served.manifest_bytes, content_type="application/json")

    async def _manifest(self, request: web.Request) -> web.Response:
        return web.Response(body=self._version(request).manifest_bytes, content_type="application/json")

    async def _availability(self, request: web.Request) -> web.Response:
        served = self._version(request)
        if self.identity is None:
            raise web.HTTPNotFound(
                text='{"error": "this server signs no availability records"}', content_type="application/json"
            )
        after = request.query.get("after")
        if after is not None:  # a long poll: answered once more than `after` shards are held, or at its end
            try:
                known = parse_uint(after, "after", maximum=MAX_SHARDS, minimum=0) if after != "-1" else -1
            except WireFormatError as exc:
                raise web.HTTPBadRequest(
                    text=json.dumps({"error": str(exc)}), content_type="application/json"
                ) from None
            served = await self._wait_held(served, known)
        loop = asyncio.get_running_loop()
        now = loop.time()
        held, signed_at = served.record_key
        # Signed again only when the shards held changed (one signature serves every poller meanwhile), and
        # well before the record would go stale.
        if served.record is None or held != served.held() or now - signed_at > MAX_AGE_S / 4:
            shards = range(len(served.manifest.body.shards)) if served.complete else served.ready
            served.record = sign_availability(self.identity, served.manifest, frozenset(shards))
            served.record_key = (served.held(), now)
        return web.Response(body=served.record, content_type="application/json")

    async def _wait_held(self, served: ServedVersion, known: int) -> ServedVersion:
        """The version once it holds more than `known` shards, or after LONG_POLL_S (404 if it went away)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LONG_POLL_S
        while served.held() <= known and not served.complete:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                async with asyncio.timeout(remaining):
                    await served.arrived.wait()
            except TimeoutError:
                pass
            current = self.versions.get(served.manifest.step)
            if current is None:
                raise web.HTTPNotFound(text='{"error": "no such version"}', content_type="application/json")
            served = current
        return served

    async def _shard(self, request: web.Request) -> web.StreamResponse:
        served = self._version(request)
        index = _number(request, "index", 10**9)
        shards = served.manifest.body.shards
        if index >= len(shards):
            raise web.HTTPNotFound(text='{"error": "no such shard"}', content_type="application/json")
        served = await self._wait_for(served, index)
        size = shards[index].size
        try:
            span = request.http_range  # slice(start, stop); slice(-N, None) for a suffix range
        except ValueError:
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"}) from None
        start, stop = span.start or 0, span.stop
        if start < 0:
            start, stop = max(0, size + start), None
        stop = size if stop is None else min(stop, size)
        if not 0 <= start < stop:
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
        slots = self.settings.upload_slots
        client = client_of(
            request.remote
        )  # the socket's peer (an IPv6 one's /64), as the rate limiter keys it
        if slots and (
            self.sending >= slots
            or self.sending_by_client.get(client, 0) >= self.settings.upload_slots_per_client
        ):
            # Every slot taken, or this client holds its share of them (`upload_slots_per_client`): the same
            # answer either way, so a client holding slots learns nothing it could not learn by asking again.
            raise web.HTTPServiceUnavailable(
                text='{"error": "every upload slot is busy"}',
                content_type="application/json",
                headers={"Retry-After": f"{self.settings.busy_retry_s:g}", BUSY_HEADER: "upload slots"},
            )
        step, count = served.manifest.step, len(shards)
        if self.seeds is not None and served.complete:
            instead = self.seeds.instead(step, count, index)
            if instead is not None:
                raise web.HTTPServiceUnavailable(
                    text='{"error": "shard sent already; ask its peers, and this server for another"}',
                    content_type="application/json",
                    headers={"Retry-After": "0", SEED_HEADER: str(instead)},
                )
            self.seeds.started(step, count, index)
        partial = "Range" in request.headers
        resp = web.StreamResponse(status=206 if partial else 200)
        resp.content_type = SHARD_CONTENT_TYPE
        resp.content_length = stop - start
        resp.headers["Accept-Ranges"] = "bytes"
        resp.headers["ETag"] = f'"{shards[index].sha256}"'
        if partial:
            resp.headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        self.sending += 1
        if slots:
            self.sending_by_client[client] = self.sending_by_client.get(client, 0) + 1
        sent = False
        try:
            whole = await self.guard.send(
                request,
                resp,
                stop - start,
                lambda: self._send_range(request, resp, served, index, start, stop),
            )
            sent = (
                whole and stop == size
            )  # a range that ends before the shard's end leaves it incomplete there
        finally:
            self.sending -= 1
            if slots:
                held = self.sending_by_client.pop(client) - 1
                if held > 0:
                    self.sending_by_client[client] = held
            if self.seeds is not None and served.complete and not sent:
                self.seeds.failed(step, index)
        return resp

    async def _wait_for(self, served: ServedVersion, index: int) -> ServedVersion:
        loop = asyncio.get_running_loop()
        # A server that signs availability records tells fetchers what it holds, so a shard it does not hold
        # is refused at once (503) rather than holding the request in the hope that it arrives.
        wait_s = 0.0 if self.identity is not None else self.settings.shard_wait_s
        deadline = loop.time() + wait_s
        while not served.has(index):
            remaining = deadline - loop.time()
            if remaining <= 0 or self.versions.get(served.manifest.step) is not served:
                current = self.versions.get(served.manifest.step)
                if current is not None and current.has(index):
                    return current
                raise web.HTTPServiceUnavailable(
                    text='{"error": "shard not verified here yet"}',
                    content_type="application/json",
                    headers={"Retry-After": "1"},
                )
            try:
                async with asyncio.timeout(remaining):
                    await served.arrived.wait()
            except TimeoutError:
                pass
        return served

    async def _send_range(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        served: ServedVersion,
        index: int,
        start: int,
        stop: int,
    ) -> None:
        loop = asyncio.get_running_loop()
        files = served.manifest.body.files
        for seg in served.manifest.segments(index):
            lo, hi = max(start, seg.shard_offset), min(stop, seg.shard_offset + seg.length)
            if lo >= hi:
                continue
            offset = seg.file_offset + (lo - seg.shard_offset)
            path = served.checkpoint_dir / files[seg.file_index].path
            if not path.exists():  # a relay's version may have just moved from .partial/ into place
                path = self.store.checkpoint_dir(served.manifest.step) / files[seg.file_index].path
            with open(path, "rb") as fobj:
                transport = request.transport
                if transport is None:
                    raise ConnectionResetError("client went away")
                try:
                    await loop.sendfile(transport, fobj, offset, hi - lo)
                except NotImplementedError:  # e.g. TLS transports: plain reads on a thread instead
                    pos = offset
                    while pos < offset + (hi - lo):
                        block = await asyncio.to_thread(
                            os.pread, fobj.fileno(), min(1 << 20, offset + hi - lo - pos), pos
                        )
                        await resp.write(block)
                        pos += len(block)
            if self.metrics is not None:
                self.metrics.sent_bytes.inc(hi - lo)
        await resp.write_eof()


def _number(request: web.Request, name: str, maximum: int) -> int:
    """A route's number (already [0-9] by the route's pattern) within its bound; 404 otherwise."""
    try:
        return parse_uint(request.match_info[name], name, maximum=maximum)
    except WireFormatError:
        raise web.HTTPNotFound(
            text=json.dumps({"error": f"no such {name}"}), content_type="application/json"
        ) from None
