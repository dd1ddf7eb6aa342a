"""The same hook functions through TransformerLens's own run_with_hooks and through xmix-lens.

For every hook point of the foundation slice, on a tiny Llama, a tiny GPT-2 and SmolLM2, with a
batch of prompts of different lengths and both padding sides: logits at real positions and
cached activations must agree within the tolerance derived from the unhooked difference, and
every write must move the logits by far more than that tolerance.
"""
import pytest
import torch

from xmix_lens.hook_points import is_computed

from compare import PROMPTS, cache_bound, direction, max_diff, real_mask, tolerance  # noqa: F401 (fixture)

MODELS = ["tiny-llama", "tiny-gpt2", "smollm2"]
POINTS = ["hook_embed", "blocks.0.hook_resid_pre", "blocks.1.hook_attn_out", "blocks.0.hook_resid_mid",
          "blocks.0.hook_mlp_out", "blocks.1.hook_resid_post", "ln_final.hook_normalized"]
# Fixed upper bounds on the unhooked xmix-vs-TL logit difference (fp32), a few times what was
# measured on 2026-11-29 (tiny models ~4e-6, SmolLM2 ~1e-4): the unhooked test asserts them.
UNHOOKED_BOUND = {"tiny-llama": 5e-5, "tiny-gpt2": 5e-5, "smollm2": 1e-3}


@pytest.mark.parametrize("model", MODELS)
def test_unhooked_logits_match(model, tolerance):
    unhooked, _ = tolerance(model)
    assert unhooked < UNHOOKED_BOUND[model]


def writes(point, d_model, padding_side):
    """(label, hook fn) pairs; forms TL 4.3 itself honours at each point (see docs/hook-points.md)."""
    v, d = direction(d_model, 1), direction(d_model, 2)
    pos = -1 if padding_side == "left" else 1
    scale = 4.0 if "normalized" in point else 0.5 * d_model ** 0.5

    def steer(act, hook):
        return act + scale * v

    def steer_in_place(act, hook):
        act += scale * v

    def zero_position(act, hook):
        act[:, pos] = 0.0

    def remove_direction(act, hook):
        return act - (act @ d)[..., None] * d

    if point.endswith("hook_resid_mid"):  # TL 4.3 drops returned values here (hook on ln2's input)
        return [("steer_in_place", steer_in_place), ("zero_position", zero_position)]
    if "normalized" in point:  # TL 4.3 ignores in-place edits at RMSNorm's hook_normalized
        return [("steer", steer), ("remove_direction", remove_direction)]
    return [("steer", steer), ("zero_position", zero_position), ("remove_direction", remove_direction)]


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("model", MODELS)
def test_writes_match_transformer_lens(model, point, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    _, tol = tolerance(model)
    mask = real_mask(tl, tl.to_tokens(PROMPTS, padding_side=padding_side), padding_side)
    base = xl(PROMPTS, padding_side=padding_side)
    for label, fn in writes(point, xl.cfg.d_model, padding_side):
        ours = xl.run_with_hooks(PROMPTS, fwd_hooks=[(point, fn)], padding_side=padding_side)
        theirs = tl.run_with_hooks(PROMPTS, fwd_hooks=[(point, fn)], padding_side=padding_side)
        assert max_diff(ours, theirs, mask) < tol, label
        assert max_diff(ours, base, mask) > 50 * tol, f"{label} did not move the logits"


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("model", MODELS)
def test_cache_matches_transformer_lens(model, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    mask = real_mask(tl, tl.to_tokens(PROMPTS, padding_side=padding_side), padding_side)
    # every engine site (attention patterns, [batch, head, query, key]: test_attention_patterns.py)
    _, ours = xl.run_with_cache(PROMPTS, names_filter=lambda n: not is_computed(n), padding_side=padding_side)
    _, theirs = tl.run_with_cache(PROMPTS, names_filter=list(ours.keys()), padding_side=padding_side)
    assert set(ours.keys()) >= set(POINTS)
    for name, value in ours.items():
        assert max_diff(value, theirs[name], mask) <= cache_bound(theirs[name], mask, tolerance(model)[1]), name


@pytest.mark.parametrize("model", MODELS)
def test_read_only_hook_leaves_logits_alone(model, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    kept = {}

    def keep(act, hook):
        kept[hook.name] = act

    tokens = xl.to_tokens(PROMPTS)
    mask = real_mask(tl, tokens, "right")
    logits = xl.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_post", keep)])
    assert max_diff(logits, tl.run_with_hooks(tokens), mask) < tolerance(model)[1]
    _, ref_cache = tl.run_with_cache(tokens, names_filter=["blocks.1.hook_resid_post"])
    got = kept["blocks.1.hook_resid_post"]
    assert type(got) is torch.Tensor and got.shape == tokens.shape + (xl.cfg.d_model,)
    ref = ref_cache["blocks.1.hook_resid_post"]
    assert max_diff(got, ref, mask) < 1e-4 * max(float(ref.abs().max()), 1.0)


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2"])
def test_loss_matches_transformer_lens(model, padding_side, served, reference):
    """Next-token loss, plain and hooked. TL masks padding only with left-padded strings, so
    right padding is compared on equal-length prompts (no padding at all)."""
    xl, tl = served[model], reference[model]
    prompts = PROMPTS if padding_side == "left" else ["The cat sat on the mat", "One two three four five six"]
    v = direction(xl.cfg.d_model, 3) * xl.cfg.d_model ** 0.5
    hooks = [("blocks.0.hook_resid_post", lambda act, hook: act + v)]
    for fwd_hooks in ([], hooks):
        ours = xl.run_with_hooks(prompts, fwd_hooks=fwd_hooks, return_type="loss", padding_side=padding_side)
        theirs = tl.run_with_hooks(prompts, fwd_hooks=fwd_hooks, return_type="loss", padding_side=padding_side)
        assert abs(float(ours) - float(theirs)) < 1e-4
    plain = xl(prompts, return_type="loss", padding_side=padding_side)
    logits, both = xl.run_with_hooks(prompts, fwd_hooks=hooks, return_type="both", padding_side=padding_side)
    assert abs(float(both) - float(ours)) < 1e-6 and abs(float(ours) - float(plain)) > 1e-2
    assert logits.shape[:2] == xl.to_tokens(prompts, padding_side=padding_side).shape
