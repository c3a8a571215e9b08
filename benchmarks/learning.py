"""Learning benchmark: the embedded tiny model, warm-started, trained by the trainer's own components on
rollouts produced by the real engine and accepted by the real verifier; held-out accuracy before and after.

Each step: load the engine from the newest published checkpoint, produce `--files` signed rollout files
exactly as contributors do (assigned tasks, Gumbel sampling, TOPLOC proofs), verify each with the validator's
checks, read them back through the trainer's inbox reader, train one GRPO rollout step with the Learner
(trainer/service/learner.py) and publish the next checkpoint. Held-out accuracy is greedy exact match on problems
never trained on (class HeldOut): the warm start's own evaluation set (`mix`), and with --heldout-filter the
unseen problems of the run's filtered distribution (`band`); with --filter, also the held-out problems whose
prompt text is absent from the training set (`mix-new`, `band-new`). With --heldout-fraction the split is by
content instead: held-out prompts are never trained on, by the warm start or by RL (`-distinct`: each prompt
once). With --eval-samples K every set is also scored by sampled pass@1 at --temperature (`NAME-sampled`).
Everything is seeded (--seed).

    .venv/bin/python benchmarks/learning.py --model DIR --steps 30 --out reward.png
    # the record run, prompts held out by content (docs/trainer.md, "Does it learn?", section 9):
    .venv/bin/python benchmarks/learning.py --sft-steps 250 --heldout-fraction 0.2 --filter 8000 \
        --heldout-filter 8000 --steps 400 --files 1 --prompts 64 --samples 8 --batch-size 192 \
        --optimizer-steps 1 --lr 1e-3 --warmup 5 --negative-weight 0 --decay --min-lr-ratio 0 \
        --eval-every 50 --threads 1 --cpu-minutes 20 --seed 0

`--steps N` is N training steps (one per full batch of mixed-reward groups; the lr decays over them): a
generation round whose groups all had equal rewards trains nothing, and the next round generates again, at most
`--max-rounds` rounds in all (3 x N by default; the summary's `rounds`). Until 2026-12-06 it counted rounds,
so a run recorded before then that had rounds without a full batch trained fewer than N steps.

Without --model the warm start runs first (a few minutes). The PNG is drawn by matplotlib
(trainer/devnet/plot.py); `--summary FILE` keeps its data, and `--replot FILE --out PNG` redraws it without a
run. Prints one line per step and a summary.

Budgets are CPU time, not wall time, so that a run on a shared machine does what it does on an idle one:
`--cpu-minutes M` stops the RL loop once its process CPU time (every thread, and the scoring workers it
started) divided by `--threads` passes M minutes, i.e. M minutes of an idle machine with that many cores;
`--minutes` is an optional wall-clock stop as well. Both are printed per step. Kernels are pinned to AVX2
(`--cpu-kernels`, node/runtime/numerics.py) so that a seed gives the same warm start on every x86-64 machine.

`--env SPEC` runs the same loop on another environment (a reasoning-gym family, say): the warm start trains
on that environment's reference answers (node/models/env_warmstart.py), the filter and the held-out sets
are that environment's, and the environment's scorer grades (exact = reward 1.0).
"""

# ruff: noqa: E402 (the CPU kernels are pinned before torch is imported: the `__main__` block below)
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

if __name__ == "__main__":  # before torch is imported: its CPU kernels are chosen then
    from prime_node.node.runtime.numerics import pin_cpu_kernels

    _early = argparse.ArgumentParser(add_help=False)
    _early.add_argument("--cpu-kernels", default="avx2")
    pin_cpu_kernels(_early.parse_known_args()[0].cpu_kernels)

import psutil
import torch
from matplotlib.figure import Figure
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from prime_node.node.engine import load_engine
from prime_node.node.engine.types import InferenceEngine, SampleRequest, SamplingParams
from prime_node.node.environments import DEFAULT_ENV, open_environment, spec_of_tasks
from prime_node.node.environments.environment import Environment
from prime_node.node.environments.split import ContentSplit
from prime_node.node.environments.types import Task
from prime_node.node.models.env_warmstart import EnvWarmStartConfig, greedy_rewards, init_env_model_dir
from prime_node.node.models.env_warmstart import heldout_tasks as env_heldout_tasks
from prime_node.node.models.warmstart import (
    RUN_INFO_FILE,
    WarmStartConfig,
    greedy_accuracy,
    heldout_tasks,
    init_model_dir,
)
from prime_node.node.run.producer import BatchSpec, produce_rollout_file
from prime_node.node.run.prompts import PromptBuilder
from prime_node.node.run.validation import RunTasks, verify_rollout_file
from prime_node.node.runtime.numerics import describe_cpu_kernels
from prime_node.p2p.identity import Identity
from prime_node.p2p.weights.store import Store
from prime_node.proofs.verifier import VerifierSettings
from prime_node.trainer.devnet.plot import Series, figure, save
from prime_node.trainer.devnet.tasks import TaskFilter, filtered_tasks
from prime_node.trainer.grpo.config import TrainerSettings
from prime_node.trainer.service.batch_buffer import BatchBuffer, RolloutRecord
from prime_node.trainer.service.consumed import ConsumedLedger
from prime_node.trainer.service.inbox import Inbox
from prime_node.trainer.service.learner import Learner

