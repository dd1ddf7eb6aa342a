"""Stores: a value computed at one hook point gates or steers a write at a later one, inside the
engine, per request. Compared with TransformerLens running the same hooks (a dict the functions
close over) or, for prompt-level reductions, an equivalent TransformerLens hook."""
import pytest
import torch

from xmix_lens import store

MODEL = "tiny-llama"
# equal lengths: TransformerLens reduces over every position, padding included
PROMPTS = ["The cat sat on the mat", "One two three four five six"]


@pytest.fixture
def pair(served, reference):
    xl, tl = served[MODEL], reference[MODEL]
    assert len({xl.to_tokens(p).shape[1] for p in PROMPTS}) == 1, "the prompts must tokenize to equal lengths"
    return xl, tl


def vectors(d_model: int):
    g = torch.Generator().manual_seed(7)
    w, v = torch.randn(d_model, generator=g), torch.randn(d_model, generator=g)
    return w / w.norm(), 3.0 * v / v.norm()


def test_per_token_store_through_a_plain_dict(pair):
    xl, tl = pair
    w, v = vectors(xl.cfg.d_model)

    def hooks():
        ctx = {}

        def probe(act, hook):
            ctx["score"] = act @ w

        def steer(act, hook):
            return act + ctx["score"][..., None] * v

        return [("blocks.0.hook_resid_post", probe), ("blocks.1.hook_resid_post", steer)]

    tokens = xl.to_tokens(PROMPTS)
    ours = xl.run_with_hooks(tokens, fwd_hooks=hooks())
    theirs = tl.run_with_hooks(tokens, fwd_hooks=hooks())
    assert (ours - theirs).abs().max() < 1e-4
    assert (ours - xl(tokens)).abs().max() > 0.1


@pytest.mark.parametrize("reduce", ["mean", "sum", "max"])
def test_prompt_level_reduction_gates_a_later_write(pair, reduce):
    xl, tl = pair
    w, v = vectors(xl.cfg.d_model)
    tokens = xl.to_tokens(PROMPTS)

    def probe(act, hook):
        store.put("score", act @ w, reduce=reduce)

    def gated(act, hook):
        return torch.where(store.get("score")[..., None] > 0.0, act + v, act - v)

    ours = xl.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", probe), ("blocks.1.hook_attn_out", gated)])

    ctx = {}
    fold = {"mean": lambda s: s.mean(1), "sum": lambda s: s.sum(1), "max": lambda s: s.amax(1)}[reduce]

    def tl_probe(act, hook):
        ctx["score"] = fold(act @ w)[:, None].expand(act.shape[:2])

    def tl_gated(act, hook):
        return torch.where(ctx["score"][..., None] > 0.0, act + v, act - v)

    theirs = tl.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", tl_probe),
                                                  ("blocks.1.hook_attn_out", tl_gated)])
    assert (ours - theirs).abs().max() < 1e-4
    assert (ours - xl(tokens)).abs().max() > 0.1  # the gated write took effect


def test_last_position_value_is_per_request(pair):
    xl, tl = pair
    w, v = vectors(xl.cfg.d_model)
    tokens = xl.to_tokens(PROMPTS)

    def probe(act, hook):
        store.put("last", act[:, -1] @ w)

    def steer(act, hook):
        return act + store.get("last")[..., None] * v

    ours = xl.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_mlp_out", probe), ("blocks.1.hook_resid_pre", steer)])
    ctx = {}

    def tl_probe(act, hook):
        ctx["last"] = act[:, -1] @ w

    def tl_steer(act, hook):
        return act + ctx["last"][:, None, None] * v

    theirs = tl.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_mlp_out", tl_probe),
                                                  ("blocks.1.hook_resid_pre", tl_steer)])
    assert (ours - theirs).abs().max() < 1e-4


def test_reading_a_store_nobody_wrote_is_a_clear_error(served):
    xl = served[MODEL]
    baseline = xl(PROMPTS)

    def reader(act, hook):
        return act + store.get("missing")[..., None]

    with pytest.raises(KeyError, match="read before any hook writes it"):
        xl.run_with_hooks(PROMPTS, fwd_hooks=[("blocks.1.hook_resid_post", reader)])
    assert torch.equal(xl(PROMPTS), baseline)


def test_explain_shows_ir_and_templates(served):
    xl = served[MODEL]
    w, v = vectors(xl.cfg.d_model)

    def probe(act, hook):
        store.put("score", act @ w, reduce="mean")

    def gated(act, hook):
        return act + torch.relu(store.get("score"))[..., None] * v

    text = xl.explain(PROMPTS, fwd_hooks=[("blocks.0.hook_resid_post", probe), ("blocks.1.hook_resid_post", gated),
                                          ("blocks.1.hook_mlp_out", lambda act, hook: act * 0.5)])
    assert "graph(blocks.0.hook_resid_post" in text and "store['score', reduce=mean]" in text
    assert "project_read" in text and "generated kernel (write)" in text and "affine_write (parametric)" in text
