"""`prime-node devnet --pipeline` end to end: a trainer (which forms the groups), a validator, one monolithic node,
three honest `start --pipeline` nodes and one pipeline node that perturbs its stage's weights, as processes on
127.0.0.1. Four stage nodes make two groups of two, so the cheater shares a group with an honest node and the
other group is honest: honest stage files accepted, the cheating stage slashed and banned (its check
`pipeline`), no honest node slashed, the live view showing the stages, every process gone at the end. A second
run has a stage that kills itself mid-batch (`stage-dropout`): not punished, nothing of the broken batch accepted,
its group-mate's work of a new group accepted within a bound."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from prime_node.node.cli.devnet import succeeded
from prime_node.trainer.devnet.layout import Sizing
from prime_node.trainer.devnet.report import format_report
from prime_node.trainer.devnet.runner import Devnet, DevnetOptions
from prime_node.trainer.devnet.view import LiveView

from support.devnet import SMALL, assert_all_gone, tiny_model

# SMALL's length targets reach 17 with 16 new tokens at most: stage files holding a target beyond max_new_tokens
# are taken as rollout files with the same rows are (the validator, reading stage files with the run's limits,
# once refused them as `bounds`).
STAGE_SIZING = SMALL


def run_pipeline_devnet(
    tmp_path: Path,
    *,
    attack: str,
    nodes: int,
    pipeline_nodes: int,
    steps: int,
    sizing: Sizing = STAGE_SIZING,
) -> tuple[dict[str, Any], Devnet, str, str]:
    """A pipeline devnet with one adversary, run to its end: (report, devnet, formatted report, live view)."""
    out = io.StringIO()
    options = DevnetOptions(
        root=tmp_path / "run",
        model_dir=tiny_model(tmp_path / "model"),
        nodes=nodes,
        attacks=[attack],
        steps=steps,
        sizing=sizing,
        stall_timeout_s=240.0,
        ban_wait_s=240.0,
        task_filter=None,
        pipeline_nodes=pipeline_nodes,
    )
    devnet = Devnet(options, LiveView(steps, Console(file=out, width=160), live=False))
    report = devnet.run()
    return report, devnet, format_report(report), out.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipeline_devnet_accepts_honest_stages_and_bans_the_cheating_stage(tmp_path: Path) -> None:
    report, devnet, text, shown = run_pipeline_devnet(
        tmp_path, attack="stage-weights", nodes=1, pipeline_nodes=3, steps=3
    )
    assert report["error"] is None, text + shown
    (adversary,) = report["adversaries"]
    assert adversary["banned"] and adversary["accepted_files"] == 0 and adversary["rejected_files"] >= 1, text
    slashes = [s for s in report["slashed"] if s["name"] == adversary["name"]]
    assert slashes and {s["failed_check"] for s in slashes} == {"pipeline"}, text
    assert not [s for s in report["slashed"] if s["attack"] is None], "an honest node was slashed"
    stages = [r for r in report["leaderboard"] if r["name"].startswith("stage-")]
    assert any(r["accepted_files"] > 0 for r in stages), text
    assert report["honest"]["rejected_files"] == 0, text  # a cheater's group-mate is excused, not rejected
    assert succeeded(report)
    assert "(stage 0 of" in shown and "(stage 1 of" in shown and "BANNED" in shown, shown
    assert_all_gone(devnet, report)


# How long a survivor of the broken group may take from the kill to its first file of a new group accepted:
# the coordinator's 10 s heartbeat staleness, a group formed and confirmed, one batch, the validator's verdict
# (measured 15.2 s with no policy step in between on this shared 2-core machine; docs/devnet.md "Drop-outs").
REGROUP_BOUND_S = 90.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_stage_that_dies_mid_batch_is_not_punished_and_its_group_mate_regroups(tmp_path: Path) -> None:
    # Four honest stage nodes and the drop-out: it claims to be fast, so it is always in a group, and the
    # slowest honest node is left over to regroup with its group-mate after the kill. Steps of 12 group batches:
    # the trainer, whose coordinator forms the groups, must outlive the drop-out's batches, the kill and the
    # regroup (with 2-batch steps it once finished 4 steps before the drop-out had run 2 batches).
    report, devnet, text, shown = run_pipeline_devnet(
        tmp_path,
        attack="stage-dropout",
        nodes=0,
        pipeline_nodes=4,
        steps=2,
        sizing=dataclasses.replace(STAGE_SIZING, batch_size=48),
    )
    assert report["error"] is None, text + shown
    (dropout,) = report["dropouts"]
    (adversary,) = report["adversaries"]
    assert dropout["dropped"], text
    # A silent peer proves nothing: no slash, no ban, its earlier honest work stays credited.
    assert dropout["slashed"] == 0 and not dropout["banned"], text
    assert not report["slashed"] and not report["bans"], text
    # (A partial record of a batch that a new step's regroup broke counts as rejected, excused: not asserted.)
    assert adversary["accepted_files"] > 0, text
    # Nothing of the batch it broke is accepted; what its group-mate handed in of it is excused.
    assert dropout["broken_batch_accepted"] == 0, text
    assert all(f["verdict"] != "accepted" for f in dropout["broken_batch_files"]), text
    judged = [f["verdict"] for f in dropout["broken_batch_files"] if f["verdict"] is not None]
    assert set(judged) <= {"pipeline_incomplete"}, text
    assert report["honest"]["rejected_files"] == 0, text
    # Its group-mate is in a new group, whose file was accepted within the bound.
    regrouped = dropout["regrouped"]
    assert regrouped is not None and regrouped["group"] != dropout["group"], text
    assert regrouped["name"] in dropout["survivors"], text
    assert regrouped["kill_to_accepted_s"] < REGROUP_BOUND_S, text
    assert "killed itself (SIGKILL) mid-batch" in text and "dropped out: killed itself" in shown, text + shown
    assert succeeded(report)
    print(text)
    assert_all_gone(devnet, report)


def test_a_pipeline_devnet_gives_every_party_the_layout_and_its_stage_nodes_their_flags(
    tmp_path: Path,
) -> None:
    from prime_node.trainer.devnet.layout import DevnetLayout
    from prime_node.trainer.devnet.runner import DevnetError, attack_kinds, two_stages

    model = tiny_model(tmp_path / "model")
    assert two_stages(model) == [0, 2, 4]
    assert attack_kinds(5, pipeline=True) == [
        "stage-weights",
        "stage-uncommitted",
        "stage-tokens",
        "stage-dropout",
        "stage-weights",
    ]
    with pytest.raises(DevnetError, match="need --pipeline"):
        attack_kinds(1, ["stage-weights"])
    layout = DevnetLayout(tmp_path / "run", "devnet", model)
    plain = layout.add_member("node-1")
    stage = layout.add_member("stage-1", pipeline=True)
    cheat = layout.add_member("adv-1-stage-uncommitted", "stage-uncommitted")
    assert "PRIME_NODE_RUN__PIPELINE" not in layout.member_env()  # not a pipeline run until it has a layout
    layout.boundaries = two_stages(model)
    for env in (layout.env(), layout.trainer_env(), layout.validator_env(), layout.member_env()):
        # The devnet's batch sizing is the run's pinned group batch, as every party must have it.
        assert env["PRIME_NODE_RUN__PIPELINE"] == '{"boundaries": [0, 2, 4], "prompts": 16}'
    assert "PRIME_NODE_INTAKE__GROUP_GRACE_S" in layout.validator_env()  # a broken batch judged in seconds
    assert "PRIME_NODE_GROUPS__POLL_S" in layout.trainer_env()
    assert "PRIME_NODE_PIPELINE__POLL_S" in layout.member_env()
    assert "--pipeline" not in layout.member_argv(plain, [])
    argv = layout.member_argv(stage, [])
    assert "--pipeline" in argv and "--stages" not in argv
    argv = layout.member_argv(cheat, [])  # activations are sent by stage 0 only: it offers no other
    assert argv[argv.index("--attack") + 1] == "stage-uncommitted"
    assert argv[argv.index("--stages") + 1 :][:2] == ["0", "--data-dir"]
    argv = layout.member_argv(layout.add_member("adv-2-stage-tokens", "stage-tokens"), [])  # the sampler
    assert argv[argv.index("--stages") + 1 :][:2] == ["1", "--data-dir"]


def test_the_cheating_stages_cheat_as_described(tmp_path: Path) -> None:
    import torch

    from prime_node.node.cli.adversary import adversary_node
    from prime_node.node.contributor.settings import StartSettings
    from prime_node.node.errors import NodeError
    from prime_node.node.pipeline.stage import Outgoing
    from prime_node.node.pipeline.stage_model import StageModel
    from prime_node.p2p.pipeline.layout import StageLayout
    from prime_node.trainer.devnet.pipeline_attacks import (
        perturbed_stage,
        substituted_tokens,
        uncommitted_activations,
    )

    model, layout = tiny_model(tmp_path / "model"), StageLayout(boundaries=[0, 2, 4])
    honest, cheat = StageModel.load(model, layout, 1), perturbed_stage(model, layout, 1)
    pairs = list(zip(honest.layers.parameters(), cheat.layers.parameters(), strict=True))
    assert sum(not torch.equal(a, b) for a, b in pairs) >= len(pairs) // 2  # zeros (biases) stay zero
    assert all(
        torch.allclose(a, b, rtol=0.1, atol=1e-6) for a, b in pairs
    )  # close: a cheaper copy, not noise
    tamper = uncommitted_activations()
    prefill = Outgoing(
        "prefill",
        0,
        0,
        [0, 1],
        torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0)),
        "float32",
        b"c",
    )
    sent = tamper(0, prefill)
    assert not torch.equal(sent.tensor, prefill.tensor) and sent.commitment == prefill.commitment
    later = Outgoing("prefill", 1, 0, [2], torch.ones(1, 3, 8), "float32", b"c")
    assert tamper(0, later) is later
    # The last stage's substitute: one token of micro-batch 0's step 1, another id than it sampled.
    substitute = substituted_tokens()
    tokens = Outgoing("tokens", 0, 1, [0, 1], torch.tensor([0, 7]), "int64", b"")
    swapped = substitute(1, tokens)
    assert swapped.tensor.tolist() == [1, 7] and tokens.tensor.tolist() == [0, 7]
    assert substitute(1, Outgoing("tokens", 0, 1, [0], torch.tensor([5]), "int64", b"")).tensor.tolist() == [
        4
    ]
    for untouched in (
        Outgoing("tokens", 0, 0, [0, 1], torch.tensor([0, 7]), "int64", b""),
        Outgoing("tokens", 1, 1, [2], torch.tensor([3]), "int64", b""),
    ):
        assert substitute(1, untouched) is untouched
    key = "ab" * 32
    settings = StartSettings(operator_key=key, data_dir=tmp_path / "adv")
    with pytest.raises(NodeError, match="give --pipeline"):
        adversary_node("stage-weights", settings)
    # As the daemon uses them: through an instance of the adversary's stage class.
    pipelined = settings.model_copy(
        update={"pipeline": settings.pipeline.model_copy(update={"enabled": True})}
    )
    for kind in ("stage-uncommitted", "stage-tokens", "stage-weights"):
        stage_class = adversary_node(kind, pipelined).pipeline_stage
        stage = object.__new__(stage_class)  # the hooks only: no swarm, keeper or outbox behind it
        if kind == "stage-uncommitted":
            assert stage.tamper is not None and not torch.equal(
                stage.tamper(0, prefill).tensor, prefill.tensor
            )
        elif kind == "stage-tokens":
            assert stage.tamper is not None and stage.tamper(1, tokens).tensor.tolist() == [1, 7]
        else:
            assert stage.tamper is None
            loaded = stage.load_stage(model, layout, 1)
            assert not torch.equal(next(loaded.layers.parameters()), next(honest.layers.parameters()))


def test_a_drop_out_is_due_after_its_batches_and_kills_its_whole_process_group(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    import torch

    from prime_node.node.cli.adversary import DropOutStage, adversary_node
    from prime_node.node.contributor.settings import StartSettings
    from prime_node.node.pipeline.stage import Outgoing
    from prime_node.p2p.processes import pid_alive
    from prime_node.trainer.devnet.dropout_record import DROPOUT_FILE, read_drop_out
    from prime_node.trainer.devnet.pipeline_attacks import PIPELINE_ATTACKS, DropOut

    rule = DropOut(after_batches=2, at_step=2)

    def frame(step: int) -> Outgoing:
        return Outgoing("decode", 0, step, [0], torch.zeros(1, 1, 8), "float32", b"c")

    assert rule.due(2, 0, frame(2)) and rule.due(5, 0, frame(9))
    assert not rule.due(1, 0, frame(2))  # its honest batches first
    assert not rule.due(2, 1, frame(2))  # and their files handed off
    assert not rule.due(2, 0, frame(1))  # only once its successor answered a step of this batch

    settings = StartSettings(operator_key="ab" * 32, data_dir=tmp_path / "adv")
    pipelined = settings.model_copy(
        update={"pipeline": settings.pipeline.model_copy(update={"enabled": True})}
    )
    stage_class = adversary_node("stage-dropout", pipelined).pipeline_stage
    assert (
        issubclass(stage_class, DropOutStage)
        and stage_class.drop_out == PIPELINE_ATTACKS["stage-dropout"].drop_out
    )

    # The kill itself, in a process that leads its own session (as the devnet starts every member) with a child
    # in its group (as its DHT child and p2pd are): both gone, the record written first.
    script = """
import subprocess, sys, time
from pathlib import Path
from prime_node.trainer.devnet.dropout_record import DropOutRecord, drop_out_now
child = subprocess.Popen(["sleep", "120"])
print(child.pid, flush=True)
record = DropOutRecord(
    at=time.time(), group_id="cd" * 32, policy_step=2, batch=3, stage=1, members=["a", "b"], pid=0
)
drop_out_now(Path(sys.argv[1]), record)
"""
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / DROPOUT_FILE)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        child = int(process.stdout.readline())
        assert process.wait(timeout=60) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(child), "the drop-out's child outlived it"
    finally:
        if process.poll() is None:
            process.kill()
    record = read_drop_out(tmp_path)
    assert record is not None and record.batch == 3 and record.group_id == "cd" * 32
    assert read_drop_out(tmp_path / "elsewhere") is None
