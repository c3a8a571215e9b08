"""Which validator owns a batch (p2p/swarm/routing.py): the pure function every sender and receiver computes.

The end-to-end behaviour (two live validators in one DHT, a node's own delivery, one leaving) is in
tests/test_validator_assignment.py; here, the properties the protocol relies on, on many batches at once.
"""

from __future__ import annotations

import hashlib
import struct
import time
from pathlib import Path

from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import ValidatorAnnouncement
from prime_node.p2p.swarm.routing import DOMAIN, Batch, owner, score
from prime_node.trainer.validator.assignment import JOIN_MARGIN_STEPS, keep, load_kept, next_first_step

RUN = "routing-test"
NODES = [Identity.from_seed(bytes([i]) * 32).node_id for i in range(1, 9)]
BATCHES = [Batch(n, step, k) for n in NODES for step in range(4) for k in range(16)]  # 512 batches


def _validator(seed: int, from_step: int = 0) -> ValidatorAnnouncement:
    return ValidatorAnnouncement(
        node_id=Identity.from_seed(bytes([seed]) * 32).node_id,
        peer_id="1" * 40,
        addresses=[],
        max_rollout_bytes=1 << 20,
        published_at=time.time(),
        from_step=from_step,
    )


def _owners(validators: list[ValidatorAnnouncement]) -> dict[Batch, str | None]:
    found = {b: owner(RUN, b, validators) for b in BATCHES}
    return {b: v.node_id if v is not None else None for b, v in found.items()}


def test_the_score_is_the_documented_hash() -> None:
    batch, validator = Batch(NODES[0], 7, 3), _validator(100).node_id
    expected = hashlib.sha256(
        DOMAIN
        + struct.pack(">H", len(RUN))
        + RUN.encode()
        + bytes.fromhex(batch.node_id)
        + struct.pack(">QQ", 7, 3)
        + bytes.fromhex(validator)
    ).digest()
    assert score(RUN, batch, validator) == expected
    # Every input matters: another run, node, step, counter or validator gives another score.
    others = [
        score("routing-test2", batch, validator),
        score(RUN, batch._replace(node_id=NODES[1]), validator),
        score(RUN, batch._replace(policy_step=8), validator),
        score(RUN, batch._replace(batch_counter=4), validator),
        score(RUN, batch, _validator(101).node_id),
    ]
    assert expected not in others and len(set(others)) == len(others)


def test_one_owner_per_batch_whatever_order_the_set_is_read_in_and_the_work_is_spread() -> None:
    validators = [_validator(s) for s in (100, 101, 102)]
    owners = _owners(validators)
    assert owners == _owners(validators[::-1]) == _owners([validators[1], validators[2], validators[0]])
    shares = [sum(1 for o in owners.values() if o == v.node_id) for v in validators]
    assert all(120 < share < 220 for share in shares), shares  # 512 / 3 = 171 each, give or take
    assert owner(RUN, BATCHES[0], []) is None


def test_a_validator_leaving_moves_only_its_own_batches() -> None:
    validators = [_validator(s) for s in (100, 101, 102)]
    before = _owners(validators)
    gone = validators[1].node_id
    after = _owners([validators[0], validators[2]])
    moved = {b for b in BATCHES if before[b] != after[b]}
    assert moved == {b for b in BATCHES if before[b] == gone}  # the leaver's, and nobody else's
    assert all(after[b] != gone for b in BATCHES)


def test_a_validator_joining_takes_no_batch_of_a_step_before_its_first() -> None:
    validators = [_validator(100), _validator(101)]
    joined = _validator(102, from_step=2)
    before, after = _owners(validators), _owners([*validators, joined])
    assert all(after[b] == before[b] for b in BATCHES if b.policy_step < 2)  # existing work stays put
    taken = {b for b in BATCHES if after[b] == joined.node_id}
    assert taken and all(b.policy_step >= 2 for b in taken)
    assert {b for b in BATCHES if before[b] != after[b]} == taken  # and it takes only for itself


def test_the_last_eligible_validator_leaving_hands_its_steps_to_the_earliest_others() -> None:
    """Every step keeps an owner while any validator is live: when the only validator that takes a step leaves,
    the ones with the smallest `from_step` take it (their batches of later steps do not move)."""
    first, late, later = _validator(100), _validator(101, from_step=2), _validator(102, from_step=3)
    before = _owners([first, late, later])
    after = _owners([late, later])
    assert all(after[b] == late.node_id for b in BATCHES if b.policy_step < 2)  # no step is stranded
    moved = {b for b in BATCHES if before[b] != after[b]}
    assert moved == {b for b in BATCHES if before[b] == first.node_id}  # the leaver's, and nobody else's
    # Coming back with a new, later `from_step` (an absence: assignment.py), it takes none of them back.
    back = _validator(100, from_step=4)
    assert _owners([back, late, later]) == after
    # Alone, a validator owns every step whatever its `from_step`: an absence strands nothing.
    assert set(_owners([back]).values()) == {back.node_id}


def test_the_first_step_changes_only_after_an_absence_and_never_goes_back(tmp_path: Path) -> None:
    # next_first_step(kept, announced and live with, newest policy)
    assert next_first_step(None, None, None) == 0  # a swarm without a policy: from the start
    assert next_first_step(None, None, 5) == 5 + JOIN_MARGIN_STEPS  # joining a running swarm: past all
    assert next_first_step(0, 0, 40) == 0  # a restart while still live: nothing moved, nothing changes
    assert next_first_step(0, None, 40) == 40 + JOIN_MARGIN_STEPS  # back after an absence: past what moved
    assert next_first_step(50, None, 40) == 50  # never lower than before
    assert next_first_step(None, 3, 40) == 3  # a lost data directory: what the swarm routes by
    run_dir = tmp_path / "validator"
    assert load_kept(run_dir, RUN) is None
    keep(run_dir, RUN, 7)
    assert load_kept(run_dir, RUN) == 7
    assert load_kept(run_dir, "another-run") is None  # a new run chooses again
    for damaged in ("{not json", "[]", '{"run_id": "routing-test", "from_step": -1}', '{"from_step": true}'):
        (run_dir / "assignment.json").write_text(damaged)
        assert load_kept(run_dir, RUN) is None, damaged
