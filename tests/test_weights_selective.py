"""Selective download: a pipeline stage fetches and verifies only its shards of the signed checkpoint, from a real
weights server on 127.0.0.1, loads bit-identical tensors from them, and the version held in part is never taken
for a whole one (docs/pipeline.md, "Selective download"; docs/weights.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from prime_node.node.contributor.checkpoints import CheckpointKeeper
from prime_node.node.contributor.state import NodeState
from prime_node.node.errors import EngineError
from prime_node.node.pipeline.weights import (
    StageSelection,
    load_stage_tensors,
    safetensors_header_size,
    tensor_ranges,
)
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.p2p.swarm import PolicyAnnouncement
from prime_node.p2p.weights.availability import parse_availability
from prime_node.p2p.weights.errors import IncompleteVersion, PlanError, StoreError
from prime_node.p2p.weights.fetch import Fetcher, FetchSettings
from prime_node.p2p.weights.metrics import WeightsServerMetrics
from prime_node.p2p.weights.publish import publish
from prime_node.p2p.weights.selection import describe_shards
from prime_node.p2p.weights.serve_verified import ServeAsVerified
from prime_node.p2p.weights.server import ServeSettings, WeightsServer
from prime_node.p2p.weights.sources import SelectionSettings
from prime_node.p2p.weights.store import Store

from support.pipeline import save_tiny
from support.swarm import RUN_PARAMETERS
from support.weights import hostile, operator, publish_steps, same_tree

STEP = 3
SHARD = 16 << 10  # the embedded model's ~3 MB checkpoint in ~200 shards, as docs/pipeline.md measures
TWO = StageLayout(boundaries=[0, 2, 4])
FOUR = StageLayout(boundaries=[0, 1, 2, 3, 4])
FAST = dict(
    stall_timeout_s=3.0,
    connect_timeout_s=3.0,
    manifest_timeout_s=5.0,
    durable=False,
    selection=SelectionSettings(backoff_base_s=0.02, backoff_max_s=0.2),
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-selective"))


@pytest.fixture(scope="module")
def origin(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("origin")
    publish(model_dir, step=STEP, identity=operator(), out_dir=root, shard_size=SHARD, run_id="test")
    return root


@contextlib.asynccontextmanager
async def counted(store_dir: Path, identity: Identity | None = None) -> AsyncIterator[WeightsServer]:
    """A real weights server whose `sent` is the shard bytes it has sent so far."""
    server = WeightsServer(
        Store(store_dir),
        ServeSettings(port=0),
        metrics=WeightsServerMetrics(CollectorRegistry()),
        identity=identity,
    )
    server.url = await server.start()  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        await server.stop()


def sent(server: WeightsServer) -> int:
    assert server.metrics is not None
    return int(server.metrics.sent_bytes._value.get())


async def fetch(
    sources: list[str], out: Path, plan: StageSelection | None, serve: ServeAsVerified | None = None
):
    fetcher = Fetcher(sources, operator().node_id, Store(out), FetchSettings(**FAST))  # type: ignore[arg-type]
    if serve is not None:
        fetcher.on_manifest, fetcher.on_shard = serve.on_manifest, serve.on_shard
    try:
        result = await fetcher.fetch_version(await fetcher.resolve(STEP), plan)
    finally:
        fetcher.close()
    if serve is not None:
        serve.finished(result)
    return result


async def get(url: str) -> bytes:
    """A GET from a thread: the server answers on this test's event loop."""
    return await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "layout", [TWO, StageLayout(boundaries=[0, 1, 2, 3, 4])], ids=["2 stages", "4 stages"]
)
async def test_each_stage_fetches_fewer_bytes_and_loads_bit_identical_tensors(
    layout: StageLayout, model_dir: Path, origin: Path, tmp_path: Path
) -> None:
    total = Store(origin).load_manifest(STEP, operator().node_id).body.total_size
    async with counted(origin) as server:
        for stage in range(layout.stages):
            before = sent(server)
            result = await fetch(
                [server.url], tmp_path / f"node-{stage}", StageSelection(layout, frozenset({stage}))
            )
            served = sent(server) - before
            assert not result.complete and result.held is not None
            # Exactly the held shards crossed the wire, once each: fewer bytes than the whole.
            assert served == result.fetched_bytes == result.held_bytes < total * 0.8, (stage, served, total)
            assert (
                result.rounds >= 2
            )  # the headers were read from verified shards before the tensors were named
            full = load_stage_tensors(model_dir, layout, stage, torch.float32, tied=True)
            ours = load_stage_tensors(result.checkpoint_dir, layout, stage, torch.float32, tied=True)
            assert same_tensors(full, ours)
            other = (stage + 1) % layout.stages
            with pytest.raises(EngineError, match=f"stage {other} needs shards .* did not fetch"):
                load_stage_tensors(result.checkpoint_dir, layout, other, torch.float32, tied=True)


