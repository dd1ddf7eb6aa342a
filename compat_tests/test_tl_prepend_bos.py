"""TransformerLens's prepend_bos tests, run against xmix-lens.

Source: TransformerLensOrg/TransformerLens, tests/integration/test_prepend_bos.py at commit
f3da28b4de201065a2bfb099e27fc37ddf212e89 (the stored version the code index holds; it tests
`HookedTransformer`). Every case keeps its TL name and asserts the same behaviour; the code is written
anew for xmix-lens.

Changes from the original:
* Models: TL loads the hub models "gpt2" and "facebook/opt-125m". Here every case runs on the
  session's tiny Llama and tiny GPT-2 engines (`served`); the cases that build a model with other
  defaults (`default_prepend_bos=False`) build an eager engine of the same tiny folder once per module.
* Cases that change `model.cfg.default_prepend_bos` or `tokenizer.padding_side` on the shared engine
  put them back afterwards (`model` fixture), as TL's class-scoped model never needed.
* get_num_tokens_in_prompt: TL loads a second tokenizer with add_bos_token=False from
  `model.tokenizer.name_or_path`; here the tokenizer is loaded from the model's folder the same way.
"""
import pytest
from transformers import AutoTokenizer

MODELS = ["tiny-llama", "tiny-gpt2"]
PROMPT = "Hello world!"


@pytest.fixture(params=MODELS)
def model_name(request):
    return request.param


@pytest.fixture
def model(model_name, served):
    """The session's engine for the model, its tokenizer defaults put back after the case."""
    model = served[model_name]
    prepend_bos, side = model.cfg.default_prepend_bos, model.tokenizer.padding_side
    yield model
    model.cfg.default_prepend_bos, model.tokenizer.padding_side = prepend_bos, side


@pytest.fixture(scope="module")
def without_bos():
    """Per model, an engine built with TransformerLens's `default_prepend_bos=False`."""
    from conftest import MODEL_DIRS
    from xmix_lens import HookedTransformer

    built = {name: HookedTransformer.from_pretrained(str(MODEL_DIRS[name]()), enforce_eager=True, max_model_len=128,
                                                     default_prepend_bos=False) for name in MODELS}
    yield built
    for model in built.values():
        model.shutdown()


def get_num_tokens_in_prompt(model, prompt, intended_prepend_bos):
    tokenizer = AutoTokenizer.from_pretrained(str(model.model_dir), add_bos_token=False)
    return len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) + int(intended_prepend_bos)


def check_first_token(model, str_tokens, tokens, intended_prepend_bos):
    if intended_prepend_bos:
        assert str_tokens[0] == model.tokenizer.bos_token
        assert tokens[0][0] == model.tokenizer.bos_token_id
    else:
        assert str_tokens[0] != model.tokenizer.bos_token
        assert tokens[0][0] != model.tokenizer.bos_token_id


def check_tokens_length(model, logits, str_tokens, tokens, intended_prepend_bos):
    expected = get_num_tokens_in_prompt(model, PROMPT, intended_prepend_bos)
    assert logits.shape[1] == len(str_tokens) == tokens.shape[1] == expected


def test_default_prepend_bos(model):
    assert model.cfg.default_prepend_bos is True, "Default prepend_bos should be True"
    logits = model(PROMPT)
    str_tokens = model.to_str_tokens(PROMPT)
    tokens = model.to_tokens(PROMPT)
    check_first_token(model, str_tokens, tokens, True)
    check_tokens_length(model, logits, str_tokens, tokens, True)
    assert model.get_token_position(model.tokenizer.bos_token_id, PROMPT) == 0


def test_default_prepend_bos_to_false(model_name, without_bos):
    model = without_bos[model_name]
    logits = model(PROMPT)
    str_tokens = model.to_str_tokens(PROMPT)
    tokens = model.to_tokens(PROMPT)
    check_first_token(model, str_tokens, tokens, False)
    check_tokens_length(model, logits, str_tokens, tokens, False)


@pytest.mark.parametrize("intended_prepend_bos", [True, False])
def test_override_prepend_bos(model, intended_prepend_bos):
    for default_prepend_bos in [True, False]:
        model.cfg.default_prepend_bos = default_prepend_bos
        logits = model(PROMPT, prepend_bos=intended_prepend_bos)
        str_tokens = model.to_str_tokens(PROMPT, prepend_bos=intended_prepend_bos)
        tokens = model.to_tokens(PROMPT, prepend_bos=intended_prepend_bos)
        check_first_token(model, str_tokens, tokens, intended_prepend_bos)
        check_tokens_length(model, logits, str_tokens, tokens, intended_prepend_bos)


def test_prepend_bos_with_get_token_position(model):
    assert model.get_token_position(model.tokenizer.bos_token_id, PROMPT) == 0
    with pytest.raises(AssertionError):
        model.get_token_position(model.tokenizer.bos_token_id, PROMPT, prepend_bos=False)
    model.cfg.default_prepend_bos = False
    with pytest.raises(AssertionError):
        model.get_token_position(model.tokenizer.bos_token_id, PROMPT)
    assert model.get_token_position(model.tokenizer.bos_token_id, PROMPT, prepend_bos=True) == 0


def test_same_tokenization(model):
    prompts = ["Italy is in Europe.", "Pyeongchang Olympics was held in 2018", "2023-09-09", "287594812673495"]
    model.tokenizer.padding_side = "right"
    for input in [PROMPT, prompts]:
        tokens_with_bos = model.to_tokens(input, prepend_bos=True)
        tokens_without_bos = model.to_tokens(input, prepend_bos=False)
        assert tokens_with_bos[..., 1:].equal(tokens_without_bos)
        str_tokens_with_bos = model.to_str_tokens(input, prepend_bos=True)
        str_tokens_without_bos = model.to_str_tokens(input, prepend_bos=False)
        if isinstance(str_tokens_with_bos[0], list):
            for i in range(len(str_tokens_with_bos)):
                assert str_tokens_with_bos[i][1:] == str_tokens_without_bos[i]
        else:
            assert str_tokens_with_bos[1:] == str_tokens_without_bos
