"""Byte compatibility with the public `toploc` package (0.1.6); skipped where it is not installed.

Install it with `.venv/bin/pip install --no-build-isolation --no-binary toploc --no-deps toploc==0.1.6`.
"""

from __future__ import annotations

import pytest
import torch

from prime_node.proofs.bounds import BYTES_PER_CHUNK
from prime_node.proofs.toploc import build_proof, check_proof, parse_proof

toploc = pytest.importorskip("toploc")


def _split(proof: bytes) -> list[bytes]:
    return [proof[i : i + BYTES_PER_CHUNK] for i in range(0, len(proof), BYTES_PER_CHUNK)]


def _theirs(hidden: torch.Tensor) -> bytes:
    rows = [row for row in hidden.to(torch.bfloat16)]
    return b"".join(toploc.build_proofs_bytes(rows, decode_batching_size=32, topk=128, skip_prefill=True))


@pytest.mark.parametrize(("rows", "width"), [(1, 128), (70, 128), (64, 896), (40, 4096)])
def test_same_bytes_as_toploc(rows: int, width: int):
    hidden = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows + width)) * 2
    ours = build_proof(hidden)
    assert ours == _theirs(hidden)


def test_smaller_modulus_chunks_match():
    # Find activations whose top-k indices collide modulo 65497, then compare.
    for seed in range(50):
        hidden = torch.randn(32, 4096, generator=torch.Generator().manual_seed(seed))
        ours = build_proof(hidden)
        if parse_proof(ours, 1)[0][0] < 65497:
            assert ours == _theirs(hidden)
            return
    pytest.fail("no chunk needed a smaller modulus in 50 tries")


def test_cross_verification_both_ways():
    hidden = torch.randn(80, 128, generator=torch.Generator().manual_seed(3)) * 2
    noisy = hidden * (1 + 5e-3 * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(4)))
    noisy16 = noisy.to(torch.bfloat16)
    ours = build_proof(hidden)
    theirs = _theirs(hidden)
    # their verifier on our proof, our verifier on theirs: identical statistics
    their_stats = toploc.verify_proofs_bytes(
        noisy16, _split(ours), decode_batching_size=32, topk=128, skip_prefill=True
    )
    our_stats = check_proof(theirs, noisy)
    assert [(r.exp_mismatches, r.mant_err_mean, r.mant_err_median) for r in their_stats] == [
        (s.exp_mismatches, s.mant_err_mean, s.mant_err_median) for s in our_stats
    ]
    assert any(s.exp_mismatches or s.mant_err_mean for s in our_stats)  # the noise was visible
