"""TransformerLens's weight processing (from_pretrained(fold_ln=True, ...)): the engine serves the
weights TransformerLens's own processing makes (tl_surface.processed_folder), checked against
TransformerLens's bridge with the same processing on the same checkpoint: logits, activations,
weights. Three cases: the tiny Llama with HookedTransformer.from_pretrained's default flags
(refactor_factored_attn_matrices, which TransformerLens refuses for rotary models, left out), the
tiny GPT-2 with every flag, and the tiny GPT-2 with fold_ln alone: folding its final LayerNorm gives
an unembedding bias b_U, which the served output layer then has (families.UNEMBEDDING_BIAS). And
the families whose checkpoints lay out TransformerLens's weights otherwise: Qwen2 (q, k, v biases),
Qwen3 (q and k norms), Phi-3 (fused qkv and gate_up projections), GPT-NeoX (q, k, v head after head;
an output layer named embed_out) and OLMo 2 (norms after the sublayers only, served by vLLM's OLMo 3 class)."""
import pytest
import torch

from compare import PROMPTS, real_mask
from compat_tests.reference import TLReference
from tests.tiny_models import (tiny_gemma2, tiny_gemma3, tiny_gpt2, tiny_llama, tiny_neox, tiny_olmo2, tiny_phi3,
                               tiny_qwen2, tiny_qwen3)
from xmix_lens.families import FAMILIES

ATOL = 1e-3  # engine (vLLM, fp32) against TransformerLens (HF eager, fp32) on the tiny models
CASES = {
    "tiny-llama": (tiny_llama, {"fold_ln": True, "center_writing_weights": True, "center_unembed": True,
                                "fold_value_biases": True}),
    "tiny-gpt2": (tiny_gpt2, {"fold_ln": True, "center_writing_weights": True, "center_unembed": True,
                              "fold_value_biases": True, "refactor_factored_attn_matrices": True}),
    "tiny-gpt2-fold-ln": (tiny_gpt2, {"fold_ln": True}),
    # Qwen2's q, k, v biases; Phi-3's fused projections (families.py's checkpoint layouts)
    # (fold_value_biases would give Qwen2 a b_O: test_a_bias_the_family_has_no_place_for_is_refused)
    "tiny-qwen2": (tiny_qwen2, {"fold_ln": True, "center_writing_weights": True, "center_unembed": True}),
    "tiny-phi3": (tiny_phi3, {"fold_ln": True, "center_writing_weights": True, "center_unembed": True}),
    "tiny-qwen3": (tiny_qwen3, {"fold_ln": True, "center_writing_weights": True, "center_unembed": True}),
    "tiny-gemma3": (tiny_gemma3, {"fold_ln": True, "center_writing_weights": True, "center_unembed": True}),
    # TransformerLens does not fold OLMo's norms (they follow the sublayers): centring only
    "tiny-olmo2": (tiny_olmo2, {"center_writing_weights": True, "center_unembed": True}),
    "tiny-neox": (tiny_neox, {"fold_ln": True, "center_writing_weights": True, "center_unembed": True,
                              "fold_value_biases": True}),
}


@pytest.fixture(scope="module", params=list(CASES))  # eager: processing changes the weights, not the compiled path
def processed(request):
    """(served model, TransformerLens's bridge with the same processing, the raw bridge's name)."""
    from xmix_lens import HookedServedModel

    folder, flags = CASES[request.param]
    model = HookedServedModel.from_pretrained(str(folder()), max_model_len=256, enforce_eager=True, **flags)
    assert {flag for flag, on in model.processing.items() if on} == set(flags)
    ref = TLReference(folder())
    ref.bridge.enable_compatibility_mode(disable_warnings=True, **model.processing)  # all five: TL's defaults are True
    yield model, ref, request.param.removesuffix("-fold-ln")
    model.shutdown()


def test_processed_logits_and_activations_match_transformer_lens(processed):
    xl, tl, _ = processed
    real = real_mask(tl, tl.to_tokens(PROMPTS), "right")
    norm = "ln1" if "blocks.0.ln1.hook_normalized" in xl.hook_dict else "ln1_post"  # OLMo: norms after the sublayers
    names = ["blocks.1.hook_resid_pre", f"blocks.0.{norm}.hook_normalized", "blocks.1.attn.hook_v", "ln_final.hook_scale"]
    logits, ours = xl.run_with_cache(PROMPTS, names_filter=names)
    ref_logits, theirs = tl.run_with_cache(PROMPTS, names_filter=names)
    assert (logits - ref_logits).abs()[real].max() < ATOL
    for name in names:
        assert (ours[name] - theirs[name]).abs()[real].max() < ATOL, name


def test_processed_weights_are_transformer_lens_processed_weights(processed, reference):
    xl, tl, name = processed
    raw = reference[name].bridge
    if FAMILIES[xl.cfg.family].pre_norms:
        # processing changed them: the norm's weight folded in (Llama), the writing weights centred (GPT-2)
        changed = "W_Q" if xl.processing["fold_ln"] else "W_O"
        assert (getattr(xl, changed) - getattr(raw, changed)).abs().max() > 0.01
    else:  # norms after the sublayers (OLMo): TransformerLens centres the unembedding only
        assert xl.W_U.mean(-1).abs().max() < 1e-6 < raw.W_U.mean(-1).abs().max()
    for weight in ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_out", "W_E", "W_U", "b_U"):
        assert torch.allclose(getattr(xl, weight), getattr(tl.bridge, weight), atol=1e-6), weight
    if xl.processing["fold_ln"]:
        # folded into the weights after it: a gain of 1 (Gemma's norms weigh by 1 + w)
        folded = torch.zeros if getattr(xl.cfg, "rmsnorm_uses_offset", False) else torch.ones
        assert torch.allclose(xl.blocks[0].ln1.w, folded(xl.cfg.d_model))


def test_folded_unembedding_bias_is_served_in_generation(processed):
    """Greedy tokens of the processed model are TransformerLens's processed model's: sampling sees the
    served logits, b_U included."""
    xl, tl, _ = processed
    tokens = tl.to_tokens(PROMPTS[:1])
    ours = xl.generate(tokens, max_new_tokens=5, do_sample=False, return_type="tokens")
    theirs = tl.bridge.generate(tokens, max_new_tokens=5, do_sample=False, stop_at_eos=False, verbose=False,
                                use_past_kv_cache=False)
    assert torch.equal(ours.cpu(), theirs)
    if xl.processing["fold_ln"] and xl.cfg.normalization_type == "LN":
        assert xl.b_U.abs().max() > 0.01  # the folded final LayerNorm's bias


def test_a_bias_the_family_has_no_place_for_is_refused():
    """Folding Qwen2's value biases makes an output bias b_O, which Qwen2's o_proj lacks; folding Gemma 2's
    final norm into its unembedding unties that from the embedding, which vLLM's Gemma 2 cannot serve:
    refused with the reason and what to leave off, before an engine starts."""
    from xmix_lens import HookedServedModel

    with pytest.raises(ValueError, match=r"nonzero b_O, which Qwen2 models .*load with fold_value_biases=False"):
        HookedServedModel.from_pretrained(str(tiny_qwen2()), fold_ln=True, fold_value_biases=True)
    with pytest.raises(ValueError, match=r"\(fold_ln\) makes the unembedding differ .* Gemma 2 models only with the "
                                         r"two tied; load without weight processing"):
        HookedServedModel.from_pretrained(str(tiny_gemma2()), fold_ln=True)
