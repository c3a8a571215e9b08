"""The group lifecycle on a real swarm (hivemind DHT children and p2p daemons on 127.0.0.1): nodes offer stages,
the operator's coordinator forms and signs a group, members confirm through their heartbeats; a member is
killed (its DHT child SIGKILLed, its tasks gone) and the survivors regroup. Prints the measured time from the
kill to the new group confirmed by all its members."""

from __future__ import annotations

import asyncio
import time

from prime_node.node.pipeline.member import MemberSettings, PipelineMember
from prime_node.p2p.identity import Identity
from prime_node.p2p.pipeline.layout import StageLayout
from prime_node.trainer.groups.coordinator import GroupCoordinator
from prime_node.trainer.groups.plan import PlanSettings

from support.swarm import fleet, wait_until

LAYOUT = StageLayout(boundaries=[0, 2, 4])
FAST = dict(heartbeat_interval_s=0.5, heartbeat_ttl_s=20.0, record_ttl_s=60.0)
STALE_S = 3.0  # six missed heartbeats


async def test_a_killed_member_dissolves_its_group_and_the_survivors_regroup() -> None:
    operator = Identity.generate()
    async with fleet("groups", operator) as swarm:
        coordinator_peer = await swarm.add(operator, roles=("trainer",), **FAST)
        nodes = [await swarm.add(**FAST) for _ in range(3)]
        for node in nodes:
            node.policy_step = 3
        members = [
            PipelineMember(
                node,
                LAYOUT,
                MemberSettings(
                    stages=frozenset({0, 1}), layer_tokens_per_s=1000.0, poll_s=0.3, stale_after_s=STALE_S
                ),
            )
            for node in nodes
        ]
        coordinator = GroupCoordinator(
            coordinator_peer,
            LAYOUT,
            lambda: 3,
            PlanSettings(stale_after_s=STALE_S, confirm_within_s=15.0),
            poll_s=0.3,
        )
        tasks = {
            "coordinator": asyncio.create_task(coordinator.run(), name="test-coordinator"),
            **{
                n.node_id: asyncio.create_task(m.run(), name=f"test-member-{i}")
                for i, (n, m) in enumerate(zip(nodes, members))
            },
        }
        try:

            async def confirmed(exclude: str | None = None) -> str | None:
                """The id of a group every member of which names it in a live heartbeat, if any."""
                beats = await coordinator_peer.list_peers()
                for group in coordinator.state.current:
                    if exclude is not None and exclude in group.members:
                        continue
                    if all(
                        beats.get(m) is not None and beats[m].group == group.group_id for m in group.members
                    ):
                        return group.group_id
                return None

            formed_in = await wait_until(lambda: _truthy(confirmed()), timeout=60.0)
            (first,) = coordinator.state.current
            spare = next(n for n in nodes if n.node_id not in first.members)
            victim = next(n for n in nodes if n.node_id == first.members[0])
            survivor = next(n for n in nodes if n.node_id == first.members[1])
            # Kill: the victim's DHT child and p2p daemon die without a goodbye, and its own tasks stop.
            killed_at = time.monotonic()
            tasks.pop(victim.node_id).cancel()
            assert victim.process is not None
            victim.process.kill()
            regrouped_in = await wait_until(lambda: _truthy(confirmed(exclude=victim.node_id)), timeout=60.0)
            (second,) = coordinator.state.current
            assert set(second.members) == {spare.node_id, survivor.node_id}
            assert second.round > first.round
            assert [gid for _, gid, _ in coordinator.state.dissolved] == [first.group_id]
            # The survivor left the old group before joining the new one (its batch there was abandoned).
            survivor_member = members[nodes.index(survivor)]
            seen = [gid for _, gid, _ in survivor_member.events]
            assert seen[0] == first.group_id and seen[-1] == second.group_id and set(seen[1:-1]) <= {None}
            print(
                f"group formed and confirmed in {formed_in:.2f} s; kill -> survivors regrouped and confirmed in "
                f"{time.monotonic() - killed_at:.2f} s (wait {regrouped_in:.2f} s; heartbeat staleness {STALE_S} s)"
            )
            assert time.monotonic() - killed_at < 60.0
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)


async def _truthy(value: object) -> bool:
    return bool(await value)  # type: ignore[misc]
