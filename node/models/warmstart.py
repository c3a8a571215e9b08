"""Warm start: a short supervised fine-tune of the tiny model on the built-in arithmetic family.

RL needs signal: a freshly initialised model never answers correctly, so GRPO would see only zero-advantage
groups. A few hundred SFT steps bring held-out exact-match accuracy into the 20-60% band, which leaves room
for RL to show a rise. The run is deterministic for a given (model seed, config, torch build, thread count):
data order is fixed by the task seed, there is no dropout, and torch's deterministic algorithms are on.
Problems are drawn from index 0 upwards; held-out problems are the last `eval_size` indices of the set, so
they are never trained on by index (at the easy levels the same expression recurs: there are only 200
distinct level-1 problems). With `heldout_fraction` the split is by content (node/environments/split.py): held-out
prompts are skipped in training and only they are evaluated.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from pydantic import BaseModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..environments.split import ContentSplit
from ..environments.types import Task
from ..environments.verifier import get_verifier
from ..errors import ModelError
from ..run.prompts import PromptBuilder
from ..runtime import disk
from ..runtime.disk import free_bytes
from ..runtime.progress import progress_bar
from .chat_corpus import CORPUS_VERSION
from .sft_loop import SftLoop, SftRecipe
from .tiny import TinyModelShape, build_tiny_model, save_model_dir
from .warmstart_config import WarmStartConfig

logger = logging.getLogger(__name__)
IGNORE_INDEX = -100  # label value that transformers' causal-LM loss skips (prompt and padding positions)
RUN_INFO_FILE = "prime_node.json"
WEIGHTS_FILE = "model.safetensors"


class WarmStartReport(BaseModel):
    """What a warm start did and how well the result answers held-out problems."""

    steps: int
    final_loss: float | None  # mean loss over the last 20 steps; None without training
    heldout_accuracy: float  # exact-match reward averaged over the held-out problems, greedy decoding
    accuracy_by_level: dict[int, float]
    eval_size: int
    train_seconds: float
    eval_seconds: float
    cpu_seconds: float  # process CPU time (all threads) of training plus evaluation


@contextmanager
def deterministic_torch(threads: int) -> Iterator[None]:
    """Fixed thread count and deterministic kernels for the block; the previous global state is restored."""
    previous_threads = torch.get_num_threads()
    previous_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous_deterministic)
        torch.set_num_threads(previous_threads)


def _encode_batch(
    tokenizer: PreTrainedTokenizerBase, prompts_of: PromptBuilder, tasks: Sequence[Task]
) -> dict[str, torch.Tensor]:
    """Right-padded prompt+answer+EOS sequences whose labels cover only the answer and its EOS. Prompts are
    as a run gives them to this model (node/run/prompts.py): the task text itself, or, for a model with a
    chat template, that text in a user turn followed by an open assistant turn."""
    prompts = [prompts_of.ids(t.prompt) for t in tasks]
    answers = tokenizer([t.answer for t in tasks], add_special_tokens=False)["input_ids"]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    sequences = [[*p, *a, eos] for p, a in zip(prompts, answers)]
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(tasks), width), pad, dtype=torch.long)
    labels = torch.full((len(tasks), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(tasks), width), dtype=torch.long)
    for row, (prompt, seq) in enumerate(zip(prompts, sequences)):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(prompt) : len(seq)] = torch.tensor(seq[len(prompt) :])
        attention[row, : len(seq)] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def _training_problems(config: WarmStartConfig) -> Iterator[Task]:
    """Problems in index order from 0, minus held-out prompts under a content split; enough for every step."""
    tasks = config.train_tasks()
    needed = config.steps * config.batch_size
    if not config.heldout_fraction:
        train_limit = len(tasks) - config.eval_size
        if needed > train_limit:
            raise ModelError(f"warm start needs {needed} training problems; the set has {train_limit}")
        return (tasks.get(i) for i in range(needed))
    # No length check: the family has 2^24 problems and a content split removes only a share of them.
    return ContentSplit(config.heldout_fraction).trainable(tasks)


def train(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: WarmStartConfig, progress: bool
) -> float | None:
    """Supervised training in place; returns the mean loss of the last 20 steps (None when steps == 0)."""
    problems = _training_problems(config)
    prompts_of = PromptBuilder(tokenizer)
    loop = SftLoop(model, SftRecipe.of(config))
    batches = (
        _encode_batch(tokenizer, prompts_of, [next(problems) for _ in range(config.batch_size)])
        for _ in range(config.steps)
    )
    with progress_bar(config.steps, "warm start", "step", enabled=progress) as bar:

        def shown(done: SftLoop) -> None:
            bar.update(1)
            if (done.step - 1) % 10 == 0 or done.step == config.steps:
                bar.set_postfix(loss=f"{done.mean_loss:.3f}")

        return loop.run(batches, shown)


@torch.no_grad()
def _greedy_same_length(
    model: PreTrainedModel, input_ids: torch.Tensor, max_new_tokens: int, eos: int
) -> list[list[int]]:
    """Greedy continuation of equal-length prompts (no padding needed), cut after the first EOS."""
    outputs: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    step_input, past = input_ids, None
    for _ in range(max_new_tokens):
        result = model(input_ids=step_input, past_key_values=past, use_cache=True)
        past = result.past_key_values
        next_ids = result.logits[:, -1, :].argmax(dim=-1)
        for row, token in enumerate(next_ids.tolist()):
            if not done[row]:
                outputs[row].append(token)
        done |= next_ids == eos
        if bool(done.all()):
            break
        step_input = next_ids[:, None]
    return outputs


def greedy_complete(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 256,
) -> list[str]:
    """Greedy completions (special tokens dropped), batched by prompt length so that nothing is padded."""
    encoded = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(encoded):
        by_length[len(ids)].append(i)
    texts = [""] * len(prompts)
    model.eval()
    for members in by_length.values():
        for start in range(0, len(members), batch_size):
            chunk = members[start : start + batch_size]
            input_ids = torch.tensor([encoded[i] for i in chunk], dtype=torch.long)
            for i, ids in zip(
                chunk, _greedy_same_length(model, input_ids, max_new_tokens, tokenizer.eos_token_id)
            ):
                texts[i] = str(tokenizer.decode(ids, skip_special_tokens=True))  # one sequence: one string
    return texts


def evaluate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: WarmStartConfig
) -> tuple[float, dict[int, float]]:
    """Held-out exact-match accuracy (overall, and per difficulty level) by greedy decoding."""
    return greedy_accuracy(model, tokenizer, heldout_tasks(config), config.eval_max_new_tokens)


def heldout_tasks(config: WarmStartConfig) -> list[Task]:
    """The evaluation problems: the last eval_size indices, or under a content split the last eval_size
    problems whose prompts are held out (never trained on by the warm start nor by a run using the split)."""
    tasks = config.eval_tasks()
    if not config.heldout_fraction:
        return [tasks.get(i) for i in range(len(tasks) - config.eval_size, len(tasks))]
    scan = min(len(tasks), int(config.eval_size / config.heldout_fraction * 4) + 1000)
    found = ContentSplit(config.heldout_fraction).heldout_from_end(tasks, config.eval_size, scan)
    if len(found) < config.eval_size:
        raise ModelError(
            f"only {len(found)} held-out problems among the last {scan}; raise heldout_fraction or lower eval_size"
        )
    return found


def greedy_accuracy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tasks: Sequence[Task], max_new_tokens: int
) -> tuple[float, dict[int, float]]:
    """Exact-match accuracy of greedy answers to `tasks` (overall, and per difficulty level)."""
    if not tasks:
        raise ModelError("no tasks to evaluate")
    prompts_of = PromptBuilder(tokenizer)  # the run's format (raw text or the chat template), as in training
    completions = greedy_complete(
        model, tokenizer, [prompts_of.text(t.prompt) for t in tasks], max_new_tokens
    )
    rewards = [get_verifier(t.task_type)(c, t.answer) for t, c in zip(tasks, completions)]
    per_level: dict[int, list[float]] = defaultdict(list)
    for task, reward in zip(tasks, rewards):
        per_level[task.difficulty].append(reward)
    by_level = {level: sum(r) / len(r) for level, r in sorted(per_level.items())}
    return sum(rewards) / len(rewards), by_level


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    config: WarmStartConfig | None = None,
    *,
    progress: bool = False,
) -> WarmStartReport:
    """Train `model` in place on the arithmetic family, then measure held-out accuracy."""
    config = config or WarmStartConfig()
    with deterministic_torch(config.threads):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        final_loss = train(model, tokenizer, config, progress)
        wall1 = time.perf_counter()
        accuracy, by_level = evaluate(model, tokenizer, config)
        wall2, cpu2 = time.perf_counter(), time.process_time()
    logger.info(
        "warm start: %d steps, loss %s, held-out accuracy %.1f%%", config.steps, final_loss, 100 * accuracy
    )
    return WarmStartReport(
        steps=config.steps,
        final_loss=final_loss,
        heldout_accuracy=accuracy,
        accuracy_by_level=by_level,
        eval_size=config.eval_size,
        train_seconds=wall1 - wall0,
        eval_seconds=wall2 - wall1,
        cpu_seconds=cpu2 - cpu0,
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ModelError(f"{out_dir} exists and is not a directory; choose another --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ModelError(
            f"{out_dir} is not empty; choose another --out or pass --force to overwrite its model files"
        )


# Beyond the weights: safetensors' header, the tokenizer (29 kB for the chat BPE), configs, prime_node.json.
FILES_MARGIN_BYTES = 1024**2


def _check_free_disk(out_dir: Path, model: PreTrainedModel) -> None:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    needed = weights + FILES_MARGIN_BYTES
    free = free_bytes(out_dir.parent)
    if free < needed:
        raise ModelError(
            f"not enough free disk for the model in {out_dir}: {disk.describe(free)} free on "
            f"{disk.existing_ancestor(out_dir.parent)}, {disk.describe(needed)} needed; free space or choose "
            "another --out"
        )


def init_model_dir(
    out_dir: Path,
    seed: int,
    config: WarmStartConfig | None = None,
    *,
    force: bool = False,
    progress: bool = False,
    chat: bool = False,
) -> tuple[WarmStartReport, dict[str, object]]:
    """Build the tiny model from `seed`, warm-start it and save it as an HF directory with prime_node.json.

    The files are written to a temporary sibling directory and moved into place only when complete, so an
    interrupted init never leaves a half-written model behind. With `force`, files of the same names in a
    non-empty `out_dir` are replaced and other files are left alone. Returns the report and the run info
    (the contents of prime_node.json, which are deterministic: no timings). `chat`: the model with the BPE
    tokenizer and chat template of chat_tokenizer.py, warm-started on prompts in its chat format.
    """
    config = config or WarmStartConfig()
    out_dir = Path(out_dir).expanduser()
    _check_out_dir(out_dir, force)
    model, tokenizer = build_tiny_model(seed, TinyModelShape(), chat=chat)
    _check_free_disk(out_dir, model)  # before the training, not in safetensors after it
    report = warm_start(model, tokenizer, config, progress=progress)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        save_model_dir(model, tokenizer, staging)
        info: dict[str, object] = {
            "format": 1,
            "seed": seed,
            "sft_steps": config.steps,
            "task_seed": config.task_seed,
            "heldout_accuracy": report.heldout_accuracy,
            "accuracy_by_level": {str(k): v for k, v in report.accuracy_by_level.items()},
            "eval_size": report.eval_size,
            "final_loss": report.final_loss,
            "warm_start": config.model_dump(mode="json"),
            "model_sha256": file_sha256(staging / WEIGHTS_FILE),
            "torch_version": torch.__version__,
        }
        if chat:  # only then: the default model's prime_node.json stays byte for byte what it was
            info["chat"] = {
                "corpus": CORPUS_VERSION,
                "vocab_size": len(tokenizer),
                "tokenizer_sha256": file_sha256(staging / "tokenizer.json"),
                "prompt_format": PromptBuilder(tokenizer).prompt_format,
            }
        (staging / RUN_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        _check_out_dir(out_dir, force)  # again: something may have appeared while we trained
        if not out_dir.exists():
            os.replace(staging, out_dir)
        else:
            for item in sorted(staging.iterdir()):
                os.replace(item, out_dir / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return report, info
