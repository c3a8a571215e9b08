"""The leaderboard: ranking from the ledger, the JSON API on a real server, the CLI and the dashboard page."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest

from prime_node.node.cli.main import main
from prime_node.trainer.ledger import Ledger
from prime_node.trainer.ledger.activity import ban_causes, node_history, recent_activity, totals, verdict_pace
from prime_node.trainer.ledger.leaderboard import NodeLookupError, leaderboard, node_detail
from prime_node.trainer.ledger.slashing import CheckClass, SlashingPolicy
from prime_node.trainer.validator.dashboard import create_app, ledger_rewards, serve

from support.browser import chromium, severe_console_errors, wait_for, wait_loaded
from support.ledger import T0, node_id, signed_verdict

C, B, A, D, E = (node_id(20 + i) for i in range(5))
EXPECTED_ORDER = [C, B, A, D, E]
# Every leaderboard row (and `--node ID --json`'s "node") has exactly these fields (docs/validator.md).
LEADERBOARD_FIELDS = {
    "rank",
    "node_id",
    "accepted_tokens",
    "accepted_samples",
    "accepted_files",
    "rejected_files",
    "score",
    "slashes",
    "slashed",
    "banned",
    "ban_permanent",
    "banned_until",
    "last_step",
    "first_seen",
    "last_seen",
    "hardware",
}


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    """Five nodes: C most tokens; B, A tie on tokens, B has more samples; D cheated; E only heartbeats."""
    with Ledger(tmp_path / "ledger.sqlite") as led:
        led.record(signed_verdict(A, tokens=1000, samples=10, at=T0))
        led.record(signed_verdict(B, tokens=600, samples=12, at=T0 + 1))
        led.record(signed_verdict(B, tokens=400, samples=8, at=T0 + 2))
        led.record(signed_verdict(C, tokens=5000, samples=16, at=T0 + 3))
        led.record(signed_verdict(A, accepted=False, failed_check="schema", at=T0 + 4))
        led.record(signed_verdict(D, tokens=100, samples=1, at=T0 + 5))
        led.record(signed_verdict(D, accepted=False, failed_check="sampling", at=T0 + 6))
        led.record(
            signed_verdict(C, accepted=False, failed_check="signature", at=T0 + 7)
        )  # forged: not C's fault
        led.touch_node(E, seen_at=T0 + 8, hardware={"gpu": "none", "cpu_cores": 2})
        led.touch_node(C, seen_at=T0 + 9, hardware={"gpu": "H100", "gpu_memory_gb": 80})
        yield led


def test_ranking_by_tokens_then_samples(ledger):
    rows = leaderboard(ledger, now=T0 + 10)
    assert [r.node_id for r in rows] == EXPECTED_ORDER and [r.rank for r in rows] == [1, 2, 3, 4, 5]
    c, b, a, d, e = rows
    assert (c.accepted_tokens, c.accepted_samples, c.rejected_files, c.hardware["gpu"]) == (
        5000,
        16,
        0,
        "H100",
    )
    assert (b.accepted_tokens, b.accepted_samples, b.accepted_files) == (1000, 20, 2)
    assert (a.accepted_tokens, a.rejected_files, a.slashes, a.score, a.banned) == (
        1000,
        1,
        1,
        1.0 - 5.0,
        False,
    )
    assert (d.banned, d.ban_permanent, d.banned_until, d.slashes, d.last_step) == (
        True,
        False,
        T0 + 6 + 86400,
        1,
        3,
    )
    assert (e.accepted_tokens, e.last_seen, e.last_step, e.hardware) == (
        0,
        T0 + 8,
        None,
        {"gpu": "none", "cpu_cores": 2},
    )
    assert [r.node_id for r in leaderboard(ledger, top=2, now=T0)] == [C, B]
    assert not leaderboard(ledger, now=T0 + 6 + 86400)[3].banned  # the ban expired


def test_a_pipelined_groups_rows_count_once_each_member_its_share(tmp_path):
    # Each member's stage file holds the group's rows under its own id: weighted by its credit share, the group's
    # batch counts once on the leaderboard and in the totals, as in the score, and a monolithic node that did the
    # same work ranks with the group, not below each of its members.
    first, second, alone = node_id(40), node_id(41), node_id(42)
    with Ledger(tmp_path / "ledger.sqlite") as led:
        led.record(signed_verdict(first, tokens=300, samples=8, at=T0), credit_share=0.25)
        led.record(signed_verdict(second, tokens=300, samples=8, at=T0 + 1), credit_share=0.75)
        led.record(signed_verdict(alone, tokens=200, samples=4, at=T0 + 2))
        rows = {r.node_id: r for r in leaderboard(led, now=T0 + 10)}
        assert (rows[first].accepted_tokens, rows[first].accepted_samples, rows[first].accepted_files) == (
            75,
            2,
            1,
        )
        assert (rows[second].accepted_tokens, rows[second].accepted_samples) == (225, 6)
        assert [r.node_id for r in leaderboard(led, now=T0 + 10)] == [second, alone, first]
        assert node_detail(led, first, now=T0 + 10).node.accepted_tokens == 75
        assert (totals(led).accepted_tokens, totals(led).accepted_samples) == (500, 12)
        assert recent_activity(led, since=T0)[second].tokens == 225


def test_excused_rejections_are_not_counted_as_the_nodes_own(tmp_path):
    # A stage file excused because a group-mate cheated, or a file whose checkpoint never arrived, is not the
    # node's fault: the ranking, the activity window, the totals and the per-step history all leave it out of
    # `rejected`, as the API's field says; the node's own faults still count. The policy decides what is
    # excused, so an operator who makes a check a fault sees it counted.
    honest, cheat = node_id(50), node_id(51)
    verdicts = (
        signed_verdict(honest, tokens=300, samples=8, at=T0),
        signed_verdict(honest, accepted=False, failed_check="pipeline_group", at=T0 + 1),
        signed_verdict(honest, accepted=False, failed_check="checkpoint_unavailable", at=T0 + 2),
        signed_verdict(cheat, accepted=False, failed_check="pipeline", at=T0 + 3),
        signed_verdict(cheat, accepted=False, failed_check="schema", at=T0 + 4),
    )
    with Ledger(tmp_path / "ledger.sqlite") as led:
        for v in verdicts:
            led.record(v)
        rows = {r.node_id: r for r in leaderboard(led, now=T0 + 10)}
        assert (rows[honest].accepted_files, rows[honest].rejected_files) == (1, 0)
        assert rows[cheat].rejected_files == 2
        assert node_detail(led, honest, now=T0 + 10).node.rejected_files == 0
        assert len(node_detail(led, honest, now=T0 + 10).recent) == 3  # still listed, with their checks
        activity = recent_activity(led, since=T0)
        assert (activity[honest].rejected_files, activity[cheat].rejected_files) == (0, 2)
        assert (totals(led).accepted_files, totals(led).rejected_files) == (1, 2)
        assert [p.rejected for p in node_history(led, honest).points] == [0]
    strict = SlashingPolicy(check_classes={"checkpoint_unavailable": CheckClass.fault})
    with Ledger(tmp_path / "strict.sqlite", strict) as led:
        for v in verdicts:
            led.record(v)
        assert {r.node_id: r.rejected_files for r in leaderboard(led, now=T0 + 10)}[honest] == 1


def test_node_detail_by_id_or_prefix(ledger):
    detail = node_detail(ledger, D[:10], now=T0 + 10)
    assert detail.node.node_id == D and detail.node.rank == 4
    assert [c.accepted for c in detail.recent] == [False, True]  # newest first
    assert (
        detail.recent[0].failed_check == "sampling" and len(detail.bans) == 1 and len(detail.slash_log) == 1
    )
    assert node_detail(ledger, C).recent[0].accepted  # the forged file is not listed as C's
    for bad, status in (("xyz", 400), ("abc", 400), ("0" * 64, 404)):
        with pytest.raises(NodeLookupError) as info:
            node_detail(ledger, bad)
        assert info.value.status == status


def test_activity_in_a_window_bans_with_their_slash_and_pace(ledger):
    """What the swarm view reads from the ledger (trainer/ledger/activity.py)."""
    recent = recent_activity(ledger, since=T0 + 3)  # C's, A's rejection, D's two; C's forged file is not C's
    assert {n: (a.accepted_files, a.rejected_files, a.tokens) for n, a in recent.items()} == {
        C: (1, 0, 5000),
        A: (0, 1, 0),
        D: (1, 1, 100),
    }
    (cause,) = ban_causes(ledger, now=T0 + 10).values()  # D's fraud: the ban with the slash behind it
    assert (cause.failed_check, cause.reason) == ("sampling", "fraud: sampling check failed")
    assert cause.since == T0 + 6 and cause.until is not None and cause.until > T0 + 6
    assert ban_causes(ledger, now=cause.until + 1) == {}  # expired
    t = totals(ledger)
    assert (t.accepted_files, t.rejected_files, t.accepted_tokens) == (5, 2, 7100)
    pace = verdict_pace(ledger, since=T0 + 5)
    assert (
        pace.latency_over == 8 and pace.verdicts == 3 and pace.latency_s is not None and pace.latency_s >= 0
    )


@contextmanager
def running_dashboard(ledger: Ledger, **sources) -> Iterator[str]:
    """The real aiohttp app on 127.0.0.1 in its own thread and loop, so sync clients (CLI, browser) work."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        box["runner"], box["url"] = loop.run_until_complete(
            serve(create_app(ledger, **sources), "127.0.0.1", 0)
        )
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="dashboard-test-server", daemon=True)
    thread.start()
    assert started.wait(30), "dashboard did not start"
    try:
        yield box["url"]
    finally:
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


