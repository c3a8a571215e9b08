"""Typed settings of the trainer's group coordinator (the [groups] section of `prime-node trainer`'s config)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, model_validator

from ...node.config import Section

if TYPE_CHECKING:  # the planner reads swarm records (hivemind): not loaded when the CLI builds its flags
    from .plan import PlanSettings


class GroupsSection(Section):
    """Forming pipelined groups; used only when the run announces a stage layout ([run] pipeline)."""

    enabled: bool = Field(True, description="Form and sign pipelined groups when the run has a stage layout.")
    poll_s: float = Field(
        5.0, gt=0, le=600, description="How often offers and heartbeats are read and groups planned."
    )
    stale_after_s: float = Field(
        45.0, gt=0, le=300, description="A heartbeat or stage offer older than this is a departed node."
    )
    confirm_within_s: float = Field(
        60.0, gt=0, le=3600, description="Members must name a new group in their heartbeat within this."
    )
    cooldown_s: float = Field(
        300.0, ge=0, le=86400, description="How long a member that never confirmed its group is left out."
    )
    keep_apart_s: float = Field(
        600.0,
        ge=0,
        le=86400,
        description="How long a member that left a group for its failed batches (its heartbeat's left_group) "
        "is not grouped with that group's other members; it is not cooled down (0: no such pairs kept apart).",
    )
    free_leaves: int = Field(
        2,
        ge=0,
        le=1000,
        description="How many groups a member may leave for failed batches within keep_apart_s without a "
        "cooldown; each further one within it is cooled down as well (a leave costs the leaver one confirmation).",
    )
    unknown_rtt_ms: float = Field(
        250.0, ge=0, le=60_000, description="Price of a hop whose round trip neither end measured."
    )
    unreachable_penalty_s: float = Field(
        1.0, ge=0, le=3600, description="Price of a member that is not directly dialable (needs a relay)."
    )

    @model_validator(mode="after")
    def _staleness_after_a_beat(self) -> GroupsSection:
        if self.confirm_within_s < self.poll_s:
            raise ValueError(
                f"confirm_within_s ({self.confirm_within_s}) must be at least poll_s ({self.poll_s}): members "
                "need one round to read the group before they can confirm it"
            )
        return self

    def plan_settings(self) -> PlanSettings:
        from .formation import FormationSettings
        from .plan import PlanSettings

        formation = FormationSettings(
            unknown_rtt_ms=self.unknown_rtt_ms, unreachable_penalty_s=self.unreachable_penalty_s
        )
        return PlanSettings(
            stale_after_s=self.stale_after_s,
            confirm_within_s=self.confirm_within_s,
            cooldown_s=self.cooldown_s,
            formation=formation,
            keep_apart_s=self.keep_apart_s,
            free_leaves=self.free_leaves,
        )
