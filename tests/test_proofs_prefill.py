"""The validator's prefill: length-bucketed micro-batches, and one file prefilled at once equals each
sequence prefilled alone (the states and logits the TOPLOC and sampling checks read)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

from prime_node.node.engine import HFEngine, load_engine
from prime_node.node.engine.prefill_batches import length_buckets
from prime_node.node.models.tiny import build_tiny_model, save_model_dir


def _cost(groups: list[list[int]], lengths: list[int], call_cost: int) -> int:
    return sum(call_cost + len(g) * max(lengths[i] for i in g) for g in groups)


def _brute_force(lengths: list[int], max_batch: int, call_cost: int) -> int:
    """Cheapest split of the length-sorted list into contiguous groups, by trying every split."""
    n = len(lengths)
    ordered = sorted(range(n), key=lambda i: lengths[i], reverse=True)
    best = None
    for cuts in itertools.product((False, True), repeat=n - 1):
        groups, current = [], [ordered[0]]
        for i, cut in zip(ordered[1:], cuts):
            if cut:
                groups.append(current)
                current = []
            current.append(i)
        groups.append(current)
        if all(len(g) <= max_batch for g in groups):
            cost = _cost(groups, lengths, call_cost)
            best = cost if best is None else min(best, cost)
    assert best is not None
    return best


def test_length_buckets_cover_every_sequence_once_and_are_optimal():
    rng = random.Random(0)
    for trial in range(60):
        lengths = [rng.randint(1, 200) for _ in range(rng.randint(1, 9))]
        max_batch, call_cost = rng.randint(1, 5), rng.choice((0, 16, 64, 1000))
        groups = length_buckets(lengths, max_batch, call_cost)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(1 <= len(g) <= max_batch for g in groups)
        flat = [lengths[i] for g in groups for i in g]
        assert flat == sorted(flat, reverse=True)  # longest first, each group contiguous in that order
        assert _cost(groups, lengths, call_cost) == _brute_force(lengths, max_batch, call_cost), trial


def test_length_buckets_split_only_where_padding_costs_more_than_a_call():
    assert length_buckets([], 16, 64) == []
    same = length_buckets([50] * 20, 16, 64)
    assert len(same) == 2 and max(len(g) for g in same) <= 16  # the cap forces one split, nothing more
    mixed = length_buckets([140] * 8 + [30] * 8, 16, 64)  # one group would pad 880 tokens for 64 saved
    assert [sorted(g) for g in mixed] == [list(range(8)), list(range(8, 16))]
    close = length_buckets([140] * 8 + [135] * 8, 16, 64)  # 40 padded tokens: cheaper than a second call
    assert len(close) == 1


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> HFEngine:
    model, tokenizer = build_tiny_model(seed=5)
    out: Path = tmp_path_factory.mktemp("tiny-prefill")
    save_model_dir(model, tokenizer, out)
    loaded = load_engine(out, max_batch_size=6, threads=1)
    assert isinstance(loaded, HFEngine)
    return loaded


def test_a_file_prefilled_at_once_equals_each_sequence_alone(engine: HFEngine):
    rng = random.Random(1)
    # Lengths that make several buckets of different sizes (cap 6), 3 to 150 tokens, so rows are padded.
    lengths = (150, 3, 90, 148, 12, 12, 60, 149, 7, 100, 33)
    sequences = [[rng.randrange(3, 259) for _ in range(n)] for n in lengths]
    together = engine.prefill(sequences)
    assert len(together) == len(sequences)
    for sequence, result in zip(sequences, together, strict=True):
        alone = engine.prefill([sequence])[0]
        assert result.hidden_states.shape == (len(sequence), engine.model.config.hidden_size)
        assert result.logits.shape == (len(sequence), engine.vocab_size)
        assert result.logits.dtype == torch.float32
        torch.testing.assert_close(result.hidden_states, alone.hidden_states, rtol=0, atol=1e-5)
        torch.testing.assert_close(result.logits, alone.logits, rtol=0, atol=1e-5)
        # And the model's own forward (its LM head included) on the sequence alone, with no padding.
        with torch.inference_mode():
            reference = engine.model(input_ids=torch.tensor([sequence])).logits[0].float()
        torch.testing.assert_close(result.logits, reference, rtol=0, atol=1e-4)
