"""The devnet's cheaters: each attack of the proofs issue's threat list as a batch producer.

An attack takes the same inputs as an honest contributor's `produce_rollout_file` (the engine of the
verified checkpoint, the run's tasks, the node's identity, the assigned batch) and writes a signed file
that lies about the work in one specific way. They live in the devnet harness only: production nodes
never load this module. Each docstring names the check that should catch it (docs/proofs.md).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from ...node.engine import HFEngine, InferenceEngine
from ...node.models.tiny import TinyModelShape, build_tiny_model
from ...node.run.producer import BatchSpec, ProducedBatch, produce_rows
from ...node.run.validation import RunTasks
from ...p2p.identity import Identity
from ...proofs.rollout_file import batch_of, encode_rows, sign_bytes, signature_path
from ...proofs.rollout_schema import RolloutRow
from ...proofs.toploc import build_proof, committed_rows
from ..errors import TrainerError

EOS_ID = 1  # the byte-level tokenizer's <eos> (node/models/tokenizer.py)
PERTURBATION = 5e-2  # relative weight noise on one layer: the example, far above the toploc threshold
OTHER_SEED = 1_000_003  # the init seed of the "other-seed" cheater's model (any seed but the claimed model's)
INT_BITS = 4  # the "int4" cheater's weight precision
WRONG_TEMPERATURE = 0.5  # sampled cooler than the run's temperature, which the rows still claim
# One layer and a narrow MLP (the width stays >= the proofs' top-k of 128, so its own proofs could be built).
SMALL_SHAPE = TinyModelShape(intermediate_size=128, num_hidden_layers=1)

Rows = list[RolloutRow]


class AttackError(TrainerError):
    pass


def _engine_of(engine: InferenceEngine) -> HFEngine:
    if not isinstance(engine, HFEngine):
        raise AttackError("the devnet's attacks need the transformers engine (run the adversary on the CPU)")
    return engine


def _reprove(engine: HFEngine, row: RolloutRow) -> RolloutRow:
    """The row with an honest proof (by prefill on `engine`) for whatever tokens it now holds."""
    hidden = engine.prefill([list(row.prompt_ids) + list(row.output_ids)])[0].hidden_states
    proof = build_proof(hidden[committed_rows(len(row.prompt_ids), len(row.output_ids))])
    return dataclasses.replace(row, proof=proof)


def _rescore(tasks: RunTasks, row: RolloutRow, output_ids: list[int]) -> RolloutRow:
    """The row with new output tokens and the rewards they honestly earn (so only the tokens lie)."""
    task_reward, penalty, target = tasks.rewards_for(row.sample_index, row.sample_seed, output_ids)
    return dataclasses.replace(
        row,
        output_ids=type(row.output_ids)(output_ids),
        task_reward=task_reward,
        length_penalty=penalty,
        reward=task_reward - penalty,
        target_length=target,
    )


# The model these attacks change in place, returned as the type it came in (a transformers model stays one).
ModelT = TypeVar("ModelT", bound=torch.nn.Module)


def perturb_layer_(
    model: ModelT, relative_noise: float, generator: torch.Generator, layer: int | None = None
) -> ModelT:
    """Multiply every parameter of one decoder layer (the middle one by default) by (1 + noise * N(0, 1)),
    in place: a cheaper, stale or tampered copy of the claimed weights."""
    decoder: Any = model.model  # a transformers causal LM's decoder, whose layers are a ModuleList
    layers = decoder.layers
    with torch.no_grad():
        for param in layers[len(layers) // 2 if layer is None else layer].parameters():
            param.mul_(1 + relative_noise * torch.randn(param.shape, generator=generator).to(param.dtype))
    return model


def perturbed(engine: InferenceEngine, tasks: RunTasks, node_id: str, spec: BatchSpec) -> Rows:
    """Generates and proves with one decoder layer's weights perturbed (a cheaper or stale model): toploc."""
    model = copy.deepcopy(_engine_of(engine).model)
    perturb_layer_(model, PERTURBATION, torch.Generator().manual_seed(spec.batch_counter))
    return produce_rows(HFEngine(model), tasks, node_id, spec).rows


