"""`prime-node rollout`: produce one signed rollout file offline, exactly as a contributor would."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import NodeError
from ..run.settings import RolloutSettings
from .common import model_dir, print_json
from .flags import Flag, SettingsFlags, load_settings
from .run_flags import add_run_flags


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rollout", help="generate one signed rollout file offline, as a contributor would")
    flags = SettingsFlags(p, RolloutSettings)
    p.add_argument("--checkpoint", type=Path, required=True, help="HF model directory of the policy")
    add_run_flags(flags)
    flags.add(Flag("engine.threads"))
    p.add_argument("--key", type=Path, required=True, help="the node's secret key file")
    p.add_argument("--step", type=int, required=True, help="policy step of the checkpoint")
    p.add_argument("--out", type=Path, required=True, help="rollout file to write (FILE and FILE.sig)")
    p.add_argument(
        "--batch-counter",
        type=int,
        default=0,
        help="the node's batch number at this step (default %(default)s)",
    )
    flags.add(Flag("prompts"))
    p.add_argument("--gpu", action="store_true", default=None, help="generate on CUDA")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(handler=rollout)


def rollout(args: argparse.Namespace) -> int:
    settings = load_settings(args, RolloutSettings)
    model_dir(args.checkpoint, "--checkpoint")
    # Heavy imports (torch, transformers) only when the command runs, so `--help` stays fast.
    from ...p2p.identity import Identity
    from ..engine import load_engine
    from ..run.producer import BatchSpec, produce_rollout_file
    from ..run.settings import engine_for_run, load_run_tasks

    if args.gpu:
        settings.engine.device = "cuda"
    if args.step < 0 or args.batch_counter < 0:
        raise NodeError("--step and --batch-counter must be >= 0")
    identity = Identity.load(args.key)
    engine = load_engine(args.checkpoint, **engine_for_run(settings.engine, settings.run).model_dump())
    tasks = load_run_tasks(settings.run, args.checkpoint)
    spec = BatchSpec(
        run_id=settings.run.run_id,
        run_seed=settings.run.run_seed,
        policy_step=args.step,
        batch_counter=args.batch_counter,
        prompts=settings.prompts,
        samples=settings.run.samples,
        temperature=settings.run.temperature,
        max_new_tokens=settings.run.max_new_tokens,
    )
    batch = produce_rollout_file(engine, tasks, identity, spec, args.out)
    summary = {
        "file": str(args.out),
        "rows": len(batch.rows),
        "node_id": identity.node_id,
        "mean_reward": sum(r.reward for r in batch.rows) / len(batch.rows),
        "tokens": sum(len(r.output_ids) for r in batch.rows),
        "generation_seconds": round(batch.generation_seconds, 3),
        "proof_seconds": round(batch.proof_seconds, 3),
    }
    if args.json:
        print_json(summary)
    else:
        print(
            f"wrote {args.out} ({summary['rows']} samples, {summary['tokens']} tokens, "
            f"mean reward {summary['mean_reward']:.3f}) and {args.out}.sig"
        )
    return 0
