"""`prime-node start --gpu` on a machine without CUDA: one clear message and a non-zero exit, before anything
starts; the per-checkpoint GPU memory check sizes a model from its weight files."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from prime_node.node.cli.main import main
from prime_node.node.contributor.preflight import check_cuda_for_model, model_gpu_bytes
from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.p2p.identity import Identity

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def test_gpu_start_without_cuda_fails_at_once_with_one_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # what the check sets; restored after the test
    Identity.generate().save(tmp_path / "node.key")
    started = time.monotonic()
    code = main(
        [
            "start",
            "--gpu",
            "--data-dir",
            str(tmp_path),
            "--operator-key",
            Identity.generate().node_id,
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--reachability",
            "public",
        ]
    )
    elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert "cannot start" in err and "cuda:" in err and "--gpu" in err and "without --gpu" in err, err
    assert "Traceback" not in err
    assert elapsed < 15, f"the refusal took {elapsed:.1f} s: it must come before the DHT starts"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node.key"]  # nothing started, nothing written


def test_gpu_room_for_a_checkpoint_is_sized_from_its_weight_files(tmp_path: Path) -> None:
    model, tokenizer = build_tiny_model(seed=0)
    save_model_dir(model, tokenizer, tmp_path / "ckpt")
    weights = sum(f.stat().st_size for f in (tmp_path / "ckpt").glob("*.safetensors"))
    assert weights > 0 and model_gpu_bytes(tmp_path / "ckpt") == weights + weights // 4
    result = check_cuda_for_model(tmp_path / "ckpt", 0)
    assert not result.ok and result.fatal and str(tmp_path / "ckpt") in result.message