RUN_ID = "learning-bench"


HELDOUT_COLOURS = {
    "mix": "tab:red",
    "band": "tab:green",
    "mix-new": "tab:orange",
    "band-new": "tab:purple",
    "mix-distinct": "tab:orange",
    "band-distinct": "tab:purple",
}


def learning_figure(
    rewards: list[tuple[float, float]],
    accuracy: dict[str, list[tuple[float, float]]],
    sizes: dict[str, int],
    title: str = "RL on the tiny model: rollout reward and held-out greedy accuracy",
) -> Figure:
    """The learning curve: rollout reward per step and each held-out set's greedy accuracy per evaluation."""
    series = [Series("rollout reward (T = 1, before filtering)", rewards, "tab:blue", marker=None)]
    series += [
        Series(f"held-out {name} accuracy ({sizes[name]} problems)", points, HELDOUT_COLOURS.get(name))
        for name, points in accuracy.items()
    ]
    steps = max((x for s in series for x, _ in s.points), default=1.0)
    return figure(
        series,
        title=title,
        xlabel="policy step",
        integer_x=True,
        ylabel="reward / exact-match accuracy",
        xlim=(0.0, max(steps, 1.0)),
        ylim=(0.0, 1.0),
    )


def replot(summary_path: Path, out: Path) -> None:
    """Redraw the curve from a --summary file alone (no model, no run): the plot's data is all in it."""
    summary = json.loads(summary_path.read_text())
    curves = summary["curves"]
    accuracy = {name: [(x, y) for x, y in points] for name, points in curves["heldout"].items()}
    rewards = [(x, y) for x, y in curves["rollout_reward"]]
    title = summary.get("title") or "RL on the tiny model: rollout reward and held-out greedy accuracy"
    print(f"wrote {save(learning_figure(rewards, accuracy, curves['problems'], title), out)}")


class CpuClock:
    """Process CPU time since creation: every thread of this process plus its child processes (the bounded
    scorer's workers), live ones read from /proc and finished ones from the kernel's rusage."""

    def __init__(self) -> None:
        self._start = self.total()

    @staticmethod
    def total() -> float:
        children = 0.0
        for child in psutil.Process().children(recursive=True):
            try:
                times = child.cpu_times()
            except psutil.Error:  # ended between listing and reading: counted by RUSAGE_CHILDREN
                continue
            children += times.user + times.system
        reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + children + reaped.ru_utime + reaped.ru_stime

    def seconds(self) -> float:
        return self.total() - self._start


Scorer = Callable[[torch.nn.Module, object, list[Task], int], tuple[float, dict[int, float]]]


def arithmetic_scorer(
    model, tokenizer, tasks: list[Task], max_new_tokens: int
) -> tuple[float, dict[int, float]]:  # type: ignore[no-untyped-def]
    return greedy_accuracy(model, tokenizer, tasks, max_new_tokens)


def environment_scorer(environment: Environment) -> Scorer:
    """Share of greedy completions the environment scores 1.0 (its partial credit is not a right answer)."""

    def score(model, tokenizer, tasks: list[Task], max_new_tokens: int) -> tuple[float, dict[int, float]]:  # type: ignore[no-untyped-def]
        rewards = greedy_rewards(model, tokenizer, environment, tasks, max_new_tokens)
        return sum(r == 1.0 for r in rewards) / len(rewards), {}

    return score


SAMPLED_EVAL_DOMAIN = b"prime-node/learning-bench/sampled-eval/v1\x00"


