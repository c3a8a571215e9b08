"""Pipelined generation: throughput with and without micro-batching against one node, the validator's cost of a
group against a monolithic rollout, and the evidence for the boundary thresholds (docs/pipeline.md).

Usage: .venv/bin/python benchmarks/pipeline.py [--model DIR] [--delay-ms 20] [--samples 16] [--new-tokens 32]
       [--micro-batch 4] [--batches 3] [--threads 1] [--skip-calibration] [--throughput-only] [--hidden N]

Throughput: one batch of --samples prompts, --new-tokens tokens each, generated (a) by HFEngine in one process,
(b) by a 2-stage group (layers [0, L/2, L]) over TCP on 127.0.0.1 with --delay-ms injected one-way latency per
hop and the whole batch as one micro-batch, (c) the same group with micro-batches of --micro-batch. Wall-clock
tokens/s, ratios, and the frames whose flight overlapped another micro-batch's compute, all from this run.
Validator cost: process CPU seconds of verify_group (one hooked prefill, every boundary's TOPLOC check, Gumbel
replay) against the monolithic core (one prefill, TOPLOC check of the final states, Gumbel replay) on the
same tokens. Regroup: a 2-stage group formed by trainer/groups/formation.py loses its last stage mid-batch;
the survivors regroup with a spare node, rerun the batch and the validator verifies it: seconds from the kill
to the verdict (4 samples x 8 tokens; in one process, no DHT). Calibration: per boundary, the worst honest
TOPLOC statistics (micro-batch sizes 1, 2, 4, 8) and the typical error of one stage's weights perturbed
by 1e-4 and 1e-3, against the bounds in use.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from prime_node.node.engine.hf import HFEngine  # noqa: E402
from prime_node.node.engine.types import SamplingParams  # noqa: E402
from prime_node.node.models.tiny import TinyModelShape  # noqa: E402
from prime_node.node.pipeline.boundaries import BoundaryOracle  # noqa: E402
from prime_node.node.pipeline.driver import run_loopback  # noqa: E402
from prime_node.node.pipeline.group import HopSettings, overlapped_flights, run_group  # noqa: E402
from prime_node.p2p.pipeline.layout import StageLayout  # noqa: E402
from prime_node.proofs.gumbel import gumbel_noise, perturbed_scores  # noqa: E402
from prime_node.proofs.pipeline.blame import BlameThresholds, GroupWork, _rows, verify_group  # noqa: E402
from prime_node.proofs.toploc import build_proofs, check_proof, check_proofs, typical_mant_err_mean  # noqa: E402

from support.pipeline import group, identities, random_requests, regroup_after_a_kill, save_tiny  # noqa: E402
from support.pipeline_attacks import perturb_stage_  # noqa: E402


def throughput(model_dir: Path, engine: HFEngine, args: argparse.Namespace) -> None:
    requests = random_requests(args.samples, seed=1)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    layers = engine.model.config.num_hidden_layers
    boundaries = [0, layers // 2, layers]
    engine = HFEngine(engine.model, max_batch_size=args.samples)  # one node batches them all at once
    # Warm-up outside the timings: first-call costs (TOPLOC's field tables, torch kernels) would land on
    # whichever configuration runs first.
    build_proofs([torch.randn(4, engine.model.config.hidden_size)])
    engine.generate(requests[:2], SamplingParams(max_new_tokens=2, temperature=1.0), capture_hidden=False)
    start = time.monotonic()
    reference = engine.generate(requests, params, capture_hidden=False)
    mono_s = time.monotonic() - start
    tokens = sum(len(c.output_ids) for c in reference)
    rows = [("monolithic (one node, no hops)", mono_s, None)]
    variants = (
        ("2-stage, one micro-batch", args.samples, True),
        (f"2-stage, micro-batches of {args.micro_batch}", args.micro_batch, True),
        ("  same, no commitments: one micro-batch", args.samples, False),
        (f"  same, no commitments: micro-batches of {args.micro_batch}", args.micro_batch, False),
    )
    for label, size, commit in variants:
        spec, processors, ids = group(
            model_dir,
            boundaries,
            requests,
            params,
            micro_batch_size=size,
            eos_token_id=engine.eos_token_id,
            pad_token_id=engine.pad_token_id,
            commit=commit,
        )
        start = time.monotonic()
        run = asyncio.run(run_group(spec, processors, ids, HopSettings(delay_s=args.delay_ms / 1000)))
        elapsed = time.monotonic() - start
        same = [c.output_ids for c in run.completions] == [c.output_ids for c in reference]
        rows.append(
            (f"{label}{'' if same else ' (OUTPUTS DIFFER)'}", elapsed, overlapped_flights(run.runners))
        )
    print(
        f"\n== throughput: {args.samples} samples x {args.new_tokens} tokens, {args.delay_ms} ms per hop =="
    )
    for label, seconds, overlap in rows:
        extra = "" if overlap is None else f"   frames in flight during other compute: {overlap}"
        print(f"{label:40s} {tokens / seconds:8.1f} tok/s  ({seconds:.2f} s){extra}")
    print(
        f"micro-batching / one micro-batch: {rows[1][1] / rows[2][1]:.2f}x with commitments, "
        f"{rows[3][1] / rows[4][1]:.2f}x without; "
        f"micro-batched group / monolithic: {mono_s / rows[2][1]:.2f}x (token-for-token identical outputs)"
    )


def validator_cost(model_dir: Path, engine: HFEngine, args: argparse.Namespace) -> None:
    requests = random_requests(args.samples, seed=2)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    print(f"\n== validator CPU seconds per batch ({args.samples} samples x {args.new_tokens} tokens) ==")
    for boundaries in ([0, 2, 4], [0, 1, 2, 3, 4]):
        spec, processors, ids = group(
            model_dir,
            boundaries,
            requests,
            params,
            micro_batch_size=args.micro_batch,
            eos_token_id=engine.eos_token_id,
            pad_token_id=engine.pad_token_id,
        )
        completions, records = run_loopback(spec, processors, ids)
        work = GroupWork(
            [r.prompt_ids for r in requests],
            [r.seed for r in requests],
            1.0,
            args.new_tokens,
            engine.eos_token_id,
            args.micro_batch,
        )
        oracle = BoundaryOracle(engine.model, spec.layout)
        start = time.process_time()
        verdict = verify_group(spec, records, work, oracle)
        group_s = time.process_time() - start
        assert verdict.accepted, verdict.reason
        sequences = [list(c.prompt_ids) + list(c.output_ids) for c in completions]
        keep = [len(c.prompt_ids) - 1 for c in completions]
        committed = [p.hidden_states for p in engine.prefill(sequences, keep)]
        proofs = build_proofs(committed)  # the node's side, not timed
        start = time.process_time()
        prefilled = engine.prefill(sequences, keep)
        check_proofs(proofs, [p.hidden_states for p in prefilled])
        for c, p in zip(completions, prefilled, strict=True):
            n = len(c.output_ids)
            seeds = torch.full((n,), c.seed, dtype=torch.int64)
            perturbed_scores(
                p.logits[:n], 1.0, gumbel_noise(seeds, torch.arange(n), p.logits.shape[-1])
            ).argmax(-1)
        mono_s = time.process_time() - start
        print(
            f"{len(boundaries) - 1} stages: group {group_s:.3f} s, monolithic core {mono_s:.3f} s, "
            f"ratio {group_s / mono_s:.2f}x"
        )


def regroup(model_dir: Path, engine: HFEngine, args: argparse.Namespace) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    seconds, verdict, _, _ = regroup_after_a_kill(model_dir, engine, params, identities(4, salt=40))
    print(
        f"\n== regroup: last stage killed mid-batch, survivors regrouped, batch rerun over TCP at "
        f"20 ms per hop and verified ==\nfrom the kill to the validator's verdict ({verdict.reason}): {seconds:.2f} s"
    )


def calibration(model_dir: Path, engine: HFEngine, args: argparse.Namespace) -> None:
    boundaries = [0, 1, 2, 3, 4] if engine.model.config.num_hidden_layers == 4 else None
    layout = StageLayout(
        boundaries=boundaries
        or [0, engine.model.config.num_hidden_layers // 2, engine.model.config.num_hidden_layers]
    )
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    oracle = BoundaryOracle(engine.model, layout)
    bounds = BlameThresholds()
    print(f"\n== boundary calibration ({args.batches} batches of {args.samples} per configuration) ==")
    inner = bounds.inner
    print(
        "boundary  config          max exp-mismatch  max chunk mean  typical mean (bounds: "
        f"{inner.max_exp_mismatches}, {inner.max_mant_err_mean}, {inner.max_typical_mant_err_mean})"
    )
    configs: list[tuple[str, int, int | None, float]] = [
        (f"honest mb={m}", m, None, 0.0) for m in (1, 2, 4, 8)
    ]
    configs += [(f"stage {k} x{rel:g}", 4, k, rel) for rel in (1e-4, 1e-3) for k in range(layout.stages)]
    for label, micro, stage, relative in configs:
        worst: dict[int, tuple[int, float, float]] = {}
        for batch in range(args.batches):
            requests = random_requests(args.samples, seed=500 + batch)
            spec, processors, ids = group(
                model_dir,
                layout.boundaries,
                requests,
                params,
                micro_batch_size=micro,
                eos_token_id=engine.eos_token_id,
                pad_token_id=engine.pad_token_id,
            )
            if stage is not None:
                perturb_stage_(processors[stage], relative, batch)
            _, records = run_loopback(spec, processors, ids)
            work = GroupWork(
                [r.prompt_ids for r in requests],
                [r.seed for r in requests],
                1.0,
                args.new_tokens,
                engine.eos_token_id,
                micro,
            )
            outputs = records[-1].record.outputs
            recomputed = oracle.prefill(
                [list(p) + list(o) for p, o in zip(work.prompts, outputs, strict=True)]
            )
            for k in range(layout.stages):
                stats = []
                for header in records[k].record.sent.headers:
                    if header.kind in ("prefill", "decode"):
                        states = torch.cat(
                            [recomputed[r].states[k][s] for r, s in _rows(header, work, outputs)]
                        )
                    elif header.kind == "tokens":
                        states = torch.stack(
                            [
                                recomputed[r].states[-1][len(work.prompts[r]) - 1 + header.step]
                                for r in header.rows
                            ]
                        )
                    else:
                        continue
                    stats += check_proof(bytes.fromhex(header.commitment or ""), states)
                entry = (
                    max(s.exp_mismatches for s in stats),
                    max(s.mant_err_mean for s in stats),
                    typical_mant_err_mean(stats),
                )
                old = worst.get(k + 1, (0, 0.0, 0.0))
                worst[k + 1] = (
                    (max(old[0], entry[0]), max(old[1], entry[1]), max(old[2], entry[2]))
                    if stage is None
                    else (
                        max(old[0], entry[0]),
                        max(old[1], entry[1]),
                        entry[2] if batch == 0 else min(old[2], entry[2]),
                    )
                )
        for j, (mismatch, chunk_mean, typical) in sorted(worst.items()):
            name = f"{j}" if j < layout.stages else f"{j} (final)"
            print(f"{name:9s} {label:15s} {mismatch:16d}  {chunk_mean:14.3f}  {typical:12.3f}")
    print(
        "(honest rows: worst over batches; perturbed rows: the smallest typical error over batches, i.e. the "
        "perturbation's hardest case, at and after the perturbed stage)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="HF model dir (default: the embedded tiny model)"
    )
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-calibration", action="store_true")
    parser.add_argument("--throughput-only", action="store_true")
    parser.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="width of a wider embedded model (MLP 3x), to make compute weigh",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        shape = (
            TinyModelShape(hidden_size=args.hidden, intermediate_size=3 * args.hidden)
            if args.hidden
            else None
        )
        model_dir = args.model or save_tiny(Path(tmp), shape=shape)
        engine = HFEngine.load(model_dir, dtype="float32", max_batch_size=args.micro_batch)
        throughput(model_dir, engine, args)
        if args.throughput_only:
            return
        validator_cost(model_dir, engine, args)
        regroup(model_dir, engine, args)
        if not args.skip_calibration:
            calibration(model_dir, engine, args)


if __name__ == "__main__":
    main()
