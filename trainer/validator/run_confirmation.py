"""The validator judges no file before the run's operator has confirmed its run parameters.

A validator pinned to other run parameters than the trainer's rejects every honest file as fraud and bans its
sender. The policy records carry the trainer's parameters (node/run/announcement.py), so the validator holds
its verification worker until a policy announced with exactly its own parameters arrives; one announced with
others stops it. Files received meanwhile wait in the spool and the queue, as they do for a checkpoint.

The last confirmed parameters are kept in `<data-dir>/run-parameters.json`, so that a validator restarted
with the same settings resumes at once, even while the trainer is down; one restarted with changed settings
waits for the operator's next announcement instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from ...node.run.announcement import check_announced_run
from ...p2p.swarm.records import PolicyAnnouncement, RunParameters
from ...p2p.weights.store import write_atomic

logger = logging.getLogger(__name__)

FILE_NAME = "run-parameters.json"
_MAX_FILE_BYTES = 64 * 1024


class RunConfirmation:
    """Reads its file when built: construct it off the event loop (asyncio.to_thread)."""

    def __init__(self, data_dir: Path, ours: RunParameters) -> None:
        self.path = data_dir / FILE_NAME
        self.ours = ours
        self.confirmed = asyncio.Event()
        if self._previously_confirmed():
            self.confirmed.set()
        else:
            logger.info(
                "verification waits for the run's operator to announce this validator's run parameters"
            )

    def _previously_confirmed(self) -> bool:
        try:
            with self.path.open("rb") as file:
                raw = file.read(_MAX_FILE_BYTES + 1)
            if len(raw) > _MAX_FILE_BYTES:
                raise ValueError(f"larger than {_MAX_FILE_BYTES} bytes")
            return RunParameters.model_validate_json(raw) == self.ours
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as exc:  # our own file, damaged (ValidationError is a ValueError): wait
            logger.warning("ignoring %s: %s", self.path, exc)
            return False

    async def admit(self, policy: PolicyAnnouncement) -> None:
        """RunMismatchError when `policy` carries other run parameters than ours; else verification opens (and
        the parameters are recorded for the next start) if it was not open yet."""
        check_announced_run(self.ours, policy.run, policy.step, "validator")
        if not self.confirmed.is_set():
            await asyncio.to_thread(write_atomic, self.path, self.ours.model_dump_json().encode())
            logger.info("policy step %d confirms this validator's run parameters: verifying", policy.step)
            self.confirmed.set()

    async def policies(
        self, policies: AsyncIterator[PolicyAnnouncement]
    ) -> AsyncIterator[PolicyAnnouncement]:
        """`policies` (Swarm.watch_policy()), each admitted before it is passed on."""
        async for policy in policies:
            await self.admit(policy)
            yield policy
