"""The TransformerLens reference runner (compat_tests/reference.py) on a tiny random Llama."""

from pathlib import Path

import pytest
import torch

from compat_tests.reference import TLReference
from tests.tiny_models import tiny_llama

TOL = 1e-4  # brief: TL logits equal HF transformers logits within this (fp32, eager attention)
PROMPTS = ["The capital of France is", "Hi", "One two three four five six seven"]


@pytest.fixture(scope="module")
def tiny_llama_dir() -> Path:
    return tiny_llama()


@pytest.fixture(scope="module")
def ref(tiny_llama_dir) -> TLReference:
    return TLReference(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def tokens(ref) -> torch.Tensor:
    """One unpadded batch: every prompt cut to the shortest length."""
    rows = [ref.to_tokens(p)[0] for p in PROMPTS]
    n = min(len(r) for r in rows)
    return torch.stack([r[:n] for r in rows])


def test_booted_as_reference(ref):
    assert ref.bridge.compatibility_mode
    assert next(ref.bridge.parameters()).dtype == torch.float32
    assert "blocks.0.hook_resid_post" in ref.hook_dict


def test_tokens_follow_tl_rules(ref):
    toks = ref.to_tokens(PROMPTS)
    assert toks.dtype == torch.long and toks.shape[0] == len(PROMPTS)
    assert (toks[:, 0] == ref.tokenizer.bos_token_id).all()          # prepend_bos=True default
    assert toks[1, -1].item() == ref.tokenizer.pad_token_id           # right padding default
    assert ref.to_tokens(PROMPTS, padding_side="left")[1, 0].item() == ref.tokenizer.pad_token_id
    assert ref.to_tokens("Hi", prepend_bos=False)[0, 0].item() != ref.tokenizer.bos_token_id


def test_logits_equal_hf(ref, hf, tokens):
    logits = ref.run_with_hooks(tokens, fwd_hooks=[])
    with torch.no_grad():
        expected = hf(tokens).logits
    assert logits.shape == expected.shape == (*tokens.shape, hf.config.vocab_size)
    assert (logits - expected).abs().max().item() < TOL


def test_resid_post_write_moves_logits_and_matches_hf(ref, hf, tokens):
    direction = torch.randn(ref.cfg.d_model, generator=torch.Generator().manual_seed(1))
    calls = []

    def steer(act, hook):  # a plain TransformerLens hook
        calls.append(hook.name)
        return act + 4.0 * direction

    base = ref.run_with_hooks(tokens, fwd_hooks=[])
    steered = ref.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", steer)])
    assert calls == ["blocks.0.hook_out"]  # one call per forward; TL names it canonically
    assert (steered - base).abs().max().item() > 1000 * TOL

    # the same edit as a torch forward hook on HF's layer 0: TL applied it exactly once
    def hf_steer(module, args, output):
        if isinstance(output, tuple):
            return (output[0] + 4.0 * direction, *output[1:])
        return output + 4.0 * direction

    handle = hf.model.layers[0].register_forward_hook(hf_steer)
    try:
        with torch.no_grad():
            expected = hf(tokens).logits
    finally:
        handle.remove()
    assert (steered - expected).abs().max().item() < TOL
    # hooks are gone after the run
    assert (ref.run_with_hooks(tokens, fwd_hooks=[]) - base).abs().max().item() == 0.0


def test_run_with_cache_reads_residuals(ref, hf, tokens):
    names = ["hook_embed", "blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    logits, cache = ref.run_with_cache(tokens, names_filter=names)
    assert isinstance(cache, dict) and set(names) <= set(cache)
    with torch.no_grad():
        out = hf(tokens, output_hidden_states=True)
    assert (logits - out.logits).abs().max().item() < TOL
    assert (cache["hook_embed"] - out.hidden_states[0]).abs().max().item() < TOL
    assert (cache["blocks.0.hook_resid_post"] - out.hidden_states[1]).abs().max().item() < TOL
    assert cache["blocks.1.hook_resid_post"].shape == (*tokens.shape, ref.cfg.d_model)


def test_left_padding_with_mask_matches_unpadded(ref):
    padded = ref.to_tokens(PROMPTS, padding_side="left")
    mask = ref.attention_mask(padded, padding_side="left")
    logits = ref.run_with_hooks(padded, fwd_hooks=[], attention_mask=mask)
    for i, prompt in enumerate(PROMPTS):
        alone = ref.run_with_hooks(ref.to_tokens(prompt), fwd_hooks=[])[0]
        n = alone.shape[0]
        assert int(mask[i].sum()) == n
        assert (logits[i, -n:] - alone).abs().max().item() < TOL
