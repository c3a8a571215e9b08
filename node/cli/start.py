"""`prime-node start [--gpu] [--pipeline]`: run a contributor node until SIGINT/SIGTERM (exit 0 after a clean
stop); with --pipeline it serves a stage of the operator's pipelined groups (docs/pipeline.md)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from ..contributor.settings import StartSettings
from ..runtime.ports import Listener, check_ports_free, dht_listeners
from .flags import Flag, SettingsFlags, load_settings
from .run_flags import add_run_flags


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("start", help="run a contributor node (generate rollouts for a run)")
    flags = SettingsFlags(p, StartSettings)
    p.add_argument("--gpu", action="store_true", help="generate on CUDA (vLLM where installed)")
    flags.add(
        Flag("operator_key"),
        Flag("swarm.initial_peers", "--peers", nargs="+", metavar="MADDR"),
        Flag("key_file", "--key"),
        Flag("prompts"),
    )
    add_run_flags(flags)
    flags.add(
        Flag("async_level"),
        Flag("swarm.host_maddrs", nargs="+", metavar="MADDR"),
        Flag("swarm.announce_maddrs", nargs="+", metavar="MADDR"),
        Flag("swarm.reachability"),
        Flag("engine.threads"),
        Flag("status_host"),
        Flag("status_port"),
        Flag("max_batches"),
        Flag("serve_weights"),
        Flag("pipeline.enabled", "--pipeline"),
        Flag("pipeline.stages", "--stages", nargs="+", metavar="STAGE"),
    )
    p.set_defaults(handler=start)


def start(args: argparse.Namespace) -> int:
    settings = load_settings(args, StartSettings)
    check_ports_free(
        [
            Listener(
                settings.status_host, settings.status_port, "--status-port", "the status API and /metrics"
            ),
            *dht_listeners(settings.swarm.host_maddrs),
        ]
        + (
            [Listener(settings.serve.host, settings.serve.port, "setting serve.port", "the weights server")]
            if settings.serve_weights
            else []
        )
    )
    # Heavy imports (torch, hivemind) only when the command runs, so `--help` stays fast.
    from ..contributor.daemon import ContributorNode

    if args.gpu:
        settings.engine.device = "cuda"
    if settings.log_level != "DEBUG":
        # The node logs one line per batch itself; the producer's own per-batch line would double it.
        logging.getLogger("prime_node.node.run.producer").setLevel(logging.WARNING)
    node = ContributorNode(settings, gpu=bool(args.gpu))
    return asyncio.run(node.run())
