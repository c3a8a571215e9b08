"""Entry point of the `prime-node` command.

Each command group lives in its own module with a `register(subparsers)` function; a module is listed in
COMMAND_MODULES only once its commands work, so `--help` never shows placeholders. Fatal errors that the
packages raise on purpose become one clear line on stderr and a non-zero exit; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from ...p2p.errors import P2PError
from ...proofs.errors import ProofError
from ...trainer.errors import TrainerError
from .. import __version__
from ..config import FlagValueError
from ..errors import NodeError

COMMAND_MODULES = [
    "keys",
    "model",
    "weights",
    "leaderboard",
    "validator",
    "rollout",
    "verify",
    "start",
    "status",
    "tasks",
    "trainer",
    "devnet",
    "dataset",
    "sft",
]

EXPECTED_ERRORS = (NodeError, P2PError, ProofError, TrainerError)
EXIT_ERROR = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prime-node",
        description="Permissionless, globally distributed RL of language models: contributor, trainer and validator.",
    )
    parser.add_argument("--version", action="version", version=f"prime-node {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__package__}.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except EXPECTED_ERRORS as exc:
        logging.getLogger(__name__).debug("fatal error", exc_info=True)
        print(f"prime-node {args.command}: error: {exc}", file=sys.stderr)
        if isinstance(
            exc, FlagValueError
        ):  # a flag's value broke its setting's rules: as argparse's own errors
            return EXIT_USAGE
        return getattr(exc, "exit_code", EXIT_ERROR)
    except KeyboardInterrupt:
        print(f"prime-node {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
