"""A node's Ed25519 identity: key files on disk, and signing with them.

The node id is the hex-encoded 32-byte public key. The secret key file holds the 32-byte seed as hex
(one line) and must be readable by its owner only, as ssh insists for its private keys: a key that
other users can read may already be copied, so it is refused rather than silently used.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nacl.signing

from .errors import KeyFileError
from .signing import canonical_json

KEY_FILE_MODE = 0o600
SEED_BYTES = 32


@dataclass(frozen=True)
class Identity:
    """An Ed25519 key pair. `node_id` (hex public key) is how peers name this node."""

    signing_key: nacl.signing.SigningKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(nacl.signing.SigningKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """Deterministic identity from a 32-byte seed (tests and devnets)."""
        if len(seed) != SEED_BYTES:
            raise KeyFileError(f"an Ed25519 seed is {SEED_BYTES} bytes, got {len(seed)}")
        return cls(nacl.signing.SigningKey(seed))

    @property
    def public_key(self) -> bytes:
        return bytes(self.signing_key.verify_key)

    @property
    def node_id(self) -> str:
        return self.public_key.hex()

    def sign(self, message: bytes) -> bytes:
        """Detached 64-byte signature over `message`."""
        return self.signing_key.sign(bytes(message)).signature

    def sign_document(self, document: Any) -> bytes:
        """Detached signature over the canonical JSON of `document` (see signing.canonical_json)."""
        return self.sign(canonical_json(document))

    def save(self, path: Path, *, force: bool = False) -> None:
        """Write the secret key with mode 0600, atomically; refuses to overwrite unless `force`."""
        path = Path(path).expanduser()
        if path.exists() and not force:
            raise KeyFileError(f"{path} already exists; pass --force to overwrite it (the old key is lost)")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        # O_EXCL + explicit mode: the secret is never on disk with looser permissions, not even briefly.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(bytes(self.signing_key).hex() + "\n")
            os.chmod(tmp, KEY_FILE_MODE)  # in case a umask or filesystem altered the mode at creation
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path) -> Identity:
        """Read a key file written by `save`, refusing one that group or others can read or write."""
        path = Path(path).expanduser()
        try:
            st = path.stat()
        except FileNotFoundError:
            raise KeyFileError(
                f"key file {path} does not exist; create one with `prime-node keygen --out {path}`"
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"key file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise KeyFileError(
                f"key file {path} has mode {stat.S_IMODE(st.st_mode):04o}: it must not be accessible by group "
                f"or others. Fix it with `chmod 600 {path}`"
            )
        text = path.read_text(encoding="ascii", errors="replace").strip()
        try:
            seed = bytes.fromhex(text)
        except ValueError:
            raise KeyFileError(f"key file {path} is not a prime-node key (expected 64 hex digits)") from None
        if len(seed) != SEED_BYTES:
            raise KeyFileError(f"key file {path} holds {len(seed)} bytes, expected {SEED_BYTES}")
        return cls.from_seed(seed)
