"""TransformerLens's SVDInterpreter tests, run against xmix-lens.

Source: TransformerLensOrg/TransformerLens, tests/unit/test_svd_interpreter.py at commit
0c02d2a69b34bd3ace2863e786e0bef0699caa0d (the stored version the code index holds; it tests
`HookedTransformer`). Every case keeps its TL name and asserts the same behaviour; the code is written
anew for xmix-lens.

Changes from the original:
* Models: TL loads the hub models "solu-2l" (folded and unfolded) and "solu-3l" and compares with
  numbers taken from them. Here the model is the session's tiny Llama (raw weights, as solu-2l with
  fold_ln=False) and the expected values are what TransformerLens's own SVDInterpreter gives on its
  bridge over the same folder (`reference`). The "second model" is a tiny Llama of another seed.
* test_svd_interpreter and test_w_in_when_fold_ln_is_false are one case here: the served model's
  weights are the raw ones unless from_pretrained processes them (test_weight_processing.py covers
  folding).
* The error cases' messages name the tiny model's 2 layers and 4 heads.
* test_svd_interpreter_fails_on_invalid_vector_type: TransformerLens 4.3 checks the vector type itself
  (ValueError, "Vector type must be in [...]"); the 3.x file expected typeguard's TypeCheckError.
"""
import pytest
import torch
from transformer_lens import SVDInterpreter

VECTOR_TYPES = ["OV", "w_in", "w_out"]
ATOL = 2e-4


@pytest.fixture
def model(served):
    return served["tiny-llama"]


@pytest.fixture
def expected(reference):
    """TransformerLens's top-2 absolute singular-vector entries per vector type and layer."""
    svd = SVDInterpreter(reference["tiny-llama"].bridge)
    return {(kind, layer): top2(svd, kind, layer) for kind in VECTOR_TYPES for layer in (0, 1)}


@pytest.fixture(scope="module")
def second_model():
    from tests.tiny_models import tiny_llama
    from xmix_lens import HookedTransformer

    model = HookedTransformer.from_pretrained(str(tiny_llama(seed=7)), enforce_eager=True, max_model_len=64)
    yield model
    model.shutdown()


def top2(svd, kind, layer):
    vectors = svd.get_singular_vectors(kind, num_vectors=4, layer_index=layer, head_index=0).abs()
    return vectors.topk(2, dim=0).values.cpu()


def test_svd_interpreter(model, expected):
    svd = SVDInterpreter(model)
    ov, w_in, w_out = (top2(svd, kind, 0) for kind in VECTOR_TYPES)
    assert ov.shape == w_in.shape == w_out.shape == expected["OV", 0].shape
    assert torch.allclose(ov, expected["OV", 0], atol=ATOL)
    assert torch.allclose(w_in, expected["w_in", 0], atol=ATOL)
    assert torch.allclose(w_out, expected["w_out", 0], atol=ATOL)


def test_svd_interpreter_returns_different_answers_for_different_layers(model, expected):
    svd = SVDInterpreter(model)
    for kind in VECTOR_TYPES:
        layer1 = top2(svd, kind, 1)
        assert torch.allclose(layer1, expected[kind, 1], atol=ATOL)
        assert not torch.allclose(layer1, expected[kind, 0], atol=ATOL)


def test_svd_interpreter_returns_different_answers_for_different_models(second_model, expected):
    svd = SVDInterpreter(second_model)
    for kind in VECTOR_TYPES:
        assert not torch.allclose(top2(svd, kind, 1), expected[kind, 1], atol=ATOL)


def test_svd_interpreter_fails_on_invalid_vector_type(model):
    with pytest.raises(ValueError) as e:
        SVDInterpreter(model).get_singular_vectors("test", layer_index=0, num_vectors=4, head_index=0)
    assert str(e.value) == "Vector type must be in ['OV', 'w_in', 'w_out'], instead got test"


def test_svd_interpreter_fails_on_not_passing_required_head_index(model):
    with pytest.raises(AssertionError) as e:
        SVDInterpreter(model).get_singular_vectors("OV", layer_index=0, num_vectors=4)
    assert str(e.value) == "Head index optional only for w_in and w_out, got OV"


def test_svd_interpreter_fails_on_invalid_layer_index(model):
    for vector in VECTOR_TYPES:
        with pytest.raises(AssertionError) as e:
            SVDInterpreter(model).get_singular_vectors(vector, layer_index=2, num_vectors=4, head_index=0)
        assert str(e.value) == "Layer index must be between 0 and 1 but got 2"


def test_svd_interpreter_fails_on_invalid_head_index(model):
    with pytest.raises(AssertionError) as e:
        SVDInterpreter(model).get_singular_vectors("OV", layer_index=0, num_vectors=4, head_index=8)
    assert str(e.value) == "Head index must be between 0 and 3 but got 8"
