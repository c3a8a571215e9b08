"""The command line is a contract: `prime-node --help` and every subcommand's options stay as recorded.

tests/data/cli_surface.txt holds the help text of every command and subcommand, rendered at a fixed width.
A change to the CLI is deliberate: regenerate the file with
`.venv/bin/python tests/test_cli_surface.py > tests/data/cli_surface.txt` and review the diff.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from prime_node.node.cli.main import build_parser

SURFACE = Path(__file__).parent / "data" / "cli_surface.txt"
WIDTH = "100"  # argparse wraps help at $COLUMNS: a fixed width keeps the text machine-independent


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render() -> str:
    os.environ["COLUMNS"] = WIDTH
    out: list[str] = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        out.append(f"===== {path}\n{parser.format_help()}")
        for name, child in _subparsers(parser).items():
            walk(child, f"{path} {name}")

    walk(build_parser(), "prime-node")
    return "\n".join(out)


def test_the_command_line_is_unchanged(monkeypatch):
    monkeypatch.setenv("COLUMNS", WIDTH)
    assert render() == SURFACE.read_text(), (
        "the CLI changed; if on purpose, regenerate tests/data/cli_surface.txt (see this module's docstring)"
    )


if __name__ == "__main__":
    print(render(), end="")
