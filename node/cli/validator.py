"""`prime-node validator`: receive, verify and credit rollout files; publish verdicts and bans.

Runs until SIGTERM or Ctrl-C (graceful: tasks stop in reverse order within a time limit). When ready it
prints one JSON line: {"validator": node id, "maddrs": [...], "dashboard": URL} (for scripts and the devnet).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from ..errors import NodeError
from .common import common_flags, load_settings, run_until_stopped
from .run_flags import RUN_FLAGS, add_run_flags

FLAGS = {
    **RUN_FLAGS,
    "swarm.run_id": "run_id",
    "engine.threads": "threads",
    "swarm.initial_peers": "peers",
    "swarm.operator_keys": "operator_key",
    "swarm.host_maddrs": "listen",
    "verifier.sample_fraction": "sample_fraction",
    "dashboard.host": "http_host",
    "dashboard.port": "http_port",
    "validator.accepted_dir": "accepted_dir",
}
SHUTDOWN_S = 20.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validator",
        parents=[common_flags()],
        help="verify contributors' rollout files, credit them, slash and ban cheaters",
    )
    p.add_argument("--key", type=Path, required=True, help="the validator's secret key (an operator key)")
    p.add_argument(
        "--operator-key",
        action="append",
        default=None,
        metavar="HEX",
        help="pinned operator public key (repeatable; default: this validator's own key)",
    )
    p.add_argument(
        "--peers", nargs="*", default=None, metavar="MADDR", help="bootstrap peers (/ip4/.../p2p/...)"
    )
    p.add_argument("--listen", nargs="*", default=None, metavar="MADDR", help="libp2p listen multiaddrs")
    p.add_argument(
        "--sample-fraction",
        type=float,
        default=None,
        help="share of rows the expensive checks cover, drawn after each file arrives (default 1.0)",
    )
    p.add_argument(
        "--accepted-dir", type=Path, default=None, help="trainer inbox (default <data-dir>/accepted)"
    )
    p.add_argument("--http-host", default=None, help="dashboard listen address (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=None, help="dashboard port (default 8471; 0 picks one)")
    add_run_flags(p)  # --run-id names the DHT's run too
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default 1 on machines with 4 cores or fewer)",
    )
    p.set_defaults(handler=validator)


def validator(args: argparse.Namespace) -> int:
    # Heavy imports (torch, hivemind) only when the command runs, so `--help` stays fast.
    from ...p2p.identity import Identity
    from ...trainer.validator.config import ValidatorSettings

    settings = load_settings(args, ValidatorSettings, FLAGS)
    if settings.engine.threads is None and (os.cpu_count() or 1) <= 4:
        # On a small machine one torch thread is several times faster than contended ones.
        settings.engine.threads = 1
    if not args.key.is_file():
        raise NodeError(f"key file {args.key} does not exist; create one with `prime-node keygen`")
    identity = Identity.load(args.key)
    return asyncio.run(_serve(settings, identity))


async def _serve(settings: object, identity: object) -> int:
    from ...trainer.validator.run import start_validator
    from ..runtime.supervisor import Supervisor

    async def start(supervisor: Supervisor) -> str:
        running = await start_validator(settings, identity, supervisor)  # type: ignore[arg-type]
        return json.dumps(
            {
                "validator": running.service.identity.node_id,
                "maddrs": running.maddrs,
                "dashboard": running.dashboard_url,
            }
        )

    return await run_until_stopped("validator", start, SHUTDOWN_S)
