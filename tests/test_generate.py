"""generate() with hooks on the prompt and on every generated token (KV-cache semantics).

References: TransformerLens's generate without its KV cache (it recomputes the whole sequence each
step) for position-independent hooks; for hooks that depend on positions, TransformerLens's
run_with_hooks over the final sequence, teacher-forced, with the hook applied where our hooks ran."""
import pytest
import torch

from xmix_lens import store

MODEL = "tiny-llama"
PROMPTS = ["The cat sat on the mat", "One two three four five six"]  # equal lengths (6 tokens + BOS)
NEW = 6


@pytest.fixture
def pair(served, reference):
    return served[MODEL], reference[MODEL]


def unit(d_model, seed):
    v = torch.randn(d_model, generator=torch.Generator().manual_seed(seed))
    return v / v.norm()


def greedy_under_teacher_forcing(tl, tokens: torch.Tensor, prompt_len: int, fwd_hooks) -> torch.Tensor:
    """The greedy choice at every generated position of `tokens`, by TL with the hooks."""
    logits = tl.run_with_hooks(tokens, fwd_hooks=fwd_hooks)
    return logits[:, prompt_len - 1: -1].argmax(-1)


def test_unhooked_greedy_matches_transformer_lens(pair):
    xl, tl = pair
    ours = xl.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, return_type="tokens")
    theirs = tl.bridge.generate(xl.to_tokens(PROMPTS), max_new_tokens=NEW, do_sample=False, use_past_kv_cache=False,
                                stop_at_eos=False, verbose=False)
    assert torch.equal(ours, theirs)


def test_position_independent_steering_matches_transformer_lens_generate(pair):
    xl, tl = pair
    v = 6.0 * unit(xl.cfg.d_model, 3)

    def steer(act, hook):
        return act + v

    hooks = [("blocks.0.hook_resid_post", steer)]
    ours = xl.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, return_type="tokens", fwd_hooks=hooks)
    with tl.bridge.hooks(fwd_hooks=hooks):
        theirs = tl.bridge.generate(xl.to_tokens(PROMPTS), max_new_tokens=NEW, do_sample=False,
                                    use_past_kv_cache=False, stop_at_eos=False, verbose=False)
    unhooked = xl.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, return_type="tokens")
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, unhooked)


def test_newest_token_hook_matches_teacher_forced_reference(pair):
    """act[:, -1] is the newest token of each forward: the last prompt token, then each new one."""
    xl, tl = pair
    v = 8.0 * unit(xl.cfg.d_model, 4)
    calls = []

    def last(act, hook):
        calls.append(act.shape[1])
        act[:, -1] = act[:, -1] + v

    ours = xl.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, return_type="tokens",
                       fwd_hooks=[("blocks.1.hook_resid_pre", last)])
    prompt_len = xl.to_tokens(PROMPTS).shape[1]
    assert calls == [prompt_len, 1]  # traced once for the prompt, once for generated tokens

    def reference_hook(act, hook):  # v at the last prompt position and at every generated one
        act[:, prompt_len - 1:] = act[:, prompt_len - 1:] + v

    expected = greedy_under_teacher_forcing(tl, ours, prompt_len, [("blocks.1.hook_resid_pre", reference_hook)])
    assert torch.equal(ours[:, prompt_len:], expected)
    unhooked = xl.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, return_type="tokens")
    assert not torch.equal(ours, unhooked)


def test_prompt_level_condition_gates_every_generated_token(pair):
    xl, tl = pair
    w, v = unit(xl.cfg.d_model, 5), 8.0 * unit(xl.cfg.d_model, 6)
    prompt_len = xl.to_tokens(PROMPTS).shape[1]
    probe_values = {}

    def probe(act, hook):
        store.put("cond", act @ w, reduce="mean")

    def gate(act, hook):
        return act + (store.get("cond") > 0.0)[..., None] * v

    hooks = [("blocks.0.hook_resid_post", probe), ("blocks.1.hook_resid_pre", gate)]
    ours = xl.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, return_type="tokens", fwd_hooks=hooks)

    def tl_probe(act, hook):  # the condition: mean over the prompt's positions only
        probe_values["cond"] = (act[:, :prompt_len] @ w).mean(1)

    def tl_gate(act, hook):
        return act + (probe_values["cond"] > 0.0)[:, None, None] * v

    expected = greedy_under_teacher_forcing(tl, ours, prompt_len, [("blocks.0.hook_resid_post", tl_probe),
                                                                  ("blocks.1.hook_resid_pre", tl_gate)])
    assert torch.equal(ours[:, prompt_len:], expected)
    gated = probe_values["cond"] > 0.0
    assert gated.any(), "the condition must hold for some prompt, or the test shows nothing"
    unhooked = xl.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, return_type="tokens")
    assert not torch.equal(ours[gated], unhooked[gated])
    assert torch.equal(ours[~gated], unhooked[~gated])  # rows whose condition fails are untouched


def test_generate_returns_text_for_text(pair):
    xl, _ = pair
    text = xl.generate("The cat sat", max_new_tokens=3, do_sample=False)
    assert isinstance(text, str) and "The cat sat" in text
    with pytest.raises(ValueError, match="max_model_len"):
        xl.generate("The cat sat", max_new_tokens=10_000)


