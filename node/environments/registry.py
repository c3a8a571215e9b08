"""Environments by name: `--env NAME[:ARGS]` parsed strictly, and opened through Python entry points.

Every environment, the built-in ones included, is an entry point in the group `prime_node.environments`
(environment.py, ENTRY_POINT_GROUP): its name is the environment's, its object a factory

    factory(args: str, *, seed: int) -> Environment

called with the text after the first ':' of the spec ('' without one) and the run's task seed (a default:
an environment whose ARGS give a seed uses that). A third-party package registers one in its own
pyproject (docs/environments.md); nothing here lists them. Installing or removing a package changes what
is found; the identity each environment reports (its package, version and content hash) is what the run
pins (node/run/announcement.py), so two machines that would open different code for one name disagree
there, not in their rewards.

ARGS have one grammar for every environment (docs/environments.md, "Choosing one"):

    SPEC  = NAME [":" ARGS]
    ARGS  = ITEM *("," ITEM)
    ITEM  = KEY "=" VALUE | VALUE     a bare VALUE only first: the environment's main argument (a file's path)
    KEY   = [a-z_][a-z0-9_]* ["." [a-z_][a-z0-9_]*]     (FAMILY.OPTION in a reasoning-gym mix)
    VALUE = one or more characters other than ","; a list is a/b/c where the option takes a list

`split_args` checks the grammar (one-line errors naming the item that is wrong) and returns the items by
key; `parse_options` also checks them against a pydantic model and names the key whose value is wrong.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ...p2p.signing import canonical_json
from ...p2p.wire import unprintable
from ..errors import TaskError
from .environment import ENTRY_POINT_GROUP, ENV_NAME_PATTERN, Environment, EnvironmentIdentity, ScoringLimits

logger = logging.getLogger(__name__)

DEFAULT_ENV = "arithmetic"
MAX_SPEC_CHARS = 4096
# The distribution this package is installed as: the `package` of the built-in environments' identities.
OWN_DISTRIBUTION = "prime-node"
_NAME = re.compile(ENV_NAME_PATTERN)
_KEY = re.compile(r"[a-z_][a-z0-9_]{0,63}(?:\.[a-z_][a-z0-9_]{0,63})?")

Options = TypeVar("Options", bound=BaseModel)
Factory = Callable[..., Environment]


def parse_spec(spec: str) -> tuple[str, str]:
    """(NAME, ARGS) of `NAME[:ARGS]`; TaskError naming the part that is wrong. ARGS is '' without a ':'."""
    if not isinstance(spec, str) or not spec:
        raise TaskError("an environment spec is NAME[:ARGS] (e.g. arithmetic); got an empty one")
    if len(spec) > MAX_SPEC_CHARS:
        raise TaskError(f"environment spec of {len(spec)} characters; at most {MAX_SPEC_CHARS}")
    bad = unprintable(spec)
    if bad is not None:
        raise TaskError(f"environment spec {spec[:80]!r} holds the unprintable {bad}")
    name, colon, args = spec.partition(":")
    if not _NAME.fullmatch(name):
        raise TaskError(
            f"environment spec {spec[:80]!r}: the name {name[:80]!r} must be 1-64 of a-z 0-9 _, starting "
            "with a letter (prime-node tasks list shows the installed ones)"
        )
    if colon and not args:
        raise TaskError(f"environment spec {spec!r}: nothing after ':'; give ARGS or leave out the ':'")
    return name, args


def split_args(
    name: str, args: str, *, positional: str | None = None, known: Sequence[str] | None = None
) -> dict[str, str]:
    """The items of `args` (`key=value,key=value`, see the module's grammar) by key; TaskError naming the item
    that is wrong. With `positional`, a first item that is not `key=value` is the value of that key (so
    `file:tasks.jsonl` is `file:path=tasks.jsonl`); `known`, when given, are the only keys allowed."""
    values: dict[str, str] = {}
    keys = f" (known: {', '.join(known)})" if known is not None else ""
    for number, item in enumerate(args.split(",") if args else [], start=1):
        key, eq, value = item.partition("=")
        if number == 1 and positional is not None and not (eq and _KEY.fullmatch(key)):
            key, value = positional, item
        elif not item:
            raise TaskError(
                f"{name}: empty item {number} in {args[:80]!r}: items are key=value separated by ','"
            )
        elif not eq or not _KEY.fullmatch(key):
            raise TaskError(f"{name}: {item[:80]!r} is not key=value{keys}")
        if known is not None and key not in known:
            raise TaskError(f"{name}: unknown option {key!r}{keys}")
        if key in values:
            raise TaskError(f"{name}: option {key!r} is given twice")
        if not value:
            raise TaskError(f"{name}: option {key!r} has no value")
        values[key] = value
    return values


def parse_options(name: str, args: str, model: type[Options], *, positional: str | None = None) -> Options:
    """ARGS of the form `key=value,key=value` checked against `model` (its fields are the keys); TaskError
    naming the key and what is wrong with it. A list value is written with '/' between its items; with
    `positional`, a first bare value is that field's (see split_args)."""
    values: dict[str, Any] = {}
    for key, value in split_args(name, args, positional=positional, known=list(model.model_fields)).items():
        annotation = model.model_fields[key].annotation
        values[key] = value.split("/") if _is_list(annotation) else value
        if _takes_ints(annotation):  # pydantic would read "+5", "1_0" and " 7" as numbers
            for number in values[key] if isinstance(values[key], list) else [values[key]]:
                if not _INT_TEXT.fullmatch(number):
                    raise TaskError(f"{name}: {key}: {number[:40]!r} is not a whole number in ASCII digits")
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'options'}: {err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
        )
        raise TaskError(f"{name}: {problems}") from None


