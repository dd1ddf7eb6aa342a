"""TransformerLens's hook bookkeeping tests, run against xmix-lens.

Source: TransformerLensOrg/TransformerLens, tests/integration/test_hooks.py at commit
04a4d4bee670cd0901b751a77c6bdab15e658ece (the one stored version of the file the code index holds; it
still tests `HookedTransformer`). Every case below keeps its TL name (test_<TL name>) and asserts the
same behaviour; the code is written anew for xmix-lens.

Changes from the original:
* Model: TL loads the hub model "solu-1l" once at import. Here every case is parametrized over the
  session's tiny Llama and tiny GPT-2 engines (`served` fixture; no engine of our own).
* Every case leaves the shared engine clean (`model` fixture below: all hook functions removed,
  permanent ones included, after the case), as TL's cases did by hand at their ends.
* test_conditional_hooks: TL's expected cache shapes were written for solu-1l (4 tokens for
  "Hello World!", [1, 4, n_heads, d_model] for hook_q_input / hook_attn_in). The expected shapes are
  now what TransformerLens itself caches on the same weights and prompt (`reference` fixture), so
  the tokenizer's token count and TL's per-head input shape come from TL, not from solu-1l.
  Adding such a hook with its flag off must raise: TL 3.x raised AssertionError, TL 4.3 raises
  ValueError; either is accepted.
* test_prepending_hooks: solu-1l has one layer, so zeroing blocks.0.hook_resid_post zeroes the final
  residual, and TL compares the logits with the unembedding bias b_U (what a zero residual gives
  through solu-1l's folded LayerNorm). Our models have two layers and unfolded final norms, so the
  hook sits on the last block's hook_resid_post and "the logits of a zero final residual" are
  computed by TransformerLens on the same weights (zero hook alone), instead of b_U.
* Backward-hook cases keep TL's form (a forward pass, then `.backward()` on the output).
"""
from typing import Any

import pytest
import torch

MODELS = ["tiny-llama", "tiny-gpt2"]
PROMPT = "Hello World!"


def embed(name):
    return name == "hook_embed"


class Counter:
    def __init__(self):
        self.count = 0

    def inc(self, *args, **kwargs):
        self.count += 1


@pytest.fixture(params=MODELS)
def model_name(request):
    return request.param


@pytest.fixture
def model(model_name, served):
    m = served[model_name]
    m.reset_hooks(including_permanent=True)
    yield m
    m.reset_hooks(including_permanent=True)


def n_fwd(model, name="hook_embed"):
    return len(model.hook_dict[name].fwd_hooks)


def n_bwd(model, name="hook_embed"):
    return len(model.hook_dict[name].bwd_hooks)


def test_hook_attaches_normally(model):
    c = Counter()
    model.run_with_hooks(PROMPT, fwd_hooks=[(embed, c.inc)])
    assert all(len(hp.fwd_hooks) == 0 for hp in model.hook_dict.values())
    assert c.count == 1


def test_perma_hook_attaches_normally(model):
    c = Counter()
    model.add_perma_hook(embed, c.inc)
    assert n_fwd(model) == 1
    model.run_with_hooks(PROMPT, fwd_hooks=[])
    assert n_fwd(model) == 1
    assert c.count == 1


def test_hook_context_manager(model):
    c = Counter()
    with model.hooks(fwd_hooks=[(embed, c.inc)]):
        assert n_fwd(model) == 1
        model.forward(PROMPT)
    assert n_fwd(model) == 0
    assert c.count == 1


def test_nested_hook_context_manager(model):
    c = Counter()
    with model.hooks(fwd_hooks=[(embed, c.inc)]):
        assert n_fwd(model) == 1
        model.forward(PROMPT)
        assert c.count == 1
        with model.hooks(fwd_hooks=[(embed, c.inc)]):
            assert n_fwd(model) == 2
            model.forward(PROMPT)
            assert c.count == 3  # outer hook twice, inner once
        assert n_fwd(model) == 1
    assert n_fwd(model) == 0
    assert c.count == 3


def test_context_manager_run_with_cache(model):
    c = Counter()
    with model.hooks(fwd_hooks=[(embed, c.inc)]):
        assert n_fwd(model) == 1
        model.run_with_cache(input=PROMPT)
        assert n_fwd(model) == 1
    assert n_fwd(model) == 0
    assert c.count == 1


def test_backward_hook_runs_successfully(model):
    c = Counter()

    def pass_grad_through(grad: torch.Tensor, hook: Any):
        c.inc()
        return (grad,)

    with model.hooks(bwd_hooks=[(embed, pass_grad_through)]):
        assert n_bwd(model) == 1
        out = model(PROMPT)
        assert c.count == 0
        out.sum().backward()
        assert n_bwd(model) == 1
    assert n_bwd(model) == 0
    assert c.count == 1


