"""Hooks that change computed hook points (xmix_lens/computed_points.py) against TransformerLens:
attention knockout and pattern patching (hook_pattern, hook_attn_scores), per-head results
(hook_result), the per-head attention inputs (hook_attn_in, hook_q/k/v_input), the MLP's input
(hook_mlp_in), the logits (unembed.hook_out), and the engine sites unembed.hook_in and
mlp.hook_pre_linear. Logits compared at real positions of a padded batch, on a tiny Llama (grouped-
query attention, rotary) and a tiny GPT-2 (LayerNorm, biases)."""
import contextlib

import pytest
import torch

from compare import PROMPTS, cache_bound, max_diff, real_mask, tolerance  # noqa: F401 (fixture)

MODELS = ["tiny-llama", "tiny-gpt2"]


def knock_out_first_key(pattern, hook):
    """Attention knockout: no query attends to the first position; rows renormalised."""
    pattern[:, :, :, 0] = 0.0
    return pattern / pattern.sum(-1, keepdim=True).clamp_min(1e-9)


def mask_second_key(scores, hook):
    scores[:, :, :, 1] = float("-inf")
    return scores


def halve(act, hook):
    return act * 0.5


def shift(act, hook):
    """Adds a fixed direction (a norm that follows would undo a rescaling)."""
    return act + torch.linspace(-1.0, 1.0, act.shape[-1])


def zero_head_1(act, hook):
    act[:, :, 1] = 0.0
    return act


@contextlib.contextmanager
def switched(xl, tl, switch):
    """A TransformerLens config switch (set_use_attn_result ...) on in both models for the block."""
    if switch is None:
        yield
        return
    getattr(xl, f"set_{switch}")(True)
    getattr(tl.bridge, f"set_{switch}")(True)
    try:
        yield
    finally:
        getattr(xl, f"set_{switch}")(False)
        getattr(tl.bridge, f"set_{switch}")(False)


