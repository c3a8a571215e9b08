"""A synthetic run's accepted work on disk, as a validator and trainer leave it, plus a cheater's files.

Honest files are produced by the real engine and accepted by the real verifier (support/trainer_service.py);
their verdicts are signed by the validator's key and recorded in a real ledger; the files are delivered into
the accepted directory under the validator's own names. The checkpoint is published into a real store.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm.handoff import stored_name
from prime_node.p2p.verdicts import Signed, Verdict, sign
from prime_node.p2p.weights.publish import publish
from prime_node.proofs.rollout_file import read_rollout_file, signature_path, write_rollout_file
from prime_node.proofs.work_identity import sample_ids
from prime_node.trainer.ledger import Ledger

from support.attack import make_checkpoint
from support.trainer_service import RUN_ID, make_accepted_files

OPERATOR = Identity.from_seed(b"\x61" * 32)
VALIDATOR = Identity.from_seed(b"\x62" * 32)
STRANGER = Identity.from_seed(b"\x63" * 32)  # signs verdicts too, but nobody trusts it
HONEST = (Identity.from_seed(b"\x64" * 32), Identity.from_seed(b"\x65" * 32))
CHEATER = Identity.from_seed(b"\x66" * 32)


@dataclass
class SyntheticWorld:
    root: Path
    checkpoint: Path
    weights: Path
    ledger: Path
    accepted: Path
    honest_files: list[str]  # sha256 of every honest accepted file
    cheater_id: str


def verdict_for(path: Path, signer: Identity, accepted: bool = True) -> Signed[Verdict]:
    verified = read_rollout_file(path)
    rows = verified.rows
    return sign(
        Verdict(
            file_hash=verified.sha256,
            node_id=verified.signer,
            step=rows[0].policy_step,
            samples=len(rows),
            tokens=sum(len(r.output_ids) for r in rows),
            accepted=accepted,
            failed_check=None if accepted else "rewards",
            reason="" if accepted else "task reward 1.0, recomputed 0.0",
            validator_id=signer.node_id,
            decided_at=time.time(),
        ),
        signer,
    )


def deliver(path: Path, accepted: Path) -> str:
    """Copy a file and its signature into the accepted directory under the validator's name for it."""
    verified = read_rollout_file(path)
    name = stored_name(verified.sha256, verified.signer)
    accepted.mkdir(parents=True, exist_ok=True)
    (accepted / f"{name}.parquet.sig").write_bytes(signature_path(path).read_bytes())
    (accepted / f"{name}.parquet").write_bytes(path.read_bytes())
    return verified.sha256


def forge_rewards(path: Path, out: Path, node: Identity) -> Path:
    """The node's own file with every task reward claimed 1.0, re-signed by the node: a valid signature over
    a lie that the validator's reward check rejects."""
    rows = [
        dataclasses.replace(r, task_reward=1.0, reward=1.0 - r.length_penalty)
        for r in read_rollout_file(path).rows
    ]
    write_rollout_file(out, rows, node)
    return out


def build_world(root: Path, files_per_node: int = 2) -> SyntheticWorld:
    checkpoint = make_checkpoint(root / "model")
    weights = root / "weights"
    publish(checkpoint, step=0, identity=OPERATOR, out_dir=weights, shard_size=1 << 20, run_id=RUN_ID)
    accepted, ledger_path = root / "accepted", root / "ledger.sqlite"
    honest: list[str] = []
    with Ledger(ledger_path) as ledger:
        for n, node in enumerate(HONEST):
            for path in make_accepted_files(
                checkpoint, 0, files_per_node, root / f"stage-{n}", node=node, first_counter=10 * n
            ):
                ledger.record(verdict_for(path, VALIDATOR), samples=sample_ids(read_rollout_file(path).rows))
                honest.append(deliver(path, accepted))
        # The cheater: one honest file, accepted, whose bytes in the accepted directory it then replaces by a
        # forged copy (same name); one forged file with a stranger's accepting verdict; one forged file the
        # validator rejected; one forged file with no verdict at all. None of its rows may reach a dataset.
        staged = make_accepted_files(checkpoint, 0, 4, root / "stage-cheater", node=CHEATER, first_counter=50)
        real = staged[0]
        ledger.record(verdict_for(real, VALIDATOR), samples=sample_ids(read_rollout_file(real).rows))
        real_name = stored_name(read_rollout_file(real).sha256, CHEATER.node_id)
        forged = forge_rewards(real, root / "forged" / "swap.parquet", CHEATER)
        (accepted / f"{real_name}.parquet.sig").write_bytes(signature_path(forged).read_bytes())
        (accepted / f"{real_name}.parquet").write_bytes(forged.read_bytes())
        stranger_signed = forge_rewards(staged[1], root / "forged" / "stranger.parquet", CHEATER)
        ledger.record(
            verdict_for(stranger_signed, STRANGER),
            samples=sample_ids(read_rollout_file(stranger_signed).rows),
        )
        deliver(stranger_signed, accepted)
        rejected = forge_rewards(staged[2], root / "forged" / "rejected.parquet", CHEATER)
        ledger.record(verdict_for(rejected, VALIDATOR, accepted=False))
        deliver(rejected, accepted)
        deliver(forge_rewards(staged[3], root / "forged" / "unjudged.parquet", CHEATER), accepted)
    os.sync()
    return SyntheticWorld(root, checkpoint, weights, ledger_path, accepted, honest, CHEATER.node_id)
