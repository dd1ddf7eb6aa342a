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
STEER_LAYER, TRUTH_LAYER, HARM_LAYER, CONDITION_LAYER, REFUSAL_LAYER, SAE_LAYER = 8, 14, 6, 6, 10, 8
STEER_COEF, REFUSAL_COEF = 16.0, 8.0  # times a unit direction
ITI_TOP_K, ITI_ALPHA = 8, 5.0
SAE_SIZE, SAE_K = 128, 16
NEW = 5  # generated tokens in generate comparisons


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


@pytest.fixture(scope="module")
def iti_shifts(pair):
    """ITI head shifts from the sentiment sets' derivation halves: each head's `attn.hook_z` averaged
    over the prompt, heads chosen on a validation third of those halves (real and control)."""
    xl, _ = pair
    (ptr, _), (ntr, _) = D.split(D.load_lines("positive.txt")), D.split(D.load_lines("negative.txt"))
    (pfit, pval), (nfit, nval) = D.split(ptr), D.split(ntr)
    z_fit, z_val = D.head_means(xl, pfit + nfit), D.head_means(xl, pval + nval)
    y_fit, y_val = labels(pfit, nfit), labels(pval, nval)
    return {name: D.head_shifts(*D.by_label(z_fit, yf), *D.by_label(z_val, yv), top_k=ITI_TOP_K)[0]
            for name, yf, yv in (("iti", y_fit, y_val), ("iti_control", D.shuffled(y_fit), D.shuffled(y_val)))}


@pytest.fixture(scope="module")
def trained_sae(pair):
    """A top-k SAE on the residual of the derivation halves of every prompt set (BOS left out: its
    residual is hundreds of times larger and the same for every prompt), the held-out halves'
    tokens to evaluate it on, and the feature most active on positive over negative sentences."""
    xl, _ = pair
    hook = f"blocks.{SAE_LAYER}.hook_resid_post"
    fit, held = [], []
    for name in ("positive.txt", "negative.txt", "harmful.txt", "benign.txt", "topic_food.txt", "topic_other.txt"):
        a, b = D.split(D.load_lines(name))
        fit, held = fit + a, held + b

    def tokens(prompts):
        return torch.cat([a[1:] for a in D.activations(xl, prompts, hook)])

    X_fit = tokens(fit)
    sae = D.train_sae(X_fit, SAE_SIZE, SAE_K, hook)
    (ptr, _), (ntr, _) = D.split(D.load_lines("positive.txt")), D.split(D.load_lines("negative.txt"))
    feature = int((sae.encode(tokens(ptr)).mean(0) - sae.encode(tokens(ntr)).mean(0)).argmax())
    return {"sae": sae, "untrained": D.train_sae(X_fit, SAE_SIZE, SAE_K, hook, steps=0), "held": tokens(held),
            "feature": feature, "clamp": float(sae.encode(X_fit)[:, feature].max())}


def unit(v):
    return v / v.norm()


def prompt_mean(values, prompt_mask):
    """Per row, the mean of values [batch, pos] over the prompt's real positions (what a store's
    reduce="mean" keeps)."""
    return (values * prompt_mask).sum(1) / prompt_mask.sum(1)


def tl_conditional_steering(app, prompt_mask):
    """The CAST app's math for TransformerLens, the prompt's condition kept in a plain dict."""
    p, kept = app.params, {}

    def condition(act, hook):
        kept["similarity"] = prompt_mean((act @ p["condition"]) / act.norm(dim=-1), prompt_mask)

    def steer_at(key):
        def steer(act, hook):
            return act + (kept["similarity"] > p["threshold"])[:, None, None] * (p["coef"] * p[key])
        return steer

    hooks = [(app.param_sites["condition"][0], condition)]
    hooks += [(site, steer_at(key)) for key, (site, _) in app.param_sites.items() if key.startswith("direction.")]
    return hooks, kept


