"""Validator admission: tiers (established vs newcomer), reserved places, back-pressure, tiered scheduling."""

from __future__ import annotations

import hashlib
import itertools

import pytest
from pydantic import ValidationError

from prime_node.p2p.swarm import DeliveryKey
from prime_node.trainer.validator.admission import Admission
from prime_node.trainer.validator.config import IntakeSettings
from prime_node.trainer.validator.intake import Tier, TieredQueue

_n = itertools.count()


def sha() -> str:
    return hashlib.sha256(f"file-{next(_n)}".encode()).hexdigest()


def key(node_id: str, sha256: str | None = None) -> DeliveryKey:
    return DeliveryKey(sha256 or sha(), node_id)


def node(i: int) -> str:
    return hashlib.sha256(f"node-{i}".encode()).hexdigest()


HONEST = node(0)
SYBILS = [node(100 + i) for i in range(50)]


WALL = 1_700_000_000.0  # the wall clock of these tests (standing is kept in the ledger's times)


def make(clock: list[float], wall: list[float] | None = None, **intake: object) -> Admission:
    fields: dict[str, object] = dict(
        queue_size=40,
        newcomer_queue=8,
        newcomer_per_node=2,
        per_node_queue=4,
        rate_per_minute=60,
        burst=4,
        established_after=3,
        established_window_s=3600.0,
    )
    fields.update(intake)
    now = wall or [WALL]
    admission = Admission(
        IntakeSettings(**fields), reservation_s=30.0, clock=lambda: clock[0], wall_clock=lambda: now[0]
    )
    admission.load_accepted([(HONEST, WALL - 600.0 + k, 1.0) for k in range(3)])
    return admission


def test_a_sybil_flood_fills_only_the_newcomer_slice() -> None:
    clock = [1000.0]
    admission = make(clock)
    admitted = {s: 0 for s in SYBILS}
    busy = []
    for _ in range(3):  # 50 fresh ids, each trying 3 files at once: 150 headers
        for sybil in SYBILS:
            answer = admission.admit(key(sybil))
            if answer is None:
                admitted[sybil] += 1
            else:
                busy.append(answer)
    assert sum(admitted.values()) == 8 and max(admitted.values()) <= 2  # the slice, at most 2 per newcomer
    assert admission.in_tier(Tier.NEWCOMER) == 8
    assert all("queue for newcomer nodes is full" in b.reason and b.retry_after_s == 10.0 for b in busy)
    # The established node keeps its places; its own bound and bucket still apply to it.
    honest = [admission.admit(key(HONEST)) for _ in range(5)]
    assert honest[:4] == [None] * 4
    assert honest[4] is not None and "established node already has 4 files" in honest[4].reason
    assert admission.tier_of(HONEST) is Tier.ESTABLISHED and admission.tier_of(SYBILS[0]) is Tier.NEWCOMER


def test_reservations_become_files_lapse_or_are_cancelled() -> None:
    clock = [1000.0]
    admission = make(clock, newcomer_queue=2, newcomer_per_node=2)
    newcomer = node(1)
    first, second, third = key(newcomer), key(newcomer), key(newcomer)
    assert admission.admit(first) is None and admission.admit(second) is None
    assert admission.admit(first) is None  # the same file again: already counted, not twice
    assert admission.admit(third) is not None  # two reservations fill the slice
    assert admission.enqueued(first) is Tier.NEWCOMER  # body stored: the reservation is the file
    assert admission.of_node(newcomer) == 2
    clock[0] += 31  # the second hand-off never sent its body: its reservation lapses
    assert admission.of_node(newcomer) == 1
    assert admission.admit(third) is None
    admission.cancel(third)  # it turned out to be decided already
    admission.finished(first)  # verdict
    assert admission.in_tier(Tier.NEWCOMER) == 0
    # A file recovered from the spool is counted whatever the bounds say: acknowledged means never dropped.
    for _ in range(5):
        admission.enqueued(key(newcomer))
    assert admission.of_node(newcomer) == 5


def test_rate_limit_is_busy_with_the_wait_as_hint() -> None:
    clock = [1000.0]
    admission = make(clock, per_node_queue=100, burst=2, rate_per_minute=6)
    answers = [admission.admit(key(HONEST)) for _ in range(3)]
    assert answers[:2] == [None, None]
    assert answers[2] is not None and answers[2].reason.startswith("rate limit: 6 files per minute")
    assert answers[2].retry_after_s == pytest.approx(10.0)


