"""TransformerLens's ActivationCache unit tests, run against xmix-lens's cache.

Source: TransformerLensOrg/TransformerLens, tests/unit/test_activation_cache.py at commit
1b4d03a58d92e3d4958d559056ca4c9fba7d69c5 (the one stored version the code index holds; it boots
its model with TL 4.x's TransformerBridge.boot_native, but the ActivationCache methods it tests --
accumulated_resid, apply_slice_to_batch_dim, get_neuron_results, stack_neuron_results -- are
HookedTransformer-era API). Every parametrization is kept (ids as in TL).

Changes from the original:
* Model: TL's module fixture builds a random 2-layer native model twice, with LayerNorm ("LN") and
  with RMSNorm ("RMS"). Here the fixture's two params are the session's tiny GPT-2 (LayerNorm) and
  tiny Llama (RMSNorm) engines (`served` fixture), each run once per module on TL's 3 x 4 token ids.
* The random projection directions come from a seeded torch.Generator (TL: the global RNG).
* Assertions unchanged: each compares two ways of getting the same quantity from one cache.
"""
import pytest
import torch

TOKENS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])


@pytest.fixture(scope="module", params=["tiny-gpt2", "tiny-llama"], ids=["LN", "RMS"])
def activation_cache(request, served):
    model = served[request.param]
    model.reset_hooks(including_permanent=True)
    _, cache = model.run_with_cache(TOKENS)
    return cache


@pytest.mark.parametrize("layer", [1, -1], ids=["cached-scale", "recomputed-final-ln"])
@pytest.mark.parametrize("pos_slice", [None, (1, 3), -1], ids=["all-positions", "position-slice", "scalar-position"])
@pytest.mark.parametrize("apply_ln", [False, True], ids=["raw", "normalized"])
def test_batchless_accumulated_resid_matches_batched_row(activation_cache, layer, pos_slice, apply_ln):
    row = 1
    batched = activation_cache.accumulated_resid(layer=layer, pos_slice=pos_slice, apply_ln=apply_ln)
    batchless_cache = activation_cache.apply_slice_to_batch_dim(row)
    assert not batchless_cache.has_batch_dim
    batchless = batchless_cache.accumulated_resid(layer=layer, pos_slice=pos_slice, apply_ln=apply_ln)
    expected = batched[:, row]
    assert batchless.shape == expected.shape
    torch.testing.assert_close(batchless, expected)


@pytest.mark.parametrize("neuron_slice", [0, [0]], ids=["integer", "list"])
@pytest.mark.parametrize("projection_ndim", [1, 2], ids=["vector", "matrix"])
@pytest.mark.parametrize("has_batch_dim", [True, False], ids=["batched", "batchless"])
@pytest.mark.parametrize("pos_slice", [None, -1], ids=["all-positions", "last-position"])
@torch.no_grad()
def test_get_neuron_results_projection_matches_unprojected(activation_cache, neuron_slice, projection_ndim,
                                                           has_batch_dim, pos_slice):
    cache = activation_cache if has_batch_dim else activation_cache.apply_slice_to_batch_dim(0)
    full = cache.get_neuron_results(layer=0, neuron_slice=neuron_slice, pos_slice=pos_slice)
    shape = (full.shape[-1],) if projection_ndim == 1 else (full.shape[-1], 2)
    direction = torch.randn(shape, dtype=full.dtype, generator=torch.Generator().manual_seed(1)).to(full.device)
    expected = full @ direction
    actual = cache.get_neuron_results(layer=0, neuron_slice=neuron_slice, pos_slice=pos_slice,
                                      project_output_onto=direction)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("incl_remainder", [False, True], ids=["no-remainder", "remainder"])
@pytest.mark.parametrize("projection_ndim", [None, 1, 2], ids=["unprojected", "vector-projection", "matrix-projection"])
@pytest.mark.parametrize("apply_ln", [False, True], ids=["raw", "normalized"])
@torch.no_grad()
def test_stack_neuron_results_integer_neuron_slice_matches_list(activation_cache, apply_ln, projection_ndim,
                                                                incl_remainder):
    """An int neuron_slice keeps the neuron axis and matches the one-element list [n]."""
    n_layers = activation_cache.model.cfg.n_layers
    d_model = activation_cache.model.cfg.d_model
    neuron = 3
    direction = None
    if projection_ndim is not None:
        shape = (d_model,) if projection_ndim == 1 else (d_model, 2)
        direction = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    kwargs = dict(layer=n_layers, apply_ln=apply_ln, project_output_onto=direction,
                  incl_remainder=incl_remainder, return_labels=True)
    expected, expected_labels = activation_cache.stack_neuron_results(neuron_slice=[neuron], **kwargs)
    actual, labels = activation_cache.stack_neuron_results(neuron_slice=neuron, **kwargs)
    assert expected.shape[0] == n_layers + int(incl_remainder)
    assert labels == expected_labels
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected)
