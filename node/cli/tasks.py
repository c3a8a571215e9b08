"""`prime-node tasks filter`: keep the tasks a model solves sometimes but not always (offline filtering)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..errors import TaskError
from .common import common_flags, load_settings, print_json

# Past this many tasks, estimating every one is surely a mistake (the built-in set has 2^24).
MAX_UNLIMITED_TASKS = 100_000


def register(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("tasks", help="task sets: difficulty filtering")
    tasks_sub = group.add_subparsers(dest="tasks_command", metavar="SUBCOMMAND")
    tasks_sub.required = True
    group.set_defaults(handler=lambda args: group.print_help() or 2)
    p = tasks_sub.add_parser(
        "filter",
        parents=[common_flags()],
        help="estimate each task's pass rate with a model and keep those inside a band",
        description="Sample --k completions per task with the model (seeded Gumbel sampling), score them "
        "with the task's verifier, and write the tasks whose pass rate lies in [--min, --max] to --out "
        "(JSONL or Parquet, readable as --tasks).",
    )
    p.add_argument("--model", type=Path, required=True, help="HF model directory to estimate with")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--env", default=None, metavar="NAME[:ARGS]", help="environment to filter (default arithmetic)"
    )
    source.add_argument(
        "--tasks", default=None, help="task file (Parquet/JSONL): shorthand of --env file:PATH"
    )
    p.add_argument("--out", type=Path, required=True, help="task file to write (.jsonl or .parquet)")
    p.add_argument("--k", type=int, default=None, help="completions per task (default 8)")
    p.add_argument("--min", dest="min_pass", type=float, default=None, help="lowest pass rate kept (0.125)")
    p.add_argument("--max", dest="max_pass", type=float, default=None, help="highest pass rate kept (0.5)")
    p.add_argument("--limit", type=int, default=None, help="tasks to estimate (default all of a file)")
    p.add_argument("--offset", type=int, default=None, help="first task index (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="most tokens per completion (64)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (1.0)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling noise (0)")
    p.add_argument("--task-seed", type=int, default=None, help="seed of generated environments (0)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--gpu", action="store_true", default=None, help="generate on CUDA")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=filter_tasks)


def filter_tasks(args: argparse.Namespace) -> int:
    # Heavy imports (torch, transformers) only when the command runs, so `--help` stays fast.
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from ..engine import load_engine
    from ..environments import open_environment, spec_of_tasks
    from ..environments.difficulty import (
        FilterSettings,
        estimate_pass_rates,
        histogram,
        in_band,
        render_histogram,
        write_task_file,
    )

    names = [
        "k",
        "min_pass",
        "max_pass",
        "limit",
        "offset",
        "max_new_tokens",
        "temperature",
        "seed",
        "task_seed",
    ]
    flags = {name: name for name in names}
    flags["engine.threads"] = "threads"
    settings = load_settings(args, FilterSettings, flags)
    if args.gpu:
        settings.engine.device = "cuda"
    environment = open_environment(args.env or spec_of_tasks(args.tasks), seed=settings.task_seed)
    total = len(environment)
    if settings.offset >= total:
        raise TaskError(f"--offset {settings.offset} is past the end of {environment.spec} ({total} tasks)")
    count = min(settings.limit or total, total - settings.offset)
    if settings.limit is None and count > MAX_UNLIMITED_TASKS:
        raise TaskError(f"{environment.spec} has {total} tasks; pass --limit N to estimate only N of them")
    indices = list(range(settings.offset, settings.offset + count))
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TaskError(f"cannot load the tokenizer of {args.model}: {exc}") from None
    engine = load_engine(args.model, **settings.engine.model_dump())
    started = time.perf_counter()
    # Enough tasks per engine call to fill its micro-batches, few enough for a lively progress bar.
    per_batch = max(1, settings.engine.max_batch_size // settings.k)
    with tqdm(
        total=count,
        desc="estimating",
        unit="task",
        file=sys.stderr,
        disable=args.no_progress or args.json or None,
    ) as bar:
        estimates = estimate_pass_rates(
            engine,
            tokenizer,
            environment,
            indices,
            k=settings.k,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            seed=settings.seed,
            tasks_per_batch=per_batch,
            progress=bar.update,
        )
    kept = in_band(estimates, settings.min_pass, settings.max_pass)
    write_task_file(args.out, kept)
    counts = histogram(estimates, settings.k)
    summary = {
        "out": str(args.out),
        "source": environment.spec,
        "estimated": len(estimates),
        "kept": len(kept),
        "k": settings.k,
        "min": settings.min_pass,
        "max": settings.max_pass,
        "histogram": {f"{c}/{settings.k}": n for c, n in enumerate(counts)},
        "mean_pass_rate": sum(e.pass_rate for e in estimates) / len(estimates),
        "seconds": round(time.perf_counter() - started, 3),
    }
    if args.json:
        print_json(summary)
        return 0
    print(render_histogram(counts, settings.k, settings.min_pass, settings.max_pass))
    print(
        f"kept {len(kept)} of {len(estimates)} tasks (pass rate in [{settings.min_pass}, {settings.max_pass}], "
        f"* rows) -> {args.out}; mean pass rate {summary['mean_pass_rate']:.3f}; {summary['seconds']:.1f} s"
    )
    return 0
