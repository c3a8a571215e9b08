"""Proof costs measured in one run: size, building vs generation, verification vs generation, and
(where the `toploc` package is installed) our build/verify times against its own, with cross-checks.

Usage: .venv/bin/python benchmarks/proofs.py [--model DIR] [--prompts N] [--samples G] [--new-tokens T]
       [--batch B] [--repeats R]

Without --model it builds the embedded tiny model (random init, seed 0). Generation is timed with
hidden-state capture (what a contributor runs); proof building covers every completion of the batch;
verification is what a validator does per file: one prefill of prompt + output per sample (batched),
TOPLOC check and Gumbel replay. Best of R repeats for each timing, all in this one process.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from prime_node.node.engine import SampleRequest, SamplingParams, load_engine
from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.proofs import gf
from prime_node.proofs.sampling import replay_sampling
from prime_node.proofs.toploc import BYTES_PER_CHUNK, build_proof, build_proofs, check_proof, check_proofs, committed_rows


def best(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model
    if model_dir is None:
        model_dir = Path(tmp.name) / "tiny"
        model, tokenizer = build_tiny_model(0)
        save_model_dir(model, tokenizer, model_dir)
    engine = load_engine(model_dir, max_batch_size=args.batch)
    requests = [SampleRequest(prompt_ids=tuple(3 + 48 + (5 * i + j) % 10 for j in range(10 + i % 16)), seed=1000 + i)
                for i in range(args.prompts) for _ in range(args.samples)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)

    start = time.perf_counter()
    gf._power_rows(128)  # one-time table, built at first use in a process
    table_seconds = time.perf_counter() - start
    gen_seconds, completions = best(lambda: engine.generate(requests, params), args.repeats)
    states = [c.hidden_states[committed_rows(len(c.prompt_ids), len(c.output_ids))] for c in completions]
    # As the producer does (node/producer.py): one batched call for the whole batch's completions.
    build_seconds, proofs = best(lambda: build_proofs(states), args.repeats)
    one_by_one_seconds, _ = best(lambda: [build_proof(h) for h in states], args.repeats)
    tokens = sum(len(c.output_ids) for c in completions)
    chunks = sum(len(p) for p in proofs) // BYTES_PER_CHUNK

    parts: dict[str, float] = {"prefill": 0.0, "toploc": 0.0, "sampling replay": 0.0}

    def verify() -> None:  # as proofs/checks.py does: one prefill, one batched TOPLOC check, replay per row
        t0 = time.perf_counter()
        results = engine.prefill([c.prompt_ids + c.output_ids for c in completions])
        spans = [committed_rows(len(c.prompt_ids), len(c.output_ids)) for c in completions]
        t1 = time.perf_counter()
        check_proofs(proofs, [r.hidden_states[span] for r, span in zip(results, spans, strict=True)])
        t2 = time.perf_counter()
        for c, result, span in zip(completions, results, spans, strict=True):
            replay_sampling(result.logits[span], c.output_ids, 1.0, c.seed, 0.05)
        parts["prefill"] += t1 - t0
        parts["toploc"] += t2 - t1
        parts["sampling replay"] += time.perf_counter() - t2

    verify_seconds, _ = best(verify, args.repeats)
    total_parts = sum(parts.values())
    print(f"batch: {len(requests)} samples, {tokens} output tokens, {chunks} chunks, torch threads {torch.get_num_threads()}")
    print(f"bytes per full 32-token chunk: {BYTES_PER_CHUNK}; bytes per 32 output tokens in this batch: "
          f"{sum(len(p) for p in proofs) * 32 / tokens:.1f} (a partial last chunk costs a full 258)")
    print(f"generation: {gen_seconds:.3f} s ({tokens / gen_seconds:.0f} tokens/s)")
    print(f"proof building: {build_seconds * 1e3:.1f} ms = {100 * build_seconds / gen_seconds:.2f}% of generation "
          f"(target <= 3%); one-time power table {table_seconds * 1e3:.0f} ms per process; one call per "
          f"completion instead of one per batch: {one_by_one_seconds * 1e3:.1f} ms")
    print(f"verification (prefill + TOPLOC + sampling replay): {verify_seconds:.3f} s; generation / verification "
          f"= {gen_seconds / verify_seconds:.1f}x (target >= 20x on CPU)")
    print("verification time by part (all repeats): " + ", ".join(
        f"{name} {100 * t / total_parts:.0f}%" for name, t in parts.items()))

    try:
        import toploc
    except ImportError:
        print("toploc not installed: no comparison (pip install --no-build-isolation --no-binary toploc toploc==0.1.6)")
        return
    bf16 = [h.to(torch.bfloat16) for h in states]
    theirs_build, theirs = best(lambda: [b"".join(toploc.build_proofs_bytes(list(h), decode_batching_size=32, topk=128,
                                                                            skip_prefill=True)) for h in bf16], args.repeats)
    ours_verify, ours_stats = best(lambda: [check_proof(p, h) for p, h in zip(proofs, bf16)], args.repeats)

    def their_verify() -> list:
        return [toploc.verify_proofs_bytes(h, [p[i:i + BYTES_PER_CHUNK] for i in range(0, len(p), BYTES_PER_CHUNK)],
                                           decode_batching_size=32, topk=128, skip_prefill=True)
                for p, h in zip(proofs, bf16)]

    theirs_verify, their_stats = best(their_verify, args.repeats)
    same_bytes = theirs == proofs
    same_stats = all(
        [(s.exp_mismatches, s.mant_err_mean, s.mant_err_median) for s in ours]
        == [(r.exp_mismatches, r.mant_err_mean, r.mant_err_median) for r in their]
        for ours, their in zip(ours_stats, their_stats)
    )
    cross = all(all(s.exp_mismatches == 0 for s in check_proof(p, h)) for p, h in zip(theirs, bf16))
    print(f"toploc {getattr(toploc, '__version__', '?')}: build ours {build_seconds * 1e3:.1f} ms vs theirs "
          f"{theirs_build * 1e3:.1f} ms ({theirs_build / build_seconds:.2f}x); verify (no prefill) ours "
          f"{ours_verify * 1e3:.1f} ms vs theirs {theirs_verify * 1e3:.1f} ms ({theirs_verify / ours_verify:.2f}x)")
    print(f"cross-check: identical bytes {same_bytes}; their verifier on our proofs gives our statistics "
          f"{same_stats}; our verifier accepts their proofs exactly {cross}")


if __name__ == "__main__":
    main()
