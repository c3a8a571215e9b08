"""Which policy step a file may claim: one the run announced, or will within a margin; else the sender's fault.

A file names the checkpoint it was generated with (its policy step, read by the `limits` check before any bulk
decoding). A file whose checkpoint the validator does not hold waits for it, in a queue place, for up to
`intake.hold_timeout_s`. Unbounded, that wait was free: a file claiming a step nobody will ever announce held a
place for the whole hold and was then excused (`checkpoint_unavailable`; issue 18 review, H6). So, right after
`limits` and before any hold (trainer/validator/service.py `_hold`), the claimed step is judged:

- above the newest announced step plus `intake.step_margin`: refused at once, a fault (`policy_step`);
- within the margin: the file waits; when its hold ends without the checkpoint, it is excused only when the
  step was announced by then (the validator could not get it), and a fault when it never was.

The trainer announces every optimizer step in order (trainer/service/service.py), so every step up to the
newest announced one was announced. The margin covers the honest race: a node may see a new policy a moment
before the validator does. The validator's own view (what its policy watch and its store have seen) can also
lag by a poll or a long checkpoint fetch, so before it calls a step too new, or never announced, it reads the
current policy from the DHT (at most once per REFRESH_S); when that read fails, the file is held or excused,
never blamed. A step older than the validator keeps is not judged here: it is excused at once (the keeper's
`gone`), without a hold, so it costs the validator no queue place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ...p2p.errors import P2PError

logger = logging.getLogger(__name__)

POLICY_STEP = "policy_step"  # the failed check of a file claiming a step the run did not announce (a fault)
REFRESH_S = 1.0  # one DHT read serves every judgement within this long
READ_TIMEOUT_S = 10.0

CurrentStep = Callable[[], Awaitable["int | None"]]  # the newest step the DHT announces now (None: none)
KnownStep = Callable[[], "int | None"]  # the newest step this validator has seen announced, without a read


class PolicySteps:
    """The newest announced policy step, as this validator knows it, and what a claimed step costs."""

    def __init__(
        self,
        current: CurrentStep,
        known: KnownStep,
        *,
        margin: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.margin = margin
        self._current, self._known, self._clock = current, known, clock
        self._read: int | None = None  # the newest step a DHT read returned
        self._read_at = float("-inf")  # when the last read was tried
        self._read_ok = (
            False  # whether it succeeded: a failure is remembered as long, never taken as a success
        )
        self._lock = asyncio.Lock()

    def newest(self) -> int | None:
        """The newest step known to be announced, without asking the DHT."""
        steps = [s for s in (self._read, self._known()) if s is not None and s >= 0]
        return max(steps) if steps else None

    async def refusal(self, step: int) -> str | None:
        """Why a file claiming `step` is refused before any hold (the sender's fault); None: it may wait."""
        newest = self.newest()
        if newest is None or step > newest + self.margin:
            if not await self.refresh():
                return None  # the validator cannot tell now: the file waits, and the hold's end judges it
            newest = self.newest()
        if newest is not None and step > newest + self.margin:
            return (
                f"{POLICY_STEP}: the file claims policy step {step}, beyond the newest announced step {newest} "
                f"by more than the margin of {self.margin}"
            )
        return None

    async def never_announced(self, step: int) -> str | None:
        """At the end of a vain hold: why the claim was the sender's fault (the step was never announced), or
        None when it was announced (or the validator cannot tell) and the file is excused."""
        newest = self.newest()
        if newest is None or step > newest:
            if not await self.refresh():
                return None
            newest = self.newest()
        if (
            newest is None or step <= newest
        ):  # nothing known at all: a DHT miss is no proof against the sender
            return None
        return (
            f"{POLICY_STEP}: the file claims policy step {step}, which was never announced (newest: {newest})"
        )

    async def refresh(self) -> bool:
        """Read the current policy from the DHT (one try per REFRESH_S at most, so a flood of files claiming
        far steps costs one read a second, and a failing DHT does not stall the worker on every file); False
        when the last read failed."""
        async with self._lock:
            if self._clock() - self._read_at < REFRESH_S:
                return self._read_ok
            try:
                step = await asyncio.wait_for(self._current(), READ_TIMEOUT_S)
            except (TimeoutError, OSError, EOFError, P2PError) as exc:
                logger.warning(
                    "could not read the current policy step (%s); claimed steps are not judged", exc
                )
                self._read_at, self._read_ok = self._clock(), False
                return False
            self._read_at, self._read_ok = self._clock(), True
            if step is not None:
                self._read = max(step, self._read if self._read is not None else step)
            return True
