"""The lowest layer of a Swarm: the DHT child process, our replica of its p2p daemon, named tasks.

`DHTPeer` starts and stops the DHT process (trainer and node daemons fork it before CUDA initialises),
attaches to its p2p daemon, runs the dial-back self-test that decides between a full DHT peer and client
mode, and bounds every wait on the child. Its background tasks (the heartbeat) are named and exposed as
`tasks`; the process that owns the swarm supervises them with its other tasks. The records API
(directory.py) and the rollout hand-off (swarm.py) build on it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hivemind.p2p import P2P

from ..identity import Identity
from . import reachability
from .config import SwarmConfig
from .errors import SwarmError
from .process import DHTProcess, daemon_listen_maddr

logger = logging.getLogger(__name__)


class DHTPeer:
    def __init__(self, config: SwarmConfig, identity: Identity) -> None:
        self.config = config
        self.identity = identity
        self.node_id = identity.node_id
        self.process: DHTProcess | None = None
        self._p2p: P2P | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._handlers: list[str] = []

    # ----- lifecycle -----------------------------------------------------------------------------------

    async def _connect(self) -> None:
        """Start the DHT process if needed, attach to it, and fall back to client mode if undialable."""
        if self.process is None:
            await asyncio.to_thread(self.start_dht)
        await self._attach()
        if self.config.reachability == "auto" and self.config.initial_peers and not self.client_mode:
            await self._self_test()

    def start_dht(self, *, client_mode: bool | None = None) -> None:
        """Blocking: fork the DHT process. Call before CUDA initialises; `join` calls it if you did not."""
        if self.process is not None:
            raise SwarmError("the DHT is already running; call leave() before starting it again")
        self.process = DHTProcess.start(
            self.config,
            client_mode=self.config.reachability == "private" if client_mode is None else client_mode,
        )

    @property
    def client_mode(self) -> bool:
        return self.process is not None and self.process.client_mode

    async def _attach(self) -> None:
        assert self.process is not None
        # Not dht.replicate_p2p(): it waits for the child's answer with a blocking, unbounded result() on
        # this thread, which freezes the whole event loop if the child never answers.
        listen_maddr = await self._await(
            self.process.dht.run_coroutine(daemon_listen_maddr, return_future=True)
        )
        try:
            self._p2p = await asyncio.wait_for(P2P.replicate(listen_maddr), self.config.startup_timeout_s)
        except TimeoutError:
            raise SwarmError(
                f"could not attach to the DHT process's p2p daemon within {self.config.startup_timeout_s:.0f} s"
            ) from None
        if not self.client_mode:
            server = reachability.DialBackServer(self.config.run_id, self.config.reachability_timeout_s)
            await self._add_handler(server.name, server.handle)

    async def dial_back(self, ports: list[int]) -> bool | None:
        """Ask up to three bootstrap peers, in turn, to open fresh TCP connections to `ports` on the address
        they see this node at. True: one was reached; False: a peer tried and reached none; None: no peer
        answered (no bootstrap peers, or none serves the probe). Works whatever `reachability` says: a
        node's own claim is exactly what it checks."""
        if self._p2p is None:
            raise SwarmError("not joined: call join() first")
        return await reachability.probe(
            self._p2p,
            self.config.run_id,
            self.config.initial_peers[:3],
            ports,
            self.config.reachability_timeout_s,
        )

    async def _self_test(self) -> None:
        ports = reachability.tcp_ports(self.config.announce_maddrs or await self.maddrs())
        reached = await self.dial_back(ports)
        if reached is None:
            logger.warning(
                "could not test whether this node can be dialled (no bootstrap peer answered the "
                "dial-back probe); staying a full DHT peer"
            )
        elif not reached:
            logger.warning(reachability.unreachable_message(ports, self.config.host_maddrs))
            await self._stop_process()
            await asyncio.to_thread(self.start_dht, client_mode=True)
            await self._attach()

    async def leave(self) -> None:
        """Stop the heartbeat, unregister handlers, shut the DHT process down (ending it by PID if needed)."""
        for task in self._tasks.values():
            task.cancel()
        if self._tasks:
            # Bounded: shutdown must finish even if a task swallows its cancellation.
            await asyncio.wait(list(self._tasks.values()), timeout=self.config.shutdown_timeout_s)
        self._tasks.clear()
        await self._stop_process()

    async def _stop_process(self) -> None:
        if self._p2p is not None:
            for name in self._handlers:
                try:
                    await asyncio.wait_for(self._p2p.remove_binary_stream_handler(name), 2)
                except Exception as exc:  # the daemon may already be gone; nothing left to unregister
                    logger.debug("could not remove handler %s: %s", name, exc)
            try:  # a replica: closes our client sockets, not the daemon; bounded like every other step
                await asyncio.wait_for(self._p2p.shutdown(), self.config.shutdown_timeout_s)
            except (TimeoutError, OSError) as exc:
                logger.warning(
                    "closing the p2p client took too long or failed (%r); ending the DHT process anyway", exc
                )
        self._handlers, self._p2p = [], None
        if self.process is not None:
            process, self.process = self.process, None
            await asyncio.to_thread(process.stop)

    def _spawn(self, name: str, coro: Any) -> None:
        self._tasks[name] = asyncio.create_task(coro, name=name)

    @property
    def tasks(self) -> dict[str, asyncio.Task[None]]:
        """The named background tasks (after join), for the owner's supervisor to supervise: a crash of one is
        the owner's to surface (node/runtime/supervisor.py `Supervisor.supervise`); leave() stops them."""
        return dict(self._tasks)

    async def maddrs(self) -> list[str]:
        """This node's dialable multiaddrs (with /p2p/<peer id>), for other nodes' --peers."""
        if self._p2p is None:
            raise SwarmError("not joined: call join() first")
        # Asked of p2pd over our replica's own socket. Not dht.get_visible_maddrs() from a thread: the
        # DHT's command pipe is not thread-safe, and two writers interleave and garble its messages.
        return [str(m) for m in await self._p2p.get_visible_maddrs()]

    @property
    def peer_id(self) -> str:
        if self._p2p is None:
            raise SwarmError("not joined: call join() first")
        return self._p2p.peer_id.to_base58()

    async def _await(self, future: Any) -> Any:
        # An MPFuture from the DHT child never resolves if the child died: bound every wait. asyncio.timeout,
        # not wait_for: on 3.11 wait_for returns the result and drops a cancellation that arrives as the DHT
        # answers, so a supervised loop polling the DHT could outlive its own shutdown.
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                return await future
        except TimeoutError:
            alive = self.process is not None and self.process.dht.is_alive()
            raise SwarmError(
                f"the DHT process did not answer within {self.config.request_timeout_s:.0f} s"
                + ("" if alive else " (it has exited; leave() and join() again)")
            ) from None

    def _dht(self) -> Any:
        if self.process is None:
            raise SwarmError("not joined: call join() first")
        if not self.process.dht.is_alive():
            # Checked before each command: a dead child leaves its pipe unread, and once the pipe is full
            # the next send would block this thread (and with it the event loop) for good.
            raise SwarmError("the DHT process has exited; leave() and join() again")
        return self.process.dht

    async def _add_handler(self, name: str, handler: Any) -> None:
        assert self._p2p is not None
        await self._p2p.add_binary_stream_handler(name, handler)
        self._handlers.append(name)
