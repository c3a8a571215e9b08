"""Issue 19's learning target on a reasoning-gym family, run as documented (docs/environments.md, "Learning on
reasoning-gym", run F): the tiny model warm-started for 200 steps on `spell_backward` (words of 3-5 letters)
without ever seeing a held-out prompt, then RL on the full path (real engine, signed rollout files, the
validator's checks, the trainer's inbox, Learner and publisher) at temperature 0.7 with exact rewards, within
20 CPU-minutes at one torch thread (process CPU time, so a shared machine gives the figures an idle one gives):

- the warm start leaves room: its greedy accuracy on `band` is at most 65% (run F: 61.3%);
- held-out greedy accuracy gains >= 15 points on `band` (held-out prompts of the run's filtered distribution),
  on `band-distinct` (each prompt once) and on `mix-distinct` (the whole held-out distribution); run F:
  +16.1, +16.6 and +26.3.

This is run G's command (run F's recipe from scratch, `--sft-steps 200` in place of `--model`), which
reproduced F exactly. Opt-in (PRIME_NODE_LONG_TESTS=1) because it cannot fit CI's budget: about 16
CPU-minutes (77 s of warm start, 145 s of offline filtering, 12.5 minutes of RL and evaluations), while CI
runs the whole default suite in about 25 minutes of wall time on 2 cores. The CPU kernels are pinned to AVX2
(node/runtime/numerics.py), so x86-64 machines should give the figures docs/environments.md records.
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
    "--env reasoning_gym:family=spell_backward,max_word_len=5 --sft-steps 200 --heldout-fraction 0.2 "
    "--filter 6000 --heldout-filter 3000 --eval-size 300 --steps 160 --files 1 --prompts 64 --samples 8 "
    "--batch-size 192 --optimizer-steps 1 --lr 1e-3 --warmup 5 --negative-weight 0 --decay --min-lr-ratio 0 "
    "--temperature 0.7 --exact-reward --eval-samples 4 --eval-every 40 --threads 1 --cpu-minutes 20 --seed 0"
).split()


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)  # CPU time is the budget; on a shared machine the wall clock runs longer
@pytest.mark.skipif(
    os.environ.get("PRIME_NODE_LONG_TESTS") != "1",
    reason="long: about 16 CPU-minutes (set PRIME_NODE_LONG_TESTS=1)",
)
def test_rl_raises_held_out_spell_backward_accuracy_by_15_points_within_20_cpu_minutes(
    tmp_path: Path,
) -> None:
    summary = tmp_path / "summary.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "learning.py"),
            *RECORD,
            "--out",
            str(tmp_path / "curve.png"),
            "--summary",
            str(summary),
        ],
        check=True,
        timeout=3 * 3600 - 60,
    )
    result = json.loads(summary.read_text())
    held = result["heldout"]
    assert result["rl_cpu_minutes"] <= 20 + 2, result  # one step and an evaluation may run past the budget
    assert held["band"]["problems"] > 100 and held["band-distinct"]["problems"] > 100, held
    assert held["band"]["first"] <= 0.65, f"the warm start leaves too little room: {held['band']}"
    for name in ("band", "band-distinct", "mix-distinct"):
        assert held[name]["last"] - held[name]["first"] >= 0.15, (name, held[name])
    assert (tmp_path / "curve.png").read_bytes().startswith(b"\x89PNG")
