"""Reliability: no request corrupts another, threads are safe, app state is atomic.

Each test reproduces a defect seen by a user (issue: reliability) and checks the fixed behaviour
against a reference made the plain way: the same hooks per call, the same call alone on a fresh
prefix cache, TransformerLens."""
import threading

import pytest
import torch

from xmix_lens import App
from xmix_lens.backend.control import MAX_RESIDENT_APPS, ResidentCapacityError

MODEL = "tiny-llama"
PROMPTS = ["The cat sat on the mat and looked", "One two three", "A quick brown fox jumps"]
SITE = "blocks.0.hook_resid_post"
PROMPT = "The quick brown fox jumps over the lazy dog and then runs far away into the woods"


def vector(d: int, seed: int, scale: float = 4.0) -> torch.Tensor:
    return scale * torch.randn(d, generator=torch.Generator().manual_seed(seed))


def add(v):
    return [(SITE, lambda act, hook: act + v)]


def test_returning_a_value_kept_at_an_earlier_hook(served, reference):
    """TransformerLens semantics: a hook may return an activation another hook point kept."""
    xl, tl = served[MODEL], reference[MODEL]

    def hooks():
        saved = {}

        def keep(act, hook):
            saved["a"] = act.clone()

        def put_back(act, hook):
            return saved["a"]

        return [("blocks.0.hook_resid_mid", keep), ("blocks.1.hook_resid_pre", put_back)]

    tokens = xl.to_tokens(PROMPTS[:1])
    ours = xl.run_with_hooks(tokens, fwd_hooks=hooks())
    theirs = tl.run_with_hooks(tokens, fwd_hooks=hooks())
    assert (ours - theirs).abs().max() < 1e-4
    assert (ours - xl(tokens)).abs().max() > 1e-2  # the layer-0 MLP's output was dropped


def test_threads_calling_one_model_get_their_own_results(served):
    """Calls from several threads run one after another, each with its own hooks."""
    model = served[MODEL]
    v = vector(model.cfg.d_model, 1)
    signs = [1.0, -1.0, 0.5]

    def calls(sign):
        logits = model.run_with_hooks(PROMPTS, fwd_hooks=add(sign * v))
        tokens = model.generate(PROMPTS[:2], max_new_tokens=4, do_sample=False, return_type="tokens",
                                fwd_hooks=add(sign * v))
        return logits, tokens

    expected = {sign: calls(sign) for sign in signs}
    results, errors = {sign: [] for sign in signs}, []

    def worker(sign):
        try:
            for _ in range(3):
                results[sign].append(calls(sign))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(sign,)) for sign in signs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for sign in signs:
        assert len(results[sign]) == 3
        for logits, tokens in results[sign]:
            assert (logits - expected[sign][0]).abs().max() < 1e-5
            assert torch.equal(tokens, expected[sign][1])
    assert (expected[1.0][0] - expected[-1.0][0]).abs().max() > 1e-1


def test_prefix_cache_never_reuses_kv_written_at_other_real_tokens(served):
    """`act[:, :K] += v` writes other real tokens of a shorter row under left and right padding:
    the second call must not reuse the KV the first computed."""
    model = served[MODEL]
    v = vector(model.cfg.d_model, 2, scale=8.0)
    prompts = [" ".join([PROMPT] * 11), " ".join([PROMPT] * 8)]
    lengths = [model.to_tokens(p).shape[1] for p in prompts]
    block = model.engine.llm.llm_engine.vllm_config.cache_config.block_size
    assert lengths[1] > block and lengths[0] - lengths[1] < 100 <= lengths[1]

    def first_positions(act, hook):
        act[:, :100] += v

    def run(padding_side):
        return model.generate(prompts, max_new_tokens=6, do_sample=False, return_type="tokens",
                              padding_side=padding_side, fwd_hooks=[(SITE, first_positions)])

    model.engine.llm.reset_prefix_cache()
    alone = run("left")
    model.engine.llm.reset_prefix_cache()
    run("right")
    after_right = run("left")
    # the longer row has no padding: its written tokens are the same both times, its KV is reused;
    # the shorter row's are not
    assert 0 < model.last_run_stats["cached_tokens"] < 2 * block
    assert torch.equal(after_right, alone)


