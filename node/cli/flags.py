"""Command-line flags generated from the settings fields: each flag is declared once, by the setting it sets.

A command lists its settings flags as `Flag("swarm.initial_peers", "--peers", nargs="+", metavar="MADDR")`:
only what the field cannot say is written there (the flag's name where it is not `--<field name>`, a
metavar, "+" where a list needs one value at least, a repeatable flag, a required one). The rest comes from
the field of the command's settings model: the type, the choices of a Literal or an Enum, nargs "*" for a
list, store_true for a bool, and the help, which is the field's description with its default and bounds.

`SettingsFlags` adds the flags to a parser and records them in the parser's defaults; `load` reads the same
record back, so the values given reach load_config (flags > environment > TOML > defaults,
docs/configuration.md) under the flag's own name, and a bad value is reported as `argument --peers: ...`
(config.FlagValueError: a usage error, exit status 2). A flag's argparse default is always None ("not
given"): the default lives in the field only.
"""

from __future__ import annotations

import argparse
import enum
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from ..config import CommonSettings, load_config
from ..runtime.logs import configure_logging

Settings = TypeVar("Settings", bound=BaseModel)

# The parser default under which SettingsFlags records itself (argparse copies it into the namespace).
NAMESPACE_KEY = "settings_flags"


@dataclass(frozen=True)
class Flag:
    """One flag, named by the dotted setting it sets; the other fields say only what the setting cannot."""

    path: str  # the field in the command's settings model, e.g. "swarm.initial_peers"
    name: str | None = None  # the flag where it is not --<field name>, e.g. "--peers"
    metavar: str | None = None
    nargs: Literal["+"] | None = None  # a list flag that needs one value at least (lists take "*")
    append: bool = False  # a repeatable flag, one value per use (--ban A --ban B), for a list field
    required: bool = False  # the command needs it, though the setting is optional (others may leave it unset)
    dest: str | None = None  # the argparse attribute where it is not the flag's name (--min: min_pass)
    # Further settings the same value sets (the validator's --run-id names the DHT's run: swarm.run_id).
    also: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return self.name or "--" + self.path.rpartition(".")[2].replace("_", "-")

    @property
    def attr(self) -> str:
        return self.dest or self.flag.lstrip("-").replace("-", "_")


# Every command's settings derive from CommonSettings: these flags come first on each of them.
COMMON_FLAGS = (Flag("data_dir"), Flag("log_level"), Flag("log_json"))


def resolve(model: type[BaseModel], path: str) -> FieldInfo:
    """The field at dotted `path` of `model`; ValueError when a part is not a field or not a section."""
    *sections, last = path.split(".")
    for part in sections:
        field = model.model_fields.get(part)
        section = _plain(field.annotation) if field is not None else None
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            raise ValueError(f"{path!r}: {part!r} is not a section of {model.__name__}")
        model = section
    if last not in model.model_fields:
        raise ValueError(f"{path!r}: {model.__name__} has no field {last!r}")
    return model.model_fields[last]


def default_of(settings: BaseModel, path: str) -> Any:
    """The value at `path` of a settings instance (the command's defaults: sections may set their own)."""
    value: Any = settings
    for part in path.split("."):
        value = getattr(value, part)
    return value


def flag_help(field: FieldInfo, default: Any, *, repeatable: bool = False) -> str:
    """The field's description with its default, its bounds and, for a repeatable flag, that it repeats."""
    description = (field.description or "").strip()
    notes = []
    shown = _shown(default)
    if shown:
        notes.append(f"default {shown}")
    bounds = _bounds(field)
    if bounds:
        notes.append(bounds)
    if repeatable:
        notes.append("repeatable")
    text = description if description.endswith(".") else description + "."
    if notes:
        joined = "; ".join(notes)
        text += f" {joined[0].upper()}{joined[1:]}."
    return text.replace("%", "%%")  # argparse formats help with %


class SettingsFlags(Generic[Settings]):
    """The settings flags of one command: added to its parser, read back by `load`."""

    def __init__(self, parser: argparse.ArgumentParser, model: type[Settings]) -> None:
        self.parser = parser
        self.model = model
        self.flags: list[Flag] = []
        try:
            self.defaults: BaseModel = model()
        except ValidationError:  # a model with required fields: each field's own default then
            self.defaults = model.model_construct()
        parser.set_defaults(**{NAMESPACE_KEY: self})
        group = parser.add_argument_group("common options")
        group.add_argument(
            "--config", type=Path, default=None, help="TOML config file (flags > env > file > defaults)"
        )
        if issubclass(model, CommonSettings):
            self.add(*COMMON_FLAGS, group=group)

    def add(self, *flags: Flag, group: Any = None) -> None:
        """Add each flag to the parser (or to `group`, an argument group of it), in order."""
        for flag in flags:
            if flag.attr == NAMESPACE_KEY or any(known.attr == flag.attr for known in self.flags):
                raise ValueError(f"{flag.flag}: its destination {flag.attr!r} is taken")
            for path in flag.also:
                resolve(self.model, path)
            field = resolve(self.model, flag.path)
            default = default_of(self.defaults, flag.path)
            options = _argparse_options(flag, field, default)
            target = group if group is not None else self.parser
            target.add_argument(flag.flag, dest=flag.attr, default=None, **options)
            self.flags.append(flag)

    def load(self, args: argparse.Namespace) -> Settings:
        """The command's settings from the flags given in `args`, the environment, the TOML file and the
        defaults; configures logging from them."""
        overrides: dict[str, Any] = {}
        flag_names: dict[str, str] = {}
        for flag in self.flags:
            value = getattr(args, flag.attr)
            if value is None:  # not given
                continue
            for path in (flag.path, *flag.also):
                overrides[path] = value
                flag_names[path] = flag.flag
        settings = load_config(
            self.model, toml_path=args.config, cli_overrides=overrides, flag_names=flag_names
        )
        if isinstance(settings, CommonSettings):
            configure_logging(settings.log_level, settings.log_json)
        return settings


