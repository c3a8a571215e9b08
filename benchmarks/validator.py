"""Validator throughput against one contributor's generation rate, measured in one run on this machine.

Usage: .venv/bin/python benchmarks/validator.py [--model DIR] [--files N] [--prompts P] [--samples G]
       [--new-tokens T] [--threads K] [--sample-fraction F]

A contributor's rate: producing N assigned batches (generation with hidden-state capture, TOPLOC proofs,
rewards, the signed file). The validator's rate: the service's per-file work after the hand-off, i.e.
every proofs/ check cheapest first against the claimed checkpoint (trainer/validator/verify_job.verify_spooled),
the signed verdict recorded in a real ledger (fsync), and the accepted file copied to the trainer's inbox;
once with every row checked and once with --sample-fraction. The ratio of verified to generated tokens
per second is the number of such contributors one validator (one verification thread) keeps up with.
Hand-off transfer is not included (measured by benchmarks/swarm.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import random
import tempfile
import time
from pathlib import Path

import torch

from prime_node.node.engine import load_engine
from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.node.run.producer import BatchSpec, produce_rollout_file
from prime_node.node.run.settings import RunSettings, load_run_tasks
from prime_node.p2p.identity import Identity
from prime_node.p2p.verdicts import Verdict, sign
from prime_node.proofs.verifier import VerifierSettings
from prime_node.trainer.ledger import Ledger
from prime_node.trainer.validator.spool import Spool, deliver
from prime_node.trainer.validator.verify_job import verify_spooled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="HF model directory (default: embedded tiny model)"
    )
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    parser.add_argument("--sample-fraction", type=float, default=0.25)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = args.model
        if model_dir is None:
            model_dir = root / "model"
            save_model_dir(*build_tiny_model(0), model_dir)
        run = RunSettings(run_id="bench", samples=args.samples)
        engine = load_engine(model_dir, threads=args.threads)
        tasks = load_run_tasks(run, model_dir)
        node, validator = Identity.generate(), Identity.generate()
        spool = Spool(root / "spool")
        spec = BatchSpec(
            run_id="bench",
            run_seed=0,
            policy_step=0,
            batch_counter=0,
            prompts=args.prompts,
            samples=args.samples,
            temperature=1.0,
            max_new_tokens=args.new_tokens,
        )
        start, tokens = time.perf_counter(), 0
        for counter in range(args.files):
            # Files are named as the hand-off spools them, so that verification reads them in place.
            scratch = root / f"out-{counter}.parquet"
            batch = produce_rollout_file(
                engine, tasks, node, dataclasses.replace(spec, batch_counter=counter), scratch
            )
            tokens += sum(len(r.output_ids) for r in batch.rows)
            sha = hashlib.sha256(scratch.read_bytes()).hexdigest()
            scratch.rename(spool.entry(sha, node.node_id).path)
            Path(f"{scratch}.sig").rename(spool.entry(sha, node.node_id).sig_path)
        gen_s = time.perf_counter() - start
        gen_rate = tokens / gen_s
        print(
            f"contributor: {args.files} files, {tokens} tokens in {gen_s:.2f} s = {gen_rate:.1f} tokens/s "
            f"({args.threads} torch thread(s))"
        )
        entries = spool.recover()
        for fraction in (1.0, args.sample_fraction):
            settings = VerifierSettings(
                run_id="bench",
                run_seed=0,
                samples_per_prompt=args.samples,
                temperature=spec.temperature,
                max_new_tokens=spec.max_new_tokens,
                sample_fraction=fraction,
            )
            with Ledger(root / f"ledger-{fraction}.sqlite") as ledger:
                start, verified, accepted, rollouts = time.perf_counter(), 0, 0, 0
                for entry in entries:
                    outcome = verify_spooled(
                        entry.path,
                        lambda step: (engine, tasks),
                        settings,
                        random.Random(1),
                        accepted=ledger.accepted_holder,
                    )
                    verdict = Verdict(
                        file_hash=entry.sha256,
                        node_id=node.node_id,
                        step=outcome.step,
                        samples=outcome.samples,
                        tokens=outcome.tokens,
                        accepted=outcome.accepted,
                        failed_check=outcome.failed_check,
                        reason=outcome.reason,
                        validator_id=validator.node_id,
                        decided_at=time.time(),
                    )
                    ledger.record(sign(verdict, validator), samples=outcome.sample_ids)
                    if outcome.accepted:
                        deliver(entry, root / f"inbox-{fraction}")
                    verified += outcome.tokens
                    rollouts += outcome.samples
                    accepted += outcome.accepted
                seconds = time.perf_counter() - start
            rate = verified / seconds
            print(
                f"validator, sample fraction {fraction:g}: {accepted}/{len(entries)} accepted, "
                f"{rollouts / seconds:.1f} rollouts/s ({len(entries) / seconds:.2f} files/s), {rate:.1f} tokens/s "
                f"verified "
                f"-> one validator serves {rate / gen_rate:.1f} contributors like this one"
            )


if __name__ == "__main__":
    main()
