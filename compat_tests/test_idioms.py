"""TransformerLens idioms written as hooks, through TransformerLens and through xmix-lens.

The table in docs/hook-idioms.md names, per idiom, the test here that backs it. Every test runs
the same hook function objects through TransformerLens's own run_with_hooks (compat_tests/reference.py)
and through xmix-lens, on a batch of prompts of different lengths, both padding sides where the
idiom names no position (SmolLM2, for a few idioms, right padding only: its engine is the slow
one). Writes: logits at real positions agree within compare.py's per-model tolerance, and move
by more than 50x that tolerance (a hook that silently does nothing fails). Reads: the value the
hook keeps agrees with the value TL's run of the same hook keeps, at real positions, and the
logits are left alone. Each test also asserts what `explain()` says the hooks lower to: a
parametric template (affine_write, gather_rows, project_read: no code generated, the hook's
numbers are buffers) or a generated kernel.

Constants a hook closes over that come from a cached run (a mean activation, a clean run's
residuals, a threshold) are taken from TL's run_with_cache, so that both engines run the very
same function; the tests of "cache, then hook" idioms also check xmix-lens's own cached value
against TL's.
"""
import pytest
import torch

from compare import PROMPTS, cache_bound, direction, max_diff, real_mask, tolerance  # noqa: F401 (fixture)
from xmix_lens import store

TINY = ["tiny-llama", "tiny-gpt2"]
SIDES = ["right", "left"]
EVERY = [(m, s) for m in TINY for s in SIDES]  # every idiom: both tiny models, both padding sides
FEW = EVERY + [("smollm2", "right")]  # the idioms also run on SmolLM2
HEAD = 1  # the head the head idioms act on (every model has at least 4)
# "Cache, then hook" idioms. Equal token counts in every tokenizer here (Llama / SmolLM2 / GPT-2):
REFERENCE_BATCH = ["The cat sat on the mat", "One two three four five six", "I like green apples a lot"]
CLEAN = ["The capital of France is", "One two three four five six"]  # different lengths, padded
CORRUPTED = ["The capital of Italy is", "One two three nine five six"]  # the same lengths, row by row
PATCH_POS = 4  # BOS, The, capital, of, [France]  /  BOS, One, two, three, [four]


# --- shared checks ------------------------------------------------------------------------------
def lowered(xl, hooks, prompts=PROMPTS):
    """What explain() says the hooks become, one entry per lowered op, in order: 'affine_write',
    'gather_rows', 'project_read', 'generated write' or 'generated read'."""
    kinds, inside = [], False
    for line in xl.explain(prompts, fwd_hooks=hooks).splitlines():
        if line.startswith("graph("):
            inside = False
        elif line.strip() == "lowered to:":
            inside = True
        elif inside:
            text = line.strip()
            if text.startswith("generated kernel (write)"):
                kinds.append("generated write")
            elif text.startswith("generated kernel (read"):
                kinds.append("generated read")
            else:
                kinds.append(text.split(" ")[0])
    return kinds


def check_write(xl, tl, hooks, tol, padding_side="right", prompts=PROMPTS, tl_hooks=None):
    """The hooks' logits agree with TL's at real positions and differ from the unhooked logits by
    far more than the tolerance. tl_hooks: TL's counterpart where xmix-only API is used (stores)."""
    mask = real_mask(tl, tl.to_tokens(prompts, padding_side=padding_side), padding_side)
    base = xl(prompts, padding_side=padding_side)
    ours = xl.run_with_hooks(prompts, fwd_hooks=hooks, padding_side=padding_side)
    theirs = tl.run_with_hooks(prompts, fwd_hooks=tl_hooks or hooks, padding_side=padding_side)
    assert max_diff(ours, theirs, mask) < tol
    assert max_diff(ours, base, mask) > 50 * tol, "the hook did not move the logits"


