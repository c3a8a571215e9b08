"""The devnet's final report: rewards, leaderboard, slashes and bans, and INTELLECT-2-style timings.

Sources, all written by the processes themselves: the trainer's metrics JSONL (step, task reward, when
each step was announced and how long it trained), the validator's ledger (every verdict with its receive
and decide times, slashes, bans), and the checkpoint arrival times the monitor noted on each node.

Timings (seconds; "announced" is when the trainer had published and announced a step: the ready line for
step 0, the step's metrics record otherwise):
- broadcast: announced -> the checkpoint fully downloaded and verified on an honest node (mean over nodes
  and steps; `max` is the slowest node of the slowest step);
- broadcast_to_first_rollout: announced -> the first rollout file of that step received by the validator;
- validation_latency: a file received -> its verdict decided (queueing included);
- trainer_idle: time the trainer waited for a full batch (between announcing a step and starting to train
  the next), in total and as a share of the run.
"""

from __future__ import annotations

import sqlite3
import statistics
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from ..ledger import Ledger
from ..ledger.leaderboard import leaderboard
from ..ledger.slashing import DEFAULT_CHECK_CLASSES, CheckClass
from .dropout import dropout_outcome, is_dropout
from .layout import DevnetLayout
from .monitor import Monitor
from .plot import Series, figure, save


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "mean": round(statistics.fmean(values), 3),
        "p50": round(statistics.median(values), 3),
        "max": round(max(values), 3),
        "count": len(values),
    }


