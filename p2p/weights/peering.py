"""What each source holds while a fetch runs: signed availability records, and peers that do not hold it yet.

A shard run (shardrun.py) starts one `Peering` task. For each usable source it keeps one availability request
in flight (GET /v1/weights/{step}/availability?after=N, which the server answers once it holds more than N
shards, or after its long-poll time), at most one every `availability_interval_s`, and folds each verified
record into the source's state (sources.py) and the rarest-first counts (rarest.py):

  * a record that verifies: the source is asked only for the shards it claims; an older record than one
    already taken (a replay, or answers out of order) is ignored;
  * 404/503: the source signs no records (an origin, a relay without an identity), so it is taken to hold
    every shard, as before availability existed; but a peer the swarm advertised (`SourceState.claimants`: the
    node ids whose heartbeats name its URL) is never taken on its word: until a current record signed by one
    of those node ids verifies it claims nothing and is asked again, and a record signed by any other key is a
    lie;
  * a record that does not verify, is about another manifest, is malformed or is dated in the future beyond
    the clock skew tolerated: a lie; the source is demoted (`record_lie`), claims nothing from then on, and
    is not polled again in this fetch;
  * a validly signed record that is stale (older than availability.MAX_AGE_S: the node's clock runs behind,
    or the answer came late): like a network failure, nothing is concluded and nothing charged; it is not
    taken (a replayed record cannot revive claims) and the source is asked again later;
  * a network failure: nothing is concluded; it is asked again later.

A source that answers a shard request with a version-level 404 ("no such version": it dropped or pruned the
version since its last record) is `withdrawn`: its claims are cleared at once and it is asked again at once;
an answer to a request made before the withdrawal is ignored, so a record signed just before it cannot bring
the void claims back.

A server that several node ids name (a peer naming another node's server as its own, or a heartbeat still
naming an address its node has left to another) is bound by its own answers: the first current record it
serves that verifies under one claimant's id binds it to that node for the rest of the fetch, and the others
are reported (`disproved`, claims.py) and gain nothing. A stale record binds nothing (a replay proves nothing
about who serves there now). A bound server that later serves a record of another claimant has lied, as with
any other key: an honest node's server signs only with its own, so whoever runs it holds or relays both ids'
records, and switching the binding would let it disown a claim each time one was caught. That costs the
server this fetch; the next fetch binds afresh (a server that changed hands between two fetches is no liar).

Sources that did not hold the version when the fetch chose its manifest (404/503: a peer still fetching
it, which advertises it in its heartbeat as soon as it holds the manifest) are asked for the manifest again
every `availability_interval_s`; the shard run admits them when it is the manifest being fetched.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .availability import MAX_AVAILABILITY_BYTES, AvailabilityError, StaleAvailability, parse_availability
from .claims import Disproved
from .connections import ConnectionPool
from .errors import ManifestAbsent, ManifestError
from .fetch_settings import FetchSettings
from .manifest import SignedManifest
from .rarest import ShardQueue
from .sources import SourcePool, SourceState
from .transfer import fetch_document

logger = logging.getLogger(__name__)

MAX_POLL_THREADS = 32


def availability_path(step: int, after: int) -> str:
    return f"/v1/weights/{step}/availability?after={after}"


class Peering:
    """Availability records and absent sources of one shard run; see the module docstring."""

    def __init__(
        self,
        settings: FetchSettings,
        connections: ConnectionPool,
        manifest: SignedManifest,
        pool: SourcePool,
        queue: ShardQueue,
        *,
        absent: set[str],
        ask_manifest: Callable[[str], asyncio.Task[SignedManifest]] | None,
        on_change: Callable[[], None],
        on_join: Callable[[str, asyncio.Task[SignedManifest]], None],
    ) -> None:
        self.settings = settings
        self.connections = connections
        self.manifest = manifest
        self.pool = pool
        self.queue = queue
        self.absent = set(absent)  # sources without the version: asked for the manifest again
        self.ask_manifest = ask_manifest
        self.on_change = on_change
        self.on_join = on_join
        self.distrusted: set[str] = set()
        self.unsigned: set[str] = set()  # advertised peers that answered without a record they signed
        self.disproved: list[Disproved] = []  # contested servers bound to one claimant: the others' claims
        self._polls: dict[str, asyncio.Future[bytes]] = {}
        self._next_poll: dict[str, float] = {}
        # Withdrawals seen per source (`withdrawn`): an answer to a request sent before the latest is ignored.
        self._epoch: dict[str, int] = {}
        if settings.availability_interval_s <= 0:
            for source in pool.sources.values():
                if source.advertised:  # a peer is used only on a record it signed: none is asked for
                    pool.exclude(
                        source.url, "a peer is used only once its signed availability record verified"
                    )
                else:
                    source.records = False  # never asked: taken to hold every shard its manifest lists
        self._threads = ThreadPoolExecutor(
            max_workers=min(MAX_POLL_THREADS, max(1, len(pool.sources))), thread_name_prefix="weights-avail"
        )

    def close(self) -> None:
        self._threads.shutdown(wait=False)  # requests in flight end with the fetch's connection abort

    def lacking(self, index: int) -> set[str]:
        """Usable sources that must not be asked for shard `index`: their records do not claim it (or have
        not arrived yet)."""
        return {s.url for s in self.pool.usable() if not s.holds(index)}

    def first_record_due(self) -> bool:
        """Whether an advertised peer has not answered its first availability request yet: a fetch with nothing
        else left waits for it (one round trip), but not for a peer that answered without a signed record."""
        return any(
            s.advertised and s.records is None and s.url not in self.distrusted | self.unsigned
            for s in self.pool.usable()
        )

    def unknown(self) -> bool:
        """Whether some usable source has not answered its first availability request yet."""
        return any(s.records is None and s.url not in self.distrusted for s in self.pool.usable())

    def drop(self, source: SourceState) -> None:
        """The source is out of this fetch (a peer that sent bytes not matching the manifest): it claims nothing
        from now on and is not polled again."""
        self.distrusted.add(source.url)
        self._claim(source, frozenset())

    def withdrawn(self, source: SourceState) -> None:
        """The source answered a shard request with "no such version": whatever it claimed is void (it dropped
        or pruned the version, which is no lie). It claims nothing until a record it signs after this says
        otherwise, and is asked again at once."""
        self._epoch[source.url] = self._epoch.get(source.url, 0) + 1
        self._next_poll[source.url] = 0.0
        self._claim(source, frozenset())

    def absent_again(self, url: str) -> None:
        """A late manifest request found the source without the version: ask it again later."""
        if self.ask_manifest is not None:
            self.absent.add(url)
            self._next_poll[url] = time.monotonic() + self.settings.availability_interval_s

    async def run(self) -> None:
        interval = self.settings.availability_interval_s
        if interval <= 0:
            return
        loop = asyncio.get_running_loop()
        while True:
            now = time.monotonic()
            for source in self.pool.usable():
                url = source.url
                if url in self._polls or url in self.distrusted or source.records is False:
                    continue
                if self._next_poll.get(url, 0.0) > now:
                    continue
                self._next_poll[url] = now + interval
                after = len(source.have) if source.have is not None else -1
                future = loop.run_in_executor(
                    self._threads,
                    fetch_document,
                    self.connections,
                    url,
                    availability_path(self.manifest.step, after),
                    MAX_AVAILABILITY_BYTES,
                    self.settings.manifest_timeout_s,
                )
                self._polls[url] = future
                future.add_done_callback(functools.partial(self._answered, source, self._epoch.get(url, 0)))
            if self.ask_manifest is not None:
                for url in [u for u in self.absent if self._next_poll.get(u, 0.0) <= now]:
                    self.absent.discard(url)
                    self._next_poll[url] = now + interval
                    self.on_join(url, self.ask_manifest(url))
            await asyncio.sleep(interval / 2)

    def _answered(self, source: SourceState, epoch: int, future: asyncio.Future[bytes]) -> None:
        self._polls.pop(source.url, None)
        if future.cancelled():
            return
        if epoch != self._epoch.get(source.url, 0):
            return  # asked before the source withdrew the version; the next request is due at once
        error = future.exception()
        if isinstance(error, ManifestAbsent):
            if source.advertised and not source.records:
                logger.debug("availability of peer %s: %s; asked again", source.url, error)
                self.unsigned.add(source.url)
                return  # a peer without a signed record holds nothing we may ask for (yet)
            if source.records is None:
                source.records = False  # it signs no records: it holds what its manifest lists
                self.on_change()
            elif source.records:  # it signed records and no longer holds the version: claims nothing now
                self._claim(source, frozenset())
            return
        if isinstance(error, ManifestError):  # a network failure: nothing is concluded, it is asked again
            logger.debug("availability of %s: %s", source.url, error)
            return
        if error is not None:  # not the source's doing: a bug of ours, reported, and the source asked again
            logger.error("availability of %s: unexpected %s: %s", source.url, type(error).__name__, error)
            return
        try:
            # An advertised peer's record must be signed by a node the swarm named for it (the one it is bound to,
            # once bound), not by any valid key: a host that answers for another node's URL cannot make itself a
            # source, and a peer that names another node's server cannot have that node's records judged as lies.
            record, have = parse_availability(future.result(), self.manifest, signers=source.signers())
        except StaleAvailability as exc:
            # Validly signed but old: a clock behind ours, or a late answer. Not taken, not charged, asked again.
            logger.info("source %s: %s; ignored, asked again", source.url, exc.reason)
            if source.advertised and not source.records:
                # It answered, without a current record: a fetch does not wait on it (`first_record_due`).
                self.unsigned.add(source.url)
            return
        except AvailabilityError as exc:
            self.distrusted.add(source.url)
            self._claim(source, frozenset())
            self.pool.record_lie(source, f"availability record: {exc.reason}")
            logger.warning("source %s: availability record refused: %s", source.url, exc.reason)
            return
        if source.node_id is None and source.advertised:
            self._bind(source, record.node_id)
        if record.issued_at_ms <= source.record_ms:
            return  # older than one already taken
        source.record_ms = record.issued_at_ms
        self._claim(source, have)

    def _bind(self, source: SourceState, owner: str) -> None:
        """A contested server served a current record of `owner`, one of its claimants: it is that node's."""
        source.node_id = owner
        others = source.claimants - {owner}
        self.disproved.append(Disproved(source.url, owner, others))
        logger.debug(
            "server %s proved to be node %s… (its current signed record); also named by %s",
            source.url,
            owner[:16],
            ", ".join(f"{n[:16]}…" for n in sorted(others)),
        )

    def _claim(self, source: SourceState, have: frozenset[int]) -> None:
        self.unsigned.discard(source.url)
        self.queue.claims_changed(source.have if source.records else None, have)
        source.records = True
        source.have = have
        self.on_change()
