"""Where a devnet keeps its files and how each of its processes is started.

One run directory holds everything: `operator.key` (the trainer's and the validator's: both are the
operator's), `trainer/`, `validator/` (its `accepted/` inbox is the trainer's), `node-1..N/` and
`adv-1..M-<attack>/` (each with its own `node.key`), in a pipeline devnet `stage-1..K/` (`start --pipeline`
nodes), `logs/`, and the report. Every process listens on
127.0.0.1 with ports picked by the OS, so several devnets (or tests) can run side by side.

Only sizing and responsiveness are set here (batch size from the node count, DHT poll intervals, one torch
thread per process on a shared machine); the RL recipe is the trainer's and the nodes' own defaults.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ...p2p.identity import Identity
from .pipeline_attacks import PIPELINE_ATTACKS

CLI = (sys.executable, "-m", "prime_node.node.cli.main")
ADVERSARY = (sys.executable, "-m", "prime_node.node.cli.adversary")
LOOPBACK = "/ip4/127.0.0.1/tcp/0"

# Responsiveness on loopback: find policies, validators and bans within a second or two, not a minute.
SWARM_ENV = {
    "PRIME_NODE_SWARM__REACHABILITY": "public",  # loopback: no dial-back self-test needed
    "PRIME_NODE_SWARM__POLICY_POLL_S": "0.5",
    "PRIME_NODE_SWARM__HEARTBEAT_INTERVAL_S": "2.0",
    "PRIME_NODE_SWARM__HEARTBEAT_TTL_S": "30",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
NODE_ENV = {
    "PRIME_NODE_HANDOFF_RETRY_S": "0.5",
    "PRIME_NODE_FETCH_RETRY_S": "1.0",
    "PRIME_NODE_MAX_RETRY_S": "5.0",
    "PRIME_NODE_SHUTDOWN_TIMEOUT_S": "15",
}

# The tiny model's RL settings (docs/trainer.md, "Does it learn?", 4): with the recipe's symmetric GRPO its
# greedy held-out accuracy stalls or falls (1e-4 flat, 3e-4 and up falling); learning from the
# better-than-average samples only, at 3e-4, raises it. Everything else stays the trainer's default.
TRAINER_ENV = {
    "PRIME_NODE_TRAINER__NEGATIVE_WEIGHT": "0",
    "PRIME_NODE_TRAINER__LR": "3e-4",
}

# Prompts per rollout file when not given. With the node's default (4) the tiny model writes a file about
# every second, past the validator's per-node intake limit (30 files a minute): the surplus waits in the
# node's outbox, oldest first, and reaches the trainer after it left the async window (measured: 500 files
# pending per node and the trainer starved after 6 steps). Files of 16 prompts carry the same samples in a
# quarter of the hand-offs. Sizing only: the samples per prompt and the recipe stay the run's defaults.
DEVNET_PROMPTS = 16

# A pipeline devnet's group timings, for loopback (docs/pipeline.md, "Groups"): groups form, confirm and
# re-form within seconds, not the minute the defaults take; the trainer's [groups] and the nodes' [pipeline]
# agree on when a member is gone.
GROUPS_ENV = {
    "PRIME_NODE_GROUPS__POLL_S": "1.0",
    "PRIME_NODE_GROUPS__STALE_AFTER_S": "10",
    "PRIME_NODE_GROUPS__CONFIRM_WITHIN_S": "20",
    "PRIME_NODE_GROUPS__COOLDOWN_S": "30",
}
# The validator judges a group's batch once every stage's file is in, or when this grace period after the first
# ends (default 60 s, for peers across the internet): on loopback a member's file arrives within seconds, and a
# batch broken by a member that died is judged incomplete (its survivors excused) without waiting a minute.
VALIDATOR_GROUPS_ENV = {"PRIME_NODE_INTAKE__GROUP_GRACE_S": "15"}
STAGE_ENV = {
    "PRIME_NODE_PIPELINE__POLL_S": "1.0",
    "PRIME_NODE_PIPELINE__STALE_AFTER_S": "10",
    "PRIME_NODE_PIPELINE__ROUND_GRACE_S": "3",
}


@dataclass(frozen=True)
class Sizing:
    """How big the work is; None keeps the trainer's / node's own default."""

    batch_size: int | None = None
    prompts: int | None = DEVNET_PROMPTS
    samples: int | None = None
    max_new_tokens: int | None = None
    length_targets: tuple[int, ...] | None = None

    def node_flags(self) -> list[str]:
        return [] if self.prompts is None else ["--prompts", str(self.prompts)]

    def run_flags(self) -> list[str]:
        """Run parameters every party must agree on (the trainer announces its own, and nodes and the
        validator stop on a difference), given to all of them the same way."""
        flags = []
        for flag, value in (("--samples", self.samples), ("--max-new-tokens", self.max_new_tokens)):
            if value is not None:
                flags += [flag, str(value)]
        if self.length_targets is not None:
            flags += ["--length-targets", *map(str, self.length_targets)]
        return flags


@dataclass
class Member:
    """One contributor (honest or not) of the devnet."""

    name: str
    data_dir: Path
    node_id: str
    attack: str | None = None  # None: honest
    pipeline: bool = False  # a `start --pipeline` node (a stage of the operator's groups)


@dataclass
class DevnetLayout:
    root: Path
    run_id: str
    model_dir: Path
    sizing: Sizing = field(default_factory=Sizing)
    operator: Identity = field(init=False)
    members: list[Member] = field(default_factory=list)
    env_spec: str | None = None  # the run's environment, given to every party; None: the built-in arithmetic
    synthetic: bool = False  # a synthetic run (docs/synthetic.md): frozen model, the product is a dataset
    # A pipeline devnet: the run's stage layout (set once the model is there, from its layer count); every
    # party is given it, the trainer forms groups of the `pipeline` members.
    boundaries: list[int] | None = None

    def run_flags(self) -> list[str]:
        """The run's parameters, the same for the trainer, the validator and every member."""
        env = [] if self.env_spec is None else ["--env", self.env_spec]
        kind = ["--run-kind", "synthetic"] if self.synthetic else []
        return ["--run-id", self.run_id, *env, *kind, *self.sizing.run_flags()]

    @property
    def accepted_dir(self) -> Path:
        return self.trainer_dir / "accepted"

    @property
    def dataset_dir(self) -> Path:
        return self.root / "dataset"

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        key = self.root / "operator.key"
        if key.exists():
            self.operator = Identity.load(key)
        else:
            self.operator = Identity.generate()
            self.operator.save(key)

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def trainer_dir(self) -> Path:
        return self.root / "trainer"

    @property
    def validator_dir(self) -> Path:
        return self.root / "validator"

    @property
    def metrics_path(self) -> Path:
        return self.trainer_dir / "trainer" / "metrics.jsonl"

    @property
    def ledger_path(self) -> Path:
        return self.validator_dir / "ledger.sqlite"

    @property
    def spool_dir(self) -> Path:
        return self.validator_dir / "spool"

    @property
    def weights_dir(self) -> Path:
        return self.trainer_dir / "weights"

    def add_member(self, name: str, attack: str | None = None, *, pipeline: bool = False) -> Member:
        data_dir = self.root / name
        data_dir.mkdir(parents=True, exist_ok=True)
        key = data_dir / "node.key"
        identity = Identity.load(key) if key.exists() else Identity.generate()
        if not key.exists():
            identity.save(key)
        member = Member(name, data_dir, identity.node_id, attack, pipeline or attack in PIPELINE_ATTACKS)
        self.members.append(member)
        return member

    def env(self) -> dict[str, str]:
        if self.boundaries is None:
            return dict(SWARM_ENV)
        # A group's batch is the run's (run.pipeline.prompts), not a node's own `--prompts`: the same sizing.
        layout: dict[str, object] = {"boundaries": self.boundaries}
        if self.sizing.prompts is not None:
            layout["prompts"] = self.sizing.prompts
        return {**SWARM_ENV, "PRIME_NODE_RUN__PIPELINE": json.dumps(layout)}

    def trainer_argv(self, max_steps: int | None) -> list[str]:
        """`max_steps` None: the trainer runs until the devnet stops it."""
        argv = [
            *CLI,
            "trainer",
            *(["--max-steps", str(max_steps)] if max_steps is not None else []),
            "--model",
            str(self.model_dir),
            "--key",
            str(self.root / "operator.key"),
            "--data-dir",
            str(self.trainer_dir),
            *self.run_flags(),
            "--swarm-run-id",
            self.run_id,
            "--listen",
            LOOPBACK,
            "--http-port",
            "0",
            "--metrics-port",
            "0",
            "--threads",
            "1",
        ]
        if self.sizing.batch_size is not None:
            argv += ["--batch-size", str(self.sizing.batch_size)]
        return argv

    def validator_argv(self, peers: list[str]) -> list[str]:
        argv = [
            *CLI,
            "validator",
            "--key",
            str(self.root / "operator.key"),
            "--data-dir",
            str(self.validator_dir),
            *self.run_flags(),
            "--listen",
            LOOPBACK,
            "--http-port",
            "0",
            "--threads",
            "1",
            "--accepted-dir",
            str(self.accepted_dir),
            "--peers",
            *peers,
        ]
        return argv

    def member_argv(self, member: Member, peers: list[str]) -> list[str]:
        head = [*CLI, "start"] if member.attack is None else [*ADVERSARY, "--attack", member.attack]
        stage: list[str] = []
        if member.pipeline:
            stage = ["--pipeline"]
            offered = PIPELINE_ATTACKS[member.attack].stages if member.attack in PIPELINE_ATTACKS else None
            if offered is not None:
                stage += ["--stages", *map(str, offered)]
        return [
            *head,
            *stage,
            "--data-dir",
            str(member.data_dir),
            "--operator-key",
            self.operator.node_id,
            *self.run_flags(),
            "--peers",
            *peers,
            "--host-maddrs",
            LOOPBACK,
            "--threads",
            "1",
            "--status-port",
            "0",  # several nodes on one host: each its own free port (`prime-node status` reads it)
            *self.sizing.node_flags(),
        ]

    def trainer_env(self) -> dict[str, str]:
        return {**self.env(), **TRAINER_ENV, **(GROUPS_ENV if self.boundaries is not None else {})}

    def validator_env(self) -> dict[str, str]:
        return {**self.env(), **(VALIDATOR_GROUPS_ENV if self.boundaries is not None else {})}

    def member_env(self) -> dict[str, str]:
        return {**self.env(), **NODE_ENV, **(STAGE_ENV if self.boundaries is not None else {})}
