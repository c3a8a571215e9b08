"""The command line is a contract: every command, subcommand and option stays as recorded.

tests/data/cli_surface.json holds, for `prime-node` and each of its subcommands, every option with its
flags, destination, arity, metavar, choices, default and whether it is required. Help wording may improve
(it is generated from the settings' field descriptions); the surface may not change by accident. A change
to the CLI is deliberate: regenerate the file with
`.venv/bin/python tests/test_cli_surface.py > tests/data/cli_surface.json` and review the diff.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from prime_node.node.cli.main import build_parser

SURFACE = Path(__file__).parent / "data" / "cli_surface.json"


def _option(action: argparse.Action) -> dict[str, Any]:
    default = action.default
    if default is not None and not isinstance(default, (str, int, float, bool, list)):
        default = str(default)
    return {
        "flags": list(action.option_strings) or [action.dest],
        "dest": action.dest,
        "kind": type(action).__name__,
        "nargs": action.nargs,
        "metavar": action.metavar,
        "choices": sorted(map(str, action.choices))
        if action.choices and not isinstance(action, argparse._SubParsersAction)
        else None,
        "default": default,
        "required": action.required,
        "type": getattr(action.type, "__name__", None) if action.type else None,
    }


def surface() -> dict[str, Any]:
    commands: dict[str, Any] = {}

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        options = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, f"{path} {name}")
                options.append({"subcommands": sorted(action.choices)})
            else:
                options.append(_option(action))
        commands[path] = options

    walk(build_parser(), "prime-node")
    return commands


def test_the_command_line_is_unchanged():
    assert surface() == json.loads(SURFACE.read_text()), (
        "the CLI changed; if on purpose, regenerate tests/data/cli_surface.json (see this module's docstring)"
    )


if __name__ == "__main__":
    print(json.dumps(surface(), indent=1, sort_keys=True))