async def test_json_endpoints_on_a_real_server(ledger):
    runner, url = await serve(create_app(ledger), "127.0.0.1", 0)
    try:
        assert url.startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            async with http.get(f"{url}/api/leaderboard?top=3") as resp:
                assert resp.status == 200 and resp.headers["X-Content-Type-Options"] == "nosniff"
                body = await resp.json()
            assert [n["node_id"] for n in body["nodes"]] == EXPECTED_ORDER[:3]
            async with http.get(f"{url}/api/node/{A}") as resp:
                assert resp.status == 200 and (await resp.json())["node"]["rejected_files"] == 1
            for path, status in (
                ("/api/leaderboard?top=0", 400),
                ("/api/leaderboard?top=abc", 400),
                ("/api/leaderboard?top=%D9%A3", 400),  # an Arabic-Indic 3: ASCII digits only (p2p/wire.py)
                ("/api/leaderboard?top=+3", 400),
                ("/api/node/nothex", 400),
                (f"/api/node/{'0' * 64}", 404),
                ("/static/../ledger.py", 404),
            ):
                async with http.get(url + path) as resp:
                    assert resp.status == status, path
            async with http.get(f"{url}/api/swarm") as resp:
                view = await resp.json()
                assert (view["available"], view["nodes"], view["trainer"]) == (False, [], None)
            # One node's files per policy step (the page's history chart), by id or prefix, as /api/node.
            async with http.get(f"{url}/api/node/{D[:10]}/history") as resp:
                history = await resp.json()
            assert history["node_id"] == D
            assert [(p["step"], p["accepted"], p["rejected"], p["tokens"]) for p in history["points"]] == [
                (3, 1, 1, 100)
            ]
            for path, status in (("/api/node/nothex/history", 400), (f"/api/node/{'0' * 64}/history", 404)):
                async with http.get(url + path) as resp:
                    assert resp.status == status, path
            async with http.get(f"{url}/api/rewards") as resp:
                assert await resp.json() == {"available": False, "points": []}
            async with http.get(f"{url}/") as resp:
                assert "default-src 'self'" in resp.headers["Content-Security-Policy"]
                assert 'id="leaderboard"' in await resp.text()
    finally:
        await runner.cleanup()


