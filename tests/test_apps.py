"""Apps (xmix_lens.App) and the seven applications of xmix_lens.apps on SmolLM2.

Each application is derived from SmolLM2's own activations (xmix_lens.apps.derive over the prompt
sets in xmix_lens/apps/data), evaluated on held-out items against a shuffled-label control, and
compared with TransformerLens running the same hook functions (the app's own `fwd_hooks`; for the
two apps that use xmix-lens stores, TL runs the same math with a dict, as tests/test_generate.py
does). Prompts are left-padded so that `act[:, -1]` is each prompt's last token; TL gets the mask."""
import contextlib

import pytest
import torch

from xmix_lens import App, apps
from xmix_lens.apps import derive as D

MODEL = "smollm2"
STEER_LAYER, TRUTH_LAYER, HARM_LAYER, CONDITION_LAYER = 8, 14, 6, 6


@pytest.fixture(scope="module")
def pair(served, reference):
    return served[MODEL], reference[MODEL]


@contextlib.contextmanager
def installed(model, *built):
    for app in built:
        model.install(app)
    try:
        yield
    finally:
        for app in built:
            model.uninstall(app.name)
        model.deactivate()


def labels(pos, neg):
    return torch.cat([torch.ones(len(pos)), torch.zeros(len(neg))])


def tl_run(tl, model, prompts, hooks):
    """TL's logits and the real-position mask for left-padded prompts."""
    tokens = model.to_tokens(prompts, padding_side="left")
    mask = tl.attention_mask(tokens, padding_side="left")
    return tl.run_with_hooks(tokens, fwd_hooks=hooks, attention_mask=mask), mask.bool()


@pytest.fixture(scope="module")
def tol(pair):
    """50x the unhooked xmix-vs-TL logit difference at real positions (floor 1e-4), as compat_tests."""
    xl, tl = pair
    prompts = D.load_lines("neutral_prompts.txt")[:3]
    theirs, mask = tl_run(tl, xl, prompts, [])
    ours = xl.run_with_hooks(prompts, padding_side="left")
    return max(50 * float((ours - theirs).abs()[mask].max()), 1e-4)


@pytest.fixture(scope="module")
def derived(pair):
    """Every direction and probe, from the derivation halves of the data sets (real and control)."""
    xl, _ = pair
    out = {}
    (ptr, _), (ntr, _) = D.split(D.load_lines("positive.txt")), D.split(D.load_lines("negative.txt"))
    X = D.mean(D.activations(xl, ptr + ntr, f"blocks.{STEER_LAYER}.hook_resid_post"))
    y = labels(ptr, ntr)
    out["sentiment"], out["sentiment_control"] = D.mean_difference(X, y), D.mean_difference(X, D.shuffled(y))
    (htr, _), (btr, _) = D.split(D.load_lines("harmful.txt")), D.split(D.load_lines("benign.txt"))
    X = D.mean(D.activations(xl, htr + btr, f"blocks.{HARM_LAYER}.hook_resid_post"))
    y = labels(htr, btr)
    out["harm"], out["harm_control"] = D.ridge_lda_probe(X, y), D.ridge_lda_probe(X, D.shuffled(y))
    out["refusal"] = D.mean_difference(X, y)
    out["refusal_control"] = D.mean_difference(X, D.shuffled(y))
    tr, _ = D.split(D.load_statements())
    stmts, y = [t for t, _ in tr] + [f for _, f in tr], labels(tr, tr)
    X = D.last(D.activations(xl, stmts, f"blocks.{TRUTH_LAYER}.hook_resid_post"))
    out["truth"], out["truth_control"] = D.ridge_lda_probe(X, y), D.ridge_lda_probe(X, D.shuffled(y))
    (ftr, _), (otr, _) = D.split(D.load_lines("topic_food.txt")), D.split(D.load_lines("topic_other.txt"))
    acts, y = D.activations(xl, ftr + otr, f"blocks.{CONDITION_LAYER}.hook_resid_post"), labels(ftr, otr)
    for name, yy in (("condition", y), ("condition_control", D.shuffled(y))):
        c = D.mean_difference(D.mean(acts), yy)
        s = D.mean_cosine(acts, c)
        out[name] = (c, float((s[yy.bool()].mean() + s[~yy.bool()].mean()) / 2))
    return out


