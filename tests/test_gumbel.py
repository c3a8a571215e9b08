"""Counter-based Gumbel noise: bit-exact replay, independence from batching, correct distribution."""

from __future__ import annotations

import torch

from prime_node.proofs.gumbel import _mix32, gumbel_argmax, gumbel_noise, uniform_noise


def _reference_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mixer_matches_uint32_reference():
    values = [0, 1, 2, 0xFFFF, 0x10000, 123456789, 2**31, 2**31 + 5, 0xFFFFFFFF]
    got = _mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [_reference_mix32(v) for v in values]


def test_noise_is_a_pure_function_of_seed_and_position():
    seeds = torch.tensor([0, 1, 2**62 + 7, 2**63 - 1])
    positions = torch.tensor([0, 5, 100, 2**20])
    batch = gumbel_noise(seeds, positions, 97)
    for i in range(len(seeds)):
        alone = gumbel_noise(seeds[i : i + 1], positions[i : i + 1], 97)
        assert torch.equal(alone[0], batch[i])
    reversed_batch = gumbel_noise(seeds.flip(0), positions.flip(0), 97)
    assert torch.equal(reversed_batch.flip(0), batch)
    # a different position or seed gives different noise
    assert not torch.equal(gumbel_noise(seeds, positions + 1, 97), batch)
    assert not torch.equal(gumbel_noise(seeds + 1, positions, 97), batch)


def test_noise_does_not_depend_on_thread_count():
    seeds = torch.arange(8)
    positions = torch.arange(8) * 3
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gumbel_noise(seeds, positions, 5000)
        torch.set_num_threads(2)
        two = gumbel_noise(seeds, positions, 5000)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


def test_noise_has_gumbel_moments():
    noise = gumbel_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096).double()
    assert abs(noise.mean().item() - 0.5772) < 0.01  # Euler-Mascheroni constant
    assert abs(noise.std().item() - 1.2825) < 0.01  # pi / sqrt(6)
    assert torch.isfinite(noise).all()


def test_gumbel_argmax_samples_from_softmax():
    n = 100_000
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    for temperature in (1.0, 0.5):
        tokens = gumbel_argmax(
            logits.expand(n, 4), temperature, torch.arange(n), torch.zeros(n, dtype=torch.int64)
        )
        freq = torch.bincount(tokens, minlength=4).double() / n
        expected = torch.softmax(logits.double() / temperature, 0)
        assert torch.allclose(freq, expected, atol=0.006), (temperature, freq, expected)


def test_cpu_fast_path_is_bit_identical_to_the_portable_path():
    from prime_node.proofs.gumbel import _uniform_noise_torch

    g = torch.Generator().manual_seed(5)
    seeds = torch.cat(
        [torch.randint(0, 2**62, (300,), generator=g), torch.tensor([0, 1, 2**63 - 1, 2**32, 2**32 - 1])]
    )
    positions = torch.cat(
        [torch.randint(0, 2**31, (300,), generator=g), torch.tensor([0, 2**32 - 1, 7, 2**32, 3])]
    )
    fast = uniform_noise(seeds, positions, 1000)
    assert fast.dtype == torch.float64 and fast.shape == (305, 1000)
    assert torch.equal(fast, _uniform_noise_torch(seeds, positions, 1000))
    scalar = uniform_noise(torch.tensor(2**63 - 1), torch.tensor(9), 17)  # 0-d inputs, as a single row
    assert torch.equal(scalar, _uniform_noise_torch(torch.tensor(2**63 - 1), torch.tensor(9), 17))
