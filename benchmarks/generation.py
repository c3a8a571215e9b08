"""Generation throughput of the transformers engine at batch 1, 16 and 64, with and without hidden-state capture.

Usage: .venv/bin/python benchmarks/generation.py [--model DIR] [--device cpu|cuda] [--threads N]
       [--new-tokens N] [--repeats R] [--dtype auto|float32|bfloat16]

Without --model it builds the embedded tiny model (TinyModelShape defaults, random init, seed 0) in a
temporary directory. Capture and no-capture runs alternate within one process and the best of R repeats
is kept, so the printed ratio compares like with like on a shared machine.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from prime_node.node.engine import HFEngine, SampleRequest, SamplingParams, load_engine
from prime_node.node.models.tiny import build_tiny_model, save_model_dir

BATCH_SIZES = (1, 16, 64)


def prompts(count: int) -> list[SampleRequest]:
    # Arithmetic-like prompts of 12..35 characters: realistic lengths, different ones to exercise padding.
    return [
        SampleRequest(prompt_ids=tuple(3 + 48 + (5 * i + j) % 10 for j in range(12 + (7 * i) % 24)), seed=i)
        for i in range(count)
    ]


def timed_run(engine: HFEngine, batch: int, params: SamplingParams, capture: bool) -> tuple[float, int]:
    requests = prompts(batch)
    if engine.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    completions = engine.generate(requests, params, capture_hidden=capture)
    if engine.device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, sum(len(c.output_ids) for c in completions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF model directory (default: tiny model)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--new-tokens", type=int, default=64, help="max new tokens per sample")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration; the best is kept")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = Path(tmp) / "tiny"
            save_model_dir(*build_tiny_model(seed=0), model_dir)
        engine = load_engine(
            model_dir,
            device=args.device,
            dtype=args.dtype,
            max_batch_size=max(BATCH_SIZES),
            threads=args.threads,
        )
        assert isinstance(engine, HFEngine)
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
        timed_run(engine, 4, SamplingParams(max_new_tokens=4, temperature=1.0), True)  # warm-up
        print(
            f"device={engine.device} dtype={engine.dtype} threads={torch.get_num_threads()} "
            f"new_tokens={args.new_tokens} repeats={args.repeats}"
        )
        print(f"{'batch':>5} {'tok/s no capture':>17} {'tok/s capture':>14} {'capture time ratio':>19}")
        for batch in BATCH_SIZES:
            best = {True: float("inf"), False: float("inf")}
            tokens = {True: 0, False: 0}
            for _ in range(args.repeats):
                for capture in (False, True):
                    seconds, count = timed_run(engine, batch, params, capture)
                    if seconds < best[capture]:
                        best[capture], tokens[capture] = seconds, count
            print(
                f"{batch:>5} {tokens[False] / best[False]:>17.1f} {tokens[True] / best[True]:>14.1f} "
                f"{best[True] / best[False]:>19.3f}"
            )


if __name__ == "__main__":
    main()
