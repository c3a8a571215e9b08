"""Proof costs measured in one run: size, building vs generation, verification vs generation, and
(where the `toploc` package is installed) our build/verify times against its own, with cross-checks.

Usage: .venv/bin/python benchmarks/proofs.py [--model DIR] [--prompts N] [--samples G] [--new-tokens T]
       [--batch B] [--repeats R] [--threads K] [--grid] [--prefill-variants] [--device cuda [--dtype D]]

Without --model it builds the embedded tiny model (random init, seed 0). Generation is timed with
hidden-state capture (what a contributor runs, micro-batches of --batch); proof building covers every
completion of the batch; verification is what proofs/checks.py does per file with the validator's own
engine (micro-batches of 16): one prefill of prompt + output per sample (length-bucketed batches), one
batched TOPLOC check, one batched Gumbel replay and the EOS-probability check. Both sides run on the same
--threads torch threads (default 1). Best of R repeats for each timing (generation, building and
verification alternate within a repeat), all in this one process. Times are this process's CPU time by
default (--clock cpu): on a machine shared with other work, wall time swings with their load while CPU
time of a one-thread process does not; --clock wall measures elapsed time.
--grid also prints generation / verification for max new tokens 16, 64, 128 x generation batch 1, 4, 16.
--prefill-variants measures candidate prefill paths (attention kernel, autograd mode, torch.compile) against
the validator's current one on the same rollouts: whole verification, prefill, one-time cost, and how far
their hidden states, logits and TOPLOC statistics move (docs/proofs.md, "Costs").
--device cuda generates and verifies on the GPU (transformers backend; generation in --dtype, bfloat16 by
default as on a GPU node; the verifier prefills in float32 as a validator does) and times wall seconds after
a CUDA synchronize; the CPU-only lines (matmul ceiling, toploc comparison) are left out there.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from prime_node.node.engine import (
    Completion,
    HFEngine,
    InferenceEngine,
    SampleRequest,
    SamplingParams,
    load_engine,
)
from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.proofs import gf
from prime_node.proofs.bounds import BYTES_PER_CHUNK
from prime_node.proofs.evidence import prefill_batches
from prime_node.proofs.sampling import SamplingThresholds, eos_probability_failure, replay_samplings
from prime_node.proofs.toploc import (
    build_proof,
    build_proofs,
    check_proof,
    check_proofs,
    committed_rows,
)
from prime_node.proofs.verifier import VerifierSettings

VERIFIER = VerifierSettings()  # the validator's defaults: prefill calls of this many rows and logits bytes
VERIFIER_BATCH = VERIFIER.prefill_batch_size
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]  # set from --clock in main


def cuda_wall_clock() -> float:
    """Wall seconds once the GPU has finished what was queued (kernels run asynchronously)."""
    torch.cuda.synchronize()
    return time.perf_counter()


def best(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = clock()
        result = fn()
        times.append(clock() - start)
    return min(times), result


def requests_for(prompts: int, samples: int) -> list[SampleRequest]:
    return [
        SampleRequest(prompt_ids=tuple(3 + 48 + (5 * i + j) % 10 for j in range(10 + i % 16)), seed=1000 + i)
        for i in range(prompts)
        for _ in range(samples)
    ]


def verify(
    verifier: InferenceEngine, completions: list[Completion], proofs: list[bytes], parts: dict[str, float]
) -> None:
    """The expensive checks of proofs/checks.py on one file's rows, timed by part into `parts`."""
    thresholds = SamplingThresholds()
    t0 = clock()
    results = []
    lengths = [len(c.prompt_ids) + len(c.output_ids) for c in completions]
    spans = [committed_rows(len(c.prompt_ids), len(c.output_ids)) for c in completions]
    # The validator's cut into prefill calls, kept from each prompt's last token (proofs/evidence.py); unlike
    # the validator, which reduces each call before the next, every call's outputs are kept here so that
    # TOPLOC and the replay can be timed apart.
    for batch in prefill_batches(
        lengths,
        verifier.vocab_size,
        VERIFIER.prefill_batch_size,
        VERIFIER.prefill_max_logits_mib << 20,
        logit_rows=[n - span.start for n, span in zip(lengths, spans, strict=True)],
    ):
        sequences = [completions[i].prompt_ids + completions[i].output_ids for i in batch]
        results += zip(batch, verifier.prefill(sequences, [spans[i].start for i in batch]))
    prefills = [r for _, r in sorted(results, key=lambda pair: pair[0])]
    spans = [slice(0, span.stop - span.start) for span in spans]  # counted from each result's first position
    t1 = clock()
    check_proofs(proofs, [r.hidden_states[span] for r, span in zip(prefills, spans, strict=True)])
    t2 = clock()
    replay_samplings(
        [r.logits[span] for r, span in zip(prefills, spans, strict=True)],
        [c.output_ids for c in completions],
        [c.seed for c in completions],
        1.0,
        thresholds.margin,
    )
    for c, r, span in zip(completions, prefills, spans, strict=True):
        if c.finish_reason == "eos":
            eos_probability_failure(r.logits[span.stop - 1], verifier.eos_token_id, 1.0, thresholds)
    parts["prefill"] += t1 - t0
    parts["toploc"] += t2 - t1
    parts["sampling replay"] += clock() - t2


