"""`prime-node weights publish|serve|fetch`: signed sharded checkpoints, relays and verified downloads."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from pydantic import Field, field_validator

from ...p2p.identity import Identity
from ...p2p.weights.errors import FetchError
from ...p2p.weights.fetch import Fetcher, FetchSettings
from ...p2p.weights.manifest import MAX_STEP
from ...p2p.weights.metrics import WeightsServerMetrics
from ...p2p.weights.publish import DEFAULT_SHARD_SIZE, publish
from ...p2p.weights.relay import Relay
from ...p2p.weights.server import ServeSettings, WeightsServer
from ...p2p.weights.store import Store
from ...p2p.wire import HEX64_PATTERN, WireFormatError, is_hex64, parse_uint
from ..config import CommonSettings
from ..errors import ConfigError
from ..runtime.metrics import PORTS, render, role_registry, serve_metrics
from ..runtime.ports import Listener, check_ports_free
from ..runtime.progress import DownloadProgress
from ..runtime.supervisor import Supervisor
from .common import print_json, run_until_stopped
from .flags import Flag, SettingsFlags, load_settings

logger = logging.getLogger(__name__)
SHUTDOWN_TIMEOUT_S = 10.0


class RelayMetrics:
    """A standalone weights server's (or relay's) metrics: the weights server's, with build info and process
    metrics, on a /metrics of its own (its weights port is the public one; docs/metrics.md)."""

    def __init__(self) -> None:
        self.registry = role_registry("weights")
        self.weights = WeightsServerMetrics(self.registry)

    def render(self) -> bytes:
        return render(self.registry)


class WeightsSettings(CommonSettings):
    """Settings of the weights commands: the server's and the fetcher's (also used by relays)."""

    serve: ServeSettings = Field(default_factory=ServeSettings, description="The HTTP server.")
    fetch: FetchSettings = Field(default_factory=FetchSettings, description="Downloads (fetch and relay).")
    trainer_key: str | None = Field(
        None,
        pattern=HEX64_PATTERN,
        description="Pinned signer public key (hex): only checkpoints it signed are taken; a relay (--upstream) "
        "needs it.",
    )
    poll_interval_s: float = Field(
        2.0, gt=0, description="How often a relay asks its upstreams for a new version."
    )
    metrics_host: str = Field("127.0.0.1", description="Address of the server's /metrics.")
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description=f"Port of the server's /metrics (docs/metrics.md; {PORTS['relay']} by convention, 0 picks a "
        "free one); unset serves none.",
    )

    @field_validator("trainer_key", mode="before")
    @classmethod
    def _lowercase(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        key = value.strip().lower()
        if not is_hex64(key):  # the field's pattern would say only "should match pattern '^[0-9a-f]{64}$'"
            raise ValueError(
                "must be the trainer's node id: 64 hex digits, as `prime-node identity --key TRAINER_KEY` prints"
            )
        return key


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

    p = cmds.add_parser("publish", help="shard and sign a checkpoint directory")
    SettingsFlags(p, CommonSettings)
    p.add_argument(
        "ckpt_dir", type=Path, help="HF checkpoint directory (config, safetensors, tokenizer files)"
    )
    p.add_argument("--step", type=int, required=True, help="optimizer step of this checkpoint")
    p.add_argument("--key", type=Path, required=True, help="the operator's secret key file")
    p.add_argument(
        "--out", type=Path, required=True, help="store directory to publish into (served by `serve`)"
    )
    p.add_argument(
        "--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help="shard size in bytes (default %(default)s)"
    )
    p.add_argument("--run-id", default="default", help="run id written into the manifest")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=publish_cmd)

    p = cmds.add_parser("serve", help="serve a store; with --upstream, relay")
    flags = SettingsFlags(p, WeightsSettings)
    p.add_argument("dir", type=Path, help="store directory")
    flags.add(Flag("serve.host"), Flag("serve.port"))
    p.add_argument(
        "--upstream", action="append", default=None, help="relay mode: upstream server URL (repeatable)"
    )
    flags.add(
        Flag("serve.keep"),
        Flag("trainer_key"),
        Flag("serve.ban", append=True),
        Flag("serve.ban_file"),
        Flag("serve.rate_per_s", "--rate-limit"),
        Flag("serve.require_node_auth"),
    )
    p.add_argument(
        "--key",
        type=Path,
        default=None,
        help="this server's key: signs which verified shards it holds (as nodes do) and its requests to upstreams",
    )
    flags.add(
        Flag("serve.public_urls", "--public-url", append=True), Flag("metrics_host"), Flag("metrics_port")
    )
    p.set_defaults(handler=serve_cmd)

    p = cmds.add_parser("fetch", help="download and verify a checkpoint")
    flags = SettingsFlags(p, WeightsSettings)
    p.add_argument("--source", action="append", required=True, help="server URL (repeatable)")
    flags.add(Flag("trainer_key", required=True))
    p.add_argument("--out", type=Path, required=True, help="store directory to fetch into")
    p.add_argument("--step", type=_step, default=None, help="step number or 'latest' (default)")
    flags.add(Flag("fetch.concurrency"), Flag("fetch.stall_timeout_s", "--stall-timeout"), Flag("fetch.keep"))
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
    settings = load_settings(args, WeightsSettings)
    if args.upstream and not settings.trainer_key:
        raise ConfigError("relay mode (--upstream) needs --trainer-key: a relay verifies what it mirrors")
    identity = Identity.load(args.key) if args.key is not None else None
    listeners = [Listener(settings.serve.host, settings.serve.port, "--port", "the weights server")]
    if settings.metrics_port is not None:
        listeners.append(Listener(settings.metrics_host, settings.metrics_port, "--metrics-port", "/metrics"))
    check_ports_free(listeners)
    return asyncio.run(_serve(args.dir, args.upstream or [], settings, identity))


async def _serve(
    directory: Path, upstreams: list[str], settings: WeightsSettings, identity: Identity | None
) -> int:
    async def start(supervisor: Supervisor) -> str:
        metrics = RelayMetrics() if settings.metrics_port is not None else None
        server = WeightsServer(
            Store(directory),
            settings.serve,
            settings.trainer_key,
            metrics=None if metrics is None else metrics.weights,
            # Signed availability, as re-serving nodes give: fetchers ask a relay only for the shards it has
            # verified (no 503 round trips while it mirrors), and a relay that claims a shard it then does not
            # serve is caught under its own key.
            identity=identity,
        )
        url = await server.start()
        supervisor.on_shutdown("weights server", server.stop)
        served = f"serving {server.store.root} at {url}"
        if metrics is not None:
            assert settings.metrics_port is not None
            runner, metrics_url = await serve_metrics(
                metrics.registry, settings.metrics_host, settings.metrics_port
            )
            supervisor.on_shutdown("metrics server", runner.cleanup)
            served += f", metrics at {metrics_url}"
        if server.scanner is not None:
            supervisor.supervise(server.scanner)
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
            supervisor.spawn("weights-relay", relay.run())
        return served

    return await run_until_stopped("weights-serve", start, SHUTDOWN_TIMEOUT_S)


def fetch_cmd(args: argparse.Namespace) -> int:
    settings = load_settings(args, WeightsSettings)
    assert settings.trainer_key is not None  # required flag, validated by the settings pattern
    progress = DownloadProgress(enabled=not args.json)
    identity = Identity.load(args.key) if args.key is not None else None
    fetcher = Fetcher(
        args.source,
        settings.trainer_key,
        Store(args.out),
        settings.fetch,
        on_bytes=progress.on_bytes,
        identity=identity,
    )
    fetcher.on_manifest = progress.on_manifest
    try:
        result = asyncio.run(fetcher.fetch(args.step))
    except FetchError as exc:
        if not args.json:
            raise
        print_json({"ok": False, "error": str(exc), "blame": exc.blame})
        return 1
    finally:
        progress.close()
    if args.json:
        print_json({"ok": True, **result.report()})
    elif result.already_held:
        print(f"step {result.manifest.step} already held and verified: {result.checkpoint_dir}")
    else:
        print(f"step {result.manifest.step} verified: {result.checkpoint_dir}")
    return 0
