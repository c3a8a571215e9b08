"""How far one machine carries the devnet: 20 contributors (by default) with a trainer and a validator.

    .venv/bin/python benchmarks/devnet_scale.py [--nodes 20] [--steps 3] [--model DIR | --untrained]

Runs a real devnet (trainer/devnet/runner.py: every role its own process on 127.0.0.1) and prints, measured
in that one run: policy steps per hour, the validator's queue depth (files received but not yet judged,
sampled every second: mean and max), and memory per process tree as PSS (proportional set size: shared
pages split between their users, so the numbers add up to what the machine really spends), for the
trainer, the validator and the median/max contributor; plus the devnet's own timings. With --untrained
the tiny model is used without its warm start (quick set-up; the rewards are then ~0 and only length
targets give the groups signal, so the small test sizing is used too).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import psutil
from rich.console import Console

from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.trainer.devnet.layout import Sizing
from prime_node.trainer.devnet.monitor import Snapshot
from prime_node.trainer.devnet.processes import descendants
from prime_node.trainer.devnet.report import format_report
from prime_node.trainer.devnet.runner import Devnet, DevnetOptions
from prime_node.trainer.devnet.view import LiveView

UNTRAINED_SIZING = Sizing(prompts=2, samples=2, max_new_tokens=16, length_targets=(3, 9, 17))


def pss_kib(pid: int) -> int:
    """The process's PSS in KiB (0 if it is gone)."""
    try:
        info = psutil.Process(pid).memory_full_info()
    except psutil.Error:
        return 0
    return int(getattr(info, "pss", info.rss)) // 1024  # PSS: Linux only


class Sampler:
    """Every second: the validator's queue depth; every 10 s: PSS of each child's whole process tree."""

    def __init__(self, devnet: Devnet) -> None:
        self.devnet = devnet
        self.queue: list[int] = []
        self.pss: dict[str, int] = {}  # child name -> largest tree PSS seen (KiB)
        self._last_pss = 0.0

    def __call__(self, snapshot: Snapshot) -> None:
        self.queue.append(snapshot.queue_depth)
        if time.monotonic() - self._last_pss < 10:
            return
        self._last_pss = time.monotonic()
        for child in self.devnet.group.children:
            tree = [child.pid, *descendants(child.pid)]
            self.pss[child.name] = max(self.pss.get(child.name, 0), sum(pss_kib(pid) for pid in tree))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=20)
    p.add_argument("--adversaries", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", type=Path, default=Path("~/.prime-node/models/tiny").expanduser())
    p.add_argument("--untrained", action="store_true", help="the tiny model without warm start, small sizing")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("/tmp") / f"devnet-scale-{os.getpid()}")
    args = p.parse_args()
    sizing = Sizing(batch_size=args.batch_size)
    model = args.model
    if args.untrained:
        model = args.out / "model"
        save_model_dir(*build_tiny_model(0), model)
        sizing = Sizing(
            batch_size=args.batch_size or 8 * args.nodes,
            **{
                k: getattr(UNTRAINED_SIZING, k)
                for k in ("prompts", "samples", "max_new_tokens", "length_targets")
            },
        )
    from prime_node.trainer.devnet.attacks import ATTACKS

    options = DevnetOptions(
        root=args.out / "run",
        model_dir=model,
        nodes=args.nodes,
        attacks=[list(ATTACKS)[i % len(ATTACKS)] for i in range(args.adversaries)],
        steps=args.steps,
        sizing=sizing,
    )
    devnet = Devnet(options, LiveView(args.steps, Console(stderr=True), live=False))
    sampler = Sampler(devnet)
    devnet.on_snapshot = sampler
    report = devnet.run()
    print(format_report(report))
    print()
    run_h = report["run_s"] / 3600
    print(
        f"contributors            {args.nodes} honest + {args.adversaries} adversaries, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"steps per hour          {report['steps'] / run_h:.1f}  ({report['steps']} steps in {report['run_s']:.0f} s "
        f"after {report['setup_s']:.0f} s of set-up)"
    )
    if sampler.queue:
        print(
            f"validator queue depth   mean {statistics.fmean(sampler.queue):.1f}, max {max(sampler.queue)} files "
            f"({len(sampler.queue)} samples)"
        )
    members = [v for k, v in sampler.pss.items() if k not in ("trainer", "validator")]
    mib = 1024
    if members:
        print(
            f"PSS per process tree    trainer {sampler.pss.get('trainer', 0) / mib:.0f} MiB, validator "
            f"{sampler.pss.get('validator', 0) / mib:.0f} MiB, contributor median "
            f"{statistics.median(members) / mib:.0f} MiB (max {max(members) / mib:.0f}), "
            f"all {sum(sampler.pss.values()) / mib:.0f} MiB"
        )
    return 0 if report["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
