"""`prime-node devnet --pipeline` end to end: a trainer (which forms the groups), a validator, one monolithic node,
three honest `start --pipeline` nodes and one pipeline node that perturbs its stage's weights, as processes on
127.0.0.1. Four stage nodes make two groups of two, so the cheater shares a group with an honest node and the
other group is honest: honest stage files accepted, the cheating stage slashed and banned (its check
`pipeline`), no honest node slashed, the live view showing the stages, every process gone at the end."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from prime_node.node.cli.devnet import succeeded
from prime_node.trainer.devnet.report import format_report
from prime_node.trainer.devnet.runner import Devnet, DevnetOptions
from prime_node.trainer.devnet.view import LiveView

from support.devnet import SMALL, assert_all_gone, tiny_model

# SMALL's length targets reach 17 with 16 new tokens at most: stage files holding a target beyond max_new_tokens
# are taken as rollout files with the same rows are (the validator, reading stage files with the run's limits,
# once refused them as `bounds`).
STAGE_SIZING = SMALL


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipeline_devnet_accepts_honest_stages_and_bans_the_cheating_stage(tmp_path: Path) -> None:
    out = io.StringIO()
    steps = 3
    options = DevnetOptions(
        root=tmp_path / "run",
        model_dir=tiny_model(tmp_path / "model"),
        nodes=1,
        attacks=["stage-weights"],
        steps=steps,
        sizing=STAGE_SIZING,
        stall_timeout_s=240.0,
        ban_wait_s=240.0,
        task_filter=None,
        pipeline_nodes=3,
    )
    devnet = Devnet(options, LiveView(steps, Console(file=out, width=160), live=False))
    report = devnet.run()
    text, shown = format_report(report), out.getvalue()
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


def test_a_pipeline_devnet_gives_every_party_the_layout_and_its_stage_nodes_their_flags(
    tmp_path: Path,
) -> None:
    from prime_node.trainer.devnet.layout import DevnetLayout
    from prime_node.trainer.devnet.runner import DevnetError, attack_kinds, two_stages

    model = tiny_model(tmp_path / "model")
    assert two_stages(model) == [0, 2, 4]
    assert attack_kinds(3, pipeline=True) == ["stage-weights", "stage-uncommitted", "stage-weights"]
    with pytest.raises(DevnetError, match="need --pipeline"):
        attack_kinds(1, ["stage-weights"])
    layout = DevnetLayout(tmp_path / "run", "devnet", model)
    plain = layout.add_member("node-1")
    stage = layout.add_member("stage-1", pipeline=True)
    cheat = layout.add_member("adv-1-stage-uncommitted", "stage-uncommitted")
    assert "PRIME_NODE_RUN__PIPELINE" not in layout.member_env()  # not a pipeline run until it has a layout
    layout.boundaries = two_stages(model)
    for env in (layout.env(), layout.trainer_env(), layout.member_env()):
        # The devnet's batch sizing is the run's pinned group batch, as every party must have it.
        assert env["PRIME_NODE_RUN__PIPELINE"] == '{"boundaries": [0, 2, 4], "prompts": 16}'
    assert "PRIME_NODE_GROUPS__POLL_S" in layout.trainer_env()
    assert "PRIME_NODE_PIPELINE__POLL_S" in layout.member_env()
    assert "--pipeline" not in layout.member_argv(plain, [])
    argv = layout.member_argv(stage, [])
    assert "--pipeline" in argv and "--stages" not in argv
    argv = layout.member_argv(cheat, [])  # activations are sent by stage 0 only: it offers no other
    assert argv[argv.index("--attack") + 1] == "stage-uncommitted"
    assert argv[argv.index("--stages") + 1 :][:2] == ["0", "--data-dir"]


def test_the_cheating_stages_cheat_as_described(tmp_path: Path) -> None:
    import torch

    from prime_node.node.cli.adversary import adversary_node
    from prime_node.node.contributor.settings import StartSettings
    from prime_node.node.errors import NodeError
    from prime_node.node.pipeline.stage import Outgoing
    from prime_node.node.pipeline.stage_model import StageModel
    from prime_node.p2p.pipeline.layout import StageLayout
    from prime_node.trainer.devnet.pipeline_attacks import perturbed_stage, uncommitted_activations

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
    key = "ab" * 32
    settings = StartSettings(operator_key=key, data_dir=tmp_path / "adv")
    with pytest.raises(NodeError, match="give --pipeline"):
        adversary_node("stage-weights", settings)
    # As the daemon uses them: through an instance of the adversary's stage class.
    pipelined = settings.model_copy(
        update={"pipeline": settings.pipeline.model_copy(update={"enabled": True})}
    )
    for kind in ("stage-uncommitted", "stage-weights"):
        stage_class = adversary_node(kind, pipelined).pipeline_stage
        stage = object.__new__(stage_class)  # the hooks only: no swarm, keeper or outbox behind it
        if kind == "stage-uncommitted":
            assert stage.tamper is not None and not torch.equal(
                stage.tamper(0, prefill).tensor, prefill.tensor
            )
        else:
            assert stage.tamper is None
            loaded = stage.load_stage(model, layout, 1)
            assert not torch.equal(next(loaded.layers.parameters()), next(honest.layers.parameters()))
