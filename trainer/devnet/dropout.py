"""What became of a `stage-dropout` adversary's broken batch, read from what the processes wrote themselves.

- the drop-out's own record of the kill (trainer/devnet/dropout_record.py `DropOutRecord`: when, the group and
  batch it had in flight, the group's members);
- every pipeline member's outbox signatures (`rollouts/{pending,sent,rejected}/*.sig`, kept after the verdict):
  each names its file's hash, group, batch and kind (stage file, partial record, fraud report);
- the validator's ledger: the verdict on each file (joined by hash and sender), slashes and bans.

From these: the files of the broken batch and their verdicts (none may be accepted; a survivor's partial record
is excused, `pipeline_incomplete`), whether the drop-out was slashed or banned (it must not be: a silent peer
proves nothing), and the first file a survivor of its group had accepted in another group after the kill, with
the time from the kill to that verdict: the regroup, measured.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ...proofs.errors import ProofError
from ...proofs.rollout_file import MAX_SIG_BYTES, envelope_group, parse_envelope, read_bounded
from .dropout_record import read_drop_out
from .layout import DevnetLayout, Member
from .pipeline_attacks import PIPELINE_ATTACKS

logger = logging.getLogger(__name__)

OUTBOX_DIRS = ("pending", "sent", "rejected")


def is_dropout(member: Member) -> bool:
    attack = PIPELINE_ATTACKS.get(member.attack or "")
    return attack is not None and attack.drop_out is not None


def group_files(members: Iterable[Member]) -> dict[tuple[str, str], dict[str, Any]]:
    """(file hash, sender) -> {group, policy_step, batch, kind, name, made_at} of every group file the members'
    outboxes hold
    (`made_at`: when its signature was written, just before the file was committed to the outbox)."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for member in members:
        for folder in OUTBOX_DIRS:
            for path in sorted((member.data_dir / "rollouts" / folder).glob("*.sig")):
                try:
                    made_at = path.stat().st_mtime
                    envelope = parse_envelope(read_bounded(path, MAX_SIG_BYTES, "signature file"))
                except (OSError, ProofError) as exc:  # half-written by a process that died: not a file yet
                    logger.debug("outbox signature %s not read: %s", path, exc)
                    continue
                group = envelope_group(envelope)
                if group is not None:
                    found[(envelope["sha256"], envelope["node_id"])] = {
                        "group": group,
                        "policy_step": envelope["policy_step"],
                        "batch": envelope["batch_counter"],
                        "kind": envelope["kind"],
                        "name": member.name,
                        "made_at": made_at,
                    }
    return found


def dropout_outcome(
    layout: DevnetLayout,
    member: Member,
    contributions: list[dict[str, Any]],
    slashes: list[dict[str, Any]],
    bans: list[dict[str, Any]],
) -> dict[str, Any]:
    """The report's entry for one drop-out (`ok`: dropped out, neither slashed nor banned, nothing of the broken
    batch accepted, a survivor of its group accepted in a new group)."""
    record = read_drop_out(member.data_dir)
    if record is None:
        return {"name": member.name, "node_id": member.node_id, "dropped": False, "ok": False}
    files = group_files(m for m in layout.members if m.pipeline)
    verdicts = {(c["file_hash"], c["node_id"]): c for c in contributions}
    broken = []
    for key, made in files.items():
        if made["group"] == record.group_id and made["batch"] == record.batch:
            verdict = verdicts.get(key)
            broken.append(
                {
                    "name": made["name"],
                    "kind": made["kind"],
                    "verdict": None
                    if verdict is None
                    else ("accepted" if verdict["accepted"] else str(verdict["failed_check"])),
                }
            )
    survivors = {m.node_id: m.name for m in layout.members if m.node_id in record.members}
    survivors.pop(member.node_id, None)
    # A survivor was in the broken group when it broke: a file it made after the kill of another group is of a
    # group it joined after (a file of a group it was in before is older than the kill, though it may be judged
    # after it).
    regrouped = None
    for c in sorted(contributions, key=lambda c: c["decided_at"]):
        file = files.get((c["file_hash"], c["node_id"]))
        if (
            c["accepted"]
            and c["node_id"] in survivors
            and file is not None
            and file["made_at"] > record.at
            and file["group"] != record.group_id
        ):
            regrouped = {
                "name": survivors[c["node_id"]],
                "group": file["group"],
                "batch": file["batch"],
                "kill_to_made_s": round(file["made_at"] - record.at, 1),  # the new group's batch done
                "kill_to_accepted_s": round(c["decided_at"] - record.at, 1),
                # A group of a later step: a new step regroups every member (groups are per step), so the regroup
                # need not have waited for the coordinator to find the member gone.
                "new_step": file["policy_step"] > record.policy_step,
            }
            break
    slashed = [s for s in slashes if s["node_id"] == member.node_id]
    banned = any(b["node_id"] == member.node_id for b in bans)
    accepted_broken = sum(1 for f in broken if f["verdict"] == "accepted")
    return {
        "name": member.name,
        "node_id": member.node_id,
        "dropped": True,
        "group": record.group_id,
        "batch": record.batch,
        "stage": record.stage,
        "survivors": sorted(survivors.values()),
        "broken_batch_files": sorted(broken, key=lambda f: (f["name"], f["kind"])),
        "broken_batch_accepted": accepted_broken,
        "slashed": len(slashed),
        "banned": banned,
        "regrouped": regrouped,
        "ok": not slashed and not banned and accepted_broken == 0 and regrouped is not None,
    }
