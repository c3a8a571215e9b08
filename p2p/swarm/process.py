"""The hivemind DHT child process: start it (before CUDA initialises), stop it, and end it by PID.

The child ends at once on a SIGTERM or SIGINT sent to the process group (see SwarmDHT.run): the parent
reads that as a dead DHT and shuts down without waiting for it.

hivemind.DHT forks a child that runs the DHT node and starts the p2pd daemon as its own child. The
fork must happen before CUDA or vLLM initialise in the parent (a forked CUDA context is unusable), so
the node daemon starts the swarm first thing. It is started from a worker thread: a fork taken on the
event loop's thread would hand the child a "running" loop it cannot use.

The parent sends every command (get, store, run_coroutine) to the child over a multiprocessing pipe.
hivemind's child registers the pipe's read end with uvloop, and libuv switches that file to
non-blocking mode; `Connection.recv()` is written for a blocking pipe. A command that reaches the pipe
in more than one piece (every one over 16 KiB: `Connection.send` writes the length header and the body
separately; any over 64 KiB: the pipe holds no more) then fails half-read with EAGAIN, the stream loses
its framing, and the child logs garbage or dies, never answering. Its caller's future waits forever, and
once the pipe is full the parent blocks in the next send. SwarmDHT reads the pipe in blocking mode again:
the reader callback only fires once the first byte is there, and the rest of a message follows at once.

SwarmDHT also takes a table's expiration time from its entries, never from the number a peer sends beside it
in a find response: hivemind stops a lookup at the first answer whose expiration is at least the one sought,
which for a `latest` read is +inf, so one peer answering "+inf" (and an empty table) ended every lookup it
took part in before the honest peers were asked. The entries' own times are checked finite and bounded by
the record validator (records.check_expiration), so the table's time is too.

SwarmDHT also makes the child judge a table (a key's subkey entries, as a peer returns or replicates it)
entry by entry: stock hivemind drops a peer's whole table when one entry fails validation, so one record
that its storer accepted and a reader refuses (an operator key one of them does not pin yet, an expiry
near the limit read by a peer whose clock lags) would hide every honest record under that key from it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from typing import Any

import hivemind
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.utils.timed_storage import ValueWithExpiration

from ..processes import child_pids, end_pids
from .config import SwarmConfig
from .errors import SwarmError
from .mp_locks import replace_locks_held_by_the_dead
from .validator import SwarmRecordValidator

logger = logging.getLogger(__name__)


class _BlockingCommandPipe:
    """The child's end of hivemind's command pipe, read in blocking mode (see the module docstring)."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection

    def fileno(self) -> int:
        return self._connection.fileno()

    def poll(self, timeout: float = 0.0) -> bool:
        return self._connection.poll(timeout)

    def recv(self) -> Any:
        # uvloop's add_reader has made the file non-blocking by now; restore blocking before every read
        # (cheap) rather than once, so no later add_reader call can undo it.
        os.set_blocking(self._connection.fileno(), True)
        return self._connection.recv()

    def close(self) -> None:
        self._connection.close()


# Refused entries tolerated in one table before the whole table is refused, as stock hivemind does at the
# first. The cases this is for (a key one side does not pin yet, a lagging clock) are a few entries; without
# a cap one message of junk entries would cost one signature check each instead of one in all.
MAX_REFUSED_ENTRIES = 4

READY_POLL_S = 0.2  # how often a starting DHT child is checked for having died


def _keep_valid_entries(self: DHTProtocol, key_bytes: bytes, dictionary: DictionaryDHTValue) -> bool:
    """Drop a table's invalid entries in place; False when entries were refused and none is left, or when
    more than MAX_REFUSED_ENTRIES were refused (the whole table is then refused, as stock hivemind does).

    Replaces DHTProtocol._validate_dictionary in the DHT child (see the module docstring); its callers,
    rpc_store and call_find, then store or return only the entries that passed.
    """
    if self.record_validator is None:
        return True
    refused: list[Any] = []
    with dictionary.freeze():  # no expiry sweep while we iterate
        for subkey, (value, expiration) in dictionary.items():
            record = DHTRecord(key_bytes, self.serializer.dumps(subkey), value, expiration)
            if not self.record_validator.validate(record):
                refused.append(subkey)
                if len(refused) > MAX_REFUSED_ENTRIES:
                    return False
    for subkey in refused:
        del dictionary[subkey]
    return bool(dictionary) or not refused


