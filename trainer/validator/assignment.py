"""The validator judges only the batches assigned to it, so the swarm credits each piece of work at most once.

Every batch (run, node, policy step, batch counter) has one owner among the live announced validators
(p2p/swarm/routing.py). The hand-off header is a v2 signature envelope that signs the batch, so the owner is
known before a byte of the body is read, and this gate runs first in the validator's admission:

- a v1 envelope (no batch) is refused, final: nothing tells where it belongs (nodes of this version never
  send one; files already receipted before the upgrade are judged as before);
- a batch owned by another validator in this validator's view is answered busy, naming the owner, and costs
  the sender a token of its rate bucket here (trainer/validator/intake.py), the price of any admitted file:
  a node that sprays copies at validators that do not own them gains nothing (the body is never read) and
  slows its own work at those validators. Not a fault: an honest node's view may lag a departure by a few
  seconds, and a header is no evidence of a second copy anywhere; such a node pays one token and routes again;
- the rows must be the batch the envelope signs (`signer`, fraud: proofs/rollout_file.py check_signer and
  verify_job.py), so a node cannot route a batch by the name of another.

Ownership is decided at the header, once: a file this validator has acknowledged is judged here whatever
joins or leaves afterwards (the receipt is its promise), and the node never sends it anywhere else.

`from_step` is the first policy step this validator takes (`first_step`). It never gives a validator a batch
another one may already have judged:
- first start: 0 in a swarm without a policy yet, otherwise two steps past the newest announced one, so that
  every peer reads its announcement before work of that step can exist;
- restart while still in the swarm (its announcement and its own heartbeat still live in the DHT, with
  `PRESENCE_MARGIN_S` to spare): the `from_step` it is announced with, unchanged: nothing has moved;
- restart after an absence (its heartbeat expired, so every peer routed its batches to their runners-up):
  chosen again, as at a first start and never lower than before. The batches that moved while it was away
  stay where they went; it takes work only of steps that do not exist yet (when it is the only validator,
  routing.py's fallback gives it every step anyway, so an absence strands nothing).
It is kept in `<data-dir>/assignment.json` (per run).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

from ...node.runtime.durable import fsync_path
from ...p2p.errors import P2PError
from ...p2p.rate_limit import TokenBuckets
from ...p2p.swarm import HandoffBusy, HandoffRefused, RolloutEnvelope, Swarm
from ...p2p.swarm.handoff import SIG_FORMAT
from ..errors import TrainerError

logger = logging.getLogger(__name__)

FILE_NAME = "assignment.json"
JOIN_MARGIN_STEPS = 2  # a (re)joining validator takes work from this many steps past the newest announced one
MISROUTED_RETRY_S = 2.0  # about how stale a peer's view of the validators may be (directory._LOOKUP_CACHE_S)
PRESENCE_MARGIN_S = 5.0  # a heartbeat this close to expiring may lapse in peers' views before the next one
_LOOKUP_ATTEMPTS = 5
_LOOKUP_RETRY_S = 2.0
_MAX_FILE_BYTES = 4096


def next_first_step(kept: int | None, announced: int | None, newest_policy: int | None) -> int:
    """`from_step` from what this validator kept (None: nothing for this run), the one it is still announced
    and live with (None: absent, or never announced) and the newest announced policy step (None: none yet)."""
    if announced is not None:
        return announced  # still in every peer's view: its batches have not moved
    fresh = 0 if newest_policy is None else newest_policy + JOIN_MARGIN_STEPS
    return max(fresh, kept or 0)


def load_kept(data_dir: Path, run_id: str) -> int | None:
    """The `from_step` kept for `run_id`, or None (none, another run's, or a damaged file). Blocking."""
    path = data_dir / FILE_NAME
    try:
        with path.open("rb") as file:
            kept = json.loads(file.read(_MAX_FILE_BYTES))
        if kept["run_id"] == run_id and type(kept["from_step"]) is int and kept["from_step"] >= 0:
            return kept["from_step"]
        logger.info("%s is for run %r: choosing a first step for run %r", path, kept.get("run_id"), run_id)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # our own file, damaged
        logger.warning("ignoring %s: %s", path, exc)
    return None


def keep(data_dir: Path, run_id: str, from_step: int) -> None:
    """Write `from_step` durably (temporary file, fsync, rename, fsync of the directory). Blocking."""
    path = data_dir / FILE_NAME
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{FILE_NAME}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"run_id": run_id, "from_step": from_step}))
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(data_dir)


