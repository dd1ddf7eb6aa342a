"""Bad input fails before any work starts, with an error that names the problem, the valid form and
the fix, and leaves the engine usable: after each refused call, a plain call gives the very logits
it gave before. One test per input that used to give a confusing message (or none)."""
import numpy as np
import pytest
import torch

from compat_tests.compare import max_diff, real_mask, tolerance  # noqa: F401 (fixture)
# usable: after each test, a plain call gives the logits it gave before, and no hook is left behind
from tests.test_hooks_api import MODEL, PROMPT, model, usable  # noqa: F401 (fixtures)
from xmix_lens import App, TraceError

PROMPTS = ["The capital of France is", "Hello"]
SITE = "blocks.0.hook_resid_post"


def test_empty_input(usable):
    with pytest.raises(ValueError, match=r"input is empty \(\[\]\).*at least one prompt.*a list of strings"):
        usable([])
    with pytest.raises(ValueError, match="input is empty"):
        usable.to_tokens([])


def test_token_tensor_without_rows_or_positions(usable):
    for empty in (torch.zeros(0, 4, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)):
        with pytest.raises(ValueError, match=rf"tokens must be \[batch, pos\] with batch >= 1 and pos >= 1, "
                                             rf"got \[{empty.shape[0]}, {empty.shape[1]}\]"):
            usable(empty)


def test_none_input(usable):
    with pytest.raises(TypeError, match=r"input is None; pass a string, a list of strings"):
        usable(None)
    with pytest.raises(TypeError, match="input is None"):
        usable.generate(None, max_new_tokens=1)


def test_list_mixing_strings_and_other_items(usable):
    with pytest.raises(TypeError, match=r"input mixes strings and other items: item 1 is int 5.*model.to_tokens"):
        usable(["hello", 5])


def test_attention_mask_of_another_shape(usable):
    tokens = usable.to_tokens(PROMPTS)
    for mask in (torch.ones(tokens.shape[0], tokens.shape[1] - 1, dtype=torch.long), torch.ones(tokens.shape[1])):
        with pytest.raises(ValueError, match=rf"attention_mask has shape {list(mask.shape)}, but the tokens are "
                                             rf"{list(tokens.shape)}".replace("[", r"\[").replace("]", r"\]")):
            usable(tokens, attention_mask=mask)
    # the right shape still works, as does a 1-D mask of a 1-D row
    assert torch.equal(usable(tokens, attention_mask=torch.ones_like(tokens)), usable(tokens))
    assert torch.equal(usable(tokens[0], attention_mask=torch.ones(tokens.shape[1])), usable(tokens[:1]))


def test_attention_mask_of_an_empty_row(usable):
    tokens = usable.to_tokens(PROMPTS)
    empty = torch.ones_like(tokens)
    empty[1] = 0  # a row with no real token
    with pytest.raises(ValueError, match="row 1: the attention mask marks no real token"):
        usable(tokens, attention_mask=empty)
    # left padding: row 1 alone, shifted, gives its own logits
    left = torch.ones_like(tokens)
    left[1, 0] = 0
    shifted = usable(tokens, attention_mask=left)
    assert torch.allclose(shifted[1, 1:], usable(tokens[1:, 1:])[0], atol=1e-4)


def test_hook_with_an_integer_tensor(usable):
    v = torch.arange(usable.cfg.d_model)  # int64

    def add(act, hook):
        return act + v

    with pytest.raises(TraceError, match=rf"act \+ v[\s\S]*a torch.int64 tensor of shape \[{usable.cfg.d_model}\]"
                                         rf"[\s\S]*v\.float\(\)"):
        usable.run_with_hooks(PROMPT, fwd_hooks=[(SITE, add)])


def test_hook_with_a_numpy_array(usable):
    def add(act, hook):
        return act + np.ones(usable.cfg.d_model)

    with pytest.raises(TraceError, match=r"np.ones[\s\S]*a numpy array[\s\S]*torch.as_tensor\(array"):
        usable.run_with_hooks(PROMPT, fwd_hooks=[(SITE, add)])


