"""benchmarks/learning.py's budget and guards, without a run: the CPU clock counts the scoring workers'
CPU too (a budget that missed them would let a run with a process scorer train longer), and a --model
warm-started on another environment or another split is refused (it may have trained on held-out prompts)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def learning() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_learning_guards", BENCHMARKS / "learning.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_cpu_clock_counts_child_processes() -> None:
    clock = learning().CpuClock()
    burn = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", burn], check=True, timeout=120)
    assert clock.seconds() >= 0.35  # the child's CPU, reaped: this process itself only waited


def test_a_model_warm_started_elsewhere_is_refused(tmp_path: Path) -> None:
    bench = learning()
    info = {"env": "reasoning_gym:family=gcd", "warm_start": {"heldout_fraction": 0.2}}
    (tmp_path / "prime_node.json").write_text(json.dumps(info))
    bench.check_warm_start(tmp_path, 0.2, "reasoning_gym:family=gcd")  # the same: accepted
    with pytest.raises(SystemExit, match="warm-started on"):
        bench.check_warm_start(tmp_path, 0.2, "reasoning_gym:family=count_bits")
    with pytest.raises(SystemExit, match="heldout_fraction 0.2"):
        bench.check_warm_start(tmp_path, 0.1, "reasoning_gym:family=gcd")


def test_exact_reward_keeps_right_answers_only() -> None:
    from prime_node.trainer.service.batch_buffer import RolloutRecord, RolloutSample

    def sample(key: str, reward: float) -> RolloutSample:
        return RolloutSample(prompt_key=key, prompt_ids=(1,), completion_ids=(2,), task_reward=reward)

    # chain_sum's partial credit: "-3" for 3 scores 0.5; only the 1.0 stays a reward.
    record = RolloutRecord("f" * 64, 0, (sample("1", 1.0), sample("1", 0.5), sample("2", 0.0)))
    exact = learning().exact_rewards(record)
    assert [s.task_reward for s in exact.samples] == [1.0, 0.0, 0.0]
    assert [s.prompt_key for s in exact.samples] == ["1", "1", "2"] and exact.file_id == record.file_id
