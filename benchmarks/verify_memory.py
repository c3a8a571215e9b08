"""A validator's peak memory on one large rollout file: prefill calls reduced one by one, against every row's
prefill held until the last check (what verification did before proofs/evidence.py), measured in one run.

Usage: .venv/bin/python benchmarks/verify_memory.py [--prompts P] [--samples G] [--new-tokens T] [--repeats R]

One honest file of P x G rows is produced by the embedded tiny model; each verification runs in a fresh
child process (peak RSS is a process-lifetime figure) that first loads everything, then verifies; the
figure is the growth of the peak during verification (0 when verification never needed more than the
process had already used while loading). "held" sets the call bounds so high that one call
prefills every row, which holds all their logits at once as the old per-file retention did.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from prime_node.node.engine import load_engine
from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.node.run.producer import BatchSpec, produce_rollout_file
from prime_node.node.run.settings import RunSettings, load_run_tasks
from prime_node.node.run.validation import verify_rollout_file
from prime_node.p2p.identity import Identity
from prime_node.proofs.verifier import VerifierSettings

SPEC = BatchSpec(
    run_id="bench",
    run_seed=0,
    policy_step=0,
    batch_counter=0,
    prompts=512,
    samples=2,
    temperature=1.0,
    max_new_tokens=40,
)
HELD = {"prefill_batch_size": 10**6, "prefill_max_logits_mib": 10**6}


def child(model: Path, path: Path, samples: int, mode: str) -> None:
    """Verify `path` once and print peak-RSS growth (MiB) and CPU seconds as JSON."""
    torch.set_num_threads(1)
    engine = load_engine(model, threads=1)
    tasks = load_run_tasks(RunSettings(run_id="bench", samples=samples), model)
    settings = VerifierSettings(
        run_id="bench", run_seed=0, samples_per_prompt=samples, **(HELD if mode == "held" else {})
    )
    path.read_bytes()  # the file in the page cache and nothing else new before the baseline
    before, started = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.process_time()
    report = verify_rollout_file(path, engine, tasks, settings, rng=random.Random(0))
    print(
        json.dumps(
            {
                "accepted": report.accepted,
                "cpu_s": time.process_time() - started,
                "peak_growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=SPEC.prompts)
    parser.add_argument("--samples", type=int, default=SPEC.samples)
    parser.add_argument("--new-tokens", type=int, default=SPEC.max_new_tokens)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "FILE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(Path(args.child[0]), Path(args.child[1]), args.samples, args.child[2])
        return
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model, path = Path(tmp) / "model", Path(tmp) / "big.parquet"
        save_model_dir(*build_tiny_model(0), model)
        spec = dataclasses.replace(
            SPEC, prompts=args.prompts, samples=args.samples, max_new_tokens=args.new_tokens
        )
        engine = load_engine(model, threads=1)
        batch = produce_rollout_file(
            engine,
            load_run_tasks(RunSettings(run_id="bench", samples=args.samples), model),
            Identity.generate(),
            spec,
            path,
        )
        tokens = sum(len(r.prompt_ids) + len(r.output_ids) for r in batch.rows)
        kept = sum(len(r.output_ids) + 1 for r in batch.rows)  # returned from each prompt's last token on
        per_token = (
            engine.vocab_size + int(engine.head.weight.shape[1])
        ) * 4  # float32 logits + hidden states
        longest = sorted((len(r.output_ids) + 1 for r in batch.rows), reverse=True)
        call = sum(longest[: VerifierSettings().prefill_batch_size])
        print(
            f"file: {len(batch.rows)} rows, {tokens} prefilled tokens ({kept} positions returned), vocabulary "
            f"{engine.vocab_size}, {path.stat().st_size / 2**20:.1f} MiB on disk; prefill outputs (logits + "
            f"states) of every row {kept * per_token / 2**20:.1f} MiB, of the largest default call "
            f"{call * per_token / 2**20:.1f} MiB"
        )
        results: dict[str, list[dict]] = {"bounded": [], "held": []}
        for _ in range(args.repeats):  # alternating, so load on the machine hits both alike
            for mode in results:
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--samples",
                        str(args.samples),
                        "--child",
                        str(model),
                        str(path),
                        mode,
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
        for mode, runs in results.items():
            assert all(r["accepted"] for r in runs), f"{mode}: the honest file was rejected"
            print(
                f"{mode:>7}: peak RSS growth {min(r['peak_growth_mib'] for r in runs):7.1f} MiB, "
                f"CPU {min(r['cpu_s'] for r in runs):.2f} s (best of {len(runs)})"
            )
        held, bounded = (min(r[k] for r in results[m]) for m, k in (("held", "cpu_s"), ("bounded", "cpu_s")))
        print(f"held / bounded CPU time: {held / bounded:.2f}x")


if __name__ == "__main__":
    main()
