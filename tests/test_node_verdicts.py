"""The node learns its verdicts and its rank from a real validator (swarm, checks, ledger, HTTP API) on 127.0.0.1.

Files are handed off by the daemon's own Delivery; the VerdictWatcher asks the validator's API (found in its
operator-signed DHT announcement) and the leaderboard refresher reads the node's row. Hostile answers (a
verdict signed by another key, a verdict about another file) are refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import pytest
from aiohttp import web

from prime_node.node.cli.main import main
from prime_node.node.contributor.delivery import Delivery
from prime_node.node.contributor.leaderboard import refresh_leaderboard
from prime_node.node.contributor.outbox import Outbox
from prime_node.node.contributor.state import NodeState
from prime_node.node.contributor.status import StatusServer
from prime_node.node.contributor.validator_api import ValidatorApi, ValidatorApiError, ValidatorEndpoint
from prime_node.node.contributor.verdicts import VerdictWatcher
from prime_node.p2p.identity import Identity
from prime_node.p2p.verdicts import Verdict, sign
from prime_node.proofs.rollout_file import signature_path, write_rollout_file

from support.swarm import fleet, wait_until
from support.validator import (
    OPERATOR,
    RUN,
    publish_checkpoint,
    rows_for,
    running_validator,
    validator_settings,
)


def commit(outbox: Outbox, rows: list, node: Identity, name: str) -> str:  # noqa: ANN001
    staged = outbox.staging_path(name)
    write_rollout_file(staged, rows, node)
    sha256 = json.loads(signature_path(staged).read_text())["sha256"]
    outbox.commit(sha256, staged, signature_path(staged))
    return sha256


def metric(state: NodeState, verdict: str) -> float:
    return state.metrics.verdicts.labels(verdict=verdict)._value.get()


async def serve_json(routes: dict[str, bytes]) -> tuple[web.AppRunner, str]:
    """A hostile 'validator API' on 127.0.0.1 answering fixed bodies."""
    app = web.Application()

    def handler(body: bytes):  # noqa: ANN202
        async def answer(_request: web.Request) -> web.Response:
            return web.Response(body=body, content_type="application/json")

        return answer

    for path, body in routes.items():
        app.router.add_get(path, handler(body))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


async def test_verdicts_and_rank_are_learned_checked_persisted_and_shown(
    tmp_path: Path,
    world,
    capsys: pytest.CaptureFixture[str],  # noqa: ANN001
) -> None:
    checkpoint, engine, tasks = world
    node = Identity.generate()
    honest = rows_for(engine, tasks, node)
    other = rows_for(engine, tasks, node, batch_counter=1)  # other work: the honest file's samples are taken
    cheat = [
        dataclasses.replace(
            other[0],
            task_reward=1.0 - other[0].task_reward,
            reward=1.0 - other[0].task_reward - other[0].length_penalty,
        ),
        *other[1:],
    ]
    outbox = Outbox(tmp_path / "node" / "rollouts")
    good = commit(outbox, honest, node, "honest.parquet")
    time.sleep(0.01)  # pending/ is sent oldest first: the honest file goes first
    bad = commit(outbox, cheat, node, "cheat.parquet")

    settings = validator_settings(tmp_path / "validator")
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    state = NodeState(node.node_id, OPERATOR.node_id)
    async with running_validator(settings) as running, fleet(RUN, OPERATOR) as group:
        sender = await group.add(node, bootstrap=running.maddrs[:1], reachability="public")
        api = ValidatorApi(sender, node.node_id, timeout_s=5.0)
        try:
            await wait_until(lambda: _api_announced(api), 15)
            watcher = VerdictWatcher(api, outbox, state, poll_s=0.2, max_poll_s=0.5, timeout_s=600)
            delivery = Delivery(
                sender, outbox, state, retry_s=0.2, max_retry_s=1.0, on_receipt=watcher.receipted
            )
            for entry in outbox.pending_entries():
                await delivery.deliver(entry)
            assert (state.rollouts.handed_off, state.awaiting_verdicts) == (2, 2)

            task = asyncio.create_task(watcher.run(), name="verdicts")
            try:
                await wait_until(lambda: _settled(state), 60)
            finally:
                task.cancel()
            assert (state.rollouts.accepted, state.rollouts.rejected, state.awaiting_verdicts) == (1, 1, 0)
            assert (metric(state, "accepted"), metric(state, "rejected")) == (1, 1)
            assert (
                "rejected by the validator (rewards)" in (state.last_error or "")
                and bad[:16] in state.last_error
            )
            stored = json.loads((outbox.sent / f"{good}.verdict.json").read_text())
            assert (
                stored["document"]["accepted"] is True
                and stored["document"]["validator_id"] == OPERATOR.node_id
            )
            assert not (
                outbox.sent / f"{good}.parquet"
            ).exists()  # the validator holds it; receipt and verdict stay
            assert (outbox.sent / f"{good}.receipt.json").exists()

            # The leaderboard row is read from the validator's API and shown by `prime-node status`.
            await refresh_leaderboard(api, state)
            assert state.leaderboard_status == "ok", state.leaderboard_status
            board = state.leaderboard
            assert (
                board is not None
                and board.rank == 1
                and board.accepted_files == 1
                and board.rejected_files == 1
            )
            assert board.validator_url == running.dashboard_url
            text, as_json = await _status_cli(tmp_path / "node", state, capsys)
            assert f"rank 1, score {board.score:.3f}" in text and "1 accepted, 1 rejected" in text, text
            assert as_json["leaderboard"]["rank"] == 1 and as_json["rollouts"]["accepted"] == 1

            # Hostile answers: a verdict signed by a key that is not the receipt's, and a replayed verdict
            # about another file (signed by the right key) are both refused.
            rogue = Identity.generate()
            forged = sign(
                Verdict(
                    file_hash=bad,
                    node_id=node.node_id,
                    step=0,
                    samples=2,
                    tokens=10,
                    accepted=True,
                    validator_id=rogue.node_id,
                    decided_at=time.time(),
                ),
                rogue,
            ).to_json()
            runner, url = await serve_json(
                {
                    f"/api/verdict/{bad}/{node.node_id}": forged,
                    f"/api/verdict/{'0' * 64}/{node.node_id}": json.dumps(stored).encode(),
                }
            )
            try:
                for sha in (bad, "0" * 64):
                    try:
                        await api.verdict(ValidatorEndpoint(OPERATOR.node_id, url), sha)
                    except ValidatorApiError as exc:
                        assert "not a trusted key" in str(exc) or "another file" in str(exc), exc
                    else:
                        raise AssertionError(f"a hostile verdict for {sha[:8]} was accepted")
            finally:
                await runner.cleanup()
        finally:
            await api.close()

        # A restart keeps what was learned: counts, metrics, nothing left to ask.
        again = NodeState(node.node_id, OPERATOR.node_id)
        restarted = VerdictWatcher(api, Outbox(outbox.root), again, poll_s=0.2, max_poll_s=0.5, timeout_s=600)
        await asyncio.to_thread(restarted.restore)
        assert (again.rollouts.accepted, again.rollouts.rejected, restarted.awaiting) == (1, 1, 0)
        assert metric(again, "accepted") == 1

    # With the validator gone, the status says so instead of showing a stale rank.
    await refresh_leaderboard(api, state)
    await api.close()
    assert state.leaderboard is None and state.leaderboard_status.startswith("validator unreachable")


async def _api_announced(api: ValidatorApi) -> bool:
    return bool(await api.endpoints())


async def _settled(state: NodeState) -> bool:
    return state.rollouts.accepted + state.rollouts.rejected == 2


async def _status_cli(
    data_dir: Path, state: NodeState, capsys: pytest.CaptureFixture[str]
) -> tuple[str, dict]:
    """`prime-node status` (text and --json) against a status API serving `state` (the CLI runs its own
    event loop, so it runs on a thread here)."""
    server = StatusServer(data_dir, state.to_status, state.metrics)
    await server.start()
    try:
        outputs = []
        for extra in ([], ["--json"]):
            capsys.readouterr()
            code = await asyncio.to_thread(main, ["status", "--data-dir", str(data_dir), *extra])
            out, err = capsys.readouterr()
            assert code == 0, err
            outputs.append(out)
    finally:
        await server.stop()
    return outputs[0], json.loads(outputs[1])


def test_an_announced_url_with_an_unspecified_host_is_made_routable() -> None:
    from prime_node.node.contributor.validator_api import api_base
    from prime_node.p2p.swarm import ValidatorAnnouncement

    def announced(api_url: str | None, addresses: list[str]) -> ValidatorAnnouncement:
        return ValidatorAnnouncement(
            node_id="a" * 64,
            peer_id="12D3KooW" + "x" * 44,
            addresses=addresses,
            max_rollout_bytes=1 << 20,
            published_at=time.time(),
            api_url=api_url,
        )

    maddrs = ["/ip4/203.0.113.9/tcp/31337/p2p/12D3KooWabc"]
    assert api_base(announced("http://0.0.0.0:8471", maddrs)) == "http://203.0.113.9:8471"
    assert api_base(announced("http://[::]:8471/", ["/ip6/2001:db8::1/tcp/1"])) == "http://[2001:db8::1]:8471"
    assert api_base(announced("https://validator.example:443/", maddrs)) == "https://validator.example:443"
    assert api_base(announced("http://0.0.0.0:8471", [])) is None  # nowhere to dial: no endpoint
    assert api_base(announced(None, maddrs)) is None
    assert api_base(announced("http://:::8471", maddrs)) is None  # unbracketed IPv6: unusable, not a crash


async def test_a_verdict_nobody_could_sign_is_refused_and_the_watcher_goes_on(tmp_path: Path) -> None:
    """A validator API (a real aiohttp server, announced by the operator in the DHT) answers one file's verdict
    with a document whose reason holds a lone surrogate: valid JSON (`"\\ud800"`), but no UTF-8 form, so no key
    can have signed it. Checking its signature once raised UnicodeEncodeError out of the verdict client and
    ended the supervised `verdicts` task (and with it the node). It must be a refused verdict like any other:
    counted, asked again later, while the honest verdict on the node's other file is learned meanwhile."""
    node = Identity.generate()
    hostile_sha, honest_sha = "aa" * 32, "bb" * 32
    honest = sign(
        Verdict(
            file_hash=honest_sha,
            node_id=node.node_id,
            step=0,
            samples=2,
            tokens=10,
            accepted=True,
            validator_id=OPERATOR.node_id,
            decided_at=time.time(),
        ),
        OPERATOR,
    )
    document = {
        **honest.document.payload(),
        "file_hash": hostile_sha,
        "accepted": False,
        "failed_check": "sampling",
        "reason": "@@",
    }
    unsignable = json.dumps({"document": document, "signature": "ab" * 64}).replace('"@@"', '"row 0 \\ud800"')
    asked: dict[str, int] = {hostile_sha: 0, honest_sha: 0}

    async def answer(request: web.Request) -> web.Response:
        sha = request.match_info["file_hash"]
        asked[sha] = asked.get(sha, 0) + 1
        body = unsignable.encode() if sha == hostile_sha else honest.to_json()
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/api/verdict/{file_hash}/{node_id}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    state = NodeState(node.node_id, OPERATOR.node_id)
    try:
        async with fleet(RUN, OPERATOR) as group:
            validator = await group.add(OPERATOR, roles=("validator",))
            validator.api_url = url
            await validator.publish_validator()
            sender = await group.add(node)
            api = ValidatorApi(sender, node.node_id, timeout_s=5.0)
            watcher = VerdictWatcher(
                api, Outbox(tmp_path / "rollouts"), state, poll_s=0.1, max_poll_s=0.2, timeout_s=600
            )
            try:
                await wait_until(lambda: _api_announced(api), 15)
                for sha in (hostile_sha, honest_sha):  # the hostile file first: the old code died on it
                    body = {"sha256": sha, "receiver": OPERATOR.node_id, "received_at": time.time()}
                    watcher.receipted({"body": body, "signature": "00" * 64})
                task = asyncio.create_task(watcher.run(), name="verdicts")

                async def went_on() -> bool:
                    if task.done():
                        raise AssertionError(f"the verdicts task ended: {task.exception()!r}")
                    return asked[hostile_sha] >= 3 and state.rollouts.accepted == 1

                try:
                    await wait_until(went_on, 30)
                finally:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            finally:
                await api.close()
    finally:
        await runner.cleanup()
    assert (state.rollouts.accepted, state.rollouts.rejected, watcher.awaiting) == (1, 0, 1)
    assert state.metrics.verdict_lookup_failures._value.get() >= 3
    assert (tmp_path / "rollouts" / "sent" / f"{honest_sha}.verdict.json").exists()