def test_cli_json_and_text_against_the_server(ledger, capsys):
    with running_dashboard(ledger) as url:
        assert main(["leaderboard", "--validator", url, "--json", "--top", "4"]) == 0
        board = json.loads(capsys.readouterr().out)
        assert [n["node_id"] for n in board["nodes"]] == EXPECTED_ORDER[:4]
        assert main(["leaderboard", "--validator", url]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split()[:4] == ["#", "node", "tokens", "samples"]
        assert [line.split()[1] for line in lines[1:]] == [n[:12] for n in EXPECTED_ORDER]
        assert "until" in lines[4] and "gpu=H100" in lines[1]
        assert main(["leaderboard", "--validator", url, "--node", D[:8]]) == 0
        text = capsys.readouterr().out
        assert D in text and "rejected: sampling" in text and "rank        4 of 5" in text
        # The machine-readable form other commands read (prime-node status): docs/validator.md, "Leaderboard".
        assert main(["leaderboard", "--validator", url, "--node", D[:8], "--json"]) == 0
        detail = json.loads(capsys.readouterr().out)
        node = detail["node"]
        assert detail["ranked"] == 5 and node["node_id"] == D and node["rank"] == 4
        assert (node["accepted_tokens"], node["accepted_samples"], node["rejected_files"]) == (100, 1, 1)
        assert node["slashes"] == 1 and node["score"] == pytest.approx(1.0 - 100.0)  # credit, fraud slash
        assert node["banned"] and not node["ban_permanent"] and node["banned_until"] > T0
        assert node["last_seen"] >= T0 + 6 and node["hardware"] == {}
        assert set(node) == LEADERBOARD_FIELDS
        assert set(board["nodes"][0]) == LEADERBOARD_FIELDS and board["ranked"] == 5
        assert main(["leaderboard", "--validator", url, "--node", "0" * 64]) == 1
        assert "answered 404: no node" in capsys.readouterr().err


def test_the_api_never_serves_text_its_readers_refuse(ledger, capsys):
    """Free text in the ledger comes from peers (heartbeat hardware) and from exception messages (ban
    reasons): the server makes it printable as it builds its answers (`outgoing`), so the API's own client,
    which refuses control characters, still reads every row. Here the operator's ban reason spans lines and a
    node's GPU name carries escape sequences; both are shown with spaces in their place."""
    ledger.touch_node(E, seen_at=T0 + 9, hardware={"gpu_model": "H100\x1b[2J\x07", "cpu\n": "x86"})
    ledger.ban(E, "first line\nsecond line", until=None, at=T0 + 9)
    with running_dashboard(ledger) as url:
        assert main(["leaderboard", "--validator", url]) == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if E[:12] in line)
        assert "gpu_model=H100 [2J" in row and "cpu =x86" in row and "permanent" in row, row
        assert main(["leaderboard", "--validator", url, "--node", E, "--json"]) == 0
        detail = json.loads(capsys.readouterr().out)
    assert detail["bans"][0]["reason"] == "first line second line"
    assert all(line.isprintable() for line in [*out.splitlines(), json.dumps(detail, ensure_ascii=False)])
    raw = ledger.query("SELECT reason FROM bans WHERE node_id = ?", (E,))[0]["reason"]
    assert raw == "first line\nsecond line"  # the ledger keeps what was written