def run_reads(xl, tl, hooks, kept, tol, padding_side):
    """Runs read-only hooks through both; checks the logits are left alone; returns (our kept
    values, TL's kept values, the real-position mask)."""
    mask = real_mask(tl, tl.to_tokens(PROMPTS, padding_side=padding_side), padding_side)
    logits = xl.run_with_hooks(PROMPTS, fwd_hooks=hooks, padding_side=padding_side)
    ours = dict(kept)
    kept.clear()
    tl_logits = tl.run_with_hooks(PROMPTS, fwd_hooks=hooks, padding_side=padding_side)
    theirs = dict(kept)
    assert max_diff(logits, tl_logits, mask) < tol
    assert max_diff(logits, xl(PROMPTS, padding_side=padding_side), mask) < tol, "a read changed the logits"
    return ours, theirs, mask


def check_read(ours, theirs, mask, tol):
    """A kept value equals TL's at real positions and is far from zero (a read that silently
    returned nothing fails)."""
    assert type(ours) is torch.Tensor and ours.shape == theirs.shape
    bound = cache_bound(theirs, mask, tol)
    assert max_diff(ours, theirs, mask) <= bound
    assert float(theirs[mask].abs().max()) > 50 * bound, "the read value is too small to test anything"


def tl_cached(tl, prompts, name, padding_side="right"):
    """TL's cached activation at `name` for `prompts` and the real-position mask."""
    _, cache = tl.run_with_cache(prompts, names_filter=[name], padding_side=padding_side)
    mask = real_mask(tl, tl.to_tokens(prompts, padding_side=padding_side), padding_side)
    return cache[name], mask


def steering_scale(xl):
    return 0.5 * xl.cfg.d_model ** 0.5