def measure(
    engine: InferenceEngine,
    verifier: InferenceEngine,
    requests: list[SampleRequest],
    params: SamplingParams,
    repeats: int,
) -> dict:
    """Generation, proof building and verification of the same rollouts, timed in this one run. The three
    alternate within each repeat, so a burst of load from other processes hits all of them alike."""
    gen, build, check = [], [], []
    parts: dict[str, float] = {"prefill": 0.0, "toploc": 0.0, "sampling replay": 0.0}
    for _ in range(repeats):
        seconds, completions = best(lambda: engine.generate(requests, params), 1)
        gen.append(seconds)
        states = [c.hidden_states[committed_rows(len(c.prompt_ids), len(c.output_ids))] for c in completions]
        # As the producer does (node/run/producer.py): one batched call for the whole batch's completions.
        seconds, proofs = best(functools.partial(build_proofs, states), 1)
        build.append(seconds)
        check.append(best(functools.partial(verify, verifier, completions, proofs, parts), 1)[0])
    return {
        "gen": min(gen),
        "build": min(build),
        "verify": min(check),
        "parts": parts,
        "completions": completions,
        "states": states,
        "proofs": proofs,
        "tokens": sum(len(c.output_ids) for c in completions),
    }


def matmul_flops_per_second(width: int, inner: int, repeats: int = 30) -> float:
    """This CPU's float32 matmul rate at the model's shapes, on the current torch threads (best of R)."""
    a, b = torch.randn(4096, width), torch.randn(width, inner)
    seconds, _ = best(lambda: a @ b, repeats)
    return 2 * 4096 * width * inner / seconds


def prefill_floor(verifier: InferenceEngine, completions: list[Completion]) -> tuple[float, float, float]:
    """(seconds, FLOP per token, FLOP/s): the prefill's time if every weight multiply ran at the measured
    matmul rate and nothing else cost anything (attention scores, norms, Python all free): a floor."""
    model = verifier.model  # the transformers engine (the only CPU backend)
    weights = (
        sum(p.numel() for p in model.model.layers.parameters()) + model.get_output_embeddings().weight.numel()
    )
    flops = 2 * weights
    rate = matmul_flops_per_second(model.config.hidden_size, model.config.intermediate_size)
    tokens = sum(len(c.prompt_ids) + len(c.output_ids) for c in completions)
    return tokens * flops / rate, flops, rate


