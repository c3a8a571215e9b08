"""`prime-node tasks`: the installed environments (`list`), a look at an environment's tasks and how its scorer
scores them (`preview`), and offline difficulty filtering (`filter`: keep the tasks a model solves sometimes
but not always)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from ..config import CommonSettings
from ..environments.difficulty import FilterSettings
from ..errors import TaskError
from .common import model_dir, print_json
from .flags import Flag, SettingsFlags, load_settings

# Past this many tasks, estimating every one is surely a mistake (the built-in set has 2^24).
MAX_UNLIMITED_TASKS = 100_000
MAX_SHOWN_CHARS = 400  # of a prompt, answer or metadata in the text preview (--json has them whole)


class PreviewSettings(CommonSettings):
    """Settings of `prime-node tasks preview`."""

    task_seed: int = Field(
        0, ge=0, lt=2**63, description="Seed of generated environments unless ARGS give one."
    )
    offset: int = Field(0, ge=0, description="First task index shown.")
    count: int = Field(5, ge=1, le=1000, description="Tasks shown.")


def register(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("tasks", help="task environments: list, preview, difficulty filtering")
    tasks_sub = group.add_subparsers(dest="tasks_command", metavar="SUBCOMMAND")
    tasks_sub.required = True
    group.set_defaults(handler=lambda args: group.print_help() or 2)
    listing = tasks_sub.add_parser(
        "list",
        help="the installed environments (entry points of prime_node.environments)",
        description="Every environment --env can name: its name, the package and version that provide it, "
        "and what it is. A name two packages register cannot be opened until one is uninstalled.",
    )
    SettingsFlags(listing, CommonSettings)
    listing.add_argument("--json", action="store_true", help="print the list as JSON")
    listing.set_defaults(handler=list_environments)
    preview = tasks_sub.add_parser(
        "preview",
        help="show an environment's identity and some of its tasks, scored by its scorer",
        description="Open --env as a run would (its identity is what the run pins), show --count tasks from "
        "--offset with their reference answers, and score each reference answer (and --completion, if "
        "given) through the environment's scorer and its limits, as node and validator do.",
    )
    source = preview.add_mutually_exclusive_group()
    source.add_argument("--env", default=None, metavar="NAME[:ARGS]", help="environment (default arithmetic)")
    source.add_argument(
        "--tasks", default=None, help="task file (Parquet/JSONL): shorthand of --env file:PATH"
    )
    SettingsFlags(preview, PreviewSettings).add(Flag("task_seed"), Flag("offset"), Flag("count"))
    preview.add_argument("--completion", default=None, help="also score this text as every task's completion")
    preview.add_argument("--json", action="store_true", help="print the preview as JSON")
    preview.set_defaults(handler=preview_tasks)
    p = tasks_sub.add_parser(
        "filter",
        help="estimate each task's pass rate with a model and keep those inside a band",
        description="Sample --k completions per task with the model (seeded Gumbel sampling), score them "
        "with the environment's scorer, and write the tasks whose pass rate lies in [--min, --max] to --out "
        "(JSONL or Parquet; a run uses them with --env filtered:OUT).",
    )
    flags = SettingsFlags(p, FilterSettings)
    p.add_argument("--model", type=Path, required=True, help="HF model directory to estimate with")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--env", default=None, metavar="NAME[:ARGS]", help="environment to filter (default arithmetic)"
    )
    source.add_argument(
        "--tasks", default=None, help="task file (Parquet/JSONL): shorthand of --env file:PATH"
    )
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
    from ..environments import open_environment, spec_of_tasks
    from ..environments.difficulty import (
        estimate_pass_rates,
        histogram,
        in_band,
        render_histogram,
        write_task_file,
    )
    from ..runtime.progress import progress_bar

    settings = load_settings(args, FilterSettings)
    model_dir(args.model, "--model")
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
    with progress_bar(count, "estimating", "task", enabled=not (args.no_progress or args.json)) as bar:
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
    write_task_file(args.out, kept, environment)
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


def list_environments(args: argparse.Namespace) -> int:
    from ..environments.registry import installed

    load_settings(args, CommonSettings)
    rows: list[dict[str, Any]] = []
    for name, entries in sorted(installed().items()):
        for entry in entries:
            try:
                summary = entry.summary()
            except Exception as exc:  # a plugin that cannot be imported is listed with the reason
                summary = f"(cannot be loaded: {type(exc).__name__}: {exc})"
            rows.append(
                {
                    "name": name,
                    "package": entry.package,
                    "version": entry.version,
                    "entry_point": entry.target,
                    "summary": summary,
                    "conflict": len(entries) > 1,
                }
            )
    if args.json:
        print_json({"environments": rows})
        return 0
    width = max([len(r["name"]) for r in rows] + [4])
    package_width = max([len(f"{r['package']} {r['version']}") for r in rows] + [7])
    print(f"{'NAME':<{width}}  {'PACKAGE':<{package_width}}  SUMMARY")
    for r in rows:
        mark = "  (registered by more than one package: cannot be opened)" if r["conflict"] else ""
        print(
            f"{r['name']:<{width}}  {r['package'] + ' ' + r['version']:<{package_width}}  {r['summary']}{mark}"
        )
    return 0


def _shown(text: str) -> str:
    text = text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + f"... ({len(text)} characters)"
    return text.replace("\n", "\n             ")


def preview_tasks(args: argparse.Namespace) -> int:
    from ..environments import open_environment, spec_of_tasks
    from ..environments.rewards import EnvironmentScorer

    settings = load_settings(args, PreviewSettings)
    environment = open_environment(args.env or spec_of_tasks(args.tasks), seed=settings.task_seed)
    total = len(environment)
    if settings.offset >= total:
        raise TaskError(f"--offset {settings.offset} is past the end of {environment.spec} ({total} tasks)")
    scorer = EnvironmentScorer(environment)
    shown = []
    for index in range(settings.offset, min(settings.offset + settings.count, total)):
        task = environment.get(index)
        item = task.model_dump() | {"index": index, "answer_score": scorer(task.answer, task)}
        if args.completion is not None:
            item["completion_score"] = scorer(args.completion, task)
        shown.append(item)
    identity = environment.identity
    if args.json:
        print_json(
            {
                "spec": environment.spec,
                "identity": identity.model_dump(),
                "pin": identity.pin,
                "tasks": total,
                "scoring": environment.scoring.model_dump(),
                "preview": shown,
            }
        )
        return 0
    scoring = environment.scoring
    print(f"environment  {environment.spec}")
    print(f"identity     {identity.pin}")
    limits = (
        ""
        if scoring.isolation == "inline"
        else f" ({scoring.wall_s:g} s, {scoring.cpu_s:g} CPU-s, {scoring.memory_mb} MiB)"
    )
    print(f"tasks        {total}, scored {scoring.isolation}{limits}")
    for item in shown:
        print(f"\n#{item['index']}  {item['task_type']}, difficulty {item['difficulty']}")
        print(f"  prompt     {_shown(item['prompt'])}")
        print(f"  answer     {_shown(item['answer'])}  (scores {item['answer_score']:g})")
        if item["metadata"] != "{}":
            print(f"  metadata   {_shown(item['metadata'])}")
        if "completion_score" in item:
            print(f"  --completion scores {item['completion_score']:g}")
    return 0
