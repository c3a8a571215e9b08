"""Honest intake of a live validator unattacked and under each slow hand-off attack, measured in one run.

Usage: .venv/bin/python benchmarks/slow_handoff.py [--phase-s S] [--honest N] [--interval-s I]
       [--modes drip,hangup,network] [--streams K] [--attackers A] [--drip-bytes-per-s R]

A validator (default hand-off and intake settings, loopback senders grouped by /24 as the Internet's are, in this
process, its swarm on 127.0.0.1) and N established honest nodes, each on its own /24 of the loopback (127.0.1.1,
127.0.2.1, ...), each producing one real rollout file every I seconds (by default the per-node rate limit, 30
files a minute) and handing it off as an outbox does (retrying "busy" after its hint). Honest intake is the
number of honest files received during a phase and accepted by verification, per minute: accepted, because
that is what reaches the trainer and what issue 18 reported ("118 to 10 accepted files per 240 s"); received
per minute is printed too. Every node earns its standing as the validator's admission asks (intake.
established_after accepted files), the attackers' included. Phase 1 runs unattacked; then one phase per mode:

- drip: A newcomer peers keep K streams open at all times, each dripping a large signed file at R bytes/s
  (default 5 KiB/s: fast enough for the old per-read timeout of 60 s per 256 KiB, far below the rate floor),
  opening the next stream as soon as one ends;
- hangup: 2 ids with standing (earned with real accepted files) and 2 newcomers, each on a /24 of its own (so
  no network share stops them), each keep a stream going that sends nothing and hangs up just before the rate
  window's floor is due (90% of it), then open the next stream at once: the close used to cost nothing, and
  the four held every receive slot, the reserved ones included;
- network: on 127.0.0.0/24, 2 ids with standing (earned with real accepted files) and 2 newcomers stream large
  files just above the floor (they pay for it and are never cut), reopening as soon as one ends; before, each
  tier had its own share of the network and the four held every receive slot.

Prints each phase's rates, the attack's slots held, and each ratio to the unattacked phase (target >= 0.80).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
MODES = ("drip", "hangup", "network")


@dataclass
class AttackLog:
    tries: int = 0  # headers sent
    held: list[float] = field(default_factory=list)  # seconds each stream that got a slot held it


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


async def attacker_stream(
    peer: Swarm, target: str, rate: float, log: AttackLog, hang_up_after_s: float | None = None
) -> None:
    """Keep one slow stream going: drip a large signed file at `rate` (or hang up after `hang_up_after_s`),
    and open the next stream as soon as one ends."""
    data, envelope = signed_blob(peer.identity, DRIP_FILE_BYTES)
    went_at: list[float] = []
    try:
        while True:
            log.tries += 1
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
                    hang_up_after_s=hang_up_after_s,
                )
            except (HandoffError, OSError, ConnectionError):
                pass
            if went_at:
                log.held.append(time.monotonic() - went_at.pop())
            await asyncio.sleep(0.5)  # a bounded attack: at most 2 headers a second per stream
    finally:
        if went_at:  # still holding a slot when the phase ended
            log.held.append(time.monotonic() - went_at[0])


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


async def earn_standing(running, peer: Swarm, files: list[tuple[Path, RolloutEnvelope]]) -> None:  # noqa: ANN001
    for path, envelope in files:
        await peer.send_rollout(path, envelope)
    for _, envelope in files:
        assert (await wait_verdict(running, envelope.sha256, 120)).document.accepted


async def main(args: argparse.Namespace) -> None:
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = make_checkpoint(root / "model")
        engine, tasks = engine_from(build_tiny_model(0)[0]), run_tasks(checkpoint)
        settings = validator_settings(
            root / "validator",
            swarm={"handoff_timeout_s": DEFAULT_TIMEOUT_S, "handoff_group_loopback": True},
            hold_timeout_s=60.0,
        )
        standing = settings.intake.established_after
        honest = [Identity.generate() for _ in range(args.honest)]
        # The attackers with standing, per mode (fresh ones each: a cooldown earned in one phase must not
        # weaken the next).
        veterans = {mode: [Identity.generate() for _ in range(2)] for mode in modes if mode != "drip"}
        per_phase = int(args.phase_s / args.interval_s) + 2

        def files_of(node: Identity, count: int, first: int = 0) -> list[tuple[Path, RolloutEnvelope]]:
            return [
                write_file(
                    root / f"{node.node_id[:8]}-{k}.parquet",
                    rows_for(engine, tasks, node, batch_counter=k),
                    node,
                )
                for k in range(first, first + count)
            ]

        earning = [*honest, *(v for group_of in veterans.values() for v in group_of)]
        earned = {node.node_id: files_of(node, standing) for node in earning}
        work = [files_of(node, (1 + len(modes)) * per_phase, standing) for node in honest]
        publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
        async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
            join = dict(
                bootstrap=running.maddrs[:1], reachability="public", handoff_timeout_s=DEFAULT_TIMEOUT_S
            )
            networks = iter(range(1, 255))  # 127.0.N.0/24, one per peer that must not share a network

            def own_network() -> dict[str, list[str]]:
                return {"host_maddrs": [f"/ip4/127.0.{next(networks)}.1/tcp/0"]}

            # Each honest node on a /24 of its own; the attackers of drip and network on 127.0.0.0/24, those of
            # hangup each on its own.
            peers = [await group.add(node, **own_network(), **join) for node in honest]
            newcomers, veteran_peers = {}, {}
            for mode in modes:
                count = args.attackers if mode == "drip" else 2
                place = own_network if mode == "hangup" else dict
                newcomers[mode] = [await group.add(**place(), **join) for _ in range(count)]
                veteran_peers[mode] = [await group.add(v, **place(), **join) for v in veterans.get(mode, [])]
            attackers = [p for m in modes for p in (*newcomers[m], *veteran_peers[m])]
            for peer in [*peers, *attackers]:
                await wait_until(lambda p=peer: sees_a_validator(p), 30)
            # Standing is earned with verified work (not counted in any phase).
            await asyncio.gather(
                *(
                    earn_standing(running, p, earned[p.node_id])
                    for p in [*peers, *(v for m in modes for v in veteran_peers[m])]
                )
            )
            target = running.swarm.peer_id
            window_s = settings.swarm.handoff_rate_window_s
            floor = settings.swarm.handoff_min_bytes_per_s

            def streams(mode: str, log: AttackLog) -> Callable[[], list[asyncio.Task]]:
                def start() -> list[asyncio.Task]:
                    senders = [*veteran_peers[mode], *newcomers[mode]]
                    if mode == "network":  # all above the floor
                        runs = [attacker_stream(p, target, 1.25 * floor, log) for p in senders]
                    elif mode == "hangup":  # nothing sent; each hangs up at 90% of the window
                        runs = [attacker_stream(p, target, 0.0, log, 0.9 * window_s) for p in senders]
                    else:
                        runs = [
                            attacker_stream(senders[i % len(senders)], target, args.drip_bytes_per_s, log)
                            for i in range(args.streams)
                        ]
                    return [asyncio.create_task(r, name=f"{mode}-{i}") for i, r in enumerate(runs)]

                return start

            chunks = [
                [mine[k * per_phase : (k + 1) * per_phase] for mine in work] for k in range(1 + len(modes))
            ]
            clean, clean_rx = await phase("unattacked", running, peers, chunks[0], args, None)
            receiver = running.service.receiver
            results = []
            for k, mode in enumerate(modes, start=1):
                log = AttackLog()
                cut_before = receiver.cut_off if receiver is not None else 0
                attacked, attacked_rx = await phase(
                    f"under attack ({mode})", running, peers, chunks[k], args, streams(mode, log)
                )
                cut = (receiver.cut_off if receiver is not None else 0) - cut_before
                print(
                    f"  {mode}: {log.tries} slow hand-offs tried, {len(log.held)} got a receive slot, {cut} cut off, "
                    f"{sum(log.held):.0f} slot-seconds held in a {args.phase_s:g} s phase",
                    flush=True,
                )
                results.append((mode, attacked / clean, attacked_rx / clean_rx))
            for mode, ratio, rx_ratio in results:
                print(
                    f"honest intake under {mode} / unattacked: accepted {ratio:.2f} (received {rx_ratio:.2f}); "
                    "target >= 0.80"
                )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-s", type=float, default=60.0, help="length of each phase")
    parser.add_argument("--honest", type=int, default=2, help="established honest nodes")
    parser.add_argument("--interval-s", type=float, default=2.0, help="one file per node every this many s")
    parser.add_argument("--modes", default=",".join(MODES), help=f"attacks to run, of {', '.join(MODES)}")
    parser.add_argument("--streams", type=int, default=4, help="slow streams kept open (drip)")
    parser.add_argument("--attackers", type=int, default=1, help="newcomer peers the drip streams come from")
    parser.add_argument("--drip-bytes-per-s", type=float, default=5 * 1024, help="each drip stream's rate")
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    asyncio.run(main(parser.parse_args()))
