"""The text the chat model's tokenizer is trained on, generated here: the same lines on every machine.

No corpus can be downloaded, and a tokenizer trained on files that change (the docs, a task file) would
change with them, so the corpus is a pure function of this module's version: the built-in arithmetic
family's problems and answers, the length-target instruction, and short chat turns (system prompts,
questions, answers, the role names the chat template writes) assembled from the fixed phrases below.
Changing anything here changes the tokenizer, hence CORPUS_VERSION, which prime_node.json records.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..environments.arithmetic import ArithmeticConfig, ArithmeticEnvironment
from ..environments.length import thinking_suffix

CORPUS_VERSION = "prime-node/chat-corpus/v1"
ROLES = ("system", "user", "assistant")
ARITHMETIC_LINES = 6000  # problems of the built-in family (seed 0, the default level mix)
CHAT_TURNS = 3000
LENGTH_TARGETS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful assistant. Think step by step, then give the final answer after '='.",
    "Answer with the number only.",
    "You solve arithmetic problems. Show your working briefly and end with the result.",
    "Be concise. Reply with a single line.",
    "You are a patient math tutor who explains each step clearly.",
)
QUESTIONS = (
    "What is {expr}?",
    "Please compute {expr}.",
    "Solve: {expr}",
    "Calculate {expr} and give the answer after '='.",
    "How much is {expr}? Answer after '='.",
    "Can you work out {expr} for me?",
    "Find the value of {expr}.",
    "I need the result of {expr}, please.",
)
ANSWERS = (
    "{expr}={answer}",
    "The answer is {answer}.",
    "Let me work it out step by step. {expr}={answer}",
    "Sure! The result of {expr} is {answer}.",
    "We compute the expression carefully: ={answer}",
    "First I evaluate the brackets, then the products, then the sums. So the final answer is {answer}.",
    "{answer}",
)
FREE_TURNS = (
    ("Hello! Who are you?", "Hello! I am a small assistant that answers questions and solves problems."),
    ("Thank you for the help.", "You are welcome. Let me know if there is anything else I can do."),
    ("Can you explain what a prime number is?", "A prime number has exactly two divisors: one and itself."),
    ("Is seven greater than three?", "Yes, seven is greater than three."),
    ("Write the numbers from one to five.", "One, two, three, four, five."),
    ("What should I check before giving an answer?", "Check each step again, then state the final result."),
)


def _pick(options: tuple[str, ...], n: int) -> str:
    return options[n % len(options)]


def corpus_lines() -> Iterator[str]:
    """Every training line, in a fixed order (index-driven choices, no random generator)."""
    tasks = ArithmeticEnvironment(ArithmeticConfig(seed=0))
    for i in range(ARITHMETIC_LINES):
        task = tasks.get(i)
        yield f"{task.prompt}{task.answer}"
    for target in LENGTH_TARGETS:
        yield thinking_suffix(target).strip()
    for i in range(CHAT_TURNS):
        task = tasks.get(ARITHMETIC_LINES + i)
        expr = task.prompt.removesuffix("=")
        yield _pick(ROLES, i)
        yield _pick(SYSTEM_PROMPTS, i // 3)
        yield _pick(QUESTIONS, i).format(expr=expr) + thinking_suffix(_pick_target(i))
        yield _pick(ANSWERS, i // 2).format(expr=expr, answer=task.answer)
        question, answer = FREE_TURNS[i % len(FREE_TURNS)]
        yield question
        yield answer


def _pick_target(n: int) -> int:
    return LENGTH_TARGETS[n % len(LENGTH_TARGETS)]
