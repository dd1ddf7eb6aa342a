"""TransformerLens's hook bookkeeping on a served model, ported from TransformerLens's own tests
(tests/integration/test_hooks.py, test_cache_hook_names.py) onto a local tiny Llama, plus what a
served model must add: hooks run as lowered programs (no user Python in the engine's forward),
no recompilation when hooks change, and clear errors that leave the engine usable."""
import sys

import pytest
import torch
from vllm.compilation.counter import compilation_counter
from vllm.forward_context import is_forward_context_available

from xmix_lens import TraceError

MODEL = "tiny-llama"
PROMPT = "Hello there, how are you"


@pytest.fixture
def model(served):
    m = served[MODEL]
    m.reset_hooks(including_permanent=True)
    yield m
    m.reset_hooks(including_permanent=True)


class Counter:
    def __init__(self):
        self.count = 0

    def inc(self, act, hook):
        self.count += 1


def embed(name):
    return name == "hook_embed"


def test_run_with_hooks_calls_once_and_cleans_up(model):
    c = Counter()
    model.run_with_hooks(PROMPT, fwd_hooks=[(embed, c.inc)])
    assert c.count == 1
    assert all(len(hp.fwd_hooks) == 0 for hp in model.hook_dict.values())


def test_perma_hook_survives_run_with_hooks_and_reset(model):
    c = Counter()
    model.add_perma_hook(embed, c.inc)
    model.run_with_hooks(PROMPT, fwd_hooks=[])
    model.reset_hooks()
    model(PROMPT)
    assert c.count == 2
    assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
    model.reset_hooks(including_permanent=True)
    assert len(model.hook_dict["hook_embed"].fwd_hooks) == 0


def test_nested_hooks_contexts(model):
    c = Counter()
    with model.hooks(fwd_hooks=[(embed, c.inc)]):
        assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
        with model.hooks(fwd_hooks=[(embed, c.inc)]):
            assert len(model.hook_dict["hook_embed"].fwd_hooks) == 2
            model(PROMPT)
        assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
        model(PROMPT)
    assert len(model.hook_dict["hook_embed"].fwd_hooks) == 0
    assert c.count == 3


def test_run_with_cache_inside_hooks_context(model):
    c = Counter()
    with model.hooks(fwd_hooks=[(embed, c.inc)]):
        model.run_with_cache(PROMPT, names_filter="hook_embed")
    assert c.count == 1


def test_inner_context_cleans_up_when_a_hook_raises(model):
    c = Counter()

    def boom(act, hook):
        raise ValueError("boom")

    with model.hooks(fwd_hooks=[(embed, c.inc)]):
        with pytest.raises(ValueError, match="boom"):
            with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", boom)]):
                model(PROMPT)
        assert len(model.hook_dict["blocks.0.hook_resid_post"].fwd_hooks) == 0
        assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
    assert model(PROMPT).shape[-1] == model.cfg.d_vocab  # still usable


def test_remove_all_hook_fns_keeps_permanent_unless_asked(model):
    model.add_perma_hook(embed, Counter().inc)
    model.add_hook(embed, Counter().inc)
    model.remove_all_hook_fns()
    assert len(model.hook_dict["hook_embed"].fwd_hooks) == 1
    model.remove_all_hook_fns(including_permanent=True)
    assert len(model.hook_dict["hook_embed"].fwd_hooks) == 0


def test_prepend_changes_order(model):
    """Hooks on one point run in order, each on the previous one's result (TL: prepend=True first)."""
    v = torch.ones(model.cfg.d_model)

    def zero(act, hook):
        return act * 0.0

    def add(act, hook):
        return act + v

    name = "ln_final.hook_normalized"
    model.add_hook(name, zero)
    model.add_hook(name, add, prepend=True)
    zero_last = model(PROMPT)
    model.reset_hooks()
    model.add_hook(name, zero)
    model.add_hook(name, add)
    add_last = model(PROMPT)
    # the logits of a normalized value: the final norm's weight (and bias), then the engine's unembedding
    w, b = model.ln_final.w, getattr(model.ln_final, "b", None)
    W_U, b_U = model.engine.W_U, model.engine.b_U
    b = torch.zeros_like(w) if b is None else b
    assert torch.allclose(zero_last, (b @ W_U + b_U).expand_as(zero_last), atol=1e-4)
    assert torch.allclose(add_last, ((v * w + b) @ W_U + b_U).expand_as(add_last), atol=1e-4)


def test_backward_hooks_are_kept_apart_from_forward_hooks(model):
    """As in TransformerLens, add_hook(dir="bwd") keeps the hook in the hook point's bwd_hooks; a
    forward pass does not call it."""
    counter = Counter()
    model.add_hook("hook_embed", counter.inc, dir="bwd")
    try:
        assert [h.hook for h in model.hook_dict["hook_embed"].bwd_hooks] == [counter.inc]
        assert not model.hook_dict["hook_embed"].fwd_hooks
        model(PROMPT)
        assert counter.count == 0
    finally:
        model.reset_hooks()
    assert not model.hook_dict["hook_embed"].has_hooks()


