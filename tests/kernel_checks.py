"""What the kernel tests share: seeded inputs, poisoned outputs, and the comparison by dtype."""
import zlib

import pytest
import torch

SENTINEL = 12345.0  # poisons outputs before a run, so that unwritten elements show


@pytest.fixture
def gen(request):
    """A generator seeded differently for every test and parameter set."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def random_subset(n, k, gen):
    """k distinct indices of range(n), in random order, as int32."""
    return torch.randperm(n, generator=gen)[:k].to(torch.int32)


def assert_matches(actual, expected, noise: float = 1e-5, roundings: int = 1):
    """fp32: ~1e-5 relative. bf16: one bf16 ulp apart per rounding to bf16 on the way (the
    interpreter truncates to bf16, torch rounds to nearest) plus `noise` of fp32 rounding, which
    matters where terms cancel to near 0."""
    assert actual.dtype == expected.dtype
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        actual, expected = actual.float(), expected.float()
        larger = torch.maximum(actual.abs(), expected.abs())
        ulp = torch.ldexp(torch.ones_like(larger), torch.frexp(larger).exponent - 8)
        excess = (actual - expected).abs() - roundings * ulp - noise
        assert (excess <= 0).all(), f"more than one bf16 ulp apart, by up to {excess.max()}"
