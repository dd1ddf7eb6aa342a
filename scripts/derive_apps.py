"""Reproduce the measured table of docs/apps.md: derive every app's direction, probe, head shifts
and SAE from SmolLM2's own activations (xmix_lens.apps.derive over xmix_lens/apps/data), evaluate on
held-out items with the apps installed in the served model, and print each figure next to its
shuffled-label (or untrained) control.

    .venv/bin/python scripts/derive_apps.py

Settings are those of tests/test_apps.py; the test asserts margins on the same figures."""
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import torch  # noqa: E402

from xmix_lens import HookedServedModel, apps, model_files  # noqa: E402
from xmix_lens.apps import derive as D  # noqa: E402

STEER_LAYER, TRUTH_LAYER, HARM_LAYER, CONDITION_LAYER, SAE_LAYER = 8, 14, 6, 6, 8
STEER_COEF, ITI_TOP_K, ITI_ALPHA, SAE_SIZE, SAE_K = 16.0, 8, 5.0, 128, 16


def labels(pos, neg):
    return torch.cat([torch.ones(len(pos)), torch.zeros(len(neg))])


def resid(layer):
    return f"blocks.{layer}.hook_resid_post"


def with_app(model, app, prompts):
    """The AppRun of prompts with the app installed and selected alone."""
    model.install(app)
    try:
        return model.run_with_hooks(prompts, apps=[app.name], padding_side="left")
    finally:
        model.uninstall(app.name)


def report(what, real, control, unit=""):
    print(f"{what:<58} {real:>8.3f}{unit}   control {control:>8.3f}{unit}")


def sets(name):
    return D.split(D.load_lines(name))


def sentiment(model, neutral, base):
    """ActAdd at layer 8 (x8, x16, x32): mean shift of the sentiment log-prob gap on neutral prompts."""
    (ptr, _), (ntr, _) = sets("positive.txt"), sets("negative.txt")
    X, y = D.mean(D.activations(model, ptr + ntr, resid(STEER_LAYER))), labels(ptr, ntr)
    directions = {"real": D.mean_difference(X, y), "control": D.mean_difference(X, D.shuffled(y))}
    for coef in (8.0, 16.0, 32.0):
        shift = {k: float((D.sentiment_logit_gap(model, with_app(model, apps.activation_addition(
            f"actadd_{k}", {STEER_LAYER: d / d.norm()}, coef), neutral).result[:, -1]) - base).mean())
            for k, d in directions.items()}
        report(f"ActAdd layer {STEER_LAYER} x{coef:g}: sentiment gap shift (nats)", shift["real"], shift["control"])
    return directions["real"]


def probe_figures(model, what, hook, w_b, w_b_control, prompts, y, read):
    figures = {}
    for kind, (w, b) in (("real", w_b), ("control", w_b_control)):
        app = (apps.linear_probe if read == "last" else apps.harmful_request_detector)(f"probe_{kind}", hook, w, b)
        scores = with_app(model, app, prompts).outputs[app.name][read]
        figures[kind] = (D.auc(scores, y), D.accuracy(scores, y))
    report(f"{what}: held-out AUC", figures["real"][0], figures["control"][0])
    report(f"{what}: held-out accuracy", figures["real"][1], figures["control"][1])


def truth(model):
    tr, held = D.split(D.load_statements())
    X = D.last(D.activations(model, [t for t, _ in tr] + [f for _, f in tr], resid(TRUTH_LAYER)))
    y = labels(tr, tr)
    probe_figures(model, f"truth probe layer {TRUTH_LAYER} (ridge LDA, last token)", resid(TRUTH_LAYER),
                  D.ridge_lda_probe(X, y), D.ridge_lda_probe(X, D.shuffled(y)),
                  [t for t, _ in held] + [f for _, f in held], labels(held, held), "last")