def test_output_logits_are_transformer_lens_step_logits(pair):
    """generate(output_logits=True): TransformerLens's GenerateDecoderOnlyOutput, its sequences and one
    [batch, d_vocab] logits per new token, the ones TransformerLens's generate sampled from."""
    xl, tl = pair
    tokens = xl.to_tokens(PROMPTS)
    ours = xl.generate(tokens, max_new_tokens=NEW, do_sample=False, output_logits=True)
    theirs = tl.bridge.generate(tokens.cpu(), max_new_tokens=NEW, do_sample=False, stop_at_eos=False, verbose=False,
                                output_logits=True, use_past_kv_cache=False)
    assert torch.equal(ours.sequences.cpu(), theirs.sequences)
    assert len(ours.logits) == len(theirs.logits) == NEW
    for got, expected in zip(ours.logits, theirs.logits):
        assert got.shape == expected.shape
        assert torch.allclose(got.cpu().float(), expected.float(), atol=1e-4)


def test_output_logits_refused_where_hooks_change_the_pass(pair):
    xl, _ = pair
    with pytest.raises(ValueError, match="output_logits works in generate only when nothing else changes"):
        xl.generate(PROMPTS, max_new_tokens=2, output_logits=True,
                    fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act * 2)])


def test_one_row_decodes_to_one_string_as_transformer_lens(pair):
    xl, tl = pair
    tokens = xl.to_tokens(PROMPTS[:1])
    ours = xl.generate(tokens, max_new_tokens=3, do_sample=False, return_type="str")
    theirs = tl.bridge.generate(tokens.cpu(), max_new_tokens=3, do_sample=False, stop_at_eos=False, verbose=False,
                                return_type="str", use_past_kv_cache=False)
    assert isinstance(ours, str) and ours == theirs
    assert isinstance(xl.generate(PROMPTS[:1], max_new_tokens=2, do_sample=False), str)


def test_generate_from_input_embeddings_as_transformer_lens(pair):
    """Input embeddings are the prompt (written at hook_embed); only the new tokens come back."""
    xl, tl = pair
    tokens = xl.to_tokens(PROMPTS)
    embeds = tl.bridge.W_E[tokens.cpu()]
    ours = xl.generate(embeds, max_new_tokens=4, do_sample=False)
    theirs = tl.bridge.generate(embeds, max_new_tokens=4, do_sample=False, stop_at_eos=False, verbose=False,
                                use_past_kv_cache=False)
    assert torch.equal(ours.cpu(), theirs)
    from_tokens = xl.generate(tokens, max_new_tokens=4, do_sample=False, return_type="tokens")
    assert torch.equal(ours.cpu(), from_tokens[:, tokens.shape[1]:].cpu())
    logits = xl.generate(embeds, max_new_tokens=2, do_sample=False, output_logits=True).logits
    assert torch.equal(torch.stack(logits, 1).argmax(-1).cpu(), ours[:, :2].cpu())
    with pytest.raises(ValueError, match="d_model"):
        xl.generate(embeds[..., :3], max_new_tokens=2)


def _plans_run(xl, monkeypatch) -> list:
    """The pass plans of each engine run from now on, recorded."""
    seen, run = [], xl.engine.run

    def recording(plans, *args, **kwargs):
        seen.append(plans)
        return run(plans, *args, **kwargs)

    monkeypatch.setattr(xl.engine, "run", recording)
    return seen


def test_per_token_hooks_run_as_a_resident_app_that_only_the_call_selects(pair, monkeypatch):
    """generate's per-token writes become a resident app (resident_calls.py), selected by the call's
    rows alone; a later call of the same structure takes its values in place; the tokens are those of
    the host-planned path, and a plain generate beside it is unchanged."""
    xl, _ = pair
    calls = xl.planner.resident_calls
    plans = _plans_run(xl, monkeypatch)

    def steering(v):
        return [("blocks.1.hook_resid_mid", lambda act, hook: act * 0.5 + v)]

    first, second = (6.0 * unit(xl.cfg.d_model, s) for s in (5, 6))
    ours, digests = [], []
    for v in (first, second):
        ours.append(xl.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, return_type="tokens",
                                fwd_hooks=steering(v)))
        digests.append(xl.engine.installed[plans[-1][0].apps[0][0]].digest)
    (a,), (b,) = plans
    assert a.prompt.ops == {} and a.decode.ops == {} and a.apps == [a.apps[0]] * len(PROMPTS)
    assert b.apps == a.apps and a.apps[0][0] in calls.kept  # one app, its values set again
    assert digests[0] != digests[1]  # so the prefix cache never serves one call's KV to the other
    calls.enabled = False
    try:
        host = [xl.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, return_type="tokens", fwd_hooks=steering(v))
                for v in (first, second)]
    finally:
        calls.enabled = True
    assert plans[-1][0].prompt.ops and plans[-1][0].apps is None
    assert torch.equal(ours[0], host[0]) and torch.equal(ours[1], host[1])
    assert not torch.equal(ours[0], ours[1])
    plain = xl.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, return_type="tokens")
    unhooked = xl.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, return_type="tokens", apps=[[], []])
    assert torch.equal(plain, unhooked) and not torch.equal(plain, ours[0])


def _newest_only(v):
    def steer(act, hook):
        act[:, -1] += v

    return steer


@pytest.mark.parametrize("hook", [
    _newest_only,  # one position
    lambda v: lambda act, hook: act / (act.norm(dim=-1, keepdim=True) - 1.0) + v,  # could divide by zero
])
def test_hooks_that_are_not_per_token_or_could_write_nan_stay_host_planned(pair, monkeypatch, hook):
    xl, _ = pair
    plans = _plans_run(xl, monkeypatch)
    xl.generate(PROMPTS, max_new_tokens=2, do_sample=False, fwd_hooks=[("blocks.0.hook_resid_post",
                                                                        hook(unit(xl.cfg.d_model, 7)))])
    ((plan,),) = plans
    assert plan.apps is None and plan.prompt.ops
