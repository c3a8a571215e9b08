"""`prime-node dataset build`: a synthetic run's accepted work -> one dataset directory.

    rows.parquet        every verified sample (rows.py ROW_SCHEMA)
    sft.parquet         its correct rows within the SFT bands (subsets.py)
    preference.parquet  (correct, incorrect) pairs per prompt
    difficulty.parquet  n, correct, mean reward, pass rate and pass@k per task and annotating model
    difficulty/<model>.parquet  the same per model, as a task file `--env filtered:FILE` opens
    verdicts.parquet    the signed verdict of every file a row comes from (verdict_id -> envelope)
    dataset.json        the build's parameters and counts;  README.md  the dataset card (card.py)

Written into a temporary directory beside the target and renamed into place, so a crash leaves no half
dataset. Everything here blocks (disk, tokenizer): the CLI calls it directly.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ...node.environments import Environment
from ...node.environments.filtered import FilteredEnvironment
from ...node.run.settings import RunSettings, open_run_environment
from ...p2p.errors import P2PError
from ...p2p.weights.store import Store
from .card import FILES, render_card
from .difficulty import Outcome, TaskDifficulty, annotate
from .errors import DatasetError
from .rows import ROW_SCHEMA, dataset_rows
from .settings import DatasetSection
from .sources import accepted_files
from .subsets import PAIR_COLUMNS, preference_pairs, sft_rows

logger = logging.getLogger(__name__)

ROWS_FILE = FILES["rows"]
META_FILE = "dataset.json"


@dataclass(frozen=True)
class BuildResult:
    out: Path
    meta: dict[str, Any]


def _require(value: Any, flag: str) -> Any:
    if value is None or value == []:
        raise DatasetError(f"dataset build needs {flag}")
    return value


class _Checkpoints:
    """Manifest digests and the tokenizer of the run's published checkpoints, read once per step."""

    def __init__(self, store: Store, operator_key: str) -> None:
        self.store, self.key = store, operator_key
        self.digests: dict[int, str] = {}
        self._decode: Callable[[list[int]], str] | None = None

    def digest(self, step: int) -> str:
        if step not in self.digests:
            try:
                self.digests[step] = self.store.load_manifest(step, self.key).digest
            except (OSError, P2PError) as exc:
                raise DatasetError(
                    f"checkpoint of policy step {step} in {self.store.root}: {exc} (give the trainer's "
                    "weights directory and the operator key that signs its manifests)"
                ) from None
        return self.digests[step]

    def decoder(self, step: int) -> Callable[[list[int]], str]:
        if self._decode is None:
            from transformers import AutoTokenizer

            self.digest(step)  # its manifest verifies before its tokenizer is loaded
            where = self.store.checkpoint_dir(step)
            try:
                tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True)
            except (OSError, ValueError) as exc:
                raise DatasetError(f"cannot load the tokenizer of {where}: {exc}") from None
            self._decode = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))
        return self._decode


def _outcomes(rows: Sequence[Mapping[str, Any]]) -> list[Outcome]:
    return [Outcome(r["model"], r["task_index"], r["task_reward"], r["correct"]) for r in rows]


def annotation_outcomes(annotations: Sequence[str], environment_pin: str) -> list[Outcome]:
    """The verified rows of other dataset directories (`LABEL=DIR`), relabelled LABEL."""
    out: list[Outcome] = []
    labels: set[str] = set()
    for spec in annotations:
        label, _, where = spec.partition("=")
        if label in labels:
            raise DatasetError(f"--annotation names the model {label!r} twice")
        labels.add(label)
        path = Path(where).expanduser() / ROWS_FILE
        try:
            table = pq.read_table(path, columns=["environment", "task_index", "task_reward", "correct"])
        except (OSError, pa.ArrowException) as exc:
            raise DatasetError(f"--annotation {label}: cannot read {path}: {exc}") from None
        envs = set(table.column("environment").to_pylist())
        if envs - {environment_pin}:
            raise DatasetError(
                f"--annotation {label}: {path} holds rows of environment {sorted(envs)[0]!r}, not this run's "
                f"{environment_pin!r}: annotate with runs of the same environment"
            )
        for index, reward, correct in zip(
            table.column("task_index").to_pylist(),
            table.column("task_reward").to_pylist(),
            table.column("correct").to_pylist(),
            strict=True,
        ):
            out.append(Outcome(label, int(index), float(reward), bool(correct)))
    return out


def _task_file_rows(
    difficulty: Sequence[TaskDifficulty], environment: Environment, ks: Sequence[int]
) -> list[dict[str, Any]]:
    """Rows of a task file `filtered:FILE` opens (node/environments/filtered.py), with the difficulty columns."""
    origin: Callable[[int], int] = lambda index: index  # noqa: E731
    source = environment
    if isinstance(environment, FilteredEnvironment):
        origin, source = environment.source_index, environment.source
    out = []
    for d in difficulty:
        task = environment.get(d.task_index)
        out.append(
            {
                "prompt": task.prompt,
                "answer": task.answer,
                "task_type": task.task_type,
                "metadata": task.metadata,
                "source": source.spec,
                "source_index": origin(d.task_index),
                **d.columns(ks),
            }
        )
    return out


def _write(table_rows: Sequence[Mapping[str, Any]], path: Path, schema: pa.Schema | None = None) -> None:
    if schema is not None:
        table = pa.Table.from_pylist(list(table_rows), schema=schema)
    elif table_rows:
        table = pa.Table.from_pylist(list(table_rows))
    else:
        table = pa.table({})
    pq.write_table(table, path)


