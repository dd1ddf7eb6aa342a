"""TransformerLens's tokenization-method tests, run against xmix-lens.

Source: TransformerLensOrg/TransformerLens, tests/unit/test_tokenization_methods.py (the stored version the
code index holds; it tests `HookedTransformer`). Every case keeps its TL name and asserts the same
behaviour; the code is written anew for xmix-lens.

Changes from the original:
* Model: TL loads the hub model "solu-1l" and asserts token ids of its tokenizer. Here every case runs
  on the session's tiny Llama and tiny GPT-2 engines, and the expected ids and strings are what
  TransformerLens's bridge gives on the same folder (`reference`), for the same strings.
* test_set_tokenizer_during_initialization: the tokenizer is the folder's (TL checks solu-1l's name).
* test_set_tokenizer_lazy is not ported: it builds a weightless HookedTransformer from a config and
  gives it a tokenizer later; an xmix-lens model is a vLLM engine serving a checkpoint folder, so there
  is no model without weights to give one to (from_pretrained(tokenizer=...) is the way in:
  test_tl_loader_options.py).
* test_to_tokens_truncate: the engine's limit is its max_model_len (256 for the session engines), which
  to_tokens truncates to (TL: n_ctx, 1024 for solu-1l).
* test_to_single_token / test_to_single_str_token: a word that is one token in each tokenizer.
"""
import pytest
import torch
from torch import equal

MODELS = ["tiny-llama", "tiny-gpt2"]
TEXT = "Hello, world!"
WORDS = " SolidGoldMagikarp"


@pytest.fixture(params=MODELS)
def pair(request, served, reference):
    return served[request.param], reference[request.param].bridge


def one_token_word(tl) -> str:
    """A word of several letters that this tokenizer keeps as one token."""
    for word in (" the", " world", " some", "Hello"):
        if len(tl.to_tokens(word, prepend_bos=False)[0]) == 1:
            return word
    raise AssertionError("no one-token word found")


def test_set_tokenizer_during_initialization(pair):
    xl, tl = pair
    assert xl.tokenizer is not None and xl.tokenizer.name_or_path == str(xl.model_dir)
    assert xl.cfg.d_vocab == tl.cfg.d_vocab


def test_to_tokens_default(pair):
    xl, tl = pair
    assert equal(xl.to_tokens(TEXT).cpu(), tl.to_tokens(TEXT))


def test_to_tokens_without_bos(pair):
    xl, tl = pair
    assert equal(xl.to_tokens(TEXT, prepend_bos=False).cpu(), tl.to_tokens(TEXT, prepend_bos=False))


def test_to_tokens_device(pair):
    xl, _ = pair
    tokens1 = xl.to_tokens(TEXT, move_to_device=False)
    tokens2 = xl.to_tokens(TEXT, move_to_device=True)
    assert tokens1.device.type == "cpu" and tokens2.device == xl.engine.device
    assert equal(tokens1, tokens2.cpu())


def test_to_tokens_truncate(pair):
    xl, _ = pair
    limit = xl.engine.max_model_len
    s = "@ " * (limit + 1)
    tokens1 = xl.to_tokens(s)
    tokens2 = xl.to_tokens(s, truncate=False)
    assert len(tokens1[0]) == limit, "truncated by default"
    assert len(tokens2[0]) > limit, "not truncated"


def test_to_string_from_to_tokens_without_bos(pair):
    xl, _ = pair
    tokens = xl.to_tokens(TEXT, prepend_bos=False)
    assert xl.to_string(tokens[0]) == TEXT


def test_to_string_multiple(pair):
    xl, tl = pair
    tokens = torch.cat([tl.to_tokens("Hello")[:, :2], tl.to_tokens(" Charlie Planet", prepend_bos=False)[:, :2]])
    assert xl.to_string(tokens) == tl.to_string(tokens)


def test_to_str_tokens_default(pair):
    xl, tl = pair
    assert xl.to_str_tokens(WORDS) == tl.to_str_tokens(WORDS)


def test_to_str_tokens_without_bos(pair):
    xl, tl = pair
    assert xl.to_str_tokens(WORDS, prepend_bos=False) == tl.to_str_tokens(WORDS, prepend_bos=False)


def test_to_single_token(pair):
    xl, tl = pair
    word = one_token_word(tl)
    assert xl.to_single_token(word) == tl.to_single_token(word)


def test_to_single_str_token(pair):
    xl, tl = pair
    token = tl.to_single_token(one_token_word(tl))
    assert xl.to_single_str_token(token) == tl.to_single_str_token(token)


def test_get_token_position_not_found(pair):
    xl, tl = pair
    with pytest.raises(AssertionError) as exc_info:
        xl.get_token_position(one_token_word(tl), "There were many biomolecules")
    assert str(exc_info.value) == "The token does not occur in the prompt"


def test_get_token_position_str(pair):
    xl, tl = pair
    single, input = " some", "There were some biomolecules"
    if len(tl.to_tokens(single, prepend_bos=False)[0]) != 1:
        single = one_token_word(tl)
        input = f"There were{single} biomolecules"
    assert xl.get_token_position(single, input) == tl.get_token_position(single, input)
    assert xl.get_token_position(single, input, prepend_bos=False) == tl.get_token_position(single, input,
                                                                                               prepend_bos=False)


def test_get_token_position_int_pos(pair):
    xl, _ = pair
    input = torch.tensor([2.0, 3, 4])
    assert xl.get_token_position(2, input) == 0, "first position"
    assert xl.get_token_position(2, input, prepend_bos=False) == 0, "no effect from BOS when using tensor as input"


def test_get_token_position_int_pos_last(pair):
    xl, _ = pair
    assert xl.get_token_position(2, torch.tensor([2.0, 3, 4, 2, 5]), mode="last") == 3


def test_get_token_position_int_1_pos(pair):
    xl, _ = pair
    assert xl.get_token_position(2, torch.tensor([[2.0, 3, 4]])) == 0


def test_tokens_to_residual_directions(pair):
    xl, tl = pair
    directions = xl.tokens_to_residual_directions(xl.to_tokens(""))
    assert directions.shape == torch.Size([xl.cfg.d_model])
    assert equal(directions.cpu(), tl.tokens_to_residual_directions(tl.to_tokens("")))
