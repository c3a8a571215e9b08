"""`prime-node trainer`: the operator's GRPO trainer (origin of the weights, announcer of policies).

Runs until SIGTERM or Ctrl-C (graceful), or until --max-steps. When ready it prints one JSON line on stdout:
{"trainer": node id, "step": N, "weights": URL, "maddrs": [...], "metrics": URL}; then one compact line per
rollout step on stderr (unless --quiet).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import NodeError
from .common import common_flags, load_settings, run_until_stopped
from .run_flags import RUN_FLAGS, add_run_flags

FLAGS = {
    **RUN_FLAGS,
    "swarm.run_id": "swarm_run_id",
    "swarm.initial_peers": "peers",
    "swarm.host_maddrs": "listen",
    "serve.host": "http_host",
    "serve.port": "http_port",
    "service.accepted_dir": "accepted_dir",
    "service.max_steps": "max_steps",
    "service.threads": "threads",
    "service.metrics_port": "metrics_port",
    "trainer.batch_size": "batch_size",
    "trainer.async_level": "async_level",
    "trainer.lr": "lr",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trainer",
        parents=[common_flags()],
        help="train on accepted rollouts with GRPO; publish and announce every checkpoint",
    )
    p.add_argument(
        "--model", type=Path, required=True, help="HF model directory: the genesis weights (step 0)"
    )
    p.add_argument(
        "--key", type=Path, required=True, help="the operator's secret key (signs manifests, policies)"
    )
    add_run_flags(p)
    p.add_argument("--swarm-run-id", default=None, help="DHT run id (default: the run id, as nodes use)")
    p.add_argument(
        "--peers", nargs="*", default=None, metavar="MADDR", help="bootstrap peers (/ip4/.../p2p/...)"
    )
    p.add_argument("--listen", nargs="*", default=None, metavar="MADDR", help="libp2p listen multiaddrs")
    p.add_argument("--no-dht", action="store_true", help="serve weights over HTTP only; announce nothing")
    p.add_argument("--http-host", default=None, help="weights server address (default 127.0.0.1)")
    p.add_argument(
        "--http-port", type=int, default=None, help="weights server port (default 8470; 0 picks one)"
    )
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (default 0: any)")
    p.add_argument(
        "--accepted-dir", type=Path, default=None, help="validator inbox (default <data-dir>/accepted)"
    )
    p.add_argument("--max-steps", type=int, default=None, help="stop once this policy step is published")
    p.add_argument("--batch-size", type=int, default=None, help="samples per rollout step (default 64)")
    p.add_argument("--async-level", type=int, default=None, help="oldest usable policy, steps behind (2)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-4)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
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
    from ...trainer.service.config import TrainerCommandSettings

    settings = load_settings(args, TrainerCommandSettings, FLAGS)
    if args.no_dht:
        settings.service.dht = False
    if not args.key.is_file():
        raise NodeError(f"key file {args.key} does not exist; create one with `prime-node keygen`")
    identity = Identity.load(args.key)
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
    settings: object,
    identity: object,
    model_dir: Path,
    *,
    quiet: bool,
    learner_factory: Callable[..., object] | None = None,
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
            on_step=show,  # type: ignore[arg-type]
            learner_factory=learner_factory,
        )  # type: ignore[arg-type]
        return (await service.start()).ready_line()

    return await run_until_stopped("trainer", start, SHUTDOWN_S)