def tl_harmful_request_detector(app, prompt_mask):
    """The detector's math for TransformerLens, the prompt's score kept in a plain dict."""
    p, kept = app.params, {}

    def probe(act, hook):
        kept["score"] = prompt_mean(act @ p["w"] + p["b"], prompt_mask)

    def refuse_at(key):
        def refuse(act, hook):
            return act + (kept["score"] > p["threshold"])[:, None, None] * (p["coef"] * p[key])
        return refuse

    hooks = [(app.param_sites["w"][0], probe)]
    hooks += [(site, refuse_at(key)) for key, (site, _) in app.param_sites.items() if key.startswith("refusal.")]
    return hooks, kept


def generate_tokens(xl, prompts, **kwargs):
    # left padding: a prompt read of act[:, -1] is each row's last token, in a batch as alone
    return xl.generate(prompts, max_new_tokens=NEW, do_sample=False, stop_at_eos=False, return_type="tokens",
                       padding_side="left", **kwargs)


def teacher_forced_matches(tl, xl, prompt, sequence, twin) -> bool:
    """Whether TL, running `twin(prompt_mask)`'s hooks over the generated sequence, chooses every
    generated token greedily: the condition is the prompt's, the write on every position."""
    prompt_len = len(xl.to_tokens(prompt)[0])
    sequence = sequence[-(prompt_len + NEW):][None]  # a batch comes back left-padded, as from TransformerLens
    hooks, _ = twin((torch.arange(sequence.shape[1]) < prompt_len)[None].float())
    logits = tl.run_with_hooks(sequence, fwd_hooks=hooks)
    return torch.equal(logits[0, prompt_len - 1: -1].argmax(-1), sequence[0, prompt_len:])


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


def test_conditional_steering_gates_every_generated_token_and_matches_transformer_lens(pair, tol, derived):
    xl, tl = pair
    (_, held_food), (_, held_other) = D.split(D.load_lines("topic_food.txt")), D.split(D.load_lines("topic_other.txt"))
    prompts, y = held_food + held_other, labels(held_food, held_other)  # never used to derive the condition
    plain = xl.run_with_hooks(prompts, padding_side="left")
    plain_tokens = generate_tokens(xl, prompts)
    steer = {STEER_LAYER: unit(derived["sentiment"])}
    gate_accuracy = {}
    for name in ("condition", "condition_control"):
        c, threshold = derived[name]
        app = apps.conditional_steering(name, f"blocks.{CONDITION_LAYER}.hook_resid_post", c, threshold, steer,
                                        coef=STEER_COEF)
        with installed(xl, app):
            run = xl.run_with_hooks(prompts, apps=[name], padding_side="left")
            generated = generate_tokens(xl, prompts, apps=[name])
        gate = run.outputs[name]["gate"].bool()
        gate_accuracy[name] = float((gate == y.bool()).float().mean())
        if name != "condition":
            continue
        assert gate.any() and not gate.all(), "both branches must be taken, or the test shows nothing"
        hooks, kept = tl_conditional_steering(app, tl_run(tl, xl, prompts, [])[1].float())
        theirs, mask = tl_run(tl, xl, prompts, hooks)
        assert (run.outputs[name]["similarity"] - kept["similarity"]).abs().max() < 1e-4
        assert (run.result - theirs).abs()[mask].max() < tol
        # steered where the prompt meets the condition, untouched elsewhere
        shift = D.sentiment_logit_gap(xl, run.result[:, -1]) - D.sentiment_logit_gap(xl, plain[:, -1])
        assert shift[gate].min() > 0.5
        assert (run.result[~gate] - plain[~gate]).abs()[mask[~gate]].max() < tol
        # generate: the prompt's gate holds on every generated token (the last one's read is the prompt's)
        assert torch.equal(generated.generated_outputs[name]["gate"], run.outputs[name]["gate"])
        for row, prompt in enumerate(prompts):
            ours = generated.result[row]
            assert teacher_forced_matches(tl, xl, prompt, ours, lambda m: tl_conditional_steering(app, m))
        assert torch.equal(generated.result[~gate], plain_tokens[~gate])
        assert not torch.equal(generated.result[gate], plain_tokens[gate])
    assert gate_accuracy["condition"] >= 0.75 > gate_accuracy["condition_control"]