def path_arg(name: str, path: object) -> str:
    """A path as the main argument of a spec that reopens it: bare, or as `path=...` when the bare form would
    read as an option; TaskError for a path no spec can hold (a ',' separates items)."""
    text = str(path)
    if "," in text or not text:
        raise TaskError(
            f"{name}: the path {text[:80]!r} cannot be named in an environment spec (it holds a ',')"
        )
    key, eq, _ = text.partition("=")
    return f"path={text}" if eq and _KEY.fullmatch(key) else text


_INT_TEXT = re.compile(r"-?[0-9]{1,19}")


def _takes_ints(annotation: Any) -> bool:
    """Whether a field holds integers only (an int, a list or tuple of them, optional or not)."""
    kinds = [annotation]
    while any(typing.get_origin(k) in (typing.Union, types.UnionType, list, tuple) for k in kinds):
        kinds = [
            a
            for k in kinds
            for a in (typing.get_args(k) if typing.get_origin(k) is not None else (k,))
            if a is not type(None) and a is not Ellipsis
        ]
    return bool(kinds) and all(k is int for k in kinds)


def _is_list(annotation: Any) -> bool:
    """Whether a field takes a list (or tuple), optional or not: one value without '/' is then a list of one."""
    kinds = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else ()
    )
    return any(typing.get_origin(kind) in (list, tuple) for kind in (annotation, *kinds))


@functools.cache
def distribution_version(package: str) -> str:
    """The installed version of `package`; TaskError when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        raise TaskError(f"package {package!r} is not installed") from None


def content_hash(document: Any) -> str:
    """`sha256:<hex>` of the canonical JSON of `document`: a configuration's hash, the same on every machine."""
    return "sha256:" + hashlib.sha256(canonical_json(document)).hexdigest()


def builtin_identity(name: str, digest: str) -> EnvironmentIdentity:
    """The identity of an environment this package provides: prime-node's installed version, and `digest`
    (`sha256:<hex>` of what defines its tasks: content_hash of its configuration, or a file's bytes)."""
    return EnvironmentIdentity(
        name=name,
        package=OWN_DISTRIBUTION,
        version=distribution_version(OWN_DISTRIBUTION),
        content_hash=digest,
    )


@dataclass(frozen=True)
class Registered:
    """One installed environment: its entry point and the distribution that provides it."""

    name: str
    package: str
    version: str
    target: str  # module:object
    entry_point: importlib.metadata.EntryPoint

    def summary(self) -> str:
        """The first line of the factory's docstring (loads the module)."""
        doc = (getattr(self.entry_point.load(), "__doc__", None) or "").strip()
        return doc.splitlines()[0] if doc else ""


def installed() -> dict[str, list[Registered]]:
    """Every environment entry point, by name; a name two distributions register holds both (refused when
    opened). Names that are not valid environment names are skipped with a warning."""
    found: dict[str, list[Registered]] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        package, version = (dist.metadata["Name"], dist.version) if dist is not None else ("?", "?")
        if not _NAME.fullmatch(ep.name):
            logger.warning("ignoring environment entry point %r of %s: not a valid name", ep.name, package)
            continue
        entries = found.setdefault(ep.name, [])
        if not any(r.target == ep.value and r.package == package for r in entries):  # one dist seen twice
            entries.append(Registered(ep.name, package, version, ep.value, ep))
    return found


def lookup(name: str) -> Registered:
    """The one installed environment called `name`; TaskError naming what is installed otherwise."""
    entries = installed().get(name, [])
    if not entries:
        known = ", ".join(sorted(installed())) or "none"
        hint = (
            " (the built-in ones are registered by prime-node's own install: run scripts/setup.sh)"
            if name == DEFAULT_ENV
            else ""
        )
        raise TaskError(f"no environment named {name!r} is installed; installed: {known}{hint}")
    if len(entries) > 1:
        who = ", ".join(
            f"{r.package} {r.version} ({r.target})" for r in sorted(entries, key=lambda r: r.package)
        )
        raise TaskError(
            f"environment {name!r} is registered by more than one package: {who}; uninstall all but one"
        )
    return entries[0]


def open_environment(spec: str, *, seed: int = 0) -> Environment:
    """The environment `spec` (`NAME[:ARGS]`) names, with `seed` as its default task seed.

    A file environment reads and hashes its file here: call it off the event loop."""
    name, args = parse_spec(spec)
    registered = lookup(name)
    try:
        factory = registered.entry_point.load()
    except Exception as exc:  # a plugin's import can fail any way at all; name it, keep the traceback out
        raise TaskError(
            f"environment {name!r} ({registered.package} {registered.version}, {registered.target}) "
            f"cannot be loaded: {type(exc).__name__}: {exc}"
        ) from None
    try:
        environment = factory(args, seed=seed)
    except TaskError:
        raise
    except Exception as exc:  # a plugin refusing its ARGS with its own exception type
        raise TaskError(f"environment {name!r} refused {spec!r}: {type(exc).__name__}: {exc}") from None
    _check(name, registered, environment)
    return environment


def _check(name: str, registered: Registered, environment: object) -> None:
    where = f"environment {name!r} ({registered.package} {registered.version})"
    if not isinstance(environment, Environment):
        raise TaskError(f"{where} returned {type(environment).__name__}, which is not an Environment")
    if not isinstance(environment.identity, EnvironmentIdentity):
        raise TaskError(f"{where}: its identity is not an EnvironmentIdentity")
    if not isinstance(environment.scoring, ScoringLimits):
        raise TaskError(f"{where}: its scoring limits are not ScoringLimits")
    if len(environment) < 1:
        raise TaskError(f"{where} has no tasks")
