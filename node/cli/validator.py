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

from ...trainer.validator.config import ValidatorSettings
from ..errors import NodeError
from ..runtime.ports import Listener, check_ports_free, dht_listeners
from .common import run_until_stopped
from .flags import Flag, SettingsFlags, load_settings
from .run_flags import RUN_FLAGS, add_run_flags

SHUTDOWN_S = 20.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validator", help="verify contributors' rollout files, credit them, slash and ban cheaters"
    )
    flags = SettingsFlags(p, ValidatorSettings)
    p.add_argument("--key", type=Path, required=True, help="the validator's secret key (an operator key)")
    flags.add(
        Flag("swarm.operator_keys", "--operator-key", append=True, metavar="HEX"),
        Flag("swarm.initial_peers", "--peers", metavar="MADDR"),
        Flag("swarm.host_maddrs", "--listen", metavar="MADDR"),
        Flag("swarm.announce_maddrs", nargs="+", metavar="MADDR"),
        Flag("verifier.sample_fraction"),
        Flag("validator.accepted_dir"),
        Flag("dashboard.host", "--http-host"),
        Flag("dashboard.port", "--http-port"),
    )
    # --run-id names the DHT's run too, over a swarm.run_id from the environment or the config file.
    add_run_flags(flags, run_id=Flag(RUN_FLAGS[0].path, also=("swarm.run_id",)))
    flags.add(Flag("engine.threads"))
    p.set_defaults(handler=validator)


def validator(args: argparse.Namespace) -> int:
    # Heavy imports (torch, hivemind) only when the command runs, so `--help` stays fast.
    from ...p2p.identity import Identity

    settings = load_settings(args, ValidatorSettings)
    if settings.engine.threads is None and (os.cpu_count() or 1) <= 4:
        # On a small machine one torch thread is several times faster than contended ones.
        settings.engine.threads = 1
    if not args.key.is_file():
        raise NodeError(f"key file {args.key} does not exist; create one with `prime-node keygen`")
    identity = Identity.load(args.key)
    check_ports_free(
        [
            Listener(
                settings.dashboard.host,
                settings.dashboard.port,
                "--http-port",
                "the API, dashboard and /metrics",
            ),
            *dht_listeners(settings.swarm.host_maddrs, "--listen"),
        ]
    )
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
