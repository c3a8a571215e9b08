"""`prime-node sft`: fine-tune a model on a verified dataset's SFT subset (docs/synthetic.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..models.sft_config import SftSettings
from .common import print_json
from .flags import Flag, SettingsFlags, load_settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sft",
        help="fine-tune a model on a dataset's verified correct traces (resumable)",
        description="Supervised fine-tuning of --model on the SFT subset (sft.parquet) of a directory written "
        "by `prime-node dataset build`, with the warm start's training loop. Saves a resumable state every "
        "--save-every steps beside --out: run the same command again after a kill to continue. Writes an HF "
        "directory like `prime-node model init`, which `prime-node trainer --model` takes.",
    )
    flags = SettingsFlags(p, SftSettings)
    p.add_argument(
        "--dataset", type=Path, required=True, help="a dataset directory (prime-node dataset build)"
    )
    p.add_argument("--model", type=Path, required=True, help="the student: an HF model directory")
    p.add_argument("--out", type=Path, required=True, help="the directory to write the fine-tuned model to")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    flags.add(
        Flag("sft.steps"),
        Flag("sft.batch_size"),
        Flag("sft.lr"),
        Flag("sft.warmup_steps"),
        Flag("sft.seed"),
        Flag("sft.save_every"),
        Flag("sft.threads"),
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=sft)


def sft(args: argparse.Namespace) -> int:
    settings = load_settings(args, SftSettings)
    from ..models.dataset_sft import sft_from_dataset  # imports torch: only when the command runs

    result = sft_from_dataset(
        args.dataset,
        args.model,
        args.out,
        settings.sft,
        progress=not (args.no_progress or args.json),
        force=args.force,
    )
    if args.json:
        print_json(result.model_dump())
        return 0
    print(f"model dir   {result.out}")
    resumed = f" (resumed at step {result.resumed_from})" if result.resumed_from else ""
    print(f"sft         {result.steps} steps on {result.samples} verified correct samples{resumed}")
    print(f"final loss  {result.final_loss}")
    print(f"sha256      {result.model_sha256}  model.safetensors")
    print(f"time        {result.wall_seconds:.1f} s wall, {result.cpu_seconds:.1f} s CPU")
    return 0
