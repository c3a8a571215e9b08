"""The run's parameters as flags: the same set on every command that takes part in a run.

`start`, `rollout`, `verify`, `validator` and `trainer` all load the `run` section (node/run_config.RunSettings),
and the trainer announces it with every policy (node/run/announcement.py), so each of them accepts the same
flags for it, with the same names and defaults.
"""

from __future__ import annotations

import argparse

# Dotted setting -> argparse destination.
RUN_FLAGS = {
    "run.run_id": "run_id",
    "run.run_seed": "run_seed",
    "run.env": "env",
    "run.tasks": "tasks",
    "run.task_seed": "task_seed",
    "run.samples": "samples",
    "run.length_targets": "length_targets",
    "run.length_alpha": "length_alpha",
    "run.compute_dtype": "compute_dtype",
    "run.temperature": "temperature",
    "run.max_new_tokens": "max_new_tokens",
}


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """Add a flag for every field of RunSettings (mapped by RUN_FLAGS); none given keeps config and defaults."""
    g = p.add_argument_group(
        "run parameters (every party of a run must agree on them; the trainer announces its own)"
    )
    g.add_argument("--run-id", default=None, help="name of the run (default local)")
    g.add_argument("--run-seed", type=int, default=None, help="seed of the work assignment (default 0)")
    g.add_argument(
        "--env",
        default=None,
        metavar="NAME[:ARGS]",
        help="task environment (default arithmetic; prime-node tasks list shows the installed ones)",
    )
    g.add_argument("--tasks", default=None, help="task file (Parquet/JSONL): shorthand of --env file:PATH")
    g.add_argument("--task-seed", type=int, default=None, help="seed of generated environments (default 0)")
    g.add_argument("--samples", type=int, default=None, help="completions per prompt, G (default 4)")
    g.add_argument(
        "--length-targets", type=int, nargs="*", default=None, help="thinking-length targets (default off)"
    )
    g.add_argument(
        "--length-alpha", type=float, default=None, help="length penalty per token (default 0.001)"
    )
    # The values of proofs.toploc.Precision, spelled out: importing it here would slow `--help`.
    g.add_argument(
        "--compute-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="the dtype every contributor generates in; picks the proof bounds (default float32)",
    )
    g.add_argument(
        "--temperature", type=float, default=None, help="the run's sampling temperature (default 1.0)"
    )
    g.add_argument(
        "--max-new-tokens", type=int, default=None, help="the run's most tokens per sample (default 64)"
    )
