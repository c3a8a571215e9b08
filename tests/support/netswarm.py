"""A prime-node swarm on the lab's hosts (tests/support/netlab): the real roles, each a process on a host.

`NetSwarm` starts `prime-node trainer` and `prime-node validator` on public hosts (fixed ports: each host
is a machine of its own, so they cannot clash) announcing their lab addresses, as docs/deploy.md has an
operator do, and contributor nodes (`prime-node start`) on any host, behind a home router or not, with the
dial-back self-test on (`--reachability auto`) unless a test says otherwise. Command lines come from the
devnet's layout (trainer/devnet/layout.py) with only the addresses changed, so the roles run exactly as
they do on loopback. Queries (`status`, `leaderboard`, the swarm's heartbeats) run on a host too, so they
see the network as that host does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.p2p.swarm import SwarmConfig
from prime_node.trainer.devnet.layout import CLI, NODE_ENV, DevnetLayout, Member, Sizing
from prime_node.trainer.devnet.processes import Child
from prime_node.trainer.devnet.runner import wait_ready

from support.netlab import INTERNET, Host

RUN_ID = "netlab"
DHT_PORT, WEIGHTS_PORT, API_PORT = 31337, 8470, 8471
# Small work, so that a file is generated, handed off and judged within seconds on a shared CPU.
SIZING = Sizing(prompts=2, samples=2, max_new_tokens=16)
FAST = {
    "PRIME_NODE_SWARM__POLICY_POLL_S": "0.5",
    "PRIME_NODE_SWARM__HEARTBEAT_INTERVAL_S": "1.0",
    "PRIME_NODE_SWARM__HEARTBEAT_TTL_S": "20",
    # Weights URLs of peers may point into the lab's internet (private addresses, unlike the real one).
    "PRIME_NODE_PEER_WEIGHTS_NETWORKS": json.dumps([str(INTERNET)]),
}

_HEARTBEATS = r"""
import asyncio, json, sys
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import Swarm, SwarmConfig

async def main():
    config = SwarmConfig(run_id=sys.argv[1], operator_keys=[sys.argv[2]], initial_peers=sys.argv[3:],
                         reachability="private")
    swarm = Swarm(config, Identity.generate())
    await swarm.join(heartbeat=False)
    try:
        peers = await swarm.list_peers()
        print(json.dumps({k: v.model_dump(mode="json") for k, v in peers.items()}))
    finally:
        await swarm.leave()

asyncio.run(main())
"""


# A bare DHT peer (no model): joins with the given settings, prints what it became, and with --probe asks a
# bootstrap peer to dial that port back, as a serving node does before advertising its weights server.
_PEER = r"""
import argparse, asyncio, json, sys
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import Swarm, SwarmConfig

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True)
parser.add_argument("--probe", type=int)
parser.add_argument("--stay", action="store_true")
args = parser.parse_args()

async def main():
    swarm = Swarm(SwarmConfig.model_validate_json(args.config), Identity.generate())
    await swarm.join(heartbeat=False)
    try:
        ready = {"peer": swarm.node_id, "client_mode": swarm.client_mode, "maddrs": await swarm.maddrs()}
        if args.probe:
            ready["dial_back"] = await swarm.dial_back([args.probe])
        print(json.dumps(ready), flush=True)
        if args.stay:
            await asyncio.Event().wait()
    finally:
        await swarm.leave()

