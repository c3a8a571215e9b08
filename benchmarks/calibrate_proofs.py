"""Calibrate the proof thresholds: statistic distributions of honest rollouts against attacks.

Usage: .venv/bin/python benchmarks/calibrate_proofs.py [--model DIR] [--prompts N] [--samples G]
       [--new-tokens T] [--out results.json]
       .venv/bin/python benchmarks/calibrate_proofs.py --honest 1000 [--new-tokens T]   (false rejections)

Every configuration generates the same assigned batch (the embedded tiny model unless --model), then
the validator's configuration (float32, CPU, batch 16) prefills it and computes, per TOPLOC chunk,
exponent mismatches and mean/median mantissa errors, and per sample the Gumbel replay (mismatches beyond
the margin, near-ties, largest gap) and the log-probability z-score. Honest configurations vary batch
size, thread count and compute dtype; attacks use other weights (relative noise on one layer at several
scales, int8/int4 weights, another seed) with their own honest-looking proofs. The table printed at the
end is what docs/proofs.md reports; the thresholds must sit between the honest maxima and attack minima.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from attack_support import (  # noqa: E402  (the attack tests' real-model cheaters, reused)
    NODE,
    engine_from,
    make_checkpoint,
    perturbed_engine,
    quantized_engine,
    run_tasks,
)

from prime_node.node.engine import HFEngine, load_engine  # noqa: E402
from prime_node.node.models.tiny import build_tiny_model  # noqa: E402
from prime_node.node.producer import BatchSpec, produce_rows  # noqa: E402
from prime_node.node.validation import verify_rollout_file  # noqa: E402
from prime_node.proofs.rollout_file import write_rollout_file  # noqa: E402
from prime_node.proofs.sampling import SamplingThresholds, distribution_z, replay_sampling  # noqa: E402
from prime_node.proofs.toploc import (  # noqa: E402
    ToplocThresholds,
    check_proof,
    committed_rows,
    typical_mant_err_mean,
)
from prime_node.proofs.verifier import VerifierSettings  # noqa: E402


def measure(verifier: HFEngine, rows) -> dict:
    """Every statistic the verifier computes, for all rows."""
    chunks, samples = [], []
    margin = SamplingThresholds().margin
    results = verifier.prefill([r.prompt_ids + r.output_ids for r in rows])
    for row, result in zip(rows, results, strict=True):
        span = committed_rows(len(row.prompt_ids), len(row.output_ids))
        chunks.extend(check_proof(row.proof, result.hidden_states[span]))
        samples.append(replay_sampling(result.logits[span], row.output_ids, row.temperature, row.sample_seed, margin))
    return {
        "chunks": len(chunks),
        "exp_mismatches_max": max(c.exp_mismatches for c in chunks),
        "exp_mismatches_mean": statistics.fmean(c.exp_mismatches for c in chunks),
        "exp_mismatches_min": min(c.exp_mismatches for c in chunks),
        "mant_err_mean_max": max(c.mant_err_mean for c in chunks),
        "mant_err_mean_min": min(c.mant_err_mean for c in chunks),
        "mant_err_median_max": max(c.mant_err_median for c in chunks),
        "mant_err_median_min": min(c.mant_err_median for c in chunks),
        "tokens": sum(s.tokens for s in samples),
        "sampling_mismatches": sum(s.mismatches for s in samples),
        "near_ties": sum(s.near_ties for s in samples),
        "max_gap": max(s.max_gap for s in samples),
        "z": distribution_z(samples)[0],
        "toploc_rejected_chunks": sum(c.failure(ToplocThresholds()) is not None for c in chunks),
        "typical_mant_err_mean": typical_mant_err_mean(chunks),
    }


def honest_run(checkpoint: Path, tasks, total: int, new_tokens: int, out_dir: Path) -> dict:
    """`total` honest rollouts through the full verifier, cycling batch size, threads and dtype."""
    verifier = load_engine(checkpoint, max_batch_size=16)
    threads = torch.get_num_threads()
    engines = [("fp32 batch 16", load_engine(checkpoint, max_batch_size=16)),
               ("fp32 batch 64", load_engine(checkpoint, max_batch_size=64)),
               ("fp32 batch 8, 1 thread", load_engine(checkpoint, max_batch_size=8, threads=1)),
               ("bf16 batch 32", load_engine(checkpoint, max_batch_size=32, dtype="bfloat16"))]
    settings = VerifierSettings(run_seed=1, samples_per_prompt=2)
    done, rejected, counter = 0, [], 0
    worst = {"exp": 0, "mean": 0.0, "median": 0.0, "typical": 0.0, "near_ties": 0}
    while done < total:
        name, engine = engines[counter % len(engines)]
        spec = BatchSpec(run_id="honest", run_seed=1, policy_step=0, batch_counter=counter, prompts=16,
                         samples=2, temperature=1.0, max_new_tokens=new_tokens)
        torch.set_num_threads(engine.threads or threads)
        rows = produce_rows(engine, tasks, NODE.node_id, spec).rows
        torch.set_num_threads(threads)
        path = out_dir / f"honest-{counter}.parquet"
        write_rollout_file(path, rows, NODE)
        report = verify_rollout_file(path, verifier, tasks, settings)
        if not report.accepted:
            rejected.append((name, report.reasons))
        stats = measure(verifier, rows)
        worst = {"exp": max(worst["exp"], stats["exp_mismatches_max"]),
                 "mean": max(worst["mean"], stats["mant_err_mean_max"]),
                 "median": max(worst["median"], stats["mant_err_median_max"]),
                 "typical": max(worst["typical"], stats["typical_mant_err_mean"]),
                 "near_ties": worst["near_ties"] + stats["near_ties"]}
        done += len(rows)
        counter += 1
        print(f"{done:5d} rollouts, {len(rejected)} rejected; batch {counter} ({name}) worst so far {worst}", flush=True)
    return {"rollouts": done, "files": counter, "rejected": rejected, "worst": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--honest", type=int, default=0,
                        help="instead: run this many honest rollouts through the full verifier and count rejections")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    checkpoint = args.model or make_checkpoint(Path(tmp.name) / "ckpt")
    tasks = run_tasks(checkpoint)
    if args.honest:
        summary = honest_run(checkpoint, tasks, args.honest, args.new_tokens, Path(tmp.name))
        print(json.dumps(summary, indent=2))
        if args.out:
            args.out.write_text(json.dumps(summary, indent=2))
        return
    spec = BatchSpec(run_id="calibrate", run_seed=1, policy_step=0, batch_counter=0, prompts=args.prompts,
                     samples=args.samples, temperature=1.0, max_new_tokens=args.new_tokens)
    verifier = load_engine(checkpoint, max_batch_size=16)
    threads = torch.get_num_threads()

    def loaded(**kw) -> Callable[[], HFEngine]:
        return lambda: load_engine(checkpoint, **kw)

    configs: list[tuple[str, str, Callable[[], HFEngine]]] = [
        ("honest", "fp32 batch 16", loaded(max_batch_size=16)),
        ("honest", "fp32 batch 1", loaded(max_batch_size=1)),
        ("honest", "fp32 batch 16, 1 thread", loaded(max_batch_size=16, threads=1)),
        ("honest", "bf16 compute, batch 16", loaded(max_batch_size=16, dtype="bfloat16")),
    ]
    if args.model is None:  # the cheaters rebuild the embedded model from its seed
        configs += [("attack", f"layer-1 noise {s:g}", lambda s=s: perturbed_engine(s))
                    for s in (1e-3, 3e-3, 1e-2, 3e-2, 5e-2)]
        configs += [("attack", "int8 weights", lambda: quantized_engine(8)),
                    ("attack", "int4 weights", lambda: quantized_engine(4)),
                    ("attack", "other seed", lambda: engine_from(build_tiny_model(1)[0]))]
    results = []
    for kind, name, make in configs:
        engine = make()
        start = time.perf_counter()
        rows = produce_rows(engine, tasks, NODE.node_id, spec).rows
        torch.set_num_threads(threads)  # a 1-thread config must not slow the verifier
        stats = measure(verifier, rows)
        stats.update(kind=kind, config=name, seconds=round(time.perf_counter() - start, 1))
        results.append(stats)
        print(f"{kind:6} {name:28} exp-mismatch max {stats['exp_mismatches_max']:3d} min {stats['exp_mismatches_min']:3d} "
              f"| mant-mean max {stats['mant_err_mean_max']:.2f} min {stats['mant_err_mean_min']:.2f} "
              f"| mant-median max {stats['mant_err_median_max']:.0f} | typical {stats['typical_mant_err_mean']:.2f} | sampling mismatches {stats['sampling_mismatches']} "
              f"near-ties {stats['near_ties']} z {stats['z']:+.2f} | rejected chunks "
              f"{stats['toploc_rejected_chunks']}/{stats['chunks']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
