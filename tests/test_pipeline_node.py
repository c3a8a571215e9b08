"""`prime-node start --pipeline` end to end on 127.0.0.1: two (or three) real node processes fetch the operator's
checkpoint, offer stages, are put in one group by the operator's GroupCoordinator (the trainer's, here on the
validator's operator-keyed peer), run its batches over libp2p and hand their stage files to the real validator
service, which accepts and credits them; `prime-node status` shows the stage; SIGTERM stops each node cleanly
(exit 0). With three, the middle stage's files are accepted too: it learns the tokens from the end frames."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from prime_node.node.run.announcement import run_parameters
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.weights.publish import publish
from prime_node.p2p.weights.server import ServeSettings, WeightsServer
from prime_node.p2p.weights.store import Store
from prime_node.trainer.devnet.processes import ProcessGroup
from prime_node.trainer.groups.coordinator import GroupCoordinator
from prime_node.trainer.groups.plan import PlanSettings

from support.node_daemon import NODE_ENV, node_status, poll
from support.swarm import cancel_and_wait
from support.validator import OPERATOR, RUN, VALIDATOR_RUN, running_validator, validator_settings

# One prompt per group batch, cut in micro-batches of one: the run pins them, every member and the validator.
LAYOUT = StageLayout(boundaries=[0, 2, 4], prompts=1, micro_batch_size=1)
# Three stages: the middle one learns the sampled tokens from its predecessor's end frame (wire v4).
LAYOUT_3 = StageLayout(boundaries=[0, 1, 2, 4], prompts=1, micro_batch_size=1)
PIPELINED = VALIDATOR_RUN.model_copy(update={"pipeline": LAYOUT})
STALE_S = 8.0
PIPELINE_ENV = {
    **NODE_ENV,
    "PRIME_NODE_RUN__PIPELINE": LAYOUT.model_dump_json(),
    "PRIME_NODE_PIPELINE__POLL_S": "0.5",
    "PRIME_NODE_PIPELINE__STALE_AFTER_S": str(STALE_S),
    "PRIME_NODE_PIPELINE__ROUND_GRACE_S": "3",
    "PRIME_NODE_PIPELINE__CONNECT_TIMEOUT_S": "15",
    "PRIME_NODE_PIPELINE__FRAME_TIMEOUT_S": "20",
    "PRIME_NODE_ENGINE__THREADS": "1",
    "OMP_NUM_THREADS": "1",
}


def pipeline_argv(data_dir: Path, peers: list[str], stage: int) -> list[str]:
    run = PIPELINED  # the layout itself comes in the environment (PRIME_NODE_RUN__PIPELINE)
    return [
        *(sys.executable, "-m", "prime_node.node.cli.main", "start", "--pipeline"),
        *("--data-dir", str(data_dir), "--operator-key", OPERATOR.node_id, "--peers", *peers),
        *("--run-id", RUN, "--run-seed", str(run.run_seed), "--samples", str(run.samples)),
        *("--temperature", str(run.temperature), "--max-new-tokens", str(run.max_new_tokens)),
        *("--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--reachability", "public"),
        *("--threads", "1", "--status-port", "0"),
        *("--stages", str(stage)),  # one stage each: each node fetches only that stage's shards
    ]


def node_id_of(data_dir: Path) -> str:
    return Identity.load(data_dir / "node.key").node_id


@pytest.mark.slow
@pytest.mark.parametrize("layout", [LAYOUT, LAYOUT_3], ids=["2-stage", "3-stage"])
async def test_pipeline_nodes_form_a_group_and_their_stage_files_are_accepted(
    tmp_path: Path,
    world,  # noqa: ANN001
    layout: StageLayout,
) -> None:
    checkpoint, _, _ = world
    pipelined = VALIDATOR_RUN.model_copy(update={"pipeline": layout})
    settings = validator_settings(tmp_path / "validator", group_grace_s=30.0).model_copy(
        update={"run": pipelined}
    )
    weights = settings.resolved_data_dir() / "validator-weights"  # the validator's store, served to the nodes
    manifest, _ = publish(
        checkpoint, step=0, identity=OPERATOR, out_dir=weights, shard_size=64 << 10, run_id=RUN
    )
    server = WeightsServer(Store(weights), ServeSettings(port=0, scan_interval_s=0.5), OPERATOR.node_id)
    url = await server.start()
    dirs = [tmp_path / f"stage-node-{i}" for i in range(layout.stages)]
    for data_dir in dirs:
        data_dir.mkdir()
        Identity.generate().save(data_dir / "node.key")
    try:
        async with running_validator(settings, announce=False) as running:
            operator = (
                running.swarm
            )  # the operator's key signs the policy, the group records and the verdicts
            assert await operator.publish_policy(0, manifest.digest, [url], run_parameters(pipelined))
            coordinator = GroupCoordinator(
                operator,
                layout,
                lambda: 0,
                PlanSettings(stale_after_s=STALE_S, confirm_within_s=60.0),
                poll_s=0.5,
            )
            coordinating = asyncio.create_task(coordinator.run(), name="test-group-coordinator")
            try:
                await _run_nodes(tmp_path, running, coordinator, dirs, layout)
            finally:
                await cancel_and_wait([coordinating])
    finally:
        await server.stop()


async def _run_nodes(
    tmp_path: Path,
    running,  # noqa: ANN001
    coordinator: GroupCoordinator,
    dirs: list[Path],
    layout: StageLayout,
) -> None:
    env = {**PIPELINE_ENV, "PRIME_NODE_RUN__PIPELINE": layout.model_dump_json()}
    with ProcessGroup(tmp_path / "logs") as children:
        nodes = [
            children.start(d.name, pipeline_argv(d, running.maddrs[:1], stage), env=env)
            for stage, d in enumerate(dirs)
        ]
        ledger = running.service.ledger.ledger

        def accepted(node_id: str) -> int:
            rows = ledger.query(
                "SELECT COUNT(*) AS n FROM contributions WHERE node_id = ? AND accepted = 1",
                (node_id,),
            )
            return rows[0]["n"]

        for node, data_dir in zip(nodes, dirs, strict=True):
            node_id = await poll(lambda d=data_dir: (d / "node.key").exists() and node_id_of(d), 120, "a key")
            await poll(lambda n=node_id: accepted(n) > 0, 300, f"an accepted stage file of {node.name}", node)
        (group,) = coordinator.state.current
        ids = [node_id_of(d) for d in dirs]
        assert sorted(group.members) == sorted(ids)
        for node_id in ids:  # honest stages: nothing slashed, whatever else was judged meanwhile
            slashes = ledger.query("SELECT COUNT(*) AS n FROM slashes WHERE node_id = ?", (node_id,))
            assert slashes[0]["n"] == 0
        status = await asyncio.to_thread(node_status, dirs[0])
        assert status is not None and status["pipeline"]["group_id"] == group.group_id
        assert status["pipeline"]["batches"] >= 1 and status["pipeline"]["stage_files"] >= 1
        marks = json.loads((dirs[0] / "pipeline" / "batch_marks.json").read_text())
        (run_marks,) = [run[-1] for run in marks["runs"] if run[0] == RUN]  # kept per run
        assert {entry[0]: entry[2] for entry in run_marks}[group.group_id] >= 1  # [group, step, next, formed]
        for data_dir in dirs:  # each holds only its stage's shards of the checkpoint, never the whole
            store = Store(data_dir / "checkpoints")
            held = store.holdings(0)
            assert store.versions() == [] and held is not None
            assert len(held.done) < len(held.manifest.body.shards)
        for node in nodes:  # a clean stop: the stage task cancelled, the daemon's shutdown bounded
            os.killpg(node.pid, signal.SIGTERM)
        for node in nodes:
            assert await asyncio.to_thread(node.process.wait, 60) == 0, node.log_tail(40)


def test_a_stage_node_cuts_group_batches_as_the_run_pins_them_not_by_its_own_prompts(tmp_path: Path) -> None:
    # A node's own `prompts` sizes its monolithic rollout files; a group's batches must be cut alike by every
    # member, so a stage node adopts the run's (run.pipeline) and says so when its own setting differs.
    from prime_node.node.config import load_config
    from prime_node.node.contributor.pipeline_stage import own_prompts_note
    from prime_node.node.contributor.settings import StartSettings
    from prime_node.node.pipeline.work import GroupBatch

    env = {"PRIME_NODE_RUN__PIPELINE": LAYOUT.model_dump_json(), "PRIME_NODE_PIPELINE__ENABLED": "true"}
    own = load_config(StartSettings, env={**env, "PRIME_NODE_PROMPTS": "8"})
    assert own_prompts_note(own, LAYOUT) == (
        "prompts = 8 set here is not used for pipelined groups: a group's batch has the run's "
        "run.pipeline.prompts = 1 problems (every member must cut alike); using 1"
    )
    assert own_prompts_note(load_config(StartSettings, env=env), LAYOUT) is None  # not set: nothing to say
    assert (
        own_prompts_note(load_config(StartSettings, env={**env, "PRIME_NODE_PROMPTS": "1"}), LAYOUT) is None
    )
    batch = GroupBatch.pinned(LAYOUT, "ab" * 32, 3, 7)
    assert (batch.prompts, batch.micro_batch_size) == (LAYOUT.prompts, LAYOUT.micro_batch_size) == (1, 1)
    assert batch.pinned_difference(LAYOUT) is None
    assert GroupBatch("ab" * 32, 3, 7, 8, 2).pinned_difference(LAYOUT) == (
        "prompts 8, the run's 1; micro_batch_size 2, the run's 1"
    )
