"""The learning targets of issue 25, run as documented (docs/trainer.md, "Does it learn?", sections 7 and 8): the tiny
model, warm-started without ever seeing the held-out prompts, trained on the full path (real engine, signed
rollout files, the validator's checks, the trainer's inbox, Learner and publisher) within 20 minutes on 2 cores
(20 CPU-minutes at one torch thread, measured as process CPU time, so a shared machine gives the figures an
idle one gives), for each of three seeds:

- the warm start leaves room: its greedy accuracy on `band` is at most 50%;
- `band` (held-out prompts of the run's filtered distribution) gains >= 20 points;
- `band-distinct` (the same, each prompt counted once: the honest measure of generalisation) gains >= 15.

Opt-in (PRIME_NODE_LONG_TESTS=1) because it does not fit the default suite's budget: measured at commit
42453af (docs/trainer.md, section 9), one seed stops at its 400 steps after about 6 CPU-minutes of RL plus about
one of warm start, filtering and evaluations, so three seeds cost about 21 CPU-minutes, and about as many minutes
of wall time since they run one after another, while the default suite already takes about 23 minutes on CI's
two cores. Measured there: `band` +37.8, +35.5 and +34.8, `band-distinct` +15.6 for each seed (20 of its 128
prompts; 19 would be +14.8 and fail). The CPU kernels are pinned to AVX2 (node/runtime/numerics.py) and the weights
do not depend on the thread count, so x86-64 machines should give the same figures (checked: the pinned warm
start's accuracy is the one issue 25 measured on its AVX2 machine; not checked bit for bit on an Intel machine).
docs/trainer.md records what the command measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORD = (
    "--sft-steps 250 --heldout-fraction 0.2 --filter 8000 --heldout-filter 8000 --steps 400 --files 1 "
    "--prompts 64 --samples 8 --batch-size 192 --optimizer-steps 1 --lr 1e-3 --warmup 5 --negative-weight 0 "
    "--decay --min-lr-ratio 0 --eval-every 50 --threads 1 --cpu-minutes 20"
).split()
SEEDS = (0, 1, 2)


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)  # CPU time is the budget; on a shared machine the wall clock runs longer
@pytest.mark.skipif(
    os.environ.get("PRIME_NODE_LONG_TESTS") != "1",
    reason="long: about 22 CPU-minutes per seed, 3 seeds (set PRIME_NODE_LONG_TESTS=1)",
)
@pytest.mark.parametrize("seed", SEEDS)
def test_rl_gains_on_prompts_held_out_by_content_within_20_cpu_minutes(tmp_path: Path, seed: int) -> None:
    summary = tmp_path / "summary.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "learning.py"),
            *RECORD,
            "--seed",
            str(seed),
            "--out",
            str(tmp_path / "curve.png"),
            "--summary",
            str(summary),
        ],
        check=True,
        timeout=4 * 3600 - 60,
    )
    result = json.loads(summary.read_text())
    held = result["heldout"]
    assert result["rl_cpu_minutes"] <= 20 + 2, result  # one step and an evaluation may run past the budget
    assert held["band"]["problems"] > 100 and held["band-distinct"]["problems"] > 50
    assert held["band"]["first"] <= 0.50, f"the warm start leaves too little room: {held['band']}"
    assert held["band"]["last"] - held["band"]["first"] >= 0.20, held
    assert held["band-distinct"]["last"] - held["band-distinct"]["first"] >= 0.15, held
    assert (tmp_path / "curve.png").read_bytes().startswith(b"\x89PNG")
