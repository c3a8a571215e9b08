"""The contributor node: every long-running piece of `prime-node start` under one Supervisor.

Order of start (stopped in reverse): preflight checks -> the DHT child process (forked before anything
initialises CUDA) -> signal handlers -> the CUDA check for --gpu -> join the swarm -> status API ->
optional weights server (when reachable) -> tasks: the swarm's heartbeat and the weights server's rescans
(started by those components, supervised here), policy watcher, checkpoint fetcher, peers/bans watcher,
weights advertiser, hand-off, verdicts, leaderboard, and the rollout loop, or with --pipeline
(`pipeline.enabled`) the pipeline member in its place (pipeline_stage.py: its stage offer, the groups it joins,
its stage task, per group, supervised here as well). A crashed task stops the node with a non-zero exit;
SIGINT/SIGTERM stop it cleanly within `shutdown_timeout_s` with exit code 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from ...p2p.identity import Identity
from ...p2p.swarm import Hardware, Swarm, SwarmError
from ...p2p.swarm.hardware import local_hardware
from ...p2p.weights.store import Store
from ..errors import ConfigError, NodeError, OperatorActionNeeded
from ..pipeline.weights import StageSelection
from ..run.announcement import agreed_policies, run_parameters
from ..run.settings import engine_for_run, open_run_environment
from ..runtime.supervisor import Supervisor, TaskCrashed
from .checkpoints import CheckpointKeeper
from .delivery import Delivery
from .leaderboard import run_leaderboard
from .outbox import Outbox
from .pipeline_stage import PipelineStage, offered_stages
from .preflight import (
    check_cuda,
    check_cuda_visible,
    check_data_dir,
    check_disk,
    check_key,
    check_memory,
    run_checks,
)
from .rollout_loop import RolloutLoop
from .serving import WeightsSharing
from .settings import StartSettings
from .state import NodeState
from .status import StatusServer
from .validator_api import ValidatorApi
from .verdicts import VerdictWatcher

logger = logging.getLogger(__name__)

STOP_SIGNAL_GRACE_S = 1.0  # how long a failed start waits for the stop signal that may have caused it

MIB = 1 << 20


class ContributorNode:
    rollout_loop: type[RolloutLoop] = RolloutLoop  # the devnet's adversaries substitute a cheating loop
    pipeline_stage: type[PipelineStage] = PipelineStage  # ... or, with --pipeline, a cheating stage

    def __init__(self, settings: StartSettings, *, gpu: bool = False) -> None:
        if settings.operator_key is None:
            raise ConfigError(
                "no operator key: pass --operator-key HEX (the run operator's public key, from the run's "
                "announcement) or set operator_key in the config file"
            )
        self.settings = settings
        self.gpu = gpu
        self.data_dir = settings.resolved_data_dir()
        self.operator_key: str = settings.operator_key
        self.supervisor = Supervisor("contributor")

    def preflight(self) -> Identity:
        """The checks that need nothing started; raises PreflightError listing every fatal failure."""
        s = self.settings
        engine_for_run(
            s.engine, s.run
        )  # a dtype the run's validators reject stops the node here, not per file
        checks = [check_key(s.key_path()), check_data_dir(self.data_dir)]
        if self.gpu:  # no CUDA at all is known at once, before the DHT starts (the memory check comes later)
            checks.append(check_cuda_visible())
        run_checks(checks)
        window = (s.async_level + 1) * s.checkpoint_disk_mb * MIB
        for result in run_checks([check_disk(self.data_dir, window), check_memory(s.min_ram_mb * MIB)]):
            logger.debug("preflight %s: %s", result.name, result.message)
        return Identity.load(s.key_path())

    async def run(self) -> int:
        """Run until stopped; 0 after a clean stop, NodeError when a task crashed or shutdown was unclean."""
        identity = self.preflight()
        s, sup = self.settings, self.supervisor
        state = NodeState(identity.node_id, self.operator_key)
        swarm = Swarm(
            s.swarm_config(),
            identity,
            roles=("contributor", "relay") if s.serve_weights else ("contributor",),
        )
        crash: TaskCrashed | None = None
        needs_operator: OperatorActionNeeded | None = None
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-worker")
        try:
            # Before the DHT's fork: a SIGTERM while it starts is then a stop request, and the shutdown ends
            # the DHT child and its p2pd, instead of killing this process and orphaning them.
            sup.install_signal_handlers()
            state.state = "starting the DHT"
            try:
                await asyncio.to_thread(
                    swarm.start_dht
                )  # fork before CUDA initialises (no CUDA context in the child)
            except Exception:
                # A stop sent to the whole process group (systemd, the devnet) also reaches what the DHT start
                # waits on (torch's shared-memory manager, the DHT child), and the start fails: the stop's
                # doing. The failure can reach this task before the loop has run the signal's handler: give
                # it a moment.
                if not await sup.sleep_or_stop(STOP_SIGNAL_GRACE_S):
                    raise
                logger.info("the DHT start was cut short by the stop")
            sup.on_shutdown("leave the swarm", swarm.leave)
            if not sup.stopping:
                if self.gpu:
                    result = await asyncio.to_thread(check_cuda, s.min_gpu_memory_mb * MIB)
                    run_checks([result])
                    swarm.hardware = await asyncio.to_thread(_gpu_hardware)
                await swarm.join()
            if not sup.stopping:
                await self._start_services(identity, swarm, state, executor)
            await sup.wait()
        except TaskCrashed as exc:
            crash = exc
        except (
            OperatorActionNeeded
        ) as exc:  # e.g. the run announces other parameters: its message says what to do
            needs_operator = exc
        finally:
            state.state = "stopping"
            sup.on_shutdown("torch worker", _executor_closer(executor))
            report = await sup.shutdown(s.shutdown_timeout_s)
        if crash is not None:
            raise NodeError(f"the node stopped because {crash}") from crash.__cause__
        problems = [f"{name}: {err}" for name, err in report.errors]
        problems += [f"{t} did not stop" for t in report.stuck_tasks]
        if needs_operator is not None:
            if problems:
                logger.error("the node stopped, but not cleanly: %s", "; ".join(problems))
            raise needs_operator
        if problems:
            raise NodeError("the node stopped, but not cleanly: " + "; ".join(problems))
        logger.info("stopped (%s) in %.1f s", sup.stop_reason, report.seconds)
        return 0

    async def _start_services(
        self, identity: Identity, swarm: Swarm, state: NodeState, executor: ThreadPoolExecutor
    ) -> None:
        s, sup = self.settings, self.supervisor
        sup.supervise(*swarm.tasks.values())  # the swarm's own (the heartbeat): a crash stops the node
        status = StatusServer(self.data_dir, state.to_status, state.metrics, s.status_host, s.status_port)
        await status.start()
        sup.on_shutdown("status API", status.stop)
        store = Store(self.data_dir / "checkpoints")
        sharing = WeightsSharing(store, s, self.operator_key, swarm, state, identity)
        if await sharing.start():
            sup.on_shutdown("weights server", sharing.stop)
            sup.supervise(*sharing.tasks())  # its rescans: a crash stops the node instead of serving less
        layout = s.run.pipeline
        # A pipeline node fetches only the shards of the stages it offers (docs/pipeline.md, "Selective download").
        plan = StageSelection(layout, offered_stages(s, layout)) if s.pipeline.enabled and layout else None
        keeper = CheckpointKeeper(
            store,
            self.operator_key,
            state,
            async_level=s.async_level,
            fetch_settings=s.fetch,
            retry_s=s.fetch_retry_s,
            max_retry_s=s.max_retry_s,
            identity=identity,
            peer_sources=sharing.sources_for,
            on_proven=sharing.note_proven,
            serve=sharing.serve_as_verified(),
            plan=plan,
            # A tiny checkpoint arrives in milliseconds: a bar only for a download slower than a second.
            download_bar_after_s=None if s.log_json else 1.0,
        )
        await keeper.load_local()
        outbox = Outbox(self.data_dir / "rollouts")
        api = ValidatorApi(swarm, identity.node_id, s.validator_api_timeout_s)
        sup.on_shutdown("validator API client", api.close)
        verdicts = VerdictWatcher(
            api,
            outbox,
            state,
            poll_s=s.verdict_poll_s,
            max_poll_s=s.max_retry_s,
            timeout_s=s.verdict_timeout_s,
        )
        await asyncio.to_thread(verdicts.restore)
        delivery = Delivery(
            swarm,
            outbox,
            state,
            retry_s=s.handoff_retry_s,
            max_retry_s=s.max_retry_s,
            on_receipt=verdicts.receipted,
            async_level=s.async_level,
        )
        # Opened once (a file is read and hashed): its identity is compared with every policy's, and the rollout
        # loop draws from this same object, so a task file edited in place cannot change the tasks unnoticed.
        environment = await asyncio.to_thread(open_run_environment, s.run)
        loop = self.rollout_loop(
            s,
            identity,
            keeper,
            outbox,
            state,
            executor,
            on_committed=delivery.committed,
            environment=environment,
        )

        ours = run_parameters(
            s.run, environment
        )  # every announced policy must carry these (run_announcement.py)

        async def watch_policy() -> None:
            while True:
                try:
                    async for policy in agreed_policies(swarm.watch_policy(), ours, "node"):
                        keeper.announce(policy)
                except SwarmError as exc:  # the DHT process answered too slowly: transient, look again
                    state.error(f"policy lookup failed: {exc}")
                    logger.warning("policy lookup failed: %s; retrying", exc)
                    await asyncio.sleep(swarm.config.policy_poll_s)

        async def rollouts() -> None:
            await loop.run(s.max_batches)
            sup.request_stop(f"{s.max_batches} batches done")

        sup.spawn("policy-watch", watch_policy())
        sup.spawn("announcement-wait", _report_no_announcement(s.announcement_wait_s, s.max_retry_s, state))
        sup.spawn("checkpoint-fetch", keeper.run())
        sup.spawn("peers-watch", _watch_peers(swarm, state, sharing))
        sup.spawn("weights-source-proofs", sharing.prove_sources())
        if sharing.server is not None:
            sup.spawn("weights-serve", sharing.advertise())
        sup.spawn("hand-off", delivery.run())
        sup.spawn("verdicts", verdicts.run())
        sup.spawn("leaderboard", run_leaderboard(api, state, s.leaderboard_refresh_s))
        if s.pipeline.enabled:  # a stage of the operator's groups instead of whole batches alone
            stage = self.pipeline_stage(
                s,
                identity,
                swarm,
                keeper,
                outbox,
                state,
                self.data_dir,
                environment=environment,
                on_committed=delivery.committed,
                supervise=sup.supervise,
                request_stop=sup.request_stop,
            )
            sup.spawn("pipeline-member", stage.run())
        else:
            sup.spawn("rollout-loop", rollouts())
        logger.info(
            "node %s… started: status API on %s:%s, data in %s",
            identity.node_id[:16],
            s.status_host,
            status.port,
            self.data_dir,
        )


def no_announcement_message(operator_key: str, waited_s: float, peers: int) -> str:
    """What a node that found no run announcement says: the key it looks for, and the three likely causes."""
    reach = (
        "no peers seen: give --peers the address a swarm member printed (`joined swarm ... --peers ...`)"
        if peers == 0
        else f"{peers} peers seen: is the trainer running and announcing in this swarm (--run-id)?"
    )
    return (
        f"no run announcement signed by the operator key {operator_key[:16]}… found after {waited_s:.0f} s; "
        f"check that --operator-key is the trainer's node id (`prime-node identity --key TRAINER_KEY`); {reach}"
    )


async def _report_no_announcement(wait_s: float, max_wait_s: float, state: NodeState) -> None:
    """A wrong operator key, a missing trainer or unreachable peers all look the same from here: nothing
    signed by the pinned key ever arrives. Without this the node waits silently for ever ("announced none",
    "last error: none"); with it, the log and `prime-node status` say which key it waits for and what to check,
    at wait_s, then at doubling intervals (at most max_wait_s apart) while nothing arrives."""
    started = time.monotonic()
    interval = wait_s
    while True:
        await asyncio.sleep(interval)
        if state.announced_step is not None:
            return  # the announcement arrived: the policy watch carries on from here
        message = no_announcement_message(
            state.operator_key or "", time.monotonic() - started, state.peers_seen
        )
        state.error(message)
        logger.warning("%s", message)
        interval = min(interval * 2, max(max_wait_s, wait_s))


async def _watch_peers(swarm: Swarm, state: NodeState, sharing: WeightsSharing) -> None:
    """Count live peers, publish our working step in the heartbeat, notice a ban of this node, note which
    peers serve weights, and refuse weight requests from banned nodes when this node serves weights."""
    banned_reason: str | None = None
    while True:
        swarm.policy_step = state.working_step
        try:
            peers = await swarm.list_peers()
            bans = await swarm.read_bans()
        except (OSError, EOFError, SwarmError) as exc:
            logger.debug("peer lookup failed: %s", exc)
        else:
            state.set_peers(len([p for p in peers if p != swarm.node_id]))
            sharing.note_peers(peers, set(bans))
            if sharing.server is not None:
                sharing.server.bans.set_dynamic(set(bans))
            ban = bans.get(swarm.node_id)
            if ban is not None and ban.reason != banned_reason:
                banned_reason = ban.reason
                state.error(f"this node is banned by the operator: {ban.reason}")
                logger.error(
                    "this node is banned by the operator (%s); its rollouts will be refused", ban.reason
                )
        await asyncio.sleep(swarm.config.heartbeat_interval_s)


def _gpu_hardware() -> Hardware:
    import torch

    props = torch.cuda.get_device_properties(0)
    return local_hardware(props.name[:64], props.total_memory // MIB)


def _executor_closer(executor: ThreadPoolExecutor) -> Callable[[], Awaitable[None]]:
    async def close() -> None:
        # A batch still running finishes on its thread (torch cannot be interrupted); nothing waits for it
        # here, and its staged file never reaches pending/.
        executor.shutdown(wait=False, cancel_futures=True)

    return close
