"""`prime-node trainer`: the operator's GRPO trainer (origin of the weights, announcer of policies).

Runs until SIGTERM or Ctrl-C (graceful), or until --max-steps. When ready it prints one JSON line on stdout:
{"trainer": node id, "step": N, "weights": bound URL, "sources": [announced weights URLs], "maddrs": [...],
"metrics": URL}; then one compact line per rollout step on stderr (unless --quiet).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ...trainer.service.config import TrainerCommandSettings
from ..errors import NodeError
from ..runtime.ports import Listener, check_ports_free, dht_listeners
from .common import model_dir, run_until_stopped
from .flags import Flag, SettingsFlags, load_settings
from .run_flags import add_run_flags

if TYPE_CHECKING:
    from ...p2p.identity import Identity
    from ...trainer.service.learner import Learner


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trainer", help="train on accepted rollouts with GRPO; publish and announce every checkpoint"
    )
    flags = SettingsFlags(p, TrainerCommandSettings)
    p.add_argument(
        "--model", type=Path, required=True, help="HF model directory: the genesis weights (step 0)"
    )
    p.add_argument(
        "--key", type=Path, required=True, help="the operator's secret key (signs manifests, policies)"
    )
    add_run_flags(flags)
    flags.add(
        Flag("swarm.run_id", "--swarm-run-id"),
        Flag("swarm.initial_peers", "--peers", metavar="MADDR"),
        Flag("swarm.host_maddrs", "--listen", metavar="MADDR"),
        Flag("swarm.announce_maddrs", nargs="+", metavar="MADDR"),
    )
    p.add_argument("--no-dht", action="store_true", help="serve weights over HTTP only; announce nothing")
    flags.add(
        Flag("serve.host", "--http-host"),
        Flag("serve.port", "--http-port"),
        Flag("service.public_sources", "--public-weights-url", nargs="+", metavar="URL"),
        Flag("service.metrics_host"),
        Flag("service.metrics_port"),
        Flag("service.accepted_dir"),
        Flag("service.max_steps"),
        Flag("trainer.batch_size"),
        Flag("trainer.async_level"),
        Flag("trainer.lr"),
        Flag("service.threads"),
    )
    p.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model over GPUs with FSDP2; start under torchrun (docs/trainer.md)",
    )
    p.set_defaults(handler=trainer)


def trainer(args: argparse.Namespace) -> int:
    # Heavy imports (torch, hivemind) only when the command runs, so `--help` stays fast.
    from ...p2p.identity import Identity

    settings = load_settings(args, TrainerCommandSettings)
    model_dir(args.model, "--model")
    if args.no_dht:
        settings.service.dht = False
    if not args.key.is_file():
        raise NodeError(f"key file {args.key} does not exist; create one with `prime-node keygen`")
    identity = Identity.load(args.key)
    svc = settings.service
    # Under torchrun only rank 0 listens; another rank's probe could meet rank 0's own server.
    probe = not args.fsdp or os.environ.get("RANK", "0") == "0"
    check_ports_free(
        []
        if not probe
        else [
            Listener(settings.serve.host, settings.serve.port, "--http-port", "the weights server"),
            *(
                [Listener(svc.metrics_host, svc.metrics_port, "--metrics-port", "the trainer's /metrics")]
                if svc.metrics_port is not None
                else []
            ),
            *(dht_listeners(settings.swarm.host_maddrs, "--listen") if svc.dht else []),
        ]
    )
    if settings.service.dht and identity.node_id not in settings.swarm.operator_keys:
        # The trainer signs policies, so its own key is an operator key of the run.
        settings.swarm.operator_keys = [*settings.swarm.operator_keys, identity.node_id]
    if args.fsdp:
        from ...trainer.service.fsdp_learner import run_under_torchrun

        # Every rank runs this command; rank 0 serves, the others follow it (trainer/service/fsdp_learner.py).
        return run_under_torchrun(
            settings,
            args.model,
            lambda factory: asyncio.run(
                _serve(settings, identity, args.model, quiet=args.quiet, learner_factory=factory)
            ),
        )
    return asyncio.run(_serve(settings, identity, args.model, quiet=args.quiet))


async def _serve(
    settings: TrainerCommandSettings,
    identity: Identity,
    model_dir: Path,
    *,
    quiet: bool,
    learner_factory: Callable[..., Learner] | None = None,
) -> int:
    from ...trainer.service.metrics import StepRecord, progress_line
    from ...trainer.service.service import SHUTDOWN_S, TrainerService
    from ..runtime.supervisor import Supervisor

    def show(record: StepRecord) -> None:
        if not quiet:
            print(progress_line(record), file=sys.stderr, flush=True)

    async def start(supervisor: Supervisor) -> str:
        service = TrainerService(
            settings,
            identity,
            model_dir,
            supervisor,
            on_step=show,
            learner_factory=learner_factory,
        )
        return (await service.start()).ready_line()

    return await run_until_stopped("trainer", start, SHUTDOWN_S)