def load_settings(args: argparse.Namespace, model: type[Settings]) -> Settings:
    """The settings of the command `args` was parsed for, which must be `model` (flags > env > TOML > defaults)."""
    flags = getattr(args, NAMESPACE_KEY, None)
    if not isinstance(flags, SettingsFlags) or flags.model is not model:
        raise TypeError(f"this command's parser declares no settings flags for {model.__name__}")
    return flags.load(args)


def _argparse_options(flag: Flag, field: FieldInfo, default: Any) -> dict[str, Any]:
    if not (field.description or "").strip():
        raise ValueError(f"{flag.flag}: {flag.path} has no description, and the description is the help")
    annotation = _plain(field.annotation)
    options: dict[str, Any] = {"help": None, "required": flag.required}
    if flag.metavar is not None:
        options["metavar"] = flag.metavar
    repeatable = False
    if get_origin(annotation) is list:
        item = _plain(get_args(annotation)[0])
        if flag.append and flag.nargs:
            raise ValueError(f"{flag.flag}: a repeatable flag takes one value per use, so no nargs")
        if flag.append:
            options["action"] = "append"
            repeatable = True
        else:
            options["nargs"] = flag.nargs or "*"
        options.update(_value_options(item, flag))
    else:
        if flag.append or flag.nargs:
            raise ValueError(f"{flag.flag}: {flag.path} is not a list; it takes one value")
        if annotation is bool:
            if default:
                raise ValueError(
                    f"{flag.flag}: {flag.path} defaults to true, so a store_true flag does nothing"
                )
            options["action"] = "store_true"
        else:
            options.update(_value_options(annotation, flag))
    options["help"] = flag_help(field, default, repeatable=repeatable)
    return options


def _value_options(annotation: Any, flag: Flag) -> dict[str, Any]:
    """type= and choices= for one value of `annotation`."""
    if get_origin(annotation) is Literal:
        return {"choices": list(get_args(annotation))}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {"choices": [member.value for member in annotation]}
    if annotation is str:
        return {}  # argparse's own: the string as given
    if annotation in (int, float, Path):
        return {"type": annotation}
    raise ValueError(f"{flag.flag}: no flag type for {flag.path} ({annotation!r})")


def _plain(annotation: Any) -> Any:
    """`annotation` without Annotated[...] and without None in a union (an optional setting)."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            members = [arg for arg in get_args(annotation) if arg is not type(None)]
            if len(members) != 1:
                return annotation  # a real union: no single flag type (_value_options refuses it)
            annotation = members[0]
        else:
            return annotation


def _shown(value: Any) -> str:
    if value is None or value is False or value == [] or value == ():
        return ""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (list, tuple)):
        return " ".join(_shown(item) for item in value)
    if isinstance(value, bool):
        return "on"
    if isinstance(value, (int, float)):
        return _number(value)
    return str(value)


def _number(value: float) -> str:
    if isinstance(value, int) and value >= 2**20:
        for offset, suffix in ((0, ""), (1, " - 1")):
            exponent = (value + offset).bit_length() - 1
            if value + offset == 2**exponent:
                return f"2^{exponent}{suffix}"
    return repr(value) if isinstance(value, float) else str(value)


def _bounds(field: FieldInfo) -> str:
    lower: tuple[str, Any] | None = None
    upper: tuple[str, Any] | None = None
    # Field(ge=..., lt=...) keeps each bound as a metadata object with an attribute of that name.
    for rule in field.metadata:
        for name, words in (("ge", "at least"), ("gt", "above"), ("le", "at most"), ("lt", "below")):
            value = getattr(rule, name, None)
            if value is not None and name in ("ge", "gt"):
                lower = (words, value)
            elif value is not None:
                upper = (words, value)
    if lower and upper and lower[0] == "at least" and upper[0] == "at most":
        return f"from {_number(lower[1])} to {_number(upper[1])}"
    return ", ".join(f"{bound[0]} {_number(bound[1])}" for bound in (lower, upper) if bound is not None)
