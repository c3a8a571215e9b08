"""Packed rows versus one padded sample per row, for the trainer's forward + backward.

Usage: .venv/bin/python benchmarks/trainer_packing.py [--samples N] [--budget TOKENS] [--threads N]
       [--repeats R] [--seed S]

Builds the embedded tiny model and N samples with arithmetic-like lengths (prompt 12-35 tokens, completion
2-60), then times `token_logprobs` + backward over the whole batch two ways with the same code path:
(a) packed into rows of --budget tokens (first-fit-decreasing, position ids restarting per sample);
(b) one sample per row padded to the longest sample, 8 rows per micro-batch (what a padded batch costs).
Prints the fill ratio (real tokens / computed tokens) and the time ratio; best of R repeats, alternating.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from prime_node.node.models.tiny import build_tiny_model
from prime_node.trainer.grpo.packing import PackedRows, TrainSample, pack_samples, token_logprobs


def make_samples(n: int, seed: int) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = tuple(rng.randrange(3, 259) for _ in range(rng.randint(12, 35)))
        completion = tuple(rng.randrange(3, 259) for _ in range(rng.randint(2, 60)))
        out.append(TrainSample(prompt, completion, advantage=1.0 if i % 2 else -1.0))
    return out


def padded(samples: list[TrainSample]) -> list[PackedRows]:
    longest = max(len(s) for s in samples)
    rows: list[PackedRows] = []
    for start in range(0, len(samples), 8):
        chunk = [pack_samples([s], longest, pad_id=0)[0] for s in samples[start : start + 8]]
        rows.append(
            PackedRows(*(torch.cat([getattr(r, f) for r in chunk]) for f in PackedRows.__dataclass_fields__))
        )
    return rows


def run(model: torch.nn.Module, micro: list[PackedRows]) -> float:
    started = time.perf_counter()
    for rows in micro:
        logp, _ = token_logprobs(model, rows)
        (logp * rows.loss_mask).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = build_tiny_model(seed=args.seed)
    model.train()
    samples = make_samples(args.samples, args.seed)
    real = sum(len(s) for s in samples)
    packed_rows = pack_samples(samples, args.budget, pad_id=0)
    padded_rows = padded(samples)
    packed_tokens = sum(r.input_ids.numel() for r in packed_rows)
    padded_tokens = sum(r.input_ids.numel() for r in padded_rows)
    best_packed = best_padded = float("inf")
    for _ in range(args.repeats):
        best_packed = min(best_packed, run(model, packed_rows))
        best_padded = min(best_padded, run(model, padded_rows))
    print(f"samples {len(samples)}, real tokens {real}, threads {args.threads}")
    print(
        f"packed : {len(packed_rows)} rows x {args.budget}, fill {real / packed_tokens:.3f}, {best_packed:.3f} s"
    )
    print(
        f"padded : {len(samples)} rows x {padded_rows[0].input_ids.shape[1]}, fill {real / padded_tokens:.3f}, "
        f"{best_padded:.3f} s"
    )
    print(
        f"padded / packed time: {best_padded / best_packed:.2f}x; "
        f"packed throughput {real / best_packed:.0f} tokens/s (forward + backward)"
    )


if __name__ == "__main__":
    main()