def ledger_rows(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    if not path.is_file():
        return [], [], []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    db.row_factory = sqlite3.Row
    try:
        contributions = [
            dict(r)
            for r in db.execute(
                "SELECT file_hash, node_id, step, accepted, failed_check, reason, received_at, decided_at "
                "FROM contributions"
            )
        ]
        slashes = [
            dict(r)
            for r in db.execute(
                "SELECT node_id, amount, check_class, failed_check, reason, created_at FROM slashes ORDER BY id"
            )
        ]
        bans = [
            dict(r) for r in db.execute("SELECT node_id, reason, created_at, until FROM bans ORDER BY id")
        ]
    finally:
        db.close()
    return contributions, slashes, bans


def announce_times(monitor: Monitor, ready_at: float) -> dict[int, float]:
    times = {0: ready_at}
    for record in monitor.steps:
        times[int(record["step"])] = float(record["time"])
    return times


def timings(
    layout: DevnetLayout,
    monitor: Monitor,
    contributions: list[dict[str, Any]],
    ready_at: float,
    ended_at: float,
) -> dict[str, Any]:
    announced = announce_times(monitor, ready_at)
    honest = {m.name for m in layout.members if m.attack is None}
    honest_ids = {m.node_id for m in layout.members if m.attack is None}
    # Step 0 is left out: the nodes start after the trainer announced it, so its time includes their start-up.
    broadcast = [
        max(0.0, at - announced[step])
        for name, seen in monitor.arrivals.items()
        if name in honest
        for step, at in seen.items()
        if step > 0 and step in announced
    ]
    first: dict[int, float] = {}
    for c in contributions:
        if c["node_id"] in honest_ids:
            first[c["step"]] = min(first.get(c["step"], float("inf")), c["received_at"])
    to_first = [first[s] - announced[s] for s in sorted(first) if s in announced and s > 0]
    latency = [c["decided_at"] - c["received_at"] for c in contributions]
    idle, previous = 0.0, ready_at
    for record in monitor.steps:
        started = float(record["time"]) - float(record["wall_s"])
        idle += max(0.0, started - previous)
        previous = float(record["time"])
    total = max(1e-9, ended_at - ready_at)
    return {
        "broadcast_s": _stats(broadcast),
        "broadcast_to_first_rollout_s": _stats(to_first),
        "validation_latency_s": _stats(latency),
        "trainer_idle_s": round(idle, 3),
        "trainer_idle_fraction": round(idle / total, 3),
        "train_s": round(sum(float(r["wall_s"]) for r in monitor.steps), 3),
    }


def _excused(contribution: dict[str, Any]) -> bool:
    return DEFAULT_CHECK_CLASSES.get(str(contribution["failed_check"])) == CheckClass.excused


def reward_trend(rewards: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Mean rollout reward over the first and the last third of the steps (one step's 64 samples are too
    noisy to compare two single steps); None with fewer than three steps."""
    values = [float(r["rollout_reward"]) for r in rewards if r.get("rollout_reward") is not None]
    if len(values) < 3:
        return None
    third = len(values) // 3
    first, last = sum(values[:third]) / third, sum(values[-third:]) / third
    return {
        "steps_per_window": third,
        "first": round(first, 4),
        "last": round(last, 4),
        "change": round(last - first, 4),
    }


def reward_figure(rewards: list[dict[str, Any]]) -> Figure | None:
    """Both rewards per policy step (None with no reward at all). A step with no value, absent from the
    records or recorded without that reward, is a gap in its line, not a segment to the next step."""
    by_step = {int(r["step"]): r for r in rewards}
    if not by_step:
        return None
    steps = range(min(by_step), max(by_step) + 1)
    series = [
        Series(label, [(step, by_step.get(step, {}).get(key)) for step in steps], color)
        for key, label, color in (
            ("rollout_reward", "rollout reward (every sample read for the step)", "tab:blue"),
            ("task_reward", "batch reward (the samples trained on)", "tab:red"),
        )
    ]
    series = [s for s in series if any(y is not None for _, y in s.points)]
    if not series:
        return None
    values = [y for s in series for _, y in s.points if y is not None]
    return figure(
        series,
        title=f"devnet: mean task reward per policy step ({len(by_step)} steps)",
        xlabel="policy step",
        integer_x=True,
        ylabel="mean task reward",
        ylim=(min(0.0, *values), max(1.0, *values)),  # the whole 0-1 scale, widened if a reward leaves it
    )


def build_report(
    layout: DevnetLayout,
    monitor: Monitor,
    *,
    ready_at: float,
    ended_at: float,
    setup_s: float,
    stop: dict[str, Any],
    stopped_by: str,
) -> dict[str, Any]:
    contributions, slashes, bans = ledger_rows(layout.ledger_path)
    names = {m.node_id: m for m in layout.members}
    board = []
    if layout.ledger_path.is_file():
        with Ledger(layout.ledger_path) as ledger:
            board = [r.model_dump(mode="json") for r in leaderboard(ledger, top=1000)]
    rewards: list[dict[str, Any]] = [
        {
            "step": int(r["step"]),
            "rollout_reward": r.get("rollout_reward"),
            "task_reward": r.get("task_reward"),
            "samples": r.get("samples"),
            "wall_s": r.get("wall_s"),
        }
        for r in monitor.steps
    ]
    plot = None
    if (drawn := reward_figure(rewards)) is not None:
        plot = str(save(drawn, layout.root / "reward.png"))

    def who(node_id: str) -> dict[str, Any]:
        m = names.get(node_id)
        name = m.name if m else ("operator" if node_id == layout.operator.node_id else "unknown")
        return {"name": name, "node_id": node_id, "attack": m.attack if m else None}

    honest_ids = {m.node_id for m in layout.members if m.attack is None}
    honest_rejections = [c for c in contributions if c["node_id"] in honest_ids and not c["accepted"]]
    adversaries = [m for m in layout.members if m.attack is not None]
    banned_ids = {b["node_id"] for b in bans}
    return {
        "run_dir": str(layout.root),
        "stopped_by": stopped_by,
        "steps": len(rewards),
        "rewards": rewards,
        "plot": plot,
        "reward_trend": reward_trend(rewards),
        "leaderboard": [
            {
                **who(r["node_id"]),
                **{
                    k: r[k]
                    for k in (
                        "rank",
                        "accepted_files",
                        "rejected_files",
                        "accepted_samples",
                        "score",
                        "slashes",
                        "banned",
                    )
                },
            }
            for r in board
        ],
        "slashed": [
            {
                **who(s["node_id"]),
                "failed_check": s["failed_check"],
                "class": s["check_class"],
                "amount": s["amount"],
                "reason": s["reason"][:300],
            }
            for s in slashes
        ],
        "bans": [{**who(b["node_id"]), "reason": b["reason"][:300], "until": b["until"]} for b in bans],
        "honest": {
            "accepted_files": sum(1 for c in contributions if c["node_id"] in honest_ids and c["accepted"]),
            # Blamed rejections only; an excused one (the file's checkpoint already dropped because the file
            # came late, a validator error) is not the node's fault and is counted apart.
            "rejected_files": sum(1 for c in honest_rejections if not _excused(c)),
            "excused_files": sorted(str(c["failed_check"]) for c in honest_rejections if _excused(c)),
        },
        "adversaries": [
            {
                **who(m.node_id),
                "banned": m.node_id in banned_ids,
                "accepted_files": sum(
                    1 for c in contributions if c["node_id"] == m.node_id and c["accepted"]
                ),
                "rejected_files": sum(
                    1 for c in contributions if c["node_id"] == m.node_id and not c["accepted"]
                ),
            }
            for m in adversaries
        ],
        "dropouts": [
            dropout_outcome(layout, m, contributions, slashes, bans) for m in adversaries if is_dropout(m)
        ],
        "timings": timings(layout, monitor, contributions, ready_at, ended_at),
        "setup_s": round(setup_s, 1),
        "run_s": round(ended_at - ready_at, 1),
        "processes": stop,
    }


def dropout_line(a: dict[str, Any], d: dict[str, Any]) -> str:
    """A drop-out's outcome in words: what it broke, how that was judged, how long its group-mate took to work again."""
    head = f"adversary {a['name']} ({a['attack']}): "
    if not d["dropped"]:
        return head + f"did NOT drop out ({a['accepted_files']} files accepted)"
    files = ", ".join(
        f"{f['name']} {f['kind']}: {f['verdict'] or 'no verdict yet'}" for f in d["broken_batch_files"]
    )
    punished = (f"SLASHED {d['slashed']} times" if d["slashed"] else "not slashed") + (
        ", BANNED" if d["banned"] else ", not banned"
    )
    regrouped = d["regrouped"]
    after = (
        f"{regrouped['name']} regrouped (group {regrouped['group'][:8]}), made a file "
        f"{regrouped['kill_to_made_s']:.1f} s and had it accepted {regrouped['kill_to_accepted_s']:.1f} s after "
        "the kill ("
        + (
            "a group of a later policy step: the new step regrouped every member"
            if regrouped["new_step"]
            else "a group of the same policy step: the coordinator dissolved the broken group for its silent member"
        )
        + ")"
        if regrouped
        else f"NO survivor ({', '.join(d['survivors']) or 'none'}) had a file of a new group accepted"
    )
    return (
        head
        + f"killed itself (SIGKILL) mid-batch {d['batch']} of group {d['group'][:8]} as stage {d['stage']} after "
        f"{a['accepted_files']} files accepted; {punished}; the broken batch's files: {files or 'none handed in'} "
        f"({d['broken_batch_accepted']} accepted); {after}"
    )


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"devnet report ({r['stopped_by']}; {r['steps']} steps in {r['run_s']:.0f} s after "
        f"{r['setup_s']:.0f} s of set-up; files in {r['run_dir']})",
        "",
        "reward per step:",
    ]
    for row in r["rewards"]:
        rollouts = "-" if row.get("rollout_reward") is None else f"{row['rollout_reward']:.3f}"
        batch = "-" if row["task_reward"] is None else f"{row['task_reward']:.3f}"
        lines.append(
            f"  step {row['step']:>4}  rollouts {rollouts}  batch {batch}  "
            f"({row['samples']} samples, {row['wall_s']} s)"
        )
    if r.get("reward_trend"):
        t = r["reward_trend"]
        lines.append(
            f"  rollout reward, mean of the first {t['steps_per_window']} steps {t['first']:.3f} -> "
            f"of the last {t['steps_per_window']} {t['last']:.3f} ({t['change']:+.3f})"
        )
    if r["plot"]:
        lines.append(f"  plot: {r['plot']}")
    lines += ["", "leaderboard:"]
    for row in r["leaderboard"]:
        role = (
            row["name"]
            if row["name"] in ("operator", "unknown")
            else ("honest" if row["attack"] is None else f"attack:{row['attack']}")
        )
        lines.append(
            f"  {row['rank']:>2}. {row['name']:<22} {role:<23} {row['accepted_files']:>3} accepted "
            f"{row['rejected_files']:>3} rejected  score {row['score']:>8.1f}"
            f"{'  BANNED' if row['banned'] else ''}"
        )
    lines += ["", "slashed:" if r["slashed"] else "slashed: nobody"]
    for s in r["slashed"]:
        lines.append(
            f"  {s['name']:<22} -{s['amount']:g} ({s['class']}, {s['failed_check']}): {s['reason'][:140]}"
        )
    h = r["honest"]
    excused = h.get("excused_files") or []
    lines += [
        "",
        f"honest nodes: {h['accepted_files']} files accepted, {h['rejected_files']} rejected"
        + (
            f" ({len(excused)} more not counted, not their fault: {', '.join(sorted(set(excused)))})"
            if excused
            else ""
        ),
    ]
    dropped = {d["name"]: d for d in r.get("dropouts", [])}
    for a in r["adversaries"]:
        if a["name"] in dropped:
            lines.append(dropout_line(a, dropped[a["name"]]))
            continue
        lines.append(
            f"adversary {a['name']} ({a['attack']}): {'banned' if a['banned'] else 'NOT banned'}, "
            f"{a['rejected_files']} rejected, {a['accepted_files']} accepted"
        )
    t = r["timings"]
    lines += ["", "timings (s; mean / p50 / max over n):"]
    for key, label in (
        ("broadcast_s", "checkpoint broadcast"),
        ("broadcast_to_first_rollout_s", "broadcast -> first rollout"),
        ("validation_latency_s", "validation latency"),
    ):
        s = t[key]
        lines.append(
            f"  {label:<28} "
            + ("-" if s is None else f"{s['mean']:.2f} / {s['p50']:.2f} / {s['max']:.2f} (n={s['count']})")
        )
    lines.append(
        f"  {'trainer idle':<28} {t['trainer_idle_s']:.1f} s ({100 * t['trainer_idle_fraction']:.0f}% of "
        f"the run; {t['train_s']:.1f} s training)"
    )
    p = r["processes"]
    lines += [
        "",
        f"processes: {len(p['exit_codes'])} stopped, exit codes {p['exit_codes']}"
        + (f", killed after the grace period: {p['killed']}" if p["killed"] else "")
        + (f", STILL ALIVE: {p['alive']}" if p["alive"] else ""),
    ]
    if r.get("error"):
        lines += ["", f"error: {r['error']}"]
    return "\n".join(lines)
