"""Attention scores and patterns (computed from the pass's reads: xmix_lens/attention_points.py)
against TransformerLens's hook_attn_scores / hook_pattern, and hook_rot_q / hook_rot_k and the
norms' hook_scale (engine sites) against TL's, on a tiny Llama, a tiny GPT-2 and SmolLM2, both
padding sides, at real query positions (the engine computes nothing at padding)."""
import pytest
import torch

from compare import PROMPTS, cache_bound, real_mask, tolerance  # noqa: F401 (fixture)

MODELS = ["tiny-llama", "tiny-gpt2", "smollm2"]


def points(model, layer):
    attn = [f"blocks.{layer}.attn.hook_attn_scores", f"blocks.{layer}.attn.hook_pattern",
            f"blocks.{layer}.ln1.hook_scale", f"blocks.{layer}.ln2.hook_scale", "ln_final.hook_scale"]
    rotary = [f"blocks.{layer}.attn.hook_rot_q", f"blocks.{layer}.attn.hook_rot_k"]
    return attn + (rotary if model != "tiny-gpt2" else [])


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("model", MODELS)
def test_patterns_scores_and_scales_match_transformer_lens(model, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    _, tol = tolerance(model)
    names = points(model, 1)
    _, ours = xl.run_with_cache(PROMPTS, names_filter=names, padding_side=padding_side)
    _, theirs = tl.run_with_cache(PROMPTS, names_filter=names, padding_side=padding_side)
    real = real_mask(tl, tl.to_tokens(PROMPTS, padding_side=padding_side), padding_side)
    for name in names:
        a, b = ours[name], theirs[name]
        assert a.shape == b.shape, name
        if "attn.hook_attn_scores" in name or "attn.hook_pattern" in name:
            query = real[:, None, :, None].expand_as(b)  # [batch, head, query, key]: rows of real queries
            causal = torch.ones(b.shape[-2:], dtype=torch.bool).tril()
            allowed = query & real[:, None, None, :].expand_as(b) & causal
            assert torch.equal(a[query & ~allowed], b[query & ~allowed]), name  # -inf / 0 where masked
            assert (a - b).abs()[allowed].max() <= cache_bound(b, allowed, tol), name  # noqa: E501
        else:
            assert (a - b).abs()[real].max() <= cache_bound(b, real, tol), name


def test_patterns_rows_sum_to_one_and_are_causal(served):
    xl = served["tiny-llama"]
    _, cache = xl.run_with_cache(PROMPTS, names_filter=lambda n: n.endswith("hook_pattern"), padding_side="left")
    pattern = cache["pattern", 0]
    P = pattern.shape[-1]
    assert torch.allclose(pattern[2].sum(-1), torch.ones(pattern.shape[1], P), atol=1e-5)  # the longest row: all real
    assert (pattern.triu(1) == 0).all()


def test_scores_read_in_run_with_hooks(served, reference):
    xl, tl = served["tiny-gpt2"], reference["tiny-gpt2"]
    seen = {}

    def keep(scores, hook):
        seen[hook.name] = scores.clone()

    xl.run_with_hooks(PROMPTS[:1], fwd_hooks=[("blocks.0.attn.hook_attn_scores", keep)])
    _, theirs = tl.run_with_cache(PROMPTS[:1], names_filter=["blocks.0.attn.hook_attn_scores"])
    ours, ref = seen["blocks.0.attn.hook_attn_scores"], theirs["blocks.0.attn.hook_attn_scores"]
    finite = ref.isfinite()
    assert torch.equal(finite, ours.isfinite())
    assert (ours - ref).abs()[finite].max() < 1e-4
