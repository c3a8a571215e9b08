"""The validator's peak memory judging Parquet bombs, against the largest legal file and an honest one, in one run.

Usage: .venv/bin/python benchmarks/validator_bombs.py [--honest-prompts P] [--bound-mib B] [--only NAME ...]

Every file is validly signed (a v2 envelope naming the batch its rows claim) and within the validator's file
size limit (64 MiB); each is judged by the validator's own path (trainer/validator/verify_job.py
verify_spooled: signature, schema, limits, then against the checkpoint) in a fresh child process that first
loads the tiny checkpoint and the run's tasks and judges a small honest file once, then starts a new peak at
its present RSS (Linux clear_refs) and judges the file: the figure is that peak above idle, the file's own
bytes included. The bombs are judged by a run of the widest limits a run can set (max_new_tokens 8,192; the
default 4,096 rows, 4 Mi tokens, 128 MiB decompressed), the honest file (generated and proved by the tiny
model, accepted) by a run of 64 new tokens. The largest legal file's 4,096 rows are one sample repeated, so
it is read, decoded and checked up to the identity checks and rejected as `duplicate` before any check
that runs the model: its figure is what reading and decoding the largest file costs, not the prefill (bounded
apart by `verifier.prefill_max_logits_mib`). "expands to" estimates what the reader before issue 18 made of
the file (its Arrow table expanded, then about 44 bytes a token and a copy of every binary value as Python
objects).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from prime_node.node.engine import load_engine
from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.node.run.producer import BatchSpec, produce_rollout_file
from prime_node.node.run.settings import RunSettings, load_run_tasks, verifier_for_run
from prime_node.p2p.identity import Identity
from prime_node.proofs.bounds import proof_size
from prime_node.proofs.rollout_file import encode_rows, sign_bytes, signature_path
from prime_node.proofs.rollout_schema import RolloutRow
from prime_node.proofs.verifier import VerifierSettings
from prime_node.trainer.validator.verify_job import verify_spooled

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import bomb as bombs  # noqa: E402

RUN = "bench"
MiB = 1 << 20
WIDE = 8192  # the largest max_new_tokens a run may set: the bombs' run
NODE = Identity.from_seed(b"\x42" * 32)


# The kernel's resettable peak RSS (VmHWM, reset by clear_refs 5): psutil reads neither, so /proc it is.
def _peak_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _peak_kib()


def child(model: Path, warm: Path, path: Path, max_new_tokens: int) -> None:
    """Judge `path` after a warm-up on `warm`; print the verdict and the peak RSS above idle as JSON."""
    torch.set_num_threads(1)
    engine = load_engine(model, threads=1)
    run = RunSettings(run_id=RUN, run_seed=0, samples=2, max_new_tokens=max_new_tokens)
    tasks = load_run_tasks(run, model)
    settings = verifier_for_run(VerifierSettings(), run)

    def lookup(step: int):  # noqa: ANN202 - the validator's CheckpointKeeper.model_for: step 0 is held
        return (engine, tasks) if step == 0 else None

    verify_spooled(warm, lookup, settings)
    idle = _reset_peak()
    start = time.perf_counter()
    outcome = verify_spooled(path, lookup, settings)
    print(
        json.dumps(
            {
                "accepted": outcome.accepted,
                "hold": outcome.hold,
                "check": outcome.failed_check,
                "reason": outcome.reason,
                "seconds": time.perf_counter() - start,
                "peak_mib": (_peak_kib() - idle) / 1024,
            }
        )
    )


# ----- the files ------------------------------------------------------------------------------------------


def _wide(row: RolloutRow) -> RolloutRow:
    return dataclasses.replace(row, max_new_tokens=WIDE)


def _random_binary(rows: int, each: int, seed: int) -> pa.BinaryArray:
    offsets = np.arange(rows + 1, dtype=np.int32) * np.int32(each)
    data = np.random.default_rng(seed).integers(0, 256, rows * each, dtype=np.uint8)
    return pa.BinaryArray.from_buffers(pa.binary(), rows, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _token_lists(rows: int, each: int, seed: int, vocab: int) -> pa.ListArray:
    offsets = np.arange(rows + 1, dtype=np.int32) * np.int32(each)
    values = np.random.default_rng(seed).integers(2, vocab, rows * each, dtype=np.int32)
    return pa.ListArray.from_arrays(
        pa.array(offsets), pa.array(values), type=bombs.SCHEMA.field("prompt_ids").type
    )


def largest_legal(row: RolloutRow, vocab: int) -> bytes:
    """4,096 rows of 1 prompt + 1,023 output tokens (the 4 Mi token budget, outputs as long as a proof makes them
    cost most), random tokens and proofs of the right size: passes the limits, decoding and the value bounds."""
    rows, output = 4096, 1023
    columns = {
        "prompt_ids": _token_lists(rows, 1, 1, vocab),
        "output_ids": _token_lists(rows, output, 2, vocab),
        "proof": _random_binary(rows, proof_size(output), 3),
        "finish_reason": pa.array(["length"] * rows),
        "target_length": pa.nulls(rows, pa.int32()),
        "length_penalty": pa.array([0.0] * rows),
        "reward": pa.array([row.task_reward] * rows),
    }
    return bombs.parquet(bombs.table(_wide(row), rows, **columns))


def shared_legal(row: RolloutRow) -> bytes:
    """The largest legal file's decoded size from one repeated token and one dictionary proof: a few kB."""
    rows, output = 4096, 1023
    proof = pa.array([b"\x07" * proof_size(output)] * rows, pa.binary())
    return bombs.parquet(
        bombs.table(
            _wide(row),
            rows,
            prompt_ids=bombs._constant_lists(rows, 1),
            output_ids=bombs._constant_lists(rows, output),
            proof=proof,
            finish_reason=pa.array(["length"] * rows),
            target_length=pa.nulls(rows, pa.int32()),
            length_penalty=pa.array([0.0] * rows),
            reward=pa.array([row.task_reward] * rows),
        )
    )


