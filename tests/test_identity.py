"""Ed25519 identity: key files (mode, overwrite refusal, unsafe permissions) and detached signatures."""

from __future__ import annotations

import os
import stat

import pytest

from prime_node.p2p.errors import KeyFileError, SignatureError
from prime_node.p2p.identity import Identity
from prime_node.p2p.signing import canonical_json, is_valid_signature, verify_document, verify_signature


def test_saved_key_has_mode_0600_and_loads_back(tmp_path):
    ident = Identity.generate()
    path = tmp_path / "keys" / "node.key"
    ident.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load(path).node_id == ident.node_id
    assert len(ident.node_id) == 64


def test_save_mode_ignores_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        Identity.generate().save(tmp_path / "k")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o600


def test_refuses_to_overwrite_without_force(tmp_path):
    path = tmp_path / "node.key"
    first = Identity.generate()
    first.save(path)
    with pytest.raises(KeyFileError, match="--force"):
        Identity.generate().save(path)
    assert Identity.load(path).node_id == first.node_id  # the good key is untouched
    second = Identity.generate()
    second.save(path, force=True)
    assert Identity.load(path).node_id == second.node_id


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_refuses_key_readable_by_others(tmp_path, mode):
    path = tmp_path / "node.key"
    Identity.generate().save(path)
    path.chmod(mode)
    with pytest.raises(KeyFileError, match="chmod 600"):
        Identity.load(path)


def test_malformed_and_missing_key_files(tmp_path):
    missing = tmp_path / "absent.key"
    with pytest.raises(KeyFileError, match="keygen"):
        Identity.load(missing)
    bad = tmp_path / "bad.key"
    bad.write_text("not hex at all\n")
    bad.chmod(0o600)
    with pytest.raises(KeyFileError, match="64 hex digits"):
        Identity.load(bad)
    short = tmp_path / "short.key"
    short.write_text("abcd\n")
    short.chmod(0o600)
    with pytest.raises(KeyFileError, match="2 bytes"):
        Identity.load(short)


def test_signature_verifies_and_tampering_fails():
    ident = Identity.from_seed(bytes(range(32)))
    message = b"rollout sha256 0123"
    sig = ident.sign(message)
    verify_signature(ident.node_id, message, sig)
    with pytest.raises(SignatureError):
        verify_signature(ident.node_id, message + b"!", sig)
    flipped = bytes([sig[0] ^ 1]) + sig[1:]
    with pytest.raises(SignatureError):
        verify_signature(ident.node_id, message, flipped)
    other = Identity.generate()
    assert not is_valid_signature(other.node_id, message, sig)
    assert not is_valid_signature(ident.node_id, message, sig[:-1])
    assert not is_valid_signature("zz" * 32, message, sig)
    assert not is_valid_signature(ident.node_id[:-2], message, sig)


def test_canonical_json_is_order_independent_and_rejects_nan():
    a = {"b": 1, "a": [1, 2, {"y": "é", "x": None}]}
    b = {"a": [1, 2, {"x": None, "y": "é"}], "b": 1}
    assert canonical_json(a) == canonical_json(b) == '{"a":[1,2,{"x":null,"y":"é"}],"b":1}'.encode()
    with pytest.raises(SignatureError, match="cannot be signed"):
        canonical_json({"x": float("nan")})


def test_signed_document_round_trip_and_edit_detected():
    ident = Identity.generate()
    doc = {"step": 3, "sha256": "ab" * 32}
    sig = ident.sign_document(doc)
    verify_document(ident.node_id, dict(reversed(list(doc.items()))), sig)
    with pytest.raises(SignatureError):
        verify_document(ident.node_id, {**doc, "step": 4}, sig)