def sampled_eval_seed(prompt: str, j: int) -> int:
    """The Gumbel seed of evaluation sample j of `prompt`: the same at every evaluation of every run."""
    digest = hashlib.sha256(SAMPLED_EVAL_DOMAIN + j.to_bytes(4, "big") + prompt.encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def sampled_pass_rates(
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    environment: Environment,
    tasks: list[Task],
    samples: int,
    temperature: float,
    max_new_tokens: int,
) -> dict[str, float]:
    """Per distinct prompt: the share of `samples` completions sampled at `temperature` that the environment
    scores 1.0 (the unbiased estimate of sampled pass@1). Sample j of a prompt is keyed by SHA-256(prompt, j),
    so every evaluation of a run draws the same noise: the difference between two checkpoints is not blurred
    by fresh sampling noise, and a prompt that recurs (or sits in two sets) is sampled once."""
    distinct = list({t.prompt: t for t in tasks}.values())
    prompts_of = PromptBuilder(tokenizer)  # as the run gives prompts to this model
    requests = [
        SampleRequest(prompt_ids=tuple(prompts_of.ids(task.prompt)), seed=sampled_eval_seed(task.prompt, j))
        for task in distinct
        for j in range(samples)
    ]
    completions = engine.generate(requests, SamplingParams(max_new_tokens, temperature), capture_hidden=False)
    rates: dict[str, float] = {}
    for n, task in enumerate(distinct):
        mine = completions[n * samples : (n + 1) * samples]
        texts = [str(tokenizer.decode(list(c.output_ids), skip_special_tokens=True)) for c in mine]
        rates[task.prompt] = sum(environment.score(t, task) == 1.0 for t in texts) / samples
    return rates


class HeldOut:
    """The held-out sets, evaluated by greedy decoding at every evaluation.

    `mix`: the last `eval_size` problems of the environment (for arithmetic, the warm start's own evaluation).
    `band`: with --heldout-filter N, those of the last N problems whose pass@8 with the warm start lies in the
    training band: problems of the run's own (filtered) task distribution, filtered exactly as the training set
    was. Neither is ever trained on (`first_heldout` bounds the training indices).

    With --heldout-fraction F the split is by content (node/environments/split.py): both sets hold only prompts on
    the held-out side, which neither the warm start nor the RL run ever trains on, so they are wholly new.
    Both are drawn as the environment draws them, so an easy prompt recurs (arithmetic level 1: 40 held-out
    prompts for F = 0.2): accuracy on them estimates accuracy on the held-out part of the task distribution.
    `-distinct` counts each prompt once, the measure with the effective sample size.

    With `sampled` (--eval-samples K), every set is also scored by sampled pass@1 at the run's temperature
    (`NAME-sampled`: K seeded samples per prompt, the share the environment scores 1.0): what GRPO optimises,
    where greedy accuracy sees only the mode of each answer distribution.

    Held out by index is not held out by content: the arithmetic family has only 200 distinct level-1 problems
    (and about 16,000 at level 2), so most held-out level-1 prompts also occur among the training problems.
    With a training task file the prompts are known, and `mix-new` / `band-new` are the held-out problems whose
    prompt text is not in it: what the policy never saw, hence the measure of learning that generalises.
    """

    def __init__(
        self,
        sets: dict[str, list[Task]],
        training_prompts: set[str] | None,
        heldout_fraction: float,
        scorer: Scorer,
        max_new_tokens: int,
        threads: int,
        sampled: tuple[Environment, int, float] | None = None,
    ) -> None:
        self.sets = dict(sets)
        self.scorer, self.max_new_tokens, self.threads = scorer, max_new_tokens, threads
        self.sampled = sampled  # (scoring environment, samples per prompt, temperature)
        if heldout_fraction:
            for name in list(self.sets):
                self.sets[f"{name}-distinct"] = list({t.prompt: t for t in self.sets[name]}.values())
        if heldout_fraction and training_prompts is not None:
            seen = sum(t.prompt in training_prompts for tasks in self.sets.values() for t in tasks)
            if seen:  # the split guarantees none; a bug here would inflate every number printed
                raise SystemExit(
                    f"{seen} held-out prompts occur in the training set: the content split is broken"
                )
        elif training_prompts is not None:
            for name in list(self.sets):
                new = [t for t in self.sets[name] if t.prompt not in training_prompts]
                if new:
                    self.sets[f"{name}-new"] = new

    def names(self) -> list[str]:
        return [*self.sets, *(f"{name}-sampled" for name in self.sets if self.sampled)]

    def size(self, name: str) -> int:
        return len(self.sets[name.removesuffix("-sampled")])

    def evaluate(self, checkpoint: Path) -> dict[str, tuple[float, dict[int, float]]]:
        engine = load_engine(checkpoint, threads=self.threads)
        model = engine.model  # type: ignore[attr-defined]
        tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
        results = {
            name: self.scorer(model, tokenizer, tasks, self.max_new_tokens)
            for name, tasks in self.sets.items()
        }
        if self.sampled is not None:
            environment, samples, temperature = self.sampled
            every = [t for tasks in self.sets.values() for t in tasks]
            rates = sampled_pass_rates(
                engine, tokenizer, environment, every, samples, temperature, self.max_new_tokens
            )
            for name, tasks in self.sets.items():
                results[f"{name}-sampled"] = (sum(rates[t.prompt] for t in tasks) / len(tasks), {})
        return results

    def line(self, step: int, results: dict[str, tuple[float, dict[int, float]]]) -> str:
        return f"step {step} held-out " + "; ".join(
            f"{name} ({self.size(name)}) {acc:.3f}" + (f" [{fmt_levels(levels)}]" if levels else "")
            for name, (acc, levels) in results.items()
        )


def task_file_column(path: Path, column: str) -> list[str]:
    """One column of a task file this benchmark wrote (trusted: our own JSONL)."""
    return [json.loads(line)[column] for line in path.read_text().splitlines() if line]


def band_heldout(model_dir: Path, filter_spec: TaskFilter, environment: Environment) -> list[Task]:
    """The held-out problems of the training band (indices given by `filter_spec`), as tasks of `environment`."""
    path, summary = filtered_tasks(model_dir, filter_spec)
    print(f"held-out band: {summary}", flush=True)
    if path is None:
        return []
    return [environment.get(int(index)) for index in task_file_column(path, "source_index")]


def without_heldout(
    record: RolloutRecord, first_heldout: int, tasks: RunTasks, split: ContentSplit
) -> RolloutRecord:
    """The record minus samples of held-out problems, so the evaluation stays honest (never trained on).

    Assignment draws from the whole set, so a held-out index is assigned with probability eval_size / 2^24
    per prompt: rare, but a benchmark that claims held-out accuracy must exclude it rather than hope. Under a
    content split, a prompt on the held-out side is dropped whatever its index (the whole family's prompts
    are assigned when there is no filtered task file).
    """
    kept = tuple(
        s
        for s in record.samples
        if int(s.prompt_key) < first_heldout
        and not split.is_heldout(tasks.environment.get(int(s.prompt_key)).prompt)
    )
    return record if len(kept) == len(record.samples) else replace(record, samples=kept)


def exact_rewards(record: RolloutRecord) -> RolloutRecord:
    """The record with every task reward made 1.0 for a right answer and 0.0 otherwise (--exact-reward).

    Some reasoning-gym families give partial credit that rewards wrong answers: `chain_sum` scores a
    completion containing the right digits len(answer) / len(completion), so "-3" for 3 earns 0.5. In a group
    where nothing is right, the wrong answer with the most credit then gets a positive advantage and is
    trained on. Evaluation counts only scores of 1.0, so training on the same criterion is consistent.
    """
    samples = tuple(replace(s, task_reward=float(s.task_reward == 1.0)) for s in record.samples)
    return replace(record, samples=samples)


def check_warm_start(model_dir: Path, heldout_fraction: float, env: str | None) -> None:
    """A content split means nothing if the warm start trained on the held-out prompts: refuse a --model
    whose warm start used another split or another environment (its prime_node.json records both)."""
    info_path = model_dir / RUN_INFO_FILE
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    if env is not None and info.get("env") != env:
        raise SystemExit(f"{model_dir} was warm-started on {info.get('env')!r}, not {env!r}: omit --model")
    if not heldout_fraction:
        return
    used = info.get("warm_start", {}).get("heldout_fraction", 0.0) if info else None
    if used != heldout_fraction:
        raise SystemExit(
            f"{model_dir} was warm-started with heldout_fraction {used} (from {RUN_INFO_FILE}), not "
            f"{heldout_fraction}: its warm start may have trained on held-out prompts; warm-start "
            "anew (omit --model)"
        )


def fmt_levels(by_level: dict[int, float]) -> str:
    return " ".join(f"L{k} {v:.2f}" for k, v in sorted(by_level.items()))


def git_commit() -> str:
    """The commit the figures come from (with `+dirty` when the tree differs from it): docs cite it."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", type=Path, default=None, help="warm-started model dir (default: warm-start one)"
    )
    p.add_argument(
        "--env",
        default=None,
        help="environment spec (e.g. reasoning_gym:family=count_bits,max_n=255); default: built-in arithmetic",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=30,
        help="training steps (one per full batch; the lr schedule decays over them)",
    )
    p.add_argument(
        "--max-rounds",
        type=int,
        default=None,
        help="bound on generation rounds (default 3 x --steps): a round whose groups all had equal rewards "
        "trains nothing and the next one generates again",
    )
    p.add_argument("--files", type=int, default=2, help="rollout files per step")
    p.add_argument("--prompts", type=int, default=8, help="prompts per file")
    p.add_argument("--samples", type=int, default=8, help="completions per prompt")
    p.add_argument("--lr", type=float, default=TrainerSettings().lr)
    p.add_argument(
        "--batch-size", type=int, default=None, help="samples per step (default: prompts x samples)"
    )
    p.add_argument("--optimizer-steps", type=int, default=TrainerSettings().optimizer_steps_per_batch)
    p.add_argument("--warmup", type=int, default=TrainerSettings().warmup_steps)
    p.add_argument(
        "--decay",
        action="store_true",
        help="decay the lr linearly to --min-lr-ratio over the run's optimizer steps (trainer decay_steps)",
    )
    p.add_argument("--min-lr-ratio", type=float, default=TrainerSettings().min_lr_ratio)
    p.add_argument(
        "--negative-weight",
        type=float,
        default=TrainerSettings().negative_weight,
        help="weight of negative advantages (trainer negative_weight)",
    )
    p.add_argument("--temperature", type=float, default=TrainerSettings().temperature)
    p.add_argument(
        "--exact-reward",
        action="store_true",
        help="train on 1.0 for a right answer and 0.0 otherwise, not on the environment's partial credit",
    )
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument(
        "--sft-steps", type=int, default=WarmStartConfig().steps, help="warm start without --model"
    )
    p.add_argument("--sft-seed", type=int, default=0, help="seed of the tiny model the warm start trains")
    p.add_argument(
        "--filter",
        type=int,
        default=0,
        help="train on the problems among the first N whose pass@8 estimate lies in the band (0: all)",
    )
    p.add_argument("--band", type=float, nargs=2, default=(0.125, 0.875), metavar=("MIN", "MAX"))
    p.add_argument("--eval-size", type=int, default=WarmStartConfig().eval_size)
    p.add_argument(
        "--heldout-filter",
        type=int,
        default=0,
        help="also evaluate on those of the environment's last N problems that lie in the training band",
    )
    p.add_argument(
        "--heldout-fraction",
        type=float,
        default=0.0,
        help="hold out this share of prompt texts by content: never trained on (warm start and RL), "
        "the only ones evaluated (0: held out by index; --env needs one)",
    )
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument(
        "--eval-samples",
        type=int,
        default=0,
        help="also score every held-out set by sampled pass@1 at --temperature, from this many seeded "
        "samples per prompt (`NAME-sampled`; 0: greedy only)",
    )
    p.add_argument(
        "--cpu-minutes",
        type=float,
        default=20.0,
        help="stop the RL loop after this much process CPU time divided by --threads (minutes on that many "
        "idle cores)",
    )
    p.add_argument("--minutes", type=float, default=None, help="also stop after this much wall time")
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch CPU threads for everything but the offline filter (which uses one)",
    )
    p.add_argument(
        "--cpu-kernels",
        default="avx2",
        help="x86-64 kernels to pin before torch loads (node/runtime/numerics.py): avx2 (reproducible "
        "across machines), avx512, default (scalar) or native (no pin)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seeds the node and operator keys (hence the task assignment)"
    )
    p.add_argument("--out", type=Path, default=Path("learning.png"))
    p.add_argument(
        "--summary",
        type=Path,
        default=None,
        help="also write the figures printed at the end as JSON (tests/test_learning_record.py reads it)",
    )
    p.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="SUMMARY",
        help="instead of a run: redraw --out from the curves of a --summary file",
    )
    args = p.parse_args()
    if args.env is not None and not args.heldout_fraction:
        p.error("--env needs --heldout-fraction F (> 0): its held-out prompts are chosen by content")
    return args


def warm_start(args: argparse.Namespace, work: Path, environment: Environment | None) -> Path:
    """The model the run starts from: --model, or a fresh warm start (arithmetic, or --env's own answers)."""
    if args.model is not None:
        return args.model
    model_dir = work / "warm"
    clock = CpuClock()
    if environment is None:
        config = WarmStartConfig(
            steps=args.sft_steps, heldout_fraction=args.heldout_fraction, threads=args.threads
        )
        report, _ = init_model_dir(model_dir, args.sft_seed, config)
        accuracy = report.heldout_accuracy
    else:
        env_config = EnvWarmStartConfig(
            steps=args.sft_steps,
            heldout_fraction=args.heldout_fraction,
            threads=args.threads,
            eval_size=args.eval_size,
        )
        accuracy = init_env_model_dir(model_dir, environment, args.sft_seed, env_config).heldout_exact
    print(
        f"warm start: {args.sft_steps} steps, held-out {accuracy:.3f}, {clock.seconds():.0f} s CPU",
        flush=True,
    )
    return model_dir


def main() -> int:
    args = parse_args()
    if args.replot:
        replot(args.replot, args.out)
        return 0
    begun, whole = time.perf_counter(), CpuClock()  # the whole run: warm start and offline filtering included
    commit = git_commit()  # at the start: the code that ran, whatever is committed while it runs
    torch.set_num_threads(args.threads)
    kernels = describe_cpu_kernels()
    print(f"kernels: {kernels}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="prime-learning-"))
    environment = open_environment(args.env) if args.env is not None else None
    base_env = environment or open_environment(DEFAULT_ENV)
    model_dir = warm_start(args, work, environment)
    check_warm_start(model_dir, args.heldout_fraction, environment and environment.spec)
    # Seeded identities: the node id seeds the task assignment, so a random key would make every run differ.
    operator, node = (
        Identity.from_seed(hashlib.sha256(f"learning-bench/{who}/{args.seed}".encode()).digest())
        for who in ("operator", "node")
    )
    settings = TrainerSettings(
        lr=args.lr,
        warmup_steps=args.warmup,
        batch_size=args.batch_size or args.prompts * args.samples,
        optimizer_steps_per_batch=args.optimizer_steps,
        temperature=args.temperature,
        micro_batch_tokens=256,
        async_level=1,
        kl_coef=0.0,
        negative_weight=args.negative_weight,
        decay_steps=args.steps * args.optimizer_steps if args.decay else 0,
        min_lr_ratio=args.min_lr_ratio,
    )
    store = Store(work / "weights")
    ledger = ConsumedLedger(work / "consumed.sqlite")
    learner = Learner(settings, model_dir, work / "states", store, ledger, operator, RUN_ID)
    learner.resume()
    buffer = BatchBuffer(ledger, batch_size=settings.batch_size, async_level=settings.async_level)
    inbox = Inbox(work / "accepted", RUN_ID)
    low, high = args.band
    env_spec = base_env.spec if environment is not None else DEFAULT_ENV
    task_source = None
    if args.filter:  # offline difficulty filtering, as the devnet does (cached beside the model)
        task_source, summary = filtered_tasks(
            model_dir,
            TaskFilter(
                count=args.filter,
                low=low,
                high=high,
                max_new_tokens=args.max_new_tokens,
                heldout_fraction=args.heldout_fraction,
                env=env_spec,
            ),
        )
        print(f"offline filter: {summary}", flush=True)
    torch.set_num_threads(args.threads)  # the filter's engine ran at one thread
    if environment is None:
        run_spec = spec_of_tasks(task_source and str(task_source))
    else:
        run_spec = f"filtered:{task_source}" if task_source else environment.spec
    tasks = RunTasks(open_environment(run_spec), learner.tokenizer)
    verifier = VerifierSettings(run_id=RUN_ID, run_seed=args.seed, samples_per_prompt=args.samples)
    # A filtered file holds problems of indices below --filter only; otherwise drop the held-out ones.
    held_out_count = max(args.eval_size, args.heldout_filter)
    first_heldout = tasks.task_count if task_source else tasks.task_count - held_out_count
    sets: dict[str, list[Task]]
    if environment is None:
        config = WarmStartConfig(eval_size=args.eval_size, heldout_fraction=args.heldout_fraction)
        sets, scorer, eval_tokens = (
            {"mix": heldout_tasks(config)},
            arithmetic_scorer,
            config.eval_max_new_tokens,
        )
    else:
        env_config = EnvWarmStartConfig(eval_size=args.eval_size, heldout_fraction=args.heldout_fraction)
        sets = {"mix": env_heldout_tasks(environment, env_config)}
        scorer, eval_tokens = environment_scorer(environment), env_config.eval_max_new_tokens
    if args.heldout_filter:
        family_size = len(base_env)
        if args.filter and args.filter > family_size - args.heldout_filter:
            raise SystemExit(
                "--filter and --heldout-filter overlap: the held-out band must lie past the training one"
            )
        band = band_heldout(
            model_dir,
            TaskFilter(
                count=args.heldout_filter,
                low=low,
                high=high,
                max_new_tokens=args.max_new_tokens,
                offset=family_size - args.heldout_filter,
                heldout_fraction=args.heldout_fraction,
                heldout=True,
                env=env_spec,
            ),
            base_env,
        )
        torch.set_num_threads(args.threads)
        if band:
            sets["band"] = band
    training_prompts = set(task_file_column(task_source, "prompt")) if task_source else None
    sampled = (base_env, args.eval_samples, args.temperature) if args.eval_samples else None
    held_out = HeldOut(
        sets, training_prompts, args.heldout_fraction, scorer, eval_tokens, args.threads, sampled
    )
    split = ContentSplit(args.heldout_fraction)
    setup_cpu = whole.seconds()
    rewards: list[tuple[float, float]] = []
    results = held_out.evaluate(model_dir)
    accuracy = {name: [(0.0, acc)] for name, (acc, _) in results.items()}
    print(held_out.line(0, results), flush=True)
    started, rl = time.perf_counter(), CpuClock()
    # CPU and wall time of the held-out evaluations inside the RL loop: counted by the budget, not the cost.
    eval_cpu = eval_wall = 0.0
    # Per evaluation: the RL step and the RL loop's CPU and wall seconds so far, evaluations excluded, so
    # that a run can say what reaching an accuracy cost (benchmarks/synthetic_sft.py reads it).
    timeline: list[tuple[int, float, float]] = [(0, 0.0, 0.0)]

    def rl_minutes() -> float:  # minutes on `threads` idle cores
        return rl.seconds() / args.threads / 60

    raw: list[float] = []  # task reward of every rollout produced since the last step, before filtering
    counter = 0  # the node's batch counter: never reused, or it would regenerate the same (known) file
    stopped_by = "steps"
    # --steps counts training steps, not generation rounds: a round whose groups all had equal rewards fills no
    # batch and trains nothing, and counting those would end the run before the lr schedule (decaying over
    # --steps) reached its end. Rounds are bounded all the same, so a policy that stops producing mixed groups
    # ends the run rather than spinning.
    max_rounds = args.max_rounds if args.max_rounds is not None else 3 * args.steps
    rounds = 0
    while learner.step < args.steps:
        if rounds >= max_rounds:
            stopped_by = "rounds"
            break
        rounds += 1
        ckpt = store.checkpoint_dir(learner.step)
        engine = load_engine(ckpt, threads=args.threads)
        for _ in range(args.files):
            counter += 1
            spec = BatchSpec(
                run_id=RUN_ID,
                run_seed=args.seed,
                policy_step=learner.step,
                batch_counter=counter,
                prompts=args.prompts,
                samples=args.samples,
                temperature=args.temperature,
                max_new_tokens=args.max_new_tokens,
            )
            path = inbox.directory / f"s{learner.step}-b{counter}.parquet"
            produce_rollout_file(engine, tasks, node, spec, path)
            report = verify_rollout_file(path, engine, tasks, verifier)
            if not report.accepted:
                print(f"rejected {path.name}: {report.reasons}", file=sys.stderr)
                continue
            record = inbox.read(path)
            if record is not None:
                record = exact_rewards(record) if args.exact_reward else record
                raw.extend(smp.task_reward for smp in record.samples)
                buffer.add(without_heldout(record, first_heldout, tasks, split), learner.step)
                inbox.mark_done(path)
        batch = buffer.take(learner.step)
        if batch is None:  # groups with all-equal rewards were filtered: generate more before a step
            print(
                f"step {learner.step}: {buffer.buffered_samples} samples waiting for a full batch", flush=True
            )
            continue
        metrics = batch.reward_metrics()
        summary = learner.train(batch).summary()
        learner.save_and_publish(keep_states=1, keep_versions=2)
        buffer.commit(batch)
        raw_reward = sum(raw) / max(len(raw), 1)
        raw.clear()
        rewards.append((learner.step, raw_reward))
        print(
            f"step {learner.step} rollout reward {raw_reward:.3f} batch reward {metrics['task_reward']:.3f} "
            f"groups {metrics['groups']:.0f} clip {summary['clip_fraction']:.3f} |g| {summary['grad_norm']:.3f} "
            f"H {summary['entropy']:.3f} ({time.perf_counter() - started:.0f} s wall, "
            f"{rl_minutes():.2f} CPU min on {args.threads} threads)",
            flush=True,
        )
        if rl_minutes() > args.cpu_minutes:
            stopped_by = "cpu-minutes"
        elif args.minutes is not None and time.perf_counter() - started > 60 * args.minutes:
            stopped_by = "minutes"
        last = stopped_by != "steps" or learner.step >= args.steps
        if learner.step % args.eval_every == 0 or last:
            before, began = rl.seconds(), time.perf_counter()
            timeline.append((learner.step, before - eval_cpu, began - started - eval_wall))
            results = held_out.evaluate(store.checkpoint_dir(learner.step))
            eval_cpu, eval_wall = eval_cpu + rl.seconds() - before, eval_wall + time.perf_counter() - began
            for name, (acc, _) in results.items():
                accuracy[name].append((float(learner.step), acc))
            print(held_out.line(learner.step, results), flush=True)
        if stopped_by != "steps":
            break
    if learner.step and accuracy and next(iter(accuracy.values()))[-1][0] != learner.step:
        # The last iterations trained nothing (every group's rewards were equal: waiting for a full batch),
        # so the in-loop evaluation missed the final policy: "after" must be the policy the run ended with.
        results = held_out.evaluate(store.checkpoint_dir(learner.step))
        for name, (acc, _) in results.items():
            accuracy[name].append((float(learner.step), acc))
        print(held_out.line(learner.step, results), flush=True)
    ledger.close()
    sizes = {name: held_out.size(name) for name in held_out.names()}
    title = "RL on the tiny model: rollout reward and held-out greedy accuracy" + (
        f"\n{args.env}" if args.env else ""
    )
    save(learning_figure(rewards, accuracy, sizes, title), args.out)
    for name, points in accuracy.items():
        first, last_acc = points[0][1], points[-1][1]
        print(
            f"held-out {name} ({held_out.size(name)} problems) accuracy {first:.3f} -> {last_acc:.3f} "
            f"({100 * (last_acc - first):+.1f} points, best {max(a for _, a in points):.3f})"
        )
    rl_wall, rl_cpu = time.perf_counter() - started, rl.seconds()
    if args.summary:
        window = max(1, min(40, len(rewards) // 2))
        args.summary.write_text(
            json.dumps(
                {
                    "command": shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                    "commit": commit,
                    "env": args.env or DEFAULT_ENV,
                    "title": title,
                    "kernels": kernels,
                    "threads": args.threads,
                    "cpus_available": len(os.sched_getaffinity(0)),
                    "load_average_1min_at_end": os.getloadavg()[0],
                    "steps": learner.step,
                    "stopped_by": stopped_by,
                    "rounds": rounds,
                    "setup_cpu_s": setup_cpu,
                    "rl_wall_s": rl_wall,
                    "rl_cpu_s": rl_cpu,
                    "rl_cpu_minutes": rl_cpu / args.threads / 60,
                    "eval_cpu_s": eval_cpu,
                    "eval_wall_s": eval_wall,
                    "evaluations": [
                        {"step": step, "rl_cpu_s": cpu, "rl_wall_s": wall} for step, cpu, wall in timeline
                    ],
                    "total_wall_s": time.perf_counter() - begun,
                    "total_cpu_s": whole.seconds(),
                    "rollout_reward": {
                        "first": sum(r for _, r in rewards[:window]) / window if rewards else None,
                        "last": sum(r for _, r in rewards[-window:]) / window if rewards else None,
                        "window": window,
                    },
                    "heldout": {
                        name: {
                            "problems": held_out.size(name),
                            "first": points[0][1],
                            "last": points[-1][1],
                            "best": max(a for _, a in points),
                        }
                        for name, points in accuracy.items()
                    },
                    # What the plot draws, so that --replot can redraw it without a run.
                    "curves": {"rollout_reward": rewards, "heldout": accuracy, "problems": sizes},
                },
                indent=2,
            )
            + "\n"
        )
    print(
        f"{learner.step} steps in {rounds} rounds (stopped by {stopped_by}), RL: {rl_wall:.0f} s wall, "
        f"{rl_cpu:.0f} s CPU "
        f"({rl_cpu / args.threads / 60:.2f} min on {args.threads} threads); in all (warm start and filter "
        f"included): {time.perf_counter() - begun:.0f} s wall, {whole.seconds():.0f} s CPU; learning curve -> "
        f"{args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
