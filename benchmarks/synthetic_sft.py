"""The INTELLECT-MATH experiment on this machine: does SFT on a stronger model's verified traces make a
better starting policy for RL than the plain warm start?

1. The teacher: the tiny model warm-started longer (`--teacher-sft-steps`, or `--teacher DIR`).
2. Its traces: a real synthetic devnet run (trainer with the frozen teacher, a validator, `--nodes`
   contributors, one inflated-rewards cheater) until `--files` files are accepted; `prime-node dataset build`
   (run by the devnet) keeps the verified rows, and the SFT subset is their correct ones.
3. Two students from the same fresh weights (`--student-seed`), with the same number of SFT steps
   (`--student-steps`) and batch size: `plain` is the arithmetic warm start on reference answers (`prime-node
   model init`'s code), `traces` is `prime-node sft` on the teacher's verified correct traces.
4. Both trained by benchmarks/learning.py with the same RL recipe and seed for `--rl-steps` steps, held-out
   greedy accuracy (the warm start's own held-out set) every `--eval-every` steps.

Prints, from this one run, each student's held-out accuracy after SFT and the RL steps (and wall seconds)
until it first reaches `--target` held-out accuracy (or that it did not within the budget).

    .venv/bin/python benchmarks/synthetic_sft.py --work /tmp/synthetic-sft
"""

from __future__ import annotations

import argparse
import io
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from prime_node.node.engine.hf import load_hf_model
from prime_node.node.models.dataset_sft import sft_from_dataset
from prime_node.node.models.sft_config import SftConfig
from prime_node.node.models.warmstart import WarmStartConfig, greedy_accuracy, heldout_tasks, init_model_dir
from prime_node.trainer.devnet.layout import Sizing
from prime_node.trainer.devnet.runner import Devnet, DevnetOptions
from prime_node.trainer.devnet.synthetic import SyntheticOptions
from prime_node.trainer.devnet.view import LiveView

HERE = Path(__file__).resolve().parent


def heldout_accuracy(model_dir: Path, eval_size: int) -> float:
    import torch
    from transformers import AutoTokenizer

    model = load_hf_model(model_dir, "cpu", torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    config = WarmStartConfig(eval_size=eval_size)
    return greedy_accuracy(model, tokenizer, heldout_tasks(config), config.eval_max_new_tokens)[0]


def traces(teacher: Path, work: Path, args: argparse.Namespace) -> Path:
    """A synthetic devnet run of the teacher; its dataset directory (that of an earlier run in `work` if any)."""
    done = work / "devnet" / "dataset"
    if (done / "sft.parquet").is_file():
        print(f"traces: reusing {done}", flush=True)
        return done
    options = DevnetOptions(
        root=work / "devnet",
        model_dir=teacher,
        nodes=args.nodes,
        attacks=["inflated-rewards"],
        steps=1,
        sizing=Sizing(prompts=16, samples=args.samples, max_new_tokens=8),
        task_filter=None,  # the whole environment: the teacher's traces on every kind of task
        synthetic=SyntheticOptions(target_files=args.files),
    )
    report = Devnet(options, LiveView(1, Console(file=io.StringIO()), live=False)).run()
    if report["error"] is not None or report.get("dataset") is None:
        raise SystemExit(f"the synthetic devnet run failed: {report['error']}")
    print(f"traces: {json.dumps(report['dataset']['counts'])} ({report['wall_s']:.0f} s)", flush=True)
    return Path(report["dataset"]["path"])


def rl(model: Path, out: Path, args: argparse.Namespace) -> dict:
    summary = out.with_suffix(".json")
    argv = [
        sys.executable, str(HERE / "learning.py"), "--model", str(model), "--steps", str(args.rl_steps),
        "--eval-every", str(args.eval_every), "--eval-size", str(args.eval_size), "--seed", "0",
        "--summary", str(summary), "--out", str(out.with_suffix(".png")), "--minutes", str(args.rl_minutes),
        *shlex.split(args.rl_args),
    ]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=sys.stderr)
    data = json.loads(summary.read_text())
    data["wall_s"] = time.perf_counter() - started
    return data


def steps_to(curve: list[list[float]], target: float) -> float | None:
    return next((step for step, acc in curve if acc >= target), None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="directory for every model and run")
    p.add_argument("--teacher", type=Path, default=None, help="a warm-started teacher (default: make one)")
    p.add_argument("--teacher-sft-steps", type=int, default=600)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--samples", type=int, default=4, help="teacher samples per task")
    p.add_argument("--files", type=int, default=24, help="accepted files of traces")
    p.add_argument("--student-seed", type=int, default=1)
    p.add_argument("--student-steps", type=int, default=150, help="SFT steps of both students")
    p.add_argument("--rl-steps", type=int, default=20)
    p.add_argument("--rl-minutes", type=float, default=8.0)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-size", type=int, default=300)
    p.add_argument(
        "--target", type=float, default=None, help="held-out accuracy to reach (default: plain + 5 points)"
    )
    p.add_argument(
        "--rl-args",
        default="",
        help="further benchmarks/learning.py flags, one string: --rl-args='--lr 3e-4'",
    )
    args = p.parse_args()
    work = args.work.expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    teacher = args.teacher
    if teacher is None:
        teacher = work / "teacher"
        if not (teacher / "config.json").is_file():
            init_model_dir(teacher, 0, WarmStartConfig(steps=args.teacher_sft_steps))
    print(f"teacher held-out accuracy {heldout_accuracy(teacher, args.eval_size):.3f}", flush=True)
    dataset = traces(teacher, work, args)

    t0 = time.perf_counter()
    plain = work / "student-plain"
    init_model_dir(plain, args.student_seed, WarmStartConfig(steps=args.student_steps), force=True)
    plain_s = time.perf_counter() - t0
    fresh = work / "student-fresh"
    init_model_dir(fresh, args.student_seed, WarmStartConfig(steps=0), force=True)
    t0 = time.perf_counter()
    sft_from_dataset(  # the same SFT steps and batch size as the plain warm start (WarmStartConfig's)
        dataset,
        fresh,
        work / "student-traces",
        SftConfig(steps=args.student_steps, batch_size=64, lr=3e-3, warmup_steps=50),
        force=True,
    )
    traces_s = time.perf_counter() - t0
    students = {"plain": (plain, plain_s), "traces": (work / "student-traces", traces_s)}
    start = {name: heldout_accuracy(path, args.eval_size) for name, (path, _) in students.items()}
    for name, (_, seconds) in students.items():
        steps = args.student_steps
        print(
            f"student {name}: held-out accuracy {start[name]:.3f} after {steps} SFT steps ({seconds:.0f} s)"
        )
    target = args.target if args.target is not None else start["plain"] + 0.05
    results = {}
    for name, (path, _) in students.items():
        data = rl(path, work / f"rl-{name}", args)
        curve = data["curves"]["heldout"]["mix"]
        reached = steps_to(curve, target)
        results[name] = {
            "start": start[name],
            "curve": curve,
            "reached_at": reached,
            "rl_wall_s": data["rl_wall_s"],
        }
        print(f"student {name}: RL curve {curve}; reaches {target:.3f} at step {reached}", flush=True)
    (work / "result.json").write_text(json.dumps({"target": target, **results}, indent=2))
    a, b = results["plain"]["reached_at"], results["traces"]["reached_at"]
    ratio = f"{a / b:.2f}x" if a and b else "n/a (one did not reach it, or reached it at step 0)"
    print(f"target {target:.3f}: plain at RL step {a}, traces at RL step {b}; plain/traces steps {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