def test_harmful_request_detector_flags_held_out_requests_and_matches_transformer_lens(pair, tol, derived):
    xl, tl = pair
    (_, held_harm), (_, held_benign) = D.split(D.load_lines("harmful.txt")), D.split(D.load_lines("benign.txt"))
    prompts, y = held_harm + held_benign, labels(held_harm, held_benign)  # never used to derive the probe
    hook = f"blocks.{HARM_LAYER}.hook_resid_post"
    plain = xl.run_with_hooks(prompts, padding_side="left")
    figures = {}
    for name in ("harm", "harm_control"):
        w, b = derived[name]
        app = apps.harmful_request_detector(name, hook, w, b)
        with installed(xl, app):
            run = xl.run_with_hooks(prompts, apps=[name], padding_side="left")
        score = run.outputs[name]["score"]
        figures[name] = (D.accuracy(score, y), D.auc(score, y))
        assert torch.equal(run.outputs[name]["flag"], (score > 0) * 1.0)
        assert (run.result - plain).abs().max() == 0  # without a refusal steer the detector only reads
        if name == "harm":
            hooks, kept = tl_harmful_request_detector(app, tl_run(tl, xl, prompts, [])[1].float())
            tl_run(tl, xl, prompts, hooks)
            assert (score - kept["score"]).abs().max() < 1e-4 * float(kept["score"].abs().max()) + tol
    (accuracy, auc), (control_accuracy, control_auc) = figures["harm"], figures["harm_control"]
    assert accuracy > 0.8 > control_accuracy and auc > 0.9 > control_auc
    # a refusal steer on flagged requests only, the flag returned with the logits
    w, b = derived["harm"]
    app = apps.harmful_request_detector("refuse", hook, w, b, refusal_directions={REFUSAL_LAYER: unit(derived["refusal"])},
                                        coef=REFUSAL_COEF)
    with installed(xl, app):
        run = xl.run_with_hooks(prompts, apps=["refuse"], padding_side="left")
    flag = run.outputs["refuse"]["flag"].bool()
    hooks, _ = tl_harmful_request_detector(app, tl_run(tl, xl, prompts, [])[1].float())
    theirs, mask = tl_run(tl, xl, prompts, hooks)
    assert (run.result - theirs).abs()[mask].max() < tol
    assert flag.any() and not flag.all()
    assert min((run.result[r] - plain[r]).abs()[mask[r]].max() for r in flag.nonzero()[:, 0]) > 50 * tol
    assert (run.result[~flag] - plain[~flag]).abs()[mask[~flag]].max() < tol


def test_iti_head_shifts_steer_sentiment_beyond_control_and_match_transformer_lens(pair, tol, iti_shifts):
    xl, tl = pair
    neutral = D.load_lines("neutral_prompts.txt")  # never used to derive the shifts
    base = D.sentiment_logit_gap(xl, xl.run_with_hooks(neutral, padding_side="left")[:, -1])
    shift = {}
    for name, shifts in iti_shifts.items():
        app = apps.inference_time_intervention(name, shifts, xl.cfg.n_heads, alpha=ITI_ALPHA)
        with installed(xl, app):
            run = xl.run_with_hooks(neutral, apps=[name], padding_side="left")
        shift[name] = D.sentiment_logit_gap(xl, run.result[:, -1]) - base
        if name == "iti":
            assert all(site.endswith("attn.hook_z") for site, _ in app.fwd_hooks)
            theirs, mask = tl_run(tl, xl, neutral, app.fwd_hooks)
            assert (run.result - theirs).abs()[mask].max() < tol
    assert float(shift["iti"].mean()) > 1.5 > float(shift["iti_control"].mean()) and shift["iti"].min() > 0.5