def test_cache_hook_names_in_firing_order(model):
    _, cache = model.run_with_cache(PROMPT)
    expected = ["hook_embed"]
    for L in range(model.cfg.n_layers):
        expected += [f"blocks.{L}.{n}" for n in ("hook_resid_pre", "ln1.hook_scale", "ln1.hook_normalized",
                                                  "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_rot_q",
                                                  "attn.hook_rot_k", "attn.hook_attn_scores", "attn.hook_pattern",
                                                  "attn.hook_z", "hook_attn_out", "hook_resid_mid", "ln2.hook_scale",
                                                  "ln2.hook_normalized", "mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post",
                                                  "hook_mlp_out", "hook_resid_post")]
    expected += ["ln_final.hook_scale", "ln_final.hook_normalized", "unembed.hook_in", "unembed.hook_out"]
    assert list(cache.keys()) == expected


def test_cache_indexing_and_filters(model):
    tokens = model.to_tokens([PROMPT, "Hi"])
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: "resid" in n)
    assert all("resid" in k for k in cache.keys())
    assert torch.equal(cache["resid_post", 1], cache["blocks.1.hook_resid_post"])
    assert torch.equal(cache["resid_pre", -1], cache["blocks.1.hook_resid_pre"])
    assert cache["blocks.0.hook_resid_post"].shape == tokens.shape + (model.cfg.d_model,)
    assert cache.accumulated_resid().shape == (model.cfg.n_layers + 1,) + tokens.shape + (model.cfg.d_model,)
    # the residual stream adds up: resid_mid = resid_pre + attn_out (read at the same pass)
    _, full = model.run_with_cache(tokens)
    assert torch.allclose(full["resid_mid", 0], full["resid_pre", 0] + full["attn_out", 0], atol=1e-5)
    # TransformerLens's short names of the attention- and MLP-internal points, with their shapes
    heads = (model.cfg.n_heads, model.cfg.d_head)
    assert full["z", 0].shape == tokens.shape + heads and torch.equal(full["q", 1], full["blocks.1.attn.hook_q"])
    assert full["k", 0].shape == full["v", 0].shape == tokens.shape + (model.cfg.n_key_value_heads, model.cfg.d_head)
    assert full["pre", 0].shape == full["post", 0].shape == tokens.shape + (model.cfg.d_mlp,)
    # an alias (TransformerLens 4.x name) reads the same hook point
    _, alias = model.run_with_cache(tokens, names_filter=["blocks.1.hook_out"])
    assert torch.equal(alias["blocks.1.hook_resid_post"], cache["blocks.1.hook_resid_post"])


def test_no_user_python_runs_inside_the_engine(model):
    """Hook functions are traced before the engine runs; calling one during the forward would raise."""
    v = torch.randn(model.cfg.d_model)
    calls = []

    def steer(act, hook):
        if is_forward_context_available():  # vLLM sets this only while its forward runs
            raise AssertionError("user Python ran inside the engine's forward")
        calls.append(hook.name)
        return act + v

    base = model(PROMPT)
    steered = model.run_with_hooks(PROMPT, fwd_hooks=[(lambda n: n.endswith("hook_resid_post"), steer)])
    assert (steered - base).abs().max() > 1.0
    assert calls == [f"blocks.{L}.hook_resid_post" for L in range(model.cfg.n_layers)]  # once per pass each


def test_changing_hooks_and_parameters_does_not_recompile(model):
    tokens = model.to_tokens([PROMPT, "Another prompt here"])
    model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", lambda a, hook: a + 1.0)])
    before = (compilation_counter.num_graphs_seen, compilation_counter.num_backend_compilations,
              compilation_counter.num_inductor_compiles)
    results = []
    for scale in (2.0, -3.0):
        for name in ("blocks.0.hook_resid_post", "blocks.1.hook_attn_out", "ln_final.hook_normalized"):
            results.append(model.run_with_hooks(tokens, fwd_hooks=[(name, lambda a, hook, s=scale: a * s)]))
    model.run_with_cache(tokens)
    model.generate(PROMPT, max_new_tokens=3, do_sample=False,
                   fwd_hooks=[("blocks.1.hook_resid_pre", lambda a, hook: a * 0.5)])
    model.run_batch([(tokens, [("blocks.0.hook_mlp_out", lambda a, hook: a + 1.0)]), (tokens, [])])
    after = (compilation_counter.num_graphs_seen, compilation_counter.num_backend_compilations,
             compilation_counter.num_inductor_compiles)
    assert after == before
    assert not torch.allclose(results[0], results[3])  # the parameter change took effect