def _pairs_schema() -> pa.Schema:
    ids = pa.list_(pa.int32())
    types = {"task_index": pa.int64(), "prompt_ids": ids, "chosen_ids": ids, "rejected_ids": ids}
    types |= {"chosen_reward": pa.float64(), "rejected_reward": pa.float64()}
    return pa.schema([pa.field(c, types.get(c, pa.string())) for c in PAIR_COLUMNS])


def _difficulty_schema(ks: Sequence[int]) -> pa.Schema:
    fields = [("model", pa.string()), ("task_index", pa.int64()), ("n", pa.int64()), ("correct", pa.int64())]
    fields += [("mean_reward", pa.float64()), ("pass_rate", pa.float64())]
    fields += [(f"pass_at_{k}", pa.float64()) for k in ks]
    return pa.schema(fields)


_VERDICTS_SCHEMA = pa.schema(
    [
        ("verdict_id", pa.string()),
        ("file_sha256", pa.string()),
        ("producer", pa.string()),
        ("validator_id", pa.string()),
        ("step", pa.int64()),
        ("samples", pa.int64()),
        ("decided_at", pa.float64()),
        ("envelope", pa.string()),  # the signed verdict as JSON: p2p/verdicts.py open_signed checks it
    ]
)


def build_dataset(
    run: RunSettings, section: DatasetSection, out: Path, *, force: bool = False
) -> BuildResult:
    """Build the dataset directory `out` (module docstring); DatasetError naming what is wrong."""
    ledgers = _require(section.ledgers, "--ledger (the validator's ledger.sqlite)")
    accepted_dir = _require(section.accepted_dir, "--accepted-dir (the trainer's accepted/ inbox)")
    weights_dir = _require(section.weights_dir, "--weights-dir (the trainer's published checkpoints)")
    trusted = frozenset(
        _require(section.validator_keys, "--validator-key (a trusted validator's public key)")
    )
    operator = _require(section.operator_key, "--operator-key (the key that signs the checkpoint manifests)")
    out = Path(out).expanduser().resolve()
    if out.exists() and any(out.iterdir()) and not force:
        raise DatasetError(f"{out} exists and is not empty; choose another --out or pass --force")
    model = section.model_label or run.run_id
    environment = open_run_environment(run)
    files, report = accepted_files(ledgers, Path(accepted_dir).expanduser(), trusted, run.run_id)
    checkpoints = _Checkpoints(Store(Path(weights_dir).expanduser()), operator)
    steps = sorted({a.verdict.document.step for a in files})
    decode = checkpoints.decoder(steps[0]) if steps else (lambda ids: "")
    rows, duplicates = dataset_rows(
        files,
        environment,
        decode,
        checkpoints.digest,
        model=model,
        correct_threshold=section.correct_threshold,
    )
    ks = section.pass_k
    annotated = _outcomes(rows) + annotation_outcomes(section.annotations, environment.identity.pin)
    difficulty = annotate(annotated, ks)
    band_model = section.band_model or model
    solve_rates = {d.task_index: d.pass_rate for d in difficulty if d.model == band_model}
    if not any(d.model == band_model for d in difficulty) and section.band_model is not None:
        raise DatasetError(
            f"--band-model {band_model!r} annotated no task (models: {model} and --annotation)"
        )
    sft = sft_rows(rows, section.sft, solve_rates)
    pairs = preference_pairs(rows)
    verdicts = {
        a.verdict_id: {
            "verdict_id": a.verdict_id,
            "file_sha256": a.verdict.document.file_hash,
            "producer": a.verdict.document.node_id,
            "validator_id": a.verdict.document.validator_id,
            "step": a.verdict.document.step,
            "samples": a.verdict.document.samples,
            "decided_at": a.verdict.document.decided_at,
            "envelope": a.verdict.to_json().decode(),
        }
        for a in files
    }
    meta = {
        "format": "prime-node/dataset/v1",
        "run": {**run.model_dump(mode="json"), "env": run.env_spec},
        "environment": environment.identity.pin,
        "model": model,
        "checkpoints": {str(s): checkpoints.digest(s) for s in steps},
        "correct_threshold": section.correct_threshold,
        "pass_k": ks,
        "band_model": band_model,
        "sft_bands": section.sft.model_dump(),
        "annotators": sorted({d.model for d in difficulty}),
        "counts": {
            "accepted_files": len(files),
            "rows": len(rows),
            "correct": sum(1 for r in rows if r["correct"]),
            "tasks": len({r["task_index"] for r in rows}),
            "sft": len(sft),
            "preference_pairs": len(pairs),
            "difficulty": len(difficulty),
            "duplicate_samples_left_out": duplicates,
        },
        "skipped": dict(report.skipped),
    }
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "difficulty").mkdir(parents=True)
    try:
        _write(rows, tmp / FILES["rows"], ROW_SCHEMA)
        _write(sft, tmp / FILES["sft"], ROW_SCHEMA)
        _write(pairs, tmp / FILES["preference"], _pairs_schema())
        _write([d.columns(ks) for d in difficulty], tmp / FILES["difficulty"], _difficulty_schema(ks))
        for label in sorted({d.model for d in difficulty}):
            mine = [d for d in difficulty if d.model == label]
            _write(_task_file_rows(mine, environment, ks), tmp / "difficulty" / f"{label}.parquet")
        _write(list(verdicts.values()), tmp / FILES["verdicts"], _VERDICTS_SCHEMA)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        (tmp / "README.md").write_text(render_card(meta))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("dataset %s: %s", out, meta["counts"])
    return BuildResult(out, meta)
