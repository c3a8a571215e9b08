"""Typed configuration with one precedence rule for every command: flags > environment > TOML > defaults.

Each command declares a pydantic model (fields with a one-line description and bounds) and loads it with
`load_config`. Environment variables are `PRIME_NODE_<FIELD>` for top-level fields and
`PRIME_NODE_<SECTION>__<FIELD>` for fields of nested sections. A bad value is reported with the field's
dotted name, where the value came from (flag, environment variable or TOML file) and what is allowed.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ConfigError

ENV_PREFIX = "PRIME_NODE_"
DEFAULT_DATA_DIR = Path("~/.prime-node")

Settings = TypeVar("Settings", bound=BaseModel)


class Section(BaseModel):
    """Base of every config model: unknown keys are errors (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    # Settings that moved, old dotted name -> new dotted name: a config, variable or flag written for the old
    # layout is refused with where the setting lives now (load_config), not just "unknown setting" (or, where
    # the old name is still a field of a shared section, silently overridden).
    MOVED: ClassVar[Mapping[str, str]] = {}


class CommonSettings(Section):
    """Settings shared by every command."""

    data_dir: Path = Field(
        DEFAULT_DATA_DIR, description="Directory for keys, checkpoints, rollouts and state."
    )
    log_level: str = Field("INFO", pattern=r"^(DEBUG|INFO|WARNING|ERROR)$", description="Logging threshold.")
    log_json: bool = Field(
        False, description="Emit one JSON object per log line instead of human-readable text."
    )

    def resolved_data_dir(self) -> Path:
        return self.data_dir.expanduser().resolve()


def _set_path(target: dict[str, Any], dotted: tuple[str, ...], value: Any) -> None:
    for part in dotted[:-1]:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise ConfigError(f"config section {'.'.join(dotted[:-1])!r} is a value, not a table")
    target[dotted[-1]] = value


def _env_value(raw: str) -> Any:
    # Lists and tables come as JSON; scalars stay strings and pydantic converts them with the field's type.
    stripped = raw.strip()
    if stripped[:1] in "[{":
        try:
            return json.loads(stripped)
        except json.JSONDecodeError:
            return raw
    return raw


def _env_overrides(
    model: type[BaseModel], env: Mapping[str, str]
) -> dict[str, tuple[tuple[str, ...], Any, str]]:
    found: dict[str, tuple[tuple[str, ...], Any, str]] = {}
    moved_roots = {old.split(".")[0] for old in getattr(model, "MOVED", {})}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        dotted = tuple(part.lower() for part in name[len(ENV_PREFIX) :].split("__") if part)
        if not dotted:
            continue
        if dotted[0] not in model.model_fields and dotted[0] not in moved_roots:
            continue  # another command's setting, or a variable this command does not use
        found[".".join(dotted)] = (dotted, _env_value(raw), f"environment variable {name}")
    return found


def _flatten(table: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
    paths: dict[str, tuple[str, ...]] = {}
    for key, value in table.items():
        path = prefix + (key,)
        if isinstance(value, dict):
            paths.update(_flatten(value, path))
        paths[".".join(path)] = path
    return paths


def _has_path(table: Mapping[str, Any], dotted: list[str]) -> bool:
    for part in dotted[:-1]:
        table = table.get(part)  # type: ignore[assignment]
        if not isinstance(table, Mapping):
            return False
    return dotted[-1] in table


def read_toml(path: Path) -> dict[str, Any]:
    path = Path(path).expanduser()
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def load_config(
    model: type[Settings],
    *,
    toml_path: Path | None = None,
    cli_overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Build `model` from defaults, a TOML file, the environment and CLI flags (later wins).

    `cli_overrides` maps dotted field names to values; None values mean "flag not given" and are skipped.
    """
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if toml_path is not None:
        table = read_toml(toml_path)
        merged = json.loads(json.dumps(table, default=str))  # deep copy; TOML dates become strings
        for dotted in _flatten(table):
            sources[dotted] = f"config file {toml_path}"
    for dotted_name, (dotted, value, source) in _env_overrides(model, env).items():
        _set_path(merged, dotted, value)
        sources[dotted_name] = source
    for dotted_name, value in (cli_overrides or {}).items():
        if value is None:
            continue
        _set_path(merged, tuple(dotted_name.split(".")), value)
        sources[dotted_name] = "flag --" + dotted_name.split(".")[-1].replace("_", "-")
    for old, new in getattr(model, "MOVED", {}).items():
        if _has_path(merged, old.split(".")):
            where = sources.get(old)
            section, _, key = new.rpartition(".")
            raise ConfigError(
                f"setting {old!r}" + (f" (from {where})" if where else "") + f" is now {new!r}: in a config "
                f"file write `{key} = ...` under [{section}]; in the environment {ENV_PREFIX}"
                + "__".join(new.upper().split("."))
            )
    try:
        return model.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, sources)) from None


def describe_validation_error(exc: ValidationError, sources: Mapping[str, str] | None = None) -> str:
    """One line per problem: the dotted field, what is wrong, the value given and where it came from."""
    lines = []
    for err in exc.errors():
        dotted = ".".join(str(p) for p in err["loc"])
        where = (sources or {}).get(dotted)
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown setting {dotted!r}" + (f" (from {where})" if where else ""))
            continue
        given = f" (got {err['input']!r}" + (f" from {where})" if where else ")") if "input" in err else ""
        lines.append(f"setting {dotted!r}: {err['msg']}{given}")
    return "invalid configuration:\n  " + "\n  ".join(lines)
