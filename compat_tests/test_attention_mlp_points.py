"""Attention-internal and MLP-internal hook points against TransformerLens 4.3.

`blocks.L.attn.hook_q/k/v/z` ([batch, pos, heads, d_head]; k and v with the key-value heads of
grouped-query attention) and `blocks.L.mlp.hook_pre/post` ([batch, pos, d_mlp]): cached values at
every layer, writes (a constant per head, a scale, a zeroed position) and head selectors (one
head ablated, steered, read) compared with TL's own run_with_hooks at real positions, both padding
sides, on the tiny Llama (GQA: 4 query heads, 2 key-value heads) and the tiny GPT-2; caches and
writes on SmolLM2 (GQA 9/3, d_head 64). Also: the site table's order and shapes against TL's
firing order and act shapes, and the TL 4.x alias names.
"""
import pytest
import torch

from compare import PROMPTS, cache_bound, max_diff, real_mask, tolerance  # noqa: F401 (fixture)

KINDS = ["attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z", "mlp.hook_pre", "mlp.hook_post"]
# Each kind at one layer; the tiny models have two, so both layers are covered.
WRITE_POINTS = ["blocks.0.attn.hook_q", "blocks.1.attn.hook_k", "blocks.0.attn.hook_v", "blocks.1.attn.hook_z",
                "blocks.0.mlp.hook_pre", "blocks.1.mlp.hook_post"]


def new_points(n_layers):
    return [f"blocks.{L}.{kind}" for L in range(n_layers) for kind in KINDS]