async def test_a_version_held_in_part_is_never_taken_for_a_whole_one(origin: Path, tmp_path: Path) -> None:
    async with counted(origin) as server:
        result = await fetch([server.url], tmp_path / "node", StageSelection(TWO, frozenset({0})))
    store = Store(tmp_path / "node")
    assert store.versions() == []  # no reader of complete versions sees it
    assert result.version_dir == store.partial_dir(STEP)
    count = len(result.manifest.body.shards)
    missing = sorted(set(range(count)) - set(result.held or ()))
    with pytest.raises(IncompleteVersion) as refused:
        store.whole_checkpoint_dir(STEP)
    assert refused.value.missing == missing
    assert f"shards {describe_shards(missing)} were never fetched" in str(refused.value)
    assert f"{len(result.held or ())} of {count} shards" in str(refused.value)
    # The node turns monolithic: a plain (whole) fetch downloads only the shards it lacked, then it loads.
    async with counted(origin) as server:
        whole = await fetch([server.url], tmp_path / "node", None)
        assert (
            whole.complete
            and sent(server) == whole.fetched_bytes == result.manifest.body.total_size - result.held_bytes
        )
    assert store.versions() == [STEP] and store.whole_checkpoint_dir(STEP) == whole.checkpoint_dir


async def test_widening_the_selection_fetches_only_what_is_missing(origin: Path, tmp_path: Path) -> None:
    out = tmp_path / "node"
    total = Store(origin).load_manifest(STEP, operator().node_id).body.total_size
    async with counted(origin) as server:
        first = await fetch([server.url], out, StageSelection(FOUR, frozenset({1})))
        held_first = first.held_bytes
        both = await fetch([server.url], out, StageSelection(FOUR, frozenset({1, 2})))
        assert not both.complete and both.held is not None and first.held is not None
        assert first.held < both.held
        assert sent(server) - held_first == both.held_bytes - held_first == both.fetched_bytes
        # Every stage of a split is the whole checkpoint: it is moved into place, as a whole fetch would be.
        whole = await fetch([server.url], out, StageSelection(TWO, frozenset({0, 1})))
        assert whole.complete and sent(server) == total and whole.fetched_bytes == total - both.held_bytes
    assert Store(out).versions() == [STEP]
    assert same_tree(Store(origin).checkpoint_dir(STEP), whole.checkpoint_dir)
    assert Store(out).whole_checkpoint_dir(STEP) == whole.checkpoint_dir


async def test_a_corrupt_peer_cannot_slip_bytes_into_a_stage(
    model_dir: Path, origin: Path, tmp_path: Path
) -> None:
    async with counted(origin) as good, hostile(origin, STEP, "flip") as bad:
        result = await fetch([bad.url, good.url], tmp_path / "node", StageSelection(TWO, frozenset({1})))
    bad_report = next(s for s in result.sources if s["url"] == bad.url)
    assert bad_report["shards_ok"] == 0 and bad_report["shards_corrupt"] >= 1
    full = load_stage_tensors(model_dir, TWO, 1, torch.float32, tied=True)
    assert same_tensors(full, load_stage_tensors(result.checkpoint_dir, TWO, 1, torch.float32, tied=True))


