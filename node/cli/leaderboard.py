"""`prime-node leaderboard`: the ranking of contributors, read from a validator's HTTP API.

Through the API's one client (p2p/validator_api.py): one wall-clock deadline (`timeout_s`) for the whole
answer, a byte limit, and the answer parsed into its wire types, so a hostile `--validator` gets one error
line and exit code 1, never a stall, a traceback or a control character on the terminal.
"""

from __future__ import annotations

import argparse
import datetime
import time

from pydantic import Field

from ...p2p.validator_api import (
    MAX_TOP,
    ApiUnreachable,
    Leaderboard,
    LeaderboardRow,
    NodeDetail,
    ValidatorApiClient,
    call_sync,
)
from ...p2p.wire import WireFormatError, parse_uint
from ..config import CommonSettings
from ..errors import NodeError
from .common import print_json
from .flags import Flag, SettingsFlags, load_settings


class LeaderboardUnavailable(NodeError):
    """The validator's leaderboard API cannot be reached or answered with an error."""


class LeaderboardSettings(CommonSettings):
    validator_url: str = Field(
        "http://127.0.0.1:8471",
        pattern=r"^https?://[^\s/]+(/\S*)?$",
        description="Base URL of a validator's API.",
    )
    timeout_s: float = Field(
        10.0, gt=0, le=300, description="Give up on the validator after this many seconds."
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("leaderboard", help="contributors ranked by accepted tokens")
    SettingsFlags(p, LeaderboardSettings).add(Flag("validator_url", "--validator", metavar="URL"))
    p.add_argument(
        "--top", type=_top, default=20, metavar="N", help="show the first N nodes (default %(default)s)"
    )
    p.add_argument(
        "--node", default=None, metavar="ID", help="one node's details (full id or a 6+ digit prefix)"
    )
    p.add_argument("--json", action="store_true", help="print the API's JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    settings = load_settings(args, LeaderboardSettings)
    base = settings.validator_url

    async def node(client: ValidatorApiClient) -> NodeDetail:
        return await client.node(base, args.node)

    async def board(client: ValidatorApiClient) -> Leaderboard:
        return await client.leaderboard(base, args.top)

    try:
        answer = call_sync(settings.timeout_s, node if args.node is not None else board)
    except ApiUnreachable as exc:
        raise LeaderboardUnavailable(
            f"{exc}; is `prime-node validator` running? Point --validator (or PRIME_NODE_VALIDATOR_URL) at its API"
        ) from None
    if args.json:
        print_json(answer.model_dump(mode="json"))
    elif isinstance(answer, NodeDetail):
        print(format_node(answer))
    elif isinstance(answer, Leaderboard):
        print(format_table(answer.nodes))
    return 0


def _top(text: str) -> int:
    try:
        return parse_uint(text, "--top", maximum=MAX_TOP, minimum=1)
    except WireFormatError:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {MAX_TOP}") from None


def _ago(ts: float | None) -> str:
    if ts is None:
        return "-"
    s = max(0.0, time.time() - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit} ago"
    return f"{s:.0f} s ago"


def _ban(row: LeaderboardRow) -> str:
    if not row.banned:
        return "-"
    if row.ban_permanent or row.banned_until is None:
        return "permanent"
    # banned_until is a Timestamp (at most 2^33): within what datetime can represent.
    return "until " + datetime.datetime.fromtimestamp(row.banned_until, datetime.UTC).strftime(
        "%Y-%m-%d %H:%M"
    )


def _hardware(hw: dict[str, str | int | float | bool | None]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(hw.items())) or "-"


def format_table(rows: list[LeaderboardRow]) -> str:
    if not rows:
        return "no contributions yet"
    header = (
        "#",
        "node",
        "tokens",
        "samples",
        "ok",
        "rejected",
        "score",
        "slashes",
        "ban",
        "last seen",
        "hardware",
    )
    lines = [header] + [
        (
            str(r.rank),
            r.node_id[:12],
            str(r.accepted_tokens),
            str(r.accepted_samples),
            str(r.accepted_files),
            str(r.rejected_files),
            f"{r.score:.1f}",
            str(r.slashes),
            _ban(r),
            _ago(r.last_seen),
            _hardware(r.hardware),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    padded = ("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines)
    return "\n".join(line.rstrip() for line in padded)


def format_node(detail: NodeDetail) -> str:
    n = detail.node
    out = [
        f"node        {n.node_id}",
        f"rank        {n.rank} of {detail.ranked}",
        f"accepted    {n.accepted_tokens} tokens, {n.accepted_samples} samples, {n.accepted_files} files",
        f"rejected    {n.rejected_files} files",
        f"score       {n.score:.1f} ({n.slashes} slashes, {n.slashed:.1f} removed)",
        f"ban         {_ban(n)}",
        f"last seen   {_ago(n.last_seen)}",
        f"hardware    {_hardware(n.hardware)}",
    ]
    if detail.recent:
        out.append("recent verdicts:")
        for c in detail.recent:
            verdict = "accepted" if c.accepted else f"rejected: {c.failed_check}: {c.reason}"
            out.append(
                f"  step {c.step:>5}  {c.file_hash[:12]}  {c.samples} samples  {c.tokens} tokens  {verdict}"
            )
    return "\n".join(out)