CASES = [  # (hook point, hook, switch)
    ("blocks.0.attn.hook_pattern", knock_out_first_key, None),
    ("blocks.1.attn.hook_pattern", knock_out_first_key, None),
    ("blocks.0.attn.hook_attn_scores", mask_second_key, None),
    ("blocks.0.attn.hook_result", zero_head_1, "use_attn_result"),
    ("blocks.1.hook_attn_in", shift, "use_attn_in"),
    ("blocks.0.hook_q_input", shift, "use_split_qkv_input"),
    ("blocks.1.hook_k_input", shift, "use_split_qkv_input"),
    ("blocks.0.hook_v_input", shift, "use_split_qkv_input"),
    ("blocks.0.hook_mlp_in", shift, "use_hook_mlp_in"),
    ("unembed.hook_in", halve, None),
    ("unembed.hook_out", halve, None),
]


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name,hook,switch", CASES, ids=[c[0] for c in CASES])
def test_writes_match_transformer_lens(model, name, hook, switch, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    _, tol = tolerance(model)
    tokens = tl.to_tokens(PROMPTS, padding_side=padding_side)
    real = real_mask(tl, tokens, padding_side)
    with switched(xl, tl, switch):
        ours = xl.run_with_hooks(PROMPTS, fwd_hooks=[(name, hook)], padding_side=padding_side)
        theirs = tl.run_with_hooks(PROMPTS, fwd_hooks=[(name, hook)], padding_side=padding_side)
    plain = xl(PROMPTS, padding_side=padding_side)
    assert max_diff(ours, plain, real) > 100 * tol  # the hook changed the logits
    assert max_diff(ours, theirs, real) <= tol


def test_gated_mlp_linear_half(served, reference, tolerance):
    xl, tl = served["tiny-llama"], reference["tiny-llama"]
    _, tol = tolerance("tiny-llama")
    name = "blocks.0.mlp.hook_pre_linear"
    real = real_mask(tl, tl.to_tokens(PROMPTS), "right")
    _, ours = xl.run_with_cache(PROMPTS, names_filter=[name])
    _, theirs = tl.run_with_cache(PROMPTS, names_filter=[name])
    assert (ours[name] - theirs[name]).abs()[real].max() <= cache_bound(theirs[name], real, tol)
    assert max_diff(xl.run_with_hooks(PROMPTS, fwd_hooks=[(name, halve)]),
                    tl.run_with_hooks(PROMPTS, fwd_hooks=[(name, halve)]), real) <= tol
    with pytest.raises(ValueError, match="GPT-2 .*'s MLP is not gated"):
        served["tiny-gpt2"].add_hook(name, halve)


@pytest.mark.parametrize("model", MODELS)
def test_switched_points_read_as_transformer_lens(model, served, reference, tolerance):
    """The computed per-head points' values (cache), with their switches on, and a cache that also
    holds what a pattern write changed downstream."""
    xl, tl = served[model], reference[model]
    _, tol = tolerance(model)
    real = real_mask(tl, tl.to_tokens(PROMPTS), "right")
    for switch, names in [("use_attn_result", ["blocks.1.attn.hook_result"]),
                          ("use_split_qkv_input", ["blocks.0.hook_q_input", "blocks.1.hook_k_input"]),
                          ("use_hook_mlp_in", ["blocks.1.hook_mlp_in"])]:
        with switched(xl, tl, switch):
            _, ours = xl.run_with_cache(PROMPTS, names_filter=names)
            _, theirs = tl.run_with_cache(PROMPTS, names_filter=names)
        for name in names:
            a, b = ours[name], theirs[name]
            if a.shape != b.shape:  # TL's bridge repeats k/v inputs over query heads; HookedTransformer's
                b = b[:, :, :: b.shape[2] // a.shape[2]]  # layout (one per key-value head) is ours
            assert (a - b).abs()[real].max() <= cache_bound(b, real, tol), name

    names = ["blocks.0.attn.hook_z", "blocks.1.hook_resid_pre", "blocks.1.attn.hook_pattern"]
    hooks = [("blocks.0.attn.hook_pattern", knock_out_first_key)]
    with xl.hooks(hooks):
        _, ours = xl.run_with_cache(PROMPTS, names_filter=names)
    with tl.bridge.hooks(hooks):
        _, theirs = tl.run_with_cache(PROMPTS, names_filter=names)
    for name in names[:2]:
        assert (ours[name] - theirs[name]).abs()[real].max() <= cache_bound(theirs[name], real, tol), name
    query = real[:, None, :, None].expand_as(theirs[names[2]])
    assert (ours[names[2]] - theirs[names[2]]).abs()[query].max() <= cache_bound(theirs[names[2]], query, tol)


def test_patterns_in_generate_as_hooked_transformer(served, reference, tolerance):
    """In generate, hook_pattern fires as with HookedTransformer's KV cache: on the prompt [batch,
    head, P, P], then per token fed back [batch, head, 1, keys so far]. The oracle: TransformerLens's
    pattern over the whole generated sequence (causal: each row is what that step computed)."""
    xl, tl = served["tiny-llama"], reference["tiny-llama"]
    _, tol = tolerance("tiny-llama")
    prompts, name, n_new = ["Hello World!", "Hi"], "blocks.1.attn.hook_pattern", 4
    seen = []
    xl.generate(prompts, max_new_tokens=n_new, do_sample=False, padding_side="left",
                fwd_hooks=[(name, lambda pattern, hook: seen.append(pattern.clone()))])
    tokens = xl.generate(prompts, max_new_tokens=n_new, do_sample=False, padding_side="left", return_type="tokens")
    P = xl.to_tokens(prompts, padding_side="left").shape[1]
    assert [p.shape[-2:] for p in seen] == [(P, P)] + [(1, P + j + 1) for j in range(n_new - 1)]
    # the sequences the steps computed: generate returns them left-padded, as TransformerLens's does
    sequence = tokens[:, : P + n_new - 1].cpu()
    mask = torch.ones_like(sequence)
    for b, prompt in enumerate(prompts):
        mask[b, : P - len(xl.to_tokens(prompt)[0])] = 0
    _, theirs = tl.run_with_cache(sequence, names_filter=[name], attention_mask=mask)
    full = theirs[name]
    real = mask.bool()
    query = real[:, None, :P, None].expand(-1, full.shape[1], -1, P)
    assert (seen[0] - full[:, :, :P, :P]).abs()[query].max() <= tol
    for j, step in enumerate(seen[1:]):
        assert (step[:, :, 0] - full[:, :, P + j, : P + j + 1]).abs().max() <= tol
