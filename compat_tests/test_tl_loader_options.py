"""TransformerLens's loader options (`HookedTransformer.from_pretrained(...)`'s own keywords): each is
taken as TransformerLens takes it, or refused by name before anything loads.

TransformerLens's kv-cache tests build their model with `default_padding_side="left"`; its tokenization
tests use `default_prepend_bos=False`. The oracle is TransformerLens's bridge on the same folder, asked
for the same padding and BOS explicitly.
"""
import pytest
import torch

from tests.tiny_models import tiny_llama

PROMPTS = ["Hello World!", "The cat sat on the mat, and then"]


@pytest.fixture(scope="module")
def left_no_bos():
    from transformers import AutoTokenizer

    from xmix_lens import HookedTransformer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama()))  # a tokenizer of the user's own
    model = HookedTransformer.from_pretrained(str(tiny_llama()), enforce_eager=True, max_model_len=128,
                                              default_padding_side="left", default_prepend_bos=False,
                                              tokenizer=tokenizer)
    yield model
    model.shutdown()


def test_default_padding_side_and_prepend_bos_are_the_tokenizers_defaults(left_no_bos, reference):
    tl = reference["tiny-llama"]
    assert left_no_bos.tokenizer.padding_side == "left" and left_no_bos.cfg.default_prepend_bos is False
    expected = tl.to_tokens(PROMPTS, prepend_bos=False, padding_side="left")
    assert torch.equal(left_no_bos.to_tokens(PROMPTS).cpu(), expected)
    assert left_no_bos.to_str_tokens(PROMPTS[0]) == tl.to_str_tokens(PROMPTS[0], prepend_bos=False)


def test_left_padded_defaults_give_transformerlens_logits(left_no_bos, reference):
    """Strings run with the model's defaults (left padding, no BOS) as TransformerLens runs the same
    tokens with their mask."""
    tl = reference["tiny-llama"]
    tokens = tl.to_tokens(PROMPTS, prepend_bos=False, padding_side="left")
    mask = tl.attention_mask(tokens, padding_side="left", prepend_bos=False)
    expected = tl.bridge(tokens, attention_mask=mask)
    got = left_no_bos(PROMPTS).cpu()
    real = mask.bool()
    assert torch.allclose(got[real], expected[real], atol=1e-4)


@pytest.mark.parametrize("option, value, message", [
    ("hf_model", object(), "save_pretrained"),
    ("checkpoint_index", 3, "training checkpoint"),
    ("checkpoint_value", 1000, "training checkpoint"),
    ("first_n_layers", 1, "num_hidden_layers"),
    ("torch_dtype", torch.float32, "dtype="),
    ("move_to_device", False, "move_to_device at True"),
    ("default_padding_side", "middle", "padding_side 'middle'"),
    ("max_modle_len", 128, "'max_modle_len'.*EngineArgs"),
    ("additional_config", {}, "sets it itself"),
])
def test_loader_options_it_cannot_take_are_refused_by_name_before_loading(option, value, message, monkeypatch):
    from xmix_lens import HookedTransformer, tl_surface

    def no_processing(*args):  # the first step that loads anything: not reached
        raise AssertionError("the model's folder was read before the option was refused")

    monkeypatch.setattr(tl_surface, "processed_folder", no_processing)
    with pytest.raises((ValueError, TypeError), match=message):
        HookedTransformer.from_pretrained(str(tiny_llama()), **{option: value})


def test_n_devices_is_tensor_parallel_size():
    from xmix_lens.model import _loader_options

    assert _loader_options({}, 2, True) == {"tensor_parallel_size": 2}
    assert _loader_options({}, 1, True) == {}
    with pytest.raises(ValueError, match="disagree"):
        _loader_options({"tensor_parallel_size": 4}, 2, True)