def grid(model_dir: Path, requests: list[SampleRequest], threads: int, repeats: int) -> None:
    verifier = load_engine(model_dir, max_batch_size=VERIFIER_BATCH, threads=threads)
    print("| max new tokens | generation batch | output tokens | generation s | verification s | ratio |")
    print("|---|---|---|---|---|---|")
    for new_tokens in (16, 64, 128):
        for batch in (1, 4, 16):
            engine = load_engine(model_dir, max_batch_size=batch, threads=threads)
            params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
            m = measure(engine, verifier, requests, params, repeats)
            print(
                f"| {new_tokens} | {batch} | {m['tokens']} | {m['gen']:.3f} | {m['verify']:.3f} | "
                f"{m['gen'] / m['verify']:.1f}x |",
                flush=True,
            )


def _variant_engines(model_dir: Path, threads: int) -> dict[str, HFEngine]:
    """The validator's prefill as it is, and candidates that compute the same float32 forward otherwise."""

    def engine() -> HFEngine:
        loaded = load_engine(model_dir, max_batch_size=VERIFIER_BATCH, threads=threads)
        assert isinstance(loaded, HFEngine)  # CPU: always the transformers backend
        return loaded

    variants = {"current (sdpa, inference_mode)": engine()}
    eager = variants["eager attention"] = engine()
    eager.model.set_attn_implementation("eager")
    math = variants["sdpa math backend"] = engine()
    plain_prefill = math.prefill

    def math_prefill(sequences: list, keep_from: list | None = None) -> list:
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            return plain_prefill(sequences, keep_from)

    math.prefill = math_prefill  # type: ignore[method-assign]
    no_grad = variants["no_grad instead of inference_mode"] = engine()
    no_grad._prefill_batch = torch.no_grad()(  # type: ignore[method-assign]
        functools.partial(HFEngine._prefill_batch.__wrapped__, no_grad)
    )  # type: ignore[attr-defined]
    compiled = variants["torch.compile(dynamic=True), inductor"] = engine()
    compiled.base = torch.compile(compiled.base, dynamic=True)  # type: ignore[assignment]
    return variants


