"""The hivemind DHT child process: start it (before CUDA initialises), stop it, and end it by PID.

hivemind.DHT forks a child that runs the DHT node and starts the p2pd daemon as its own child. The
fork must happen before CUDA or vLLM initialise in the parent (a forked CUDA context is unusable), so
the node daemon starts the swarm first thing. It is started from a worker thread: a fork taken on the
event loop's thread would hand the child a "running" loop it cannot use.
"""

from __future__ import annotations

import logging
import os
import signal

import hivemind

from ..processes import child_pids, end_pids
from .config import SwarmConfig
from .errors import SwarmError
from .validator import SwarmRecordValidator

logger = logging.getLogger(__name__)


class DHTProcess:
    """One running hivemind.DHT child and the PIDs it owns (itself and its p2pd)."""

    def __init__(self, dht: hivemind.DHT, client_mode: bool, shutdown_timeout_s: float) -> None:
        self.dht = dht
        self.client_mode = client_mode
        self._shutdown_timeout_s = shutdown_timeout_s
        self.pids = [dht.pid, *child_pids(dht.pid)]

    @classmethod
    def start(cls, config: SwarmConfig, *, client_mode: bool) -> DHTProcess:
        """Blocking: fork the DHT, bootstrap from config.initial_peers, return when it serves requests."""
        validator = SwarmRecordValidator(config.run_id, config.operator_keys)
        try:
            dht = hivemind.DHT(
                initial_peers=config.initial_peers or None,
                start=True,
                await_ready=False,
                client_mode=client_mode,
                host_maddrs=config.host_maddrs,
                announce_maddrs=config.announce_maddrs or None,
                # A node that cannot be dialled looks for relays so that peers can still reach it.
                use_auto_relay=client_mode,
                use_relay=True,
                wait_timeout=config.wait_timeout_s,
                startup_timeout=config.startup_timeout_s,
                shutdown_timeout=config.shutdown_timeout_s,
                record_validators=[validator],
            )
        except (OSError, ValueError) as exc:
            raise SwarmError(f"could not start the DHT process: {exc}") from exc
        try:
            dht.wait_until_ready(timeout=config.startup_timeout_s + 10 * config.wait_timeout_s)
        except Exception as exc:  # hivemind reports bootstrap and daemon failures with assorted types
            pids = [dht.pid, *child_pids(dht.pid)] if dht.pid else []
            end_pids(pids, config.shutdown_timeout_s)
            hint = (
                " None of the initial peers answered: check the --peers addresses (copy them from a running "
                "node's log) and that those nodes are up."
                if config.initial_peers
                else ""
            )
            raise SwarmError(f"the DHT did not start: {exc}.{hint}") from exc
        return cls(dht, client_mode, config.shutdown_timeout_s)

    def stop(self) -> None:
        """Blocking: ask the DHT to shut down, then end by PID whatever is still running."""
        pids = [*self.pids, *child_pids(self.dht.pid)]
        try:
            self.dht.shutdown()
        except (OSError, EOFError, BrokenPipeError, ValueError) as exc:  # the child may already be gone
            logger.debug("DHT shutdown request failed: %s", exc)
        end_pids(sorted(set(pids)), self._shutdown_timeout_s)
        self.dht.join(timeout=self._shutdown_timeout_s)

    def kill(self) -> None:
        """Blocking: SIGKILL the DHT and its daemon at once (tests use it to simulate a crash)."""
        for pid in [*self.pids, *child_pids(self.dht.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.dht.join(timeout=self._shutdown_timeout_s)
