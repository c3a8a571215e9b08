"""Calibrate the proof thresholds: statistic distributions of honest rollouts against attacks.

Usage: .venv/bin/python benchmarks/calibrate_proofs.py [--model DIR] [--other-model DIR ...] [--prompts N]
       [--samples G] [--batches B] [--new-tokens T] [--out results.json]
       .venv/bin/python benchmarks/calibrate_proofs.py --honest 1000 [--model DIR] [--new-tokens T]
       (false rejections through the full verifier)
       .venv/bin/python benchmarks/calibrate_proofs.py --sweep [--model DIR] [--batches B] [--plot-dir DIR]
       (sensitivity: one layer's relative noise 1e-4 .. 1e-1 and int16 .. int4 weights against the bounds)

Every configuration generates the same assigned batches (batch counters 0 .. B-1) from the checkpoint
(--model, default: the untrained embedded tiny model), then the validator's configuration (float32,
CPU, batch 16) prefills them and computes, per TOPLOC chunk, exponent mismatches and mean/median
mantissa errors, per file the typical chunk error, and per sample the Gumbel replay. Honest
configurations vary batch size (1, 4, 16), torch threads (1, 2) and compute dtype (float32, bfloat16;
float64 stands in for another machine's float32 rounding). Attacks run other weights and make their own
honest-looking proofs: one middle layer with relative noise (a new noise draw per batch), int8/int4
weights (per-channel symmetric), and any --other-model (another seed, an older checkpoint). Each file is
judged against the calibrated thresholds of both precisions and the pre-warm-start ones; the table
printed at the end is what docs/proofs.md reports. --sweep runs the same statistics on a finer grid of
perturbations (and honest float32 / bf16 references), prints where each set of bounds starts catching
every file, and with --plot-dir draws the curves as PNGs (matplotlib, trainer/devnet/plot.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from matplotlib.figure import Figure

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from prime_node.node.engine import HFEngine, load_engine  # noqa: E402
from prime_node.node.run.producer import BatchSpec, produce_rows  # noqa: E402
from prime_node.node.run.validation import verify_rollout_file  # noqa: E402
from prime_node.proofs.rollout_file import write_rollout_file  # noqa: E402
from prime_node.proofs.sampling import SamplingThresholds, replay_sampling  # noqa: E402
from prime_node.proofs.toploc import (  # noqa: E402
    ChunkStats,
    ToplocThresholds,
    check_proof,
    committed_rows,
    typical_mant_err_mean,
    worst_failure,
)
from prime_node.proofs.verifier import VerifierSettings  # noqa: E402
from prime_node.trainer.devnet.plot import Level, Series, figure, save  # noqa: E402

from support.attack import NODE, make_checkpoint, run_tasks  # noqa: E402
from support.proofs import float64_copy, perturbed_copy, quantized_copy  # noqa: E402

# The bounds before the warm-start recalibration (session 2), kept to show what they missed.
PREVIOUS = ToplocThresholds(
    max_exp_mismatches=16,
    max_mant_err_mean=8.0,
    max_mant_err_median=4.0,
    max_typical_mant_err_mean=1.5,
    min_typical_chunks=1,
)
JUDGES = {
    "previous": PREVIOUS,
    "float32": ToplocThresholds.for_precision("float32"),
    "bfloat16": ToplocThresholds.for_precision("bfloat16"),
}
NOISES = (1e-1, 7e-2, 5e-2, 2e-2, 1e-2, 5e-3, 2e-3, 1e-3)
QUANT_BITS = (12, 10, 8, 6, 4)
SWEEP_NOISES = tuple(m * 10.0**e for e in (-4, -3, -2) for m in (1, 2, 3, 5, 7)) + (1e-1,)  # 1e-4 .. 1e-1
SWEEP_BITS = (16, 12, 10, 8, 6, 4)
EngineFactory = Callable[[int], HFEngine]  # batch counter -> engine (attacks draw new noise per batch)


def file_stats(verifier: HFEngine, rows) -> tuple[list[ChunkStats], int, float]:
    """Per-chunk TOPLOC statistics of one file against the verifier, its Gumbel mismatches beyond the
    float32 margin, and the largest Gumbel gap of any non-argmax token."""
    chunks, mismatches, gap = [], 0, 0.0
    margin = SamplingThresholds.for_precision("float32").margin
    for row, result in zip(rows, verifier.prefill([r.prompt_ids + r.output_ids for r in rows]), strict=True):
        span = committed_rows(len(row.prompt_ids), len(row.output_ids))
        chunks.extend(check_proof(row.proof, result.hidden_states[span]))
        replay = replay_sampling(
            result.logits[span], row.output_ids, row.temperature, row.sample_seed, margin
        )
        mismatches += replay.mismatches
        gap = max(gap, replay.max_gap)
    return chunks, mismatches, gap


def run_config(
    name: str,
    kind: str,
    make: EngineFactory,
    threads: int,
    verifier: HFEngine,
    tasks,
    spec: BatchSpec,
    batches: int,
) -> dict:
    chunks: list[ChunkStats] = []
    typical, rejected, mismatches, rollouts, gap = [], dict.fromkeys(JUDGES, 0), 0, 0, 0.0
    start = time.perf_counter()
    for counter in range(batches):
        engine = make(counter)
        torch.set_num_threads(threads)
        batch = BatchSpec(**{**spec.__dict__, "batch_counter": counter})
        rows = produce_rows(engine, tasks, NODE.node_id, batch).rows
        torch.set_num_threads(1)  # the validator's own setting
        stats, wrong, file_gap = file_stats(verifier, rows)
        gap = max(gap, file_gap)
        chunks += stats
        typical.append(typical_mant_err_mean(stats))
        mismatches += wrong
        rollouts += len(rows)
        for judge, thresholds in JUDGES.items():
            rejected[judge] += worst_failure(stats, thresholds) is not None
    exp = [c.exp_mismatches for c in chunks]
    mean = [c.mant_err_mean for c in chunks]
    median = [c.mant_err_median for c in chunks]
    return {
        "kind": kind,
        "config": name,
        "rollouts": rollouts,
        "files": batches,
        "chunks": len(chunks),
        "exp": [min(exp), max(exp)],
        "mean": [min(mean), max(mean)],
        "median": [min(median), max(median)],
        "typical": [min(typical), max(typical)],
        "mean_p99": sorted(mean)[int(0.99 * (len(mean) - 1))],
        "nonzero_chunks": sum(m > 0 or e > 0 for m, e in zip(mean, exp, strict=True)),
        "rejected_files": rejected,
        "sampling_mismatches": mismatches,
        "max_gap": gap,
        "seconds": round(time.perf_counter() - start, 1),
    }


Config = tuple[str, str, EngineFactory, int]  # kind, name, engine factory, torch threads while generating


def configurations(checkpoint: Path, verifier: HFEngine, others: list[Path]) -> list[Config]:
    configs: list[Config] = []
    for dtype in ("float32", "bfloat16"):
        for batch in (1, 4, 16):
            for threads in (1, 2):
                engine = load_engine(checkpoint, max_batch_size=batch, dtype=dtype, threads=threads)
                name = f"{dtype} batch {batch}, {threads} thread(s)"
                configs.append(("honest", name, lambda c, e=engine: e, threads))
    wide = float64_copy(verifier)
    configs.append(("honest", "float64 batch 16 (other float32 hardware)", lambda c: wide, 1))
    for noise in NOISES:
        configs.append(
            (
                "attack",
                f"middle layer noise {noise:g}",
                lambda c, n=noise: perturbed_copy(verifier, n, seed=c),
                1,
            )
        )
    for bits in QUANT_BITS:
        engine = quantized_copy(verifier, bits)
        configs.append(("attack", f"int{bits} weights (per-channel symmetric)", lambda c, e=engine: e, 1))
    for other in others:
        engine = load_engine(other, max_batch_size=16)
        configs.append(("attack", f"other model {other.name}", lambda c, e=engine: e, 1))
    return configs


def honest_run(checkpoint: Path, tasks, total: int, new_tokens: int, out_dir: Path, run_seed: int) -> dict:
    """`total` honest rollouts through the full verifier, cycling batch size, threads and dtype; each file
    is verified under the thresholds of the precision its producer computed in."""
    verifier = load_engine(checkpoint, max_batch_size=16)
    engines = [
        ("float32", "batch 16", load_engine(checkpoint, max_batch_size=16, threads=2)),
        ("float32", "batch 64", load_engine(checkpoint, max_batch_size=64, threads=2)),
        ("float32", "batch 8, 1 thread", load_engine(checkpoint, max_batch_size=8, threads=1)),
        ("float32", "batch 1, 1 thread", load_engine(checkpoint, max_batch_size=1, threads=1)),
        ("bfloat16", "batch 32", load_engine(checkpoint, max_batch_size=32, dtype="bfloat16", threads=2)),
        (
            "bfloat16",
            "batch 4, 1 thread",
            load_engine(checkpoint, max_batch_size=4, dtype="bfloat16", threads=1),
        ),
    ]
    done, rejected, counter = 0, [], 0
    worst: dict[str, dict[str, float]] = {}
    while done < total:
        precision, name, engine = engines[counter % len(engines)]
        spec = BatchSpec(
            run_id="honest",
            run_seed=run_seed,
            policy_step=0,
            batch_counter=counter,
            prompts=16,
            samples=2,
            temperature=1.0,
            max_new_tokens=new_tokens,
        )
        rows = produce_rows(engine, tasks, NODE.node_id, spec).rows
        torch.set_num_threads(1)
        path = out_dir / f"honest-{counter}.parquet"
        write_rollout_file(path, rows, NODE)
        settings = VerifierSettings(run_seed=run_seed, samples_per_prompt=2, node_precision=precision)
        report = verify_rollout_file(path, verifier, tasks, settings)
        if not report.accepted:
            rejected.append((precision, name, report.reasons))
        stats, _, gap = file_stats(verifier, rows)
        w = worst.setdefault(
            precision, {"exp": 0, "mean": 0.0, "median": 0.0, "typical": 0.0, "gumbel_gap": 0.0}
        )
        w.update(
            exp=max(w["exp"], *(c.exp_mismatches for c in stats)),
            mean=max(w["mean"], *(c.mant_err_mean for c in stats)),
            median=max(w["median"], *(c.mant_err_median for c in stats)),
            typical=max(w["typical"], typical_mant_err_mean(stats)),
            gumbel_gap=max(w["gumbel_gap"], gap),
        )
        done += len(rows)
        counter += 1
        print(
            f"{done:5d} rollouts, {len(rejected)} rejected; file {counter} ({precision} {name}) worst {worst}",
            flush=True,
        )
    return {"rollouts": done, "files": counter, "rejected": rejected, "worst": worst}


def sweep(checkpoint: Path, tasks, spec: BatchSpec, batches: int, plot_dir: Path | None) -> list[dict]:
    """Sensitivity: the statistics per perturbation strength against the bounds, with honest references."""
    verifier = load_engine(checkpoint, max_batch_size=16, threads=1)
    # Engines that do not depend on the chunk are built once here and returned by their factory.
    honest = {
        d: load_engine(checkpoint, max_batch_size=16, dtype=d, threads=1) for d in ("float32", "bfloat16")
    }
    quantized = {bits: quantized_copy(verifier, bits) for bits in SWEEP_BITS}
    configs: list[tuple[str, str, EngineFactory]] = [
        ("honest", dtype, lambda c, e=engine: e) for dtype, engine in honest.items()
    ]
    configs += [
        ("noise", f"{noise:g}", lambda c, n=noise: perturbed_copy(verifier, n, seed=c))
        for noise in SWEEP_NOISES
    ]
    configs += [("quant", f"int{bits}", lambda c, e=engine: e) for bits, engine in quantized.items()]
    results = []
    print(
        "| cheat | strength | file typical (min .. max) | worst chunk: exp / mean | files caught: float32 bounds "
        "/ bfloat16 bounds | Gumbel mismatches |"
    )
    print("|---|---|---|---|---|---|")
    for kind, name, make in configs:
        r = run_config(name, kind, make, 1, verifier, tasks, spec, batches)
        results.append(r)
        rej = r["rejected_files"]
        print(
            f"| {kind} | {name} | {_span(r['typical'], 3)} | {r['exp'][1]} / {r['mean'][1]:.2f} | "
            f"{rej['float32']} / {rej['bfloat16']} of {r['files']} | {r['sampling_mismatches']} |",
            flush=True,
        )
    for judge in ("float32", "bfloat16"):
        for kind, label in (("noise", "relative noise"), ("quant", "quantization")):
            # Grids run from weakest to strongest (noise) and finest to coarsest (bits): walk back from the
            # strongest point while every file is caught; the last such point is the detection threshold.
            caught = None
            for r in reversed([r for r in results if r["kind"] == kind]):
                if r["rejected_files"][judge] < r["files"]:
                    break
                caught = r["config"]
            where = f"from {label} {caught} on" if caught else f"at no {label} on the grid"
            print(f"{judge} bounds: every file caught {where}")
    if plot_dir is not None:
        for path in plot_sweep(results, plot_dir):
            print(f"wrote {path}")
    return results


# Statistics below this are drawn on it: the y axis is logarithmic, and honest float32's is exactly 0.
PLOT_FLOOR = 1e-2


def plot_sweep(results: list[dict], plot_dir: Path) -> list[Path]:
    """The two sensitivity PNGs (noise, quantization) of a sweep's results, in `plot_dir`."""
    return [
        save(sensitivity_figure(results, kind), plot_dir / f"proofs_sensitivity_{name}.png")
        for kind, name in (("noise", "noise"), ("quant", "quantization"))
    ]


