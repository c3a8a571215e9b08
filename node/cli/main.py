"""Entry point of the `prime-node` command.

Each command group lives in its own module with a `register(subparsers)` function; a module is listed in
COMMAND_MODULES only once its commands work, so `--help` never shows placeholders.

The one error path of every command (docs/configuration.md, Errors): fatal errors that the packages raise on purpose
become one clear line on stderr and a non-zero exit, and with `--json` also a JSON object
`{"error": ..., "command": ...}` on stdout, so a script reading stdout gets JSON either way; anything else is
a bug and keeps its traceback. A reader that closes the pipe early (`prime-node leaderboard --json | head`)
ends the command quietly with 141, as SIGPIPE ends other Unix tools, instead of a BrokenPipeError traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence

from pydantic import BaseModel

from ...p2p.errors import P2PError
from ...proofs.errors import ProofError
from ...trainer.errors import TrainerError
from .. import __version__
from ..config import FlagValueError, check_env_names
from ..errors import NodeError
from .flags import NAMESPACE_KEY, SettingsFlags

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
EXIT_BROKEN_PIPE = 128 + 13  # what a shell shows for a process ended by SIGPIPE


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
    _name_commands(parser)
    return parser


def _name_commands(parser: argparse.ArgumentParser) -> None:
    """Record each parser's full name (`prime-node weights fetch`) for its errors; the innermost one parsed
    wins, as argparse lets a subcommand's defaults override its group's."""
    parser.set_defaults(command_name=parser.prog)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _name_commands(child)


def settings_models(parser: argparse.ArgumentParser) -> Iterator[type[BaseModel]]:
    """The settings model of every command under `parser` (what PRIME_NODE_* variables may set)."""
    flags = parser.get_default(NAMESPACE_KEY)
    if isinstance(flags, SettingsFlags):
        yield flags.model
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from settings_models(child)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_env_names(settings_models(parser))
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except EXPECTED_ERRORS as exc:
        logging.getLogger(__name__).debug("fatal error", exc_info=True)
        return _report(args, exc)
    except KeyboardInterrupt:
        print(f"{args.command_name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader is gone: point stdout at /dev/null so that the interpreter's last flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _report(args: argparse.Namespace, exc: Exception) -> int:
    """One line on stderr (and the JSON object on stdout with --json); the exit status."""
    code = EXIT_USAGE if isinstance(exc, FlagValueError) else getattr(exc, "exit_code", EXIT_ERROR)
    message = str(exc)
    print(f"{args.command_name}: error: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        try:
            json.dump(
                {
                    "command": args.command_name.removeprefix("prime-node "),
                    "error": message,
                    "exit_code": code,
                },
                sys.stdout,
            )
            sys.stdout.write("\n")
            sys.stdout.flush()
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


if __name__ == "__main__":
    sys.exit(main())