def harm(model):
    (htr, hte), (btr, bte) = sets("harmful.txt"), sets("benign.txt")
    X, y = D.mean(D.activations(model, htr + btr, resid(HARM_LAYER))), labels(htr, btr)
    probe_figures(model, f"harmful-request detector layer {HARM_LAYER} (prompt mean)", resid(HARM_LAYER),
                  D.ridge_lda_probe(X, y), D.ridge_lda_probe(X, D.shuffled(y)), hte + bte, labels(hte, bte), "score")
    acts, y_held = D.activations(model, hte + bte, resid(12)), labels(hte, bte)
    separation = {kind: D.separation(torch.stack([(a[1:] @ (d / d.norm())).mean() for a in acts]), y_held)
                  for kind, d in (("real", D.mean_difference(X, y)), ("control", D.mean_difference(X, D.shuffled(y))))}
    report("refusal direction: held-out d' at layer 12", separation["real"], separation["control"])


def condition(model, sentiment_direction):
    (ftr, fte), (otr, ote) = sets("topic_food.txt"), sets("topic_other.txt")
    acts, y = D.activations(model, ftr + otr, resid(CONDITION_LAYER)), labels(ftr, otr)
    accuracy = {}
    for kind, yy in (("real", y), ("control", D.shuffled(y))):
        c = D.mean_difference(D.mean(acts), yy)
        s = D.mean_cosine(acts, c)
        threshold = float((s[yy.bool()].mean() + s[~yy.bool()].mean()) / 2)
        app = apps.conditional_steering(f"cast_{kind}", resid(CONDITION_LAYER), c, threshold,
                                        {STEER_LAYER: sentiment_direction / sentiment_direction.norm()}, STEER_COEF)
        run = with_app(model, app, fte + ote)
        gate = run.outputs[app.name]["gate"]
        accuracy[kind] = float((gate == labels(fte, ote)).float().mean())
        if kind == "real":
            plain = model.run_with_hooks(fte + ote, padding_side="left")[:, -1]
            shift = D.sentiment_logit_gap(model, run.result[:, -1]) - D.sentiment_logit_gap(model, plain)
            gated = gate.bool()
            print(f"CAST: sentiment gap shift, gated held-out prompts {shift[gated].mean():.3f} (min "
                  f"{shift[gated].min():.3f}), ungated {shift[~gated].abs().max():.3f}")
    report(f"CAST condition layer {CONDITION_LAYER}: held-out gate accuracy", accuracy["real"], accuracy["control"])


def iti(model, neutral, base):
    (ptr, _), (ntr, _) = sets("positive.txt"), sets("negative.txt")
    (pfit, pval), (nfit, nval) = D.split(ptr), D.split(ntr)
    z_fit, z_val = D.head_means(model, pfit + nfit), D.head_means(model, pval + nval)
    y_fit, y_val = labels(pfit, nfit), labels(pval, nval)
    shift = {}
    for kind, yf, yv in (("real", y_fit, y_val), ("control", D.shuffled(y_fit), D.shuffled(y_val))):
        shifts, _ = D.head_shifts(*D.by_label(z_fit, yf), *D.by_label(z_val, yv), top_k=ITI_TOP_K)
        app = apps.inference_time_intervention(f"iti_{kind}", shifts, model.cfg.n_heads, ITI_ALPHA)
        shift[kind] = float((D.sentiment_logit_gap(model, with_app(model, app, neutral).result[:, -1]) - base).mean())
        if kind == "real":
            print(f"ITI heads (layer, head): {sorted(shifts)}")
    report(f"ITI {ITI_TOP_K} heads x{ITI_ALPHA:g} (sentiment): gap shift (nats)", shift["real"], shift["control"])