def quantize_decoder_(model: ModelT, bits: int) -> ModelT:
    """Round every linear layer of the decoder to `bits`-bit integers and back, in place (symmetric, one
    scale per output channel): what a node running a quantized copy of the checkpoint computes with."""
    top = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for module in model.model.layers.modules():  # type: ignore[union-attr]
            if isinstance(module, torch.nn.Linear):
                w = module.weight
                scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / top
                w.copy_((w / scale).round().clamp(-top - 1, top) * scale)
    return model


def quantized(engine: InferenceEngine, tasks: RunTasks, node_id: str, spec: BatchSpec) -> Rows:
    """Generates and proves with the claimed weights quantized to int4 and back (cheaper memory and
    compute, not the claimed model): toploc."""
    model = quantize_decoder_(copy.deepcopy(_engine_of(engine).model), INT_BITS)
    return produce_rows(HFEngine(model), tasks, node_id, spec).rows


def _reinitialised(model: ModelT, seed: int) -> ModelT:
    """The same architecture with fresh weights from `seed` (transformers initialises from the global
    generator, which is restored afterwards)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = type(model)(copy.deepcopy(model.config))
    dtype = next(model.parameters()).dtype
    return fresh.to(dtype=dtype).eval()


_other: dict[str, HFEngine] = {}


def other_seed(engine: InferenceEngine, tasks: RunTasks, node_id: str, spec: BatchSpec) -> Rows:
    """Generates and proves with another model of the same architecture (initialised from another seed,
    none of the run's training in it) while claiming the run's checkpoint: toploc."""
    claimed = _engine_of(engine)
    if "engine" not in _other:  # the architecture never changes during a run: build it once
        _other["engine"] = HFEngine(_reinitialised(claimed.model, OTHER_SEED))
    return produce_rows(_other["engine"], tasks, node_id, spec).rows


_small: dict[str, HFEngine] = {}


def smaller_model(engine: InferenceEngine, tasks: RunTasks, node_id: str, spec: BatchSpec) -> Rows:
    """Tokens from a much smaller model, proofs recomputed by the claimed one: sampling / distribution."""
    claimed = _engine_of(engine)
    if "engine" not in _small:
        _small["engine"] = HFEngine(build_tiny_model(1, SMALL_SHAPE)[0])
    rows = produce_rows(_small["engine"], tasks, node_id, spec).rows
    return [_reprove(claimed, row) for row in rows]


def wrong_temperature(engine: InferenceEngine, tasks: RunTasks, node_id: str, spec: BatchSpec) -> Rows:
    """Samples at another temperature than the one it claims (proofs are honest): sampling."""
    rows = produce_rows(engine, tasks, node_id, dataclasses.replace(spec, temperature=WRONG_TEMPERATURE)).rows
    return [dataclasses.replace(row, temperature=spec.temperature) for row in rows]


def truncation(engine: InferenceEngine, tasks: RunTasks, node_id: str, spec: BatchSpec) -> Rows:
    """Cuts every completion in half without an EOS (cheaper, or steering the length reward): termination."""
    claimed = _engine_of(engine)
    out = []
    for row in produce_rows(engine, tasks, node_id, spec).rows:
        keep = [t for t in row.output_ids[: max(1, len(row.output_ids) // 2)] if t != EOS_ID] or [EOS_ID + 2]
        out.append(_reprove(claimed, _rescore(tasks, row, keep)))
    return out


def cherry_pick(engine: InferenceEngine, tasks: RunTasks, node_id: str, spec: BatchSpec) -> Rows:
    """Generates two batches and keeps the better-rewarded group of each pair, under the first batch's
    counter (choosing its own problems instead of the assigned ones): assignment."""
    first = produce_rows(engine, tasks, node_id, spec).rows
    extra = produce_rows(
        engine, tasks, node_id, dataclasses.replace(spec, batch_counter=spec.batch_counter + 1)
    ).rows
    g = spec.samples
    out: Rows = []
    for i in range(0, len(first), g):
        mine, other = first[i : i + g], extra[i : i + g]
        # Always swap at least the first group, so every file is a cherry-picked one.
        if i == 0 or sum(r.reward for r in other) > sum(r.reward for r in mine):
            mine = [dataclasses.replace(r, batch_counter=spec.batch_counter) for r in other]
        out.extend(mine)
    return out


def inflated_rewards(engine: InferenceEngine, tasks: RunTasks, node_id: str, spec: BatchSpec) -> Rows:
    """Honest tokens and proofs, but every sample claims full task reward: rewards."""
    return [
        dataclasses.replace(r, task_reward=1.0, reward=1.0 - r.length_penalty)
        for r in produce_rows(engine, tasks, node_id, spec).rows
    ]


def tampered(engine: InferenceEngine, tasks: RunTasks, node_id: str, spec: BatchSpec) -> Rows:
    """The file edited after its proofs were built (one output token per row changed, rewards redone) and
    signed again, as a node that 'fixes' answers would: toploc / sampling."""
    out = []
    for row in produce_rows(engine, tasks, node_id, spec).rows:
        ids = list(row.output_ids)
        # Change a token that is not the EOS, so the file still looks well terminated and only the proofs
        # and the sampling replay can tell (a one-token completion gets a token put in front of its EOS).
        body = [i for i, t in enumerate(ids) if t != EOS_ID]
        if body:
            at = body[len(body) // 2]
            ids[at] = 3 + (ids[at] + 7) % 200  # another printable byte token
        else:
            ids.insert(0, ord("7"))
        out.append(_rescore(tasks, row, ids))
    return out


def changed_prompt(engine: InferenceEngine, tasks: RunTasks, node_id: str, spec: BatchSpec) -> Rows:
    """Generates for an edited prompt (its first token changed) and proves honestly for it: prompts."""
    claimed = _engine_of(engine)
    out = []
    for row in produce_rows(engine, tasks, node_id, spec).rows:
        prompt = list(row.prompt_ids)
        prompt[0] = 3 + (prompt[0] + 5) % 200  # another printable byte token
        out.append(_reprove(claimed, dataclasses.replace(row, prompt_ids=tuple(prompt))))
    return out


def after_eos(engine: InferenceEngine, tasks: RunTasks, node_id: str, spec: BatchSpec) -> Rows:
    """Keeps writing after an EOS (an answer smuggled behind the end of the text), proved honestly for the
    tokens it claims: termination."""
    claimed = _engine_of(engine)
    out = []
    for row in produce_rows(engine, tasks, node_id, spec).rows:
        body = [t for t in row.output_ids if t != EOS_ID][: max(1, row.max_new_tokens - 3)] or [ord("4")]
        ids = body[:1] + [EOS_ID] + body[1:2] + [ord("2")]
        rescored = dataclasses.replace(_rescore(tasks, row, ids), finish_reason="eos")
        out.append(_reprove(claimed, rescored))
    return out


def forced_eos(engine: InferenceEngine, tasks: RunTasks, node_id: str, spec: BatchSpec) -> Rows:
    """Ends every completion early with an EOS the sampler did not choose (shorter, cheaper work), proved
    honestly for the tokens it claims: EOS probability or sampling."""
    claimed = _engine_of(engine)
    out = []
    for row in produce_rows(engine, tasks, node_id, spec).rows:
        body = [t for t in row.output_ids if t != EOS_ID]
        ids = body[: max(1, len(body) // 2)] + [EOS_ID]
        rescored = dataclasses.replace(_rescore(tasks, row, ids), finish_reason="eos")
        out.append(_reprove(claimed, rescored))
    return out


def declared_temperature(engine: InferenceEngine, tasks: RunTasks, node_id: str, spec: BatchSpec) -> Rows:
    """Samples cooler than the run and says so: every proof holds at the declared temperature, and colder
    samples score higher rewards: run-parameters (the validator pins the run's temperature)."""
    return produce_rows(engine, tasks, node_id, dataclasses.replace(spec, temperature=WRONG_TEMPERATURE)).rows


def shuffled_proofs(engine: InferenceEngine, tasks: RunTasks, node_id: str, spec: BatchSpec) -> Rows:
    """Honest rows whose proofs are rotated by one row (proofs copied from other rollouts): toploc."""
    rows = produce_rows(engine, tasks, node_id, spec).rows
    proofs = [r.proof for r in rows]
    return [dataclasses.replace(row, proof=proofs[(i + 1) % len(rows)]) for i, row in enumerate(rows)]


Attack = Callable[[InferenceEngine, RunTasks, str, BatchSpec], Rows]
# In the order `--adversaries N` takes them: the first is the default demo's cheater.
ATTACKS: dict[str, Attack] = {
    "temperature": wrong_temperature,
    "inflated-rewards": inflated_rewards,
    "cherry-pick": cherry_pick,
    "truncation": truncation,
    "tampered": tampered,
    "smaller-model": smaller_model,
    "changed-prompt": changed_prompt,
    "after-eos": after_eos,
    "forced-eos": forced_eos,
    "shuffled-proofs": shuffled_proofs,
    "perturbed": perturbed,
    "other-seed": other_seed,
    "int4": quantized,
    "declared-temperature": declared_temperature,
}


def write_signed(path: Path, rows: Rows, identity: Identity) -> None:
    """Parquet + signature as a node writes them, minus the writer's own sanity checks (a cheater skips them)."""
    data = encode_rows(rows)
    path.write_bytes(data)
    signature_path(path).write_text(json.dumps(sign_bytes(data, identity, batch=batch_of(rows))))


def attack_producer(
    kind: str,
) -> Callable[[InferenceEngine, RunTasks, Identity, BatchSpec, Path], ProducedBatch]:
    """A drop-in for `produce_rollout_file` that cheats with attack `kind`."""
    if kind not in ATTACKS:
        raise AttackError(f"unknown attack {kind!r}; choose one of {', '.join(ATTACKS)}")
    attack = ATTACKS[kind]

    def produce(
        engine: InferenceEngine, tasks: RunTasks, identity: Identity, spec: BatchSpec, out: Path
    ) -> ProducedBatch:
        started = time.perf_counter()
        rows = attack(engine, tasks, identity.node_id, spec)
        write_signed(out, rows, identity)
        return ProducedBatch(rows, time.perf_counter() - started, 0.0)

    return produce


# The checks that should reject each attack first (docs/devnet.md; the slow devnet test asserts them).
EXPECTED_CHECKS: dict[str, frozenset[str]] = {
    "perturbed": frozenset({"toploc"}),
    "smaller-model": frozenset({"sampling", "distribution", "eos_probability", "termination"}),
    "temperature": frozenset({"sampling", "distribution"}),
    "truncation": frozenset({"termination"}),
    "cherry-pick": frozenset({"assignment"}),
    "inflated-rewards": frozenset({"rewards"}),
    "tampered": frozenset({"toploc", "sampling"}),
    "changed-prompt": frozenset({"prompts"}),
    "after-eos": frozenset({"termination"}),
    "forced-eos": frozenset({"eos_probability", "sampling"}),
    "shuffled-proofs": frozenset({"toploc"}),
    "other-seed": frozenset({"toploc"}),
    "int4": frozenset({"toploc"}),
    "declared-temperature": frozenset({"run_parameters"}),
}

__all__ = [
    "ATTACKS",
    "EXPECTED_CHECKS",
    "AttackError",
    "attack_producer",
    "perturb_layer_",
    "quantize_decoder_",
    "write_signed",
]
