"""Which rows every frame of a pipelined batch must carry, as the validator derives them from the outputs.

The micro-batch cut is the one every member derives (node/pipeline/work.py uses it, the same order and cut
as HFEngine's batches). A sample is fed at decode step t when it has an output token t that is not EOS and
t < max_new_tokens - 1 (the last token is never fed); a stage that drops or adds a row is caught here, before
any commitment is compared.
"""

from __future__ import annotations

from collections.abc import Sequence


def micro_batches(lengths: Sequence[int], size: int) -> list[list[int]]:
    """Sample indices cut into micro-batches of at most `size`, longest prompts first: the order and cut
    node/engine/hf.py (HFEngine._micro_batches) uses, so that a pipelined batch computes on the very tensors a
    monolithic node does and float32 results agree bit for bit."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    return [order[i : i + size] for i in range(0, len(order), size)]


def fed_rows(
    rows: Sequence[int], step: int, outputs: Sequence[Sequence[int]], eos: int, max_new_tokens: int
) -> list[int]:
    """The rows of a micro-batch that a decode frame of `step` carries (those that feed output token `step`)."""
    if step >= max_new_tokens - 1:
        return []
    return [r for r in rows if len(outputs[r]) > step and eos not in outputs[r][: step + 1]]


def sampled_rows(
    rows: Sequence[int], step: int, outputs: Sequence[Sequence[int]], eos: int, max_new_tokens: int
) -> list[int]:
    """The rows a tokens frame of `step` carries: all of the micro-batch at step 0, then those fed at step - 1."""
    return list(rows) if step == 0 else fed_rows(rows, step - 1, outputs, eos, max_new_tokens)
