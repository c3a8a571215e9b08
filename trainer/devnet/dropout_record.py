"""A `stage-dropout` adversary's record of the batch it broke, and the kill (trainer/devnet/pipeline_attacks.py
`DropOut` says when). Apart from the attacks, without torch: the devnet's monitor and report read the record, and
the kill is tested in a small process of its own."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import NoReturn

from pydantic import BaseModel, ConfigDict, Field

from ...node.runtime.durable import fsync_path

# What a drop-out writes into its data directory just before it kills itself: the devnet's record of the kill.
DROPOUT_FILE = "dropped-out.json"


class DropOutRecord(BaseModel):
    """The batch a drop-out broke, written (fsync'ed) by the dying process itself, so the kill time is its own
    clock's and the group and batch are the ones it had in flight, not a supervisor's guess."""

    model_config = ConfigDict(extra="forbid")

    at: float = Field(description="time.time() just before the SIGKILL")
    group_id: str = Field(pattern="^[0-9a-f]{64}$")
    policy_step: int = Field(ge=0, description="the group's checkpoint step")
    batch: int = Field(ge=0)
    stage: int = Field(ge=0)
    members: list[str] = Field(description="the group's node ids in stage order (the dropped one included)")
    pid: int


def drop_out_now(record_path: Path, record: DropOutRecord) -> NoReturn:
    """Write `record` durably, then SIGKILL this process's group when it leads one (the devnet starts every
    member in its own session), else this process alone (never a shell's job that happens to hold it). Does not
    return."""
    tmp = record_path.with_name(record_path.name + ".tmp")
    tmp.write_text(json.dumps(record.model_dump(mode="json")))
    fsync_path(tmp)
    os.replace(tmp, record_path)
    fsync_path(record_path.parent)
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(137)  # not reached: SIGKILL to oneself is delivered before kill() returns


def read_drop_out(data_dir: Path) -> DropOutRecord | None:
    """A member's drop-out record, if it dropped out (None when there is none or it is not whole)."""
    try:
        return DropOutRecord.model_validate_json((data_dir / DROPOUT_FILE).read_bytes())
    except (OSError, ValueError):
        return None
