"""Signed verdicts and ban records: round trip, tamper detection, untrusted signers, hostile envelopes."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from prime_node.p2p.identity import Identity
from prime_node.p2p.verdicts import (
    MAX_ENVELOPE_BYTES,
    BanRecord,
    DocumentError,
    Verdict,
    open_signed,
    sign,
    verify_signed,
)

from support.ledger import T0, VALIDATOR, make_verdict, node_id

TRUSTED = {VALIDATOR.node_id}
OPERATOR = Identity.from_seed(b"\x07" * 32)
NODE = node_id(1)


def _rejection() -> Verdict:
    return make_verdict(
        NODE, accepted=False, failed_check="sampling", reason="row 3: token 17 is not the Gumbel argmax"
    )


def test_verdict_round_trip_over_the_wire():
    signed = sign(_rejection(), VALIDATOR)
    opened = open_signed(signed.to_json(), Verdict, TRUSTED)
    assert opened.document == signed.document and opened.signature == signed.signature
    assert verify_signed(opened, TRUSTED) == signed.document
    assert open_signed(json.loads(signed.to_json()), Verdict, TRUSTED).document == signed.document


@pytest.mark.parametrize(
    "field, value",
    [
        ("accepted", True),
        ("failed_check", None),
        ("failed_check", "schema"),
        ("reason", "all fine"),
        ("step", 4),
        ("tokens", 10**6),
        ("samples", 9),
        ("decided_at", T0 + 1),
        ("file_hash", "0" * 64),
        ("node_id", node_id(2)),
    ],
)
def test_any_changed_field_breaks_the_signature(field, value):
    envelope = json.loads(sign(_rejection(), VALIDATOR).to_json())
    envelope["document"][field] = value
    with pytest.raises(DocumentError, match="does not verify"):
        open_signed(json.dumps(envelope), Verdict, TRUSTED)


def test_signature_bytes_tampered_or_malformed():
    envelope = json.loads(sign(_rejection(), VALIDATOR).to_json())
    sig = bytearray(bytes.fromhex(envelope["signature"]))
    sig[5] ^= 1
    for bad, match in ((sig.hex(), "does not verify"), ("zz" * 64, "not hex"), ("ab" * 10, "64 bytes")):
        with pytest.raises(DocumentError, match=match):
            open_signed(json.dumps({**envelope, "signature": bad}), Verdict, TRUSTED)


def test_untrusted_or_impersonated_signer_is_refused():
    mallory = Identity.from_seed(b"\x09" * 32)
    forged = sign(_rejection().model_copy(update={"validator_id": mallory.node_id}), mallory)
    with pytest.raises(DocumentError, match="not a trusted key"):
        open_signed(forged.to_json(), Verdict, TRUSTED)
    # Mallory names the trusted validator but signs with her own key.
    envelope = json.loads(forged.to_json())
    envelope["document"]["validator_id"] = VALIDATOR.node_id
    with pytest.raises(DocumentError, match="does not verify"):
        open_signed(json.dumps(envelope), Verdict, TRUSTED)
    with pytest.raises(DocumentError, match="signing key"):
        sign(_rejection(), mallory)


def test_hostile_envelopes_are_refused_before_parsing():
    good = json.loads(sign(_rejection(), VALIDATOR).to_json())
    cases = [
        (b"\xff\xfe not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({**good, "extra": 1}), "exactly two fields"),
        (json.dumps({"document": "text", "signature": good["signature"]}), "exactly two fields"),
        (b" " * (MAX_ENVELOPE_BYTES + 1), "limit"),
    ]
    for raw, match in cases:
        with pytest.raises(DocumentError, match=match):
            open_signed(raw, Verdict, TRUSTED)


def test_signed_but_schema_invalid_document_is_refused():
    # A trusted key that signs garbage (a bug, or a key misuse) still does not produce a verdict.
    doc = {**_rejection().payload(), "step": -1}
    envelope = {"document": doc, "signature": VALIDATOR.sign_document(doc).hex()}
    with pytest.raises(DocumentError, match="schema"):
        open_signed(json.dumps(envelope), Verdict, TRUSTED)
    doc = {**_rejection().payload(), "kind": "prime-node/ban/v1"}
    envelope = {"document": doc, "signature": VALIDATOR.sign_document(doc).hex()}
    with pytest.raises(DocumentError, match="schema"):
        open_signed(json.dumps(envelope), Verdict, TRUSTED)


def test_verdict_consistency_rules():
    with pytest.raises(ValidationError, match="cannot name a failed check"):
        make_verdict(NODE, accepted=True, failed_check="toploc")
    with pytest.raises(ValidationError, match="must name the failed check"):
        make_verdict(NODE, accepted=False, failed_check=None)
    with pytest.raises(ValidationError):
        make_verdict(NODE, file_hash="A" * 64)  # uppercase hex: two spellings of one hash are refused


def test_ban_record_signed_by_the_operator():
    ban = BanRecord(
        node_id=NODE,
        reason="fraud: toploc check failed",
        issued_at=T0,
        until=T0 + 3600,
        issuer_id=OPERATOR.node_id,
    )
    opened = open_signed(sign(ban, OPERATOR).to_json(), BanRecord, {OPERATOR.node_id})
    assert opened.document == ban and ban.active(T0 + 10) and not ban.active(T0 + 3600)
    forever = ban.model_copy(update={"until": None})
    assert forever.permanent and forever.active(T0 + 10**9)
    with pytest.raises(DocumentError, match="not a trusted key"):
        open_signed(
            sign(ban, OPERATOR).to_json(), BanRecord, TRUSTED
        )  # a validator key is not the operator's
    envelope = json.loads(sign(ban, OPERATOR).to_json())
    envelope["document"]["until"] = T0 + 10**7  # extending a ban needs the operator's signature
    with pytest.raises(DocumentError, match="does not verify"):
        open_signed(json.dumps(envelope), BanRecord, {OPERATOR.node_id})
    with pytest.raises(ValidationError, match="end after"):
        BanRecord(node_id=NODE, reason="x", issued_at=T0, until=T0, issuer_id=OPERATOR.node_id)


def test_a_verdict_signature_cannot_pass_as_a_ban():
    signed = sign(_rejection(), VALIDATOR)
    with pytest.raises(DocumentError):
        open_signed(signed.to_json(), BanRecord, TRUSTED)
