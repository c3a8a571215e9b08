"""A cheating contributor as a real process: `python -m prime_node.node.cli.adversary --attack KIND ...`.

It is the contributor daemon (`prime-node start`: same flags, own key and data directory, DHT membership,
verified checkpoint fetch, outbox and hand-off to a validator) with the rollout producer swapped for one
of trainer/devnet/attacks.py. Once the operator's ban of it shows up in the DHT it stops generating (its
files would be refused at the door anyway) and idles until stopped, so it does not steal CPU from the
honest nodes of a one-machine devnet. A pipeline attack (trainer/devnet/pipeline_attacks.py, with
`--pipeline`) is a `start --pipeline` node whose stage is loaded or sends otherwise; once banned, the operator's
coordinator no longer puts it in a group. `stage-dropout` works honestly until it kills itself mid-batch
(`DropOutStage`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ...trainer.devnet.attacks import ATTACKS, attack_producer
from ...trainer.devnet.dropout_record import DROPOUT_FILE, DropOutRecord, drop_out_now
from ...trainer.devnet.pipeline_attacks import PIPELINE_ATTACKS, DropOut
from ...trainer.errors import TrainerError
from ..contributor.daemon import ContributorNode
from ..contributor.pipeline_stage import PipelineStage
from ..contributor.rollout_loop import RolloutLoop
from ..contributor.settings import StartSettings
from ..errors import NodeError
from ..pipeline.stage import Outgoing
from . import start as start_cli
from .flags import load_settings

logger = logging.getLogger(__name__)

BANNED_IDLE_S = 1.0


class AttackLoop(RolloutLoop):
    """The honest rollout loop with a cheating producer; gives up once banned."""

    attack = "perturbed"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.produce = attack_producer(self.attack)  # type: ignore[assignment]

    banned = False

    async def produce_one(self, step: int) -> None:
        # The peers watcher reports our ban as the last error; later errors may replace it, so remember it.
        self.banned = self.banned or "banned" in (self.state.last_error or "")
        if self.banned:
            self.state.state = f"banned by the operator ({self.attack}); idle"
            await asyncio.sleep(BANNED_IDLE_S)
            return
        await super().produce_one(step)


class DropOutStage(PipelineStage):
    """A pipeline stage that runs its batches honestly until its `drop_out` is due, then writes down the batch in
    flight and SIGKILLs its process group from inside the send path (trainer/devnet/pipeline_attacks.py
    `DropOut`): the batch is broken with frames already exchanged, as when a machine dies mid-batch."""

    drop_out: DropOut = DropOut()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tamper = self._drop_when_due

    def _drop_when_due(self, stage: int, out: Outgoing) -> Outgoing:
        in_flight, group, status = self.host.in_flight if self.host else None, self.group, self.state.pipeline
        if in_flight is None or group is None or in_flight[0] != group.group_id or status is None:
            return out
        if out.step < self.drop_out.at_step:  # not yet: and no need to look at the outbox on every frame
            return out
        # Only in a group of the newest step it knows of: a group of an older one is about to be dissolved for the
        # new step anyway, which would hide the dissolution for a silent member that this adversary is to show.
        if group.policy_step != self.state.announced_step:
            return out
        # A glob of the outbox's pending/ (a few files) on the loop, once per frame until it drops: the hook is
        # synchronous, and a devnet adversary's pause of a millisecond harms nobody.
        if self.drop_out.due(status.batches, self.outbox.pending_count(), out):
            record = DropOutRecord(
                at=time.time(),
                group_id=group.group_id,
                policy_step=group.policy_step,
                batch=in_flight[1],
                stage=stage,
                members=list(group.members),
                pid=os.getpid(),
            )
            logger.warning(
                "adversary stage-dropout: killing this node mid-batch (batch %d of group %s…, %s frame of step %d)",
                record.batch,
                record.group_id[:16],
                out.kind,
                out.step,
            )
            drop_out_now(self.settings.resolved_data_dir() / DROPOUT_FILE, record)
        return out


def adversary_node(attack: str, settings: StartSettings) -> ContributorNode:
    """A ContributorNode whose rollout loop (or, for a pipeline attack, whose stage) cheats with `attack`."""
    if attack in PIPELINE_ATTACKS:
        if not settings.pipeline.enabled:
            raise NodeError(f"attack {attack} is a pipeline stage's: give --pipeline too")
        cheat = PIPELINE_ATTACKS[attack]
        # staticmethod: plain functions, not methods of the stage (a class attribute would bind `self`).
        hooks: dict[str, object] = {"load_stage": staticmethod(cheat.load_stage)}
        if cheat.tamper is not None:
            hooks["tamper"] = staticmethod(cheat.tamper)
        if cheat.measure_throughput is not None:
            hooks["measure_throughput"] = staticmethod(cheat.measure_throughput)
        base: type[PipelineStage] = PipelineStage
        if cheat.drop_out is not None:
            base, hooks["drop_out"] = DropOutStage, cheat.drop_out
        stage_class = type(f"AttackStage[{attack}]", (base,), hooks)
        return type("AdversaryNode", (ContributorNode,), {"pipeline_stage": stage_class})(settings)
    loop_class = type(f"AttackLoop[{attack}]", (AttackLoop,), {"attack": attack})
    node_class = type("AdversaryNode", (ContributorNode,), {"rollout_loop": loop_class})
    return node_class(settings)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m prime_node.node.cli.adversary",
        description="A devnet contributor that cheats in one way (for demos and tests). Any other argument is "
        "a `prime-node start` flag.",
    )
    parser.add_argument(
        "--attack", required=True, choices=sorted([*ATTACKS, *PIPELINE_ATTACKS]), help="how to cheat"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    start_parser = argparse.ArgumentParser(prog="adversary")
    start_cli.register(start_parser.add_subparsers(dest="command"))
    start_args = start_parser.parse_args(["start", *rest])
    try:
        settings = load_settings(start_args, StartSettings)
        logging.getLogger("prime_node.node.run.producer").setLevel(logging.WARNING)
        logger.warning("adversary %s: this node cheats on purpose (devnet harness)", args.attack)
        return asyncio.run(adversary_node(args.attack, settings).run())
    except (NodeError, TrainerError) as exc:
        print(f"adversary: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
