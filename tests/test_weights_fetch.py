"""Verified multi-source fetch against real servers on 127.0.0.1, honest and hostile."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from prime_node.p2p.weights import store as store_module
from prime_node.p2p.weights.errors import FetchError, ReplayError, StoreError
from prime_node.p2p.weights.fetch import Fetcher, FetchSettings
from prime_node.p2p.weights.sources import SelectionSettings
from prime_node.p2p.weights.store import Store

from support.weights import hostile, operator, publish_steps, same_tree, serving

# Short enough to keep the file quick, long enough that a loaded 2-core CI machine pausing the process for
# half a second is not taken for a silent source (tests of stalling set their own, shorter, timeout).
FAST = dict(
    stall_timeout_s=3.0,
    connect_timeout_s=3.0,
    manifest_timeout_s=5.0,
    durable=False,
    selection=SelectionSettings(backoff_base_s=0.02, backoff_max_s=0.2),
)


def fetcher(sources: list[str], out: Path, **overrides: object) -> Fetcher:
    settings = FetchSettings(**{**FAST, **overrides})  # type: ignore[arg-type]
    return Fetcher(sources, operator().node_id, Store(out), settings)


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    publish_steps(tmp_path, operator(), [3])
    return tmp_path / "origin"


def checkpoint(root: Path, step: int = 3) -> Path:
    return root / f"step-{step:012d}" / "checkpoint"


def by_url(result, url: str) -> dict:
    return next(s for s in result.sources if s["url"] == url)


async def test_fetch_from_three_sources_is_byte_identical_and_atomic(origin: Path, tmp_path: Path) -> None:
    async with serving(origin) as a, serving(origin) as b, serving(origin) as c:
        result = await fetcher([a.url, b.url, c.url], tmp_path / "out").fetch()
    assert same_tree(checkpoint(origin), result.checkpoint_dir)
    assert result.checkpoint_dir == checkpoint(tmp_path / "out")
    assert not list((tmp_path / "out" / ".partial").iterdir())  # nothing half-written is left anywhere
    assert sum(s["shards_ok"] for s in result.sources) == len(result.manifest.body.shards)
    assert sum(1 for s in result.sources if s["shards_ok"]) >= 2  # the load was spread over sources


async def test_flipped_bit_on_one_source_is_refetched_elsewhere_and_penalised(
    origin: Path, tmp_path: Path
) -> None:
    async with serving(origin) as good, hostile(origin, 3, "flip") as bad:
        result = await fetcher([bad.url, good.url], tmp_path / "out").fetch()
    assert same_tree(checkpoint(origin), result.checkpoint_dir)
    bad_report, good_report = by_url(result, bad.url), by_url(result, good.url)
    assert bad_report["shards_corrupt"] >= 1 and bad_report["shards_ok"] == 0
    assert "SHA-256 mismatch" in bad_report["last_errors"][-1]
    assert bad_report["success"] < good_report["success"] == 1.0


@pytest.mark.parametrize("fault", ["short", "long"])
async def test_wrong_length_shard_is_refused(origin: Path, tmp_path: Path, fault: str) -> None:
    async with serving(origin) as good, hostile(origin, 3, fault) as bad:
        result = await fetcher([bad.url, good.url], tmp_path / "out").fetch()
    assert same_tree(checkpoint(origin), result.checkpoint_dir)
    assert any("bytes" in e for e in by_url(result, bad.url)["last_errors"])


async def test_every_source_corrupt_fails_with_blame_and_keeps_only_what_verified(
    origin: Path, tmp_path: Path
) -> None:
    async with hostile(origin, 3, "flip", shards={4}) as bad1, hostile(origin, 3, "flip", shards={4}) as bad2:
        with pytest.raises(FetchError, match="shard 4 of step 3") as info:
            await fetcher([bad1.url, bad2.url], tmp_path / "out", max_attempts_per_shard=3).fetch()
    blamed = {(b["shard"], b["source"]) for b in info.value.blame}
    assert {(4, bad1.url), (4, bad2.url)} <= blamed
    assert all(b["corrupt"] for b in info.value.blame)
    out = Store(tmp_path / "out")
    assert out.versions() == []  # never in place
    # The shards that verified against the signed manifest are kept (whoever sent them); nothing of shard 4 is.
    journal = json.loads((out.partial_dir(3) / "progress.json").read_bytes())
    assert "4" not in journal["done"] and journal["partial"] == {} and len(journal["done"]) >= 1
    async with hostile(origin, 3) as good:
        result = await fetcher([good.url], tmp_path / "out").fetch()
    assert same_tree(checkpoint(origin), result.checkpoint_dir)
    assert result.resumed_bytes > 0 and sum(good.requests.values()) < len(result.manifest.body.shards)


async def test_source_serving_an_older_step_is_not_used(tmp_path: Path) -> None:
    publish_steps(tmp_path, operator(), [1, 2])
    old_root = tmp_path / "old"
    old_root.mkdir()
    shutil.copytree(tmp_path / "origin" / "step-000000000001", old_root / "step-000000000001")
    async with serving(tmp_path / "origin") as new, serving(old_root) as old:
        result = await fetcher([old.url, new.url], tmp_path / "out").fetch()
        assert result.manifest.step == 2
        assert by_url(result, old.url)["excluded"].startswith("serves step 1")
        # Once step 2 is held, a source offering only step 1 is a replay and is refused.
        with pytest.raises(ReplayError, match="older than step 2"):
            await fetcher([old.url], tmp_path / "out").fetch()
        with pytest.raises(FetchError, match="asked for step 1|HTTP 404"):
            await fetcher([new.url], tmp_path / "out2").fetch(step=7)


async def test_source_answering_with_another_steps_manifest_is_refused(tmp_path: Path) -> None:
    publish_steps(tmp_path, operator(), [1, 2])
    wrong = Store(tmp_path / "origin").manifest_bytes(1)
    async with (
        serving(tmp_path / "origin") as good,
        hostile(tmp_path / "origin", 2, manifest_bytes=wrong) as liar,
    ):
        result = await fetcher([liar.url, good.url], tmp_path / "out").fetch(step=2)
    assert "step 1 when asked for step 2" in by_url(result, liar.url)["excluded"]


@pytest.mark.parametrize("fault", ["404", "html", "html-manifest", "404-manifest"])
async def test_source_answering_404_or_html_is_skipped(origin: Path, tmp_path: Path, fault: str) -> None:
    async with serving(origin) as good, hostile(origin, 3, fault) as bad:
        result = await fetcher([bad.url, good.url], tmp_path / "out").fetch()
    assert same_tree(checkpoint(origin), result.checkpoint_dir)
    report = by_url(result, bad.url)
    assert report["shards_ok"] == 0
    assert any(w in " ".join(report["last_errors"]) for w in ("404", "text/html", "not valid JSON"))


async def test_stalling_source_times_out_and_fetch_switches(origin: Path, tmp_path: Path) -> None:
    async with serving(origin) as good, hostile(origin, 3, "stall") as staller:
        result = await fetcher([staller.url, good.url], tmp_path / "out", stall_timeout_s=0.3).fetch()
        # With a long stall timeout the stalled shards are not waited for: they are hedged on the good source.
        hedged = await fetcher([staller.url, good.url], tmp_path / "out2", stall_timeout_s=30).fetch()
    assert same_tree(checkpoint(origin), result.checkpoint_dir) and same_tree(
        checkpoint(origin), hedged.checkpoint_dir
    )
    report = by_url(result, staller.url)
    assert report["shards_ok"] == 0 and (
        "stalled" in " ".join(report["last_errors"]) or report["shards_lost"] >= 1
    )
    assert hedged.seconds < 10 and by_url(hedged, staller.url)["shards_ok"] == 0
    assert hedged.hedges >= 1 and hedged.hedges_won >= 1


async def test_a_source_dying_mid_transfer_is_replaced_from_byte_0(origin: Path, tmp_path: Path) -> None:
    async with hostile(origin, 3) as good, hostile(origin, 3, "die") as dying:
        result = await fetcher([dying.url, good.url], tmp_path / "out").fetch()
    assert same_tree(checkpoint(origin), result.checkpoint_dir)
    assert by_url(result, dying.url)["shards_failed"] >= 1
    # The half a dying source delivered is never completed by another source's bytes (its digest could not
    # say whose bytes were wrong): the other source is asked for whole shards, and is charged nothing.
    assert good.ranges == []
    assert by_url(result, good.url)["shards_failed"] == by_url(result, good.url)["shards_corrupt"] == 0


async def test_a_prefix_from_an_earlier_run_that_does_not_verify_blames_nobody(
    origin: Path, tmp_path: Path
) -> None:
    async with hostile(origin, 3, "garbage-die") as source:
        # A first run leaves zeros on disk as the start of some shards, journaled as this source's bytes.
        with pytest.raises(FetchError):
            await fetcher([source.url], tmp_path / "out", max_attempts_per_shard=1).fetch()
        journal = json.loads((Store(tmp_path / "out").partial_dir(3) / "progress.json").read_bytes())
        assert journal["partial"] and {p["writer"] for p in journal["partial"].values()} == {source.url}
        # The source heals. Resumed, those shards fail their digest: the same source is asked for the whole
        # shard, which verifies. The prefix came from an earlier run (our disk may have lost it): nobody is
        # charged, no attempt is used up, and nothing verified is thrown away.
        source.fault = None
        source.requests.clear()
        source.ranges.clear()
        result = await fetcher([source.url], tmp_path / "out", max_attempts_per_shard=1).fetch()
    assert same_tree(checkpoint(origin), result.checkpoint_dir)
    report = by_url(result, source.url)
    assert report["shards_corrupt"] == report["shards_failed"] == 0 and report["last_errors"] == []
    resumed = {index for index, _ in source.ranges}
    assert resumed and all(source.requests[i] == 2 for i in resumed)  # resumed, then asked from byte 0


async def test_unreachable_sources_and_no_sources(origin: Path, tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="no source served a valid manifest"):
        await fetcher(["http://127.0.0.1:9"], tmp_path / "out").fetch()
    with pytest.raises(FetchError, match="no sources"):
        Fetcher([], operator().node_id, Store(tmp_path / "out"))


async def test_free_disk_is_checked_before_downloading(origin: Path, tmp_path: Path, monkeypatch) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(
        store_module.shutil,
        "disk_usage",
        lambda p: real(p)._replace(free=store_module.FREE_DISK_MARGIN + 1000),
    )
    async with serving(origin) as good:
        with pytest.raises(StoreError, match="not enough free disk"):
            await fetcher([good.url], tmp_path / "out").fetch()


async def test_already_held_version_is_not_fetched_again(origin: Path, tmp_path: Path) -> None:
    async with serving(origin) as good:
        first = await fetcher([good.url], tmp_path / "out").fetch()
        second = await fetcher([good.url], tmp_path / "out").fetch()
    assert not first.already_held and second.already_held and second.fetched_bytes == 0
    state = json.loads((tmp_path / "out" / "high-water.json").read_bytes())
    assert state["step"] == 3


def _foreign(origin: Path) -> bytes:
    from prime_node.p2p.weights.manifest import ManifestBody, sign_manifest

    body = json.loads(Store(origin).manifest_bytes(3))["body"]
    body["signer"] = operator(8).node_id
    return sign_manifest(ManifestBody.model_validate(body), operator(8)).to_bytes()


def _edited(origin: Path) -> bytes:
    doc = json.loads(Store(origin).manifest_bytes(3))
    doc["body"]["files"][1]["size"] += 1
    return json.dumps(doc).encode()


def _traversal(origin: Path) -> bytes:
    body = json.loads(Store(origin).manifest_bytes(3))["body"]
    body["files"][0]["path"] = "../../.bashrc"
    return json.dumps({"body": body, "signature": operator().sign_document(body).hex()}).encode()


def _oversized(origin: Path) -> bytes:
    return Store(origin).manifest_bytes(3)[:-1] + b" " * (9 << 20) + b"}"


@pytest.mark.parametrize(
    "make,reason",
    [
        (_foreign, "another key"),
        (_edited, "another key or edited"),
        (_traversal, "files.0.path"),
        (_oversized, "over the"),
    ],
)
async def test_source_with_a_bad_manifest_is_excluded_before_any_shard(
    origin: Path, tmp_path: Path, make, reason
) -> None:
    async with serving(origin) as good, hostile(origin, 3, manifest_bytes=make(origin)) as bad:
        result = await fetcher([bad.url, good.url], tmp_path / "out").fetch()
        with pytest.raises(FetchError, match=reason):
            await fetcher([bad.url], tmp_path / "alone").fetch()
    assert same_tree(checkpoint(origin), result.checkpoint_dir)
    assert reason in by_url(result, bad.url)["excluded"]
    assert sum(bad.requests.values()) == 0  # not one shard was asked of it
    assert not (tmp_path / "alone" / ".partial").exists() or not list(
        (tmp_path / "alone" / ".partial").iterdir()
    )


async def test_cancelled_fetch_stops_at_once_and_a_rerun_resumes(origin: Path, tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    async with hostile(origin, 3, "stall") as source:
        # Every transfer sends half a shard and then blocks its thread in a read for up to the stall timeout.
        task = asyncio.create_task(
            fetcher([source.url], tmp_path / "out", stall_timeout_s=60, chunk_bytes=8192).fetch()
        )
        # Wait (bounded) for a transfer to send its half, then give the fetcher a second to take it in: on a
        # loaded machine a fixed sleep from the start could end before any transfer began (nothing to resume).
        for _ in range(300):
            if source.stalled:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("no transfer sent its half within 30 s")
        await asyncio.sleep(1.0)
        began = loop.time()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert loop.time() - began < 10  # transfer threads were cut loose, not left to a 60 s stall timeout
        assert Store(tmp_path / "out").versions() == []
        source.fault = None  # the same source, healed: the rerun continues the halves it sent, with Range
        result = await fetcher([source.url], tmp_path / "out").fetch()
    assert (
        result.resumed_bytes > 0
        and result.fetched_bytes == result.manifest.body.total_size - result.resumed_bytes
    )
    assert same_tree(checkpoint(origin), result.checkpoint_dir)
    assert source.ranges  # the halves on disk were continued, not fetched again