def _compressed(codec: str) -> Callable[[RolloutRow], bytes]:
    def build(row: RolloutRow) -> bytes:
        proof = bombs._zero_values(4096, 32 * 1024)  # 128 MiB of zeros in one PLAIN page
        return bombs.parquet(
            bombs.table(_wide(row), 4096, proof=proof),
            compression=codec,
            use_dictionary=False,
            data_page_size=1 << 30,
            max_rows_per_page=1 << 30,
        )

    return build


# name -> (builder from a row, what the file decodes to in MiB as the old reader expanded it)
BOMBS: dict[str, tuple[Callable[[RolloutRow], bytes], float]] = {
    "constant tokens (4,096 x 16,384)": (
        lambda r: bombs.constant_tokens(_wide(r), 4096, 8192, 8192),
        4096 * 16384 * 44 / MiB,
    ),
    "  the same, unknown step": (
        lambda r: bombs.unknown_step(_wide(r), 4096, 8192, 8192, step=9),
        4096 * 16384 * 44 / MiB,
    ),
    # Within the file's token budget (its prompts take at most 64 tokens a row), all in one row: decoded by
    # Arrow, refused on the row's length before any token becomes a Python object.
    "one row of 3.75 Mi tokens": (
        lambda r: bombs.one_long_row(_wide(r), 4096, 4 * MiB - 4096 * 65),
        3.75 * MiB * 44 / MiB,
    ),
    "dictionary proof (256 x 4 MiB)": (lambda r: bombs.dictionary_proof(_wide(r), 256, 4 * MiB), 2 * 1024.0),
    "prefix-encoded proof (256 x 4 MiB)": (lambda r: bombs.prefix_proof(_wide(r), 256, 4 * MiB), 2 * 1024.0),
    "zstd page (4,096 x 32 KiB zeros)": (_compressed("zstd"), 2 * 128.0),
    "gzip page (4,096 x 32 KiB zeros)": (_compressed("gzip"), 2 * 128.0),
    "brotli page (4,096 x 32 KiB zeros)": (_compressed("brotli"), 2 * 128.0),
    "snappy page (4,096 x 32 KiB zeros)": (_compressed("snappy"), 2 * 128.0),
    "lying footer (1,024 x 32,768 claim 1,024)": (
        lambda r: bombs.lie_in_footer(
            bombs.single_page_tokens(_wide(r), 1024, 16384), {"prompt_ids": 1024, "output_ids": 1024}
        ),
        1024 * 32768 * 44 / MiB,
    ),
    "lying dictionary header (2^28 entries)": (
        lambda r: bombs.lie_in_dictionary_header(encode_rows([_wide(r)] * 8), "proof", 1 << 28),
        (1 << 28) * 16 / MiB,
    ),
    "4,096 row groups (footer)": (lambda r: bombs.many_row_groups(_wide(r), 4096), float("nan")),
    "within the limits, one shared value": (shared_legal, 4 * MiB * 44 / MiB + 4096 * proof_size(1023) / MiB),
}