def threshold(scores):
    """A threshold for a gate on these scores (1-D, real positions): the middle of the widest gap
    between neighbouring scores in their middle half, so both branches are taken and no score is
    near it (fp32 noise must not flip a token from one branch to the other)."""
    s = scores.sort().values
    n = s.numel()
    i = max(range(n // 4, (3 * n) // 4), key=lambda j: float(s[j + 1] - s[j]))
    assert float(s[i + 1] - s[i]) > 1e-3
    return float((s[i] + s[i + 1]) / 2)


# --- 1. steering ---------------------------------------------------------------------------------
@pytest.mark.parametrize("model, padding_side", FEW)
def test_steering_addition(model, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    v, c = direction(xl.cfg.d_model, 1), steering_scale(xl)

    def steer(act, hook):
        return act + c * v

    hooks = [("blocks.0.hook_resid_post", steer)]
    assert lowered(xl, hooks) == ["affine_write"]
    check_write(xl, tl, hooks, tolerance(model)[1], padding_side)


# --- 2. head ablation ----------------------------------------------------------------------------
@pytest.mark.parametrize("model, padding_side", FEW)
def test_zero_ablate_head(model, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]

    def ablate(act, hook):  # act: [batch, pos, head, d_head]
        act[:, :, HEAD] = 0.0

    hooks = [("blocks.0.attn.hook_z", ablate)]
    assert lowered(xl, hooks) == ["affine_write"]
    check_write(xl, tl, hooks, tolerance(model)[1], padding_side)


@pytest.mark.parametrize("model, padding_side", EVERY)
def test_ablate_one_batch_row(model, padding_side, served, reference, tolerance):
    """TransformerLens's own tests write one batch element (`z[1, :] = 0`): a constant into some rows."""
    xl, tl = served[model], reference[model]

    def ablate_row(act, hook):  # act: [batch, pos, head, d_head]
        act[1, :] = 0.0
        act[0, :, HEAD] = 0.5

    hooks = [("blocks.0.attn.hook_z", ablate_row)]
    assert lowered(xl, hooks) == ["generated write", "generated write"]  # one per assignment
    check_write(xl, tl, hooks, tolerance(model)[1], padding_side)

    def copy_row(act, hook):
        act[1] = act[0]

    with pytest.raises(Exception, match="batch dim must be taken whole"):
        xl.run_with_hooks(PROMPTS, fwd_hooks=[("blocks.0.hook_resid_post", copy_row)])


@pytest.mark.parametrize("model, padding_side", FEW)
def test_mean_ablate_head(model, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    name = "blocks.0.attn.hook_z"
    z, _ = tl_cached(tl, REFERENCE_BATCH, name)  # equal lengths: no padding in the mean
    mean = z[:, :, HEAD].mean((0, 1))  # [d_head], a constant
    _, ours = xl.run_with_cache(REFERENCE_BATCH, names_filter=[name])
    every = torch.ones(z.shape[:2], dtype=torch.bool)
    assert float((ours[name][:, :, HEAD].mean((0, 1)) - mean).abs().max()) <= cache_bound(z, every, tolerance(model)[1])

    def ablate(act, hook):
        act[:, :, HEAD] = mean

    hooks = [(name, ablate)]
    assert lowered(xl, hooks) == ["affine_write"]
    check_write(xl, tl, hooks, tolerance(model)[1], padding_side)


# --- 3. activation patching ----------------------------------------------------------------------
@pytest.mark.parametrize("model", TINY + ["smollm2"])
def test_activation_patching(model, served, reference, tolerance):
    """Patch one position of a corrupted run with the clean run's residual (right padding: the
    position is a token position, the same in both runs row by row)."""
    xl, tl = served[model], reference[model]
    _, tol = tolerance(model)
    name = "blocks.0.hook_resid_post"
    differ = xl.to_tokens(CLEAN) != xl.to_tokens(CORRUPTED)
    assert differ[:, PATCH_POS].all() and int(differ.sum()) == len(CLEAN), "runs must differ at PATCH_POS only"
    _, clean_cache = tl.run_with_cache(CLEAN, names_filter=[name])
    clean_mask = real_mask(tl, tl.to_tokens(CLEAN), "right")
    _, ours = xl.run_with_cache(CLEAN, names_filter=[name])
    assert max_diff(ours[name], clean_cache[name], clean_mask) <= cache_bound(clean_cache[name], clean_mask, tol)

    def patch(act, hook):
        act[:, PATCH_POS] = clean_cache[name][:, PATCH_POS]

    hooks = [(name, patch)]
    assert lowered(xl, hooks, CORRUPTED) == ["affine_write"]
    check_write(xl, tl, hooks, tol, "right", CORRUPTED)


# --- 4. projecting out a direction ---------------------------------------------------------------
@pytest.mark.parametrize("model, padding_side", EVERY)
def test_project_out_direction(model, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    name = "blocks.0.hook_resid_post"
    act, mask = tl_cached(tl, PROMPTS, name)
    d = act[mask].mean(0)
    d = d / d.norm()  # the mean residual direction: a large component of every token's residual

    def project_out(act, hook):
        return act - (act @ d)[..., None] * d

    hooks = [(name, project_out)]
    assert lowered(xl, hooks) == ["affine_write"]
    check_write(xl, tl, hooks, tolerance(model)[1], padding_side)


# --- 5. clamping ---------------------------------------------------------------------------------
@pytest.mark.parametrize("model, padding_side", EVERY)
def test_clamp_activations(model, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    name = "blocks.0.hook_resid_post"
    act, mask = tl_cached(tl, PROMPTS, name)
    c = float(act[mask].abs().median())  # clips about half of the entries

    def clamp(act, hook):
        return act.clamp(-c, c)

    hooks = [(name, clamp)]
    assert lowered(xl, hooks) == ["generated write"]
    check_write(xl, tl, hooks, tolerance(model)[1], padding_side)


@pytest.mark.parametrize("model, padding_side", EVERY)
def test_clamp_direction_coefficient(model, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    d, c = direction(xl.cfg.d_model, 2), steering_scale(xl)

    def clamp_coefficient(act, hook):  # the component along d set to c, the rest kept
        return act + (c - act @ d)[..., None] * d

    hooks = [("blocks.0.hook_resid_post", clamp_coefficient)]
    assert lowered(xl, hooks) == ["affine_write"]
    check_write(xl, tl, hooks, tolerance(model)[1], padding_side)


# --- 6. probe readout ----------------------------------------------------------------------------
@pytest.mark.parametrize("model, padding_side", FEW)
def test_probe_readout(model, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    _, tol = tolerance(model)
    w = torch.randn(xl.cfg.d_model, generator=torch.Generator().manual_seed(3))  # a linear probe's weights
    kept = {}

    def probe(act, hook):
        kept["score"] = act[:, -1] @ w  # [batch]: the last (padded) position
        kept["scores"] = act @ w  # [batch, pos]
        kept["resid"] = act  # [batch, pos, d_model], as it is
        kept["last"] = act[:, -1]  # [batch, d_model]

    hooks = [("blocks.1.hook_resid_post", probe)]
    # act[:, k] as it is lowers to project_read with an identity W today (gather_rows would do)
    assert sorted(lowered(xl, hooks)) in (["gather_rows", "project_read", "project_read", "project_read"],
                                          ["gather_rows", "gather_rows", "project_read", "project_read"])
    ours, theirs, mask = run_reads(xl, tl, hooks, kept, tol, padding_side)
    last_real = mask[:, -1]  # right padding: only the longest prompt's last position is real
    check_read(ours["score"][:, None], theirs["score"][:, None], last_real[:, None], tol)
    check_read(ours["scores"], theirs["scores"], mask, tol)
    check_read(ours["resid"], theirs["resid"], mask, tol)
    check_read(ours["last"], theirs["last"], last_real, tol)


# --- 7. logit lens -------------------------------------------------------------------------------
def folded_unembedding(xl, tl):
    """TL's unembedding with its final norm's weight (and GPT-2's bias) folded in: what the
    residual's normalized value is multiplied by to give the logits. xmix-lens's engine.W_U / b_U (the
    unembedding of the final norm's output) are TL's W_U / b_U: checked here, then only TL's are used."""
    b = tl.bridge
    params = dict(b.ln_final.named_parameters())
    weight = next(p for n, p in params.items() if n.endswith("weight")).detach()
    bias = next((p for n, p in params.items() if n.endswith("bias")), None)
    W = weight[:, None] * b.W_U.detach()
    b_U = b.b_U.detach() + (0 if bias is None else bias.detach() @ b.W_U.detach())
    assert (b.W_U.detach() - xl.engine.W_U).abs().max() < 1e-5 and (b.b_U.detach() - xl.engine.b_U).abs().max() < 1e-4
    return W, b_U


def lens_columns(d_vocab):
    """1024 vocabulary entries, the same for every run (see test_logit_lens_full_vocabulary)."""
    return torch.randperm(d_vocab, generator=torch.Generator().manual_seed(11))[:1024].sort().values


@pytest.mark.parametrize("model, padding_side", EVERY + [("smollm2", "right")])
def test_logit_lens(model, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    _, tol = tolerance(model)
    W, b_U = folded_unembedding(xl, tl)
    ids = lens_columns(W.shape[1])
    W_lens, b_lens = W[:, ids].contiguous(), b_U[ids].contiguous()
    eps = float(tl.cfg.eps)
    layer_norm = xl.cfg.family == "gpt2"
    kept = {}

    def lens_final(act, hook):  # ln_final.hook_normalized: the unembedding gives the logits
        kept["final"] = act @ W_lens + b_lens

    def lens_resid(act, hook):  # a residual stream read through the unembedding
        kept["raw"] = act @ W_lens
        x = act - act.mean(-1, keepdim=True) if layer_norm else act
        kept["normalized"] = (x * (x.pow(2).mean(-1, keepdim=True) + eps) ** -0.5) @ W_lens + b_lens

    last = f"blocks.{xl.cfg.n_layers - 1}.hook_resid_post"
    hooks = [(last, lens_resid), ("ln_final.hook_normalized", lens_final)]
    assert sorted(lowered(xl, hooks)) == ["generated read", "project_read", "project_read"]
    ours, theirs, mask = run_reads(xl, tl, hooks, kept, tol, padding_side)
    for key in ("final", "raw", "normalized"):
        check_read(ours[key], theirs[key], mask, tol)
    # both lenses at the end of the stack are TL's logits; the raw lens is TL's cached residual @ W
    tl_logits = tl.run_with_hooks(PROMPTS, padding_side=padding_side)[..., ids]
    assert max_diff(ours["final"], tl_logits, mask) < tol
    assert max_diff(ours["normalized"], tl_logits, mask) < tol
    resid, _ = tl_cached(tl, PROMPTS, last, padding_side)
    assert max_diff(ours["raw"], resid @ W_lens, mask) <= cache_bound(theirs["raw"], mask, tol)


@pytest.mark.parametrize("model", TINY)
def test_logit_lens_full_vocabulary(model, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    _, tol = tolerance(model)
    W, b_U = folded_unembedding(xl, tl)
    kept = {}

    def lens(act, hook):
        kept["final"] = act @ W + b_U

    ours, theirs, mask = run_reads(xl, tl, [("ln_final.hook_normalized", lens)], kept, tol, "right")
    check_read(ours["final"], theirs["final"], mask, tol)


# --- 8. head-output scaling ----------------------------------------------------------------------
@pytest.mark.parametrize("model, padding_side", EVERY)
def test_scale_head_output(model, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]

    def scale_head(act, hook):
        act[:, :, HEAD] *= 3.0

    hooks = [("blocks.0.attn.hook_z", scale_head)]
    assert lowered(xl, hooks) == ["affine_write"]
    check_write(xl, tl, hooks, tolerance(model)[1], padding_side)


# --- 9. SAE feature clamp ------------------------------------------------------------------------
def small_sae(d_model, n_features=64, seed=5):
    """A random SAE with unit-norm decoder rows: W_enc [d, 64], b_enc [64], W_dec [64, d], b_dec [d]."""
    g = torch.Generator().manual_seed(seed)
    W_enc = torch.randn(d_model, n_features, generator=g) / d_model ** 0.5
    b_enc = 0.1 * torch.randn(n_features, generator=g)
    W_dec = torch.randn(n_features, d_model, generator=g)
    W_dec = W_dec / W_dec.norm(dim=-1, keepdim=True)
    b_dec = 0.1 * torch.randn(d_model, generator=g)
    return W_enc, b_enc, W_dec, b_dec


SAE_FEATURE = 7


@pytest.mark.parametrize("model, padding_side", FEW)
def test_sae_feature_clamp(model, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    W_enc, b_enc, W_dec, b_dec = small_sae(xl.cfg.d_model)
    i, c = SAE_FEATURE, steering_scale(xl)

    def clamp_feature(act, hook):
        f = torch.relu((act - b_dec) @ W_enc + b_enc)
        return act + (c - f[..., i])[..., None] * W_dec[i]

    hooks = [("blocks.0.hook_resid_post", clamp_feature)]
    assert lowered(xl, hooks) == ["generated write"]
    check_write(xl, tl, hooks, tolerance(model)[1], padding_side)


@pytest.mark.parametrize("model, padding_side", FEW)
def test_sae_feature_clamp_keepdim(model, padding_side, served, reference, tolerance):
    """The same clamp with the feature taken as a slice (f[..., i:i+1]), which lowers today."""
    xl, tl = served[model], reference[model]
    W_enc, b_enc, W_dec, b_dec = small_sae(xl.cfg.d_model)
    i, c = SAE_FEATURE, steering_scale(xl)

    def clamp_feature(act, hook):
        f = torch.relu((act - b_dec) @ W_enc + b_enc)
        return act + (c - f[..., i:i + 1]) * W_dec[i]

    hooks = [("blocks.0.hook_resid_post", clamp_feature)]
    assert lowered(xl, hooks) == ["generated write"]
    check_write(xl, tl, hooks, tolerance(model)[1], padding_side)


# --- 10. gated writes ----------------------------------------------------------------------------
def gate_vectors(xl, tl, name, padding_side):
    """(w, t, v): a probe direction, a threshold that splits this batch's real tokens with a margin,
    and a steering vector."""
    w = direction(xl.cfg.d_model, 3)
    act, mask = tl_cached(tl, PROMPTS, name, padding_side)
    return w, threshold((act @ w)[mask]), steering_scale(xl) * direction(xl.cfg.d_model, 1)


@pytest.mark.parametrize("model, padding_side", FEW)
def test_gated_write_on_probe(model, padding_side, served, reference, tolerance):
    xl, tl = served[model], reference[model]
    name = "blocks.0.hook_resid_post"
    w, t, v = gate_vectors(xl, tl, name, padding_side)

    def gated(act, hook):
        return torch.where((act @ w)[..., None] > t, act + v, act)

    hooks = [(name, gated)]
    assert lowered(xl, hooks) == ["generated write"]
    check_write(xl, tl, hooks, tolerance(model)[1], padding_side)


def cross_layer_dict_hooks(w, t, v):
    """The TL way to carry a value from one hook to a later one: a dict both functions close over."""
    ctx = {}

    def probe(act, hook):
        ctx["score"] = act @ w

    def gated(act, hook):
        return torch.where(ctx["score"][..., None] > t, act + v, act)

    return [("blocks.0.hook_resid_post", probe), ("blocks.1.hook_attn_out", gated)]


@pytest.mark.parametrize("model, padding_side", EVERY)
def test_gated_write_across_layers(model, padding_side, served, reference, tolerance):
    """The probe at layer 0 (store.put), the gated write at layer 1 (store.get); TL runs the same
    pair written with a dict."""
    xl, tl = served[model], reference[model]
    w, t, v = gate_vectors(xl, tl, "blocks.0.hook_resid_post", padding_side)

    def probe(act, hook):
        store.put("score", act @ w)

    def gated(act, hook):
        return torch.where(store.get("score")[..., None] > t, act + v, act)

    hooks = [("blocks.0.hook_resid_post", probe), ("blocks.1.hook_attn_out", gated)]
    assert lowered(xl, hooks) == ["project_read", "generated write"]
    assert "-> store 'score'" in xl.explain(PROMPTS, fwd_hooks=hooks)
    check_write(xl, tl, hooks, tolerance(model)[1], padding_side, tl_hooks=cross_layer_dict_hooks(w, t, v))


@pytest.mark.parametrize("model", TINY)
def test_gated_write_across_layers_dict(model, served, reference, tolerance):
    """The same pair written the TL way (a dict), run by xmix-lens as it is."""
    xl, tl = served[model], reference[model]
    w, t, v = gate_vectors(xl, tl, "blocks.0.hook_resid_post", "right")
    check_write(xl, tl, cross_layer_dict_hooks(w, t, v), tolerance(model)[1])


# --- residual writes' numerics -----------------------------------------------------------------
def _gap(a, b):
    return float((a.float() - b.float()).abs().max())


def test_clamped_residual_differs_as_transformer_lens_itself_would(served, reference):
    """An in-place clamp at SmolLM2's blocks.9.hook_resid_mid (fp32) moves the logits from TL's by about
    ten times the unhooked difference. That is TL's own sensitivity, not the write: TL's logits move
    as much when its own resid_mid is first moved by the unhooked difference of xmix-lens's from TL's
    there (fp32 sums in another order) and then clamped. The clamp shrinks the outlier dimensions, so
    the norm after it divides that absolute error by a far smaller RMS. Asserted: xmix-lens's
    difference is at most twice TL's own movement under that input difference."""
    xl, tl = served["smollm2"], reference["smollm2"]
    name = "blocks.9.hook_resid_mid"
    tokens = xl.to_tokens(PROMPTS[:1])
    _, ours = xl.run_with_cache(tokens, names_filter=[name])
    kept = {}

    def keep(act, hook):
        kept["act"] = act.detach().clone()

    tl.run_with_hooks(tokens, fwd_hooks=[(name, keep)])
    delta = ours[name] - kept["act"]  # the unhooked difference at the point

    def clamp(act, hook):
        act.clamp_(-2, 2)
        return act

    def moved_then_clamped(act, hook):
        act.add_(delta).clamp_(-2, 2)
        return act

    tl_clamped = tl.run_with_hooks(tokens, fwd_hooks=[(name, clamp)])
    ours_vs_tl = _gap(xl.run_with_hooks(tokens, fwd_hooks=[(name, clamp)]), tl_clamped)
    tl_own = _gap(tl.run_with_hooks(tokens, fwd_hooks=[(name, moved_then_clamped)]), tl_clamped)
    unhooked = _gap(xl(tokens), tl.run_with_hooks(tokens))
    assert ours_vs_tl > 3 * unhooked  # the amplification this test explains is there
    assert ours_vs_tl <= 2 * tl_own
