"""benchmarks/learning.py's budget and guards, without a run: the CPU clock counts the scoring workers'
CPU too (a budget that missed them would let a run with a process scorer train longer), and a --model
warm-started on another environment or another split is refused (it may have trained on held-out prompts),
and benchmarks/synthetic_sft.py reads the RL steps and CPU time to its target from a run's summary."""

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


def test_the_synthetic_experiment_reads_steps_and_cpu_to_the_target_from_a_summary() -> None:
    spec = importlib.util.spec_from_file_location("bench_synthetic_sft", BENCHMARKS / "synthetic_sft.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # The shape benchmarks/learning.py's --summary writes: curves at each evaluation, and their timing.
    data = {
        "curves": {"heldout": {"mix": [[0.0, 0.18], [10.0, 0.14], [20.0, 0.235], [30.0, 0.22]]}},
        "evaluations": [
            {"step": 0, "rl_cpu_s": 0.0, "rl_wall_s": 0.0},
            {"step": 10, "rl_cpu_s": 12.5, "rl_wall_s": 30.0},
            {"step": 20, "rl_cpu_s": 25.0, "rl_wall_s": 61.0},
            {"step": 30, "rl_cpu_s": 37.0, "rl_wall_s": 90.0},
        ],
    }
    hit = module.reached(data, 0.234)  # the first evaluation at or above it, not a later one
    assert hit == {"step": 20, "accuracy": 0.235, "rl_cpu_s": 25.0, "rl_wall_s": 61.0}
    assert module.reached(data, 0.18)["step"] == 0
    assert module.reached(data, 0.24) is None


def test_sampled_evaluation_scores_seeded_samples_of_each_prompt(tmp_path: Path) -> None:
    """--eval-samples: K seeded samples per distinct prompt (the same noise at every evaluation), scored by the
    environment; each held-out set gains a `-sampled` twin of its size. Near T = 0 sampling is greedy decoding,
    so a task whose reference is the model's greedy answer scores 1 and one with another reference 0."""
    from prime_node.node.engine import load_engine
    from prime_node.node.environments import open_environment
    from prime_node.node.models.tiny import build_tiny_model, save_model_dir
    from prime_node.node.models.warmstart import greedy_complete

    bench = learning()
    model, tokenizer = build_tiny_model(0)
    save_model_dir(model, tokenizer, tmp_path / "model")
    engine = load_engine(tmp_path / "model", threads=1)
    prompts = ["12+3=", "7*8=", "40-9="]
    greedy = greedy_complete(model, tokenizer, prompts, 4)
    rows = [{"prompt": p, "answer": g.strip() or "x"} for p, g in zip(prompts, greedy)]
    rows[2]["answer"] = rows[2]["answer"] + "different"
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = open_environment(f"file:{tmp_path / 'tasks.jsonl'}")
    tasks = [env.get(i) for i in range(3)]
    tasks.append(tasks[0])  # a recurring prompt is sampled once
    cold = bench.sampled_pass_rates(engine, tokenizer, env, tasks, 4, 1e-4, 4)
    assert cold == {prompts[0]: 1.0, prompts[1]: 1.0, prompts[2]: 0.0}, (greedy, cold)
    warm = bench.sampled_pass_rates(engine, tokenizer, env, tasks, 4, 1.0, 4)
    assert set(warm) == set(prompts) and all(r in (0.0, 0.25, 0.5, 0.75, 1.0) for r in warm.values())
    assert bench.sampled_pass_rates(engine, tokenizer, env, tasks, 4, 1.0, 4) == warm  # seeded
    assert bench.sampled_eval_seed(prompts[0], 0) != bench.sampled_eval_seed(prompts[0], 1)
    held = bench.HeldOut({"mix": tasks}, None, 0.2, lambda *a: (0.0, {}), 4, 1, (env, 4, 1.0))
    assert held.names() == ["mix", "mix-distinct", "mix-sampled", "mix-distinct-sampled"]
    assert held.size("mix-sampled") == 4 and held.size("mix-distinct-sampled") == 3
