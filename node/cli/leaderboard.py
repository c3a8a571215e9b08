"""`prime-node leaderboard`: the ranking of contributors, read from a validator's HTTP API."""

from __future__ import annotations

import argparse
import datetime
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from pydantic import Field

from ...p2p.wire import WireFormatError, loads_strict, parse_uint
from ..config import CommonSettings
from ..errors import NodeError
from .common import common_flags, load_settings, print_json

MAX_RESPONSE_BYTES = 16 * 1024 * 1024
MAX_TOP = 1000  # the validator's own limit


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
    p = sub.add_parser("leaderboard", parents=[common_flags()], help="contributors ranked by accepted tokens")
    p.add_argument(
        "--validator", default=None, metavar="URL", help="validator API (default http://127.0.0.1:8471)"
    )
    p.add_argument("--top", type=_top, default=20, metavar="N", help="show the first N nodes (default 20)")
    p.add_argument(
        "--node", default=None, metavar="ID", help="one node's details (full id or a 6+ digit prefix)"
    )
    p.add_argument("--json", action="store_true", help="print the API's JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    settings = load_settings(args, LeaderboardSettings, {"validator_url": "validator"})
    base = settings.validator_url.rstrip("/")
    if args.node is not None:
        detail = fetch_json(f"{base}/api/node/{urllib.parse.quote(args.node, safe='')}", settings.timeout_s)
        if args.json:
            print_json(detail)
        else:
            print(format_node(detail))
        return 0
    board = fetch_json(f"{base}/api/leaderboard?top={args.top}", settings.timeout_s)
    if args.json:
        print_json(board)
    else:
        print(format_table(board["nodes"]))
    return 0


def _top(text: str) -> int:
    try:
        return parse_uint(text, "--top", maximum=MAX_TOP, minimum=1)
    except WireFormatError:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {MAX_TOP}") from None


def fetch_json(url: str, timeout_s: float) -> Any:
    """GET a JSON document, turning every failure into one LeaderboardUnavailable that names the URL."""
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read(MAX_RESPONSE_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise LeaderboardUnavailable(f"{url} answered {exc.code}: {_error_text(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise LeaderboardUnavailable(
            f"cannot reach the validator at {url} ({reason}); is `prime-node validator` running? "
            "Point --validator (or PRIME_NODE_VALIDATOR_URL) at its API"
        ) from None
    if len(body) > MAX_RESPONSE_BYTES:
        raise LeaderboardUnavailable(f"{url} sent more than {MAX_RESPONSE_BYTES} bytes")
    try:
        return loads_strict(body, "the leaderboard")  # NaN or infinity would reach the table's formatting
    except WireFormatError as exc:
        raise LeaderboardUnavailable(
            f"{url} did not answer with strict JSON ({exc}); is that a prime-node validator?"
        ) from None


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read(65536)).get("error", exc.reason))
    except (ValueError, AttributeError, OSError):
        return str(exc.reason)


def _ago(ts: float | None) -> str:
    if ts is None:
        return "-"
    s = max(0.0, time.time() - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit} ago"
    return f"{s:.0f} s ago"


def _ban(row: dict[str, Any]) -> str:
    if not row["banned"]:
        return "-"
    if row["ban_permanent"]:
        return "permanent"
    return "until " + datetime.datetime.fromtimestamp(row["banned_until"], datetime.UTC).strftime(
        "%Y-%m-%d %H:%M"
    )


def _hardware(hw: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(hw.items())) or "-"


def format_table(rows: list[dict[str, Any]]) -> str:
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
            str(r["rank"]),
            r["node_id"][:12],
            str(r["accepted_tokens"]),
            str(r["accepted_samples"]),
            str(r["accepted_files"]),
            str(r["rejected_files"]),
            f"{r['score']:.1f}",
            str(r["slashes"]),
            _ban(r),
            _ago(r["last_seen"]),
            _hardware(r["hardware"]),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    padded = ("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines)
    return "\n".join(line.rstrip() for line in padded)


def format_node(detail: dict[str, Any]) -> str:
    n = detail["node"]
    out = [
        f"node        {n['node_id']}",
        f"rank        {n['rank']}" + (f" of {detail['ranked']}" if "ranked" in detail else ""),
        f"accepted    {n['accepted_tokens']} tokens, {n['accepted_samples']} samples, "
        f"{n['accepted_files']} files",
        f"rejected    {n['rejected_files']} files",
        f"score       {n['score']:.1f} ({n['slashes']} slashes, {n['slashed']:.1f} removed)",
        f"ban         {_ban(n)}",
        f"last seen   {_ago(n['last_seen'])}",
        f"hardware    {_hardware(n['hardware'])}",
    ]
    if detail["recent"]:
        out.append("recent verdicts:")
        for c in detail["recent"]:
            verdict = "accepted" if c["accepted"] else f"rejected: {c['failed_check']}: {c['reason']}"
            out.append(
                f"  step {c['step']:>5}  {c['file_hash'][:12]}  {c['samples']} samples  "
                f"{c['tokens']} tokens  {verdict}"
            )
    return "\n".join(out)
