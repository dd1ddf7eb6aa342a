"""TransformerLens habits from its utilities and generate: `from xmix_lens import utils` offers
TransformerLens's functions under their names, and they work on a served model as on TransformerLens's
own (the reference bridge on the same weights); generate takes TransformerLens's `use_past_kv_cache`.

`test_prompt` is reached as `utils.test_prompt` only: a module-level name starting with "test"
would be collected by pytest."""
import contextlib
import io
import re

import numpy as np
import pytest
import torch
import transformer_lens.utilities as tl_utils

from compat_tests.compare import PROMPTS, direction, real_mask
from compat_tests.compare import tolerance  # noqa: F401  (a fixture)


def test_both_import_spellings_give_transformer_lens_utilities():
    import xmix_lens
    import xmix_lens.utils
    from xmix_lens import utils

    assert utils is xmix_lens.utils
    for name in ("get_act_name", "test_prompt", "to_numpy", "lm_cross_entropy_loss", "tokenize_and_concatenate",
                 "get_corner", "remove_batch_dim", "Slice", "gelu_new"):
        assert getattr(utils, name) is getattr(tl_utils, name), name
        assert name in utils.__all__
    assert "tokenize_utils" not in utils.__all__  # a submodule of TL's package, not a utility


ACT_NAMES = [("embed",), ("resid_pre", 0), ("resid_post", 1), ("k", 0, "a"), ("k6",), ("pattern", 1), ("attn", 0),
             ("attn_scores", 1), ("z", 0), ("pre", 1), ("mlp_post", 0), ("post", 1), ("scale", 0, "ln1"),
             ("normalized", 1, "ln2"), ("scale",), ("mlp_out", 0), ("attn_out", 1), ("blocks.0.hook_resid_mid",)]


@pytest.mark.parametrize("args", ACT_NAMES, ids=lambda a: "-".join(map(str, a)))
def test_get_act_name_as_transformer_lens(args):
    from xmix_lens import utils

    assert utils.get_act_name(*args) == tl_utils.get_act_name(*args)


def test_act_names_are_hook_points_of_both_models(served, reference):
    """The names get_act_name makes for a two-layer model name hook points ours and TL's both have."""
    from xmix_lens import utils

    xl, tl = served["tiny-llama"], reference["tiny-llama"]
    names = [utils.get_act_name(*a) for a in ACT_NAMES if "k6" not in a]
    assert [n for n in names if n in tl.hook_dict] == names  # the premise: TL has them all
    assert [n for n in names if n not in xl.hook_dict] == []


def test_to_numpy_on_our_tensors_as_on_transformer_lens(served, reference, tolerance):
    from xmix_lens import utils

    xl, tl = served["tiny-llama"], reference["tiny-llama"]
    tokens = xl.to_tokens(PROMPTS)
    mask = real_mask(tl, tokens, "right").numpy()
    tol = tolerance("tiny-llama")[1]
    name = utils.get_act_name("resid_post", 0)
    ours_logits, ours_cache = xl.run_with_cache(tokens, names_filter=[name])
    theirs_logits, theirs_cache = tl.run_with_cache(tokens, names_filter=[name])
    for ours, theirs in [(ours_logits, theirs_logits), (ours_cache[name], theirs_cache[name])]:
        a, b = utils.to_numpy(ours), tl_utils.to_numpy(theirs)
        assert isinstance(a, np.ndarray) and a.shape == b.shape and a.dtype == b.dtype
        assert np.abs(a - b)[mask].max() <= tol
    w = utils.to_numpy(xl.W_U)  # a weight (TL's surface over the served weights)
    assert isinstance(w, np.ndarray) and np.array_equal(w, tl_utils.to_numpy(tl.bridge.W_U))


# ---- test_prompt: what it prints for our model and for TransformerLens's, on SmolLM2 ----

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def printed(model, *args, **kwargs) -> str:
    from xmix_lens import utils

    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # test_prompt prints (print and rich's print), returns None
        assert utils.test_prompt(*args, model, **kwargs) is None
    return out.getvalue()


def assert_same_report(ours: str, theirs: str, places: float = 0.01):
    """The same lines (prompt, answer and top tokens, ranks); printed numbers (logits, probabilities,
    rounded to 2 places) within a rounding step of each other, integers (ranks) equal."""
    assert NUMBER.sub("#", ours) == NUMBER.sub("#", theirs), f"ours:\n{ours}\nTransformerLens's:\n{theirs}"
    a, b = NUMBER.findall(ours), NUMBER.findall(theirs)
    for x, y in zip(a, b):
        if "." in x or "." in y:
            assert abs(float(x) - float(y)) <= places + 1e-9, (x, y)
        else:
            assert x == y, f"{x} != {y} in\n{ours}\nTransformerLens's:\n{theirs}"


