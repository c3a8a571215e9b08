"""Shared fixture for the trainer's tiny-model tests.

The embedded model's ops are a few microseconds of arithmetic each, so intra-op threads only add
synchronisation; on a 2-core machine shared with other processes, OpenMP spin-waiting made the same test
about 10x slower with 2 threads than with 1 (measured: forward + backward of 64 tokens, 0.9 s vs 0.08 s).
The thread count is process-global, so it is restored after each test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