def iti_truth(model):
    """ITI on the true/false statements: the log-prob gap of the true over the false completion
    token at the pair's first differing token, on held-out pairs."""
    tr, held = D.split(D.load_statements())
    fit, val = D.split(tr)
    z_hooks = [f"blocks.{L}.attn.hook_z" for L in range(model.cfg.n_layers)]

    def last_z(prompts):
        acts = D.activations_at(model, prompts, z_hooks)
        return {L: D.last(acts[name]) for L, name in enumerate(z_hooks)}

    z_fit = last_z([t for t, _ in fit] + [f for _, f in fit])
    z_val = last_z([t for t, _ in val] + [f for _, f in val])
    y_fit, y_val = labels(fit, fit), labels(val, val)
    prefixes, true_ids, false_ids = [], [], []
    for t, f in held:
        a, b = model.to_tokens(t)[0].tolist(), model.to_tokens(f)[0].tolist()
        k = next(i for i in range(min(len(a), len(b))) if a[i] != b[i])
        prefixes.append(model.tokenizer.decode(a[1:k]))
        true_ids.append(a[k])
        false_ids.append(b[k])

    def gap(logits):
        logp = logits[:, -1].log_softmax(-1)
        return logp[range(len(held)), true_ids] - logp[range(len(held)), false_ids]

    base = gap(model.run_with_hooks(prefixes, padding_side="left"))
    shift = {}
    for kind, yf, yv in (("real", y_fit, y_val), ("control", D.shuffled(y_fit), D.shuffled(y_val))):
        shifts, _ = D.head_shifts(*D.by_label(z_fit, yf), *D.by_label(z_val, yv), top_k=ITI_TOP_K)
        app = apps.inference_time_intervention(f"iti_truth_{kind}", shifts, model.cfg.n_heads, ITI_ALPHA)
        shift[kind] = float((gap(with_app(model, app, prefixes).result) - base).mean())
    report(f"ITI {ITI_TOP_K} heads x{ITI_ALPHA:g} (truth): true-minus-false token gap shift", shift["real"],
           shift["control"])


def sae(model, neutral, base):
    hook = resid(SAE_LAYER)
    fit, held = [], []
    for name in ("positive.txt", "negative.txt", "harmful.txt", "benign.txt", "topic_food.txt", "topic_other.txt"):
        a, b = sets(name)
        fit, held = fit + a, held + b

    def tokens(prompts):
        return torch.cat([a[1:] for a in D.activations(model, prompts, hook)])

    X_fit, X_held = tokens(fit), tokens(held)
    start = time.time()
    trained = D.train_sae(X_fit, SAE_SIZE, SAE_K, hook)
    seconds = time.time() - start
    untrained = D.train_sae(X_fit, SAE_SIZE, SAE_K, hook, steps=0)
    report(f"SAE layer {SAE_LAYER} d_sae {SAE_SIZE} top-{SAE_K} ({len(X_fit)} tokens, {seconds:.1f} s): held-out FVE",
           D.variance_explained(trained, X_held), D.variance_explained(untrained, X_held))
    (ptr, _), (ntr, _) = sets("positive.txt"), sets("negative.txt")
    feature = int((trained.encode(tokens(ptr)).mean(0) - trained.encode(tokens(ntr)).mean(0)).argmax())
    value = float(trained.encode(X_fit)[:, feature].max())
    app = apps.sae_features("sae_clamp", trained, clamp={feature: value})
    shift = float((D.sentiment_logit_gap(model, with_app(model, app, neutral).result[:, -1]) - base).mean())
    print(f"SAE: clamping feature {feature} (most active on positive over negative) to {value:.1f}: "
          f"sentiment gap shift {shift:.3f} nats on the neutral prompts")


def main():
    start = time.time()
    model = HookedServedModel.from_pretrained(str(model_files.ensure_smollm2()), max_model_len=256)
    print(f"engine ready in {time.time() - start:.0f} s")
    neutral = D.load_lines("neutral_prompts.txt")
    base = D.sentiment_logit_gap(model, model.run_with_hooks(neutral, padding_side="left")[:, -1])
    sentiment_direction = sentiment(model, neutral, base)
    truth(model)
    harm(model)
    condition(model, sentiment_direction)
    iti(model, neutral, base)
    iti_truth(model)
    sae(model, neutral, base)
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
