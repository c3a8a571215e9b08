"""Dial-back proofs of which node serves at a peer's weights URL, on hosts where more URLs are named than drawn.

Why: a heartbeat names one weights URL, on one of the addresses the same heartbeat lists as the peer's own,
and both are the peer's claims. Sybils (an id costs a key pair) that list an honest node's IP as theirs and
name other ports or paths there dilute that host's share of each fetch (serving.py `sources_for` draws hosts,
then up to MAX_URLS_PER_HOST URLs of each): with k false URLs the honest server is drawn with probability
3 / (k + 1) until this node has once fetched from it. Drawing among claimant ids first and then among the URLs
each names would not help: one heartbeat names one URL, so k false URLs are k ids already.

What this does: on a contested host (one naming more URLs than a fetch draws of it) the node asks each URL it
has not proven, in the background and under the bounds below, for the availability record of a step its
claimants say it serves (GET /v1/weights/{step}/availability, no long poll). That is the record every fetch
verifies (p2p/weights/availability.py `verify_signed_record`, `check_current`: the same code), so the answer
proves which node serves there, and nothing on the honest host signs as a sybil:

  * a current record of that step signed by one of the URL's claimants: proven (`on_proven`, serving.py
    `note_proven`), so the next fetch draws it first on its host;
  * no answer within the deadline, a refused connection, an HTTP error or 404/503, an oversized answer, a
    record of another key or another step, malformed, or dated in the future: held out of the draw for
    `hold_s` (and asked again after);
  * a validly signed record of a claimant that is stale (a clock behind ours): nothing concluded, asked again
    in a later window.

Bounds, because each probe is a request this node sends where a peer told it to (the probing must not become a
way to make the swarm flood some address): only URLs that passed `peer_url_refusal` (the IP is one its heartbeat
lists as its own, and public unless the operator lists its network), only on contested hosts, at most
`per_host` probes per host and `per_window` in all per `window_s`, `concurrency` at once, each one request for
at most MAX_AVAILABILITY_BYTES under a `timeout_s` wall-clock deadline (connect included), and each URL at most
once per window (once per `hold_s` once it failed). However many URLs sybils name on a victim's address, a
node sends it at most `per_host` small requests per window: about what one fetch that draws the host sends.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from ...p2p.identity import Identity
from ...p2p.weights.access import TokenSource
from ...p2p.weights.availability import (
    MAX_AVAILABILITY_BYTES,
    AvailabilityError,
    StaleAvailability,
    check_current,
    verify_signed_record,
)
from ...p2p.weights.connections import ConnectionPool
from ...p2p.weights.errors import ManifestError
from ...p2p.weights.transfer import fetch_document

logger = logging.getLogger(__name__)

# URLs remembered as held out or as asked this window: a bound on what sybils naming URLs can make a node keep.
MAX_URLS_KEPT = 4096
# Beyond a probe's own deadline (which the connection watchdog enforces in its thread), how long the loop waits
# for that thread to notice before it gives up on the answer.
DEADLINE_GRACE_S = 1.0


class ProofSettings(BaseModel):
    """Bounds of the dial-back proofs (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    window_s: float = Field(60.0, gt=0, le=3600, description="The window the probe budgets count in.")
    per_host: int = Field(4, ge=1, le=64, description="Probes to one host per window.")
    per_window: int = Field(32, ge=1, le=1024, description="Probes to all hosts per window.")
    concurrency: int = Field(8, ge=1, le=64, description="Probes in flight at once.")
    timeout_s: float = Field(
        5.0, gt=0, le=60, description="Wall-clock deadline of one probe, connect included."
    )
    hold_s: float = Field(
        600.0, gt=0, le=86400, description="How long a URL that failed its probe is not drawn."
    )
    interval_s: float = Field(15.0, gt=0, le=3600, description="How often to look for URLs to prove unwoken.")


@dataclass(frozen=True)
class ProofTarget:
    """A peer URL that may be probed: the node ids naming it, and a step they say it serves."""

    url: str
    claimants: frozenset[str]
    step: int


def availability_probe_path(step: int) -> str:
    return f"/v1/weights/{step}/availability"  # no `after`: the server answers at once, no long poll


class SourceProver:
    """Proves (or holds out) unproven URLs on contested hosts; see the module docstring."""

    def __init__(
        self,
        on_proven: Callable[[str, str], None],
        identity: Identity | None = None,
        settings: ProofSettings | None = None,
        *,
        slots_per_host: int,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.on_proven = on_proven
        self.settings = settings or ProofSettings()
        self.slots_per_host = slots_per_host  # a host naming more URLs than this is contested
        # Probes carry an access token as a fetch's requests do: a server that refuses banned nodes sees who asks.
        self.auth = TokenSource(identity) if identity is not None else None
        self._clock = clock
        self._rng = rng or random.Random()
        self._held: dict[str, float] = {}  # URL -> clock time until which it is not drawn (its probe failed)
        self._asked: dict[str, float] = {}  # URL -> clock time of its last probe
        self._window_start = -float("inf")
        self.window_probes: Counter[str] = Counter()  # host -> probes sent in the current window
        self.sent = 0  # probes sent in all (status, tests)
        self._wake = asyncio.Event()

    def held_out(self, url: str) -> bool:
        """Whether `url` failed its probe less than `hold_s` ago: it is not drawn for a fetch."""
        until = self._held.get(url)
        return until is not None and until > self._clock()

    def wake(self) -> None:
        """The peers changed (serving.py `note_peers`): look for URLs to prove now, not at the next interval."""
        self._wake.set()

    def due(self, targets: list[ProofTarget], proven: set[str]) -> list[ProofTarget]:
        """The probes to send now, within this window's budgets: unproven URLs of contested hosts, neither held
        out nor asked this window, in random order within each host (nothing before its proof tells an honest
        URL from a sybil's, so the order must not be one a sybil can choose)."""
        now = self._clock()
        if now - self._window_start >= self.settings.window_s:
            self._window_start = now
            self.window_probes.clear()
        by_host: dict[str, list[ProofTarget]] = {}
        for target in sorted(targets, key=lambda t: t.url):
            by_host.setdefault(urlsplit(target.url).hostname or "", []).append(target)
        left = self.settings.per_window - sum(self.window_probes.values())
        chosen: list[ProofTarget] = []
        hosts = sorted(by_host)
        self._rng.shuffle(hosts)  # the global budget must not always favour the same hosts
        for host in hosts:
            named = by_host[host]
            if len(named) <= self.slots_per_host:
                continue  # every URL of the host is drawn anyway: a proof would change nothing
            candidates = [
                t
                for t in named
                if t.url not in proven
                and not self.held_out(t.url)
                and now - self._asked.get(t.url, -float("inf")) >= self.settings.window_s
            ]
            self._rng.shuffle(candidates)
            take = min(len(candidates), self.settings.per_host - self.window_probes[host], left)
            if take <= 0:
                continue
            chosen += candidates[:take]
            self.window_probes[host] += take
            left -= take
        for target in chosen:
            _remember(self._asked, target.url, now)
        self.sent += len(chosen)
        return chosen

    async def prove(self, targets: list[ProofTarget], proven: set[str]) -> int:
        """Send the probes due now and apply their answers; returns how many URLs they proved."""
        plan = self.due(targets, proven)
        if not plan:
            return 0
        s = self.settings
        pool = ConnectionPool(s.timeout_s, s.timeout_s, self.auth)
        threads = ThreadPoolExecutor(
            max_workers=min(s.concurrency, len(plan)), thread_name_prefix="weights-proof"
        )
        gate = asyncio.Semaphore(s.concurrency)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(
                        self._probe(pool, threads, gate, target), name=f"weights-proof {target.url}"
                    )
                    for target in plan
                ]
        finally:
            pool.abort()  # a thread still blocked on a socket returns at once (cancellation, a missed deadline)
            pool.close()
            threads.shutdown(wait=False)
        return sum(task.result() for task in tasks)

    async def run(self, targets: Callable[[], tuple[list[ProofTarget], set[str]]]) -> None:
        """Supervised task: prove what is due each time the peers change, and at least every `interval_s`."""
        while True:
            self._wake.clear()
            try:
                await self.prove(*targets())
            except Exception:  # noqa: BLE001 - a bug here must not stop the node: it only loses the proofs
                logger.exception("weights URL proofs: unexpected error (a bug; please report it)")
            try:
                async with asyncio.timeout(self.settings.interval_s):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _probe(
        self, pool: ConnectionPool, threads: ThreadPoolExecutor, gate: asyncio.Semaphore, target: ProofTarget
    ) -> bool:
        """Ask one URL for its record; True when it proved to be served by one of its claimants."""
        s, loop = self.settings, asyncio.get_running_loop()
        async with gate:
            try:
                async with asyncio.timeout(s.timeout_s + DEADLINE_GRACE_S):
                    raw = await loop.run_in_executor(
                        threads,
                        fetch_document,
                        pool,
                        target.url,
                        availability_probe_path(target.step),
                        MAX_AVAILABILITY_BYTES,
                        s.timeout_s,
                    )
            except TimeoutError:
                return self._failed(target, f"sent no answer within {s.timeout_s:.1f} s")
            except (
                ManifestError
            ) as exc:  # 404/503, an HTTP error, a refused or cut connection, too many bytes
                return self._failed(target, str(exc))
        try:
            record = verify_signed_record(raw, signers=target.claimants)
            if record.step != target.step:
                raise AvailabilityError(
                    f"availability record is about step {record.step}, not the step {target.step} asked for",
                    corrupt=True,
                )
            check_current(record)
        except StaleAvailability as exc:  # a clock behind ours: no lie, nothing proven; asked again later
            logger.debug("weights URL %s: %s; asked again later", target.url, exc.reason)
            return False
        except AvailabilityError as exc:
            return self._failed(target, exc.reason)
        self._held.pop(target.url, None)
        self.on_proven(target.url, record.node_id)
        logger.debug("weights URL %s proved to be served by node %s…", target.url, record.node_id[:16])
        return True

    def _failed(self, target: ProofTarget, why: str) -> bool:
        _remember(self._held, target.url, self._clock() + self.settings.hold_s)
        logger.info(
            "weights URL %s (named by %s) is not drawn for %.0f s: asked for its signed availability record: %s",
            target.url,
            ", ".join(f"{n[:16]}…" for n in sorted(target.claimants)[:3]),
            self.settings.hold_s,
            why,
        )
        return False


def _remember(kept: dict[str, float], url: str, value: float) -> None:
    """Set `kept[url]`, newest last, forgetting the oldest beyond MAX_URLS_KEPT."""
    kept.pop(url, None)
    kept[url] = value
    if len(kept) > MAX_URLS_KEPT:
        del kept[next(iter(kept))]