def test_sae_features_saelens_round_trip_reads_clamps_and_reconstructs(pair, tol, trained_sae, tmp_path):
    xl, tl = pair
    trained = trained_sae["sae"]
    sae = apps.load_sae(apps.save_sae(trained, tmp_path / "sae"))
    for key in ("W_enc", "b_enc", "W_dec", "b_dec"):
        assert torch.equal(getattr(sae, key), getattr(trained, key))
    assert (sae.hook_name, sae.activation, sae.k) == (trained.hook_name, "topk", SAE_K)
    # reconstruction of held-out tokens, against the same SAE before training
    explained = D.variance_explained(sae, trained_sae["held"])
    assert explained > 0.6 > 0.2 > D.variance_explained(trained_sae["untrained"], trained_sae["held"])
    neutral = D.load_lines("neutral_prompts.txt")
    feature, value = trained_sae["feature"], trained_sae["clamp"]
    read = apps.sae_features("read", sae, read=range(8))
    clamp = apps.sae_features("clamp", sae, read=[feature], clamp={feature: value})
    after = {}

    def downstream(act, hook):  # runs after the app at its hook point
        after["act"] = act

    with installed(xl, read, clamp):
        reads = xl.run_with_hooks(neutral, apps=["read"], padding_side="left")
        clamped = xl.run_with_hooks(neutral, apps=["clamp"], fwd_hooks=[(sae.hook_name, downstream)],
                                    padding_side="left")
    plain, cache = xl.run_with_cache(neutral, names_filter=sae.hook_name, padding_side="left")
    theirs, mask = tl_run(tl, xl, neutral, read.fwd_hooks)
    ours = reads.outputs["read"]["features"]
    assert (ours - read.outputs["features"]).abs()[mask].max() < 1e-4 * float(ours.abs().max()) + tol
    assert ours[mask].abs().max() > 1.0
    assert (reads.result - plain).abs()[mask].max() < tol  # a read alone changes nothing
    # the clamp: equal to TL, changes the output (toward the feature's sentiment), and downstream the
    # residual carries the clamped value along the feature's decoder row
    theirs, mask = tl_run(tl, xl, neutral, clamp.fwd_hooks)
    assert (clamped.result - theirs).abs()[mask].max() < tol
    assert (clamped.result - plain).abs()[mask].max() > 50 * tol
    gap = D.sentiment_logit_gap(xl, clamped.result[:, -1]) - D.sentiment_logit_gap(xl, plain[:, -1])
    assert float(gap.mean()) > 0.5
    coefficient = clamped.outputs["clamp"]["features"][..., 0] + (after["act"] - cache[sae.hook_name]) @ sae.W_dec[feature]
    assert (coefficient[mask] - value).abs().max() < 1e-3 * value


def seven_apps(xl, derived, iti_shifts, trained_sae) -> list[App]:
    sentiment, refusal = unit(derived["sentiment"]), unit(derived["refusal"])
    condition, threshold = derived["condition"]
    feature = trained_sae["feature"]
    return [
        apps.activation_addition("actadd", {STEER_LAYER: sentiment}, coef=STEER_COEF),
        apps.directional_ablation("ablate", refusal, xl.cfg.n_layers),
        apps.linear_probe("truth", f"blocks.{TRUTH_LAYER}.hook_resid_post", *derived["truth"]),
        apps.conditional_steering("cast", f"blocks.{CONDITION_LAYER}.hook_resid_post", condition, threshold,
                                  {STEER_LAYER: sentiment}, coef=STEER_COEF),
        apps.harmful_request_detector("harm", f"blocks.{HARM_LAYER}.hook_resid_post", *derived["harm"],
                                      refusal_directions={REFUSAL_LAYER: refusal}, coef=REFUSAL_COEF),
        apps.inference_time_intervention("iti", iti_shifts["iti"], xl.cfg.n_heads, alpha=ITI_ALPHA),
        apps.sae_features("sae", trained_sae["sae"], read=[feature], clamp={feature: trained_sae["clamp"]}),
    ]


