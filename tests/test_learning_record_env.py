"""Issue 19's learning record on a reasoning-gym family, run as documented (docs/environments.md, "Learning on
reasoning-gym", run E): the tiny model warm-started for 200 steps on `spell_backward` (words of 3-5 letters)
without ever seeing a held-out prompt, then RL on the full path (real engine, signed rollout files, the
validator's checks, the trainer's inbox, Learner and publisher) at temperature 0.7, within 20 CPU-minutes at
one torch thread (process CPU time, so a shared machine gives the figures an idle one gives):

- on `band` (held-out prompts of the run's filtered distribution, 168 problems) sampled pass@1 at the
  training temperature gains >= 15 points, and >= 15 counting each prompt once (`band-distinct-sampled`);
- greedy accuracy on the same prompts does not fall (run E: +1.8). Greedy accuracy is *not* asserted to
  gain 15 points: it did not (docs/environments.md records it), and a test that asserted it would fail.

Opt-in (PRIME_NODE_LONG_TESTS=1) because it cannot fit CI's budget: about 17 CPU-minutes (80 s of warm
start, 50 s of offline filtering, 14.6 minutes of RL and evaluations), while CI runs the whole default suite
in about 25 minutes of wall time on 2 cores. The CPU kernels are pinned to AVX2 (node/runtime/numerics.py),
so x86-64 machines should give the figures docs/environments.md records.
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
    "--filter 1200 --heldout-filter 3000 --eval-size 300 --steps 150 --files 1 --prompts 64 --samples 8 "
    "--batch-size 192 --optimizer-steps 1 --lr 1e-3 --warmup 5 --negative-weight 0 --decay --min-lr-ratio 0 "
    "--temperature 0.7 --eval-samples 4 --eval-every 25 --threads 1 --cpu-minutes 20 --seed 0"
).split()


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)  # CPU time is the budget; on a shared machine the wall clock runs longer
@pytest.mark.skipif(
    os.environ.get("PRIME_NODE_LONG_TESTS") != "1",
    reason="long: about 17 CPU-minutes (set PRIME_NODE_LONG_TESTS=1)",
)
def test_rl_raises_sampled_pass_at_1_on_held_out_spell_backward_within_20_cpu_minutes(tmp_path: Path) -> None:
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
    assert held["band"]["problems"] > 100 and held["band-distinct-sampled"]["problems"] > 100, held
    for name in ("band-sampled", "band-distinct-sampled"):
        assert held[name]["last"] - held[name]["first"] >= 0.15, (name, held[name])
    assert held["band"]["last"] >= held["band"]["first"], f"greedy accuracy fell: {held['band']}"
    assert (tmp_path / "curve.png").read_bytes().startswith(b"\x89PNG")
