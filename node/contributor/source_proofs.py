"""Dial-back proofs of which node serves at a peer's weights URL, on hosts where more URLs are named than drawn.

Why: a heartbeat names one weights URL, on one of the addresses the same heartbeat lists as the peer's own,
and both are the peer's claims. Sybils (an id costs a key pair) that list an honest node's IP as theirs and
name other ports or paths there dilute that host's share of each fetch (serving.py `sources_for` draws hosts,
then up to MAX_URLS_PER_HOST URLs of each): with k false URLs the honest server is drawn with probability
3 / (k + 1) until this node has once fetched from it. Drawing among claimant ids first and then among the URLs
each names would not help: one heartbeat names one URL, so k false URLs are k ids already.

What this does: on a contested host (one naming more URLs than a fetch draws of it) the node asks each URL it
has not proven, in the background and under the bounds below, for the availability record of a step
(GET /v1/weights/{step}/availability, no long poll). Each node id naming the URL (a claimant) is asked about
its own newest step (within the step this node knows to be announced, when it names one: serving.py
`proof_targets`), never a step another claimant named: a sybil that names an honest node's very URL with steps
the honest server does not serve would otherwise get it answered 404 and held out, again at each re-ask. The
answer is the record every fetch verifies (p2p/weights/availability.py `verify_signed_record`,
`check_current`: the same code), so it proves which node serves there, and nothing on the honest host signs as
a sybil:

  * a current record of the step asked, signed by any of the URL's claimants: proven (`on_proven`, serving.py
    `note_proven`), so the next fetch draws it first on its host;
  * an answer that is not one (404 or another HTTP error, an oversized answer, a record of another key or
    another step, malformed, or dated in the future): that step failed for `hold_s`. The URL is held out of
    the draw only once the step of every claimant failed: one claimant's failure proves nothing of another's;
  * no answer (no head within the deadline, a refused, reset or cut connection, a 503 "not now"): the URL is
    held out, whoever claims it (no claimant's step can be asked there now), but briefly: `unanswered_hold_s`,
    doubled at each such probe in a row up to `hold_s`, so an honest server's restart costs it about a minute
    and a closed port soon the full hold;
  * a validly signed record of a claimant that is stale (a clock behind ours): nothing concluded, asked again
    in a later window.

Bounds, because each probe is a request this node sends where a peer told it to (the probing must not become a
way to make the swarm flood some address): only URLs that passed `peer_url_refusal` (the IP is one its heartbeat
lists as its own, and public unless the operator lists its network), only on contested hosts, at most
`per_host` probes per host and `per_window` in all per `window_s`, `concurrency` at once, each one request for
at most MAX_AVAILABILITY_BYTES under a `timeout_s` wall-clock deadline (connect included), and each URL at most
once per window (not while it is held out). However many URLs sybils name on a victim's address, a node sends
it at most `per_host` small requests per window: about what one fetch that draws the host sends. The global
budget goes first to hosts where a URL was proven before (a sybil cannot fake that), then to hosts naming the
announced step (the one the next fetch draws sources for; a sybil can name it too), then at random.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar
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
from ...p2p.weights.errors import ManifestAbsent, ManifestError, SourceUnreachable
from ...p2p.weights.transfer import fetch_document

logger = logging.getLogger(__name__)
V = TypeVar("V")

# URLs remembered as held out, asked this window, or with failed steps: a bound on what sybils naming URLs can
# make a node keep.
MAX_URLS_KEPT = 4096
# Failed steps remembered per URL (one is asked per window, and each is forgotten after `hold_s`).
MAX_FAILED_STEPS_KEPT = 64
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
        600.0,
        gt=0,
        le=86400,
        description="How long a step a URL answered wrongly counts as failed (and the URL is not drawn once "
        "every claimant's step failed); the longest hold of an unanswering URL.",
    )
    unanswered_hold_s: float = Field(
        60.0,
        gt=0,
        le=86400,
        description="How long a URL that gave no answer is not drawn, doubled at each such probe in a row "
        "(at most hold_s).",
    )
    interval_s: float = Field(15.0, gt=0, le=3600, description="How often to look for URLs to prove unwoken.")


@dataclass(frozen=True)
class ProofTarget:
    """A peer URL that may be probed: the node ids naming it, and the steps to ask it about, one per claimant
    (its own newest within the announced step, else its newest), in the order they are asked."""

    url: str
    claimants: frozenset[str]
    steps: tuple[int, ...]
    urgent: bool = False  # a claimant serves the announced step: the one the next fetch draws sources for


@dataclass(frozen=True)
class Probe:
    """One request due: `target`'s URL asked for its record of `step`."""

    target: ProofTarget
    step: int

    @property
    def url(self) -> str:
        return self.target.url


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
        # Probes carry an access token as a fetch's requests do (a server that refuses banned nodes sees who
        # asks), from a TokenSource made per round: it caches one token per host:port, and sybils name new ones.
        self.identity = identity
        self._clock = clock
        self._rng = rng or random.Random()
        self._held: dict[str, float] = {}  # URL -> clock time until which it is not drawn
        self._asked: dict[str, float] = {}  # URL -> clock time of its last probe
        self._failed: dict[
            str, dict[int, float]
        ] = {}  # URL -> {step: clock time until which it counts failed}
        self._unanswered: dict[str, int] = {}  # URL -> probes in a row that got no answer
        self._window_start = -float("inf")
        self.window_probes: Counter[str] = Counter()  # host -> probes sent in the current window
        self.sent = 0  # probes sent in all (status, tests)
        self._wake = asyncio.Event()

    def held_out(self, url: str) -> bool:
        """Whether `url` is not drawn for a fetch now: no answer came from it lately, or every claimant's step
        failed there."""
        until = self._held.get(url)
        return until is not None and until > self._clock()

    def wake(self) -> None:
        """The peers changed (serving.py `note_peers`): look for URLs to prove now, not at the next interval."""
        self._wake.set()

    def due(
        self, targets: list[ProofTarget], proven: set[str], favoured: Collection[str] = ()
    ) -> list[Probe]:
        """The probes to send now, within this window's budgets: unproven URLs of contested hosts, neither held
        out nor asked this window, each about its next step not failed. Hosts in `favoured` (where a URL was
        proven before) come first, then hosts with an `urgent` URL, then the rest, in random order within each
        (nothing before a proof tells an honest URL from a sybil's, so no order a sybil can choose), and URLs
        in random order within each host."""
        now = self._clock()
        if now - self._window_start >= self.settings.window_s:
            self._window_start = now
            self.window_probes.clear()
        by_host: dict[str, list[ProofTarget]] = {}
        for target in sorted(targets, key=lambda t: t.url):
            by_host.setdefault(urlsplit(target.url).hostname or "", []).append(target)
        left = self.settings.per_window - sum(self.window_probes.values())
        chosen: list[Probe] = []
        hosts = sorted(by_host)
        self._rng.shuffle(hosts)  # the global budget must not always favour the same hosts
        hosts.sort(key=lambda h: (h not in favoured, not any(t.urgent for t in by_host[h])))  # stable
        for host in hosts:
            named = by_host[host]
            if len(named) <= self.slots_per_host:
                continue  # every URL of the host is drawn anyway: a proof would change nothing
            candidates = [
                Probe(t, step)
                for t in named
                if t.url not in proven
                and not self.held_out(t.url)
                and now - self._asked.get(t.url, -float("inf")) >= self.settings.window_s
                and (step := self._next_step(t, now)) is not None
            ]
            self._rng.shuffle(candidates)
            take = min(len(candidates), self.settings.per_host - self.window_probes[host], left)
            if take <= 0:
                continue
            chosen += candidates[:take]
            self.window_probes[host] += take
            left -= take
        for probe in chosen:
            _remember(self._asked, probe.url, now)
        self.sent += len(chosen)
        return chosen

    def _next_step(self, target: ProofTarget, now: float) -> int | None:
        """The first of the target's steps whose probe did not fail lately (None: all did, or it names none)."""
        failed = self._failed.get(target.url, {})
        return next((s for s in target.steps if failed.get(s, -float("inf")) <= now), None)

    async def prove(
        self, targets: list[ProofTarget], proven: set[str], favoured: Collection[str] = ()
    ) -> int:
        """Send the probes due now and apply their answers; returns how many URLs they proved."""
        plan = self.due(targets, proven, favoured)
        if not plan:
            return 0
        s = self.settings
        auth = TokenSource(self.identity) if self.identity is not None else None
        pool = ConnectionPool(s.timeout_s, s.timeout_s, auth)
        threads = ThreadPoolExecutor(
            max_workers=min(s.concurrency, len(plan)), thread_name_prefix="weights-proof"
        )
        gate = asyncio.Semaphore(s.concurrency)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(
                        self._probe(pool, threads, gate, probe), name=f"weights-proof {probe.url}"
                    )
                    for probe in plan
                ]
        finally:
            pool.abort()  # a thread still blocked on a socket returns at once (cancellation, a missed deadline)
            pool.close()
            threads.shutdown(wait=False)
        return sum(task.result() for task in tasks)

    async def run(self, targets: Callable[[], tuple[list[ProofTarget], set[str], Collection[str]]]) -> None:
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
        self, pool: ConnectionPool, threads: ThreadPoolExecutor, gate: asyncio.Semaphore, probe: Probe
    ) -> bool:
        """Ask one URL for its record of one step; True when it proved to be served by one of its claimants."""
        s, loop, target = self.settings, asyncio.get_running_loop(), probe.target
        async with gate:
            try:
                async with asyncio.timeout(s.timeout_s + DEADLINE_GRACE_S):
                    raw = await loop.run_in_executor(
                        threads,
                        fetch_document,
                        pool,
                        target.url,
                        availability_probe_path(probe.step),
                        MAX_AVAILABILITY_BYTES,
                        s.timeout_s,
                    )
            except TimeoutError:
                return self._unanswered_by(target, f"sent no answer within {s.timeout_s:.1f} s")
            except ManifestError as exc:
                if isinstance(exc, SourceUnreachable) or (
                    isinstance(exc, ManifestAbsent) and exc.status == 503
                ):
                    return self._unanswered_by(target, str(exc))  # no answer, or "not now" (busy, unverified)
                return self._failed_step(
                    probe, str(exc)
                )  # 404 for the step, another HTTP error, too many bytes
        try:
            record = verify_signed_record(raw, signers=target.claimants)
            if record.step != probe.step:
                raise AvailabilityError(
                    f"availability record is about step {record.step}, not the step {probe.step} asked for",
                    corrupt=True,
                )
            check_current(record)
        except StaleAvailability as exc:  # a clock behind ours: no lie, nothing proven; asked again later
            logger.debug("weights URL %s: %s; asked again later", target.url, exc.reason)
            return False
        except AvailabilityError as exc:
            return self._failed_step(probe, exc.reason)
        self._held.pop(target.url, None)
        self._failed.pop(target.url, None)
        self._unanswered.pop(target.url, None)
        self.on_proven(target.url, record.node_id)
        logger.debug("weights URL %s proved to be served by node %s…", target.url, record.node_id[:16])
        return True

    def _unanswered_by(self, target: ProofTarget, why: str) -> bool:
        """No answer: held out briefly, longer at each such probe in a row (a restart ends; a closed port not)."""
        s = self.settings
        times = self._unanswered.pop(target.url, 0) + 1
        _remember(self._unanswered, target.url, times)
        hold = min(s.unanswered_hold_s * 2 ** min(times - 1, 32), s.hold_s)
        _remember(self._held, target.url, self._clock() + hold)
        logger.info(
            "weights URL %s (named by %s) is not drawn for %.0f s: asked for its signed availability record, "
            "it gave no answer (%d in a row): %s",
            target.url,
            _ids(target.claimants),
            hold,
            times,
            why,
        )
        return False

    def _failed_step(self, probe: Probe, why: str) -> bool:
        """The URL answered for `probe.step`, but not as a claimant serving it: that step counts failed for
        `hold_s`; the URL is held out once every claimant's step failed (one claimant's failure proves nothing
        of another's: a sybil may name the honest node's URL with steps it does not serve)."""
        now, target = self._clock(), probe.target
        self._unanswered.pop(target.url, None)  # it answered
        failed = {s: until for s, until in self._failed.pop(target.url, {}).items() if until > now}
        failed[probe.step] = now + self.settings.hold_s
        while len(failed) > MAX_FAILED_STEPS_KEPT:
            del failed[min(failed, key=failed.__getitem__)]  # the one forgotten soonest anyway
        _remember(self._failed, target.url, failed)
        left = [s for s in target.steps if s not in failed]
        if left:
            logger.debug(
                "weights URL %s: step %d: %s; its other claimants' steps are still to ask: %s",
                target.url,
                probe.step,
                why,
                left[:4],
            )
            return False
        until = min(failed[s] for s in target.steps)
        _remember(self._held, target.url, until)
        logger.info(
            "weights URL %s (named by %s) is not drawn for %.0f s: asked for its signed availability record of "
            "each claimant's step, none served one (the last, step %d: %s)",
            target.url,
            _ids(target.claimants),
            until - now,
            probe.step,
            why,
        )
        return False


def _ids(node_ids: frozenset[str]) -> str:
    return ", ".join(f"{n[:16]}…" for n in sorted(node_ids)[:3])


def _remember(kept: dict[str, V], url: str, value: V) -> None:
    """Set `kept[url]`, newest last, forgetting the oldest beyond MAX_URLS_KEPT."""
    kept.pop(url, None)
    kept[url] = value
    if len(kept) > MAX_URLS_KEPT:
        del kept[next(iter(kept))]