def test_backward_hook_returning_bare_tensor(model):
    """TL issue #1160: a backward hook may return the gradient tensor itself, not a 1-tuple."""
    c = Counter()

    def bare(grad: torch.Tensor, hook: Any):
        c.inc()
        return grad

    with model.hooks(bwd_hooks=[("blocks.0.hook_resid_post", bare)]):
        model(PROMPT).sum().backward()
    assert c.count == 1


def test_backward_hook_returning_none(model):
    c = Counter()

    def observe(grad: torch.Tensor, hook: Any):
        c.inc()

    with model.hooks(bwd_hooks=[("blocks.0.hook_resid_post", observe)]):
        model(PROMPT).sum().backward()
    assert c.count == 1


def test_hook_context_manager_with_permanent_hook(model):
    c = Counter()
    model.add_perma_hook(embed, c.inc)
    assert n_fwd(model) == 1
    with model.hooks(fwd_hooks=[(embed, c.inc)]):
        assert n_fwd(model) == 2
        model.forward(PROMPT)
    assert n_fwd(model) == 1
    assert c.count == 2  # the permanent hook once, the context's hook once


def test_nested_context_manager_with_failure(model):
    def fail(act, hook):
        raise ValueError("fail")

    c = Counter()
    with model.hooks(fwd_hooks=[(embed, c.inc)]):
        with pytest.raises(ValueError):
            with model.hooks(fwd_hooks=[(embed, fail)]):
                assert n_fwd(model) == 2
                model.forward(PROMPT)
        assert n_fwd(model) == 1
        assert c.count == 1
    assert n_fwd(model) == 0


def test_reset_hooks_in_context_manager(model):
    c = Counter()
    with model.hooks(fwd_hooks=[(embed, c.inc)]):
        assert n_fwd(model) == 1
        model.reset_hooks()
        assert n_fwd(model) == 0
    assert n_fwd(model) == 0


def test_remove_hook(model):
    c = Counter()
    model.add_perma_hook(embed, c.inc)
    assert n_fwd(model) == 1
    model.remove_all_hook_fns()
    assert n_fwd(model) == 1  # a permanent hook stays without including_permanent
    model.remove_all_hook_fns(including_permanent=True)
    assert n_fwd(model) == 0
    model.run_with_hooks(PROMPT, fwd_hooks=[])
    assert c.count == 0


CONDITIONAL = [("blocks.0.attn.hook_result", "set_use_attn_result"),
               ("blocks.0.hook_q_input", "set_use_split_qkv_input"),
               ("blocks.0.hook_mlp_in", "set_use_hook_mlp_in"),
               ("blocks.0.hook_attn_in", "set_use_attn_in")]


def test_conditional_hooks(model, model_name, reference):
    """Hooks behind a use_* flag can be added only with the flag on, and cache with TL's shapes."""
    def identity(act, hook):
        return act

    for name, setter in CONDITIONAL:
        model.reset_hooks()
        getattr(model, setter)(False)
        with pytest.raises((AssertionError, ValueError)):
            model.add_hook(name, identity)
        getattr(model, setter)(True)
        model.add_hook(name, identity)
        getattr(model, setter)(False)

    tl = reference[model_name].bridge
    for name, setter in CONDITIONAL[1:]:  # the cases TL checks the cached shape of
        model.reset_hooks()
        getattr(model, setter)(True)
        getattr(tl, setter)(True)
        try:
            _, theirs = tl.run_with_cache(PROMPT, names_filter=lambda n, name=name: n == name)
        finally:
            getattr(tl, setter)(False)
        _, cache = model.run_with_cache(input=PROMPT, names_filter=lambda n, name=name: n == name)
        getattr(model, setter)(False)
        assert list(cache.keys()) == [name]
        assert cache[name].shape == theirs[name].shape


@pytest.mark.parametrize("zero_attach_pos,prepend", [(z, p) for z in range(2) for p in (True, False)])
def test_prepending_hooks(model, model_name, reference, zero_attach_pos, prepend):
    """Two hooks on the last block's output: one zeroes it, one replaces it with noise. The logits
    are those of a zero final residual exactly when the zero hook runs last, i.e. when it was added
    last XOR prepended."""
    point = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"

    def set_to_zero(z, hook):
        z[:] = 0.0
        return z

    def set_to_randn(z, hook):
        return torch.randn_like(z) * 0.1

    tokens = torch.arange(5)[None, :]
    zero_logits = reference[model_name].run_with_hooks(tokens, fwd_hooks=[(point, set_to_zero)])
    for i in range(2):
        model.add_hook(point, set_to_zero if i == zero_attach_pos else set_to_randn, prepend=prepend)
    logits = model(tokens)
    expect_zero = (zero_attach_pos == 1) != prepend
    assert torch.allclose(logits, zero_logits, atol=1e-4) == expect_zero
