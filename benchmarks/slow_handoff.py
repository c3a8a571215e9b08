"""Honest intake of a live validator with and without 4 drip-fed hand-off streams, measured in one run.

Usage: .venv/bin/python benchmarks/slow_handoff.py [--phase-s S] [--honest N] [--interval-s I]
       [--streams K] [--attackers A] [--drip-bytes-per-s R]

A validator (default hand-off and intake settings, in this process, its swarm on 127.0.0.1) and N established
honest nodes, each producing one real rollout file every I seconds (by default the per-node rate limit, 30
files a minute) and
handing it off as an outbox does (retrying "busy" after its hint). Honest intake is the number of honest files
received during a phase and accepted by verification, per minute: accepted, because that is what reaches the
trainer and what the issue reported ("118 to 10 accepted files per 240 s"); received per minute is printed
too. Phase 1 runs unattacked; phase 2 the same while A newcomer peers (default 1, as reported) keep K slow
streams (default 4) open at all times, each dripping a large signed file at R bytes/s (default 5 KiB/s: fast
enough for the old per-read timeout of 60 s per 256 KiB, far below the rate floor) and opening the next stream
as soon as one ends. Prints both rates and their ratio (target >= 0.80).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from prime_node.node.models.tiny import build_tiny_model  # noqa: E402
from prime_node.p2p.identity import Identity  # noqa: E402
from prime_node.p2p.swarm import HandoffBusy, HandoffError, RolloutEnvelope, Swarm  # noqa: E402

from support.attack import engine_from, make_checkpoint, run_tasks  # noqa: E402
from support.slow_sender import drip, signed_blob  # noqa: E402
from support.swarm import fleet, wait_until  # noqa: E402
from support.validator import (  # noqa: E402
    OPERATOR,
    RUN,
    publish_checkpoint,
    rows_for,
    running_validator,
    sees_a_validator,
    validator_settings,
    wait_verdict,
    write_file,
)

DRIP_FILE_BYTES = 8 << 20
DEFAULT_TIMEOUT_S = 60.0  # the swarm's default handoff_timeout_s (the tests' helpers use 10 s)


async def honest_sender(
    peer: Swarm,
    files: list[tuple[Path, RolloutEnvelope]],
    interval_s: float,
    until: float,
    receipts: dict[str, float],
) -> None:
    """One file becomes ready every `interval_s`; send them in order, as an outbox would, until `until`."""
    start = time.monotonic()
    for k, (path, envelope) in enumerate(files):
        ready = start + k * interval_s
        if ready >= until:
            return
        await asyncio.sleep(max(0.0, ready - time.monotonic()))
        while time.monotonic() < until:
            try:
                await peer.send_rollout(path, envelope)
                receipts[envelope.sha256] = time.monotonic()
                break
            except HandoffBusy as exc:
                await asyncio.sleep(max(1.0, min(exc.retry_after_s, 10.0)))
            except HandoffError:
                await asyncio.sleep(1.0)


async def attacker_stream(peer: Swarm, target: str, rate: float, held: list[float], tries: list[int]) -> None:
    """Keep one slow stream open: drip a large signed file, and open the next stream as soon as one ends."""
    data, envelope = signed_blob(peer.identity, DRIP_FILE_BYTES)
    went_at: list[float] = []
    try:
        while True:
            tries[0] += 1
            went_at.clear()
            try:
                await drip(
                    peer,
                    target,
                    data,
                    envelope,
                    bytes_per_s=rate,
                    piece=4096,
                    limit_s=3600,
                    on_go=lambda: went_at.append(time.monotonic()),
                )
            except (HandoffError, OSError, ConnectionError):
                pass
            if went_at:
                held.append(time.monotonic() - went_at.pop())
            await asyncio.sleep(0.5)  # a bounded attack: at most 2 headers a second per stream
    finally:
        if went_at:  # still holding a slot when the phase ended
            held.append(time.monotonic() - went_at[0])


async def phase(label: str, running, peers, files, args, attack) -> tuple[float, float]:  # noqa: ANN001
    receipts: dict[str, float] = {}
    attack_tasks = attack() if attack is not None else []
    if attack_tasks:
        await asyncio.sleep(3.0)  # the slow streams are in place before the honest files start
    until = time.monotonic() + args.phase_s
    await asyncio.gather(
        *(honest_sender(p, mine, args.interval_s, until, receipts) for p, mine in zip(peers, files))
    )
    for task in attack_tasks:
        task.cancel()
    await asyncio.gather(*attack_tasks, return_exceptions=True)
    accepted = 0
    for sha in receipts:
        accepted += (await wait_verdict(running, sha, 120)).document.accepted
    minutes = args.phase_s / 60
    print(
        f"{label}: {len(receipts) / minutes:.1f} honest files received/min, {accepted / minutes:.1f} "
        f"accepted/min ({accepted} in {args.phase_s:g} s)",
        flush=True,
    )
    return accepted / minutes, len(receipts) / minutes


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = make_checkpoint(root / "model")
        engine, tasks = engine_from(build_tiny_model(0)[0]), run_tasks(checkpoint)
        honest = [Identity.generate() for _ in range(args.honest)]
        per_phase = int(args.phase_s / args.interval_s) + 2
        files = [
            [
                write_file(root / f"h{i}-{k}.parquet", rows_for(engine, tasks, node, batch_counter=k), node)
                for k in range(1 + 2 * per_phase)
            ]
            for i, node in enumerate(honest)
        ]
        settings = validator_settings(
            root / "validator", swarm={"handoff_timeout_s": DEFAULT_TIMEOUT_S}, hold_timeout_s=60.0
        )
        publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
        async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
            join = dict(
                bootstrap=running.maddrs[:1], reachability="public", handoff_timeout_s=DEFAULT_TIMEOUT_S
            )
            peers = [await group.add(node, **join) for node in honest]
            attackers = [await group.add(**join) for _ in range(args.attackers)]
            for peer in [*peers, *attackers]:
                await wait_until(lambda p=peer: sees_a_validator(p), 30)
            # Each honest node earns its standing with one accepted file (not counted).
            for peer, mine in zip(peers, files):
                await peer.send_rollout(*mine[0])
            for mine in files:
                assert (await wait_verdict(running, mine[0][1].sha256, 120)).document.accepted
            target = running.swarm.peer_id
            held: list[float] = []
            tries = [0]

            def attack() -> list[asyncio.Task]:
                streams = (
                    attacker_stream(attackers[i % len(attackers)], target, args.drip_bytes_per_s, held, tries)
                    for i in range(args.streams)
                )
                return [asyncio.create_task(s, name=f"slow-{i}") for i, s in enumerate(streams)]

            first = [f[1 : 1 + per_phase] for f in files]
            clean, clean_rx = await phase("unattacked", running, peers, first, args, None)
            attacked, attacked_rx = await phase(
                f"under attack ({args.streams} slow streams from {args.attackers} newcomer(s) at "
                f"{args.drip_bytes_per_s / 1024:.1f} KiB/s)",
                running,
                peers,
                [f[1 + per_phase :] for f in files],
                args,
                attack,
            )
            receiver = getattr(running.service, "receiver", None)  # absent before the slots had shares
            cut = getattr(receiver, "cut_off", "n/a")
            slot_s = sum(held) + 0.0
            print(
                f"attack: {tries[0]} slow hand-offs tried, {len(held)} got a receive slot, {cut} cut off at "
                f"the floor, {slot_s:.0f} slot-seconds held in a {args.phase_s:g} s phase"
            )
            print(
                f"honest intake under attack / unattacked: accepted {attacked / clean:.2f} "
                f"(received {attacked_rx / clean_rx:.2f}); target >= 0.80"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-s", type=float, default=60.0, help="length of each phase")
    parser.add_argument("--honest", type=int, default=2, help="established honest nodes")
    parser.add_argument("--interval-s", type=float, default=2.0, help="one file per node every this many s")
    parser.add_argument("--streams", type=int, default=4, help="slow streams kept open during the attack")
    parser.add_argument("--attackers", type=int, default=1, help="newcomer peers the streams come from")
    parser.add_argument("--drip-bytes-per-s", type=float, default=5 * 1024, help="each slow stream's rate")
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    asyncio.run(main(parser.parse_args()))
