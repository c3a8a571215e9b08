"""Completions crafted to be slow or heavy for real scorers, shared by tests/test_scorer_attacks.py and
benchmarks/scorer_bounds.py. Each is under the completion bound (verifier.MAX_COMPLETION_CHARS), so it
reaches the scorer; without the bounded scorer, those marked `hangs` here ran past 20 s (most past 300 s)
on this machine, and `factorial` took 12 s, in the calling process."""

from __future__ import annotations

# math-verify (sympy's LaTeX parsing, simplification and numeric comparison).
MATH_ATTACKS: dict[str, str] = {
    "power_tower": r"\boxed{" + "9^{" * 6 + "9" + "}" * 6 + "}",  # hangs: evaluates a power tower
    "huge_power": r"\boxed{10^{10^{10}}}",  # hangs
    "factorial": r"\boxed{1000000!}",  # 12 s
    "deep_frac": r"\boxed{" + r"\frac{1}{" * 2000 + "2" + "}" * 2000 + "}",  # hangs: nesting
    "deep_sqrt": r"\boxed{" + r"\sqrt{" * 3000 + "2" + "}" * 3000 + "}",  # hangs
    "deep_parens": r"\boxed{" + "(" * 10000 + "1" + ")" * 10000 + "}",  # hangs
    "big_interval": r"\boxed{" + r"\cup".join(f"({i},{i + 1})" for i in range(3000)) + "}",  # hangs
    "long_sum": r"\boxed{" + "+".join(["x"] * 8000) + "}",  # 4 s
    "long_integer": r"\boxed{" + "9" * 60000 + "}",
    "unclosed_boxed": r"\boxed{" * 8000,  # regex input: many openings, no close
    "many_inline_math": "$1$ " * 15000,
    "many_boxed": r"\boxed{1}, " * 5000,
}

# reasoning-gym families whose scorers parse the answer with sympy (simple_integration and
# intermediate_integration), and the answer-tag extraction every family goes through.
REASONING_GYM_ATTACKS: dict[str, str] = {
    "power_tower": "9**9**9**9",  # hangs in sympy's parse_expr
    "huge_float": "1e999999999",  # hangs
    "latex_tower": "9^{9^{9^{9}}}",  # 3 s
    "deep_parens": "(" * 20000 + "1" + ")" * 20000,
    "long_integer": "9" * 60000,
    "many_answer_tags": "<answer>" * 8000,  # quadratic for a backtracking regex; linear here
}
