"""Finding the final answer in a completion, for environments whose scorers take an answer, not a text.

Completions come from untrusted peers and every validator repeats the extraction, so it is linear in the
completion's length (plain `rfind`, no backtracking regex: a completion of many unclosed `<answer>` tags
must not cost quadratic time) and applied only after the completion is cut to MAX_COMPLETION_CHARS.
"""

from __future__ import annotations

from .verifier import MAX_COMPLETION_CHARS

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"


def tagged_answer(completion: str) -> str | None:
    """The text of the last `<answer>...</answer>` pair, stripped; None when there is none.

    reasoning-gym's own convention (its `extract_answer`), found from the end instead of with a regex."""
    end = completion.rfind(ANSWER_CLOSE)
    if end < 0:
        return None
    start = completion.rfind(ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return completion[start + len(ANSWER_OPEN) : end].strip()


def final_answer(completion: str) -> str | None:
    """The answer a completion gives: the last tagged answer if there is one, else the whole completion,
    stripped; None when the completion is not text, too long to look at, or blank."""
    if not isinstance(completion, str) or len(completion) > MAX_COMPLETION_CHARS:
        return None
    tagged = tagged_answer(completion)
    answer = tagged if tagged is not None else completion.strip()
    return answer or None
