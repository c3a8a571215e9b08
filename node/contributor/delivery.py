"""Hand-off of committed rollout files to the validator that owns each, with a signed receipt for each.

Everything in the outbox's pending/ is sent oldest first, so files written before a crash go out after
the restart before anything new. Each file goes to the one validator its batch is assigned to
(p2p/swarm/routing.py: rendezvous hashing of (run, node, policy step, batch counter) over the live announced
validators); no other validator would take it, and none may, or the swarm would credit the work twice.
A receipt moves the entry to sent/; a refusal (the validator's verdict) moves it to rejected/ and is never
retried; a transport failure (no validator yet, a broken stream) is retried with exponential backoff, and so
is the validator's "busy" answer (HandoffBusy: rate limit, full queue, or "not assigned here" when its view
of the validators differs from ours), waiting at least the `retry_after_s` it asks for. Backoff is kept per
validator: a validator that is down or busy holds back only the files assigned to it. When it stays away,
its heartbeat expires and its files are routed to the validator that owns them next. A receipted file is never
sent again, whatever joins or leaves: the validator that signed the receipt judges it. A validator credits a
delivery (file hash, this node) once, so a resend after an ambiguous failure is harmless. Each receipt is
passed on to the verdict watcher (node/contributor/verdicts.py), which learns later whether the file was
accepted. A file signed before envelopes carried the batch (format v1) is signed again first.

A file still unsent when its checkpoint falls out of the async window (announced step - async_level) is
dropped, not sent: the trainer would discard it, and the validator's time is the swarm's scarcest resource.
The rollout loop's back-pressure (settings.max_pending_files) keeps such a backlog from building up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from ...p2p.swarm import HandoffBusy, HandoffError, HandoffRefused, RolloutEnvelope, Swarm, SwarmError
from ...proofs.rollout_file import sign_again
from ...proofs.rollout_schema import RolloutFileError
from .outbox import Outbox, OutboxEntry
from .state import NodeState

logger = logging.getLogger(__name__)

_IDLE_RECHECK_S = 30.0  # look at pending/ now and then even without a wake-up (e.g. files put back by hand)


class Delivery:
    def __init__(
        self,
        swarm: Swarm,
        outbox: Outbox,
        state: NodeState,
        *,
        retry_s: float,
        max_retry_s: float,
        on_receipt: Callable[[dict[str, Any]], None] | None = None,
        async_level: int | None = None,
    ) -> None:
        self.async_level = async_level  # None: never drop a file as stale
        self.swarm = swarm
        self.on_receipt = on_receipt  # the verdict watcher's `receipted`
        self.outbox = outbox
        self.state = state
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self._wake = asyncio.Event()
        self._summaries: dict[str, str] = {}  # sha256 -> what the batch was, for its one log line
        self._last_failure: str | None = None
        # validator node id -> (monotonic time before which its files wait, its current backoff)
        self._backoff: dict[str, tuple[float, float]] = {}

    def committed(self, sha256: str, summary: str) -> None:
        """Called by the rollout loop after each commit."""
        self._summaries[sha256] = summary
        self._wake.set()

    async def run(self) -> None:
        delay = self.retry_s  # backoff while files have no route (no validator yet, DHT trouble)
        while True:
            self._wake.clear()
            entries = await asyncio.to_thread(self.outbox.pending_entries)
            try:
                for entry in entries:
                    if self._stale(entry):
                        await asyncio.to_thread(self.outbox.drop_stale, entry)
                        self.state.count_rollout("stale")
                        logger.info(
                            "dropped unsent rollout file %s…: its checkpoint step %s is outside the "
                            "async window of announced step %s",
                            entry.sha256[:16],
                            entry.policy_step,
                            self.state.announced_step,
                        )
                        continue
                    await self.deliver(entry)
            except (HandoffError, SwarmError, OSError) as exc:  # no route, or the outbox failed: all wait
                self._note_failure(str(exc), delay)
                await asyncio.sleep(delay)
                delay = min(self.max_retry_s, delay * 2)
                continue
            delay = self.retry_s
            now = time.monotonic()
            waits = [until - now for until, _ in self._backoff.values() if until > now]
            if not waits and self._last_failure is not None:
                logger.info("hand-offs work again")
                self._last_failure = None
            try:  # until a file is committed, or the first validator's backoff ends
                async with asyncio.timeout(min([_IDLE_RECHECK_S, *waits])):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _stale(self, entry: OutboxEntry) -> bool:
        announced = self.state.announced_step
        if self.async_level is None or entry.policy_step is None or announced is None:
            return False
        return entry.policy_step < announced - self.async_level

    async def deliver(self, entry: OutboxEntry) -> None:
        """Send one entry to the validator its batch is assigned to. A refusal is recorded here; a transport
        failure or "busy" backs that validator off (its files wait, the others' go on). Raises HandoffError or
        SwarmError when the file has no route (no validator live yet, the DHT unreadable): every file waits."""
        envelope = await self._envelope(entry)
        if envelope is None:
            return
        validator = await self.swarm.route(envelope)
        until, backoff = self._backoff.get(validator.node_id, (0.0, 0.0))
        if time.monotonic() < until:
            return  # its validator is backing off: the file stays pending for a later round
        summary = self._summaries.pop(
            entry.sha256, f"rollout file {entry.sha256[:16]}… (written before a restart)"
        )
        try:
            receipt = await self.swarm.send_rollout(entry.file_path, envelope, validator)
        except HandoffRefused as exc:
            await asyncio.to_thread(self.outbox.reject, entry, exc.reason)
            self.state.count_rollout("rejected")
            self.state.error(f"rollout file {entry.sha256[:16]}… rejected: {exc.reason}")
            logger.warning("%s -> REJECTED by the validator: %s", summary, exc.reason)
            return
        except (HandoffError, SwarmError, OSError) as exc:  # the file stays; this validator backs off
            self._summaries[entry.sha256] = summary
            backoff = min(self.max_retry_s, max(self.retry_s, backoff * 2))
            hint = exc.retry_after_s if isinstance(exc, HandoffBusy) else 0.0  # back-pressure
            wait = max(backoff, min(hint, self.max_retry_s))
            self._backoff[validator.node_id] = (time.monotonic() + wait, backoff)
            self._note_failure(f"validator {validator.node_id[:16]}…: {exc}", wait)
            return
        except BaseException:
            self._summaries[entry.sha256] = summary
            raise
        self._backoff.pop(validator.node_id, None)
        receipt_doc = receipt.model_dump(mode="json")
        await asyncio.to_thread(self.outbox.acknowledge, entry, receipt_doc)
        self.state.count_rollout("handed_off")
        if self.on_receipt is not None:
            self.on_receipt(receipt_doc)
        logger.info("%s -> handed off to validator %s…", summary, receipt.body.receiver[:16])

    async def _envelope(self, entry: OutboxEntry) -> RolloutEnvelope | None:
        """The entry's envelope, signed again as v2 if it was signed before envelopes named the batch; None
        (and the entry moved to rejected/) when it is damaged on disk, since no validator would take it."""
        raw = await asyncio.to_thread(entry.sig_path.read_bytes)
        try:
            envelope = RolloutEnvelope.model_validate_json(raw, strict=True)
            if envelope.batch is None:  # v1: every validator refuses it, and it has no owner to go to
                signed = await asyncio.to_thread(
                    sign_again, entry.file_path, entry.sig_path, self.swarm.identity
                )
                envelope = RolloutEnvelope.model_validate(signed, strict=True)
        except (ValidationError, RolloutFileError) as exc:
            await asyncio.to_thread(self.outbox.reject, entry, f"unreadable signature envelope: {exc}")
            logger.error(
                "outbox entry %s has an unreadable signature envelope or file; moved to rejected/: %s",
                entry.sha256,
                exc,
            )
            return None
        return envelope

    def _note_failure(self, message: str, delay: float) -> None:
        # Logged once per distinct problem, so a node waiting for a validator does not flood its log.
        self.state.error(f"hand-off failed: {message}")
        if message != self._last_failure:
            logger.warning("hand-off failed: %s; retrying (every %.0f s at most)", message, self.max_retry_s)
            self._last_failure = message
        else:
            logger.debug("hand-off failed again: %s; next try in %.0f s", message, delay)
