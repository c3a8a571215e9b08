"""`prime-node model init`: create the embedded tiny model, warm-start it and save it as an HF directory."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pydantic import Field

from ..config import CommonSettings
from ..models.warmstart_config import WarmStartConfig
from .common import print_json
from .flags import Flag, SettingsFlags, load_settings


class ModelInitSettings(CommonSettings):
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of the model's initial weights.")
    chat: bool = Field(
        False, description="Build the chat model: a BPE tokenizer trained here, with a chat template."
    )
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig, description="Supervised warm start.")


def register(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("model", help="the embedded tiny model")
    model_sub = group.add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    model_sub.required = True  # argparse rejects `prime-node model` alone; the group handler is never reached
    group.set_defaults(handler=lambda args: group.print_help() or 2)
    p = model_sub.add_parser(
        "init",
        help="create the tiny model from a seed and warm-start it on the arithmetic tasks",
        description="Create the tiny Qwen2 model deterministically from --seed, warm-start it by "
        "supervised training on the built-in arithmetic tasks, and save an HF directory (config.json, "
        "model.safetensors, tokenizer files, prime_node.json). The same seed and settings give the same "
        "model.safetensors bytes. With --chat, the tokenizer is a byte-level BPE trained here on generated "
        "text and carries a chat template (docs/model.md), and the warm start uses the chat format.",
    )
    flags = SettingsFlags(p, ModelInitSettings)
    p.add_argument("--out", type=Path, required=True, help="directory to write (must be empty or absent)")
    flags.add(
        Flag("seed"),
        Flag("warm_start.steps", "--sft-steps"),
        Flag("warm_start.task_seed"),
        Flag("warm_start.threads"),
        Flag("chat"),
    )
    p.add_argument(
        "--force", action="store_true", help="write into a non-empty directory, replacing model files"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=init)


def init(args: argparse.Namespace) -> int:
    settings = load_settings(args, ModelInitSettings)
    from ..models.warmstart import init_model_dir  # imports torch: only when the command runs

    out_dir = args.out.expanduser().resolve()
    wall0 = time.perf_counter()
    cpu0 = time.process_time()
    # The bar goes to stderr, only on a terminal (node/runtime/progress.py); --json keeps every stream quiet.
    progress = not (args.no_progress or args.json)
    report, info = init_model_dir(
        out_dir,
        settings.seed,
        settings.warm_start,
        force=args.force,
        progress=progress,
        chat=settings.chat,
    )
    summary = {
        "model_dir": str(out_dir),
        **info,
        "wall_seconds": round(time.perf_counter() - wall0, 3),
        "cpu_seconds": round(time.process_time() - cpu0, 3),
    }
    if args.json:
        print_json(summary)
        return 0
    levels = "  ".join(f"L{k} {100 * v:.0f}%" for k, v in report.accuracy_by_level.items())
    print(f"model dir   {out_dir}")
    print(f"seed        {settings.seed}" + ("  (chat model)" if settings.chat else ""))
    task_seed = settings.warm_start.task_seed
    print(f"warm start  {report.steps} steps on task seed {task_seed}, final loss {report.final_loss}")
    accuracy = f"{100 * report.heldout_accuracy:.1f}%"
    print(f"held-out    {accuracy} exact match over {report.eval_size} problems ({levels})")
    print(f"sha256      {info['model_sha256']}  model.safetensors")
    print(f"time        {summary['wall_seconds']:.1f} s wall, {summary['cpu_seconds']:.1f} s CPU")
    return 0
