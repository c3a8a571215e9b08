"""`prime-node status [--json]`: ask the local node (status API on 127.0.0.1) what it is doing."""

from __future__ import annotations

import argparse
import asyncio

from ..config import CommonSettings
from .common import print_json
from .flags import SettingsFlags, load_settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show what the local node is doing")
    SettingsFlags(p, CommonSettings)
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(handler=status)


def _step(step: int | None) -> str:
    return "none" if step is None else str(step)


def status(args: argparse.Namespace) -> int:
    from ..contributor.status import fetch_status

    settings = load_settings(args, CommonSettings)
    report = asyncio.run(fetch_status(settings.resolved_data_dir()))  # DaemonNotRunning: one line, exit 1
    if args.json:
        print_json(report.model_dump(mode="json"))
        return 0
    r = report.rollouts
    hours, rest = divmod(int(report.uptime_s), 3600)
    lines = [
        f"node id:        {report.node_id}",
        f"version:        {report.version}, up {hours}h{rest // 60:02d}m{rest % 60:02d}s",
        f"state:          {report.state}",
        f"peers seen:     {report.peers_seen}",
        f"operator key:   {report.operator_key or 'not set'}",
        f"policy step:    announced {_step(report.announced_step)}, local {_step(report.local_step)}"
        + (" (verified)" if report.local_verified else ""),
        f"rollout files:  {r.generated} generated, {r.handed_off} handed off, {r.accepted} accepted, "
        f"{r.rejected} rejected" + (f", {r.stale} dropped as stale" if r.stale else ""),
        f"throughput:     {'n/a' if report.tokens_per_second is None else f'{report.tokens_per_second:.1f} tokens/s'}",
        f"last error:     {report.last_error or 'none'}",
    ]
    lines.insert(-2, f"verdicts:       {report.awaiting_verdicts} awaited")
    board = report.leaderboard
    if board is not None:
        lines.append(
            f"leaderboard:    rank {board.rank}, score {board.score:.3f} ({board.accepted_tokens} accepted "
            f"tokens{', BANNED' if board.banned else ''}; {board.validator_url})"
        )
    else:
        lines.append(f"leaderboard:    {report.leaderboard_status}")
    if report.serving_weights is not None:
        lines.append(f"serving:        verified checkpoints at {report.serving_weights}")
    stage = report.pipeline
    if stage is not None:
        group = (
            "no group" if stage.group_id is None else f"stage {stage.stage} of group {stage.group_id[:16]}…"
        )
        lines.append(
            f"pipeline:       {group}; {stage.batches} batches, {stage.abandoned} abandoned; "
            f"{stage.stage_files} stage files, {stage.fraud_reports} fraud reports, "
            f"{stage.partial_records} partial records"
            + (f", {stage.withheld} withheld" if stage.withheld else "")
        )
    print("\n".join(lines))
    return 0
