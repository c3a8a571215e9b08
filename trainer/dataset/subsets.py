"""The dataset's derived subsets: SFT (correct rows, optional bands) and preference pairs.

SFT keeps correct rows only, optionally those whose completion length lies in a token band and whose task
the band model solves at a pass rate within a band (INTELLECT-MATH and SYNTHETIC-1 filter by both: too easy
tasks teach little, too hard ones are mostly lucky samples). Preference pairs join, per task and prompt,
a correct completion (chosen) with an incorrect one (rejected) of the same model, each used at most once,
in sample-id order so that the same dataset always gives the same pairs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SftBands(BaseModel):
    """Which correct rows the SFT subset keeps (None: no bound)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_tokens: int | None = Field(None, ge=0, description="Shortest completion kept, in tokens.")
    max_tokens: int | None = Field(None, ge=1, description="Longest completion kept, in tokens.")
    min_solve_rate: float | None = Field(None, ge=0, le=1, description="Lowest task pass rate kept.")
    max_solve_rate: float | None = Field(None, ge=0, le=1, description="Highest task pass rate kept.")

    @model_validator(mode="after")
    def _ordered(self) -> SftBands:
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens is above max_tokens")
        low, high = self.min_solve_rate, self.max_solve_rate
        if low is not None and high is not None and low > high:
            raise ValueError("min_solve_rate is above max_solve_rate")
        return self

    def keeps(self, row: Mapping[str, Any], solve_rate: float | None) -> bool:
        n = row["completion_tokens"]
        if self.min_tokens is not None and n < self.min_tokens:
            return False
        if self.max_tokens is not None and n > self.max_tokens:
            return False
        if self.min_solve_rate is None and self.max_solve_rate is None:
            return True
        if solve_rate is None:  # the band model never sampled the task: its difficulty is unknown
            return False
        eps = 1e-12  # c / n against decimal bounds such as 0.125
        low = self.min_solve_rate if self.min_solve_rate is not None else 0.0
        high = self.max_solve_rate if self.max_solve_rate is not None else 1.0
        return low - eps <= solve_rate <= high + eps


def sft_rows(
    rows: Sequence[Mapping[str, Any]], bands: SftBands, solve_rates: Mapping[int, float]
) -> list[Mapping[str, Any]]:
    """The correct rows the bands keep; `solve_rates`: task index -> the band model's pass rate."""
    return [r for r in rows if r["correct"] and bands.keeps(r, solve_rates.get(r["task_index"]))]


PAIR_COLUMNS = (
    "task_index",
    "model",
    "prompt",
    "prompt_ids",
    "chosen",
    "chosen_ids",
    "chosen_reward",
    "chosen_sample_id",
    "rejected",
    "rejected_ids",
    "rejected_reward",
    "rejected_sample_id",
)


def preference_pairs(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """(correct, incorrect) pairs of completions to one prompt of one model, each row in one pair at most."""
    groups: dict[tuple[str, int, tuple[int, ...]], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["task_index"], tuple(r["prompt_ids"])), []).append(r)
    pairs = []
    for (model, index, _), group in sorted(groups.items(), key=lambda item: (item[0][0], item[0][1])):
        group = sorted(group, key=lambda r: r["sample_id"])
        good = [r for r in group if r["correct"]]
        bad = [r for r in group if not r["correct"]]
        for chosen, rejected in zip(good, bad, strict=False):
            pairs.append(
                {
                    "task_index": index,
                    "model": model,
                    "prompt": chosen["prompt"],
                    "prompt_ids": chosen["prompt_ids"],
                    "chosen": chosen["completion"],
                    "chosen_ids": chosen["completion_ids"],
                    "chosen_reward": chosen["task_reward"],
                    "chosen_sample_id": chosen["sample_id"],
                    "rejected": rejected["completion"],
                    "rejected_ids": rejected["completion_ids"],
                    "rejected_reward": rejected["task_reward"],
                    "rejected_sample_id": rejected["sample_id"],
                }
            )
    return pairs
