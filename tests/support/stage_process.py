"""One pipeline stage in its own process, with its own hivemind DHT node: joins the swarm, waits for the
operator-signed group record naming it, runs its stage over libp2p (SwarmHops) batch after batch until its
stdin closes (and at least `batches` batches are done), then writes what it produced as JSON: the stage
records, the last stage's completions, the refusals it made.

    python tests/support/stage_process.py SPEC.json OUT.json

Used by tests/test_pipeline_libp2p.py; ended by its PID by the test if it outlives its deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `support` when run as a script

from prime_node.node.engine.types import SamplingParams  # noqa: E402
from prime_node.node.pipeline.group import HopSettings  # noqa: E402
from prime_node.node.pipeline.hops import SwarmHops  # noqa: E402
from prime_node.node.pipeline.host import BatchDone, StageHost  # noqa: E402
from prime_node.node.pipeline.work import PipelineWork  # noqa: E402
from prime_node.p2p.identity import Identity  # noqa: E402
from prime_node.p2p.pipeline.layout import StageLayout  # noqa: E402
from prime_node.p2p.swarm import Swarm, SwarmConfig  # noqa: E402
from prime_node.p2p.swarm.group_records import GroupRecord  # noqa: E402

from support.pipeline import random_requests  # noqa: E402

PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0)
SAMPLES, MICRO_BATCH = 4, 2


def work_for(eos: int, pad: int):  # noqa: ANN201
    """The batch every member (and the test's monolithic reference) derives from the group and batch alone."""

    def work(group: GroupRecord, batch: int) -> PipelineWork:
        seed = int.from_bytes(hashlib.sha256(f"{group.group_id}|{batch}".encode()).digest()[:8], "big")
        return PipelineWork(random_requests(SAMPLES, seed), PARAMS, MICRO_BATCH, eos, pad)

    return work


async def main(spec: dict, out: Path) -> None:
    import torch

    torch.set_num_threads(1)
    identity = Identity.from_seed(bytes.fromhex(spec["seed"]))
    config = SwarmConfig(
        run_id=spec["run_id"],
        operator_keys=[spec["operator"]],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=spec["bootstrap"],
        wait_timeout_s=5.0,
        startup_timeout_s=60.0,
        heartbeat_interval_s=0.5,
        heartbeat_ttl_s=20.0,
        record_ttl_s=60.0,
    )
    swarm = Swarm(config, identity)
    await swarm.join()
    done: list[BatchDone] = []
    done_wall: list[float] = []
    finished = asyncio.Event()
    try:
        swarm.policy_step = spec["policy_step"]
        streams = await swarm.serve_pipeline()
        layout = StageLayout(boundaries=spec["boundaries"])

        async def on_batch(result: BatchDone) -> None:
            done.append(result)
            done_wall.append(time.time())
            if len(done) >= spec["batches"] and told_to_stop.done():
                finished.set()

        # The test closes our stdin when it has seen what it needs; read in a thread (blocking).
        told_to_stop = asyncio.create_task(
            asyncio.to_thread(sys.stdin.buffer.read), name="stage-process-stdin"
        )
        told_to_stop.add_done_callback(lambda _: len(done) >= spec["batches"] and finished.set())

        host = StageHost(
            identity,
            spec["run_id"],
            Path(spec["model_dir"]),
            layout,
            work_for(spec["eos"], spec["pad"]),
            SwarmHops(streams, swarm.pipeline_peer),
            HopSettings(frame_timeout_s=20.0, connect_timeout_s=20.0),
            on_batch,
        )
        async with asyncio.timeout(spec["deadline_s"]):
            while not (
                groups := [g for g in (await swarm.list_groups()).values() if identity.node_id in g.members]
            ):
                await asyncio.sleep(0.2)
            await host.on_change(groups[0], "named by the operator's group record")
            await finished.wait()
        await host.stop()
        result = {
            "peer_id": swarm.peer_id,
            "batches": [
                {
                    "batch": d.batch,
                    "record": d.record.model_dump(mode="json"),
                    "completions": [
                        {
                            "output_ids": list(c.output_ids),
                            "logprobs": list(c.output_logprobs),
                            "finish": c.finish_reason,
                        }
                        for c in d.completions or []
                    ],
                }
                for d in done
            ],
            "abandoned": [list(a) for a in host.abandoned],
            "refusals": [[at, peer, why] for at, peer, why in streams.refusals],
            # When this stage first finished a batch: its predecessor's stream was surely admitted by then.
            "first_batch_wall": done_wall[0] if done_wall else None,
        }
        out.write_text(json.dumps(result))
    finally:
        await swarm.leave()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s stage-process %(name)s: %(message)s")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    asyncio.run(main(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])))