def per_head_constant(shape, seed):
    """A constant of the act's feature shape ([heads, d_head] or [d_mlp]), entries ~N(0, 1)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def writes(point, feature_shape, padding_side):
    """(label, hook fn) pairs. TL 4.3 honours returned and in-place writes at all of these points."""
    c = per_head_constant(feature_shape, 3)
    pos = -1 if padding_side == "left" else 1

    def steer(act, hook):
        return act + c

    def steer_position(act, hook):
        act[:, pos] += c

    def scale(act, hook):
        return act * 0.5

    def zero_position(act, hook):
        act[:, pos] = 0.0

    # A constant added to every key shifts all of a query's scores equally: softmax ignores it
    # without rotary (GPT-2). Steering the keys of one position moves the logits in both families.
    first = ("steer_position", steer_position) if point.endswith("hook_k") else ("steer", steer)
    return [first, ("scale", scale), ("zero_position", zero_position)]


def check_writes(xl, tl, point, padding_side, tol):
    mask = real_mask(tl, tl.to_tokens(PROMPTS, padding_side=padding_side), padding_side)
    base = xl(PROMPTS, padding_side=padding_side)
    shape = xl.feature_shapes[point]
    for label, fn in writes(point, shape, padding_side):
        ours = xl.run_with_hooks(PROMPTS, fwd_hooks=[(point, fn)], padding_side=padding_side)
        theirs = tl.run_with_hooks(PROMPTS, fwd_hooks=[(point, fn)], padding_side=padding_side)
        assert max_diff(ours, theirs, mask) < tol, label
        assert max_diff(ours, base, mask) > 50 * tol, f"{label} did not move the logits"


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2", "smollm2"])
def test_cache_matches_transformer_lens(model, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    _, tol = tolerance(model)
    mask = real_mask(tl, tl.to_tokens(PROMPTS, padding_side=padding_side), padding_side)
    names = new_points(xl.cfg.n_layers)
    _, ours = xl.run_with_cache(PROMPTS, names_filter=names, padding_side=padding_side)
    _, theirs = tl.run_with_cache(PROMPTS, names_filter=names, padding_side=padding_side)
    assert list(ours.keys()) == names
    for name in names:
        assert ours[name].shape == theirs[name].shape, name
        assert ours[name].shape[2:] == xl.feature_shapes[name], name
        assert max_diff(ours[name], theirs[name], mask) <= cache_bound(theirs[name], mask, tol), name


def test_gqa_shapes(served):
    """k and v have the key-value heads; q and z the query heads (tiny Llama: 4 and 2)."""
    xl = served["tiny-llama"]
    assert xl.cfg.n_key_value_heads < xl.cfg.n_heads
    H, Hkv, Dh = xl.cfg.n_heads, xl.cfg.n_key_value_heads, xl.cfg.d_head
    assert xl.feature_shapes["blocks.0.attn.hook_q"] == (H, Dh)
    assert xl.feature_shapes["blocks.0.attn.hook_k"] == (Hkv, Dh)
    assert xl.feature_shapes["blocks.0.attn.hook_v"] == (Hkv, Dh)
    assert xl.feature_shapes["blocks.0.attn.hook_z"] == (H, Dh)
    assert xl.feature_shapes["blocks.0.mlp.hook_pre"] == (xl.cfg.d_mlp,)


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("point", WRITE_POINTS)
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2"])
def test_writes_match_transformer_lens(model, point, padding_side, served, reference, tolerance):
    check_writes(served[model], reference[model], point, padding_side, tolerance(model)[1])


@pytest.mark.parametrize("point", ["blocks.3.attn.hook_v", "blocks.12.mlp.hook_pre"])
def test_writes_match_transformer_lens_smollm2(point, served, reference, tolerance):
    check_writes(served["smollm2"], reference["smollm2"], point, "right", tolerance("smollm2")[1])


def test_q_is_before_rotary(served, reference):
    """hook_q equals TL's pre-rotary q, and differs from TL's rotated q past position 0."""
    xl, tl = served["tiny-llama"], reference["tiny-llama"]
    mask = real_mask(tl, tl.to_tokens(PROMPTS), "right")
    _, ours = xl.run_with_cache(PROMPTS, names_filter=["blocks.0.attn.hook_q"])
    _, theirs = tl.run_with_cache(PROMPTS, names_filter=["blocks.0.attn.hook_q", "blocks.0.attn.hook_rot_q"])
    assert max_diff(ours["blocks.0.attn.hook_q"], theirs["blocks.0.attn.hook_q"], mask) < 1e-4
    assert max_diff(ours["blocks.0.attn.hook_q"], theirs["blocks.0.attn.hook_rot_q"], mask) > 0.1


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2"])
def test_bridge_aliases_are_the_same_hook_point(model, served, reference):
    """TL 4.x spellings accepted here are one HookPoint in TL too (not a copy of the value)."""
    xl, tl = served[model], reference[model]
    aliases = {"blocks.0.attn.q.hook_out": "blocks.0.attn.hook_q", "blocks.0.attn.k.hook_out": "blocks.0.attn.hook_k",
               "blocks.0.attn.v.hook_out": "blocks.0.attn.hook_v", "blocks.0.attn.o.hook_in": "blocks.0.attn.hook_z",
               "blocks.0.mlp.out.hook_in": "blocks.0.mlp.hook_post"}
    for alias, name in aliases.items():
        assert tl.hook_dict[alias] is tl.hook_dict[name], alias
    _, cache = xl.run_with_cache(PROMPTS, names_filter=list(aliases))
    assert list(cache.keys()) == list(aliases.values())


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2"])
def test_site_table_is_tl_firing_order_and_shapes(model, reference):
    """hook_names is the order TL fires the hooks in, and the site table places them in it;
    feature_shape is TL's act shape."""
    from transformers import AutoConfig

    from xmix_lens.backend.vllm.sites import site_table
    from xmix_lens.hook_points import feature_shape, hook_names

    tl = reference[model]
    family = {"tiny-llama": "llama", "tiny-gpt2": "gpt2"}[model]
    hf = AutoConfig.from_pretrained(tl.model_dir)
    names = hook_names(family, hf.num_hidden_layers)
    site_table(family, hf.num_hidden_layers)  # raises unless it places exactly these names, in order
    fired = []

    def record(name):
        def hook(act, hook):
            fired.append((name, tuple(act.shape[2:])))
        return hook

    tl.run_with_hooks(PROMPTS, fwd_hooks=[(n, record(n)) for n in names])
    assert fired == [(n, feature_shape(n, hf)) for n in names]


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("point", ["blocks.0.attn.hook_q", "blocks.1.attn.hook_v", "blocks.0.attn.hook_z"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2"])
def test_head_selectors_match_transformer_lens(model, point, padding_side, served, reference, tolerance):
    """One head ablated, one head steered, one head read (head 1: a key-value head under GQA too)."""
    xl, tl = served[model], reference[model]
    _, tol = tolerance(model)
    mask = real_mask(tl, tl.to_tokens(PROMPTS, padding_side=padding_side), padding_side)
    base = xl(PROMPTS, padding_side=padding_side)
    c = per_head_constant((xl.cfg.d_head,), 4)

    def ablate_head(act, hook):
        act[:, :, 1, :] = 0.0

    def steer_head(act, hook):
        act[:, :, 1] += c

    for label, fn in [("ablate_head", ablate_head), ("steer_head", steer_head)]:
        ours = xl.run_with_hooks(PROMPTS, fwd_hooks=[(point, fn)], padding_side=padding_side)
        theirs = tl.run_with_hooks(PROMPTS, fwd_hooks=[(point, fn)], padding_side=padding_side)
        assert max_diff(ours, theirs, mask) < tol, label
        assert max_diff(ours, base, mask) > 50 * tol, f"{label} did not move the logits"

    kept = {}

    def read_head(act, hook):
        kept["head"] = act[:, :, 1]

    xl.run_with_hooks(PROMPTS, fwd_hooks=[(point, read_head)], padding_side=padding_side)
    _, ref = tl.run_with_cache(PROMPTS, names_filter=[point], padding_side=padding_side)
    assert kept["head"].shape == ref[point][:, :, 1].shape
    assert max_diff(kept["head"], ref[point][:, :, 1], mask) <= cache_bound(ref[point], mask, tol)