# The policy step a bomb's rows claim, when not the template's (its envelope signs the same: a sender routes it so).
CLAIMED_STEP = {"  the same, unknown step": 9}


def _signed(path: Path, data: bytes, batch: tuple[int, int]) -> Path:
    """`data` with the v2 envelope a node writes: the batch its rows claim (bombs are never decoded to find it)."""
    path.write_bytes(data)
    signature_path(path).write_text(json.dumps(sign_bytes(data, NODE, batch=batch)))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--honest-prompts", type=int, default=512, help="prompts (x 2 samples) of the honest file"
    )
    parser.add_argument(
        "--bound-mib", type=float, default=512.0, help="the documented bound (peak above idle)"
    )
    parser.add_argument(
        "--only", nargs="*", default=None, help="judge only the files whose names contain these"
    )
    parser.add_argument(
        "--child", nargs=4, metavar=("MODEL", "WARM", "FILE", "MAX_NEW"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        child(Path(args.child[0]), Path(args.child[1]), Path(args.child[2]), int(args.child[3]))
        return
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        save_model_dir(*build_tiny_model(0), model)
        engine = load_engine(model, threads=1)
        tasks = load_run_tasks(RunSettings(run_id=RUN, samples=2), model)
        spec = BatchSpec(
            run_id=RUN,
            run_seed=0,
            policy_step=0,
            batch_counter=0,
            prompts=2,
            samples=2,
            temperature=1.0,
            max_new_tokens=64,
        )
        warm = Path(tmp) / "warm.parquet"
        produce_rollout_file(engine, tasks, NODE, spec, warm)
        honest = Path(tmp) / "honest.parquet"
        started = time.perf_counter()
        batch = produce_rollout_file(
            engine,
            tasks,
            NODE,
            dataclasses.replace(spec, prompts=args.honest_prompts, batch_counter=1),
            honest,
        )
        print(
            f"honest file: {len(batch.rows)} rows produced by the tiny model in "
            f"{time.perf_counter() - started:.0f} s"
        )
        template = batch.rows[0]
        files: list[tuple[str, Path, int, float]] = []
        for i, (name, (build, decoded)) in enumerate(BOMBS.items()):
            if args.only and not any(word in name for word in args.only):
                continue
            claimed = (CLAIMED_STEP.get(name, template.policy_step), template.batch_counter)
            files.append(
                (name, _signed(Path(tmp) / f"bomb{i}.parquet", build(template), claimed), WIDE, decoded)
            )
        tokens = 4 * MiB
        files.append(
            (
                "largest legal file (random)",
                _signed(
                    Path(tmp) / "legal.parquet",
                    largest_legal(template, engine.vocab_size),
                    (template.policy_step, template.batch_counter),
                ),
                WIDE,
                tokens * 44 / MiB + 4096 * proof_size(1023) / MiB,
            )
        )
        honest_tokens = sum(len(r.prompt_ids) + len(r.output_ids) for r in batch.rows)
        files.append(
            (f"honest file ({len(batch.rows)} rows, accepted)", honest, 64, honest_tokens * 44 / MiB)
        )
        print(
            f"{'file':<44} {'on disk':>9} {'expands to':>11} {'verdict':<16} {'time':>7} {'peak above idle':>16}"
        )
        worst_bomb = 0.0
        for name, path, max_new, decoded in files:
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(model), str(warm), str(path), str(max_new)],
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                print(f"{name:<44} child failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            result = json.loads(out.stdout.strip().splitlines()[-1])
            verdict = "accepted" if result["accepted"] else "held" if result["hold"] else result["check"]
            size = path.stat().st_size
            shown = f"{size / 1024:.1f} kB" if size < MiB else f"{size / MiB:.1f} MiB"
            expands = "-" if decoded != decoded else f"{decoded:.1f}"  # NaN: not a decoding bomb
            print(
                f"{name:<44} {shown:>9} {expands:>7} MiB {verdict:<16} {result['seconds']:>6.2f}s "
                f"{result['peak_mib']:>11.1f} MiB"
            )
            if not name.startswith("honest"):
                worst_bomb = max(worst_bomb, result["peak_mib"])
        print(
            f"worst peak above idle over the bombs and the largest legal file: {worst_bomb:.1f} MiB, "
            f"{worst_bomb / args.bound_mib:.2f} x the {args.bound_mib:.0f} MiB bound"
        )


if __name__ == "__main__":
    main()