def test_app_params_reach_the_engine_every_way(served):
    """App.set_params, model.set_params and writes into app.params in place all reach a resident
    app; a refused update changes nothing anywhere."""
    model = served[MODEL]
    v = vector(model.cfg.d_model, 3)
    param = v.clone()
    calls = []

    def steer(act, hook):
        calls.append(hook.name)
        return act + param

    app = App("rel-steer", fwd_hooks=[(SITE, steer)], params={"v": param})
    model.install(app)
    traced_at_install = len(calls)

    def per_call(w):
        return model.run_with_hooks(PROMPTS, fwd_hooks=add(w))

    def with_app():
        return model.run_with_hooks(PROMPTS, apps=["rel-steer"]).result

    try:
        assert "rel-steer" in model.engine.installed  # resident: the engine holds its own copy
        app.set_params(v=-v)
        assert (with_app() - per_call(-v)).abs().max() < 1e-4
        app.params["v"].mul_(-1)  # written in place, as a notebook might
        assert (with_app() - per_call(v)).abs().max() < 1e-4
        version = app.version
        with pytest.raises(ValueError, match="finite"):
            model.set_params("rel-steer", v=torch.full_like(v, float("nan")))
        with pytest.raises(ValueError, match="same shape"):
            app.set_params(v=torch.zeros(3))
        assert app.version == version and torch.equal(app.params["v"], v)
        assert (with_app() - per_call(v)).abs().max() < 1e-4
        assert (per_call(v) - per_call(-v)).abs().max() > 1e-1
        # new values were lowered from the app's graphs, its parameters named inputs there: the
        # hook function was not called again
        assert len(calls) == traced_at_install
    finally:
        model.uninstall("rel-steer")
    assert app.installed_in == []


def test_uninstalling_frees_resident_rows_and_the_limit_is_an_error(served):
    """Install and uninstall cycles never run out of control rows; a full engine says so."""
    model = served[MODEL]
    v = vector(model.cfg.d_model, 4)
    for cycle in range(MAX_RESIDENT_APPS + 4):
        model.install(App("rel-cycle", fwd_hooks=add(v * (cycle % 3))))
        assert "rel-cycle" in model.engine.installed, f"cycle {cycle}: not resident"
        model.uninstall("rel-cycle")
    installed = []
    try:
        with pytest.raises(ResidentCapacityError, match="control rows"):
            for i in range(MAX_RESIDENT_APPS + 1):
                model.install(App(f"rel-fill-{i}", fwd_hooks=add(v)))
                installed.append(f"rel-fill-{i}")
        assert f"rel-fill-{len(installed)}" not in model.apps  # the refused app is not half-installed
        assert torch.isfinite(model.run_with_hooks(PROMPTS, apps=[installed[0]]).result).all()
    finally:
        for name in installed:
            model.uninstall(name)


def test_a_hook_writing_nan_is_reported_and_never_reaches_another_request(served):
    """A NaN written by a hook used to stay in the KV block of its request; freed, the block served
    the next request (vLLM hands out a freed partial block first), whose stale slots then gave NaN
    logits. Now the call is told which hook point and rows, and the plain calls after it equal the
    same calls made before, bit for bit."""
    from xmix_lens import NonFiniteError

    model = served[MODEL]
    long, short = " ".join([PROMPT] * 5), "Hello there my friend"  # each under one KV block
    before = model(short), model.generate(short, max_new_tokens=5, do_sample=False, return_type="tokens")

    def unaffected():
        after = model(short), model.generate(short, max_new_tokens=5, do_sample=False, return_type="tokens")
        return torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])

    divide_by_zero = [(SITE, lambda act, hook: act / 0.0)]
    with pytest.raises(NonFiniteError, match=rf"{SITE} in rows \[0\]"):
        model.run_with_hooks(long, fwd_hooks=divide_by_zero)
    assert unaffected()
    with pytest.raises(NonFiniteError, match="on_nonfinite"):
        model.generate(long, max_new_tokens=5, do_sample=False, fwd_hooks=divide_by_zero)
    assert unaffected()
    first_row_only = torch.tensor([float("inf"), 0.0])[:, None, None]  # a per-row bias
    model.on_nonfinite = "warn"
    try:
        with pytest.warns(RuntimeWarning, match=rf"{SITE} in rows \[0\]"):
            out = model.run_with_hooks([long, short], fwd_hooks=[(SITE, lambda act, hook: act + first_row_only)])
    finally:
        model.on_nonfinite = "raise"
    assert not torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()
    assert unaffected()
