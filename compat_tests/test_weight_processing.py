"""TransformerLens's weight processing (from_pretrained(fold_ln=True, ...)): the engine serves the
weights TransformerLens's own processing makes (tl_surface.processed_folder), checked against
TransformerLens's bridge with the same processing on the same checkpoint: logits, activations,
weights."""
import pytest
import torch

from compare import PROMPTS, real_mask
from compat_tests.reference import TLReference
from tests.tiny_models import tiny_llama

ATOL = 1e-3  # engine (vLLM, fp32) against TransformerLens (HF eager, fp32) on the tiny models


@pytest.fixture(scope="module")  # eager: processing changes the weights, not the compiled path; shut down after
def processed_llama():
    """The tiny Llama with TransformerLens's default processing (HookedTransformer.from_pretrained's
    flags; refactor_factored_attn_matrices, which TransformerLens refuses for rotary models, left out)."""
    from xmix_lens import HookedServedModel

    flags = {"fold_ln": True, "center_writing_weights": True, "center_unembed": True, "fold_value_biases": True}
    model = HookedServedModel.from_pretrained(str(tiny_llama()), max_model_len=256, enforce_eager=True, **flags)
    assert {flag for flag, on in model.processing.items() if on} == set(flags)
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def processed_reference(processed_llama):
    ref = TLReference(tiny_llama())
    ref.bridge.enable_compatibility_mode(disable_warnings=True, **processed_llama.processing)  # all five, TL's defaults are True
    return ref


def test_processed_logits_and_activations_match_transformer_lens(processed_llama, processed_reference):
    xl, tl = processed_llama, processed_reference
    real = real_mask(tl, tl.to_tokens(PROMPTS), "right")
    names = ["blocks.1.hook_resid_pre", "blocks.0.ln1.hook_normalized", "blocks.1.attn.hook_v", "ln_final.hook_scale"]
    logits, ours = xl.run_with_cache(PROMPTS, names_filter=names)
    ref_logits, theirs = tl.run_with_cache(PROMPTS, names_filter=names)
    assert (logits - ref_logits).abs()[real].max() < ATOL
    for name in names:
        assert (ours[name] - theirs[name]).abs()[real].max() < ATOL, name


def test_processed_weights_are_transformer_lens_processed_weights(processed_llama, processed_reference, reference):
    xl, tl = processed_llama, processed_reference.bridge
    assert (xl.W_Q - reference["tiny-llama"].bridge.W_Q).abs().max() > 0.01  # the norm's weight folded in
    for name in ("W_Q", "W_K", "W_O", "W_in", "W_gate", "W_out", "W_E", "W_U"):
        assert torch.allclose(getattr(xl, name), getattr(tl, name), atol=1e-6), name
    assert torch.allclose(xl.blocks[0].ln1.w, torch.ones(xl.cfg.d_model))  # folded into the weights after it