def test_hook_returning_a_new_tensor_replaces_act_as_in_transformer_lens(usable, reference, tolerance):
    tl = reference[MODEL]
    _, tol = tolerance(MODEL)
    tokens = usable.to_tokens(PROMPTS)
    fixed = torch.randn(tokens.shape + (usable.cfg.d_model,), generator=torch.Generator().manual_seed(0))

    def replace(act, hook):
        return torch.zeros(act.shape) + fixed  # made without act: act becomes this value

    ours = usable.run_with_hooks(tokens, fwd_hooks=[(SITE, replace)])
    theirs = tl.run_with_hooks(tokens, fwd_hooks=[(SITE, replace)])
    mask = real_mask(tl, tokens, "right")
    assert max_diff(ours, theirs, mask) < tol
    assert max_diff(ours, usable(tokens), mask) > 50 * tol  # the hook did something
    # a tensor of another shape is still refused, with a message that says what was returned
    with pytest.raises(TraceError, match=r"returned a tensor of shape \[3\]; a hook returns None or a tensor of "
                                         rf"act's shape \[1, \d+, {usable.cfg.d_model}\]"):
        usable.run_with_hooks(PROMPT, fwd_hooks=[(SITE, lambda act, hook: torch.zeros(3))])


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyError("missing")])
def test_installed_app_whose_hook_raises(usable, error):
    def broken(act, hook):
        raise error

    app = App("broken", [(SITE, broken)], params={"v": torch.zeros(usable.cfg.d_model)})
    with pytest.raises(ValueError, match=rf"app 'broken': its hook function 'broken' on {SITE} raised "
                                         rf"{type(error).__name__}") as info:
        usable.install(app)
    assert info.value.__cause__ is error
    assert "sizes" not in str(info.value)
    assert "broken" not in usable.apps
    # in a forward call the hook's own exception comes through, noting the hook and hook point
    with pytest.raises(type(error)) as info:
        usable.run_with_hooks(PROMPT, fwd_hooks=[(SITE, broken)])
    assert info.value is error and f"hook function 'broken' on {SITE}" in "".join(error.__notes__)


def test_layer_out_of_range(usable):
    n = usable.cfg.n_layers
    with pytest.raises(ValueError, match=rf"layer {n} is out of range: this model has {n} layers, "
                                         rf"blocks.0 … blocks.{n - 1}"):
        usable.run_with_hooks(PROMPT, fwd_hooks=[(f"blocks.{n}.hook_resid_post", lambda act, hook: None)])


def test_padding_side_other_than_left_or_right(usable):
    tokens = usable.to_tokens(PROMPTS)
    calls = [lambda: usable(PROMPTS, padding_side="middle"), lambda: usable(tokens, padding_side="middle"),
             lambda: usable.to_tokens(PROMPTS, padding_side="middle"),
             lambda: usable.to_str_tokens(PROMPT, padding_side="middle"),
             lambda: usable.to_str_tokens(tokens[:1], padding_side="middle"),
             lambda: usable.generate(PROMPTS, max_new_tokens=1, padding_side="middle")]
    for call in calls:
        with pytest.raises(ValueError, match=r"padding_side 'middle': use 'left' or 'right'"):
            call()


def test_non_integer_token_ids(usable):
    for tokens, dtype in [(torch.tensor([[1.0, 2.0]]), "torch.float32"), (torch.tensor([[True, False]]), "torch.bool"),
                          ([[1.0, 2.0]], "torch.float32")]:
        with pytest.raises(TypeError, match=rf"token ids are integers, got {dtype}.*\.long\(\)"):
            usable(tokens)
    assert torch.equal(usable(torch.tensor([[1, 2]], dtype=torch.int32)), usable(torch.tensor([[1, 2]])))


def test_to_tokens_truncates_at_the_engines_max_model_len(usable, monkeypatch):
    limit = usable.engine.max_model_len
    # SmolLM2's cfg.n_ctx (8192) is above its default engine's max_model_len (2048)
    monkeypatch.setattr(usable.cfg, "n_ctx", 4 * limit)
    long_text = "one two three " * limit
    assert usable.to_tokens(long_text).shape[1] == limit
    assert usable.to_tokens(long_text, truncate=False).shape[1] > limit
