"""A checkpoint's chat template, rendered the same on every machine, every day, and within bounds.

Why not transformers' `apply_chat_template`: it gives templates a `strftime_now` that reads the clock
(Llama-3-style templates write today's date into the system turn), so a node and the validator re-checking
its file after midnight would build different prompt ids, and the honest node would be judged a cheat; Jinja
also offers `random` and `lipsum`, which differ from call to call. This is the same sandbox configured the
same way (ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and loop controls; transformers'
`tojson`, `raise_exception` and `{% generation %}` tag; namespaces that refuse `_` names; the special tokens
as variables; `tools` and `documents` None), except that the clock stands at the Unix epoch and `random` and
`lipsum` do not exist. A template that does not read the clock renders exactly what apply_chat_template
renders (tests/test_run_prompts.py compares them), and rendering no longer depends on the transformers version.

Bounds. The template comes with the checkpoint, which the run's operator chose, so it is trusted like the
weights; the bounds turn a broken template into a clear error instead of a hang or an exhausted machine.
A render may run at most MAX_STEPS Python lines, counted by a trace function: a count, not a clock, so a
render that passes on a node passes on a loaded validator (the count can differ a little between Python or
Jinja versions, which matters only within a hair of the bound, thousands of times what real templates run).
It may write at most MAX_OUTPUT_CHARS characters, hold no longer string or list in a namespace or a call's
arguments, build none with `*`, and build no integer wider than MAX_POWER_BITS with `**`: single
operations a line count cannot interrupt, and the ways a value can double in a few steps. The sandbox
already caps `range` at 100,000 items and refuses unsafe attribute access. One C-level operation on values
within those bounds is not interrupted: the bounds are against mistakes in a trusted template, not a
sandbox for hostile code.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from types import FrameType
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from ..errors import PromptError

MAX_TEMPLATE_CHARS = 256 * 1024  # real templates, tool-use ones included, are a few tens of KiB
MAX_STEPS = (
    1_000_000  # Python lines per render; a system + user render of the chat model's template runs ~150
)
MAX_OUTPUT_CHARS = 1 << 20
MAX_POWER_BITS = 1 << 16
_EPOCH = datetime.fromtimestamp(0, UTC)


class _OutOfSteps(BaseException):
    """Raised by the trace function. Not an Exception, so that no `except Exception` inside Jinja's runtime
    can swallow it (tracing is off once it has been raised, and the loop would go on unbounded)."""


def _size_error(what: str) -> PromptError:
    return PromptError(f"chat template builds {what}, more than a prompt needs (bound {MAX_OUTPUT_CHARS:,})")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if (
                isinstance(seq, (str, list, tuple))
                and isinstance(times, int)
                and len(seq) * times > MAX_OUTPUT_CHARS
            ):
                raise _size_error(f"a sequence of {len(seq) * times:,} items with '*'")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        if right * max(1, abs(left).bit_length() - 1) > MAX_POWER_BITS:
            raise PromptError(
                f"chat template computes an integer of more than {MAX_POWER_BITS:,} bits with '**'"
            )


def _check_slot(name: object, value: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates cannot set the namespace attribute {name!r}")
    if isinstance(value, (str, list, tuple)) and len(value) > MAX_OUTPUT_CHARS:
        raise _size_error(f"a namespace value of {len(value):,} items")


class _Namespace(Namespace):
    """Jinja's namespace (the one mutable object templates get), refusing `_` names and oversized values."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Namespace's own signature: `self` may be a key)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name, value in attrs.items():
            _check_slot(name, value)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_slot(name, value)
        Namespace.__setitem__(self, name, value)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; a prompt renders its
    body unchanged, as apply_chat_template does without return_assistant_tokens_mask."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        # A macro that calls itself with its argument doubled grows it exponentially in a few dozen steps.
        for value in (*args, *kwargs.values()):
            if isinstance(value, (str, list, tuple)) and len(value) > MAX_OUTPUT_CHARS:
                raise _size_error(f"a call argument of {len(value):,} items")
        return super().call(context, obj, *args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: Jinja's own escapes HTML characters, which no prompt wants.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_epoch(format: str) -> str:
    """transformers' strftime_now with the clock standing still: prompts must not depend on the day."""
    return _EPOCH.strftime(format)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    del env.filters["random"]  # differs from call to call
    del env.globals["lipsum"]  # random text
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_epoch
    env.globals["namespace"] = _Namespace
    return env


@contextmanager
def _step_budget(steps: int) -> Iterator[None]:
    """Count the Python lines this thread runs inside the block; _OutOfSteps past `steps`."""
    count = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
            if count > steps:
                raise _OutOfSteps
        return trace

    previous = sys.gettrace()  # a debugger's or coverage's tracer, put back afterwards
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


class ChatTemplate:
    """One compiled template; `render` is deterministic and bounded (module docstring)."""

    def __init__(self, source: str) -> None:
        if not isinstance(source, str) or not source.strip():
            raise PromptError("the chat template is empty or not text")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise PromptError(
                f"the chat template has {len(source):,} characters; the bound is {MAX_TEMPLATE_CHARS:,}"
            )
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise PromptError(f"the chat template does not compile: {exc}") from None

    def render(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool,
        variables: Mapping[str, Any],
    ) -> str:
        """The conversation as text; PromptError when the template raises or passes a bound."""
        context = {
            **variables,
            "messages": [dict(m) for m in messages],
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        pieces: list[str] = []
        size = 0
        try:
            with _step_budget(MAX_STEPS):
                for piece in self._template.generate(**context):
                    size += len(piece)
                    if size > MAX_OUTPUT_CHARS:
                        raise _size_error(f"output of more than {size:,} characters")
                    pieces.append(piece)
        except _OutOfSteps:
            raise PromptError(
                f"the chat template ran more than {MAX_STEPS:,} steps without finishing (does it loop?)"
            ) from None
        except PromptError:
            raise
        except Exception as exc:  # raise_exception, an undefined name, a bad operand: the template's error
            raise PromptError(f"the chat template fails: {type(exc).__name__}: {exc}") from None
        return "".join(pieces)