def sensitivity_figure(results: list[dict], kind: str) -> Figure:
    """The file typical statistic (log scale; values below PLOT_FLOOR drawn on it) against the strength of
    one cheat (`kind`: noise or quant): its smallest and largest over the files at each point, with the float32
    and bfloat16 bounds and the honest float32 and bfloat16 maxima as horizontal lines. x: relative noise (log)
    or weight bits."""
    honest = {r["config"]: r["typical"][1] for r in results if r["kind"] == "honest"}
    points = [r for r in results if r["kind"] == kind]
    if kind == "noise":
        name, xlabel, xscale = "noise", "relative noise added to one middle layer's weights", "log"
        xs = [float(r["config"]) for r in points]
    else:
        name, xlabel, xscale = "quantization", "weight bits (per-channel int N)", "linear"
        xs = [float(r["config"].removeprefix("int")) for r in points]
    files = points[0]["files"] if points else 0
    bounds = {p: JUDGES[p].max_typical_mant_err_mean for p in ("float32", "bfloat16")}
    return figure(
        [
            Series(
                f"largest of {files} files",
                [(x, max(r["typical"][1], PLOT_FLOOR)) for x, r in zip(xs, points, strict=True)],
                "lightskyblue",
            ),
            Series(
                f"smallest of {files} files",
                [(x, max(r["typical"][0], PLOT_FLOOR)) for x, r in zip(xs, points, strict=True)],
                "navy",
            ),
        ],
        levels=[
            Level(f"float32 bound ({bounds['float32']:g})", bounds["float32"], "tab:green"),
            Level(f"bfloat16 bound ({bounds['bfloat16']:g})", bounds["bfloat16"], "tab:red"),
            *(
                Level(f"honest {p} maximum ({honest[p]:.3f})", max(honest[p], PLOT_FLOOR), colour, ":")
                for p, colour in (("float32", "grey"), ("bfloat16", "orange"))
                if p in honest
            ),
        ],
        title=f"TOPLOC file typical mantissa error under {name}",
        xlabel=xlabel,
        ylabel=f"file typical mantissa error (below {PLOT_FLOOR:g}: on the axis)",
        xscale=xscale,
        yscale="log",
        ylim=(PLOT_FLOOR * 0.8, 10.0),
    )


