"""`prime-node weights publish|serve|fetch`: signed sharded checkpoints, relays and verified downloads."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from pydantic import Field, field_validator
from tqdm import tqdm

from ...p2p.identity import Identity
from ...p2p.weights.errors import FetchError
from ...p2p.weights.fetch import Fetcher, FetchSettings
from ...p2p.weights.manifest import MAX_STEP, SignedManifest
from ...p2p.weights.publish import DEFAULT_SHARD_SIZE, publish
from ...p2p.weights.relay import Relay
from ...p2p.weights.server import ServeSettings, WeightsServer
from ...p2p.weights.store import Store
from ...p2p.wire import WireFormatError, parse_uint
from ..config import CommonSettings
from ..errors import ConfigError
from .common import common_flags, load_settings, print_json

logger = logging.getLogger(__name__)
SHUTDOWN_TIMEOUT_S = 10.0


class WeightsSettings(CommonSettings):
    """Settings of the weights commands: the server's and the fetcher's (also used by relays)."""

    serve: ServeSettings = Field(default_factory=ServeSettings, description="The HTTP server.")
    fetch: FetchSettings = Field(default_factory=FetchSettings, description="Downloads (fetch and relay).")
    trainer_key: str | None = Field(
        None, pattern=r"^[0-9a-f]{64}$", description="Pinned signer public key (hex)."
    )
    poll_interval_s: float = Field(
        2.0, gt=0, description="How often a relay asks its upstreams for a new version."
    )

    @field_validator("trainer_key", mode="before")
    @classmethod
    def _lowercase(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value


def _step(text: str) -> int | None:
    if text == "latest":
        return None
    try:
        return parse_uint(text, "--step", maximum=MAX_STEP)
    except WireFormatError:
        raise argparse.ArgumentTypeError(
            f"--step takes an integer from 0 to {MAX_STEP} or 'latest'"
        ) from None


def register(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("weights", help="publish, serve (relay) and fetch signed sharded checkpoints")
    cmds = group.add_subparsers(dest="weights_command", metavar="SUBCOMMAND")
    cmds.required = True  # argparse rejects `prime-node weights` alone; the group handler is never reached
    group.set_defaults(handler=lambda args: group.print_help() or 2)

    p = cmds.add_parser("publish", parents=[common_flags()], help="shard and sign a checkpoint directory")
    p.add_argument(
        "ckpt_dir", type=Path, help="HF checkpoint directory (config, safetensors, tokenizer files)"
    )
    p.add_argument("--step", type=int, required=True, help="optimizer step of this checkpoint")
    p.add_argument("--key", type=Path, required=True, help="the operator's secret key file")
    p.add_argument(
        "--out", type=Path, required=True, help="store directory to publish into (served by `serve`)"
    )
    p.add_argument(
        "--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help="shard size in bytes (default 16 MiB)"
    )
    p.add_argument("--run-id", default="default", help="run id written into the manifest")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=publish_cmd)

    p = cmds.add_parser("serve", parents=[common_flags()], help="serve a store; with --upstream, relay")
    p.add_argument("dir", type=Path, help="store directory")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8470; 0 picks a free one)")
    p.add_argument(
        "--upstream", action="append", default=None, help="relay mode: upstream server URL (repeatable)"
    )
    p.add_argument("--keep", type=int, default=None, help="versions kept on disk (default 5)")
    p.add_argument("--trainer-key", default=None, help="pinned signer key (hex); required with --upstream")
    p.add_argument("--ban", action="append", default=None, help="banned node id or IP/network (repeatable)")
    p.add_argument("--ban-file", type=Path, default=None, help="file of ban entries, re-read when it changes")
    p.add_argument("--rate-limit", type=float, default=None, help="requests per second per client (0: off)")
    p.add_argument(
        "--require-node-auth",
        action="store_true",
        default=None,
        help="refuse requests without a node's signed access token (node-id bans cannot be dodged)",
    )
    p.add_argument("--key", type=Path, default=None, help="this relay's key: signs its requests to upstreams")
    p.add_argument(
        "--public-url",
        action="append",
        default=None,
        help="a URL clients reach this server by (NAT, DNS); access tokens may be addressed to it",
    )
    p.set_defaults(handler=serve_cmd)

    p = cmds.add_parser("fetch", parents=[common_flags()], help="download and verify a checkpoint")
    p.add_argument("--source", action="append", required=True, help="server URL (repeatable)")
    p.add_argument("--trainer-key", required=True, help="pinned signer public key (hex)")
    p.add_argument("--out", type=Path, required=True, help="store directory to fetch into")
    p.add_argument("--step", type=_step, default=None, help="step number or 'latest' (default)")
    p.add_argument("--concurrency", type=int, default=None, help="shards downloaded at once (default 8)")
    p.add_argument(
        "--stall-timeout", type=float, default=None, help="seconds without data before switching source"
    )
    p.add_argument("--keep", type=int, default=None, help="keep only this many versions after success")
    p.add_argument(
        "--key",
        type=Path,
        default=None,
        help="your node key: requests carry a signed access token (needed by servers that require one)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON report instead of a progress bar")
    p.set_defaults(handler=fetch_cmd)


def publish_cmd(args: argparse.Namespace) -> int:
    load_settings(args, CommonSettings)
    identity = Identity.load(args.key)
    manifest, final = publish(
        args.ckpt_dir,
        step=args.step,
        identity=identity,
        out_dir=args.out,
        shard_size=args.shard_size,
        run_id=args.run_id,
    )
    report = {
        "step": manifest.step,
        "version_dir": str(final),
        "manifest_sha256": manifest.digest,
        "checkpoint_sha256": manifest.body.checkpoint_sha256,
        "files": len(manifest.body.files),
        "shards": len(manifest.body.shards),
        "total_bytes": manifest.body.total_size,
        "signer": manifest.body.signer,
    }
    if args.json:
        print_json(report)
    else:
        print(
            f"published step {manifest.step}: {report['shards']} shards, {manifest.body.total_size} bytes -> {final}"
        )
        print(f"manifest sha256 {manifest.digest}")
    return 0


def serve_cmd(args: argparse.Namespace) -> int:
    settings = load_settings(
        args,
        WeightsSettings,
        {
            "serve.host": "host",
            "serve.port": "port",
            "serve.keep": "keep",
            "serve.ban": "ban",
            "serve.ban_file": "ban_file",
            "serve.rate_per_s": "rate_limit",
            "trainer_key": "trainer_key",
            "serve.require_node_auth": "require_node_auth",
            "serve.public_urls": "public_url",
        },
    )
    if args.upstream and not settings.trainer_key:
        raise ConfigError("relay mode (--upstream) needs --trainer-key: a relay verifies what it mirrors")
    identity = Identity.load(args.key) if args.key is not None else None
    return asyncio.run(_serve(args.dir, args.upstream or [], settings, identity))


async def _serve(
    directory: Path, upstreams: list[str], settings: WeightsSettings, identity: Identity | None
) -> int:
    server = WeightsServer(Store(directory), settings.serve, settings.trainer_key)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    url = await server.start()
    print(f"serving {server.store.root} at {url}", flush=True)
    tasks: list[asyncio.Task[None]] = []
    if upstreams:
        assert settings.trainer_key is not None
        relay = Relay(
            server,
            upstreams,
            settings.trainer_key,
            settings.fetch,
            poll_interval_s=settings.poll_interval_s,
            identity=identity,
        )
        tasks.append(asyncio.create_task(relay.run(), name="weights-relay"))
    waiter = asyncio.create_task(stop.wait(), name="weights-serve-stop")
    supervised = [waiter, *tasks, *([server.scanner] if server.scanner else [])]
    done, _ = await asyncio.wait(supervised, return_when=asyncio.FIRST_COMPLETED)
    # Shutdown in reverse order of start, bounded in time; a crashed task is re-raised after cleanup.
    for task in [*tasks, waiter]:
        task.cancel()
    clean = True
    for stopping in (asyncio.gather(*tasks, waiter, return_exceptions=True), server.stop()):
        try:
            await asyncio.wait_for(stopping, SHUTDOWN_TIMEOUT_S)
        except TimeoutError:
            logger.error("shutdown step did not finish within %.0f s; exiting anyway", SHUTDOWN_TIMEOUT_S)
            clean = False
    for task in done:  # the scanner is stopped by server.stop(); a crash of any task is re-raised here
        if task is not waiter and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    return 0 if clean else 1


def fetch_cmd(args: argparse.Namespace) -> int:
    settings = load_settings(
        args,
        WeightsSettings,
        {
            "fetch.concurrency": "concurrency",
            "fetch.stall_timeout_s": "stall_timeout",
            "fetch.keep": "keep",
            "trainer_key": "trainer_key",
        },
    )
    assert settings.trainer_key is not None  # required flag, validated by the settings pattern
    bar = tqdm(
        total=0, unit="B", unit_scale=True, unit_divisor=1024, disable=args.json or None, file=sys.stderr
    )
    identity = Identity.load(args.key) if args.key is not None else None
    fetcher = Fetcher(
        args.source,
        settings.trainer_key,
        Store(args.out),
        settings.fetch,
        on_bytes=bar.update,
        identity=identity,
    )

    def on_manifest(manifest: SignedManifest, resumed: int) -> None:
        bar.reset(total=manifest.body.total_size)
        bar.update(resumed)
        bar.set_description(f"step {manifest.step}")

    fetcher.on_manifest = on_manifest
    try:
        result = asyncio.run(fetcher.fetch(args.step))
    except FetchError as exc:
        if not args.json:
            raise
        print_json({"ok": False, "error": str(exc), "blame": exc.blame})
        return 1
    finally:
        bar.close()
    if args.json:
        print_json({"ok": True, **result.report()})
    elif result.already_held:
        print(f"step {result.manifest.step} already held and verified: {result.checkpoint_dir}")
    else:
        print(f"step {result.manifest.step} verified: {result.checkpoint_dir}")
    return 0
