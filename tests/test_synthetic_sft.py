"""`prime-node sft`: the SFT subset of a dataset into a model, resumable after a kill with the same result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from prime_node.node.environments import open_environment
from prime_node.node.errors import ModelError
from prime_node.node.models.dataset_sft import sft_from_dataset
from prime_node.node.models.sft_config import SftConfig
from prime_node.node.models.warmstart import file_sha256
from prime_node.p2p.processes import end_pids

from support.attack import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CONFIG = SftConfig(steps=40, batch_size=8, lr=3e-3, warmup_steps=5, save_every=5, threads=1)


def _dataset(root: Path, rows: int = 64) -> Path:
    """An SFT subset as `dataset build` writes it (the columns sft reads): a teacher's correct answers."""
    env = open_environment("arithmetic")
    tasks = [env.get(i) for i in range(rows)]
    root.mkdir(parents=True)
    table = pa.table(
        {
            "prompt": [t.prompt for t in tasks],
            "completion": [t.answer for t in tasks],
            "finish_reason": ["eos"] * rows,
            "correct": [True] * rows,
        }
    )
    pq.write_table(table, root / "sft.parquet")
    return root


def _untrained_loss(model_dir: Path, data: Path) -> float:
    from transformers import AutoTokenizer

    from prime_node.node.engine.hf import load_hf_model
    from prime_node.node.models.dataset_sft import _examples, batches_from

    model = load_hf_model(model_dir, "cpu", torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    batch = next(batches_from(_examples(data, tokenizer), CONFIG, 0, int(tokenizer.pad_token_id)))
    with torch.no_grad():
        return float(model(**batch).loss)


def test_sft_learns_the_traces_and_writes_a_model_dir(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "student")
    data = _dataset(tmp_path / "ds")
    result = sft_from_dataset(data, model, tmp_path / "out", CONFIG)
    assert result.steps == 40 and result.resumed_from == 0 and result.samples == 64
    info = json.loads((tmp_path / "out" / "prime_node.json").read_text())
    assert info["model_sha256"] == file_sha256(tmp_path / "out" / "model.safetensors") == result.model_sha256
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()
    assert result.final_loss is not None and result.final_loss < 0.7 * _untrained_loss(model, data)
    assert not (tmp_path / ".out.sft-state").exists()
    with pytest.raises(ModelError, match="not empty"):
        sft_from_dataset(data, model, tmp_path / "out", CONFIG)


def test_no_correct_rows_is_one_line(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "student")
    (tmp_path / "ds").mkdir()
    schema = pa.schema([("prompt", pa.string()), ("completion", pa.string()), ("finish_reason", pa.string())])
    pq.write_table(schema.empty_table(), tmp_path / "ds" / "sft.parquet")
    with pytest.raises(ModelError, match="no correct rows"):
        sft_from_dataset(tmp_path / "ds", model, tmp_path / "out", CONFIG)


@pytest.mark.slow
def test_killed_mid_run_resumes_to_the_same_weights(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "student")
    data = _dataset(tmp_path / "ds")
    steps = 80
    config = CONFIG.model_copy(update={"steps": steps, "save_every": 10})
    straight = sft_from_dataset(data, model, tmp_path / "straight", config)

    out = tmp_path / "resumed"
    argv = [
        sys.executable, "-m", "prime_node.node.cli.main", "sft",
        "--dataset", str(data), "--model", str(model), "--out", str(out),
        "--steps", str(steps), "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "5",
        "--save-every", "10", "--threads", "1", "--json",
    ]  # fmt: skip
    marker = tmp_path / ".resumed.sft-state" / "latest.json"
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and first.poll() is None:
            if marker.is_file() and json.loads(marker.read_text())["state"] != "step-10":
                break
            time.sleep(0.02)
        assert first.poll() is None, "the run ended before it could be killed mid-way"
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
    finally:
        end_pids([first.pid], 5.0)
        first.communicate()
    killed_at = int(json.loads(marker.read_text())["state"].removeprefix("step-"))
    assert 10 < killed_at < steps and not out.exists()

    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["resumed_from"] >= killed_at
    assert summary["model_sha256"] == straight.model_sha256  # the same steps, the same weights
    assert file_sha256(out / "model.safetensors") == straight.model_sha256
