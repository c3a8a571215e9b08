"""reasoning-gym (PyPI `reasoning-gym`) as an environment: any procedural family, or a weighted mix of them.

    --env reasoning_gym:family=spell_backward,max_word_len=5
    --env reasoning_gym:families=spell_backward*2/count_bits/chain_sum,chain_sum.max_digits=1,seed=3

Options: `family=NAME` or `families=NAME[*WEIGHT]/...` (integer weights, 1 by default), `seed=` (the run's
task seed by default), `size=` (number of addressable tasks), and the families' own configuration fields
(`OPTION=VALUE` for a single family, `FAMILY.OPTION=VALUE` in a mix; a list or tuple field takes `a/b/c`).
Task `index` comes from the family `SHA-256(seed, index)` picks by weight, as that family's entry `index`
(reasoning-gym generates entry i from `Random(seed + i)`, so it is a pure function of the configuration).
The prompt is the family's question verbatim; the reward is the family's own `score_answer` applied to the
completion's final answer (answers.py: the last `<answer>...</answer>`, else the whole completion), which
gives partial credit in some families. Scoring runs in the bounded scorer's worker (scoring.py).

The identity pins reasoning-gym's installed version, and its content hash covers every family's complete
configuration (defaults included, so a default changed by another version shows there too), the weights,
seed, size and the scoring limits. Families refused: `composite` (mix with `families=` instead), those whose
entries differ between processes (NONDETERMINISTIC_FAMILIES: they iterate over sets of strings, whose order
follows the interpreter's hash seed; measured on reasoning-gym 0.1.25 by tests/test_reasoning_gym.py), and
those without one reference answer (checked on the first entries at open).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import io
import json
import math
import re
import struct
from collections import OrderedDict
from typing import Any

from ...p2p.signing import canonical_json
from ..errors import TaskError
from .answers import final_answer
from .environment import EnvironmentIdentity, ScoringLimits
from .registry import split_args
from .types import MAX_ANSWER_CHARS, MAX_METADATA_CHARS, MAX_PROMPT_CHARS, Task, check_index

NAME = "reasoning_gym"
PACKAGE = "reasoning-gym"
TASK_TYPE = "reasoning_gym"
# Bumped whenever this module changes how tasks are drawn, prompted or scored: it is in the content hash.
SCHEME = "prime-node/reasoning_gym/v1"
DEFAULT_SIZE = 1 << 20
MAX_SEED = 2**32 - 1  # reasoning-gym seeds Random(seed + index); keep it in the range its own code uses
MAX_WEIGHT = 1_000_000
PROBE_ENTRIES = 4
LIMITS = ScoringLimits(isolation="process", wall_s=5.0, cpu_s=5.0, memory_mb=2048)
NONDETERMINISTIC_FAMILIES = frozenset(
    {"codeio", "isomorphic_strings", "knight_swap", "polynomial_multiplication", "ransom_note", "word_ladder"}
)
_DOMAIN = b"prime-node/reasoning_gym/pick/v1\x00"
_TUPLE = "~tuple"  # how a tuple in an entry survives the JSON of Task.metadata
_CACHE_ENTRIES = 1024
_INT = re.compile(r"[+-]?[0-9]{1,18}")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_WORD = re.compile(r"[A-Za-z0-9_.+\-]{1,128}")


@dataclasses.dataclass(frozen=True)
class Family:
    """One family of a mix: its registered name, integer weight, and the options given for it."""

    name: str
    weight: int
    options: tuple[tuple[str, Any], ...]


def _scalar(text: str) -> Any:
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    if text in ("true", "false"):
        return text == "true"
    if text == "none":
        return None
    if not _WORD.fullmatch(text):
        raise TaskError(f"{NAME}: value {text[:80]!r} must be a number, true/false/none or a plain word")
    return text


def _format(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "/".join(_format(v) for v in value)
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "none"}[value]
    return str(value)


def _family_options(name: str, given: dict[str, str]) -> tuple[tuple[str, Any], ...]:
    """`given` (option -> text) checked against the family's configuration dataclass and typed like its
    defaults; TaskError naming the family and the option."""
    from reasoning_gym.factory import DATASETS

    config_cls = DATASETS[name][1]
    defaults = {f.name: f for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")}
    typed = []
    for option, text in sorted(given.items()):
        if option not in defaults:
            known = ", ".join(sorted(defaults)) or "none"
            raise TaskError(f"{NAME}: family {name!r} has no option {option!r} (its options: {known})")
        field = defaults[option]
        default = field.default if field.default is not dataclasses.MISSING else None
        items = [_scalar(t) for t in text.split("/")]
        if isinstance(default, list | tuple):
            value: Any = type(default)(items)
        elif len(items) == 1:
            value = items[0]
        else:
            raise TaskError(f"{NAME}: family {name!r}: option {option!r} takes one value, not a list")
        typed.append((option, value))
    return tuple(typed)


def parse_args(args: str, seed: int) -> tuple[tuple[Family, ...], int, int]:
    """(families, seed, size) of the ARGS of `reasoning_gym:ARGS`; TaskError naming what is wrong."""
    from reasoning_gym.factory import DATASETS

    pairs = split_args(NAME, args)
    if ("family" in pairs) == ("families" in pairs):
        raise TaskError(f"{NAME}: give exactly one of family=NAME or families=NAME*WEIGHT/NAME*WEIGHT/...")
    weights: dict[str, int] = {}
    parts = [pairs.pop("family")] if "family" in pairs else pairs.pop("families").split("/")
    for part in parts:
        name, star, weight = part.partition("*")
        if name in weights:
            raise TaskError(f"{NAME}: family {name!r} is listed twice")
        if star and not (weight.isdigit() and 1 <= int(weight) <= MAX_WEIGHT):
            raise TaskError(
                f"{NAME}: weight of {name!r} must be an integer in 1..{MAX_WEIGHT}, got {weight!r}"
            )
        weights[name] = int(weight) if star else 1
    try:
        seed = int(pairs.pop("seed", seed))
        size = int(pairs.pop("size", DEFAULT_SIZE))
    except ValueError as exc:
        raise TaskError(f"{NAME}: seed and size must be integers ({exc})") from None
    if not 0 <= seed <= MAX_SEED or not 1 <= size <= 2**40:
        raise TaskError(f"{NAME}: seed must be in 0..{MAX_SEED} and size in 1..{2**40}")
    per_family: dict[str, dict[str, str]] = {name: {} for name in weights}
    for key, value in pairs.items():
        family, dot, option = key.rpartition(".")
        if not dot and len(weights) == 1:
            family = next(iter(weights))
        if family not in per_family:
            raise TaskError(f"{NAME}: option {key!r} names no listed family (write FAMILY.OPTION in a mix)")
        per_family[family][option] = value
    families = []
    for name, family_weight in weights.items():
        if name == "composite":
            raise TaskError(f"{NAME}: mix families with families=A*2/B instead of the composite family")
        if name in NONDETERMINISTIC_FAMILIES:
            raise TaskError(
                f"{NAME}: family {name!r} is refused: its entries differ between processes (they follow the "
                "interpreter's hash seed), so peers would disagree on its tasks"
            )
        if name not in DATASETS:
            raise TaskError(f"{NAME}: no family {name!r} in reasoning-gym (prime-node tasks list shows them)")
        families.append(Family(name, family_weight, _family_options(name, per_family[name])))
    return tuple(families), seed, size


def _encode(value: Any) -> Any:
    """`value` as JSON with tuples tagged; TypeError for anything else JSON cannot hold."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value) and _TUPLE not in value:
        return {k: _encode(v) for k, v in value.items()}
    raise TypeError(type(value).__name__)


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(_decode(v) for v in value[_TUPLE])
        return {k: _decode(v) for k, v in value.items()}
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal with equal types all the way down (1 == 1.0 == True, but they are not the same entry)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _config_document(config: Any) -> Any:
    document = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        try:
            document[field.name] = _encode(value)
        except TypeError:
            document[field.name] = f"{type(value).__qualname__}:{value}"  # e.g. a datetime.time bound
    return document