def test_standing_is_recent_accepted_volume_not_one_file_ever() -> None:
    wall = [WALL]
    admission = make([0.0], wall, established_after=3, established_window_s=3600.0)
    fresh = node(7)
    # One accepted file made a node established before: a Sybil farm bought reserved capacity that cheaply.
    admission.note_accepted(fresh)
    admission.note_accepted(fresh)
    assert admission.tier_of(fresh) is Tier.NEWCOMER
    admission.note_accepted(fresh)
    assert admission.tier_of(fresh) is Tier.ESTABLISHED
    # The standing lapses once the oldest of those files leaves the window, unless newer work replaces it.
    wall[0] += 1800.0
    admission.note_accepted(fresh)  # three within the hour still: the last two at WALL, and this one
    wall[0] += 1801.0
    assert admission.tier_of(fresh) is Tier.NEWCOMER  # only one file of the last hour is left
    # Files accepted long ago (loaded from the ledger at start) count for nothing; recent ones do.
    late = make([0.0], wall)
    old, recent = node(8), node(9)
    late.load_accepted([(old, wall[0] - 7200.0 + k, 1.0) for k in range(50)])
    late.load_accepted([(recent, wall[0] - 60.0 + k, 1.0) for k in range(3)])
    assert late.tier_of(old) is Tier.NEWCOMER and late.tier_of(recent) is Tier.ESTABLISHED


def test_a_pipelined_stage_file_counts_its_credit_share_towards_standing() -> None:
    # A member of a 2-stage group is credited half a batch per accepted file: it needs as much work as a
    # monolithic node to be established, not half of it (N identities of one operator each running a stage).
    wall = [WALL]
    admission = make([0.0], wall, established_after=3, established_window_s=3600.0)
    member, third = node(10), node(11)
    for _ in range(5):
        admission.note_accepted(member, share=0.5)
    assert admission.tier_of(member) is Tier.NEWCOMER  # 2.5 batches' worth
    admission.note_accepted(member, share=0.5)
    assert admission.tier_of(member) is Tier.ESTABLISHED
    # Only the newest files that reach the bound are kept: one whole file replaces two halves.
    wall[0] += 1800.0
    admission.note_accepted(member)
    wall[0] += 1801.0
    assert admission.tier_of(member) is Tier.NEWCOMER
    # Shares of 1/3 add up (within rounding) to whole batches; loaded from the ledger at start alike.
    admission.load_accepted([(third, wall[0] - 60.0 + k, 1 / 3) for k in range(9)])
    assert admission.tier_of(third) is Tier.ESTABLISHED
    assert len(admission._accepted[third]) == 9


def test_newcomer_slice_must_leave_room_for_established_nodes() -> None:
    with pytest.raises(ValidationError, match="newcomer_queue"):
        IntakeSettings(queue_size=16, newcomer_queue=16)


async def test_tiered_queue_bounds_an_established_files_wait() -> None:
    queue: TieredQueue[str] = TieredQueue(newcomer_share=0.25)
    for i, sybil in enumerate(SYBILS):
        queue.put(Tier.NEWCOMER, sybil, f"sybil-{i}")
    queue.put(Tier.ESTABLISHED, HONEST, "honest-0")
    queue.put(Tier.ESTABLISHED, node(1), "other-0")
    queue.put(Tier.ESTABLISHED, HONEST, "honest-1")
    served = [await queue.get() for _ in range(6)]
    # Established files take 3 of every 4 turns while they wait, whatever the number of newcomers.
    assert served == ["honest-0", "other-0", "honest-1", "sybil-0", "sybil-1", "sybil-2"]
    assert queue.waiting(Tier.NEWCOMER) == 47 and queue.waiting(Tier.ESTABLISHED) == 0
    queue.put(Tier.ESTABLISHED, HONEST, "honest-2")
    # The newcomers' credit from the last three turns is due first; then it is the established file's turn,
    # not after the 47 Sybil files still waiting.
    assert [await queue.get() for _ in range(2)] == ["sybil-3", "honest-2"]
    newcomers_only: TieredQueue[str] = TieredQueue(0.25)
    newcomers_only.put(Tier.NEWCOMER, node(3), "n")
    assert await newcomers_only.get() == "n"  # alone, newcomers are served at full speed
