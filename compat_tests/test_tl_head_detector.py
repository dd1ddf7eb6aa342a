"""TransformerLens's head-detector tests, run against xmix-lens.

Source: TransformerLensOrg/TransformerLens, tests/integration/test_head_detector.py at commit
237fb22a2d54071a08c4001003f13de0129843fc (the stored version the code index holds). Every case keeps
its TL name and asserts the same behaviour; the code is written anew for xmix-lens.

Changes from the original:
* Model: TL loads the hub model "solu-2l" and compares `detect_head`'s scores with numbers taken from
  it. Here the model is the session's tiny Llama (two layers, as solu-2l) and every expected score is
  what TransformerLens's own `detect_head` gives on its bridge over the same folder (`reference`), for
  the same sequence and options. `detect_head` is TransformerLens's code in both runs: what is tested
  is that the served model's attention patterns (computed points) and caches are TransformerLens's.
* The regular sequences' "duplicate" and "induction" scores are compared with TL's rather than with
  zeros (they are zeros on any model: no token repeats).
* The specific-heads classes are one parametrized case per sequence and error measure (TL computes
  them at import).
"""
import math

import pytest
import torch
from transformer_lens.head_detector import HEAD_NAMES, detect_head

ATOL = 1e-4
REGULAR = " four token sequence"
DUPLICATED = " seven token sequence seven token sequence"
DUPLICATED2 = " one two three one two three"
REGULAR_PADDED = " 2 2 2 seven token seq"


@pytest.fixture
def pair(served, reference):
    return served["tiny-llama"], reference["tiny-llama"].bridge


def same(pair, *args, **kwargs):
    """detect_head on the served model equals detect_head on TransformerLens's; the served result."""
    xl, tl = pair
    ours = detect_head(xl, *args, **kwargs).cpu()
    assert torch.allclose(ours, detect_head(tl, *args, **kwargs), atol=ATOL)
    return ours


@pytest.mark.parametrize("error_measure", ["mul", "abs"])
@pytest.mark.parametrize("sequence", [REGULAR, DUPLICATED])
@pytest.mark.parametrize("head_name", HEAD_NAMES)
def test_detect_head_successful(pair, head_name, sequence, error_measure):
    same(pair, sequence, detection_pattern=head_name, error_measure=error_measure)


@pytest.mark.parametrize("head_name", HEAD_NAMES)
def test_batched_equal_lengths(pair, head_name):
    xl, _ = pair
    singles = [detect_head(xl, s, head_name) for s in (REGULAR_PADDED, DUPLICATED, DUPLICATED2)]
    batched = same(pair, [REGULAR_PADDED, DUPLICATED, DUPLICATED2], head_name)
    assert torch.allclose(batched, (sum(singles) / 3).cpu(), atol=ATOL)


def test_batched_unequal_lengths(pair):
    xl, _ = pair
    r1 = detect_head(xl, REGULAR, "previous_token_head")
    r2 = detect_head(xl, DUPLICATED, "previous_token_head")
    r3 = same(pair, [REGULAR, DUPLICATED], "previous_token_head")
    assert torch.allclose(r3, ((r1 + r2) / 2).cpu(), atol=ATOL)


@pytest.mark.parametrize("error_measure", ["mul", "abs"])
@pytest.mark.parametrize("exclude_bos, exclude_current_token", [(True, False), (False, True), (True, True)])
def test_detect_head_exclusions(pair, error_measure, exclude_bos, exclude_current_token):
    """TL's test_detect_head_exclude_bos, _exclude_current_token and _exclude_bos_and_current_token."""
    same(pair, REGULAR, "previous_token_head", exclude_bos=exclude_bos, exclude_current_token=exclude_current_token,
         error_measure=error_measure)


@pytest.mark.parametrize("error_measure", ["mul", "abs"])
def test_detect_head_with_cache(pair, error_measure):
    xl, tl = pair
    _, cache = xl.run_with_cache(REGULAR, remove_batch_dim=True)
    ours = detect_head(xl, REGULAR, "previous_token_head", cache=cache, error_measure=error_measure)
    expected = detect_head(tl, REGULAR, "previous_token_head", error_measure=error_measure)
    assert torch.allclose(ours.cpu(), expected, atol=ATOL)


def test_detect_head_with_invalid_head_name(pair):
    xl, tl = pair
    with pytest.raises(Exception) as theirs:
        detect_head(tl, REGULAR, "test")
    with pytest.raises(type(theirs.value)) as ours:
        detect_head(xl, REGULAR, "test")
    assert str(ours.value) == str(theirs.value)


def test_detect_head_with_zero_sequence_length(pair):
    xl, _ = pair
    with pytest.raises(AssertionError) as e:
        detect_head(xl, "", "previous_token_head")
    assert str(e.value) == "The sequence must be non-empty and must fit within the model's context window."


def test_detect_head_with_sequence_length_outside_context_window(pair):
    xl, _ = pair
    with pytest.raises(AssertionError) as e:
        detect_head(xl, "a " * xl.cfg.n_ctx, "previous_token_head")
    assert str(e.value) == "The sequence must be non-empty and must fit within the model's context window."


def test_detect_head_with_invalid_detection_pattern(pair):
    xl, _ = pair
    with pytest.raises(AssertionError) as e:
        detect_head(xl, DUPLICATED, torch.ones(4, 4))
    assert "The detection pattern must be a lower triangular" in str(e.value)


def test_detect_head_non_lower_triangular_detection_pattern(pair):
    xl, _ = pair
    n = xl.to_tokens(DUPLICATED).shape[-1]
    pattern = torch.tril(torch.ones(n, n))
    same(pair, DUPLICATED, pattern)
    pattern[0, 1] = 1
    with pytest.raises(AssertionError) as e:
        detect_head(xl, DUPLICATED, pattern)
    assert "The detection pattern must be a lower triangular" in str(e.value)


@pytest.mark.parametrize("error_measure", ["mul", "abs"])
@pytest.mark.parametrize("sequence", [REGULAR, DUPLICATED])
def test_specific_heads(pair, sequence, error_measure):
    xl, _ = pair
    match = same(pair, sequence, "previous_token_head", heads=[(0, 0)], error_measure=error_measure)
    assert math.isclose(torch.sum(match), match[0, 0].item() - (xl.cfg.n_layers * xl.cfg.n_heads - 1), abs_tol=ATOL)
