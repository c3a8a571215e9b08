"""Pipeline stage files: their size against a rollout file of the same rows, and what reading and judging them
costs the validator (process CPU seconds, one torch thread), from one run.

    .venv/bin/python benchmarks/stage_files.py [--prompts 4] [--samples 4] [--new-tokens 32] [--stages 2]
                                               [--honest-batches N]

With --honest-batches N it also runs N more honest batches (other batch numbers, so other assigned problems and
seeds) and counts the files the judgement rejects: false rejections, which must be 0.

The group runs in one process (node/pipeline/driver.py) over the tiny embedded model; the files are what each
member writes (node/pipeline/rollouts.py), the judgement is the validator service's (trainer/validator/group_job.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from prime_node.node.engine.hf import HFEngine  # noqa: E402
from prime_node.node.models.tiny import build_tiny_model  # noqa: E402
from prime_node.node.run.settings import RunSettings  # noqa: E402
from prime_node.p2p.pipeline.layout import StageLayout  # noqa: E402
from prime_node.proofs.pipeline.stage_file import read_stage_file  # noqa: E402
from prime_node.proofs.rollout_file import read_rollout_file, write_rollout_file  # noqa: E402
from prime_node.trainer.validator.group_job import Delivery, verify_group_files  # noqa: E402

from support.attack import make_checkpoint, run_tasks  # noqa: E402
from support.pipeline import identities  # noqa: E402
from support.pipeline_files import group_files  # noqa: E402


def _cpu(fn):  # noqa: ANN001, ANN202
    start = time.process_time()
    result = fn()
    return result, time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--stages", type=int, default=2, choices=(2, 4))
    parser.add_argument("--honest-batches", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    boundaries = [0, 2, 4] if args.stages == 2 else [0, 1, 2, 3, 4]
    run = RunSettings(
        run_id="bench",
        run_seed=1,
        samples=args.samples,
        max_new_tokens=args.new_tokens,
        # The batch's shape is the run's (the validator refuses files of another).
        pipeline=StageLayout(boundaries=boundaries, prompts=args.prompts, micro_batch_size=4),
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        checkpoint = make_checkpoint(out / "model")
        tasks, engine = run_tasks(checkpoint), HFEngine(build_tiny_model(0)[0], max_batch_size=16)
        members = identities(args.stages, salt=90)
        files = group_files(out / "files", checkpoint, run, tasks, engine, members)
        parsed = [read_stage_file(p) for p in files.paths]  # warm-up (first-call costs)
        reads = [_cpu(lambda p=p: read_stage_file(p))[1] for p in files.paths]
        last = parsed[-1]
        v2 = out / "mono.parquet"
        write_rollout_file(v2, list(last.rows), members[-1])
        read_rollout_file(v2)
        _, v2_read = _cpu(lambda: read_rollout_file(v2))
        deliveries = [Delivery(p, m.node_id) for p, m in zip(files.paths, members, strict=True)]

        def lookup(step: int):  # noqa: ANN202
            return engine, tasks

        verify_group_files(deliveries, run, run.pipeline, lookup, complete=True)  # warm-up
        result, judge = _cpu(lambda: verify_group_files(deliveries, run, run.pipeline, lookup, complete=True))
        assert all(o.accepted for o in result.outcomes.values()), result.outcomes
        rows = len(last.rows)
        tokens = sum(len(r.output_ids) for r in last.rows)
        print(f"{args.stages} stages, {rows} samples, {tokens} output tokens, micro-batches of 4")
        for k, path in enumerate(files.paths):
            print(f"  stage {k} file: {path.stat().st_size} bytes; read {reads[k] * 1e3:.1f} ms CPU")
        print(
            f"  rollout file (v2) of the last stage's rows: {v2.stat().st_size} bytes; read {v2_read * 1e3:.1f} ms CPU"
        )
        sizes = [p.stat().st_size for p in files.paths]
        print(f"  stage files / rollout file: {sum(sizes) / v2.stat().st_size:.2f}x in all")
        print(
            f"  group judgement (every file read, work derived, verify_group, last-stage proofs): {judge:.3f} s CPU"
        )
        rejected, rollouts = 0, 0
        for batch in range(1, args.honest_batches + 1):
            more = group_files(
                out / f"b{batch}",
                checkpoint,
                run,
                tasks,
                engine,
                members,
                batch=batch,
            )
            deliveries = [Delivery(p, m.node_id) for p, m in zip(more.paths, members, strict=True)]
            judged = verify_group_files(deliveries, run, run.pipeline, lookup, complete=True)
            rollouts += args.prompts * args.samples
            for o in judged.outcomes.values():
                if not o.accepted:
                    rejected += 1
                    print(f"  batch {batch}: rejected ({o.failed_check}: {o.reason[:160]})")
        if args.honest_batches:
            print(
                f"  honest: {args.honest_batches} more batches, {rollouts} rollouts, {rejected} files rejected"
            )


if __name__ == "__main__":
    main()
