"""Accepted rollout files for the trainer-service tests: produced by the real engine, accepted by the real
verifier, and dropped into the trainer's inbox the way the validator's `deliver` does (signature first)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from prime_node.node.engine import load_engine
from prime_node.node.environments import open_environment
from prime_node.node.run.producer import BatchSpec, produce_rollout_file
from prime_node.node.run.validation import RunTasks, verify_rollout_file
from prime_node.p2p.identity import Identity
from prime_node.proofs.rollout_file import read_rollout_file, signature_path
from prime_node.proofs.verifier import VerifierSettings
from prime_node.trainer.grpo.advantages import group_advantages
from prime_node.trainer.service.inbox import record_from_rows

RUN_ID = "svc-test"
# Length targets give completions of one prompt different rewards even when none is correct (the untrained
# tiny model solves nothing), so groups carry signal and the online filter keeps them.
LENGTH_TARGETS = (3, 9, 17)
LENGTH_ALPHA = 0.02


def run_tasks(checkpoint: Path) -> RunTasks:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    return RunTasks(
        open_environment("arithmetic"), tokenizer, length_targets=LENGTH_TARGETS, length_alpha=LENGTH_ALPHA
    )


def every_group_informative(path: Path) -> bool:
    """Whether every prompt's group in the file has rewards that differ, so the trainer's online filter keeps
    it (a group whose completions all score the same carries no GRPO signal and is dropped)."""
    verified = read_rollout_file(path)
    record = record_from_rows(verified.sha256, verified.rows)
    groups: dict[str, list[float]] = {}
    for sample in record.samples:
        groups.setdefault(sample.prompt_key, []).append(sample.reward)
    return all(group_advantages(rewards).informative for rewards in groups.values())


def make_accepted_files(
    checkpoint: Path,
    step: int,
    count: int,
    staging: Path,
    *,
    first_counter: int = 0,
    prompts: int = 2,
    samples: int = 3,
    max_new_tokens: int = 12,
    node: Identity | None = None,
    informative: bool = False,
) -> list[Path]:
    """`count` rollout files of policy `step`, each verified (all rows) before it is kept; staged, not delivered.
    A given `node` identity makes the files reproducible (its id seeds the assignment and the sampling).
    `informative` keeps only files whose every group survives the trainer's zero-advantage filter (the
    sampling is random, so an untrained model sometimes gives one prompt identical rewards): a test that
    expects an exact number of training steps needs that, trying at most ten batches per file kept."""
    engine = load_engine(checkpoint, threads=1)
    tasks = run_tasks(checkpoint)
    node = node or Identity.generate()
    verifier = VerifierSettings(run_id=RUN_ID, run_seed=0, samples_per_prompt=samples)
    out: list[Path] = []
    for counter in range(first_counter, first_counter + 10 * count if informative else first_counter + count):
        spec = BatchSpec(
            run_id=RUN_ID,
            run_seed=0,
            policy_step=step,
            batch_counter=counter,
            prompts=prompts,
            samples=samples,
            temperature=1.0,
            max_new_tokens=max_new_tokens,
        )
        path = staging / f"file-{step}-{counter}.parquet"
        produce_rollout_file(engine, tasks, node, spec, path)
        report = verify_rollout_file(path, engine, tasks, verifier)
        assert report.accepted, report.reasons
        if informative and not every_group_informative(path):
            path.unlink()
            signature_path(path).unlink()
            continue
        out.append(path)
        if len(out) == count:
            return out
    raise AssertionError(f"only {len(out)} of {count} files had a reward spread in every group")


def deliver(path: Path, inbox: Path) -> str:
    """Move a staged file into the inbox as <sha256>.parquet, signature first; returns the SHA-256."""
    sha = read_rollout_file(path).sha256
    inbox.mkdir(parents=True, exist_ok=True)
    os.replace(signature_path(path), inbox / f"{sha}.parquet.sig")
    os.replace(path, inbox / f"{sha}.parquet")
    return sha


def trainer_argv(model: Path, key: Path, data_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "prime_node.node.cli.main",
        "trainer",
        "--model",
        str(model),
        "--key",
        str(key),
        "--data-dir",
        str(data_dir),
        "--run-id",
        RUN_ID,
        "--threads",
        "1",
        "--http-port",
        "0",
        "--metrics-port",
        "0",  # a free port: the default one is fixed (docs/metrics.md) and tests run side by side
        "--batch-size",
        "6",
        "--log-level",
        "INFO",
        *extra,
    ]


def trainer_env() -> dict[str, str]:
    # Two optimizer steps per rollout step, tiny packed rows, no warmup: a step takes well under a second.
    return {
        **os.environ,
        "PRIME_NODE_TRAINER__MICRO_BATCH_TOKENS": "128",
        "PRIME_NODE_TRAINER__WARMUP_STEPS": "0",
        "OMP_NUM_THREADS": "1",
    }


def start_trainer(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as err:
        return subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=err, env=trainer_env(), start_new_session=True
        )


def read_ready(proc: subprocess.Popen[bytes], log: Path, timeout: float = 120.0) -> dict:
    """The trainer's ready line (JSON on stdout)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    os.set_blocking(proc.stdout.fileno(), False)
    buf = b""
    while time.monotonic() < deadline:
        chunk = proc.stdout.read()
        if chunk:
            buf += chunk
            if b"\n" in buf:
                return json.loads(buf.split(b"\n", 1)[0])
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"trainer not ready (rc {proc.poll()}):\n{log.read_text()[-4000:]}")