# --- the App API ---------------------------------------------------------------------------------
def test_app_api_selection_order_params_and_errors(pair, tol):
    xl, tl = pair
    d = xl.cfg.d_model
    v = torch.randn(d, generator=torch.Generator().manual_seed(0))
    v = 8.0 * v / v.norm()
    scale = App("scale", fwd_hooks=[("blocks.3.hook_resid_post", lambda act, hook: act * 1.5)])
    steer = apps.activation_addition("steer", {3: v})
    probe = apps.linear_probe("probe", "blocks.5.hook_resid_post", v / v.norm())
    prompts = ["The capital of France is", "Hello", "One two three four"]
    with installed(xl, scale, steer, probe):
        assert list(xl.apps) == ["scale", "steer", "probe"]
        mixed = xl.run_with_hooks(prompts, apps=[["probe"], ["steer", "scale", "probe"], []], padding_side="left")
        assert mixed.selection == [("probe",), ("scale", "steer", "probe"), ()]
        alone = [xl.run_with_hooks(prompts, apps=sel, padding_side="left") for sel in (["probe"], ["scale", "steer", "probe"])]
        plain = xl.run_with_hooks(prompts, padding_side="left")
        assert torch.allclose(mixed.result[0], alone[0].result[0], atol=tol)
        assert torch.allclose(mixed.result[1], alone[1].result[1], atol=tol)
        assert torch.allclose(mixed.result[2], plain[2], atol=tol)
        assert torch.isnan(mixed.outputs["probe"]["last"][2])
        assert torch.allclose(mixed.outputs["probe"]["last"][:2],
                              torch.stack([alone[0].outputs["probe"]["last"][0], alone[1].outputs["probe"]["last"][1]]),
                              atol=tol * 100)
        # two apps writing one site compose in install order (scale, then steer), as TL runs hooks in order
        theirs, mask = tl_run(tl, xl, prompts, scale.fwd_hooks + steer.fwd_hooks)
        assert (alone[1].result - theirs).abs()[mask].max() < tol
        wrong_order, _ = tl_run(tl, xl, prompts, steer.fwd_hooks + scale.fwd_hooks)
        assert (alone[1].result - wrong_order).abs()[mask].max() > 50 * tol
        # activate: a default for calls without apps=; per row with requests=
        xl.activate(["steer"], requests=[1])
        run = xl.run_with_hooks(prompts, padding_side="left")
        assert run.selection == [(), ("steer",), ()]
        xl.deactivate()
        assert isinstance(xl.run_with_hooks(prompts, padding_side="left"), torch.Tensor)
        # set_params: in place, new version, the next call sees it
        before = xl.run_with_hooks(prompts, apps=["steer"], padding_side="left").result
        assert xl.set_params("steer", coef=2.0) == 1 and steer.version == 1
        after = xl.run_with_hooks(prompts, apps=["steer"], padding_side="left").result
        theirs, mask = tl_run(tl, xl, prompts, steer.fwd_hooks)
        assert (after - theirs).abs()[mask].max() < tol and (after - before).abs()[mask].max() > 50 * tol
        # bad input: clear errors before anything runs, and the engine keeps serving
        with pytest.raises(ValueError, match="request 1's apps= names app 'nope', which is not installed"):
            xl.run_with_hooks(prompts, apps=[["probe"], ["nope"], []], padding_side="left")
        with pytest.raises(ValueError, match="activate names app 'ghost', which is not installed"):
            xl.activate(["ghost"])
        with pytest.raises(ValueError, match=r"param 'direction.4' has shape \[100\].*carries 576 features"):
            xl.install(apps.activation_addition("short", {4: torch.ones(100)}))
        with pytest.raises(ValueError, match="shape .* do not match|same shape"):
            xl.set_params("steer", coef=torch.ones(3))
        small = apps.SAE(torch.zeros(100, 8), torch.zeros(8), torch.zeros(8, 100), torch.zeros(100),
                         "blocks.2.hook_resid_post")
        with pytest.raises(ValueError, match=r"param 'W_enc' has shape \[100, 8\].*blocks.2.hook_resid_post carries 576"):
            xl.install(apps.sae_features("small", small, read=[0]))
        with pytest.raises(ValueError, match="one list per request"):
            xl.run_batch([(prompts, [], [["probe"]])])
        assert "short" not in xl.apps and "small" not in xl.apps
        assert not any(hp.fwd_hooks for hp in xl.hook_dict.values())
        again = xl.run_batch([(prompts, [], [["probe"], [], ["steer"]]), (prompts[:1], [])], padding_side="left")
        assert torch.allclose(again[0].result[0], alone[0].result[0], atol=tol)
        assert torch.allclose(again[1][0], plain[0, -again[1].shape[1]:], atol=tol)


