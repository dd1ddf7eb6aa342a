"""TransformerLens's activation-patching functions (transformer_lens.patching) on the served model.

TransformerLens's own tests of this module (tests/unit/test_patching.py) test its index setters on
random tensors and leave the model-level cases empty (`pass`); what a user of xmix-lens needs is that
the module's patching runs give TransformerLens's results on the served model. Each case runs one of
its functions on the session's tiny Llama (hooks writing clean activations into a corrupted run, per
layer, position and head) and on TransformerLens's bridge over the same folder, with the same clean
cache taken by each, and compares the metric grids.
"""
import pytest
import torch
from transformer_lens import patching

CLEAN = ["The capital of France is", "One two three four five"]
CORRUPTED = ["The capital of Italy is", "One two three nine five"]  # the same lengths, row by row
ATOL = 1e-4
FUNCTIONS = ["get_act_patch_resid_pre", "get_act_patch_attn_out", "get_act_patch_mlp_out",
             "get_act_patch_attn_head_out_all_pos", "get_act_patch_attn_head_out_by_pos",
             "get_act_patch_attn_head_pattern_all_pos", "get_act_patch_block_every",
             "get_act_patch_attn_head_all_pos_every"]


@pytest.fixture(scope="module")
def runs(served, reference):
    xl, tl = served["tiny-llama"], reference["tiny-llama"].bridge
    clean, corrupted = tl.to_tokens(CLEAN), tl.to_tokens(CORRUPTED)
    answers = clean[:, -1]

    def metric(logits):
        return logits[:, -1].log_softmax(-1).gather(-1, answers[:, None].to(logits.device)).mean()

    return (xl, xl.run_with_cache(clean)[1]), (tl, tl.run_with_cache(clean)[1]), corrupted, metric


@pytest.mark.parametrize("function", FUNCTIONS)
def test_patching_grid_is_transformer_lens(runs, function):
    (xl, ours_cache), (tl, tl_cache), corrupted, metric = runs
    ours = getattr(patching, function)(xl, corrupted, ours_cache, metric)
    theirs = getattr(patching, function)(tl, corrupted, tl_cache, metric)
    assert ours.shape == theirs.shape
    assert torch.allclose(ours.cpu(), theirs, atol=ATOL)
    assert float(theirs.abs().max()) > 100 * ATOL, "the patches moved the metric"
