"""`prime-node devnet`: a trainer, a validator, contributors and cheaters on this machine (docs/devnet.md).

Creates the embedded model if it is missing, starts every role as its own process on 127.0.0.1, shows a
live view, and after --steps policy steps (or Ctrl-C, SIGTERM, SIGHUP) stops them all and prints the report:
reward per step (and a PNG), the leaderboard, who was slashed and why, and the timings. Exit status 0 when the run
completed (or was interrupted) with every process stopped, every adversary banned (a pipeline drop-out: gone
mid-batch unpunished, nothing of its batch accepted, its group-mate working again) and no honest file rejected;
1 otherwise.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..config import CommonSettings
from ..errors import ConfigError
from .common import print_json
from .flags import SettingsFlags, load_settings

# Enough rollout steps for the tiny model's reward to move visibly (docs/devnet.md); about 5 minutes at one
# step every 4-7 s on 2 cores, inside the 15-minute budget with the model's creation.
STEPS = 50


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "devnet", help="run a whole swarm on this machine (trainer, validator, contributors, cheaters)"
    )
    SettingsFlags(p, CommonSettings)
    p.add_argument(
        "--nodes", type=int, default=None, help="honest contributors (default 3; 1 with --pipeline)"
    )
    p.add_argument("--adversaries", type=int, default=1, help="cheating contributors (default %(default)s)")
    p.add_argument(
        "--attacks",
        nargs="+",
        default=None,
        metavar="KIND",
        help="their attacks, in order (default: the attack list in order); see docs/devnet.md",
    )
    p.add_argument("--steps", type=int, default=STEPS, help="policy steps to train (default %(default)s)")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="genesis model directory (default <data-dir>/models/tiny, created if missing)",
    )
    p.add_argument(
        "--batch-size", type=int, default=None, help="trainer samples per step (default: the trainer's)"
    )
    p.add_argument(
        "--prompts",
        type=int,
        default=None,
        help="prompts per rollout file (default 16: fewer, larger files; see docs/devnet.md)",
    )
    p.add_argument("--samples", type=int, default=None, help="completions per prompt (default: the run's)")
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="most tokens per sample (default: the node's)"
    )
    p.add_argument(
        "--length-targets",
        type=int,
        nargs="*",
        default=None,
        help="thinking-length targets of the run (default: the run's)",
    )
    p.add_argument(
        "--env",
        default=None,
        metavar="NAME[:ARGS]",
        help="the run's task environment (default arithmetic; prime-node tasks list; docs/environments.md)",
    )
    p.add_argument(
        "--all-tasks",
        action="store_true",
        help="train on the whole environment instead of the tasks the model solves 1-4 times in 8 "
        "(offline difficulty filtering of its first 1200, cached beside the model)",
    )
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="a synthetic run: the model stays frozen, the run stops after --synthetic-files accepted files and "
        "ends with a dataset directory (<run dir>/dataset; docs/synthetic.md)",
    )
    p.add_argument(
        "--synthetic-files",
        type=int,
        default=12,
        help="accepted files after which a synthetic run stops (default %(default)s)",
    )
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="a pipeline devnet: the run cut into two stages, --pipeline-nodes `start --pipeline` nodes in "
        "groups the trainer forms, adversaries cheating as stages (docs/devnet.md)",
    )
    p.add_argument(
        "--pipeline-nodes",
        type=int,
        default=4,
        help="honest pipeline nodes with --pipeline (default %(default)s: two groups of two stages)",
    )
    p.add_argument("--run-id", default="devnet", help="run id (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the final report as JSON (no live view)")
    p.set_defaults(handler=devnet)


def devnet(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ...trainer.devnet.layout import DEVNET_PROMPTS, Sizing
    from ...trainer.devnet.report import format_report
    from ...trainer.devnet.runner import Devnet, DevnetOptions, attack_kinds
    from ...trainer.devnet.synthetic import SyntheticOptions
    from ...trainer.devnet.tasks import TaskFilter
    from ...trainer.devnet.view import LiveView
    from ..environments import DEFAULT_ENV, open_environment

    settings = load_settings(args, CommonSettings)
    env = args.env or DEFAULT_ENV
    open_environment(env)  # a bad or missing environment stops here, before any process starts
    if args.nodes is None:
        args.nodes = 1 if args.pipeline else 3
    for name in ("nodes", "steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1")
    if args.pipeline and args.pipeline_nodes < 1:
        raise ConfigError("--pipeline-nodes must be at least 1")
    if args.pipeline and args.synthetic:
        raise ConfigError("--pipeline and --synthetic do not go together yet")
    if args.synthetic_files < 1:
        raise ConfigError("--synthetic-files must be at least 1")
    if args.adversaries < 0:
        raise ConfigError("--adversaries must be 0 or more")
    data_dir = settings.resolved_data_dir()
    root = data_dir / "devnet" / time.strftime("run-%Y%m%d-%H%M%S")
    sizing = Sizing(
        batch_size=args.batch_size,
        prompts=args.prompts or DEVNET_PROMPTS,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        length_targets=None if args.length_targets is None else tuple(args.length_targets),
    )
    options = DevnetOptions(
        root=root,
        model_dir=(args.model or data_dir / "models" / "tiny").expanduser().resolve(),
        nodes=args.nodes,
        attacks=attack_kinds(args.adversaries, args.attacks, pipeline=args.pipeline),
        steps=args.steps,
        run_id=args.run_id,
        sizing=sizing,
        env=env,
        task_filter=None if args.all_tasks else TaskFilter(env=env),
        progress=not args.json,
        synthetic=SyntheticOptions(args.synthetic_files) if args.synthetic else None,
        pipeline_nodes=args.pipeline_nodes if args.pipeline else 0,
    )
    # With --json, stdout carries only the report: the view's lines go to stderr, plain, and no bar is drawn.
    view = LiveView(args.steps, Console(stderr=True), live=False) if args.json else LiveView(args.steps)
    report = Devnet(options, view).run()
    if args.json:
        print_json(report)
    else:
        print(format_report(report))
    return 0 if succeeded(report) else 1


def succeeded(report: dict) -> bool:
    """No failure, nothing left running, no honest file rejected, every adversary that sent files banned, and
    every drop-out (a pipeline devnet's `stage-dropout`) gone mid-batch, unpunished, its group-mate working again."""
    dropouts = report.get("dropouts", [])
    dropped = {d["name"] for d in dropouts}
    adversaries_ok = all(
        a["banned"]
        for a in report["adversaries"]
        if (a["rejected_files"] or a["accepted_files"]) and a["name"] not in dropped
    ) and all(d["ok"] for d in dropouts)
    return (
        report["error"] is None
        and ("dataset" not in report or report["dataset"] is not None)
        and not report["processes"]["alive"]
        and report["honest"]["rejected_files"] == 0
        and adversaries_ok
    )
