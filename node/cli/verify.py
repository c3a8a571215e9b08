"""`prime-node verify FILE --checkpoint DIR`: run every check on a rollout file.

Exit status: 0 accepted, 1 rejected, 2 usage or I/O errors (missing file, unloadable checkpoint).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import ConfigError, NodeError
from ..run.settings import VerifySettings
from .common import model_dir, print_json
from .flags import Flag, SettingsFlags, load_settings
from .run_flags import add_run_flags

EXIT_ACCEPTED, EXIT_REJECTED, EXIT_IO = 0, 1, 2


class VerifyIOError(NodeError):
    """The file or the checkpoint cannot be read: not a verdict on the file."""

    exit_code = EXIT_IO


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", help="check a rollout file (exit 0 accepted, 1 rejected, 2 usage or I/O error)"
    )
    flags = SettingsFlags(p, VerifySettings)
    p.add_argument("file", type=Path, help="rollout file (its signature is FILE.sig)")
    p.add_argument("--checkpoint", type=Path, required=True, help="HF model directory of the claimed policy")
    add_run_flags(flags)
    flags.add(Flag("engine.threads"), Flag("verifier.sample_fraction"))
    p.add_argument("--json", action="store_true", help='print {"accepted", "checks", "reasons"} as JSON')
    p.set_defaults(handler=verify)


def verify(args: argparse.Namespace) -> int:
    # Heavy imports (torch, transformers) only when the command runs, so `--help` stays fast.
    from ..engine import load_engine
    from ..run.settings import load_run_tasks, validator_engine, verifier_for_run
    from ..run.validation import verify_rollout_file

    try:
        settings = load_settings(args, VerifySettings)
    except ConfigError as exc:
        raise VerifyIOError(str(exc)) from None
    if not args.file.is_file():  # a missing FILE.sig is a verdict (unsigned), a missing FILE is not
        raise VerifyIOError(f"{args.file} does not exist or is not a file")
    try:
        model_dir(args.checkpoint, "--checkpoint")
    except NodeError as exc:
        raise VerifyIOError(str(exc)) from None
    run = settings.run
    verifier = verifier_for_run(settings.verifier, run)
    try:
        engine = load_engine(args.checkpoint, **validator_engine(settings.engine).model_dump())
        tasks = load_run_tasks(settings.run, args.checkpoint)
    except NodeError as exc:
        raise VerifyIOError(str(exc)) from None
    report = verify_rollout_file(args.file, engine, tasks, verifier)
    if args.json:
        print_json(report.as_dict())
    else:
        for check in report.checks:
            where = f" (row {check.row})" if check.row is not None else ""
            print(f"{check.status:>7}  {check.name:<16} {check.detail}{where}")
        print("ACCEPTED" if report.accepted else "REJECTED: " + "; ".join(report.reasons))
    return EXIT_ACCEPTED if report.accepted else EXIT_REJECTED
