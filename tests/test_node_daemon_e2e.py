"""`prime-node start` as a real subprocess against a real operator and validator on 127.0.0.1.

One scenario covers the daemon's promises in order: join, fetch, generate, SIGKILL mid-work, restart and
resend what was not acknowledged, `status --json`, a rollout file `prime-node verify` accepts, a policy
signed by another key ignored, a corrupted checkpoint refused while work goes on with the previous one,
the async window, and SIGTERM exiting 0 within the bound with every child gone.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import ReceivedRollout
from prime_node.p2p.weights.store import Store
from prime_node.trainer.devnet.processes import ProcessGroup, pid_alive

from support.node_daemon import (
    NODE_ENV,
    RUN_ID,
    TestOperator,
    cli,
    node_argv,
    node_status,
    pending_shas,
    policy_steps,
    poll,
)
from support.swarm import fleet

SHUTDOWN_BOUND_S = 30.0


def metric(data_dir: Path, name: str, labels: str = "") -> float:
    port = json.loads((data_dir / "status.json").read_text())["port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name) and labels in line:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} {labels} not exported")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
async def test_contributor_daemon_end_to_end(tmp_path: Path) -> None:
    model, tokenizer = build_tiny_model(seed=0)
    ckpt = tmp_path / "ckpt"
    save_model_dir(model, tokenizer, ckpt)
    operator_id = Identity.generate()
    node_id = Identity.generate()
    node_id.save(tmp_path / "node" / "node.key")
    data_dir = tmp_path / "node"
    incoming = tmp_path / "incoming"
    received: list[ReceivedRollout] = []

    async with fleet(RUN_ID, operator_id) as group:
        op_swarm = await group.add(operator_id, roles=("trainer", "validator"))
        operator = TestOperator(operator_id, op_swarm, tmp_path / "operator-store")
        await operator.start()
        try:
            await operator.announce(0, await operator.publish(ckpt, 0))
            peers = (await op_swarm.maddrs())[:1]
            argv = node_argv(data_dir, operator_id.node_id, peers)
            with ProcessGroup(tmp_path / "logs") as procs:
                # 1. No validator yet: files pile up in the outbox; SIGKILL the whole node mid-work.
                first = procs.start("node-1", argv, env=NODE_ENV)
                await poll(
                    lambda: len(pending_shas(data_dir)) >= 2, 120, "rollout files in the outbox", first
                )
                os.killpg(first.pid, signal.SIGKILL)
                first.process.wait(10)
                unacknowledged = pending_shas(data_dir)
                assert unacknowledged and not list((data_dir / "rollouts" / "sent").glob("*.receipt.json"))

                # 2. A validator appears; the restarted node (same identity, data dir) resends them first.
                await op_swarm.serve_rollouts(incoming, received.append)
                await op_swarm.publish_validator()
                node = procs.start("node-2", argv, env=NODE_ENV)
                await poll(
                    lambda: unacknowledged <= {r.envelope.sha256 for r in received}, 90, "the resend", node
                )
                assert {r.envelope.node_id for r in received} == {node_id.node_id}
                # The validator holds the body before the node has its receipt: the outbox entry moves to
                # sent/ a moment later.
                await poll(lambda: not pending_shas(data_dir) & unacknowledged, 30, "the receipts", node)

                status = await poll(
                    lambda: (
                        (s := node_status(data_dir))
                        and s["rollouts"]["handed_off"] >= 1
                        and s["rollouts"]["generated"] >= 1
                        and s
                    ),
                    30,
                    "status reporting hand-offs",
                    node,
                )
                assert status["node_id"] == node_id.node_id and status["operator_key"] == operator_id.node_id
                assert (status["announced_step"], status["local_step"], status["local_verified"]) == (
                    0,
                    0,
                    True,
                )
                assert status["peers_seen"] >= 1 and status["tokens_per_second"] > 0

                # 3. A received file passes the validator's full verification against the step-0 checkpoint.
                verdict = cli(
                    "verify",
                    str(received[0].path),
                    "--checkpoint",
                    str(ckpt),
                    "--run-id",
                    RUN_ID,
                    "--samples",
                    "2",
                    "--max-new-tokens",
                    "16",
                    "--threads",
                    "1",
                )
                assert verdict.returncode == 0, verdict.stdout + verdict.stderr

                # 4. A policy signed by a key that is not pinned is ignored (step 9 never shows up).
                rogue_id = Identity.generate()
                rogue = await group.add(rogue_id, roles=("trainer",), operator_keys=[rogue_id.node_id])
                await rogue.publish_policy(9, "ab" * 32, [operator.url], operator.run)

                # 5. Step 1 is announced, but its served weights are corrupted: refused, work goes on with 0.
                digest1 = await operator.publish(ckpt, 1)
                served = operator.served_file(1, "model.safetensors")
                raw = bytearray(served.read_bytes())
                raw[len(raw) // 2] ^= 0xFF
                served.write_bytes(bytes(raw))
                await operator.announce(1, digest1)
                await poll(
                    lambda: (
                        (s := node_status(data_dir))
                        and s["announced_step"] == 1
                        and "step 1 refused" in (s["last_error"] or "")
                    ),
                    60,
                    "the refusal of step 1",
                    node,
                )
                seen = len(received)
                await poll(lambda: len(received) > seen + 1, 60, "more rollouts after the refusal", node)
                assert all(policy_steps(r.path) == {0} for r in received)
                assert node_status(data_dir)["local_step"] == 0
                assert metric(data_dir, "prime_node_contributor_checkpoint_verification_failures_total") >= 1

                # 6. Step 3 (valid) makes step 0 too old (async window 2): the node moves on and deletes it.
                await operator.announce(3, await operator.publish(ckpt, 3))
                first_new = await poll(
                    lambda: next((i for i, r in enumerate(received) if 3 in policy_steps(r.path)), None),
                    90,
                    "a rollout of step 3",
                    node,
                )
                later = received[first_new:]
                assert all(policy_steps(r.path) == {3} for r in later)
                assert Store(data_dir / "checkpoints").versions() == [
                    3
                ]  # 0 left the window; 1 never verified
                status = node_status(data_dir)
                assert (status["announced_step"], status["local_step"]) == (3, 3)
                text = cli("status", "--data-dir", str(data_dir)).stdout
                assert "announced 3, local 3 (verified)" in text, text
                assert (
                    metric(data_dir, "prime_node_contributor_rollout_files_total", 'stage="handed_off"')
                    >= len(received) - 1
                )

                # 7. SIGTERM: a clean stop within the bound, exit code 0, no child left, status file gone.
                started = time.monotonic()
                os.kill(node.pid, signal.SIGTERM)
                code = node.process.wait(SHUTDOWN_BOUND_S)
                assert code == 0, node.log_tail(40)
                assert time.monotonic() - started < SHUTDOWN_BOUND_S
                await poll(lambda: not group_alive(node.pid), 10, "the node's children to exit")
                assert not (data_dir / "status.json").exists() and not pid_alive(node.pid)
                assert "Traceback" not in node.log_tail(400)
        finally:
            await operator.server.stop()
