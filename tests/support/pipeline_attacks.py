"""Faulty pipeline stages, one per adversary kind, and the verdict a validator reaches on each: shared by the
blame tests (default and slow) and benchmarks/pipeline.py."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import torch

from prime_node.node.engine.types import SampleRequest, SamplingParams
from prime_node.node.pipeline.boundaries import BoundaryOracle
from prime_node.node.pipeline.driver import run_loopback
from prime_node.node.pipeline.errors import FraudDetected
from prime_node.node.pipeline.stage import Outgoing, StageProcessor
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.frames import chain_next, chain_start, head_message, opening_digest
from prime_node.p2p.signing import canonical_json
from prime_node.proofs.pipeline.blame import GroupVerdict, GroupWork, check_fraud, verify_group
from prime_node.proofs.pipeline.records import HopRecord, SignedStageRecord
from prime_node.proofs.toploc import build_proof

from support.pipeline import group

KINDS = ("weights", "send-uncommitted", "send-consistent", "equivocate", "tokens")


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    stage: int
    seed: int = 0


def perturb_stage_(processor: StageProcessor, relative: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in processor.model.layers.parameters():
            parameter.mul_(1 + relative * torch.randn(parameter.shape, generator=generator))


def _noisy(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return tensor + 0.05 * tensor.std() * torch.randn(tensor.shape, generator=generator)


def rechain(hop: HopRecord, identity: Identity) -> HopRecord:
    head = chain_start(canonical_json(hop.opening.model_dump(mode="json")))
    for header in hop.headers:
        head = chain_next(head, canonical_json(header.model_dump(mode="json")))
    signature = identity.sign(head_message(opening_digest(hop.opening), len(hop.headers), head))
    return hop.model_copy(update={"head": head.hex(), "signature": signature.hex()})


def run_case(
    model_dir: Path,
    boundaries: list[int],
    requests: tuple[SampleRequest, ...],
    params: SamplingParams,
    oracle: BoundaryOracle,
    *,
    eos_token_id: int,
    pad_token_id: int,
    fault: Fault | None,
    micro_batch_size: int = 2,
) -> GroupVerdict:
    """Run one batch through a group with `fault` (None: all honest) and return the validator's verdict."""
    spec, processors, ids = group(
        model_dir,
        boundaries,
        requests,
        params,
        micro_batch_size=micro_batch_size,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    stages = spec.layout.stages
    work = GroupWork(
        [r.prompt_ids for r in requests],
        [r.seed for r in requests],
        params.temperature,
        params.max_new_tokens,
        eos_token_id,
        micro_batch_size,
    )
    rng = random.Random(fault.seed if fault else 0)
    target = rng.randrange(1 << 30)  # which of the faulty stage's frames is hit (by counting)
    sent: list[int] = [0]
    fired: list[bool] = []  # the fault happened (a sample that ended first would leave nothing to attack)
    honest_commitments: dict[int, bytes] = {}
    tamper = None
    if fault is not None:
        k = fault.stage
        if fault.kind == "weights":
            perturb_stage_(processors[k], 1e-3, fault.seed)
        elif fault.kind in ("send-uncommitted", "send-consistent", "equivocate") and k < stages - 1:
            # Hit one of the stage's first 2 * micro-batches frames (prefills and early decodes).
            hit = target % (2 * len(processors[0].work.schedule))

            def tamper(stage: int, out: Outgoing) -> Outgoing:
                if stage != k or out.kind == "end":
                    return out
                sent[0] += 1
                if sent[0] - 1 != hit:
                    return out
                fired.append(True)
                tensor = _noisy(out.tensor, fault.seed)
                if fault.kind == "send-uncommitted":
                    return dataclasses.replace(out, tensor=tensor)
                committed = tensor.reshape(-1, tensor.shape[-1]) if out.kind == "decode" else None
                if out.kind == "prefill":
                    lengths = processors[0].work.prompt_lengths(out.rows)
                    width = tensor.shape[1]
                    committed = torch.cat([tensor[b, width - int(n) :] for b, n in enumerate(lengths)])
                honest_commitments[sent[0]] = out.commitment
                return dataclasses.replace(out, tensor=tensor, commitment=build_proof(committed))
        elif fault.kind == "tokens" and k == stages - 1:
            last = processors[k]
            step = target % 4  # early, while every sample is still generating

            def tamper(stage: int, out: Outgoing) -> Outgoing:
                if stage != k or out.kind != "tokens" or out.step != step or fired:
                    return out
                fired.append(True)
                tokens = out.tensor.clone()
                tokens[0] = (int(tokens[0]) + 1 + rng.randrange(50)) % 200 + 3
                last.outputs.tokens[out.rows[0]][step] = int(tokens[0])  # its record lists what it sent
                return dataclasses.replace(out, tensor=tokens)
        elif fault.kind == "tokens" and k == 0:
            first, original = processors[0], processors[0].on_tokens
            step = target % 3

            def fed_otherwise(frame):  # type: ignore[no-untyped-def]
                if frame.header.step == step and not fired:
                    fired.append(True)
                    tokens = frame.tensor.clone()
                    tokens[0] = (int(tokens[0]) + 7) % 200 + 3
                    frame = dataclasses.replace(frame, tensor=tokens)
                return original(frame)

            first.on_tokens = fed_otherwise  # type: ignore[method-assign]
    try:
        _, records = run_loopback(spec, processors, ids, tamper=tamper)
    except FraudDetected as exc:
        return check_fraud(spec, exc.fraud, work)
    if fault is not None and fault.kind in ("send-uncommitted", "send-consistent", "equivocate", "tokens"):
        if fault.kind != "tokens" or fault.stage in (0, stages - 1):
            assert fired, f"{fault} never fired: the batch ended before its target frame"
    if fault is not None and fault.kind == "equivocate" and honest_commitments:
        records[fault.stage] = _equivocated(records[fault.stage], honest_commitments, ids[fault.stage])
    if fault is not None and fault.kind == "tokens" and 0 < fault.stage < stages - 1:
        records[fault.stage] = _other_tokens(records[fault.stage], ids[fault.stage], rng)
    return verify_group(spec, records, work, oracle)


def _equivocated(
    signed: SignedStageRecord, honest: dict[int, bytes], identity: Identity
) -> SignedStageRecord:
    """The stage's record claiming the honest commitments of the frames it actually sent corrupted."""
    headers = [
        h.model_copy(update={"commitment": honest[h.index].hex()}) if h.index in honest else h
        for h in signed.record.sent.headers
    ]
    sent = rechain(signed.record.sent.model_copy(update={"headers": headers}), identity)
    return SignedStageRecord.sign(signed.record.model_copy(update={"sent": sent}), identity)


def _other_tokens(signed: SignedStageRecord, identity: Identity, rng: random.Random) -> SignedStageRecord:
    outputs = [list(o) for o in signed.record.outputs]
    sample = rng.randrange(len(outputs))
    outputs[sample][-1] = (outputs[sample][-1] + 1) % 200 + 3
    return SignedStageRecord.sign(signed.record.model_copy(update={"outputs": outputs}), identity)


def faults_for(stages: int) -> list[Fault]:
    """Every adversary kind at every stage where it applies (a last stage sends tokens, not activations: its
    "sending other than committed" is the token substitution)."""
    faults = []
    for k in range(stages):
        for kind in KINDS:
            if kind in ("send-uncommitted", "send-consistent", "equivocate") and k == stages - 1:
                continue
            faults.append(Fault(kind, k))
    return faults
