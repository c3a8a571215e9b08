"""The built-in task family: procedurally generated integer arithmetic at five difficulty levels.

Problem `index` of a set with seed `seed` is a pure function of (seed, index): its random choices come from
a counter-based stream, SHA-256(domain || seed || index || block), never from a global generator, so any
contributor or validator regenerates exactly the same problem on any machine, in any order.

Prompts are the bare expression followed by '=' (e.g. `(7-2)*9=`), answers the decimal integer (`45`);
the tokenizer spends one token per character, so prompts stay short.

| level | shape                                      | example       |
|-------|--------------------------------------------|---------------|
| 1     | a +/- b, one digit                         | `7-9=`        |
| 2     | a +/- b, two digits; a * b, one digit      | `48+17=`      |
| 3     | a +/- b, three digits; two-digit * digit   | `73*6=`       |
| 4     | three one-digit operands, + - *, brackets  | `(3+4)*5=`    |
| 5     | two-digit * two-digit; three two-digit +/- | `25-(41+81)=` |
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import TaskError
from .environment import EnvironmentIdentity, ScoringLimits
from .registry import builtin_identity, content_hash, parse_options
from .types import Task, check_index
from .verifier import integer_match

NAME = "arithmetic"
TASK_TYPE = "arithmetic"
INLINE = ScoringLimits(isolation="inline")
LEVELS = (1, 2, 3, 4, 5)
MAX_SEED = 2**63 - 1
_DOMAIN = b"prime-node/arithmetic/v1\x00"
_OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2}


class ArithmeticConfig(BaseModel):
    """Which arithmetic task set: its seed, its size and how often each difficulty level is drawn."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(
        0, ge=0, le=MAX_SEED, description="Task-set seed; with the index it fixes every problem."
    )
    size: int = Field(
        1 << 24, ge=1, le=MAX_SEED, description="Number of addressable problems (indices 0..size-1)."
    )
    # Integer weights (not floats) so the level drawn for an index cannot depend on float rounding.
    level_weights: tuple[int, int, int, int, int] = Field(
        (3, 3, 2, 1, 1), description="Relative frequency of difficulty levels 1..5 (non-negative integers)."
    )

    @field_validator("level_weights")
    @classmethod
    def _weights_valid(cls, weights: tuple[int, ...]) -> tuple[int, ...]:
        if any(w < 0 or w > 1_000_000 for w in weights) or sum(weights) == 0:
            raise ValueError("level weights must be integers in [0, 1000000] with a positive sum")
        return weights


class _Draws:
    """A counter-based stream of 64-bit integers keyed by (seed, index): SHA-256 in counter mode."""

    def __init__(self, seed: int, index: int) -> None:
        self._key = _DOMAIN + struct.pack(">QQ", seed, index)
        self._block = 0
        self._pending: list[int] = []

    def _next_u64(self) -> int:
        if not self._pending:
            digest = hashlib.sha256(self._key + struct.pack(">Q", self._block)).digest()
            self._block += 1
            self._pending = list(struct.unpack(">4Q", digest))[::-1]
        return self._pending.pop()

    def below(self, n: int) -> int:
        """An integer in [0, n); the modulo bias is below n / 2^64, negligible for the n used here."""
        return self._next_u64() % n

    def between(self, lo: int, hi: int) -> int:
        return lo + self.below(hi - lo + 1)

    def choice(self, options: str) -> str:
        return options[self.below(len(options))]


def _binary(draws: _Draws, additive_max: int, mul_max: tuple[int, int], ops: str) -> tuple[str, int]:
    op = draws.choice(ops)
    if op == "*":
        a, b = draws.between(0, mul_max[0]), draws.between(0, mul_max[1])
        if draws.below(2):  # put the short factor first half of the time
            a, b = b, a
    else:
        a, b = draws.between(0, additive_max), draws.between(0, additive_max)
    return f"{a}{op}{b}", _OPS[op](a, b)


