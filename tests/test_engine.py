"""The inference engine: finish reasons, batch/thread/device invariance of Gumbel sampling, hidden states.

All tests run the real transformers backend on a random-init tiny Qwen2 saved to tmp_path. Engines use one
torch thread unless a test says otherwise: on a busy 2-core machine that is several times faster than two.

Near-ties. Two runs of the same sample (alone vs in a batch, 1 vs 2 threads, CPU vs CUDA) compute logits
that differ in the last float32 bits, so a token may legitimately differ where the best two entries of
logits / T + g are closer than that noise. A divergence is accepted only when the top-2 gap of
logits / T + g at the first differing position (recomputed by prefill of the common prefix) is below
FLOAT32_TIE_MARGIN; every other difference fails, and the number of accepted ones must stay small.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from prime_node.node.engine import EngineSettings, HFEngine, load_engine
from prime_node.node.engine.types import Completion, SampleRequest, SamplingParams
from prime_node.node.errors import EngineError
from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.proofs.gumbel import gumbel_noise, perturbed_scores

# Observed float32 logit differences between batch compositions, thread counts and devices are ~1e-6
# (see docs/engine.md); 1e-3 leaves three orders of magnitude of headroom while a random gap of the
# perturbed scores falls below it only about once per thousand tokens.
FLOAT32_TIE_MARGIN = 1e-3
MAX_TOLERATED_TIES = 2  # per comparison of 16 samples; the expected count is 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tokenizer = build_tiny_model(seed=3)
    out = tmp_path_factory.mktemp("tiny-model")
    save_model_dir(model, tokenizer, out)
    return out


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> HFEngine:
    loaded = load_engine(model_dir, device="cpu", max_batch_size=16, threads=1)
    assert isinstance(loaded, HFEngine)
    return loaded


@pytest.fixture(autouse=True)
def _restore_threads() -> None:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def mixed_requests(count: int, seed_base: int = 1000) -> list[SampleRequest]:
    """Prompts of 2..40 tokens (different lengths force left padding), printable ids, distinct seeds."""
    return [
        SampleRequest(
            prompt_ids=tuple(3 + 33 + (7 * i + j) % 90 for j in range(2 + (11 * i) % 39)), seed=seed_base + i
        )
        for i in range(count)
    ]


def assert_well_formed(completion: Completion, params: SamplingParams, eos: int) -> None:
    out = completion.output_ids
    assert 1 <= len(out) <= params.max_new_tokens
    assert eos not in out[:-1], "EOS may only be the last output token"
    if completion.finish_reason == "eos":
        assert out[-1] == eos
    else:
        assert completion.finish_reason == "length" and len(out) == params.max_new_tokens and out[-1] != eos
    assert len(completion.output_logprobs) == len(out)
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in completion.output_logprobs)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for t, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return t
    return None if len(a) == len(b) else min(len(a), len(b))


def count_near_tie_divergences(
    engine: HFEngine, reference: list[Completion], other: list[Completion], temperature: float, margin: float
) -> int:
    """Samples whose tokens differ; fails unless each first difference sits at a top-2 gap below `margin`."""
    count = 0
    for a, b in zip(reference, other):
        assert (a.prompt_ids, a.seed) == (b.prompt_ids, b.seed), "completions must come back in request order"
        t = first_divergence(a.output_ids, b.output_ids)
        if t is None:
            continue
        count += 1
        logits = engine.prefill([a.prompt_ids + a.output_ids[:t]])[0].logits[-1]
        noise = gumbel_noise(torch.tensor([a.seed]), torch.tensor([t]), logits.shape[-1])[0]
        top2 = perturbed_scores(logits, temperature, noise).topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < margin, f"seed {a.seed} diverges at output position {t} with top-2 gap {gap} >= {margin}"
    return count


def assert_same_samples(
    engine: HFEngine,
    reference: list[Completion],
    other: list[Completion],
    temperature: float,
    what: str,
    hidden_atol: float,
) -> int:
    """Same tokens except counted near-ties, and the same captured states wherever the tokens agree."""
    ties = count_near_tie_divergences(engine, reference, other, temperature, FLOAT32_TIE_MARGIN)
    print(f"near-tie divergences, {what}: {ties} of {len(reference)} samples")
    assert ties <= MAX_TOLERATED_TIES
    for a, b in zip(reference, other):
        if a.output_ids == b.output_ids and a.hidden_states is not None:
            torch.testing.assert_close(a.hidden_states, b.hidden_states, rtol=0, atol=hidden_atol)
    return ties


def assert_bf16_states_match_own_prefill(engine: HFEngine, completion: Completion) -> None:
    # bf16 rounding differs between incremental decoding and a full prefill; states agree to bf16 precision.
    assert completion.hidden_states is not None and completion.hidden_states.dtype == torch.bfloat16
    prefill = engine.prefill([completion.prompt_ids + completion.output_ids])[0]
    assert prefill.hidden_states.dtype == torch.bfloat16 and prefill.logits.dtype == torch.float32
    fed = completion.hidden_states.shape[0]
    torch.testing.assert_close(
        completion.hidden_states.float(), prefill.hidden_states[:fed].float(), rtol=0.05, atol=0.1
    )


def logit_bound(engine: HFEngine) -> float:
    """max |logit| over every possible input: |h . e_v| <= sqrt(H) * ||w * e_v|| for h = RMSNorm(x) * w."""
    norm_weight = engine.model.model.norm.weight.detach().float()
    rows = engine.head.weight.detach().float()
    return float((rows * norm_weight).norm(dim=-1).max()) * math.sqrt(rows.shape[1])


def noise_decided_seeds(
    engine: HFEngine, temperature: float, max_new: int, candidates: int
) -> tuple[dict[int, int], list[int]]:
    """Seeds whose Gumbel noise alone decides EOS whatever the logits are.

    EOS wins at position t for any model whose logits lie in [-B, B] when g[eos] exceeds every other
    g[v] by more than 2B / T, and cannot win when it falls short of the largest by more than 2B / T. So
    ({seed: t} where EOS is forced at t after being impossible before, [seeds where EOS is impossible
    throughout]) are exact predictions made without running the model.
    """
    need = 2 * logit_bound(engine) / temperature
    seeds = torch.arange(candidates)
    impossible_so_far = torch.ones(candidates, dtype=torch.bool)
    forced_at = torch.full((candidates,), -1)
    eos = engine.eos_token_id
    for t in range(max_new):
        g = gumbel_noise(seeds, torch.full((candidates,), t), engine.vocab_size)
        others = g.clone()
        others[:, eos] = -math.inf
        best_other = others.max(dim=-1).values
        forced = impossible_so_far & (g[:, eos] - best_other > need) & (forced_at < 0)
        forced_at[forced] = t
        impossible_so_far &= best_other - g[:, eos] > need
    forced_seeds = {int(s): int(forced_at[s]) for s in (forced_at >= 0).nonzero()[:, 0]}
    return forced_seeds, [int(s) for s in impossible_so_far.nonzero()[:, 0]]


# ----------------------------------------------------------------- loading and validation


def test_load_errors_are_engine_errors(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(EngineError, match="no config.json"):
        load_engine(tmp_path / "missing")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    with pytest.raises(EngineError, match="cannot load"):
        load_engine(broken)
    truncated = tmp_path / "truncated"
    save_model_dir(*build_tiny_model(seed=1), truncated)
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(EngineError, match="cannot load"):
        load_engine(truncated)
    # A pickled checkpoint is refused, never unpickled: checkpoints may come from peers.
    (truncated / "model.safetensors").unlink()
    torch.save(build_tiny_model(seed=1)[0].state_dict(), truncated / "pytorch_model.bin")
    with pytest.raises(EngineError, match="model.safetensors"):
        load_engine(truncated)
    with pytest.raises(EngineError, match="unknown device"):
        load_engine(model_dir, device="tpu")  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="no CUDA device"):
            load_engine(model_dir, device="cuda")


def test_settings_bounds_and_factory(model_dir: Path) -> None:
    with pytest.raises(ValidationError, match="max_batch_size"):
        EngineSettings(max_batch_size=0)
    with pytest.raises(ValidationError, match="dtype"):
        EngineSettings(dtype="float16")
    settings = EngineSettings(max_batch_size=4, threads=1, dtype="bfloat16")
    loaded = load_engine(model_dir, **settings.model_dump())
    assert isinstance(loaded, HFEngine) and loaded.dtype == torch.bfloat16 and loaded.max_batch_size == 4


def test_bad_requests_are_refused(engine: HFEngine) -> None:
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    bad = [
        ([SampleRequest((), 1)], params, "empty"),
        ([SampleRequest((5, engine.vocab_size), 1)], params, "outside"),
        ([SampleRequest((5,), -1)], params, "seed"),
        ([SampleRequest((5,), 1)], SamplingParams(max_new_tokens=4, temperature=0.0), "temperature"),
        ([SampleRequest((5,), 1)], SamplingParams(max_new_tokens=0, temperature=1.0), "max_new_tokens"),
        ([SampleRequest((5,) * 500, 1)], SamplingParams(max_new_tokens=100, temperature=1.0), "positions"),
    ]
    for requests, p, message in bad:
        with pytest.raises(EngineError, match=message):
            engine.generate(requests, p)
    with pytest.raises(EngineError, match="empty"):
        engine.prefill([[]])
    for keep_from, message in [
        ([3], "outside its 3 positions"),
        ([-1], "outside"),
        ([0, 0], "2 entries for 1"),
    ]:
        with pytest.raises(EngineError, match=message):
            engine.prefill([[40, 41, 42]], keep_from)


def test_prefill_keeps_the_positions_asked_for(engine: HFEngine) -> None:
    # A verifier keeps each row from its prompt's last token: the same states and logits as the full prefill's
    # tail, nothing before (a prompt's logits are 594 KiB per token at a 152k vocabulary).
    sequences = [list(range(40, 40 + n)) for n in (9, 5, 12, 7)]
    starts = [8, 0, 3, 6]  # the last position alone, all of them, and two in between
    full = engine.prefill(sequences)
    kept = engine.prefill(sequences, starts)
    for sequence, start, whole, part in zip(sequences, starts, full, kept, strict=True):
        assert part.first_position == start and whole.first_position == 0
        assert part.logits.shape == (len(sequence) - start, engine.vocab_size)
        assert part.hidden_states.shape == (len(sequence) - start, whole.hidden_states.shape[1])
        torch.testing.assert_close(part.hidden_states, whole.hidden_states[start:], rtol=0, atol=1e-6)
        torch.testing.assert_close(part.logits, whole.logits[start:], rtol=0, atol=1e-5)


def test_hidden_states_are_the_final_norm_output(engine: HFEngine) -> None:
    """What we capture is what the LM head reads: the norm's output, which is also hidden_states[-1]."""
    ids = [40, 41, 42, 43, 44, 45]
    captured: list[torch.Tensor] = []
    hook = engine.model.model.norm.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    try:
        with torch.inference_mode():
            full = engine.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    result = engine.prefill([ids])[0]
    assert torch.equal(full.hidden_states[-1][0], captured[0][0])
    torch.testing.assert_close(result.hidden_states, captured[0][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(result.logits, full.logits[0].float(), rtol=0, atol=1e-5)
    assert result.logits.dtype == torch.float32 and result.logits.shape == (len(ids), engine.vocab_size)


# ----------------------------------------------------------------- finish reasons


def test_finish_reasons_at_eos_and_at_max_length(engine: HFEngine) -> None:
    """EOS is forced (or excluded) by the noise alone, so the expected outputs are known in advance."""
    temperature, max_new = 3.0, 8
    forced, excluded = noise_decided_seeds(engine, temperature, max_new, candidates=4000)
    assert len(forced) >= 4 and len(excluded) >= 8, "too few noise-decided seeds; raise `candidates`"
    forced_seeds = sorted(forced)[:8]
    seeds = forced_seeds + excluded[: 16 - len(forced_seeds)]
    base = mixed_requests(len(seeds))
    requests = [SampleRequest(r.prompt_ids, s) for r, s in zip(base, seeds)]
    params = SamplingParams(max_new_tokens=max_new, temperature=temperature)
    batch = engine.generate(requests, params)
    alone = [engine.generate([r], params)[0] for r in requests]
    for run in (batch, alone):
        for completion in run:
            assert_well_formed(completion, params, engine.eos_token_id)
            if completion.seed in forced:
                assert completion.finish_reason == "eos"
                assert len(completion.output_ids) == forced[completion.seed] + 1
            else:
                assert completion.finish_reason == "length"
    # Samples leave the batch at different steps here: their captured states must stay aligned.
    assert_hidden_and_logprobs_match_prefill(engine, batch, temperature, atol=1e-4)
    assert_same_samples(engine, alone, batch, temperature, "alone vs batch with early EOS", hidden_atol=1e-5)


# ----------------------------------------------------------------- invariance of the sampled tokens


def test_same_seed_same_tokens_alone_or_in_a_batch_of_16(engine: HFEngine) -> None:
    requests = mixed_requests(16)
    params = SamplingParams(max_new_tokens=16, temperature=0.7)
    batch = engine.generate(requests, params)
    alone = [engine.generate([r], params)[0] for r in requests]
    engine_in_fives = HFEngine(engine.model, max_batch_size=5, threads=1)
    micro = engine_in_fives.generate(requests, params)
    for completion in batch + alone + micro:
        assert_well_formed(completion, params, engine.eos_token_id)
    # Padding and batch-mates leave every captured state unchanged, not only the tokens.
    assert_same_samples(engine, alone, batch, params.temperature, "alone vs batch of 16", hidden_atol=1e-5)
    assert_same_samples(
        engine, alone, micro, params.temperature, "alone vs micro-batches of 5", hidden_atol=1e-5
    )
    # The seed decides: different seeds for the same prompts give different samples.
    reseeded = engine.generate([SampleRequest(r.prompt_ids, r.seed + 10**6) for r in requests], params)
    assert sum(a.output_ids != b.output_ids for a, b in zip(batch, reseeded)) >= 12


def test_one_and_two_threads_agree(model_dir: Path) -> None:
    requests = mixed_requests(8, seed_base=77)
    params = SamplingParams(max_new_tokens=12, temperature=0.7)
    one = load_engine(model_dir, max_batch_size=8, threads=1)
    two = load_engine(model_dir, max_batch_size=8, threads=2)
    single, double = one.generate(requests, params), two.generate(requests, params)
    assert torch.get_num_threads() == 2
    assert_same_samples(one, single, double, params.temperature, "1 vs 2 threads", hidden_atol=1e-4)


# ----------------------------------------------------------------- hidden states and log-probabilities


def assert_hidden_and_logprobs_match_prefill(
    engine: HFEngine, completions: list[Completion], temperature: float, atol: float
) -> None:
    """What TOPLOC verification relies on: one prefill of prompt + output reproduces the captured states."""
    prefills = engine.prefill([c.prompt_ids + c.output_ids for c in completions])
    for completion, prefill in zip(completions, prefills):
        fed = len(completion.prompt_ids) + len(completion.output_ids) - 1
        assert completion.hidden_states is not None and completion.hidden_states.shape[0] == fed
        assert completion.hidden_states.device.type == "cpu"
        torch.testing.assert_close(completion.hidden_states, prefill.hidden_states[:fed], rtol=0, atol=atol)
        start = len(completion.prompt_ids) - 1
        rows = prefill.logits[start : start + len(completion.output_ids)]
        expected = torch.log_softmax(rows / temperature, dim=-1)
        expected = expected.gather(-1, torch.tensor(completion.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(completion.output_logprobs), expected, rtol=0, atol=atol)


def test_captured_hidden_states_and_logprobs_match_prefill(engine: HFEngine) -> None:
    requests = mixed_requests(12, seed_base=500)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    completions = engine.generate(requests, params)
    assert all(c.hidden_states.dtype == torch.float32 for c in completions)
    assert_hidden_and_logprobs_match_prefill(engine, completions, params.temperature, atol=1e-4)
    without = engine.generate(requests, params, capture_hidden=False)
    assert all(c.hidden_states is None for c in without)
    assert [c.output_ids for c in without] == [c.output_ids for c in completions]
    # One prefill call batches sequences of different lengths; padding must not leak into any of them.
    single = engine.prefill([requests[3].prompt_ids])[0]
    batched = engine.prefill([r.prompt_ids for r in requests])[3]
    torch.testing.assert_close(batched.logits, single.logits, rtol=0, atol=1e-5)


def test_bfloat16_keeps_the_compute_dtype(model_dir: Path) -> None:
    bf16 = load_engine(model_dir, dtype="bfloat16", max_batch_size=8, threads=1)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    completions = bf16.generate(mixed_requests(4), params)
    for completion in completions:
        assert_well_formed(completion, params, bf16.eos_token_id)
        assert_bf16_states_match_own_prefill(bf16, completion)


# ----------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_cuda_backend_matches_cpu_except_near_ties(model_dir: Path, engine: HFEngine) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    requests = mixed_requests(16, seed_base=9000)
    params = SamplingParams(max_new_tokens=24, temperature=0.7)
    cuda = load_engine(model_dir, device="cuda", dtype="float32", max_batch_size=16)
    on_gpu, on_cpu = cuda.generate(requests, params), engine.generate(requests, params)
    for completion in on_gpu:
        assert_well_formed(completion, params, cuda.eos_token_id)
    assert_same_samples(engine, on_cpu, on_gpu, params.temperature, "CPU vs CUDA, float32", hidden_atol=1e-3)
    # bf16 on CUDA (the default there): well-formed, and its own prefill reproduces its states.
    bf16 = load_engine(model_dir, device="cuda", max_batch_size=16)
    for completion in bf16.generate(requests, params):
        assert_well_formed(completion, params, bf16.eos_token_id)
        assert_bf16_states_match_own_prefill(bf16, completion)
