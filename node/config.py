"""Typed configuration with one precedence rule for every command: flags > environment > TOML > defaults.

Each command declares a pydantic model (fields with a one-line description and bounds) and loads it with
`load_config`. Environment variables are `PRIME_NODE_<FIELD>` for top-level fields and
`PRIME_NODE_<SECTION>__<FIELD>` for fields of nested sections. A bad value is reported on one line with
what is allowed and where it came from: a flag's by the flag (`argument --peers: ...`), an environment
variable's or a TOML file's by the field's dotted name and the variable or the file. A `PRIME_NODE_*`
variable that no command reads is refused before any command runs (`check_env_names`): a typo would
otherwise be silently ignored and the default used.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ConfigError

ENV_PREFIX = "PRIME_NODE_"
DEFAULT_DATA_DIR = Path("~/.prime-node")

Settings = TypeVar("Settings", bound=BaseModel)

# PRIME_NODE_* variables that are not settings: read by the test suite (tests/test_learning_record.py,
# tests/test_devnet_learning.py, tests/support/browser.py), which runs commands with them set.
NOT_SETTINGS = frozenset(
    {"PRIME_NODE_LONG_TESTS", "PRIME_NODE_DEVNET_MODEL", "PRIME_NODE_DASHBOARD_SCREENSHOTS"}
)

FLAG_SOURCE = "flag "  # how load_config marks a value a flag gave
VALUE_ERROR_PREFIX = "Value error, "  # pydantic's prefix to the message of a validator's ValueError
MAX_SHOWN_CHARS = 120  # of a value quoted back in a message: a pasted file must not fill the terminal


class FlagValueError(ConfigError):
    """Every bad value came from a command-line flag: a usage error, which the CLI reports as argparse reports
    `--samples x` (exit status 2), while a bad file or environment variable is a failure to run (1)."""


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
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Logging threshold.")
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


def _section_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _section_models(arg)]


def env_names(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> set[str]:
    """Every environment variable that sets a field of `model` (sections too: a table given as JSON), and
    every old name in its MOVED map (load_config says where those settings live now)."""
    names = {
        ENV_PREFIX + "__".join(prefix + tuple(old.split("."))).upper() for old in getattr(model, "MOVED", {})
    }
    for name, field in model.model_fields.items():
        path = prefix + (name,)
        names.add(ENV_PREFIX + "__".join(path).upper())
        for section in _section_models(field.annotation):
            names |= env_names(section, path)
    return names


def check_env_names(models: Iterable[type[BaseModel]], env: Mapping[str, str] | None = None) -> None:
    """Refuse a PRIME_NODE_* variable that sets nothing in any of `models` (every command's settings: a
    variable one command reads may be set for all), naming the closest valid name."""
    env = os.environ if env is None else env
    given = sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in NOT_SETTINGS)
    if not given:
        return
    known: set[str] = set()
    for model in models:
        known |= env_names(model)
    for name in given:
        if name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else "; docs/configuration.md lists the settings"
        raise ConfigError(f"environment variable {name} is not a setting of any command{hint}")


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
    flag_names: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Build `model` from defaults, a TOML file, the environment and CLI flags (later wins).

    `cli_overrides` maps dotted field names to values; None values mean "flag not given" and are skipped.
    `flag_names` maps them to the flag that gave them, for the errors (node/cli/flags.py passes its own; a
    name missing there reads as --<field name>).
    """
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if toml_path is not None:
        table = read_toml(toml_path)
        merged = json.loads(json.dumps(table, default=str))  # deep copy; TOML dates become strings
        for name in _flatten(table):
            sources[name] = f"config file {toml_path}"
    for dotted_name, (dotted, value, source) in _env_overrides(model, env).items():
        _set_path(merged, dotted, value)
        sources[dotted_name] = source
    for dotted_name, value in (cli_overrides or {}).items():
        if value is None:
            continue
        _set_path(merged, tuple(dotted_name.split(".")), value)
        flag = (flag_names or {}).get(dotted_name) or "--" + dotted_name.split(".")[-1].replace("_", "-")
        sources[dotted_name] = FLAG_SOURCE + flag
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
        message = describe_validation_error(exc, sources)
        wheres = [_source(err["loc"], sources) for err in exc.errors()]
        if all(where is not None and where.startswith(FLAG_SOURCE) for where in wheres):
            raise FlagValueError(message) from None
        raise ConfigError(message) from None


def describe_validation_error(exc: ValidationError, sources: Mapping[str, str] | None = None) -> str:
    """One line per problem (a single problem: one line in all): what is wrong, the value given and where it
    came from. A flag's value is named by the flag, since that is what the user typed; an environment
    variable's or a TOML file's by the field's dotted name, the name both of them use."""
    lines = [_describe(err, sources or {}) for err in exc.errors()]
    if len(lines) == 1:
        return lines[0]
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _describe(err: Any, sources: Mapping[str, str]) -> str:
    loc = [str(part) for part in err["loc"]]
    dotted = ".".join(loc)
    where = _source(err["loc"], sources)
    if err["type"] == "extra_forbidden":
        return f"unknown setting {dotted!r}" + (f" (from {where})" if where else "")
    message = str(err["msg"]).removeprefix(VALUE_ERROR_PREFIX)
    if not loc:  # a rule over several settings (a model validator): its message names them
        return f"invalid configuration: {message}"
    given = err.get("input")
    # A section's own rule gets the whole section as input: the message says which of its settings. A
    # validator's message may quote the value (or each value of a list) itself.
    items = given if isinstance(given, list) and given else [given]
    quoted = all(isinstance(item, str) and repr(item) in message for item in items)
    shown = "" if isinstance(given, dict) or "input" not in err or quoted else _shorten(repr(given))
    if where and where.startswith(FLAG_SOURCE):
        return f"argument {where.removeprefix(FLAG_SOURCE)}: {message}" + (f" (got {shown})" if shown else "")
    got = f" (got {shown}" + (f" from {where})" if where else ")") if shown else ""
    return f"setting {dotted!r}: {message}{got}"


def _source(loc: tuple[Any, ...], sources: Mapping[str, str]) -> str | None:
    """Where the value at `loc` came from; None for a default or a rule over several settings."""
    parts = [str(part) for part in loc]
    # A list item's error is located at its index (run.length_targets.2): the list came from the source.
    return next(
        (sources[".".join(parts[:n])] for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in sources),
        None,
    )


def _shorten(text: str) -> str:
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."
