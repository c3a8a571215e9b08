"""`prime-node tasks filter`: keep the tasks a model solves sometimes but not always (offline filtering)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..environments.difficulty import FilterSettings
from ..errors import TaskError
from .common import print_json
from .flags import Flag, SettingsFlags, load_settings

# Past this many tasks, estimating every one is surely a mistake (the built-in set has 2^24).
MAX_UNLIMITED_TASKS = 100_000


def register(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("tasks", help="task sets: difficulty filtering")
    tasks_sub = group.add_subparsers(dest="tasks_command", metavar="SUBCOMMAND")
    tasks_sub.required = True
    group.set_defaults(handler=lambda args: group.print_help() or 2)
    p = tasks_sub.add_parser(
        "filter",
        help="estimate each task's pass rate with a model and keep those inside a band",
        description="Sample --k completions per task with the model (seeded Gumbel sampling), score them "
        "with the task's verifier, and write the tasks whose pass rate lies in [--min, --max] to --out "
        "(JSONL or Parquet, readable as --tasks).",
    )
    flags = SettingsFlags(p, FilterSettings)
    p.add_argument("--model", type=Path, required=True, help="HF model directory to estimate with")
    p.add_argument("--tasks", default=None, help="task file (Parquet/JSONL) or builtin:arithmetic[?...]")
    p.add_argument("--out", type=Path, required=True, help="task file to write (.jsonl or .parquet)")
    flags.add(
        Flag("k"),
        Flag("min_pass", "--min", dest="min_pass"),
        Flag("max_pass", "--max", dest="max_pass"),
        Flag("limit"),
        Flag("offset"),
        Flag("max_new_tokens"),
        Flag("temperature"),
        Flag("seed"),
        Flag("task_seed"),
        Flag("engine.threads"),
    )
    p.add_argument("--gpu", action="store_true", default=None, help="generate on CUDA")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=filter_tasks)


def filter_tasks(args: argparse.Namespace) -> int:
    # Heavy imports (torch, transformers) only when the command runs, so `--help` stays fast.
    from transformers import AutoTokenizer

    from ..engine import load_engine
    from ..environments import open_task_set
    from ..environments.difficulty import (
        estimate_pass_rates,
        histogram,
        in_band,
        render_histogram,
        write_task_file,
    )
    from ..runtime.progress import progress_bar

    settings = load_settings(args, FilterSettings)
    if args.gpu:
        settings.engine.device = "cuda"
    task_set = open_task_set(args.tasks, seed=settings.task_seed)
    total = len(task_set)
    if settings.offset >= total:
        raise TaskError(f"--offset {settings.offset} is past the end of {task_set.name} ({total} tasks)")
    count = min(settings.limit or total, total - settings.offset)
    if settings.limit is None and count > MAX_UNLIMITED_TASKS:
        raise TaskError(f"{task_set.name} has {total} tasks; pass --limit N to estimate only N of them")
    indices = list(range(settings.offset, settings.offset + count))
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TaskError(f"cannot load the tokenizer of {args.model}: {exc}") from None
    engine = load_engine(args.model, **settings.engine.model_dump())
    started = time.perf_counter()
    # Enough tasks per engine call to fill its micro-batches, few enough for a lively progress bar.
    per_batch = max(1, settings.engine.max_batch_size // settings.k)
    with progress_bar(count, "estimating", "task", enabled=not (args.no_progress or args.json)) as bar:
        estimates = estimate_pass_rates(
            engine,
            tokenizer,
            task_set,
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
        "source": task_set.name,
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