async def test_a_node_re_serves_only_the_shards_it_holds(origin: Path, tmp_path: Path) -> None:
    node_key = Identity.from_seed(b"\x09" * 32)
    async with counted(origin) as server, counted(tmp_path / "node", node_key) as mine:
        result = await fetch(
            [server.url], tmp_path / "node", StageSelection(TWO, frozenset({1})), ServeAsVerified(mine)
        )
        await mine.rescan()  # a rescan of the store finds no complete version to advertise whole
        held = result.held or frozenset()
        url = f"{mine.url}/v1/weights/{STEP}"  # type: ignore[attr-defined]
        raw = await get(f"{url}/availability")
        _, claimed = parse_availability(raw, result.manifest, signers={node_key.node_id})
        assert claimed == held
        listing = json.loads(await get(f"{mine.url}/v1/weights/versions"))  # type: ignore[attr-defined]
        assert listing["versions"][0]["complete"] is False
        inside = min(held)
        body = await get(f"{url}/shards/{inside}")
        checkpoint = Store(origin).checkpoint_dir(STEP)
        blob = b"".join((checkpoint / f.path).read_bytes() for f in result.manifest.body.files)
        assert body == blob[inside * SHARD : inside * SHARD + result.manifest.body.shards[inside].size]
        outside = min(set(range(len(result.manifest.body.shards))) - held)
        with pytest.raises(urllib.error.HTTPError) as refused:
            await get(f"{url}/shards/{outside}")
        assert refused.value.code == 503


def test_safetensors_headers_are_bounded_and_parsed_strictly() -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    data = len(header).to_bytes(8, "little") + header
    assert tensor_ranges(data, len(data) + 8) == {"w": (len(data), len(data) + 8)}
    with pytest.raises(EngineError, match="its file has"):
        safetensors_header_size(data, len(data) - 1)  # the header runs past the file's end
    with pytest.raises(EngineError, match="at most"):
        safetensors_header_size((1 << 40).to_bytes(8, "little"))
    with pytest.raises(EngineError, match="outside its file"):
        tensor_ranges(data, len(data) + 4)  # the tensor's bytes run past the file's end
    for bad in ([0, True], [0], ["0", 8], None):
        entry = json.dumps({"w": {"data_offsets": bad}}).encode()
        with pytest.raises(EngineError, match="integer data offsets"):
            tensor_ranges(len(entry).to_bytes(8, "little") + entry)
    twice = b'{"w": {"data_offsets": [0, 4]}, "w": {"data_offsets": [4, 8]}}'
    with pytest.raises(EngineError, match="not strict JSON"):
        tensor_ranges(len(twice).to_bytes(8, "little") + twice)  # one name, two ranges: which one is read?
    with pytest.raises(EngineError, match="stages"):
        StageSelection(TWO, frozenset({2}))


async def test_the_pipeline_nodes_keeper_holds_its_stages_shards_and_deletes_them_with_the_window(
    model_dir: Path, origin: Path, tmp_path: Path
) -> None:
    key, me = operator(), Identity.from_seed(b"\x0b" * 32)
    manifest = Store(origin).load_manifest(STEP, key.node_id)
    store = Store(tmp_path / "node")

    def announcement(step: int, url: str) -> PolicyAnnouncement:
        digest = manifest.digest if step == STEP else "0" * 64
        return PolicyAnnouncement(
            step=step, manifest_sha256=digest, sources=[url], published_at=time.time(), run=RUN_PARAMETERS
        )

    def keeper_for(stages: set[int], serve: ServeAsVerified | None = None) -> CheckpointKeeper:
        return CheckpointKeeper(
            store,
            key.node_id,
            NodeState(me.node_id, key.node_id),
            async_level=1,
            fetch_settings=FetchSettings(**FAST),  # type: ignore[arg-type]
            plan=StageSelection(TWO, frozenset(stages)),
            serve=serve,
        )

    async with counted(origin) as server, counted(tmp_path / "node", me) as mine:
        keeper = keeper_for({1}, ServeAsVerified(mine))
        keeper.announce(announcement(STEP, server.url))  # type: ignore[attr-defined]
        assert await keeper.try_fetch(keeper.announced), keeper.state.last_error  # type: ignore[arg-type]
        assert keeper.usable_step() == STEP
        directory = keeper.checkpoint_dir(STEP)
        assert directory == store.checkpoint_dir(STEP, partial=True)
        full = load_stage_tensors(model_dir, TWO, 1, torch.float32, tied=True)
        assert same_tensors(full, load_stage_tensors(directory, TWO, 1, torch.float32, tied=True))
        with pytest.raises(IncompleteVersion, match="never fetched"):
            keeper.whole_checkpoint_dir(STEP)
        held = keeper.state.metrics.held_fraction._value.get()
        assert 0.4 < held < 0.7  # the last of two stages: about half the bytes
        assert mine.versions[STEP].ready and not mine.versions[STEP].complete

        # After a restart the version is found again, for the stages it was fetched for only, and served.
        async with counted(tmp_path / "node", me) as restarted:
            again = keeper_for({1}, ServeAsVerified(restarted))
            await again.load_local()
            assert again.verified_steps() == [STEP]
            assert restarted.versions[STEP].ready == mine.versions[STEP].ready
        other = keeper_for({0})
        await other.load_local()
        assert other.verified_steps() == []

        # Out of the async window, the version held in part is deleted and no longer served.
        keeper.announce(announcement(STEP + 2, server.url))  # type: ignore[attr-defined]
        await keeper.prune()
        assert keeper.verified_steps() == [] and store.partial_versions() == []
        assert STEP not in mine.versions


