"""The INTELLECT-MATH experiment on this machine: does SFT on a stronger model's verified traces make a
better starting policy for RL than the plain warm start?

1. The teacher: the tiny model warm-started longer (`--teacher-sft-steps`, or `--teacher DIR`).
2. Its traces: a real synthetic devnet run (trainer with the frozen teacher, a validator, `--nodes`
   contributors, one inflated-rewards cheater) until `--files` files are accepted; `prime-node dataset build`
   (run by the devnet) keeps the verified rows, and the SFT subset is their correct ones.
3. Two students from the same fresh weights (`--student-seed`), with the same number of SFT steps
   (`--student-steps`) and batch size: `plain` is the arithmetic warm start on reference answers (`prime-node
   model init`'s code), `traces` is `prime-node sft` on the teacher's verified correct traces.
4. Both trained by benchmarks/learning.py with the same RL recipe (`--rl-args`; default the learning record's,
   docs/trainer.md "Does it learn?": offline difficulty filter, 64 prompts x 8, batch 192, lr 1e-3 decayed
   to 0, negative weight 0) and seed for `--rl-steps` steps, held-out greedy accuracy (the warm start's own
   held-out set) every `--eval-every` steps. The budget is steps, with a CPU-time stop (`--rl-cpu-minutes`
   at `--threads`, learning.py's --cpu-minutes) so that a loaded machine runs the same steps as an idle one.

Prints, from this one run, each student's held-out accuracy after SFT and the RL steps, CPU seconds and wall
seconds (evaluations excluded) until it first reaches the target held-out accuracy (`--target`, default the
plain student's accuracy after SFT + 5 points), or that it did not within the budget, with its curve.

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

if (
    __name__ == "__main__"
):  # before torch is imported (its CPU kernels are chosen then), as benchmarks/learning.py
    # pins them: the teacher, both students and the RL runs (subprocesses inherit the environment) then give
    # the same weights on every x86-64 machine.
    from prime_node.node.runtime.numerics import pin_cpu_kernels

    pin_cpu_kernels("avx2")

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
# The learning record's recipe (docs/trainer.md, "Does it learn?", sections 6-7), less its content split.
RL_RECIPE = (
    "--filter 4000 --files 1 --prompts 64 --samples 8 --batch-size 192 --optimizer-steps 1 --lr 1e-3 "
    "--warmup 5 --negative-weight 0 --decay --min-lr-ratio 0"
)


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
        "--summary", str(summary), "--out", str(out.with_suffix(".png")), "--threads", str(args.threads),
        "--cpu-minutes", str(args.rl_cpu_minutes),
        *(["--minutes", str(args.rl_minutes)] if args.rl_minutes is not None else []),
        *shlex.split(args.rl_args),
    ]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=sys.stderr)
    data = json.loads(summary.read_text())
    data["wall_s"] = time.perf_counter() - started
    return data


def reached(data: dict, target: float) -> dict | None:
    """The first evaluation at or above `target`: its RL step and the RL loop's CPU and wall seconds to it
    (evaluations excluded); None if no evaluation reached it."""
    timing = {e["step"]: e for e in data["evaluations"]}
    for step, acc in data["curves"]["heldout"]["mix"]:
        if acc >= target:
            at = timing[int(step)]
            return {
                "step": int(step),
                "accuracy": acc,
                "rl_cpu_s": at["rl_cpu_s"],
                "rl_wall_s": at["rl_wall_s"],
            }
    return None


def student_ready(path: Path, reuse: bool) -> bool:
    return reuse and (path / "model.safetensors").is_file() and (path / "config.json").is_file()


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
    p.add_argument("--rl-steps", type=int, default=200, help="RL steps per student (the lr decays over them)")
    p.add_argument(
        "--rl-cpu-minutes",
        type=float,
        default=20.0,
        help="stop a student's RL after this much process CPU time / --threads (a guard: steps are the budget)",
    )
    p.add_argument(
        "--rl-minutes", type=float, default=None, help="also stop a student's RL after this wall time"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads of the RL runs")
    p.add_argument(
        "--reuse-students",
        action="store_true",
        help="keep student-plain and student-traces from an earlier run in --work (they are deterministic)",
    )
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument(
        "--eval-size", type=int, default=1000, help="held-out problems (the warm start's own 1,000)"
    )
    p.add_argument(
        "--target", type=float, default=None, help="held-out accuracy to reach (default: plain + 5 points)"
    )
    p.add_argument(
        "--rl-args",
        default=RL_RECIPE,
        help=f"the RL recipe: benchmarks/learning.py flags, one string (default {RL_RECIPE!r})",
    )
    args = p.parse_args()
    work = args.work.expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    teacher = args.teacher
    if teacher is None:
        teacher = work / "teacher"
        if not (teacher / "config.json").is_file():
            init_model_dir(teacher, 0, WarmStartConfig(steps=args.teacher_sft_steps))
    info = teacher / "prime_node.json"
    known = json.loads(info.read_text()) if info.is_file() else {}
    if known.get("eval_size") == args.eval_size:  # its warm start's own evaluation on this very set
        print(f"teacher held-out accuracy {known['heldout_accuracy']:.3f} (from {info})", flush=True)
    else:
        print(f"teacher held-out accuracy {heldout_accuracy(teacher, args.eval_size):.3f}", flush=True)
    dataset = traces(teacher, work, args)

    plain, taught = work / "student-plain", work / "student-traces"
    seconds = {"plain": None, "traces": None}
    if not student_ready(plain, args.reuse_students):
        t0 = time.perf_counter()
        init_model_dir(plain, args.student_seed, WarmStartConfig(steps=args.student_steps), force=True)
        seconds["plain"] = time.perf_counter() - t0
    if not student_ready(taught, args.reuse_students):
        fresh = work / "student-fresh"
        init_model_dir(fresh, args.student_seed, WarmStartConfig(steps=0), force=True)
        t0 = time.perf_counter()
        sft_from_dataset(  # the same SFT steps and batch size as the plain warm start (WarmStartConfig's)
            dataset,
            fresh,
            taught,
            SftConfig(steps=args.student_steps, batch_size=64, lr=3e-3, warmup_steps=50),
            force=True,
        )
        seconds["traces"] = time.perf_counter() - t0
    for name, made in seconds.items():
        how = f"made in {made:.0f} s wall" if made is not None else "reused"
        print(f"student {name}: {args.student_steps} SFT steps ({how})", flush=True)

    # The target is fixed before either RL run: plain's accuracy after SFT (RL step 0) + 5 points.
    results, target = {}, args.target
    for name, path in (("plain", plain), ("traces", taught)):
        data = rl(path, work / f"rl-{name}", args)
        curve = data["curves"]["heldout"]["mix"]
        if target is None:
            target = curve[0][1] + 0.05
            print(f"target: held-out {target:.3f} (plain after SFT {curve[0][1]:.3f} + 5 points)", flush=True)
        hit = reached(data, target)
        results[name] = {
            "start": curve[0][1],
            "curve": curve,
            "reached": hit,
            "steps": data["steps"],
            "stopped_by": data["stopped_by"],
            "rl_cpu_s": data["rl_cpu_s"] - data["eval_cpu_s"],
            "rl_wall_s": data["rl_wall_s"] - data["eval_wall_s"],
            "eval_cpu_s": data["eval_cpu_s"],
            "load_average_1min_at_end": data["load_average_1min_at_end"],
            "command": data["command"],
        }
        print(
            f"student {name}: after SFT {curve[0][1]:.3f}; {data['steps']} RL steps (stopped by "
            f"{data['stopped_by']}), {results[name]['rl_cpu_s']:.0f} s CPU, {results[name]['rl_wall_s']:.0f} s "
            f"wall (evaluations excluded), load {data['load_average_1min_at_end']:.1f} at the end; curve "
            + " ".join(f"{int(step)}:{acc:.3f}" for step, acc in curve),
            flush=True,
        )
    assert target is not None
    (work / "result.json").write_text(json.dumps({"target": target, **results}, indent=2))
    for name, result in results.items():
        hit = result["reached"]
        print(
            f"{name}: reaches {target:.3f} at RL step {hit['step']} ({hit['accuracy']:.3f}; {hit['rl_cpu_s']:.0f} s "
            f"CPU, {hit['rl_wall_s']:.0f} s wall)"
            if hit
            else f"{name}: never reaches {target:.3f} in {result['steps']} RL steps (best "
            f"{max(a for _, a in result['curve']):.3f})"
        )
    a, b = results["plain"]["reached"], results["traces"]["reached"]
    if a and b and b["step"] > 0:
        print(
            f"plain/traces: {a['step'] / b['step']:.2f}x RL steps, {a['rl_cpu_s'] / b['rl_cpu_s']:.2f}x CPU, "
            f"{a['rl_wall_s'] / b['rl_wall_s']:.2f}x wall"
        )
    else:
        print("plain/traces: n/a (one did not reach the target, or reached it at step 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