asyncio.run(main())
"""


def peer_argv(config: SwarmConfig, probe: int | None = None, stay: bool = False) -> list[str]:
    """A bare DHT peer with `config` (run it on a host); it prints one JSON line: its node id ("peer"),
    `client_mode`, `maddrs`, and with `probe` the dial-back answer for that port ("dial_back"). With `stay`
    it then stays up (a bootstrap peer) until ended."""
    argv = [sys.executable, "-c", _PEER, "--config", config.model_dump_json()]
    return argv + (["--probe", str(probe)] if probe else []) + (["--stay"] if stay else [])


def _replace(argv: list[str], flag: str, *values: str) -> list[str]:
    """`argv` with the value(s) after `flag` replaced by `values` (the flag takes len(values) values)."""
    at = argv.index(flag)
    return [*argv[: at + 1], *values, *argv[at + 1 + len(values) :]]


class NetSwarm:
    """The roles of one run on lab hosts. `start_operator` first, then `add_node` per contributor."""

    def __init__(self, root: Path, sizing: Sizing = SIZING) -> None:
        model_dir = root / "model"
        if not model_dir.exists():
            model, tokenizer = build_tiny_model(0)
            save_model_dir(model, tokenizer, model_dir)
        self.layout = DevnetLayout(root / "run", RUN_ID, model_dir, sizing)
        self.trainer: dict[str, Any] = {}  # its ready line
        self.validator: dict[str, Any] = {}
        self.trainer_host: Host | None = None
        self.validator_host: Host | None = None

    @property
    def peers(self) -> list[str]:
        """The bootstrap peers a node is given: the trainer and the validator, as in docs/deploy.md."""
        return [*self.trainer["maddrs"][:1], *self.validator["maddrs"][:1]]

    def start_operator(self, trainer: Host, validator: Host, timeout_s: float = 300.0) -> None:
        """Start the trainer on `trainer` and the validator on `validator` (both public hosts); wait until
        both printed their ready lines (DevnetError with the log's tail if one exits or takes too long)."""
        argv = self.layout.trainer_argv(max_steps=1000)  # no step is expected within a test
        argv = _replace(argv, "--listen", f"/ip4/0.0.0.0/tcp/{DHT_PORT}")
        argv = _replace(argv, "--http-port", str(WEIGHTS_PORT))
        argv += ["--announce-maddrs", f"/ip4/{trainer.ip}/tcp/{DHT_PORT}", "--http-host", "0.0.0.0"]
        argv += ["--public-weights-url", f"http://{trainer.ip}:{WEIGHTS_PORT}"]
        child = trainer.start("trainer", argv, env={**self.layout.trainer_env(), **FAST})
        self.trainer, self.trainer_host = wait_ready(child, "trainer", timeout_s), trainer
        argv = self.layout.validator_argv(self.trainer["maddrs"][:1])
        argv = _replace(argv, "--listen", f"/ip4/0.0.0.0/tcp/{DHT_PORT}")
        argv = _replace(argv, "--http-port", str(API_PORT))
        argv += ["--announce-maddrs", f"/ip4/{validator.ip}/tcp/{DHT_PORT}", "--http-host", "0.0.0.0"]
        child = validator.start("validator", argv, env={**self.layout.env(), **FAST})
        self.validator, self.validator_host = wait_ready(child, "validator", timeout_s), validator

    def add_node(
        self,
        host: Host,
        name: str,
        *,
        reachability: str = "auto",
        serve_weights: bool = False,
        extra: tuple[str, ...] = (),
    ) -> tuple[Member, Child]:
        """Start a contributor `name` on `host` (dial-back self-test unless `reachability` says otherwise)."""
        member = self.layout.add_member(name)
        argv = self.layout.member_argv(member, self.peers)
        argv = _replace(argv, "--host-maddrs", f"/ip4/0.0.0.0/tcp/{DHT_PORT}")
        argv += ["--reachability", reachability, *extra]
        env = {**self.layout.member_env(), **FAST, "PRIME_NODE_SWARM__REACHABILITY": reachability}
        if serve_weights:
            argv.append("--serve-weights")
            env.update(PRIME_NODE_SERVE__HOST="0.0.0.0", PRIME_NODE_SERVE__PORT=str(WEIGHTS_PORT))
        return member, host.start(name, argv, env=env)

    def status(self, host: Host, member: Member) -> dict[str, Any] | None:
        """`prime-node status --json` of `member`, asked on its host; None while it does not answer."""
        done = host.run([*CLI, "status", "--json", "--data-dir", str(member.data_dir)], timeout=60)
        return json.loads(done.stdout) if done.returncode == 0 else None

    def leaderboard(self, host: Host) -> dict[str, Any]:
        """The validator's leaderboard, asked from `host` (`prime-node leaderboard --json`)."""
        assert self.validator_host is not None
        url = f"http://{self.validator_host.ip}:{API_PORT}"
        done = host.run([*CLI, "leaderboard", "--json", "--validator", url], timeout=60)
        if done.returncode != 0:
            raise AssertionError(f"leaderboard from {host.name} failed: {done.stderr.strip()[-400:]}")
        return json.loads(done.stdout)

    def heartbeats(self, host: Host) -> dict[str, dict[str, Any]]:
        """Every live heartbeat in the DHT, as a fresh DHT client on `host` reads them (node id -> fields)."""
        argv = [sys.executable, "-c", _HEARTBEATS, RUN_ID, self.layout.operator.node_id, *self.peers]
        done = host.run(argv, timeout=120)
        if done.returncode != 0:
            raise AssertionError(f"reading heartbeats on {host.name} failed: {done.stderr.strip()[-600:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


__all__ = ["API_PORT", "DHT_PORT", "NODE_ENV", "RUN_ID", "WEIGHTS_PORT", "NetSwarm", "peer_argv"]