async def test_a_checkpoint_the_stages_do_not_fit_is_refused_by_name(tmp_path: Path) -> None:
    # Its tensors are not a Qwen2 model's: no plan can name the stages' shards, and the fetch says so.
    publish_steps(tmp_path, operator(), [STEP], megabytes=0.2)
    async with counted(tmp_path / "origin") as server:
        with pytest.raises(PlanError, match=r"stages \[0\] need: .*lacks tensors stage 0 needs"):
            await fetch([server.url], tmp_path / "node", StageSelection(TWO, frozenset({0})))


def keeper_of(store: Store, stages: set[int] | None, async_level: int = 1) -> CheckpointKeeper:
    """A pipeline node's keeper offering `stages` of TWO (None: a monolithic node's)."""
    key = operator()
    return CheckpointKeeper(
        store,
        key.node_id,
        NodeState(Identity.from_seed(b"\x0c" * 32).node_id, key.node_id),
        async_level=async_level,
        fetch_settings=FetchSettings(**FAST),  # type: ignore[arg-type]
        plan=None if stages is None else StageSelection(TWO, frozenset(stages)),
    )


def announce(keeper: CheckpointKeeper, step: int) -> None:
    keeper.announce(
        PolicyAnnouncement(
            step=step,
            manifest_sha256="0" * 64,
            sources=["http://127.0.0.1:9"],
            published_at=time.time(),
            run=RUN_PARAMETERS,
        )
    )


def cut_short(store: Store, origin: Path) -> None:
    """A fetch of STEP stopped after its first journal write: the manifest and an empty journal on disk."""
    partial = store.open_partial(Store(origin).load_manifest(STEP, operator().node_id))
    partial.write_progress(partial.progress_snapshot())
    partial.close()


async def test_a_fetch_cut_short_is_kept_to_resume_then_deleted_below_the_window(
    origin: Path, tmp_path: Path
) -> None:
    store = Store(tmp_path / "node")
    cut_short(store, origin)
    keeper = keeper_of(store, {1})
    await keeper.load_local()  # not every shard its plan names: not used, but kept for the fetch to resume
    assert keeper.verified_steps() == [] and store.partial_versions() == [STEP]
    announce(keeper, STEP + 1)  # the window (async level 1) still reaches STEP
    await keeper.prune()
    assert store.partial_versions() == [STEP]
    announce(keeper, STEP + 2)  # out of the window: no fetch will ever finish it, and no one else deletes it
    await keeper.prune()
    assert store.partial_versions() == []

    # The same for a monolithic node, which used to delete one only once a newer complete version was held.
    cut_short(store, origin)
    monolithic = keeper_of(store, None)
    announce(monolithic, STEP + 2)
    await monolithic.prune()
    assert store.partial_versions() == []


async def test_a_partial_version_that_can_never_be_used_is_deleted_on_start(
    origin: Path, tmp_path: Path
) -> None:
    store = Store(tmp_path / "node")
    cut_short(store, origin)
    store.note_held(STEP + 1)  # a newer step is held: a fetch of STEP is refused as a replay, never resumed
    await keeper_of(store, {1}).load_local()
    assert store.partial_versions() == []


