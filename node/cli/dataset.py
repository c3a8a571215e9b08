"""`prime-node dataset build`: the verified dataset of a synthetic run (docs/synthetic.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ...trainer.dataset.settings import DatasetBuildSettings
from .common import print_json
from .flags import Flag, SettingsFlags, load_settings
from .run_flags import add_run_flags


def register(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("dataset", help="datasets of verified rollouts (synthetic runs)")
    dataset_sub = group.add_subparsers(dest="dataset_command", metavar="SUBCOMMAND")
    dataset_sub.required = True
    group.set_defaults(handler=lambda args: group.print_help() or 2)
    p = dataset_sub.add_parser(
        "build",
        help="collect the accepted rollouts of a run into one Parquet dataset directory",
        description="Collect the files a trusted validator accepted (its signed verdict in the ledger, the "
        "file's own signature and hash) into a dataset directory: rows.parquet (every verified sample), "
        "sft.parquet, preference.parquet, difficulty.parquet (pass@k per task and model), verdicts.parquet "
        "and a README.md dataset card. Files without such a verdict never reach it.",
    )
    flags = SettingsFlags(p, DatasetBuildSettings)
    p.add_argument("--out", type=Path, required=True, help="the dataset directory to write")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    flags.add(
        Flag("dataset.ledgers", "--ledger", append=True, metavar="PATH"),
        Flag("dataset.accepted_dir"),
        Flag("dataset.weights_dir"),
        Flag("dataset.validator_keys", "--validator-key", append=True, metavar="HEX"),
        Flag("dataset.operator_key", metavar="HEX"),
        Flag("dataset.model_label", metavar="LABEL"),
        Flag("dataset.correct_threshold"),
        Flag("dataset.pass_k", nargs="+", metavar="K"),
        Flag("dataset.annotations", "--annotation", append=True, metavar="LABEL=DIR"),
        Flag("dataset.band_model", metavar="LABEL"),
        Flag("dataset.sft.min_tokens", "--sft-min-tokens"),
        Flag("dataset.sft.max_tokens", "--sft-max-tokens"),
        Flag("dataset.sft.min_solve_rate", "--sft-min-solve-rate"),
        Flag("dataset.sft.max_solve_rate", "--sft-max-solve-rate"),
    )
    add_run_flags(flags)
    p.add_argument("--json", action="store_true", help="print the counts as JSON")
    p.set_defaults(handler=build)


def build(args: argparse.Namespace) -> int:
    from ...trainer.dataset.build import build_dataset

    settings = load_settings(args, DatasetBuildSettings)
    result = build_dataset(settings.run, settings.dataset, args.out, force=args.force)
    if args.json:
        print_json({"out": str(result.out), **result.meta["counts"], "skipped": result.meta["skipped"]})
        return 0
    print(f"dataset     {result.out}")
    for key, value in result.meta["counts"].items():
        print(f"{key:<28}{value}")
    for reason, n in sorted(result.meta["skipped"].items()):
        print(f"left out    {n} file(s): {reason}")
    return 0
