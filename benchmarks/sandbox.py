"""What the code environment's sandbox costs per test run, against a plain subprocess, in one run here.

Usage: .venv/bin/python benchmarks/sandbox.py [--runs N] [--work-ms W]

Runs the same Python program on the same stdin N times each way, interleaved (so that load from other
processes falls on both alike): once with `run_sandboxed` (bubblewrap, namespaces, seccomp, limits, the
in-sandbox launcher; node/environments/sandbox.py) and once as a plain `subprocess.run` of the same
interpreter, no isolation at all. Twice: a trivial program (read two numbers, print their sum: the cost of
a test is all start-up) and one that computes for about W ms first. Prints the median wall time per run of
each, the sandbox's overhead per run and the ratio. Needs a working sandbox.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from prime_node.node.environments.sandbox import check_sandbox, run_sandboxed, sandbox_interpreter

TRIVIAL = "a, b = map(int, input().split())\nprint(a + b)\n"
BUSY = "import time\nend = time.process_time() + {seconds}\nn = 0\nwhile time.process_time() < end:\n    n += 1\n"


def _measure(program: str, runs: int) -> tuple[list[float], list[float]]:
    python = sandbox_interpreter()
    stdin = b"20 22\n"
    sandboxed, plain = [], []
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "main.py"
        path.write_text(program)
        for _ in range(runs):
            start = time.perf_counter()
            result = run_sandboxed(program, stdin)
            sandboxed.append(time.perf_counter() - start)
            assert result.ok, result
            start = time.perf_counter()
            done = subprocess.run([python, "-s", str(path)], input=stdin, capture_output=True, timeout=60)
            plain.append(time.perf_counter() - start)
            assert done.returncode == 0, done
    return sandboxed, plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="runs of each program each way")
    parser.add_argument("--work-ms", type=int, default=200, help="CPU time of the busy program, ms")
    args = parser.parse_args()
    print(f"sandbox: {check_sandbox()}")
    busy = TRIVIAL + BUSY.format(seconds=args.work_ms / 1000)
    for name, program in (("trivial", TRIVIAL), (f"busy {args.work_ms} ms", busy)):
        sandboxed, plain = _measure(program, args.runs)
        box, bare = statistics.median(sandboxed), statistics.median(plain)
        print(
            f"{name:>14}: sandboxed {box * 1000:7.1f} ms, plain subprocess {bare * 1000:7.1f} ms "
            f"(median of {args.runs}); overhead {(box - bare) * 1000:+.1f} ms per run, ratio {box / bare:.2f}x"
        )


if __name__ == "__main__":
    main()