@pytest.mark.parametrize("prompt, answer", [
    ("The capital of France is", "Paris"),  # one answer of one token
    ("One two three", "four five"),  # one answer of two tokens: a report per token
    ("The cat sat on the", ["mat", "floor", "dog"]),  # several one-token answers
])
def test_test_prompt_prints_as_transformer_lens(served, reference, prompt, answer):
    xl, tl = served["smollm2"], reference["smollm2"]
    ours, theirs = printed(xl, prompt, answer), printed(tl.bridge, prompt, answer)
    assert "Ranks of the answer tokens" in ours and "Top 9th token" in ours
    assert_same_report(ours, theirs)


def test_test_prompt_options_and_hooks_as_transformer_lens(served, reference):
    """prepend_bos, prepend_space_to_answer and top_k pass through; a steering hook added in
    `hooks()` reaches test_prompt's forward pass in both, and changes what it prints."""
    xl, tl = served["smollm2"], reference["smollm2"]
    args = ("The capital of France is", " Paris")
    kwargs = dict(prepend_bos=False, prepend_space_to_answer=False, top_k=3)
    plain = printed(xl, *args, **kwargs)
    assert_same_report(plain, printed(tl.bridge, *args, **kwargs))
    assert "Top 2th token" in plain and "Top 3th token" not in plain

    from xmix_lens import utils

    v = 20.0 * direction(xl.cfg.d_model, 11)
    hooks = [(utils.get_act_name("resid_post", 20), lambda act, hook: act + v)]
    with xl.hooks(fwd_hooks=hooks):
        ours = printed(xl, *args, **kwargs)
    with tl.bridge.hooks(fwd_hooks=hooks):
        theirs = printed(tl.bridge, *args, **kwargs)
    assert ours != plain, "the steering hook must change the report, or this shows nothing"
    assert_same_report(ours, theirs)


# ---- generate(use_past_kv_cache=...) ----

GEN_PROMPTS = ["The cat sat on the mat", "One two three four five six"]  # equal lengths, as in tests/test_generate.py
NEW = 6


@pytest.mark.parametrize("steer", [False, True], ids=["unhooked", "steered"])
def test_generate_use_past_kv_cache_as_transformer_lens(served, reference, steer):
    """Either value gives the tokens of a call without it, and TransformerLens's greedy tokens (the
    hook is position-independent).

    TransformerLens's reference runs without its KV cache, as in tests/test_generate.py: with it,
    TransformerLens 4.3 under the transformers installed here (5.24) generates other tokens than
    without it, on both tiny models and SmolLM2: the cache its bridge hands back after the prompt
    holds no positions, so each new token is computed without its context. Hugging Face's own
    cached generate on the same weights is the oracle for the cached case below."""
    xl, tl = served["tiny-llama"], reference["tiny-llama"]
    v = 6.0 * direction(xl.cfg.d_model, 3)
    hooks = [("blocks.0.hook_resid_post", lambda act, hook: act + v)] if steer else []
    kwargs = dict(max_new_tokens=NEW, do_sample=False, return_type="tokens", fwd_hooks=hooks)
    plain = xl.generate(GEN_PROMPTS, **kwargs)
    assert plain.shape == (2, xl.to_tokens(GEN_PROMPTS).shape[1] + NEW)
    for cached in (True, False):
        assert torch.equal(xl.generate(GEN_PROMPTS, use_past_kv_cache=cached, **kwargs), plain), cached
    with tl.bridge.hooks(fwd_hooks=hooks):
        theirs = tl.bridge.generate(xl.to_tokens(GEN_PROMPTS), max_new_tokens=NEW, do_sample=False,
                                    use_past_kv_cache=False, stop_at_eos=False, verbose=False)
    assert torch.equal(plain, theirs)
    text = xl.generate("The cat sat", max_new_tokens=3, do_sample=False, use_past_kv_cache=True)
    assert text == xl.generate("The cat sat", max_new_tokens=3, do_sample=False)


def test_generate_with_kv_cache_as_hugging_face_cached_generate(served):
    from transformers import AutoModelForCausalLM

    from conftest import MODEL_DIRS

    xl = served["tiny-llama"]
    tokens = xl.to_tokens(GEN_PROMPTS)
    hf = AutoModelForCausalLM.from_pretrained(str(MODEL_DIRS["tiny-llama"]()), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, use_cache=True)
    ours = xl.generate(GEN_PROMPTS, max_new_tokens=NEW, do_sample=False, return_type="tokens", use_past_kv_cache=True)
    assert torch.equal(ours, theirs)
