"""A tiny model saved to disk and pipelined groups over it, shared by the pipeline tests and
benchmarks/pipeline.py."""

from __future__ import annotations

import random
import time
from pathlib import Path

from prime_node.node.engine.hf import HFEngine
from prime_node.node.engine.types import SampleRequest, SamplingParams
from prime_node.node.models.tiny import TinyModelShape, build_tiny_model, save_model_dir
from prime_node.node.pipeline.stage import StageProcessor
from prime_node.node.pipeline.stage_model import StageModel
from prime_node.node.pipeline.work import PipelineWork
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.proofs.pipeline.blame import GroupVerdict
from prime_node.proofs.pipeline.records import GroupSpec

from support.nonces import NONCE


def save_tiny(out: Path, seed: int = 3, shape: TinyModelShape | None = None) -> Path:
    save_model_dir(*build_tiny_model(seed=seed, shape=shape), out)
    return out


def random_requests(count: int, seed: int, vocab: int = 250) -> tuple[SampleRequest, ...]:
    rng = random.Random(seed)
    return tuple(
        SampleRequest(
            tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(2, 14))), rng.randrange(2**40)
        )
        for _ in range(count)
    )


def identities(stages: int, salt: int = 0) -> list[Identity]:
    return [Identity.from_seed(bytes([salt + s + 1]) * 32) for s in range(stages)]


def group(
    model_dir: Path,
    boundaries: list[int],
    requests: tuple[SampleRequest, ...],
    params: SamplingParams,
    *,
    micro_batch_size: int,
    eos_token_id: int,
    pad_token_id: int,
    batch: int = 0,
    commit: bool = True,
    members: list[Identity] | None = None,
    nonce: str = NONCE,
) -> tuple[GroupSpec, list[StageProcessor], list[Identity]]:
    layout = StageLayout(boundaries=boundaries)
    work = PipelineWork(requests, params, micro_batch_size, eos_token_id, pad_token_id)
    processors = [
        StageProcessor(StageModel.load(model_dir, layout, s), work, commit=commit)
        for s in range(layout.stages)
    ]
    ids = members if members is not None else identities(layout.stages)
    spec = GroupSpec("local", 0, batch, layout, tuple(i.node_id for i in ids), nonce)
    return spec, processors, ids


def frequent_token(engine: HFEngine, requests: tuple[SampleRequest, ...], params: SamplingParams) -> int:
    """A token the model emits often: used as EOS so that samples finish early and leave the batch."""
    counts: dict[int, int] = {}
    for completion in engine.generate(requests, params, capture_hidden=False):
        for token in completion.output_ids[1:6]:
            counts[token] = counts.get(token, 0) + 1
    return max(counts, key=lambda t: counts[t])


def regroup_after_a_kill(
    model_dir: Path, engine: HFEngine, params: SamplingParams, pool: list[Identity]
) -> tuple[float, GroupVerdict, str, list[str]]:
    """Form a 2-stage group from `pool`, kill its last stage mid-batch, regroup the survivors, rerun the batch
    over TCP and verify it: (seconds from the kill to the verdict, verdict, the dead node, the new members)."""
    import asyncio
    import contextlib

    from prime_node.node.pipeline.boundaries import BoundaryOracle
    from prime_node.node.pipeline.group import HopSettings, run_group
    from prime_node.node.pipeline.stage import Outgoing
    from prime_node.p2p.swarm.group_records import PeerRtt, StageAvailability
    from prime_node.proofs.pipeline.blame import GroupWork, verify_group
    from prime_node.trainer.groups.formation import form_groups

    everyone = {i.node_id: i for i in pool}
    layout = StageLayout(boundaries=[0, 2, 4])
    offers = {
        i.node_id: StageAvailability(
            node_id=i.node_id,
            stages=[0, 1],
            layer_tokens_per_s=1000.0 - 10 * n,
            rtts=[PeerRtt(node_id=j.node_id, rtt_ms=4.0) for j in pool if j is not i],
            reachable=True,
            policy_step=0,
            published_at=time.time(),
        )
        for n, i in enumerate(pool)
    }
    requests = random_requests(4, seed=21)
    hop = HopSettings(delay_s=0.02, frame_timeout_s=5)
    killed_at: list[float] = []

    def kill(stage: int, out: Outgoing) -> Outgoing:
        if stage == 1 and out.step == 2:
            killed_at.append(time.monotonic())
            raise ConnectionResetError("the last stage went away")
        return out

    # The coordinator's formation (trainer/groups/formation.py), as the DHT-wired groups use it.
    def group_of(members: tuple[str, ...], batch: int):  # noqa: ANN202
        return group(
            model_dir,
            [0, 2, 4],
            requests,
            params,
            micro_batch_size=2,
            eos_token_id=engine.eos_token_id,
            pad_token_id=engine.pad_token_id,
            batch=batch,
            members=[everyone[m] for m in members],
        )

    chosen = form_groups(layout, offers)[0].members
    spec, processors, ids = group_of(chosen, batch=0)
    with contextlib.suppress(ExceptionGroup):
        asyncio.run(run_group(spec, processors, ids, hop, tamper=kill))
    dead = chosen[1]
    (again, *_) = form_groups(layout, {m: o for m, o in offers.items() if m != dead})
    spec, processors, ids = group_of(again.members, batch=1)
    run = asyncio.run(run_group(spec, processors, ids, hop))
    work = GroupWork(
        [r.prompt_ids for r in requests],
        [r.seed for r in requests],
        params.temperature,
        params.max_new_tokens,
        engine.eos_token_id,
        2,
    )
    verdict = verify_group(spec, run.records, work, BoundaryOracle(engine.model, spec.layout))
    return time.monotonic() - killed_at[0], verdict, dead, list(again.members)