class ReasoningGymEnvironment:
    """Tasks and rewards of reasoning-gym families (see the module docstring). Pickled (for the scoring
    worker) as its configuration: the worker builds its own datasets from it."""

    def __init__(self, families: tuple[Family, ...], seed: int, size: int) -> None:
        import reasoning_gym

        self.families = families
        self.seed = seed
        self.size = size
        self._total = sum(f.weight for f in families)
        self._cache: OrderedDict[int, Task] = OrderedDict()
        self._datasets: dict[str, Any] = {}
        for family in families:
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # some families print while they load
                    self._datasets[family.name] = reasoning_gym.create_dataset(
                        family.name, **dict(family.options), seed=seed, size=size
                    )
            except (AssertionError, ValueError, TypeError, KeyError) as exc:
                raise TaskError(f"{NAME}: family {family.name!r} refuses its options: {exc}") from None
        self.version = importlib.metadata.version(PACKAGE)
        self._identity = EnvironmentIdentity(
            name=NAME, package=PACKAGE, version=self.version, content_hash=self._content_hash()
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"families": self.families, "seed": self.seed, "size": self.size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["families"], state["seed"], state["size"])  # type: ignore[misc]

    def _content_hash(self) -> str:
        document = {
            "scheme": SCHEME,
            "seed": self.seed,
            "size": self.size,
            "families": [
                {
                    "name": f.name,
                    "weight": f.weight,
                    "config": _config_document(self._datasets[f.name].config),
                }
                for f in self.families
            ],
            "limits": LIMITS.model_dump(),
        }
        return "sha256:" + hashlib.sha256(canonical_json(document)).hexdigest()

    @property
    def spec(self) -> str:
        options = [
            f"{'' if len(self.families) == 1 else f.name + '.'}{key}={_format(value)}"
            for f in self.families
            for key, value in f.options
        ]
        if len(self.families) == 1:
            head = f"family={self.families[0].name}"
        else:
            head = "families=" + "/".join(f"{f.name}*{f.weight}" for f in self.families)
        return f"{NAME}:" + ",".join([head, *options, f"seed={self.seed}", f"size={self.size}"])

    @property
    def identity(self) -> EnvironmentIdentity:
        return self._identity

    @property
    def scoring(self) -> ScoringLimits:
        return LIMITS

    def __len__(self) -> int:
        return self.size

    def family_of(self, index: int) -> str:
        """The family task `index` is drawn from: by weight, from SHA-256(seed, index)."""
        if len(self.families) == 1:
            return self.families[0].name
        digest = hashlib.sha256(_DOMAIN + struct.pack(">QQ", self.seed, index)).digest()
        pick = int.from_bytes(digest[:8], "big") % self._total
        for family in self.families:
            if pick < family.weight:
                return family.name
            pick -= family.weight
        raise AssertionError("weights sum to the total")  # not reached

    def get(self, index: int) -> Task:
        check_index(index, self.size, self.spec)
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        family = self.family_of(index)
        entry = self._entry(family, index)
        where = f"{NAME}: family {family!r}, entry {index}"
        question, answer = entry.get("question"), entry.get("answer")
        if not isinstance(question, str) or not 1 <= len(question) <= MAX_PROMPT_CHARS:
            raise TaskError(f"{where}: its question is not text of 1..{MAX_PROMPT_CHARS} characters")
        if answer is None:
            raise TaskError(f"{where}: the family has no single reference answer")
        answer = str(answer)
        if not 1 <= len(answer) <= MAX_ANSWER_CHARS:
            raise TaskError(
                f"{where}: its answer has {len(answer)} characters, outside 1..{MAX_ANSWER_CHARS}; "
                "configure the family smaller"
            )
        task = Task(
            prompt=question, answer=answer, task_type=TASK_TYPE, metadata=self._metadata(family, index, entry)
        )
        self._cache[index] = task
        if len(self._cache) > _CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return task

    def _entry(self, family: str, index: int) -> dict[str, Any]:
        with contextlib.redirect_stdout(io.StringIO()):
            entry = self._datasets[family][index]
        if not isinstance(entry, dict):
            raise TaskError(f"{NAME}: family {family!r} gave a {type(entry).__name__} for entry {index}")
        return entry

    @staticmethod
    def _metadata(family: str, index: int, entry: dict[str, Any]) -> str:
        """Family, index and (when JSON holds it exactly, tuples tagged) the whole entry, so that scoring
        need not generate the entry again; without it the scorer regenerates it from the index."""
        document: dict[str, Any] = {"family": family, "index": index}
        try:
            encoded = _encode(entry)
            text = canonical_json({**document, "entry": encoded}).decode()
            if len(text) <= MAX_METADATA_CHARS and _same(_decode(json.loads(text)["entry"]), entry):
                return text
        except Exception:  # noqa: BLE001 (NaN, a huge int, a set, an object: regenerate when scoring)
            pass
        return canonical_json(document).decode()

    def score(self, completion: str, task: Task) -> float:
        """The family's `score_answer` of the completion's final answer; 0.0 for anything unusable."""
        try:
            answer = final_answer(completion)
            if answer is None:
                return 0.0
            meta = json.loads(task.metadata)
            family = meta["family"]
            entry = _decode(meta["entry"]) if "entry" in meta else self._entry(family, meta["index"])
            value = float(self._datasets[family].score_answer(answer, entry))
        except Exception:  # noqa: BLE001 (a family's scorer on a peer's text: anything it raises is a 0)
            return 0.0
        return value if math.isfinite(value) and 0.0 <= value <= 1.0 else 0.0


def open_reasoning_gym(args: str, *, seed: int = 0) -> ReasoningGymEnvironment:
    """reasoning-gym families (procedural puzzles, arithmetic, logic) scored by their own checkers."""
    try:
        import reasoning_gym  # noqa: F401 (its absence is a message, not a traceback)
    except ImportError as exc:
        raise TaskError(f"{NAME} needs the package {PACKAGE}: pip install {PACKAGE} ({exc})") from None
    families, seed, size = parse_args(args, seed)
    environment = ReasoningGymEnvironment(families, seed, size)
    for family in families:  # a family without single reference answers shows on its first entries
        probed = 0
        for index in range(min(size, 64)):
            if probed == PROBE_ENTRIES:
                break
            if environment.family_of(index) == family.name:
                environment.get(index)
                probed += 1
    return environment
