"""`prime-node model init`: deterministic creation, warm start, saving and loading back with transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_node.node.cli.main import main
from prime_node.node.errors import ModelError
from prime_node.node.models.chat_tokenizer import CHAT_TEMPLATE
from prime_node.node.models.tiny import build_tiny_model
from prime_node.node.models.warmstart import (
    WarmStartConfig,
    deterministic_torch,
    evaluate,
    file_sha256,
    greedy_complete,
    init_model_dir,
    warm_start,
)
from prime_node.node.run.settings import RunSettings, load_run_tasks

FAST_STEPS = "20"


@pytest.fixture
def small_eval(monkeypatch: pytest.MonkeyPatch) -> None:
    # Held-out scoring of 1000 problems is the default; 64 keep these tests fast and still exercise it.
    monkeypatch.setenv("PRIME_NODE_WARM_START__EVAL_SIZE", "64")


def _init(out: Path, seed: int, capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, object]:
    argv = [
        "model",
        "init",
        "--out",
        str(out),
        "--seed",
        str(seed),
        "--sft-steps",
        FAST_STEPS,
        "--no-progress",
        "--json",
    ]
    assert main([*argv, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_init_is_deterministic_and_loads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], small_eval: None
) -> None:
    first = _init(tmp_path / "a", 0, capsys)
    again = _init(tmp_path / "b", 0, capsys)
    other = _init(tmp_path / "c", 1, capsys)
    sha_a = file_sha256(tmp_path / "a" / "model.safetensors")
    assert (
        first["model_sha256"]
        == sha_a
        == again["model_sha256"]
        == file_sha256(tmp_path / "b" / "model.safetensors")
    )
    assert other["model_sha256"] != sha_a
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()

    info = json.loads((tmp_path / "a" / "prime_node.json").read_text())
    assert info == json.loads((tmp_path / "b" / "prime_node.json").read_text())  # no timings: deterministic
    assert (
        info["seed"] == 0 and info["sft_steps"] == 20 and info["task_seed"] == 0 and info["eval_size"] == 64
    )
    assert 0.0 <= info["heldout_accuracy"] <= 1.0 and info["final_loss"] > 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in (tmp_path / "a").iterdir()
    }
    assert not list(tmp_path.glob(".*partial*"))  # the staging directory is gone

    # The saved weights are the trained ones (not the seed's initial weights) and score as recorded.
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert model.config.model_type == "qwen2"
    initial, _ = build_tiny_model(0)
    assert not torch.equal(model.model.embed_tokens.weight, initial.model.embed_tokens.weight)
    config = WarmStartConfig.model_validate(info["warm_start"])
    with deterministic_torch(config.threads):
        accuracy, _ = evaluate(model, tokenizer, config)
    assert accuracy == info["heldout_accuracy"]


def test_tokenizer_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str], small_eval: None) -> None:
    _init(tmp_path / "m", 3, capsys, "--sft-steps", "0")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    text = "(12+34)*5=230 -0 \n  x"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per ASCII character
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids([tokenizer.pad_token, tokenizer.eos_token]) == [0, 1]
    with_eos = ids + [tokenizer.eos_token_id]
    assert tokenizer.decode(with_eos, skip_special_tokens=True) == text
    assert "é" == tokenizer.decode(tokenizer("é", add_special_tokens=False)["input_ids"])  # non-ASCII: bytes


_TOKENIZER_IN_A_FRESH_PROCESS = """
import sys
from prime_node.node.models.chat_tokenizer import build_chat_tokenizer
build_chat_tokenizer().save_pretrained(sys.argv[1], save_jinja_files=False)
"""


def test_chat_model_init_is_deterministic_with_a_trained_bpe_and_a_chat_template(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], small_eval: None
) -> None:
    first = _init(tmp_path / "a", 0, capsys, "--chat", "--sft-steps", "3")
    again = _init(tmp_path / "b", 0, capsys, "--chat", "--sft-steps", "3")
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors", "prime_node.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert first["model_sha256"] == again["model_sha256"]
    # Training is deterministic across processes too (Rust hash maps are seeded per process).
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-c", _TOKENIZER_IN_A_FRESH_PROCESS, str(fresh)], check=True, timeout=300)
    assert (fresh / "tokenizer.json").read_bytes() == (tmp_path / "a" / "tokenizer.json").read_bytes()

    model_dir = tmp_path / "a"
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and not (model_dir / "chat_template.jinja").exists()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer.eos_token == "<|im_end|>" and model.config.eos_token_id == 2 == tokenizer.eos_token_id
    assert model.config.model_type == "qwen2" and len(tokenizer) <= model.config.vocab_size
    # Learned merges, not one token per byte: words are single tokens, digits stay one token each.
    assert tokenizer.tokenize(" answer") == ["Ġanswer"] and tokenizer.tokenize("12345") == list("12345")
    text = "What is 48+17? Think for 16 tokens before giving the answer. é"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(text) / 2 and tokenizer.decode(ids) == text
    assert first["chat"] == {
        "corpus": "prime-node/chat-corpus/v1",
        "vocab_size": len(tokenizer),
        "tokenizer_sha256": file_sha256(model_dir / "tokenizer.json"),
        "prompt_format": load_run_tasks(RunSettings(), model_dir).prompt_format,
    }
    # The warm start trained and scored on the chat format; scoring again through it gives the recorded value.
    config_used = WarmStartConfig.model_validate(first["warm_start"])
    with deterministic_torch(config_used.threads):
        accuracy, _ = evaluate(model, tokenizer, config_used)
    assert accuracy == first["heldout_accuracy"]


def test_refuses_non_empty_dir_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], small_eval: None
) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code = main(["model", "init", "--out", str(out), "--sft-steps", "0", "--no-progress"])
    assert code == 1
    assert "is not empty; choose another --out or pass --force" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]

    summary = _init(out, 0, capsys, "--sft-steps", "0", "--force")
    assert (out / "notes.txt").read_text() == "keep me"  # --force replaces model files only
    assert file_sha256(out / "model.safetensors") == summary["model_sha256"]

    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelError, match="exists and is not a directory"):
        init_model_dir(tmp_path / "file", 0, WarmStartConfig(steps=0, eval_size=4))


def test_bad_settings_name_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["model", "init", "--out", str(tmp_path / "m"), "--sft-steps", "-5", "--no-progress"])
    assert code == 2  # a usage error, as argparse's own
    # The flag the user typed, not the setting it sets (warm_start.steps).
    assert capsys.readouterr().err.splitlines() == [
        "prime-node model init: error: argument --sft-steps: Input should be greater than or equal to 0 (got -5)"
    ]
    assert not (tmp_path / "m").exists()


def test_text_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str], small_eval: None) -> None:
    assert main(["model", "init", "--out", str(tmp_path / "m"), "--sft-steps", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "held-out" in out and "exact match over 64 problems" in out
    assert file_sha256(tmp_path / "m" / "model.safetensors") in out


def test_greedy_complete_batches_by_length_without_changing_answers() -> None:
    model, tokenizer = build_tiny_model(5)
    prompts = ["1+1=", "12+34=", "7*8=", "(1+2)*3=", "99-100="]
    with deterministic_torch(threads=1):
        batched = greedy_complete(model, tokenizer, prompts, max_new_tokens=5)
        alone = [greedy_complete(model, tokenizer, [p], max_new_tokens=5)[0] for p in prompts]
    assert batched == alone and all(len(c) <= 5 for c in batched)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_warm_start_lands_in_the_accuracy_band() -> None:
    model, tokenizer = build_tiny_model(0)
    report = warm_start(model, tokenizer, WarmStartConfig())
    assert 0.20 <= report.heldout_accuracy <= 0.60, report