def prefill_variants(
    model_dir: Path,
    completions: list[Completion],
    proofs: list[bytes],
    threads: int,
    repeats: int,
    clock_name: str,
) -> None:
    """Each candidate's whole verification of the same rollouts against the current path, alternating within
    each repeat in this process (best of R), its first call (compilation) timed apart, and how far its states,
    logits and TOPLOC statistics move from the current path's."""
    current = "current (sdpa, inference_mode)"
    variants = _variant_engines(model_dir, threads)
    sequences = [c.prompt_ids + c.output_ids for c in completions]
    spans = [committed_rows(len(c.prompt_ids), len(c.output_ids)) for c in completions]
    reference = variants[current].prefill(sequences)
    first, diffs = {}, {}
    for name, engine in list(variants.items()):
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            results = engine.prefill(sequences)
        except Exception as exc:  # e.g. no C++ compiler for inductor: report the candidate and drop it
            print(f"{name}: failed ({type(exc).__name__}: {exc}); left out")
            del variants[name]
            continue
        first[name] = (time.process_time() - cpu, time.perf_counter() - wall)
        states = [r.hidden_states[span] for r, span in zip(results, spans, strict=True)]
        stats = [s for row in check_proofs(proofs, states) for s in row]
        diffs[name] = (
            max(float((a.hidden_states - b.hidden_states).abs().max()) for a, b in zip(results, reference)),
            max(float((a.logits - b.logits).abs().max()) for a, b in zip(results, reference)),
            max(s.exp_mismatches for s in stats),
            max(s.mant_err_mean for s in stats),
        )
    scale = max(float(r.hidden_states.abs().max()) for r in reference)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    parts = {name: {"prefill": 0.0, "toploc": 0.0, "sampling replay": 0.0} for name in variants}
    for _ in range(repeats):
        for name, engine in variants.items():
            start = clock()
            verify(engine, completions, proofs, parts[name])
            seconds[name].append(clock() - start)

    def prefill_share(name: str) -> float:
        return min(seconds[name]) * parts[name]["prefill"] / sum(parts[name].values())

    base, base_prefill = min(seconds[current]), prefill_share(current)
    print(
        f"prefill variants ({len(completions)} samples, best of {repeats}, {clock_name} seconds; "
        f"max |hidden state| {scale:.2f}):"
    )
    print(
        "| prefill path | first call s (cpu / wall) | verification ms | speed-up | prefill ms | speed-up | "
        "max abs diff hidden / logits | worst chunk: exp mismatches / mean mantissa err |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in variants:
        t, prefill = min(seconds[name]), prefill_share(name)
        dh, dl, exp, mant = diffs[name]
        print(
            f"| {name} | {first[name][0]:.2f} / {first[name][1]:.2f} | {t * 1e3:.1f} | {base / t:.2f}x | "
            f"{prefill * 1e3:.1f} | {base_prefill / prefill:.2f}x | {dh:.2g} / {dl:.2g} | {exp} / {mant:.2f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads for generation and verification"
    )
    parser.add_argument(
        "--grid", action="store_true", help="also the ratio over output lengths and batch sizes"
    )
    parser.add_argument(
        "--prefill-variants",
        action="store_true",
        help="also candidate prefill paths (attention kernel, torch.compile...) against the current",
    )
    parser.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="cpu",
        help="cpu: this process's CPU time (steady on a shared machine; with --threads > 1 it sums "
        "the threads, i.e. CPU cost); wall: elapsed time",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="generation dtype (default: cpu float32, "
        "cuda bfloat16); the verifier always prefills in float32",
    )
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    on_gpu = args.device == "cuda"
    if on_gpu:
        clock = cuda_wall_clock
        args.clock = "wall (CUDA-synchronized)"
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model
    if model_dir is None:
        model_dir = Path(tmp.name) / "tiny"
        model, tokenizer = build_tiny_model(0)
        save_model_dir(model, tokenizer, model_dir)
    gen_dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    engine = load_engine(
        model_dir,
        max_batch_size=args.batch,
        threads=args.threads,
        device=args.device,
        dtype=gen_dtype,
        prefer_vllm=False,
    )
    verifier = load_engine(
        model_dir, max_batch_size=VERIFIER_BATCH, threads=args.threads, device=args.device, dtype="float32"
    )
    if on_gpu:
        print(
            f"device: {torch.cuda.get_device_name()}, generation in {gen_dtype}, verification prefill float32"
        )
    requests = requests_for(args.prompts, args.samples)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)

    start = clock()
    gf._power_rows(128)  # one-time tables, built at first use in a process
    gf._inverse_table()
    table_seconds = clock() - start
    m = measure(engine, verifier, requests, params, args.repeats)
    gen_seconds, build_seconds, verify_seconds, parts = m["gen"], m["build"], m["verify"], m["parts"]
    states, proofs, tokens = m["states"], m["proofs"], m["tokens"]
    one_by_one_seconds, _ = best(lambda: [build_proof(h) for h in states], args.repeats)
    chunks = sum(len(p) for p in proofs) // BYTES_PER_CHUNK
    total_parts = sum(parts.values())
    print(
        f"batch: {len(requests)} samples, {tokens} output tokens, {chunks} chunks, torch threads "
        f"{torch.get_num_threads()}, times are {args.clock} seconds"
    )
    print(
        f"bytes per full 32-token chunk: {BYTES_PER_CHUNK}; bytes per 32 output tokens in this batch: "
        f"{sum(len(p) for p in proofs) * 32 / tokens:.1f} (a partial last chunk costs a full 258)"
    )
    print(f"generation: {gen_seconds:.3f} s ({tokens / gen_seconds:.0f} tokens/s, batch {args.batch})")
    print(
        f"proof building: {build_seconds * 1e3:.1f} ms = {100 * build_seconds / gen_seconds:.2f}% of generation "
        f"(target <= 3%); one-time power table {table_seconds * 1e3:.0f} ms per process; one call per "
        f"completion instead of one per batch: {one_by_one_seconds * 1e3:.1f} ms"
    )
    print(
        f"verification (prefill + TOPLOC + sampling replay): {verify_seconds:.3f} s; generation / verification "
        f"= {gen_seconds / verify_seconds:.1f}x (target >= 20x on CPU)"
    )
    print(
        "verification time by part (all repeats): "
        + ", ".join(f"{name} {100 * t / total_parts:.0f}%" for name, t in parts.items())
    )
    if on_gpu:
        return  # the ceilings below measure this CPU's matmul rate, and toploc's reference runs on CPU tensors
    prefill_seconds = verify_seconds * parts["prefill"] / total_parts
    floor, flops, rate = prefill_floor(verifier, m["completions"])
    print(
        f"ceilings: generation / prefill alone (TOPLOC and replay free) = "
        f"{gen_seconds / prefill_seconds:.1f}x; prefill at this CPU's matmul rate ({rate / 1e9:.0f} GFLOP/s, "
        f"{flops / 1e6:.2f} MFLOP per token, nothing else costing anything) >= {floor * 1e3:.1f} ms, "
        f"generation / that = {gen_seconds / floor:.1f}x"
    )
    completions = m["completions"]
    head = verifier.model.get_output_embeddings().weight.numel() * 2 / flops
    prompt_positions = sum(len(c.prompt_ids) - 1 for c in completions)
    print(
        f"LM head: {100 * head:.1f}% of a token's weight FLOPs; prompt positions before the last prompt token, "
        f"whose LM head and logits the verifier skips: {prompt_positions} of "
        f"{sum(len(c.prompt_ids) + len(c.output_ids) for c in completions)} prefilled"
    )
    if args.prefill_variants:
        prefill_variants(model_dir, m["completions"], proofs, args.threads, max(args.repeats, 5), args.clock)
    if args.grid:
        grid(model_dir, requests, args.threads, args.repeats)

    try:
        import toploc
    except ImportError:
        print(
            "toploc not installed: no comparison (pip install --no-build-isolation --no-binary toploc toploc==0.1.6)"
        )
        return
    bf16 = [h.to(torch.bfloat16) for h in states]
    theirs_build, theirs = best(
        lambda: [
            b"".join(toploc.build_proofs_bytes(list(h), decode_batching_size=32, topk=128, skip_prefill=True))
            for h in bf16
        ],
        args.repeats,
    )
    ours_verify, ours_stats = best(lambda: check_proofs(proofs, bf16), args.repeats)  # batched, as checks.py
    ours_one_by_one, _ = best(lambda: [check_proof(p, h) for p, h in zip(proofs, bf16)], args.repeats)

    def their_verify() -> list:
        return [
            toploc.verify_proofs_bytes(
                h,
                [p[i : i + BYTES_PER_CHUNK] for i in range(0, len(p), BYTES_PER_CHUNK)],
                decode_batching_size=32,
                topk=128,
                skip_prefill=True,
            )
            for p, h in zip(proofs, bf16)
        ]

    theirs_verify, their_stats = best(their_verify, args.repeats)
    same_bytes = theirs == proofs
    same_stats = all(
        [(s.exp_mismatches, s.mant_err_mean, s.mant_err_median) for s in ours]
        == [(r.exp_mismatches, r.mant_err_mean, r.mant_err_median) for r in their]
        for ours, their in zip(ours_stats, their_stats)
    )
    cross = all(all(s.exp_mismatches == 0 for s in check_proof(p, h)) for p, h in zip(theirs, bf16))
    print(
        f"toploc {getattr(toploc, '__version__', '?')}: build ours {build_seconds * 1e3:.1f} ms vs theirs "
        f"{theirs_build * 1e3:.1f} ms ({theirs_build / build_seconds:.2f}x); verify (no prefill) ours "
        f"{ours_verify * 1e3:.1f} ms vs theirs {theirs_verify * 1e3:.1f} ms ({theirs_verify / ours_verify:.2f}x; "
        f"ours one call per completion as theirs: {ours_one_by_one * 1e3:.1f} ms)"
    )
    print(
        f"cross-check: identical bytes {same_bytes}; their verifier on our proofs gives our statistics "
        f"{same_stats}; our verifier accepts their proofs exactly {cross}"
    )


if __name__ == "__main__":
    main()
