"""What the compat test files share: the prompts, the masks and differences at real positions, and
the tolerance derived from the unhooked xmix-vs-TransformerLens difference.

Test files import these names (`tolerance` is a fixture: importing it into a test module makes
pytest use it there); the measurement behind `tolerance` is made once per model per session.
"""
import pytest
import torch

PROMPTS = ["The capital of France is", "Hello", "One two three four five six seven"]

_UNHOOKED: dict[str, float] = {}  # model -> unhooked max logit difference at real positions


def real_mask(reference, tokens, padding_side):
    """[batch, pos] bool: TransformerLens's real (non-padding) positions."""
    return reference.attention_mask(tokens, padding_side=padding_side).bool()


def max_diff(a, b, mask):
    return float((a - b).abs()[mask].max())


def direction(d, seed):
    """A unit vector of size d, the same for every run."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(d, generator=g)
    return v / v.norm()


def cache_bound(ref, mask, tol):
    """How far a cached activation may be from TL's: relative to the activation's scale (SmolLM2's
    residual streams reach hundreds) plus the logit tolerance."""
    return 1e-5 * max(float(ref[mask].abs().max()), 1.0) * 10 + tol


@pytest.fixture(scope="session")
def tolerance(served, reference):
    """model -> (unhooked, tol): tol is 50x the unhooked logit difference measured now (fp32 sums
    reorder differently in vLLM and HF; large steering vectors push activations where that shows
    more), with a floor of 1e-4."""

    def get(model):
        if model not in _UNHOOKED:
            tokens = served[model].to_tokens(PROMPTS)
            mask = real_mask(reference[model], tokens, "right")
            _UNHOOKED[model] = max_diff(served[model](tokens), reference[model].run_with_hooks(tokens), mask)
        unhooked = _UNHOOKED[model]
        return unhooked, max(50 * unhooked, 1e-4)

    return get