def row_read(value, row, n):
    """One row's app read; per-position reads ([batch, pos, ...]) at the row's n real positions."""
    return value[row, -n:] if value.dim() > 1 else value[row]


def test_all_seven_apps_in_one_engine_each_request_as_its_subset_alone(pair, tol, derived, iti_shifts, trained_sae):
    xl, _ = pair
    built = seven_apps(xl, derived, iti_shifts, trained_sae)
    _, food = D.split(D.load_lines("topic_food.txt"))
    _, other = D.split(D.load_lines("topic_other.txt"))
    _, harmful = D.split(D.load_lines("harmful.txt"))
    neutral = D.load_lines("neutral_prompts.txt")
    requests = [  # (prompt, its apps): the gated apps meet prompts that trigger them and prompts that do not
        (food[0], [a.name for a in built]),
        (harmful[0], ["harm", "truth", "sae"]),
        (other[0], ["cast", "iti", "ablate"]),
        (neutral[0], ["actadd", "sae", "harm"]),
        (neutral[1], []),
        (food[1], ["truth", "cast"]),
    ]
    prompts, selection = [p for p, _ in requests], [s for _, s in requests]
    with installed(xl, *built):
        mixed = xl.run_with_hooks(prompts, apps=selection, padding_side="left")
        split = xl.run_batch([(prompts[:3], [], selection[:3]), (prompts[3:], [], selection[3:])], padding_side="left")
        generated = generate_tokens(xl, prompts, apps=selection)
        alone = [xl.run_with_hooks([p], apps=[s], padding_side="left") for p, s in requests]
        alone_generated = [generate_tokens(xl, [p], apps=[s]) for p, s in requests]
    plain = xl.run_with_hooks(prompts, padding_side="left")
    for app, key in (("cast", "gate"), ("harm", "flag")):  # both branches of each gate are taken
        gates = mixed.outputs[app][key]
        assert set(gates[~gates.isnan()].tolist()) == {0.0, 1.0}
    batch_rows = [(split[0], r) for r in range(3)] + [(split[1], r) for r in range(len(prompts) - 3)]
    for row, (prompt, names) in enumerate(requests):
        n = len(xl.to_tokens(prompt)[0])
        own = alone[row].result[0] if names else alone[row][0]
        assert (mixed.result[row, -n:] - own).abs().max() < tol
        entry, at = batch_rows[row]
        assert (entry.result[at, -n:] - own).abs().max() < tol
        if names:  # every subset here writes: a request's apps took effect, not just no harm done
            assert (own - plain[row, -n:]).abs().max() > 50 * tol
        own_tokens = alone_generated[row].result[0] if names else alone_generated[row][0]
        assert torch.equal(generated.result[row, -(n + NEW):], own_tokens)  # rows come back left-padded
        for app in built:
            for key, value in mixed.outputs.get(app.name, {}).items():
                if app.name not in names:
                    assert torch.isnan(value[row]).all()
                    continue
                own_value = alone[row].outputs[app.name][key]
                bound = 1e-4 * float(own_value.abs().max()) + tol
                assert (row_read(value, row, n) - row_read(own_value, 0, n)).abs().max() < bound
                if value.dim() == 1:  # per-request reads of generate: the prompt's, and the last token's
                    for outputs, own_outputs in ((generated.outputs, alone_generated[row].outputs),
                                                 (generated.generated_outputs, alone_generated[row].generated_outputs)):
                        assert (outputs[app.name][key][row] - own_outputs[app.name][key][0]).abs().max() < bound
