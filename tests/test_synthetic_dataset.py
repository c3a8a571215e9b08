"""`prime-node dataset build`: only rows a trusted validator accepted, readable by pandas and datasets.

The world (tests/support/synthetic.py) holds honest files accepted by the real verifier and a cheater's
forged files in every position a hostile peer or a stray writer could put them: replacing the bytes of an
accepted file, accepted by an untrusted key, rejected, and never judged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from prime_node.node.run.settings import RunSettings
from prime_node.p2p.verdicts import Verdict, open_signed
from prime_node.trainer.dataset.build import build_dataset
from prime_node.trainer.dataset.errors import DatasetError
from prime_node.trainer.dataset.settings import DatasetSection

from support.synthetic import OPERATOR, VALIDATOR, SyntheticWorld, build_world
from support.trainer_service import LENGTH_ALPHA, LENGTH_TARGETS, RUN_ID

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> SyntheticWorld:
    return build_world(tmp_path_factory.mktemp("synthetic"))


def _run() -> RunSettings:
    return RunSettings(
        run_id=RUN_ID,
        run_kind="synthetic",
        samples=3,
        max_new_tokens=12,
        length_targets=list(LENGTH_TARGETS),
        length_alpha=LENGTH_ALPHA,
    )


def _section(world: SyntheticWorld, **extra) -> DatasetSection:
    return DatasetSection(
        ledgers=[world.ledger],
        accepted_dir=world.accepted,
        weights_dir=world.weights,
        validator_keys=[VALIDATOR.node_id],
        operator_key=OPERATOR.node_id,
        **extra,
    )


def test_only_accepted_rows_and_every_row_traceable(world: SyntheticWorld, tmp_path: Path) -> None:
    result = build_dataset(_run(), _section(world), tmp_path / "ds")
    rows = pq.read_table(result.out / "rows.parquet").to_pylist()
    # 2 honest nodes x 2 files x (2 prompts x 3 samples), nothing else.
    assert len(rows) == 24
    assert {r["file_sha256"] for r in rows} == set(world.honest_files)
    assert world.cheater_id not in {r["producer"] for r in rows}
    assert result.meta["skipped"] == {"not-the-judged-bytes": 1, "untrusted-verdict": 1}
    verdicts = {v["verdict_id"]: v for v in pq.read_table(result.out / "verdicts.parquet").to_pylist()}
    for r in rows:
        signed = open_signed(verdicts[r["verdict_id"]]["envelope"], Verdict, {VALIDATOR.node_id})
        assert signed.document.accepted
        assert (signed.document.file_hash, signed.document.node_id) == (r["file_sha256"], r["producer"])
        assert r["verified"] is True
        assert r["correct"] == (r["task_reward"] >= 1.0)
        assert len(r["checkpoint_digest"]) == 64 and r["checkpoint_step"] == 0
        assert r["completion_tokens"] == len(r["completion_ids"])
    assert len({r["sample_id"] for r in rows}) == len(rows)
    card = (result.out / "README.md").read_text()
    assert "config_name: rows" in card and "| rows | 24 |" in card
    meta = json.loads((result.out / "dataset.json").read_text())
    assert meta["run"]["run_kind"] == "synthetic"


def test_loads_with_pandas_and_datasets(world: SyntheticWorld, tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas", reason="pandas is the extra `datasets` (pip install -e '.[datasets]')")
    datasets = pytest.importorskip("datasets", reason="the extra `datasets` (pip install -e '.[datasets]')")
    out = build_dataset(_run(), _section(world), tmp_path / "ds").out
    frame = pd.read_parquet(out / "rows.parquet")
    assert len(frame) == 24 and set(frame["verified"]) == {True}
    # One configuration per file, as the card's front matter declares them (each has its own schema).
    cache = str(tmp_path / "hf-cache")
    rows = datasets.load_dataset("parquet", data_files=str(out / "rows.parquet"), cache_dir=cache)["train"]
    assert rows.num_rows == 24
    assert set(rows.column_names) >= {
        "prompt",
        "completion",
        "task_reward",
        "correct",
        "verified",
        "verdict_id",
    }
    for name in ("sft", "preference", "difficulty", "verdicts"):
        expected = len(pd.read_parquet(out / f"{name}.parquet"))
        if expected == 0:  # `datasets` refuses an empty Parquet file (the untrained model solves nothing)
            continue
        part = datasets.load_dataset("parquet", data_files=str(out / f"{name}.parquet"), cache_dir=cache)
        assert part["train"].num_rows == expected


def test_difficulty_file_reopens_as_a_filtered_environment(world: SyntheticWorld, tmp_path: Path) -> None:
    from prime_node.node.environments import open_environment

    out = build_dataset(_run(), _section(world, pass_k=[1, 2, 3]), tmp_path / "ds").out
    difficulty = pq.read_table(out / "difficulty.parquet").to_pylist()
    rows = pq.read_table(out / "rows.parquet").to_pylist()
    for d in difficulty:
        mine = [r for r in rows if r["task_index"] == d["task_index"]]
        assert d["n"] == len(mine) and d["correct"] == sum(r["correct"] for r in mine)
    env = open_environment(f"filtered:{out / 'difficulty' / (RUN_ID + '.parquet')}")
    assert len(env) == len(difficulty)


def test_nobody_trusted_or_missing_inputs_is_one_line(world: SyntheticWorld, tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="--validator-key"):
        build_dataset(_run(), _section(world).model_copy(update={"validator_keys": []}), tmp_path / "a")
    # Trusting only another key (here the operator's, which signed no verdict): no verdict counts, no row.
    only = _section(world).model_copy(update={"validator_keys": [OPERATOR.node_id]})
    result = build_dataset(_run(), only, tmp_path / "b")
    assert result.meta["counts"]["rows"] == 0
    assert result.meta["skipped"]["untrusted-verdict"] == 6


def test_cli_builds_the_same(world: SyntheticWorld, tmp_path: Path) -> None:
    argv = [
        sys.executable, "-m", "prime_node.node.cli.main", "dataset", "build",
        "--out", str(tmp_path / "cli"),
        "--ledger", str(world.ledger),
        "--accepted-dir", str(world.accepted),
        "--weights-dir", str(world.weights),
        "--validator-key", VALIDATOR.node_id,
        "--operator-key", OPERATOR.node_id,
        "--run-id", RUN_ID, "--run-kind", "synthetic", "--json",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rows"] == 24
