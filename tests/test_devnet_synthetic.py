"""`prime-node devnet --synthetic` end to end: a frozen model, contributors and a cheater as real processes on
127.0.0.1, ending with a dataset directory that pandas and `datasets` load, where every row traces to an
accepted verdict signed by the validator and none is the cheater's."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from prime_node.node.cli.devnet import succeeded
from prime_node.p2p.verdicts import Verdict, open_signed
from prime_node.trainer.devnet.report import format_report
from prime_node.trainer.devnet.synthetic import SyntheticOptions

from support.devnet import SMALL, assert_all_gone, run_devnet


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_synthetic_devnet_ends_with_a_verified_dataset(tmp_path: Path) -> None:
    report, devnet, _ = run_devnet(
        tmp_path, nodes=2, attacks=["inflated-rewards"], steps=1, synthetic=SyntheticOptions(target_files=4)
    )
    text = format_report(report)
    assert report["error"] is None, text
    assert succeeded(report), text
    assert report["steps"] == 0, "a synthetic run's trainer never trains"
    (adversary,) = report["adversaries"]
    assert adversary["banned"] and adversary["accepted_files"] == 0, text
    cheater = next(m.node_id for m in devnet.layout.members if m.attack is not None)
    assert_all_gone(devnet, report)

    dataset = report["dataset"]
    out = Path(dataset["path"])
    rows = pq.read_table(out / "rows.parquet").to_pylist()
    files = report["honest"]["accepted_files"]
    assert dataset["counts"]["accepted_files"] == files >= 4
    assert len(rows) == files * SMALL.prompts * SMALL.samples
    assert cheater not in {r["producer"] for r in rows}
    operator = devnet.layout.operator.node_id
    verdicts = {v["verdict_id"]: v for v in pq.read_table(out / "verdicts.parquet").to_pylist()}
    for r in rows:
        verdict = open_signed(verdicts[r["verdict_id"]]["envelope"], Verdict, {operator}).document
        assert verdict.accepted and (verdict.file_hash, verdict.node_id) == (r["file_sha256"], r["producer"])
        assert r["checkpoint_step"] == 0 and r["verified"]
    pd = pytest.importorskip("pandas", reason="the extra `datasets` (pip install -e '.[datasets]')")
    datasets = pytest.importorskip("datasets", reason="the extra `datasets` (pip install -e '.[datasets]')")
    assert len(pd.read_parquet(out / "rows.parquet")) == len(rows)
    loaded = datasets.load_dataset(
        "parquet", data_files=str(out / "rows.parquet"), cache_dir=str(tmp_path / "c")
    )
    assert loaded["train"].num_rows == len(rows)
    assert (out / "README.md").read_text().count("config_name") == 5
