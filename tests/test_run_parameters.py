"""The run fixes sampling for everyone: a node that honestly declares its own temperature or max_new_tokens
(every proof holds at the declared values) is refused, and configs of the old layout say where they went."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from prime_node.node.config import load_config
from prime_node.node.contributor.settings import StartSettings
from prime_node.node.errors import ConfigError
from prime_node.node.run.settings import RolloutSettings, RunSettings, VerifySettings, verifier_for_run
from prime_node.proofs.sampling import SamplingThresholds
from prime_node.proofs.toploc import ToplocThresholds
from prime_node.proofs.verifier import VerifierSettings
from prime_node.trainer.validator.config import ValidatorSettings

from support.attack import SPEC, build_world, honest_rows, rejected_by, verify, write_honest


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (
            {"temperature": 0.3},
            "row 0: sampled at temperature 0.3; the run samples at 1.0",
        ),  # cooler: higher rewards
        ({"max_new_tokens": 4}, "row 0: max_new_tokens 4; the run's is 40"),  # shorter: cheaper work
    ],
)
def test_declared_sampling_other_than_the_runs_is_rejected(world, tmp_path: Path, change, reason):
    engine, tasks, _ = world
    rows = honest_rows(engine, tasks, dataclasses.replace(SPEC, **change))  # generated and proven honestly
    path = write_honest(tmp_path / "declared.parquet", rows)
    report = verify(path, engine, tasks)
    assert rejected_by(report) == "run-parameters" and report.reasons == [f"run-parameters: {reason}"]
    # Only the pin catches it: every proof holds at the declared values.
    unpinned = verify(path, engine, tasks, temperature=None, max_new_tokens=None)
    assert unpinned.accepted, unpinned.reasons
    assert "(temperature and max_new_tokens not pinned)" in next(
        c.detail for c in unpinned.checks if c.name == "run-parameters"
    )


def test_verifier_for_run_pins_the_runs_sampling():
    run = RunSettings(run_id="r", temperature=0.8, max_new_tokens=128)
    bound = verifier_for_run(VerifierSettings(), run)
    assert (bound.temperature, bound.max_new_tokens, bound.run_id) == (0.8, 128, "r")


@pytest.mark.parametrize("model", [VerifySettings, ValidatorSettings])
def test_verifier_settings_the_run_sets_are_refused_with_their_place(model, tmp_path: Path):
    # verifier_for_run replaces them: accepted, they would be ignored while the operator believes them in force.
    config = tmp_path / "validator.toml"
    for key, value, new in [
        ("temperature", "0.7", "run.temperature"),
        ("max_new_tokens", "16", "run.max_new_tokens"),
        ("samples_per_prompt", "4", "run.samples"),
        ("node_precision", '"bfloat16"', "run.compute_dtype"),
        ("run_id", '"r"', "run.run_id"),
        ("run_seed", "3", "run.run_seed"),
    ]:
        config.write_text(f"[verifier]\n{key} = {value}\n")
        with pytest.raises(ConfigError, match=rf"'verifier.{key}' \(from config file .*\) is now '{new}'"):
            load_config(model, toml_path=config, env={})
    with pytest.raises(
        ConfigError, match="'verifier.temperature' .*environment variable.* PRIME_NODE_RUN__TEMPERATURE"
    ):
        load_config(model, env={"PRIME_NODE_VERIFIER__TEMPERATURE": "0.7"})
    # The verifier's own settings stay where they are.
    config.write_text("[verifier]\nsample_fraction = 0.5\n[run]\ntemperature = 0.7\n")
    settings = load_config(model, toml_path=config, env={})
    bound = verifier_for_run(settings.verifier, settings.run)
    assert (bound.sample_fraction, bound.temperature) == (0.5, 0.7)


@pytest.mark.parametrize("model", [StartSettings, RolloutSettings])
def test_sampling_settings_of_the_old_layout_say_where_they_moved(model, tmp_path: Path):
    config = tmp_path / "old.toml"
    config.write_text("temperature = 0.7\n")
    with pytest.raises(
        ConfigError,
        match=r"'temperature' \(from config file .*\) is now 'run.temperature': "
        r"in a config file write `temperature = ...` under \[run\]",
    ):
        load_config(model, toml_path=config, env={})
    with pytest.raises(ConfigError, match="PRIME_NODE_RUN__MAX_NEW_TOKENS"):
        load_config(model, env={"PRIME_NODE_MAX_NEW_TOKENS": "16"})
    config.write_text("[run]\ntemperature = 0.7\nmax_new_tokens = 16\n")
    settings = load_config(model, toml_path=config, env={"PRIME_NODE_RUN__MAX_NEW_TOKENS": "20"})
    assert (settings.run.temperature, settings.run.max_new_tokens) == (0.7, 20)


def test_partial_threshold_overrides_keep_the_declared_precisions_calibration():
    # Setting one TOPLOC bound for a float32 run must not silently loosen the others to the bf16 set.
    settings = VerifierSettings(
        toploc=ToplocThresholds(max_exp_mismatches=5), sampling=SamplingThresholds(max_abs_z=7)
    )
    calibrated = ToplocThresholds.for_precision("float32")
    assert settings.toploc_thresholds() == calibrated.model_copy(update={"max_exp_mismatches": 5})
    assert (
        settings.toploc_thresholds().max_typical_mant_err_mean
        == calibrated.max_typical_mant_err_mean
        != ToplocThresholds().max_typical_mant_err_mean
    )
    assert settings.sampling_thresholds() == SamplingThresholds.for_precision("float32").model_copy(
        update={"max_abs_z": 7}
    )
    bf16 = VerifierSettings(
        node_precision="bfloat16", sampling=SamplingThresholds(max_abs_z=7)
    ).sampling_thresholds()
    assert bf16.margin == SamplingThresholds.for_precision("bfloat16").margin and bf16.max_abs_z == 7


def test_length_targets_are_bounded_like_the_policy_record_announcing_them():
    assert RunSettings(length_targets=[1, 1_000_000]).length_targets == [1, 1_000_000]
    for bad in ([0], [1_000_001], [8] * 33):
        with pytest.raises(ValueError, match="length_targets"):
            RunSettings(length_targets=bad)


def test_a_nodes_own_micro_batch_size_moved_to_the_runs_pinned_layout(tmp_path: Path):
    # Every member of a group must cut its batches alike: the cut is the run's (run.pipeline), pinned by the
    # announcement and the group record, and the old node setting says where it lives now.
    config = tmp_path / "old.toml"
    config.write_text("[pipeline]\nmicro_batch_size = 4\n")
    with pytest.raises(
        ConfigError, match=r"'pipeline.micro_batch_size' .* is now 'run.pipeline.micro_batch_size'"
    ):
        load_config(StartSettings, toml_path=config, env={})
    config.write_text("[run.pipeline]\nboundaries = [0, 2, 4]\nprompts = 3\nmicro_batch_size = 4\n")
    layout = load_config(StartSettings, toml_path=config, env={}).run.pipeline
    assert layout is not None and (layout.prompts, layout.micro_batch_size) == (3, 4)