def test_cli_unreachable_validator_is_one_line_and_nonzero():
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "prime_node.node.cli.main",
                "leaderboard",
                "--validator",
                f"http://127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PRIME_NODE_DATA_DIR": "/nonexistent"},
        )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert (
        line.startswith("prime-node leaderboard: error: cannot reach the validator at http://127.0.0.1:")
        and "--validator" in line
    )


def test_dashboard_page_in_a_headless_browser(ledger, tmp_path):
    """The ledger-fed parts of the page (the live swarm view is covered over a real validator in
    tests/test_dashboard_browser.py): the ranking, the reward curve with its gaps, a node's history."""
    # The reward curve is the ledger's: the fixture's verdicts carry no recomputed rewards, so it starts empty;
    # then accepted files with their rewards arrive at steps 0-2 and 5-6 (none at 3 and 4: a gap).
    F, G = node_id(40), node_id(41)
    curve = {0: 0.2, 1: 0.35, 2: 0.3, 5: 0.65, 6: 0.8}  # mean task reward per step, over both files

    def record_rewards() -> None:
        for step, mean in curve.items():
            for node, samples in ((F, 8), (G, 24)):  # unequal sizes: the mean is per sample, not per file
                ledger.record(
                    signed_verdict(node, step=step, samples=samples, tokens=samples * 10, at=T0 + 20 + step),
                    task_reward_sum=mean * samples,
                )
        ledger.record(signed_verdict(F, step=7, samples=8, at=T0 + 30))  # no recomputed reward: left out
        ledger.record(signed_verdict(G, step=8, accepted=False, failed_check="rewards", at=T0 + 31))

    with (
        running_dashboard(ledger, rewards=ledger_rewards(ledger)) as url,
        chromium(tmp_path / "profile") as driver,
    ):
        driver.set_window_size(1200, 900)
        driver.get(url + "/")
        wait_loaded(driver)
        assert driver.execute_script("return document.getElementById('swarm-placeholder').hidden") is False
        assert driver.execute_script("return document.getElementById('reward-box').hidden") is True
        rows = driver.execute_script(
            "return [...document.querySelectorAll('#leaderboard-body tr')].map((tr) =>"
            " [tr.dataset.nodeId, tr.className, [...tr.cells].map((td) => td.textContent)]);"
        )
        assert [node for node, _, _ in rows] == EXPECTED_ORDER
        assert rows[0][2][:3] == ["1", C[:12] + "…", "5000"] and "row-banned" in rows[3][1]
        # D's history: one accepted and one rejected file at step 3, and its rejection's reason shown once.
        driver.execute_script(
            f"document.querySelector('#leaderboard-body tr[data-node-id=\"{D}\"]').click();"
        )
        wait_for(driver, "document.querySelector('#history-chart rect.bar-bad[data-step]')")
        bars = driver.execute_script(
            "return [...document.querySelectorAll('#history-chart rect[data-step]')]"
            ".map((r) => [r.dataset.step, r.dataset.accepted || r.dataset.rejected]);"
        )
        assert bars == [["3", "1"], ["3", "1"]], bars
        verdicts = driver.execute_script("return document.getElementById('node-verdicts').textContent")
        assert (
            "rejected — sampling: sampling check failed" in verdicts and "sampling: sampling:" not in verdicts
        )

        record_rewards()
        driver.refresh()
        wait_loaded(driver)
        chart = driver.execute_script(
            "const s = document.getElementById('reward-chart');"
            "return {lines: [...s.querySelectorAll('polyline.series')]"
            " .map((p) => p.getAttribute('points').split(' ').length),"
            " gaps: s.querySelectorAll('line.gap').length,"
            " dots: [...s.querySelectorAll('circle')].map((c) => [+c.dataset.step, +c.dataset.reward]),"
            " xticks: [...s.querySelectorAll('.xtick')].map((t) => t.textContent),"
            " yticks: [...s.querySelectorAll('.ytick')].map((t) => t.textContent)};"
        )
        assert dict(chart["dots"]) == pytest.approx(curve)  # exactly the ledger's steps and means
        # Steps 3 and 4 have no point: the line breaks there (two runs), a dashed line marks the gap.
        assert chart["lines"] == [3, 2] and chart["gaps"] - 1 == 1, (
            chart
        )  # the legend's sample is a `gap` too
        assert chart["yticks"] == ["0.00", "0.25", "0.50", "0.75", "1.00"] and {"0", "6"} <= set(
            chart["xticks"]
        )
        latest = driver.execute_script("return document.getElementById('reward-latest').textContent")
        assert "step 6, mean task reward 0.800 (32 rollouts)" in latest
        assert severe_console_errors(driver) == []  # no CSP violation, no failed request
