"""Learning the verdicts on handed-off files, off the hot path, in the supervised task `verdicts`.

A receipt only says the validator holds a file; whether it was accepted comes later, as a verdict signed
by the same validator, served at `<api_url>/api/verdict/<sha256>/<node_id>` (docs/validator.md; the verdict
on this node's own delivery of the file, whoever else sent the same bytes). For each receipted
file this task asks the validator that signed the receipt, with exponential backoff per file (404 means
"not decided yet"), at most `_MAX_PER_ROUND` requests a round, and gives up on a file `timeout_s` after
its receipt. A checked verdict is stored beside the receipt (`sent/<sha256>.verdict.json`), so a restart
keeps the counts and asks only about files still undecided; it updates the accepted / rejected counts and
`prime_node_contributor_verdicts_total{verdict}`. A failed lookup is logged (once per distinct problem), counted
in `prime_node_contributor_verdict_lookup_failures_total` and asked again later; whatever one file's answer raises, the
task goes on with the others (a validator's API is reached over plain HTTP: anyone on the path can answer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from ...p2p.validator_api import ValidatorApiError, VerdictNotReady
from .outbox import Outbox
from .state import NodeState
from .validator_api import ValidatorApi, ValidatorEndpoint

logger = logging.getLogger(__name__)

_MAX_PER_ROUND = 32  # requests per round: a node with a long backlog does not hammer the validator
_IDLE_S = 60.0  # with nothing awaited, look at the outbox again this often (receipts arrive by `receipted`)


@dataclass
class _Awaited:
    sha256: str
    validator: str  # node id of the validator whose receipt we hold: the only key its verdict may carry
    received_at: float  # wall-clock time on the receipt: the give-up clock survives restarts
    due: float = 0.0  # monotonic time of the next question
    delay: float = 0.0


class VerdictWatcher:
    def __init__(
        self,
        api: ValidatorApi,
        outbox: Outbox,
        state: NodeState,
        *,
        poll_s: float,
        max_poll_s: float,
        timeout_s: float,
    ) -> None:
        self.api = api
        self.outbox = outbox
        self.state = state
        self.poll_s = poll_s
        self.max_poll_s = max_poll_s
        self.timeout_s = timeout_s
        self._awaited: dict[str, _Awaited] = {}
        self._wake = asyncio.Event()
        self._last_problem: str | None = None

    def restore(self) -> None:
        """Counts and the files still awaiting a verdict, from the outbox (blocking: call in a thread)."""
        accepted, rejected = self.outbox.verdict_counts()
        self.state.restore_verdicts(accepted, rejected)
        for receipt in self.outbox.awaiting_verdict():
            self._add(receipt)

    def receipted(self, receipt: dict[str, Any]) -> None:
        """Called by the hand-off after each receipt is stored: start asking about this file."""
        self._add(receipt)
        self._wake.set()

    def _add(self, receipt: dict[str, Any]) -> None:
        body = receipt["body"]
        self._awaited.setdefault(
            body["sha256"],
            _Awaited(
                body["sha256"],
                body["receiver"],
                float(body["received_at"]),
                time.monotonic() + self.poll_s,
                self.poll_s,
            ),
        )
        self.state.awaiting_verdicts = len(self._awaited)

    @property
    def awaiting(self) -> int:
        return len(self._awaited)

    async def run(self) -> None:
        while True:
            self._wake.clear()
            await self.poll_due()
            now = time.monotonic()
            wait = min((a.due for a in self._awaited.values()), default=now + _IDLE_S) - now
            try:
                async with asyncio.timeout(max(0.05, min(_IDLE_S, wait))):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def poll_due(self) -> None:
        """Ask about every file whose turn it is (at most _MAX_PER_ROUND)."""
        try:
            await self._poll_due()
        finally:
            self.state.awaiting_verdicts = len(self._awaited)

    async def _poll_due(self) -> None:
        now = time.monotonic()
        due = sorted((a for a in self._awaited.values() if a.due <= now), key=lambda a: a.due)[
            :_MAX_PER_ROUND
        ]
        if not due:
            return
        try:
            endpoints = await self.api.endpoints()
        except ValidatorApiError as exc:
            for item in due:
                self._later(item, str(exc))
            return
        for item in due:
            if time.time() - item.received_at > self.timeout_s:
                del self._awaited[item.sha256]
                logger.warning(
                    "no verdict on %s… within %.0f s of its receipt; no longer asking",
                    item.sha256[:16],
                    self.timeout_s,
                )
                continue
            endpoint = endpoints.get(item.validator)
            if endpoint is None:
                self._later(item, f"validator {item.validator[:16]}… announces no HTTP API (or is gone)")
                continue
            try:
                await self._ask(item, endpoint)
            except VerdictNotReady:
                self._later(item, None)
            except ValidatorApiError as exc:
                self._failed(item, str(exc))
            except Exception as exc:  # noqa: BLE001 - whatever one answer does, the other files (and the node) go on
                logger.exception(
                    "verdict on %s…: unexpected error (a bug; please report it)", item.sha256[:16]
                )
                problem = f"unexpected error: {type(exc).__name__}: {exc}"
                self.state.error(f"verdict on {item.sha256[:16]}…: {problem}")
                self._failed(item, problem)

    async def _ask(self, item: _Awaited, endpoint: ValidatorEndpoint) -> None:
        signed = await self.api.verdict(endpoint, item.sha256)
        await asyncio.to_thread(self.outbox.record_verdict, item.sha256, signed.envelope())
        del self._awaited[item.sha256]
        self._learned(
            signed.document.accepted, item.sha256, signed.document.failed_check, signed.document.reason
        )

    def _failed(self, item: _Awaited, problem: str) -> None:
        self.state.metrics.verdict_lookup_failures.inc()
        self._later(item, problem)

    def _learned(self, accepted: bool, sha256: str, failed_check: str | None, reason: str) -> None:
        self._last_problem = None
        if accepted:
            self.state.count_rollout("accepted")
            logger.debug("rollout file %s… accepted", sha256[:16])
            return
        self.state.count_rollout("rejected")
        message = f"rollout file {sha256[:16]}… rejected by the validator ({failed_check}): {reason}"
        self.state.error(message)
        logger.warning("%s", message)

    def _later(self, item: _Awaited, problem: str | None) -> None:
        item.delay = min(self.max_poll_s, item.delay * 2)
        item.due = time.monotonic() + item.delay
        if problem is not None and problem != self._last_problem:  # once per distinct problem
            logger.warning(
                "verdict lookup failed: %s; retrying (every %.0f s at most)", problem, self.max_poll_s
            )
            self._last_problem = problem
