"""Manifest format: signing, hostile manifests, publishing, store layout and pruning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prime_node.p2p.weights.errors import ManifestError, PublishError, ReplayError, StoreError
from prime_node.p2p.weights.manifest import MAX_MANIFEST_BYTES, checkpoint_digest, parse_signed
from prime_node.p2p.weights.publish import publish
from prime_node.p2p.weights.store import Store

from support.weights import SHARD, make_checkpoint, operator, publish_steps


@pytest.fixture
def published(tmp_path: Path) -> tuple[Path, dict]:
    manifests = publish_steps(tmp_path, operator(), [3])
    return tmp_path / "origin", manifests


def resign(body: dict, seed: int = 7) -> bytes:
    """A manifest whose body was altered and then signed by the operator (reaches schema checks)."""
    key = operator(seed)
    return json.dumps({"body": body, "signature": key.sign_document(body).hex()}).encode()


def test_publish_writes_a_verifiable_manifest_covering_every_byte(published) -> None:
    origin, manifests = published
    manifest = parse_signed(Store(origin).manifest_bytes(3), operator().node_id)
    assert manifest.digest == manifests[3].digest
    body = manifest.body
    assert [f.path for f in body.files] == ["config.json", "model.safetensors", "tokenizer/tokenizer.json"]
    assert len(body.shards) == -(-body.total_size // SHARD) > 10
    stream = b"".join((origin / "step-000000000003" / "checkpoint" / f.path).read_bytes() for f in body.files)
    # Reassembling the shards through `segments` (which cross file boundaries) gives the stream back.
    rebuilt = bytearray()
    for index in range(len(body.shards)):
        for seg in manifest.segments(index):
            path = origin / "step-000000000003" / "checkpoint" / body.files[seg.file_index].path
            rebuilt += path.read_bytes()[seg.file_offset : seg.file_offset + seg.length]
    assert bytes(rebuilt) == stream
    import hashlib

    digests = [hashlib.sha256(stream[i : i + SHARD]).hexdigest() for i in range(0, len(stream), SHARD)]
    assert [s.sha256 for s in body.shards] == digests
    assert body.checkpoint_sha256 == checkpoint_digest(digests)


def test_manifest_signed_by_another_key_is_refused(published) -> None:
    origin, _ = published
    with pytest.raises(ManifestError, match="another key or edited"):
        parse_signed(Store(origin).manifest_bytes(3), operator(8).node_id)


@pytest.mark.parametrize("edit", ["step", "shard", "path", "signature"])
def test_manifest_edited_after_signing_is_refused(published, edit: str) -> None:
    origin, _ = published
    doc = json.loads(Store(origin).manifest_bytes(3))
    if edit == "step":
        doc["body"]["step"] = 99
    elif edit == "shard":
        doc["body"]["shards"][2]["sha256"] = "0" * 64
    elif edit == "path":
        doc["body"]["files"][0]["path"] = "config2.json"
    else:
        doc["signature"] = doc["signature"][:-2] + ("00" if doc["signature"][-2:] != "00" else "11")
    with pytest.raises(ManifestError, match="does not verify"):
        parse_signed(json.dumps(doc).encode(), operator().node_id)


@pytest.mark.parametrize(
    "path",
    [
        "../evil.py",
        "/etc/passwd",
        "a/../../b",
        "sub//x",
        "./config.json",
        "C:\\model.bin",
        "a\\..\\b",
        ".hidden",
        "x\x00y",
    ],
)
def test_signed_manifest_with_unsafe_path_is_refused(published, path: str) -> None:
    origin, _ = published
    body = json.loads(Store(origin).manifest_bytes(3))["body"]
    body["files"][0]["path"] = path
    with pytest.raises(ManifestError, match="files.0.path"):
        parse_signed(resign(body), operator().node_id)


@pytest.mark.parametrize("second", ["config.json", "CONFIG.json", "config.json/inner"])
def test_signed_manifest_with_duplicate_or_nested_paths_is_refused(published, second: str) -> None:
    origin, _ = published
    body = json.loads(Store(origin).manifest_bytes(3))["body"]
    body["files"][1]["path"] = second
    with pytest.raises(ManifestError, match="duplicate|under another file"):
        parse_signed(resign(body), operator().node_id)


@pytest.mark.parametrize(
    "field,value",
    [
        ("total_size", 10**18),
        ("shard_size", 1),
        ("step", -1),
        ("format_version", 2),
        ("created_at", 1.5),
        ("extra", 1),
    ],
)
def test_signed_manifest_with_bad_fields_is_refused(published, field: str, value: object) -> None:
    origin, _ = published
    body = json.loads(Store(origin).manifest_bytes(3))["body"]
    body[field] = value
    with pytest.raises(ManifestError, match="invalid"):
        parse_signed(resign(body), operator().node_id)


def test_signed_manifest_with_inconsistent_shards_is_refused(published) -> None:
    origin, _ = published
    body = json.loads(Store(origin).manifest_bytes(3))["body"]
    body["shards"][0]["size"] -= 1
    with pytest.raises(ManifestError, match="shard 0 has size"):
        parse_signed(resign(body), operator().node_id)
    body = json.loads(Store(origin).manifest_bytes(3))["body"]
    body["shards"] = body["shards"][:-1]
    with pytest.raises(ManifestError, match="shards listed"):
        parse_signed(resign(body), operator().node_id)


def test_oversized_and_malformed_manifests_are_refused_before_parsing() -> None:
    key = operator().node_id
    with pytest.raises(ManifestError, match="over the"):
        parse_signed(b"{" + b" " * MAX_MANIFEST_BYTES + b"}", key)
    for raw, match in [
        (b"<html>hello</html>", "not valid JSON"),
        (b"[]", "exactly the keys"),
        (b'{"body": {}, "signature": "zz"}', "128 lowercase hex"),
        (b'{"body": {}, "body": {}, "signature": ""}', "duplicate JSON key"),
        (b'{"body": NaN, "signature": ""}', "not valid JSON"),
        (b"[" * 100000, "not valid JSON"),
    ]:
        with pytest.raises(ManifestError, match=match):
            parse_signed(raw, key)


def test_store_refuses_replay_and_prunes_to_keep(tmp_path: Path) -> None:
    key = operator()
    manifests = publish_steps(tmp_path, key, [1, 2, 5], megabytes=0.2)
    store = Store(tmp_path / "origin")
    assert store.versions() == [1, 2, 5]
    with pytest.raises(ReplayError, match="older than step 5"):
        store.check_not_replayed(manifests[2])
    with pytest.raises(StoreError, match="already holds step 5"):
        publish(make_checkpoint(tmp_path / "again"), step=4, identity=key, out_dir=store.root)
    assert store.prune(2) == [1]
    assert store.versions() == [2, 5] and not (store.root / "step-000000000001").exists()
    store.prune(1)
    assert store.versions() == [5]
    # The high-water mark survives the deletion of every version: an old step is still refused.
    for step in store.versions():
        import shutil

        shutil.rmtree(store.version_dir(step))
    with pytest.raises(ReplayError):
        store.check_not_replayed(manifests[2])


def test_publish_rejects_bad_directories(tmp_path: Path) -> None:
    key = operator()
    with pytest.raises(PublishError, match="does not exist"):
        publish(tmp_path / "missing", step=1, identity=key, out_dir=tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PublishError, match="no files"):
        publish(tmp_path / "empty", step=1, identity=key, out_dir=tmp_path / "o")
    bad = make_checkpoint(tmp_path / "bad", megabytes=0.1)
    (bad / "we ird.bin").write_bytes(b"x")
    with pytest.raises(PublishError, match="rename the file"):
        publish(bad, step=1, identity=key, out_dir=tmp_path / "o")
    assert not (tmp_path / "o" / "step-000000000001").exists()


def test_segments_cover_every_byte_once_across_many_and_empty_files(tmp_path: Path) -> None:
    # Shards are cut across file boundaries; `segments` finds a shard's first file by bisection and keeps
    # each answer, so empty files and files smaller than a shard must neither be skipped wrongly nor repeated.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    sizes = [0, 5, 0, 0, 300, 1, 0, 70_000, 0, 4096, 1]
    for i, size in enumerate(sizes):
        (ckpt / f"f{i:02d}.bin").write_bytes(bytes((i * 7 + j) % 251 for j in range(size)))
    (ckpt / "config.json").write_text("{}")
    manifest, final = publish(ckpt, step=1, identity=operator(), out_dir=tmp_path / "out", shard_size=4096)
    files = manifest.body.files
    stream = b"".join((final / "checkpoint" / f.path).read_bytes() for f in files)
    for _ in range(2):  # the second pass reads the kept answers
        rebuilt = bytearray()
        for index in range(len(manifest.body.shards)):
            for seg in manifest.segments(index):
                data = (final / "checkpoint" / files[seg.file_index].path).read_bytes()
                rebuilt += data[seg.file_offset : seg.file_offset + seg.length]
        assert bytes(rebuilt) == stream
