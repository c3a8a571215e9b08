"""The swarm's directory in the DHT: heartbeats, policy, validators, bans and rollout announcements.

Every record is signed and sealed (records.py) before it is stored, and every read returns only records
that pass the same checks the DHT validator applies; bad entries are logged and skipped, never raised.
Policies, validator announcements and bans may only be published by a pinned operator key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast, get_args

from hivemind.utils import MSGPackSerializer, get_dht_time

from ..identity import Identity
from .config import SwarmConfig
from .errors import RecordError, SwarmError
from .hardware import local_hardware, software_version
from .peer import DHTPeer
from .records import (
    Ban,
    GroupRecord,
    Hardware,
    Heartbeat,
    PolicyAnnouncement,
    RecordKind,
    Role,
    RolloutAnnouncement,
    RunParameters,
    StageAvailability,
    ValidatorAnnouncement,
    check_expiration,
    dht_key,
    key_id,
    open_record,
    seal,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SealedRecord:
    """A record as read, with what it was read from: the signed DHT value and its expiration time (with the
    record's subkey, what `open_record` checks again, e.g. after a restart from a copy on disk)."""

    body: Any
    value: bytes
    expiration: float


_LOOKUP_CACHE_S = 2.0  # how stale a peer/ban lookup made for an incoming hand-off may be


class SwarmDirectory(DHTPeer):
    def __init__(
        self,
        config: SwarmConfig,
        identity: Identity,
        *,
        roles: tuple[str, ...] = ("contributor",),
        hardware: Hardware | None = None,
    ) -> None:
        super().__init__(config, identity)
        unknown = [r for r in roles if r not in get_args(Role)]
        if unknown:
            raise SwarmError(f"unknown role(s) {unknown}; roles are {', '.join(get_args(Role))}")
        self.roles = [cast(Role, r) for r in roles]
        self.hardware = hardware or local_hardware()
        self.policy_step: int | None = None  # set by the node; published in the next heartbeat
        self.serves_steps: list[int] = []
        self.weights_url: str | None = None  # set by a node serving weights; published with serves_steps
        self.api_url: str | None = None  # set by a validator: its HTTP API, published in its announcement
        self.from_step = 0  # set by a validator: the first policy step it judges (p2p/swarm/routing.py)
        self.group_id: str | None = None  # set by a pipeline node: the group it confirms (node/pipeline/)
        self.left_group: str | None = None  # set by a pipeline node: a group it gave up (node/pipeline/)
        self._cache: dict[RecordKind, tuple[float, dict[str, Any]]] = {}

    async def join(self, *, heartbeat: bool = True) -> None:
        """Connect to the DHT; with `heartbeat`, start heartbeats at once (else call `start_heartbeats`)."""
        await self._connect()
        if heartbeat:
            await self.start_heartbeats()
        if self.client_mode:
            logger.info("joined swarm %r as %s in client mode", self.config.run_id, self.node_id[:16])
        else:
            logger.info(
                "joined swarm %r as %s; other nodes can use --peers %s",
                self.config.run_id,
                self.node_id[:16],
                " ".join(await self.maddrs()),
            )

    # ----- records ---------------------------------------------------------------------------------------

    async def _publish(self, kind: RecordKind, subkey: str, body: Any, ttl: float) -> bool:
        expiration = get_dht_time() + ttl
        value = seal(self.identity, self.config.run_id, kind, subkey, body, expiration)
        stored = await self._await(
            self._dht().store(
                dht_key(self.config.run_id, kind),
                value,
                expiration,
                subkey=subkey,
                beam_size=self.config.beam_size,
                return_future=True,
            )
        )
        self._cache.pop(kind, None)  # our own next read sees what we published (the assignment relies on it)
        if not stored:
            # Also the answer when peers hold a newer record under this subkey (a concurrent publish).
            logger.warning("no DHT peer stored this node's %s record (is the swarm reachable?)", kind.value)
        return bool(stored)

    async def _lookup(self, kind: RecordKind) -> dict[str, SealedRecord] | None:
        """Every live record of `kind` that passes the checks, with the signed value it came in; None when the DHT
        lookup found no table at all (nobody stores one, or the lookup reached nobody who does: a reader that
        must not take a miss for an answer, as the validator's group records, tells the two apart by retrying)."""
        found = await self._await(
            self._dht().get(
                dht_key(self.config.run_id, kind),
                latest=True,
                beam_size=self.config.beam_size,
                return_future=True,
            )
        )
        if found is None:
            return None
        if not isinstance(found.value, dict):
            logger.warning("skipping a %s entry that is not a table of signed records", kind.value)
            return {}
        kid, now, operators = (
            key_id(self.config.run_id, kind),
            get_dht_time(),
            frozenset(self.config.operator_keys),
        )
        records: dict[str, SealedRecord] = {}
        for subkey, item in found.value.items():
            try:
                # Finite first: a NaN expiration is not "< now", so it would never count as expired.
                if check_expiration(kind, item.expiration_time, now) < now:
                    continue
                body = open_record(
                    kind,
                    kid,
                    MSGPackSerializer.dumps(subkey),
                    item.value,
                    item.expiration_time,
                    operators,
                    now,
                )
            except (RecordError, TypeError, ValueError) as exc:
                logger.warning("skipping a bad %s record under subkey %.40r: %s", kind.value, subkey, exc)
                continue
            records[subkey] = SealedRecord(body, item.value, float(item.expiration_time))
        return records

    async def _read(self, kind: RecordKind) -> dict[str, Any]:
        """Every live record of `kind` that passes the checks, by subkey; {} when the lookup found none."""
        sealed = await self._lookup(kind)
        if sealed is None:
            return {}
        records = {subkey: s.body for subkey, s in sealed.items()}
        self._cache[kind] = (time.monotonic(), records)
        return records

    async def _read_cached(self, kind: RecordKind) -> dict[str, Any]:
        stamp, records = self._cache.get(kind, (0.0, {}))
        return records if time.monotonic() - stamp < _LOOKUP_CACHE_S else await self._read(kind)

    def _require_operator(self, what: str) -> None:
        if self.node_id not in self.config.operator_keys:
            raise SwarmError(
                f"only a pinned operator key may publish {what}; this node's key {self.node_id[:16]}… "
                f"is not in operator_keys"
            )

    async def publish_heartbeat(self) -> bool:
        addresses = [] if self.client_mode else (await self.maddrs())[:8]
        body = Heartbeat(
            node_id=self.node_id,
            peer_id=self.peer_id,
            version=software_version(),
            roles=self.roles,
            hardware=self.hardware,
            addresses=addresses,
            client_mode=self.client_mode,
            policy_step=self.policy_step,
            serves_steps=self.serves_steps[-16:],
            sent_at=time.time(),
            weights_url=self.weights_url if self.serves_steps else None,
            group=self.group_id,
            # Never the group it confirms (the record would be refused): that one it has not left.
            left_group=self.left_group if self.left_group != self.group_id else None,
        )
        return await self._publish(RecordKind.HEARTBEAT, self.node_id, body, self.config.heartbeat_ttl_s)

    async def start_heartbeats(self) -> None:
        """Publish the heartbeat now and every heartbeat_interval_s from now on (a supervised task)."""
        await self.publish_heartbeat()
        self._spawn("swarm-heartbeat", self.run_heartbeats())

    async def run_heartbeats(self) -> None:
        """Republish the heartbeat every heartbeat_interval_s; a failed round is logged and retried."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            try:
                await self.publish_heartbeat()
            except (OSError, EOFError, RecordError) as exc:  # DHT pipe trouble or a record we cannot build
                logger.warning("heartbeat not published: %s", exc)

    async def publish_policy(
        self, step: int, manifest_sha256: str, sources: list[str], run: RunParameters
    ) -> bool:
        self._require_operator("a policy")
        body = PolicyAnnouncement(
            step=step,
            manifest_sha256=manifest_sha256,
            sources=sources,
            published_at=time.time(),
            run=run,
            frozen=run.run_kind == "synthetic",  # a synthetic run's model never changes
        )
        return await self._publish(RecordKind.POLICY, self.node_id, body, self.config.record_ttl_s)

    async def publish_validator(self, announcement: ValidatorAnnouncement | None = None) -> bool:
        """Announce a validator (this node when None): operator-signed, so only the operator can add one."""
        self._require_operator("a validator announcement")
        if announcement is None:
            announcement = ValidatorAnnouncement(
                node_id=self.node_id,
                peer_id=self.peer_id,
                addresses=(await self.maddrs())[:8],
                max_rollout_bytes=self.config.max_rollout_bytes,
                published_at=time.time(),
                api_url=self.api_url,
                from_step=self.from_step,
            )
        return await self._publish(
            RecordKind.VALIDATOR, announcement.node_id, announcement, self.config.record_ttl_s
        )

    async def publish_ban(self, node_id: str, reason: str, ttl_s: float | None = None) -> bool:
        """Publish a ban record for `ttl_s` seconds (at most ban_ttl_s); republish to extend it."""
        self._require_operator("a ban")
        body = Ban.outgoing(node_id=node_id, reason=reason, banned_at=time.time())  # reason made printable
        ttl = self.config.ban_ttl_s if ttl_s is None else min(ttl_s, self.config.ban_ttl_s)
        return await self._publish(RecordKind.BAN, node_id, body, ttl)

    async def announce_rollout(self, sha256: str, size_bytes: int, step: int, samples: int) -> bool:
        body = RolloutAnnouncement(
            node_id=self.node_id,
            sha256=sha256,
            size_bytes=size_bytes,
            step=step,
            samples=samples,
            announced_at=time.time(),
        )
        return await self._publish(
            RecordKind.ROLLOUT, f"{self.node_id}:{sha256}", body, self.config.record_ttl_s
        )

    async def publish_stages(self, availability: StageAvailability) -> bool:
        """Offer pipeline stages (group_records.py); lives as long as a heartbeat, so republish with it."""
        return await self._publish(RecordKind.STAGES, self.node_id, availability, self.config.heartbeat_ttl_s)

    async def list_stages(self) -> dict[str, StageAvailability]:
        return await self._read(RecordKind.STAGES)

    async def publish_group(self, group: GroupRecord) -> bool:
        """Sign a group record (operator only): the named members start their stages when they read it."""
        self._require_operator("a group record")
        return await self._publish(RecordKind.GROUP, group.group_id, group, self.config.record_ttl_s)

    async def list_groups(self) -> dict[str, GroupRecord]:
        return await self._read(RecordKind.GROUP)

    async def read_group_records(self) -> dict[str, SealedRecord] | None:
        """The live group records with their signed values (a validator keeps those, trainer/validator/
        formed_groups.py); None when the lookup found no table at all, which a single read cannot tell from a
        lookup that missed the peers holding it."""
        return await self._lookup(RecordKind.GROUP)

    async def list_peers(self) -> dict[str, Heartbeat]:
        """Live nodes by node id (heartbeats that have not expired), this one included."""
        return await self._read(RecordKind.HEARTBEAT)

    async def list_validators(self) -> dict[str, ValidatorAnnouncement]:
        return await self._read(RecordKind.VALIDATOR)

    async def live_validators(self, *, fresh: bool = False) -> dict[str, ValidatorAnnouncement]:
        """Announced validators whose own heartbeat is live: the set work is assigned over (routing.py).

        A validator that stopped drops out when its heartbeat expires (`heartbeat_ttl_s`), long before its
        announcement would (`record_ttl_s`), so the work it would have judged moves on in about a minute.
        Reads may be `_LOOKUP_CACHE_S` old unless `fresh`."""
        read = self._read if fresh else self._read_cached
        validators = await read(RecordKind.VALIDATOR)
        heartbeats = await read(RecordKind.HEARTBEAT)
        return {node_id: v for node_id, v in validators.items() if node_id in heartbeats}

    async def read_bans(self) -> dict[str, Ban]:
        return await self._read(RecordKind.BAN)

    async def list_rollouts(self) -> dict[str, RolloutAnnouncement]:
        return await self._read(RecordKind.ROLLOUT)

    async def list_policies(self) -> dict[str, PolicyAnnouncement]:
        """The live policy announcement of each pinned operator key that has one, by that key."""
        return await self._read(RecordKind.POLICY)

    async def current_policy(self) -> PolicyAnnouncement | None:
        """The newest policy announced by any pinned operator key, or None."""
        policies = list((await self.list_policies()).values())
        return max(policies, key=lambda p: (p.step, p.published_at)) if policies else None

    async def watch_policy(self) -> AsyncIterator[PolicyAnnouncement]:
        """Yield each newer policy as it appears (polling every policy_poll_s), and the current step again when
        it is re-announced with other run parameters (an operator who restarted the trainer with a changed
        [run] section): readers check those on every policy they get (node/run/announcement.py)."""
        last: PolicyAnnouncement | None = None
        while True:
            try:
                policy = await self.current_policy()
            except (OSError, EOFError) as exc:
                logger.warning("policy lookup failed: %s", exc)
                policy = None
            if policy is not None and (
                last is None
                or policy.step > last.step
                or (policy.step == last.step and policy.run != last.run)
            ):
                last = policy
                yield policy
            await asyncio.sleep(self.config.policy_poll_s)