_stock_call_find = DHTProtocol.call_find


async def _find_with_own_expirations(self: DHTProtocol, peer: Any, keys: Any) -> Any:
    """DHTProtocol.call_find, with each returned table's expiration replaced by the latest of its entries
    (which _keep_valid_entries has validated by then), and an empty table by nothing found."""
    found = await _stock_call_find(self, peer, keys)
    if found is None:
        return None
    for key, (item, nearest) in found.items():
        if item is not None and isinstance(item.value, DictionaryDHTValue):
            with item.value.freeze():  # no expiry sweep while we read
                latest = max((entry.expiration_time for _, entry in item.value.items()), default=None)
            if latest is not None:
                item.value.latest_expiration_time = (
                    latest  # also a peer's number (DictionaryDHTValue.unpackb)
                )
            found[key] = (None if latest is None else ValueWithExpiration(item.value, latest), nearest)
    return found


class SwarmDHT(hivemind.DHT):
    """hivemind.DHT whose child reads its command pipe whole, judges tables entry by entry, dates them by
    their entries, and dies with its process group; otherwise identical (same arguments)."""

    def run(self) -> None:  # runs in the child process only
        # The fork copies the parent's asyncio signal handling: a no-op Python handler for SIGTERM and
        # SIGINT plus a wakeup fd that is the *parent's* event-loop socket. The child then shrugs off the
        # SIGTERM or Ctrl-C sent to the whole group (systemd, a terminal, a supervisor's killpg) while the
        # p2pd beside it dies of it; the parent's orderly shutdown then waits out the grace period on a
        # child whose daemon is gone, and a parent killed meanwhile leaves the child running as an orphan.
        # The child holds nothing durable, so the default action (end at once) is the right one.
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        self._inner_pipe = _BlockingCommandPipe(self._inner_pipe)  # type: ignore[has-type,arg-type]
        # Patched on the class, in this child only: its one DHTProtocol is built inside super().run().
        DHTProtocol._validate_dictionary = _keep_valid_entries
        DHTProtocol.call_find = _find_with_own_expirations
        super().run()


def wait_until_started(dht: hivemind.DHT, timeout: float) -> None:
    """hivemind's wait_until_ready, but a child that died while starting (a SIGTERM to the process group, an
    OOM kill) fails the start at once: its ready signal would never come, and the wait would last `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            dht.wait_until_ready(timeout=min(READY_POLL_S, max(deadline - time.monotonic(), 0.0)))
            return
        except FutureTimeout:  # the builtin TimeoutError from Python 3.11 on
            if not dht.is_alive():
                raise SwarmError(f"the DHT process exited ({dht.exitcode}) while starting") from None
            if time.monotonic() >= deadline:
                raise


async def daemon_listen_maddr(_dht: hivemind.DHT, node: Any) -> Any:
    # Runs inside the DHT child (run_coroutine): where its p2pd takes control connections.
    return node.p2p.daemon_listen_maddr


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
        replace_locks_held_by_the_dead()  # else an earlier child killed mid-write would hang this one's start
        try:
            dht = SwarmDHT(
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
            wait_until_started(dht, config.startup_timeout_s + 10 * config.wait_timeout_s)
        except Exception as exc:  # hivemind reports bootstrap and daemon failures with assorted types
            pids = [dht.pid, *child_pids(dht.pid)] if dht.pid else []
            end_pids(pids, config.shutdown_timeout_s)
            hint = (
                " None of the initial peers answered: check the --peers addresses (copy them from a running "
                "node's log) and that those nodes are up."
                if config.initial_peers
                else ""
            )
            if isinstance(exc, SwarmError):  # the child died: no bootstrap problem to hint at
                raise
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
