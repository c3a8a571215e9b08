"""`prime-node weights publish|serve|fetch` as real processes, including kill -9 of a fetch and its resume."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from prime_node.p2p.identity import Identity
from prime_node.p2p.signing import canonical_json
from prime_node.p2p.weights.availability import parse_availability
from prime_node.p2p.weights.errors import FetchError
from prime_node.p2p.weights.fetch import Fetcher
from prime_node.p2p.weights.publish import publish
from prime_node.p2p.weights.store import PARTIAL, PROGRESS_NAME, Store

from support.weights import hostile, make_checkpoint, operator, publish_steps, same_tree, serving

_SCRIPT = Path(sys.executable).parent / "prime-node"  # the installed console script, as a user runs it
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "prime_node.node.cli.main"]


async def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *CLI, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode(), err.decode()


@pytest.mark.slow  # five `prime-node` processes, each importing the whole CLI
async def test_publish_serve_fetch_round_trip_and_json_blame(tmp_path: Path) -> None:
    key_file = tmp_path / "operator.key"
    operator().save(key_file)
    ckpt = make_checkpoint(tmp_path / "ckpt")
    rc, out, err = await run_cli(
        "weights",
        "publish",
        str(ckpt),
        "--step",
        "4",
        "--key",
        str(key_file),
        "--out",
        str(tmp_path / "origin"),
        "--shard-size",
        "65536",
        "--json",
    )
    assert rc == 0, err
    published = json.loads(out)
    assert published["step"] == 4 and published["shards"] > 10
    server = await asyncio.create_subprocess_exec(
        *CLI,
        "weights",
        "serve",
        str(tmp_path / "origin"),
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert server.stdout is not None
        line = (await asyncio.wait_for(server.stdout.readline(), 180)).decode()
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:")
        rc, out, err = await run_cli(
            "weights",
            "fetch",
            "--source",
            url,
            "--trainer-key",
            operator().node_id,
            "--out",
            str(tmp_path / "out"),
            "--json",
        )
        assert rc == 0, err
        report = json.loads(out)
        assert report["ok"] and report["manifest_sha256"] == published["manifest_sha256"]
        assert same_tree(ckpt, Path(report["checkpoint_dir"]))
        rc, out, err = await run_cli(
            "weights",
            "fetch",
            "--source",
            url,
            "--trainer-key",
            operator(8).node_id,
            "--out",
            str(tmp_path / "out8"),
            "--json",
        )
        failure = json.loads(out)
        assert rc == 1 and not failure["ok"] and "another key" in failure["error"]
        assert failure["blame"][0]["source"] == url
        # A relay process follows the server and serves what it mirrored.
        relay = await asyncio.create_subprocess_exec(
            *CLI,
            "weights",
            "serve",
            str(tmp_path / "relay"),
            "--port",
            "0",
            "--upstream",
            url,
            "--trainer-key",
            operator().node_id,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            assert relay.stdout is not None
            relay_url = (
                (await asyncio.wait_for(relay.stdout.readline(), 180)).decode().strip().rsplit(" ", 1)[-1]
            )
            fetched = None
            for _ in range(150):  # the relay polls its upstream every 2 s
                try:
                    fetched = await Fetcher(
                        [relay_url], operator().node_id, Store(tmp_path / "via-relay")
                    ).fetch()
                    break
                except FetchError:
                    await asyncio.sleep(0.2)
            assert fetched is not None and same_tree(ckpt, fetched.checkpoint_dir)
        finally:
            relay.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(relay.wait(), 20) == 0
    finally:
        server.send_signal(signal.SIGTERM)  # graceful shutdown: exits 0 within its time limit
        assert await asyncio.wait_for(server.wait(), 20) == 0


async def test_fetch_killed_with_sigkill_resumes_with_range_and_ends_byte_identical(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", megabytes=2)
    publish(ckpt, step=2, identity=operator(), out_dir=tmp_path / "origin", shard_size=65536)
    out = tmp_path / "out"
    progress = Store(out).partial_dir(2) / PROGRESS_NAME
    # Small write buffers and a fast journal so that half-received shards are on disk when the kill lands.
    env = {**os.environ, "PRIME_NODE_FETCH__CHUNK_BYTES": "8192", "PRIME_NODE_FETCH__SAVE_INTERVAL_S": "0.1"}
    async with hostile(tmp_path / "origin", 2, chunk_delay_s=0.05) as source:
        fetch = await asyncio.create_subprocess_exec(
            *CLI,
            "weights",
            "fetch",
            "--source",
            source.url,
            "--trainer-key",
            operator().node_id,
            "--out",
            str(out),
            "--concurrency",
            "2",
            "--json",
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            deadline = asyncio.get_running_loop().time() + 120  # generous: CI machines are slow when busy
            while True:
                state = json.loads(progress.read_bytes()) if progress.exists() else {}
                if len(state.get("done", {})) >= 3 and state.get("partial"):
                    break
                assert asyncio.get_running_loop().time() < deadline, "the fetch never journaled progress"
                assert fetch.returncode is None, "the fetch ended before it could be killed"
                await asyncio.sleep(0.02)
        finally:
            fetch.send_signal(signal.SIGKILL)
            await fetch.wait()
        assert fetch.returncode == -signal.SIGKILL
        assert Store(out).versions() == []  # nothing visible at the final path after the kill
        # The rerun asks the same source, now at full speed: bytes on disk are continued only by the source
        # that sent them.
        source.chunk_delay_s = 0.0
        source.ranges.clear()
        rc, stdout, err = await run_cli(
            "weights",
            "fetch",
            "--source",
            source.url,
            "--trainer-key",
            operator().node_id,
            "--out",
            str(out),
            "--json",
            env=env,
        )
        assert rc == 0, err
        report = json.loads(stdout)
        assert (
            report["resumed_bytes"] > 0
            and report["fetched_bytes"] == report["total_bytes"] - report["resumed_bytes"]
        )
        assert source.ranges and all(
            r.startswith("bytes=") and not r.startswith("bytes=0-") for _, r in source.ranges
        )
    assert same_tree(ckpt, Path(report["checkpoint_dir"]))
    assert Store(out).partial_versions() == []


async def test_publish_refuses_links_and_special_files_and_keeps_modes(tmp_path: Path) -> None:
    key_file = tmp_path / "operator.key"
    operator().save(key_file)
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "operator.key"  # a 0600 file outside the checkpoint: never to be published
    secret.write_bytes(b"secret key material")
    secret.chmod(0o600)
    (outside / "more").mkdir()
    (outside / "more" / "weights.bin").write_bytes(b"not the operator's checkpoint")

    def checkpoint(name: str) -> Path:
        return make_checkpoint(tmp_path / name, megabytes=0.1)

    linked_file = checkpoint("linked-file")
    (linked_file / "tokenizer" / "vocab.json").symlink_to(secret)
    linked_dir = checkpoint("linked-dir")
    (linked_dir / "extra").symlink_to(outside / "more", target_is_directory=True)
    fifo = checkpoint("fifo")
    os.mkfifo(fifo / "pipe")  # opening it would wait for a writer for ever
    cases = {
        linked_file: linked_file / "tokenizer" / "vocab.json",
        linked_dir: linked_dir / "extra",
        fifo: fifo / "pipe",
    }
    for step, (ckpt, culprit) in enumerate(cases.items(), start=1):
        rc, out, err = await run_cli(
            "weights",
            "publish",
            str(ckpt),
            "--step",
            str(step),
            "--key",
            str(key_file),
            "--out",
            str(tmp_path / "origin"),
            timeout=60,
        )
        assert rc == 1 and out == "", err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and str(culprit) in lines[0] and "only regular files" in lines[0], err
    assert Store(tmp_path / "origin").versions() == []
    assert not list((tmp_path / "origin").rglob("*.bin")) and not list(
        (tmp_path / "origin").rglob("vocab.json")
    )
    # The honest control beside them: a plain directory publishes, a 0600 file the operator put there stays 0600.
    honest = checkpoint("honest")
    (honest / "private.json").write_text("{}")
    (honest / "private.json").chmod(0o600)
    (honest / "run.sh").write_text("echo hi")
    (honest / "run.sh").chmod(0o775)
    rc, out, err = await run_cli(
        "weights",
        "publish",
        str(honest),
        "--step",
        "9",
        "--key",
        str(key_file),
        "--out",
        str(tmp_path / "origin"),
        "--json",
        timeout=60,
    )
    assert rc == 0, err
    published = Path(json.loads(out)["version_dir"]) / "checkpoint"
    assert same_tree(honest, published)
    modes = {p.name: p.stat().st_mode & 0o777 for p in published.rglob("*") if p.is_file()}
    assert modes["private.json"] == 0o600 and modes["run.sh"] == 0o644 and modes["config.json"] == 0o644


@pytest.mark.parametrize(
    "bad_name",
    [
        "config.json\n",
        "config.json\r",
        "con\tfig.json",
        "config\x00.json",
        "config.json\x7f",
        "config.json\u2028",
        "config.json\u2029",
    ],
)
async def test_fetch_refuses_a_signed_manifest_with_a_control_character_in_a_name(
    tmp_path: Path, bad_name: str
) -> None:
    # The pinned key signs it (a compromised or buggy trainer): the names are still checked, and the fetch
    # writes nothing. Before the fix, `re.match` with `$` let "config.json\n" through and the fetcher created it.
    origin = tmp_path / "origin"
    honest = make_checkpoint(tmp_path / "ckpt", megabytes=0.2)
    publish(honest, step=2, identity=operator(), out_dir=origin, shard_size=65536)
    document = json.loads(Store(origin).manifest_bytes(2))
    body = document["body"]
    body["files"] = [{**f, "path": bad_name} if f["path"] == "config.json" else f for f in body["files"]]
    resigned = canonical_json({"body": body, "signature": operator().sign_document(body).hex()})
    async with hostile(origin, 2, manifest_bytes=resigned) as source:
        rc, out, err = await run_cli(
            "weights",
            "fetch",
            "--source",
            source.url,
            "--trainer-key",
            operator().node_id,
            "--out",
            str(tmp_path / "out"),
            "--json",
            timeout=60,
        )
    failure = json.loads(out)
    assert rc == 1 and not failure["ok"], err
    assert "files." in failure["error"] and "path" in failure["error"], failure["error"]
    assert not [p for p in (tmp_path / "out").rglob("*") if "config" in p.name]
    # The honest control: the same source serving the honest manifest is fetched.
    async with hostile(origin, 2) as source:
        rc, out, err = await run_cli(
            "weights",
            "fetch",
            "--source",
            source.url,
            "--trainer-key",
            operator().node_id,
            "--out",
            str(tmp_path / "out"),
            "--json",
            timeout=60,
        )
    assert rc == 0, err
    assert same_tree(honest, Path(json.loads(out)["checkpoint_dir"]))


async def test_serve_stops_non_zero_when_its_relay_task_crashes(tmp_path: Path) -> None:
    # The relay and the rescans run under the command's Supervisor: a crash (here the relay's own disk: its
    # .partial/ is a file) stops the process with an error naming the task, after the server is shut down.
    publish_steps(tmp_path, operator(), [1], megabytes=0.1)
    relay_dir = tmp_path / "relay"
    relay_dir.mkdir()
    (relay_dir / PARTIAL).write_text("not a directory")
    async with serving(tmp_path / "origin", operator().node_id) as origin:
        rc, out, err = await run_cli(
            "weights",
            "serve",
            str(relay_dir),
            "--port",
            "0",
            "--upstream",
            origin.url,
            "--trainer-key",
            operator().node_id,
            timeout=120,
        )
    assert out.startswith("serving ") and rc != 0
    assert "task 'weights-relay' crashed" in err


async def test_a_relay_started_with_a_key_signs_which_shards_it_holds(tmp_path: Path) -> None:
    # Relays serve each shard once verified, like re-serving nodes; with --key they also sign which ones they
    # hold, so fetchers ask them only for those and a claimed shard not served is a lie under the relay's key.
    manifest = publish_steps(tmp_path, operator(), [1], megabytes=0.3)[1]
    relay_key = Identity.from_seed(b"\x21" * 32)
    relay_key.save(tmp_path / "relay.key")
    async with serving(tmp_path / "origin", operator().node_id) as origin:
        relay = await asyncio.create_subprocess_exec(
            *CLI,
            "weights",
            "serve",
            str(tmp_path / "relay"),
            "--port",
            "0",
            "--upstream",
            origin.url,
            "--trainer-key",
            operator().node_id,
            "--key",
            str(tmp_path / "relay.key"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            assert relay.stdout is not None
            line = (await asyncio.wait_for(relay.stdout.readline(), 180)).decode().strip()
            relay_url = line.rsplit(" ", 1)[-1]
            raw = b""
            async with aiohttp.ClientSession() as session:
                for _ in range(200):  # the relay polls its upstream every 2 s; bounded at 40 s
                    async with session.get(f"{relay_url}/v1/weights/1/availability") as resp:
                        raw = await resp.read()
                        if resp.status == 200:
                            _, have = parse_availability(raw, manifest, signers={relay_key.node_id})
                            if len(have) == len(manifest.body.shards):
                                break
                    await asyncio.sleep(0.2)
            record, have = parse_availability(raw, manifest, signers={relay_key.node_id})
            assert have == frozenset(range(len(manifest.body.shards))) and record.step == 1
        finally:
            relay.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(relay.wait(), 20) == 0