def test_kept_activations_are_real_tensors(model):
    store, counter = {}, []

    def keep(act, hook):
        counter.append(1)
        store["last"] = act[:, -1]
        store["all"] = act

    tokens = model.to_tokens([PROMPT, "Hi"], padding_side="left")
    model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_pre", keep)])
    _, cache = model.run_with_cache(tokens, names_filter="blocks.1.hook_resid_pre")
    assert type(store["all"]) is torch.Tensor and len(counter) == 1
    assert torch.equal(store["all"], cache["blocks.1.hook_resid_pre"])
    assert torch.equal(store["last"], cache["blocks.1.hook_resid_pre"][:, -1])


# --- bad input: a clear error before anything runs, and the engine stays usable -------------
@pytest.fixture
def usable(model):
    baseline = model(PROMPT)
    yield model
    assert torch.equal(model(PROMPT), baseline)
    assert all(len(hp.fwd_hooks) == 0 for hp in model.hook_dict.values())


def test_unknown_hook_name_lists_nearest(usable):
    with pytest.raises(ValueError, match=r"unknown hook point .*blocks\.0\.hook_resid_post"):
        usable.run_with_hooks(PROMPT, fwd_hooks=[("blocks.0.hook_resid_pots", Counter().inc)])


def test_attention_pattern_hooks_in_generate_say_why(usable):
    def zero(act, hook):
        return act * 0

    with pytest.raises(ValueError, match=r"only when nothing else changes the pass.*hook_resid_post"):
        usable.generate(PROMPT, max_new_tokens=2, fwd_hooks=[("blocks.0.attn.hook_pattern", Counter().inc),
                                                             ("blocks.0.hook_resid_post", zero)])
    with pytest.raises(NotImplementedError, match="changed it in generate"):
        usable.generate(PROMPT, max_new_tokens=2, fwd_hooks=[("blocks.0.attn.hook_pattern", zero)])


def test_switched_hook_points_need_their_switch(usable):
    with pytest.raises(ValueError, match=r"set_use_attn_result\(True\)"):
        usable.run_with_hooks(PROMPT, fwd_hooks=[("blocks.0.attn.hook_result", Counter().inc)])
    with pytest.raises(ValueError, match="mutually exclusive"):
        usable.set_use_attn_in(True)
        usable.set_use_split_qkv_input(True)
    usable.set_use_attn_in(False)


def test_wrong_size_steering_vector(usable):
    wrong = torch.ones(usable.cfg.d_model + 3)
    with pytest.raises(TraceError, match=r"test_hooks_api.py:[\s\S]*do not broadcast"):
        usable.run_with_hooks(PROMPT, fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act + wrong)])


def test_python_control_flow_on_a_traced_value(usable):
    d = torch.ones(usable.cfg.d_model)

    def gated(act, hook):
        score = act[:, -1] @ d
        if score:
            return act * 2
        return act

    with pytest.raises(TraceError, match=r"if score:[\s\S]*control flow"):
        usable.run_with_hooks(PROMPT, fwd_hooks=[("blocks.0.hook_resid_post", gated)])


def test_bad_tokens_and_return_type(usable):
    with pytest.raises(ValueError, match="token ids"):
        usable(torch.tensor([[1, usable.cfg.d_vocab + 5]]))
    with pytest.raises(ValueError, match="return_type"):
        usable(PROMPT, return_type="probs")


def test_bad_model_arguments_fail_before_any_engine():
    from xmix_lens import HookedServedModel

    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        HookedServedModel.from_pretrained("smollm2-135m", dtype="int8")
    with pytest.raises(ValueError, match="local Hugging Face folder|embedded"):
        HookedServedModel.from_pretrained("meta-llama/Llama-3-8B")


def _python_calls(run) -> int:
    """The Python function calls made while run() runs (sys.setprofile's 'call' events)."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def test_planning_a_call_does_not_grow_with_its_tokens(model):
    """A hooked call is traced and lowered once, whatever its batch: planning it (tokens to rows,
    trace, lower, the passes' plans) makes the same Python calls for any prompt length, and at most
    a few more per row (rows grouped by their app choice, their lengths), never a trace, a
    lowering or a loop over tokens per row."""
    v = torch.randn(model.cfg.d_model) * 0.1
    hooks = [("blocks.0.hook_resid_post", lambda act, hook: act + v),
             ("blocks.1.hook_attn_out", lambda act, hook: act * 0.5)]

    def planning(batch: int, length: int) -> int:
        tokens = torch.randint(100, 1000, (batch, length), generator=torch.Generator().manual_seed(0))
        with model.hooks(fwd_hooks=hooks):
            return _python_calls(lambda: model.planner.forward_call(model._rows(tokens, None, None, None), "loss"))

    planning(2, 8)  # first use: imports and caches
    small = planning(2, 8)
    assert planning(2, 128) == small
    assert small < planning(64, 8) == planning(64, 128) <= small + 4 * 62
