"""`prime-node rollout` and `prime-node verify`: exit codes and output, run in-process on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prime_node.node.cli.main import main
from prime_node.p2p.identity import Identity

from support.attack import make_checkpoint


@pytest.fixture(scope="module")
def produced(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    checkpoint = make_checkpoint(root / "ckpt")
    key = root / "node.key"
    Identity.from_seed(b"\x33" * 32).save(key)
    out = root / "batch.parquet"
    argv = [
        "rollout",
        "--checkpoint",
        str(checkpoint),
        "--key",
        str(key),
        "--step",
        "5",
        "--out",
        str(out),
        "--batch-counter",
        "2",
        "--prompts",
        "2",
        "--samples",
        "2",
        "--run-seed",
        "9",
        "--max-new-tokens",
        "36",
        "--json",
        "--log-level",
        "WARNING",
    ]
    assert main(argv) == 0
    return checkpoint, out


def _verify(capsys, *argv: str, max_new_tokens: str | None = "36") -> tuple[int, str]:
    """`prime-node verify` for the run the files above belong to (max_new_tokens 36; None: the default)."""
    capsys.readouterr()
    run = ["--max-new-tokens", max_new_tokens] if max_new_tokens else []
    code = main(["verify", *argv, *run, "--log-level", "WARNING"])
    return code, capsys.readouterr().out


def test_rollout_then_verify_accepts(produced, capsys):
    checkpoint, out = produced
    assert out.exists() and Path(f"{out}.sig").exists()
    code, text = _verify(
        capsys, str(out), "--checkpoint", str(checkpoint), "--run-seed", "9", "--samples", "2", "--json"
    )
    report = json.loads(text)
    assert code == 0 and report["accepted"] is True and report["reasons"] == []
    assert [c["name"] for c in report["checks"]][:5] == ["signature", "schema", "limits", "decode", "signer"]
    assert all(c["status"] == "passed" for c in report["checks"])
    code, text = _verify(
        capsys,
        str(out),
        "--checkpoint",
        str(checkpoint),
        "--run-seed",
        "9",
        "--samples",
        "2",
        "--sample-fraction",
        "0.5",
    )
    assert code == 0 and "ACCEPTED" in text


def test_verify_rejects_with_reason(produced, capsys, tmp_path: Path):
    checkpoint, out = produced
    # the wrong run seed: the node's sample indices no longer match its assignment
    code, text = _verify(
        capsys, str(out), "--checkpoint", str(checkpoint), "--run-seed", "8", "--samples", "2", "--json"
    )
    report = json.loads(text)
    assert code == 1 and report["accepted"] is False
    assert report["reasons"][0].startswith("assignment: ")
    code, text = _verify(
        capsys,
        str(out),
        "--checkpoint",
        str(checkpoint),
        "--run-seed",
        "9",
        "--samples",
        "2",
        "--run-id",
        "another",
    )
    assert code == 1 and "belongs to run 'local'" in text
    # The run's sampling binds the file: another max_new_tokens or temperature than the run's is refused.
    code, text = _verify(
        capsys,
        str(out),
        "--checkpoint",
        str(checkpoint),
        "--run-seed",
        "9",
        "--samples",
        "2",
        max_new_tokens=None,
    )
    assert code == 1 and "REJECTED: run-parameters: row 0: max_new_tokens 36; the run's is 64" in text, text
    code, text = _verify(
        capsys,
        str(out),
        "--checkpoint",
        str(checkpoint),
        "--run-seed",
        "9",
        "--samples",
        "2",
        "--temperature",
        "0.7",
    )
    assert (
        code == 1 and "run-parameters: row 0: sampled at temperature 1.0; the run samples at 0.7" in text
    ), text
    tampered = tmp_path / "t.parquet"
    data = bytearray(out.read_bytes())
    data[-40] ^= 1
    tampered.write_bytes(bytes(data))
    Path(f"{tampered}.sig").write_bytes(Path(f"{out}.sig").read_bytes())
    code, text = _verify(capsys, str(tampered), "--checkpoint", str(checkpoint), "--run-seed", "9")
    assert code == 1 and "REJECTED: signature:" in text


def test_verify_usage_and_io_errors(produced, capsys, tmp_path: Path):
    checkpoint, out = produced
    assert main(["verify", str(tmp_path / "missing.parquet"), "--checkpoint", str(checkpoint)]) == 2
    assert main(["verify", str(out), "--checkpoint", str(tmp_path / "no-model")]) == 2
    assert main(["verify", str(out), "--checkpoint", str(checkpoint), "--sample-fraction", "0"]) == 2
    with pytest.raises(SystemExit) as info:
        main(["verify", str(out)])  # --checkpoint is required
    assert info.value.code == 2


def test_the_runs_compute_dtype_binds_the_node_engine_and_the_proof_bounds(tmp_path: Path, capsys):
    """run.compute_dtype is one setting for both sides: a bf16 rollout passes a bf16 run's verify and fails a
    float32 run's (the strict bounds see the rounding), and a node whose engine disagrees is stopped early."""
    from prime_node.node.engine import EngineSettings
    from prime_node.node.errors import NodeError
    from prime_node.node.run.settings import RunSettings, engine_for_run, validator_engine, verifier_for_run
    from prime_node.proofs.verifier import VerifierSettings

    run = RunSettings(compute_dtype="bfloat16", run_id="r", run_seed=3, samples=2)
    assert engine_for_run(EngineSettings(), run).dtype == "bfloat16"
    assert verifier_for_run(VerifierSettings(), run).node_precision == "bfloat16"
    with pytest.raises(NodeError, match="engine.dtype is float32 but the run computes in bfloat16"):
        engine_for_run(EngineSettings(dtype="float32"), run)
    # The validator prefills in float32 whatever the run: the bounds were calibrated against that.
    assert validator_engine(EngineSettings()).dtype == "float32"
    with pytest.raises(NodeError, match="a validator prefills in float32"):
        validator_engine(EngineSettings(dtype="bfloat16"))

    checkpoint = make_checkpoint(tmp_path / "ckpt")
    key = tmp_path / "node.key"
    Identity.from_seed(b"\x34" * 32).save(key)
    out = tmp_path / "bf16.parquet"
    assert (
        main(
            [
                "rollout",
                "--checkpoint",
                str(checkpoint),
                "--key",
                str(key),
                "--step",
                "0",
                "--out",
                str(out),
                "--prompts",
                "4",
                "--samples",
                "2",
                "--max-new-tokens",
                "36",
                "--compute-dtype",
                "bfloat16",
                "--log-level",
                "WARNING",
            ]
        )
        == 0
    )
    common = [str(out), "--checkpoint", str(checkpoint), "--samples", "2", "--json"]
    code, text = _verify(capsys, *common, "--compute-dtype", "bfloat16")
    assert code == 0, text
    code, text = _verify(capsys, *common)
    report = json.loads(text)
    assert code == 1 and report["reasons"][0].startswith("toploc: "), report["reasons"]