def _ternary(draws: _Draws, operand_max: int, ops: str) -> tuple[str, int]:
    a, b, c = (draws.between(0, operand_max) for _ in range(3))
    op1, op2 = draws.choice(ops), draws.choice(ops)
    grouping = draws.below(3)  # 0: no parentheses (usual precedence), 1: (a op b) op c, 2: a op (b op c)
    if grouping == 1:
        return f"({a}{op1}{b}){op2}{c}", _OPS[op2](_OPS[op1](a, b), c)
    if grouping == 2:
        return f"{a}{op1}({b}{op2}{c})", _OPS[op1](a, _OPS[op2](b, c))
    if _PRECEDENCE[op2] > _PRECEDENCE[op1]:
        value = _OPS[op1](a, _OPS[op2](b, c))
    else:
        value = _OPS[op2](_OPS[op1](a, b), c)
    return f"{a}{op1}{b}{op2}{c}", value


def _expression(draws: _Draws, level: int) -> tuple[str, int]:
    if level == 1:
        return _binary(draws, 9, (9, 9), "+-")
    if level == 2:
        return _binary(draws, 99, (9, 9), "+-*")
    if level == 3:
        return _binary(draws, 999, (99, 9), "+-*")
    if level == 4:
        return _ternary(draws, 9, "+-*")
    if draws.below(2):
        return _binary(draws, 99, (99, 99), "*")
    return _ternary(draws, 99, "+-")


def make_problem(seed: int, index: int, level_weights: tuple[int, ...]) -> Task:
    """Problem `index` of the family with this seed; a pure function of its arguments."""
    draws = _Draws(seed, index)
    pick = draws.below(sum(level_weights))
    level = LEVELS[-1]
    for candidate, weight in zip(LEVELS, level_weights):
        if pick < weight:
            level = candidate
            break
        pick -= weight
    text, value = _expression(draws, level)
    return Task(prompt=f"{text}=", answer=str(value), task_type=TASK_TYPE, difficulty=level)


class ArithmeticEnvironment:
    """The built-in family as an Environment: `size` problems, each fixed by (config.seed, index), scored by
    integer match (inline: verifier.py bounds its input before parsing)."""

    def __init__(self, config: ArithmeticConfig | None = None) -> None:
        self.config = config or ArithmeticConfig()
        # The generator's version (its domain tag) and whole configuration: nothing local.
        configuration = {
            "generator": _DOMAIN.rstrip(b"\x00").decode(),
            "seed": self.config.seed,
            "size": self.config.size,
            "levels": list(self.config.level_weights),
        }
        self._identity = builtin_identity(NAME, content_hash(configuration))

    @property
    def spec(self) -> str:
        weights = "/".join(str(w) for w in self.config.level_weights)
        return f"{NAME}:seed={self.config.seed},size={self.config.size},levels={weights}"

    @property
    def identity(self) -> EnvironmentIdentity:
        return self._identity

    @property
    def scoring(self) -> ScoringLimits:
        return INLINE

    def __len__(self) -> int:
        return self.config.size

    def get(self, index: int) -> Task:
        check_index(index, self.config.size, self.spec)
        return make_problem(self.config.seed, index, self.config.level_weights)

    def score(self, completion: str, task: Task) -> float:
        return integer_match(completion, task.answer)


class ArithmeticOptions(BaseModel):
    """`--env arithmetic:seed=S,size=N,levels=3/3/2/1/1`: every key optional (seed: the run's task seed)."""

    model_config = ConfigDict(extra="forbid")

    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Task-set seed (default: run.task_seed).")
    size: int | None = Field(None, ge=1, le=MAX_SEED, description="Number of problems.")
    levels: list[int] | None = Field(
        None, description="Relative frequency of levels 1..5, five integers separated by '/'."
    )

    @field_validator("levels")
    @classmethod
    def _five(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(value) != len(LEVELS):
            raise ValueError(f"needs {len(LEVELS)} weights (levels 1..5) separated by '/', got {len(value)}")
        return value


def open_arithmetic(args: str, *, seed: int = 0) -> ArithmeticEnvironment:
    """Procedurally generated integer arithmetic in five difficulty levels (built in)."""
    options = parse_options(NAME, args, ArithmeticOptions)
    fields: dict[str, object] = {"seed": seed if options.seed is None else options.seed}
    if options.size is not None:
        fields["size"] = options.size
    if options.levels is not None:
        fields["level_weights"] = tuple(options.levels)
    try:
        return ArithmeticEnvironment(ArithmeticConfig.model_validate(fields))
    except ValidationError as exc:
        problem = "; ".join(err["msg"].removeprefix("Value error, ") for err in exc.errors())
        raise TaskError(f"{NAME}: {problem}") from None