async def first_step(swarm: Swarm, data_dir: Path, run_id: str) -> int:
    """This validator's `from_step` (the module docstring), kept on disk before it is announced.

    Call it after joining the DHT and before the first heartbeat: the check of its presence reads the
    heartbeat of its previous run. TrainerError when the DHT cannot be read: a guess could take back batches
    another validator judged.
    """
    for attempt in range(1, _LOOKUP_ATTEMPTS + 1):
        try:
            validators, peers = await swarm.list_validators(), await swarm.list_peers()
            policy = await swarm.current_policy()
            break
        except (OSError, EOFError, P2PError) as exc:
            if attempt == _LOOKUP_ATTEMPTS:
                raise TrainerError(
                    f"cannot read the validators and the policy from the DHT ({exc}), so the first policy "
                    "step whose work this validator takes cannot be chosen safely; check --peers and retry"
                ) from exc
            logger.warning("DHT lookup failed (%s); trying again in %.0f s", exc, _LOOKUP_RETRY_S)
            await asyncio.sleep(_LOOKUP_RETRY_S)
    ours, heartbeat = validators.get(swarm.node_id), peers.get(swarm.node_id)
    left_s = heartbeat.sent_at + swarm.config.heartbeat_ttl_s - time.time() if heartbeat is not None else 0.0
    announced = ours.from_step if ours is not None and left_s > PRESENCE_MARGIN_S else None
    kept = await asyncio.to_thread(load_kept, data_dir, run_id)
    step = next_first_step(kept, announced, policy.step if policy is not None else None)
    if step != kept:
        await asyncio.to_thread(keep, data_dir, run_id, step)
    if kept is not None and announced is None and step != kept:
        logger.info(
            "this validator was out of the swarm long enough for its batches to move: it takes work from "
            "policy step %d on (was %d)",
            step,
            kept,
        )
    return step


class AssignmentGate:
    """Checks each hand-off header against the swarm's assignment of its batch (the module docstring)."""

    def __init__(self, swarm: Swarm, limiter: TokenBuckets) -> None:
        self.swarm = swarm
        self.limiter = limiter  # the admission's token buckets: a misrouted header spends one
        self.misrouted = 0  # headers answered busy for belonging to another validator (tests read it)

    async def check(self, header: RolloutEnvelope) -> None:
        """HandoffRefused for a v1 envelope, HandoffBusy for a batch another validator owns; None when ours."""
        if header.batch is None:
            raise HandoffRefused(
                f"envelope format {header.format} names no batch, so no validator can tell whether the work is "
                f"its own; this validator takes {SIG_FORMAT} (upgrade the node and sign the file again)"
            )
        batch = header.routed_as  # a stage file goes by its group (p2p/swarm/routing.py)
        assert batch is not None  # a batch is signed (checked above)
        owner = await self.swarm.owner_of(batch)
        if owner is not None and owner.node_id == self.swarm.node_id:
            return
        self.misrouted += 1
        wait = self.limiter.take(header.node_id)  # the cost: as much of its rate here as a file
        where = (
            f"validator {owner.node_id[:16]}… judges it"
            if owner is not None
            else "no live validator takes its step in this validator's view"
        )
        raise HandoffBusy(
            f"not assigned here: {batch.describe()} is not this validator's to judge ({where}); route it "
            "again with a fresh view of the validators (each misrouted header costs a token of this node's "
            "rate limit here)",
            max(MISROUTED_RETRY_S, wait),
        )
