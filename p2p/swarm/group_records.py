"""Wire schemas of the two DHT records that form pipelined groups (docs/pipeline.md, "Groups").

- `StageAvailability` (kind "stages", subkey and signer: the node): what a pipeline-capable node offers: the
  stages of the run's layout it can hold, its measured throughput, round-trip times to peers it knows and
  whether it is directly reachable. The operator's coordinator forms groups from these.
- `GroupRecord` (kind "group", subkey: the group id, signer: a pinned operator key): members in stage order,
  the policy step, the layout, the formation round and the formation nonce (bound into the id). A node acts
  only on one that names it.

Both are sealed and opened by records.py like every swarm record (signer and signature checked before the
payload is parsed); the models here bound every list and keep every float finite and in range, so that the
formation's arithmetic (trainer/groups/formation.py) never meets a NaN, an infinity or a million entries.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from ..pipeline.group_ids import GroupNonce, formed_ms, group_id_of, nonce_formed_ms
from ..pipeline.layout import MAX_STAGES, StageLayout, layout_digest
from ..wire import NodeId, Sha256Hex, Timestamp, WireModel

MAX_KNOWN_PEERS = 32  # round-trip times one availability record may carry
MAX_RTT_MS = 60_000.0  # a minute: anything slower is no pipeline hop
# Layer-tokens per second (tokens x decoder layers forwarded per second): one number that prices any stage,
# since a stage of n layers takes about n / layer_tokens_per_s seconds per token. 1e12 is far past any GPU.
MAX_THROUGHPUT = 1e12


class PeerRtt(WireModel):
    node_id: NodeId  # the peer measured
    rtt_ms: float = Field(ge=0, le=MAX_RTT_MS)  # median round trip to it, in milliseconds


class StageAvailability(WireModel):
    node_id: NodeId  # must equal the subkey and the signer
    # Stage indices of the run's announced layout this node can hold (its memory fits their layers).
    stages: list[Annotated[int, Field(ge=0, lt=MAX_STAGES)]] = Field(min_length=1, max_length=MAX_STAGES)
    layer_tokens_per_s: float = Field(
        gt=0, le=MAX_THROUGHPUT
    )  # measured, not declared (node/pipeline/offer.py)
    rtts: list[PeerRtt] = Field(max_length=MAX_KNOWN_PEERS)
    reachable: bool  # dialable directly (not behind NAT/client mode): preferred as a group member
    policy_step: int | None = Field(None, ge=0, lt=1 << 63)  # the checkpoint it holds, if any
    published_at: Timestamp

    @model_validator(mode="after")
    def _unique(self) -> StageAvailability:
        if len(set(self.stages)) != len(self.stages):
            raise ValueError(f"stages {self.stages} repeat an entry")
        peers = [r.node_id for r in self.rtts]
        if len(set(peers)) != len(peers):
            raise ValueError("rtts name a peer twice")
        if self.node_id in peers:
            raise ValueError("rtts name the node itself")
        return self

    def rtt_to(self, node_id: str) -> float | None:
        return next((r.rtt_ms for r in self.rtts if r.node_id == node_id), None)


def group_id(
    run_id: str, policy_step: int, members: tuple[str, ...] | list[str], layout: StageLayout, nonce: str
) -> str:
    """The id a group's streams open with: the digest of run, step, members, layout and formation nonce
    (p2p/pipeline/group_ids.py, which every party's computation of the id goes through)."""
    return group_id_of(run_id, policy_step, members, layout_digest(layout), nonce)


class GroupRecord(WireModel):
    group_id: Sha256Hex  # must equal the subkey and group_id(run, policy_step, members, layout, nonce)
    round: int = Field(ge=0, lt=1 << 63)  # the coordinator's formation round: a newer round supersedes
    policy_step: int = Field(ge=0, lt=1 << 63)  # the checkpoint every member runs
    layout: StageLayout  # must equal the run's announced layout (RunParameters.pipeline)
    members: list[NodeId] = Field(min_length=2, max_length=MAX_STAGES)  # node ids in stage order
    formed_at: Timestamp  # when the group was first formed (its confirmation deadline counts from here)
    # Drawn by the coordinator when it formed the group, kept while the group stands (p2p/pipeline/group_ids.py):
    # its formation time in ms (must be `formed_at`'s) and 16 random bytes. Bound into the id, it makes each
    # formation of the same members another group, whose batch numbers begin at 0 with no opening signed twice.
    nonce: GroupNonce
    signed_at: Timestamp  # when this round signed it (members allow a newer round a moment to propagate)

    @model_validator(mode="after")
    def _consistent(self) -> GroupRecord:
        if len(self.members) != self.layout.stages:
            raise ValueError(f"{len(self.members)} members for a layout of {self.layout.stages} stages")
        if len(set(self.members)) != len(self.members):
            raise ValueError("a node is named for two stages")
        if nonce_formed_ms(self.nonce) != formed_ms(self.formed_at):
            raise ValueError(
                f"nonce {self.nonce} carries formation time {nonce_formed_ms(self.nonce)} ms, not formed_at "
                f"{formed_ms(self.formed_at)} ms"
            )
        return self

    def stage_of(self, node_id: str) -> int | None:
        return self.members.index(node_id) if node_id in self.members else None
