"""`prime-node start [--gpu]`: run a contributor node until SIGINT/SIGTERM (exit 0 after a clean stop)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from .common import common_flags, load_settings
from .run_flags import RUN_FLAGS, add_run_flags

FLAGS = {
    **RUN_FLAGS,
    "key_file": "key",
    "operator_key": "operator_key",
    "prompts": "prompts",
    "async_level": "async_level",
    "swarm.initial_peers": "peers",
    "swarm.host_maddrs": "host_maddrs",
    "swarm.announce_maddrs": "announce_maddrs",
    "swarm.reachability": "reachability",
    "engine.threads": "threads",
    "status_host": "status_host",
    "status_port": "status_port",
    "max_batches": "max_batches",
    "serve_weights": "serve_weights",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "start", parents=[common_flags()], help="run a contributor node (generate rollouts for a run)"
    )
    p.add_argument("--gpu", action="store_true", help="generate on CUDA (vLLM where installed)")
    p.add_argument("--operator-key", default=None, help="the run operator's public key (64 hex)")
    p.add_argument(
        "--peers", nargs="+", default=None, metavar="MADDR", help="bootstrap peers (/ip4/.../p2p/...)"
    )
    p.add_argument("--key", type=Path, default=None, help="the node's key file (default <data-dir>/node.key)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per rollout batch")
    add_run_flags(p)
    p.add_argument(
        "--async-level", type=int, default=None, help="oldest usable checkpoint, in steps (default 2)"
    )
    p.add_argument("--host-maddrs", nargs="+", default=None, metavar="MADDR", help="libp2p listen addresses")
    p.add_argument("--announce-maddrs", nargs="+", default=None, metavar="MADDR", help="public addresses")
    p.add_argument(
        "--reachability", choices=["auto", "public", "private"], default=None, help="see docs/swarm.md"
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--status-host", default=None, help="status API address (default 127.0.0.1)")
    p.add_argument("--status-port", type=int, default=None, help="status API port (default: a free one)")
    p.add_argument("--max-batches", type=int, default=None, help="stop cleanly after this many batches")
    p.add_argument(
        "--serve-weights", action="store_true", default=None, help="serve verified checkpoints to peers"
    )
    p.set_defaults(handler=start)


def start(args: argparse.Namespace) -> int:
    # Heavy imports (torch, hivemind) only when the command runs, so `--help` stays fast.
    from ..contributor.daemon import ContributorNode
    from ..contributor.settings import StartSettings

    settings = load_settings(args, StartSettings, FLAGS)
    if args.gpu:
        settings.engine.device = "cuda"
    if settings.log_level != "DEBUG":
        # The node logs one line per batch itself; the producer's own per-batch line would double it.
        logging.getLogger("prime_node.node.run.producer").setLevel(logging.WARNING)
    node = ContributorNode(settings, gpu=bool(args.gpu))
    return asyncio.run(node.run())
