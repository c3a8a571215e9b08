"""Rollout hand-off over libp2p streams between real swarm peers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from pathlib import Path

import pytest

from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import (
    HandoffError,
    HandoffRefused,
    ReceivedRollout,
    RolloutEnvelope,
    Swarm,
    ValidatorAnnouncement,
)
from prime_node.p2p.swarm.framing import read_frame, write_frame
from prime_node.p2p.swarm.handoff import (
    ENVELOPE_SUFFIX,
    FILE_SUFFIX,
    MAX_CONTROL_FRAME,
    protocol_name,
    stored_name,
)
from prime_node.proofs.rollout_file import parse_envelope, sign_bytes, verify_envelope

from support.swarm import fleet, wait_until

# A port nothing listens on: announcing it makes the dial-back self-test fail, as behind a NAT.
CLOSED_PORT_MADDR = "/ip4/127.0.0.1/tcp/9"


def rollout_bytes(size: int) -> bytes:
    return b"PAR1" + os.urandom(size - 8) + b"PAR1"  # opaque to the hand-off layer; Parquet-like ends


async def test_rollout_reaches_validator_from_a_peer_in_client_mode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    operator = Identity.generate()
    async with fleet("handoff", operator) as group:
        validator = await group.add(operator, roles=("validator",))
        await validator.publish_validator()
        received: list[ReceivedRollout] = []
        await validator.serve_rollouts(tmp_path / "incoming", received.append)
        with caplog.at_level(logging.WARNING, logger="prime_node.p2p.swarm"):
            sender = await group.add(announce_maddrs=[CLOSED_PORT_MADDR])
        assert sender.client_mode  # the self-test found it cannot be dialled
        # The operator is told once, and told what to open. (Other warnings, such as a heartbeat store
        # that timed out on a busy machine, may come too.)
        logged = [r.getMessage() for r in caplog.records if r.name.startswith("prime_node.p2p.swarm")]
        told = [m for m in logged if "cannot be dialled" in m]
        assert len(told) == 1 and "forward TCP 9" in told[0] and "--host-maddrs" in told[0], logged
        heartbeat = (await validator.list_peers())[sender.node_id]
        assert heartbeat.client_mode and heartbeat.addresses == []

        data = rollout_bytes(700_000)  # several chunks
        sha = hashlib.sha256(data).hexdigest()
        # The envelope exactly as proofs/rollout_file.py signs it for the outbox.
        envelope = RolloutEnvelope.model_validate(
            sign_bytes(data, sender.identity, batch=(0, 0)), strict=True
        )
        receipt = await sender.send_rollout(data, envelope)
        assert (receipt.body.sha256, receipt.body.sender, receipt.body.receiver) == (
            sha,
            sender.node_id,
            validator.node_id,
        )
        assert [r.envelope.sha256 for r in received] == [sha] and received[0].peer_id == sender.peer_id
        name = stored_name(sha, sender.node_id)  # one sender's delivery of these bytes
        assert (tmp_path / "incoming" / f"{name}{FILE_SUFFIX}").read_bytes() == data
        # What lands on disk is what proofs/rollout_file.py reads: the file and its .sig envelope.
        stored = parse_envelope((tmp_path / "incoming" / f"{name}{ENVELOPE_SUFFIX}").read_bytes())
        assert verify_envelope(data, stored, expected_signer=sender.node_id) == sender.node_id
        # A resend after an ambiguous failure gets a receipt again without a second acceptance.
        again = await sender.send_rollout(data, RolloutEnvelope.sign(sender.identity, data, (0, 0)))
        assert again.body.sha256 == sha and len(received) == 1


async def test_bad_hand_offs_are_refused_without_being_stored(tmp_path: Path) -> None:
    operator = Identity.generate()
    incoming = tmp_path / "incoming"
    async with fleet("refusals", operator) as group:
        validator = await group.add(operator, roles=("validator",), max_rollout_bytes=64 * 1024)
        await validator.publish_validator()
        accepted: list[ReceivedRollout] = []

        def accept(rollout: ReceivedRollout) -> None:
            if rollout.size == 3000:  # stands in for the validator's own checks failing
                raise HandoffRefused("rollout failed verification")
            accepted.append(rollout)

        await validator.serve_rollouts(incoming, accept)
        sender = await group.add()
        data = rollout_bytes(2000)
        signed = RolloutEnvelope.sign(sender.identity, data, (0, 0))

        async def refused(payload: bytes, envelope: RolloutEnvelope, match: str) -> None:
            with pytest.raises(HandoffRefused, match=match):
                await sender.send_rollout(payload, envelope)

        big = rollout_bytes(65 * 1024)
        await refused(big, RolloutEnvelope.sign(sender.identity, big, (0, 1)), "exceeds the limit")
        unsigned = signed.model_copy(update={"signature": "00" * 64})
        await refused(data, unsigned, "signature does not verify")
        # Valid, but not this peer's node id.
        by_other = RolloutEnvelope.sign(Identity.generate(), data, (0, 0))
        await refused(data, by_other, "no live heartbeat binds")
        await refused(data[:-1] + b"!", signed, "SHA-256")
        rejected = rollout_bytes(3000)
        await refused(
            rejected, RolloutEnvelope.sign(sender.identity, rejected, (0, 2)), "failed verification"
        )
        assert sorted(incoming.iterdir()) == [] and accepted == []
        # Not one byte of the refused files reached the validator's disk: only the good one lands.
        await sender.send_rollout(data, signed)
        assert [r.envelope for r in accepted] == [signed]
        name = stored_name(signed.sha256, sender.node_id)
        assert sorted(p.name for p in incoming.iterdir()) == sorted(
            [f"{name}{FILE_SUFFIX}", f"{name}{ENVELOPE_SUFFIX}"]
        )
        (incoming / f"{name}{FILE_SUFFIX}").unlink()
        (incoming / f"{name}{ENVELOPE_SUFFIX}").unlink()

        await operator_bans(group.peers[0], sender.node_id)
        await refused(data, signed, "banned")
        assert sorted(incoming.iterdir()) == []


async def operator_bans(operator_swarm: Swarm, node_id: str) -> None:
    await operator_swarm.publish_ban(node_id, "slashed in a test")

    async def visible() -> bool:
        return node_id in await operator_swarm.read_bans()

    await wait_until(visible, timeout=20.0)
    await asyncio.sleep(2.1)  # the receiver caches ban lookups for 2 s


async def test_a_validator_that_reads_slowly_cannot_hold_a_hand_off_past_its_deadline(tmp_path: Path) -> None:
    """The sender gives the whole body one wall-clock deadline (grace plus its size at the rate floor). It used
    to wait up to handoff_timeout_s for each 256 KiB chunk, so a validator that drains one chunk just in time
    held a 4 MiB hand-off for a minute here (a 64 MiB one for hours with the default settings)."""
    operator = Identity.generate()
    floor, grace, size = 1 << 20, 1.0, 4 << 20  # the body's deadline: 1 s + 4 MiB at 1 MiB/s = 5 s
    limits = dict(handoff_min_bytes_per_s=floor, handoff_deadline_grace_s=grace, handoff_timeout_s=10.0)
    async with fleet("slowreader", operator) as group:
        honest = await group.add(operator, roles=("validator",), **limits)
        received: list[ReceivedRollout] = []
        await honest.serve_rollouts(tmp_path / "incoming", received.append)
        hostile = await group.add(roles=("validator",), **limits)

        async def read_slowly(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:  # noqa: ANN001
            await read_frame(reader, MAX_CONTROL_FRAME, 10.0)
            await write_frame(writer, {"go": True})
            while await reader.read(16 * 1024):  # 64 KiB/s: each chunk drains well within 10 s
                await asyncio.sleep(0.25)

        await hostile._add_handler(protocol_name("slowreader"), read_slowly)
        sender = await group.add(**limits)
        await wait_until(lambda: _binds(honest, sender), 20)
        data = rollout_bytes(size)
        envelope = RolloutEnvelope.sign(sender.identity, data, (0, 0))

        def announcement(peer: Swarm, maddrs: list[str]) -> ValidatorAnnouncement:
            return ValidatorAnnouncement(
                node_id=peer.node_id,
                peer_id=peer.peer_id,
                addresses=maddrs[:8],
                max_rollout_bytes=64 << 20,
                published_at=time.time(),
            )

        start = time.monotonic()
        with pytest.raises(
            HandoffError, match=r"did not take the 4194304-byte body within its deadline of 5\.0 s"
        ):
            await asyncio.wait_for(
                sender.send_rollout(data, envelope, announcement(hostile, await hostile.maddrs())), 30
            )
        assert time.monotonic() - start < 5.0 + 4.0
        # The honest control: the same file to a validator that reads at full speed, well within the deadline.
        receipt = await sender.send_rollout(data, envelope, announcement(honest, await honest.maddrs()))
        assert receipt.body.sha256 == envelope.sha256 and len(received) == 1


async def _binds(validator: Swarm, peer: Swarm) -> bool:
    return (await validator.list_peers()).get(peer.node_id) is not None
