"""Benchmark: what building a prompt costs (node/run/prompts.py), and how soon a looping template is cut.

Prints, from one run: microseconds per prompt (render + tokenize) for the default model's raw format and
for the chat model's template with a system prompt, the chat/raw ratio, the Python lines one chat render
runs against the bound (chat_template.MAX_STEPS), and the seconds a template that loops takes to be refused.
RunTasks caches each (task, target)'s ids, so a prompt is built once per process however often it is asked.

    .venv/bin/python benchmarks/prompts.py [--prompts N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from prime_node.node.errors import PromptError
from prime_node.node.models.chat_tokenizer import CHAT_TEMPLATE, build_chat_tokenizer
from prime_node.node.models.tokenizer import build_char_tokenizer
from prime_node.node.run.chat_template import MAX_STEPS, ChatTemplate
from prime_node.node.run.prompts import PromptBuilder

SYSTEM = "You are a careful assistant. Give the final answer after '='."
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def _per_prompt_us(builder: PromptBuilder, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        builder.ids(f"{i}+{i % 97}=", 16)
    return (time.perf_counter() - start) / n * 1e6


def _lines_of_one_render(template: ChatTemplate, variables: dict) -> int:
    count = 0

    def trace(frame, event, arg):  # noqa: ANN001, ANN202
        nonlocal count
        count += event == "line"
        return trace

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "12+34="}]
    sys.settrace(trace)
    try:
        template._template.render(messages=messages, add_generation_prompt=True, **variables)
    finally:
        sys.settrace(None)
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2000, help="prompts built per format")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    chat_tokenizer = build_chat_tokenizer()
    raw = PromptBuilder(build_char_tokenizer())
    chat = PromptBuilder(chat_tokenizer, system_prompt=SYSTEM)
    raw_us, chat_us = _per_prompt_us(raw, args.prompts), _per_prompt_us(chat, args.prompts)
    assert chat.template is not None
    lines = _lines_of_one_render(chat.template, dict(chat_tokenizer.special_tokens_map))
    start = time.perf_counter()
    try:
        ChatTemplate(LOOP + CHAT_TEMPLATE).render(
            [{"role": "user", "content": "x"}], add_generation_prompt=True, variables={}
        )
        refused = False
    except PromptError:
        refused = True
    loop_s = time.perf_counter() - start
    figures = {
        "raw_us_per_prompt": raw_us,
        "chat_us_per_prompt": chat_us,
        "chat_over_raw": chat_us / raw_us,
        "chat_render_lines": lines,
        "max_steps": MAX_STEPS,
        "loop_refused": refused,
        "loop_seconds_to_refuse": loop_s,
    }
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(f"raw prompt        {raw_us:8.1f} us (tokenize)")
        print(f"chat prompt       {chat_us:8.1f} us (render + tokenize), {chat_us / raw_us:.1f}x raw")
        print(
            f"one chat render   {lines} Python lines; the bound is {MAX_STEPS:,} ({MAX_STEPS / lines:,.0f}x)"
        )
        print(f"looping template  {'refused' if refused else 'NOT REFUSED'} after {loop_s:.2f} s")
    return 0 if refused else 1


if __name__ == "__main__":
    sys.exit(main())