def _span(pair: list[float], digits: int = 2) -> str:
    return f"{pair[0]:.{digits}f} .. {pair[1]:.{digits}f}"


def print_table(results: list[dict]) -> None:
    print(
        "| configuration | rollouts (chunks) | exponent mismatches | chunk mean | chunk median | file typical "
        "| files rejected: previous / float32 / bfloat16 bounds | Gumbel mismatches (largest gap) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        rej = r["rejected_files"]
        print(
            f"| {r['kind']}: {r['config']} | {r['rollouts']} ({r['chunks']}) | {_span(r['exp'], 0)} | "
            f"{_span(r['mean'])} | {_span(r['median'], 0)} | {_span(r['typical'], 3)} | "
            f"{rej['previous']} / {rej['float32']} / {rej['bfloat16']} of {r['files']} | "
            f"{r['sampling_mismatches']} ({r['max_gap']:.2f}) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="checkpoint (default: the untrained tiny model)"
    )
    parser.add_argument(
        "--other-model",
        type=Path,
        action="append",
        default=[],
        help="another checkpoint a cheater might run (another seed, an older step); repeatable",
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--batches", type=int, default=2, help="files per configuration")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--run-seed", type=int, default=1, help="--honest: the run seed (another seed, other batches)"
    )
    parser.add_argument(
        "--honest",
        type=int,
        default=0,
        help="instead: run this many honest rollouts through the full verifier and count rejections",
    )
    parser.add_argument(
        "--sweep", action="store_true", help="instead: the sensitivity sweep (noise and quantization)"
    )
    parser.add_argument("--plot-dir", type=Path, default=None, help="--sweep: write the curves as PNGs here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory()
    checkpoint = args.model or make_checkpoint(Path(tmp.name) / "ckpt")
    tasks = run_tasks(checkpoint)
    if args.honest:
        summary = honest_run(checkpoint, tasks, args.honest, args.new_tokens, Path(tmp.name), args.run_seed)
        print(json.dumps(summary, indent=2))
        if args.out:
            args.out.write_text(json.dumps(summary, indent=2))
        return
    spec = BatchSpec(
        run_id="calibrate",
        run_seed=1,
        policy_step=0,
        batch_counter=0,
        prompts=args.prompts,
        samples=args.samples,
        temperature=1.0,
        max_new_tokens=args.new_tokens,
    )
    if args.sweep:
        results = sweep(checkpoint, tasks, spec, args.batches, args.plot_dir)
        if args.out:
            args.out.write_text(json.dumps(results, indent=2))
        return
    verifier = load_engine(checkpoint, max_batch_size=16, threads=1)
    results = []
    for kind, name, make, threads in configurations(checkpoint, verifier, args.other_model):
        results.append(run_config(name, kind, make, threads, verifier, tasks, spec, args.batches))
        r = results[-1]
        print(
            f"{kind:6} {name:44} exp {r['exp']} mean {_span(r['mean'])} median {r['median']} typical "
            f"{_span(r['typical'], 3)} rejected {r['rejected_files']} of {r['files']} ({r['seconds']} s)",
            flush=True,
        )
    print_table(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
