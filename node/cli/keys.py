"""`prime-node keygen` and `prime-node identity`: the node's Ed25519 key."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import Field

from ...p2p.identity import Identity
from ..config import CommonSettings
from .common import print_json
from .flags import Flag, SettingsFlags, load_settings

DEFAULT_KEY_NAME = "node.key"


class KeySettings(CommonSettings):
    key_file: Path | None = Field(None, description="Secret key file; default <data-dir>/node.key.")

    def key_path(self) -> Path:
        return (self.key_file or self.resolved_data_dir() / DEFAULT_KEY_NAME).expanduser()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keygen", help="create an Ed25519 node key (mode 0600)")
    SettingsFlags(p, KeySettings).add(Flag("key_file", "--out"))
    p.add_argument(
        "--force", action="store_true", help="overwrite an existing key file (the old key is lost)"
    )
    p.add_argument("--json", action="store_true", help="print {node_id, key_file} as JSON")
    p.set_defaults(handler=keygen)

    p = sub.add_parser("identity", help="show this node's id (its public key)")
    SettingsFlags(p, KeySettings).add(Flag("key_file", "--key"))
    p.add_argument("--json", action="store_true", help="print {node_id, key_file} as JSON")
    p.set_defaults(handler=identity)


def keygen(args: argparse.Namespace) -> int:
    settings = load_settings(args, KeySettings)
    path = settings.key_path()
    ident = Identity.generate()
    ident.save(path, force=args.force)
    if args.json:
        print_json({"node_id": ident.node_id, "key_file": str(path)})
    else:
        print(ident.node_id)
    return 0


def identity(args: argparse.Namespace) -> int:
    settings = load_settings(args, KeySettings)
    path = settings.key_path()
    ident = Identity.load(path)
    if args.json:
        print_json({"node_id": ident.node_id, "key_file": str(path)})
    else:
        print(f"node id:  {ident.node_id}\nkey file: {path}")
    return 0