async def test_a_partial_version_whose_manifest_is_damaged_is_deleted_on_start(
    origin: Path, tmp_path: Path
) -> None:
    async with counted(origin) as server:
        await fetch([server.url], tmp_path / "other", StageSelection(TWO, frozenset({1})))
    other = Store(tmp_path / "other")
    manifest = other.partial_dir(STEP) / "manifest.json"
    doc = json.loads(manifest.read_bytes())
    doc["body"]["signer"] = "not a key"  # damaged on disk: its signer no public key at all
    manifest.write_bytes(json.dumps(doc).encode())
    with pytest.raises(StoreError, match="does not verify"):
        other.whole_checkpoint_dir(STEP)
    with pytest.raises(EngineError, match="cannot tell which shards"):
        load_stage_tensors(other.checkpoint_dir(STEP, partial=True), TWO, 1, torch.float32, tied=True)
    keeper = keeper_of(other, {1})
    await keeper.load_local()  # used to fail on every start, until someone deleted the directory
    assert keeper.verified_steps() == [] and other.partial_versions() == []


async def test_a_partial_version_without_its_journal_is_never_loaded(
    model_dir: Path, origin: Path, tmp_path: Path
) -> None:
    async with counted(origin) as server:
        result = await fetch([server.url], tmp_path / "node", StageSelection(TWO, frozenset({0})))
    assert load_stage_tensors(result.checkpoint_dir, TWO, 0, torch.float32, tied=True)
    (result.version_dir / "progress.json").unlink()  # it used to be taken for a complete version
    for stage in (0, 1):
        with pytest.raises(EngineError, match=f"step {STEP} without its journal progress.json"):
            load_stage_tensors(result.checkpoint_dir, TWO, stage, torch.float32, tied=True)
    (result.version_dir / "progress.json").write_bytes(b"{not json")
    with pytest.raises(EngineError, match="progress.json is malformed"):
        load_stage_tensors(result.checkpoint_dir, TWO, 1, torch.float32, tied=True)


async def test_the_shards_checked_and_fetched_are_those_of_the_tensors_the_loader_reads(
    model_dir: Path, tmp_path: Path
) -> None:
    # Tied embeddings, the head stored as its own tensor too, and an index that omits it: the loader reads
    # the head from the embedding (as the index says), so the last stage must hold the embedding's shards.
    from safetensors.torch import load_file, save_file

    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    for path in model_dir.iterdir():
        if path.is_file() and path.name != "model.safetensors":
            (checkpoint / path.name).write_bytes(path.read_bytes())
    tensors = load_file(model_dir / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    weight_map = {name: "model.safetensors" for name in tensors if name != "lm_head.weight"}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    origin = tmp_path / "origin"
    publish(checkpoint, step=STEP, identity=operator(), out_dir=origin, shard_size=SHARD, run_id="test")
    async with counted(origin) as server:
        result = await fetch([server.url], tmp_path / "node", StageSelection(TWO, frozenset({1})))
    full = load_stage_tensors(checkpoint, TWO, 1, torch.float32, tied=True)
    assert torch.equal(full["head.weight"], tensors["model.embed_tokens.weight"])
    assert same_tensors(full, load_stage_tensors(result.checkpoint_dir, TWO, 1, torch.float32, tied=True))


async def test_the_journal_of_a_version_held_in_part_is_made_durable(
    origin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:  # the real fsync, noting what it made durable
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    settings = FetchSettings(**{**FAST, "durable": True})  # type: ignore[arg-type]
    async with counted(origin) as server:
        fetcher = Fetcher([server.url], operator().node_id, Store(tmp_path / "node"), settings)
        try:
            resolved = await fetcher.resolve(STEP)
            result = await fetcher.fetch_version(resolved, StageSelection(TWO, frozenset({1})))
        finally:
            fetcher.close()
    version = str(result.version_dir)
    assert version in synced  # the journal's rename
    assert any(Path(path).parent == result.version_dir and "progress.json" in path for path in synced)