# --- the seven applications ----------------------------------------------------------------------
def test_activation_addition_shifts_sentiment_and_matches_transformer_lens(pair, tol, derived):
    xl, tl = pair
    neutral = D.load_lines("neutral_prompts.txt")  # never used to derive the direction
    base = D.sentiment_logit_gap(xl, xl.run_with_hooks(neutral, padding_side="left")[:, -1])
    shift = {}
    for name in ("sentiment", "sentiment_control"):
        d = derived[name]
        app = apps.activation_addition(name, {STEER_LAYER: d / d.norm()}, coef=16.0)
        with installed(xl, app):
            run = xl.run_with_hooks(neutral, apps=[name], padding_side="left")
        shift[name] = float((D.sentiment_logit_gap(xl, run.result[:, -1]) - base).mean())
        if name == "sentiment":
            theirs, mask = tl_run(tl, xl, neutral, app.fwd_hooks)
            assert (run.result - theirs).abs()[mask].max() < tol
    assert shift["sentiment"] > 2.0 > shift["sentiment_control"]


def test_directional_ablation_removes_the_direction_at_every_layer(pair, tol, derived):
    xl, tl = pair
    _, held_harm = D.split(D.load_lines("harmful.txt"))
    _, held_benign = D.split(D.load_lines("benign.txt"))
    prompts = held_harm + held_benign
    d = derived["refusal"] / derived["refusal"].norm()
    projections = {}

    def measure(layer):
        def read(act, hook):
            projections[layer] = act @ d
        return read

    reads = [(f"blocks.{L}.hook_resid_post", measure(L)) for L in (2, 12, 29)]
    app = apps.directional_ablation("ablate", d, xl.cfg.n_layers)
    with installed(xl, app):
        ablated = xl.run_with_hooks(prompts, apps=["ablate"], fwd_hooks=reads, padding_side="left")
    after = {L: p.clone() for L, p in projections.items()}
    xl.run_with_hooks(prompts, fwd_hooks=reads, padding_side="left")
    mask = xl.to_tokens(prompts, padding_side="left") != xl.tokenizer.pad_token_id
    for L in after:
        assert after[L][mask].abs().max() < 1e-3 * projections[L][mask].abs().max()
        assert projections[L][mask].abs().max() > 1.0
    # the direction separates held-out harmful from benign prompts (mean projection after BOS, whose
    # residual is hundreds of times larger and the same for every prompt); a shuffled-label one does not
    acts = D.activations(xl, prompts, "blocks.12.hook_resid_post")
    y = labels(held_harm, held_benign)
    separation = {name: D.separation(torch.stack([(a[1:] @ (derived[name] / derived[name].norm())).mean()
                                                  for a in acts]), y) for name in ("refusal", "refusal_control")}
    assert separation["refusal"] > 0.9 > abs(separation["refusal_control"])
    theirs, tl_mask = tl_run(tl, xl, prompts, app.fwd_hooks)
    assert (ablated.result - theirs).abs()[tl_mask].max() < tol


def test_linear_probe_reads_truthfulness_with_the_output(pair, tol, derived):
    xl, tl = pair
    _, held = D.split(D.load_statements())
    stmts, y = [t for t, _ in held] + [f for _, f in held], labels(held, held)
    aucs = {}
    for name in ("truth", "truth_control"):
        w, b = derived[name]
        app = apps.linear_probe(name, f"blocks.{TRUTH_LAYER}.hook_resid_post", w, b)
        with installed(xl, app):
            run = xl.run_with_hooks(stmts, apps=[name], padding_side="left")
        aucs[name] = D.auc(run.outputs[name]["last"], y)
        if name == "truth":
            accuracy = D.accuracy(run.outputs[name]["last"], y)
            logits, _ = tl_run(tl, xl, stmts, app.fwd_hooks)
            theirs = app.outputs["last"]
            scale = float(theirs.abs().max())
            assert (run.outputs[name]["last"] - theirs).abs().max() < 1e-4 * scale + tol
            app.outputs.clear()
    assert aucs["truth"] > 0.7 > aucs["truth_control"] and accuracy > 0.65
