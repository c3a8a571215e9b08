"""The devnet's tasks: those of the run's environment the genesis model can learn from, filtered once and cached.

INTELLECT-2's offline difficulty filtering (node/environments/difficulty.py, `prime-node tasks filter`): each of the
first `count` tasks of the environment (the built-in arithmetic problems by default) gets 8 samples from the
genesis model, and those it solves 1 to 4 times in 8 are kept. Problems it always or never solves give groups
with equal rewards, which the trainer discards after they cost a generation; on the full mix that is most of
them, and a few dozen steps show no trend. The file is named after the model's weights and the filter's
parameters, so a rebuilt model gets a new one; every party of the run (trainer, validator, contributors) is
given the same file with `--env filtered:FILE`, which reopens those tasks of the environment, scored by it.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

from ...node.environments import DEFAULT_ENV, Environment, open_environment
from ...node.environments.difficulty import in_band, write_task_file
from ...node.environments.split import ContentSplit
from ...node.runtime.progress import progress_bar

WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class TaskFilter:
    count: int = (
        1200  # tasks estimated (indices 0..count-1): about 140 built-in problems kept for the default model
    )
    k: int = 8
    low: float = 0.125
    high: float = 0.5
    max_new_tokens: int = 16  # the answers are at most 5 characters; a sample that runs on is wrong anyway
    # First index estimated: a held-out set, filtered the same way, starts past the training one.
    offset: int = 0
    # A content split (node/environments/split.py): with heldout_fraction > 0 only the problems on one side of it
    # are estimated, the trainable ones, or with `heldout` the held-out ones (benchmarks/learning.py).
    heldout_fraction: float = 0.0
    heldout: bool = False
    env: str = DEFAULT_ENV  # the run's environment spec (opened with the run's default task seed, 0)

    def selected_indices(self, environment: Environment) -> list[int]:
        indices = range(self.offset, min(self.offset + self.count, len(environment)))
        if not self.heldout_fraction:
            return list(indices)
        split = ContentSplit(self.heldout_fraction)
        return [i for i in indices if split.is_heldout(environment.get(i).prompt) == self.heldout]

    def describe(self) -> str:
        where = f"the first {self.count}" if not self.offset else f"the {self.count}"
        what = "built-in problems" if self.env == DEFAULT_ENV else f"tasks of {self.env}"
        side = ""
        if self.heldout_fraction:
            side = f" ({'held-out' if self.heldout else 'trainable'} side of a {self.heldout_fraction:g} content split)"
        return f"{where} {what}{'' if not self.offset else f' from index {self.offset}'}{side}"


def task_file_for(model_dir: Path, spec: TaskFilter) -> Path:
    """Named after the weights and the filter's parameters: a rebuilt model or another band gets a new file."""
    digest = hashlib.sha256((model_dir / WEIGHTS_FILE).read_bytes() + repr(spec).encode()).hexdigest()[:16]
    return model_dir.parent / f"{model_dir.name}-tasks-{digest}.jsonl"


def filtered_tasks(model_dir: Path, spec: TaskFilter, *, progress: bool = False) -> tuple[Path | None, str]:
    """The cached task file for this model (built when missing), or None when no problem is in the band;
    with a one-line summary for the operator. `progress`: a bar on stderr while the problems are estimated
    (a minute or two on 2 cores; node/runtime/progress.py)."""
    out = task_file_for(model_dir, spec)
    if out.is_file():
        return out, f"tasks: {out.name} (cached)"
    from transformers import AutoTokenizer  # imports torch: only when the file has to be built

    from ...node.engine import load_engine
    from ...node.environments.difficulty import estimate_pass_rates

    started = time.perf_counter()
    engine = load_engine(model_dir, threads=1, max_batch_size=128)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    environment = open_environment(spec.env)
    indices = spec.selected_indices(environment)
    with progress_bar(len(indices), "filtering tasks", "task", enabled=progress) as bar:
        estimates = estimate_pass_rates(
            engine,
            tokenizer,
            environment,
            indices,
            k=spec.k,
            max_new_tokens=spec.max_new_tokens,
            tasks_per_batch=128 // spec.k,
            progress=bar.update,
        )
    kept = in_band(estimates, spec.low, spec.high)
    took = time.perf_counter() - started
    if not kept:
        return None, (
            f"tasks: no problem of {spec.describe()} is solved {spec.low:g}-{spec.high:g} of "
            f"the time by this model ({took:.0f} s); using the whole "
            + ("built-in set" if spec.env == DEFAULT_ENV else spec.env)
        )
    write_task_file(out, kept, environment)
    return out, (
        f"tasks: kept {len(kept)} of {spec.describe()}, those the model solves "
        f"{round(spec.low * spec.k)} to {round(spec.high * spec.k)} times in {spec.k} ({took:.0f} s) -> {out.name}"
    )
