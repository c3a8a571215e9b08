"""Pieces every command shares: the common flags, settings loading, and JSON/text output."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from ..config import CommonSettings, load_config
from ..runtime.logs import configure_logging
from ..runtime.supervisor import Supervisor

Settings = TypeVar("Settings", bound=BaseModel)


def common_flags() -> argparse.ArgumentParser:
    """A parent parser with the flags every command accepts (so they may follow the subcommand)."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("common options")
    group.add_argument(
        "--config", type=Path, default=None, help="TOML config file (flags > env > file > defaults)"
    )
    group.add_argument("--data-dir", type=Path, default=None, help="data directory (default ~/.prime-node)")
    group.add_argument("--log-level", default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    group.add_argument("--log-json", action="store_true", default=None, help="JSON log lines")
    return parent


def load_settings(
    args: argparse.Namespace, model: type[Settings], flags: Mapping[str, str] | None = None
) -> Settings:
    """Load `model` with the standard precedence; `flags` maps dotted setting names to argparse attributes.

    Also configures logging from the loaded settings when the model has the common fields.
    """
    overrides: dict[str, Any] = {}
    if issubclass(model, CommonSettings):
        overrides.update(data_dir=args.data_dir, log_level=args.log_level, log_json=args.log_json)
    for dotted, attr in (flags or {}).items():
        overrides[dotted] = getattr(args, attr)
    settings = load_config(model, toml_path=args.config, cli_overrides=overrides)
    if isinstance(settings, CommonSettings):
        configure_logging(settings.log_level, settings.log_json)
    return settings


def print_json(payload: Any) -> None:
    json.dump(payload, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


async def run_until_stopped(
    name: str, start: Callable[[Supervisor], Awaitable[str]], shutdown_s: float
) -> int:
    """Run a long-lived service under one Supervisor: start it, print its ready line, wait for SIGINT, SIGTERM
    or a crashed task, then shut down within `shutdown_s`. Exit code 0 only after a clean shutdown."""
    supervisor = Supervisor(name)
    supervisor.install_signal_handlers()
    try:
        ready_line = await start(supervisor)
        print(ready_line, flush=True)
        await supervisor.wait()
    finally:
        report = await supervisor.shutdown(shutdown_s)
        for step, error in report.errors:
            print(f"shutdown: {step}: {error}", file=sys.stderr)
    return 0 if report.clean else 1
