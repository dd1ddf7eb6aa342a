"""TransformerLens's attention-mask tests, run against xmix-lens.

Source: TransformerLensOrg/TransformerLens, tests/integration/test_attention_mask.py at commit
2e985952e7b174e04d99a45bbfc81ee07e639e61 (the stored version the code index holds; it tests
`HookedTransformer`). Every case keeps its TL name and asserts the same behaviour; the code is written
anew for xmix-lens.

Changes from the original:
* Models: test_attention_mask builds a random one-layer, attention-only HookedTransformer from a config
  (d_head=1, d_vocab=2), which vLLM cannot load; test_masked_tokens loads the hub model "solu-1l". Here
  both run on the session's tiny Llama (rotary positions) and tiny GPT-2 (learned positions) engines.
* test_attention_mask also runs with a mask that has a zero inside the row (besides TL's all-real
  input): the masked key's scores must be -inf and its pattern 0 for every query.
* Added, not in TL's file: with a zero inside a row, logits and every cached activation at the real
  positions, with and without a hook that writes the residual, equal TransformerLens's on the same
  weights and mask (TL's semantics: a masked token is as if removed).
"""
import pytest
import torch

from transformer_lens import utilities as utils

PROMPTS = ["Hello world!", "The quick brown fox jumps over the lazy dog."]


@pytest.fixture(params=["tiny-llama", "tiny-gpt2"])
def model_name(request):
    return request.param


@pytest.fixture
def model(model_name, served):
    return served[model_name]


@pytest.mark.parametrize("hole", [None, 2])
def test_attention_mask(model, hole):
    input_length, layer, low_attn_score = 5, 0, 1e-6
    tokens = torch.ones((1, input_length), dtype=torch.int64)
    mask = torch.ones_like(tokens)
    if hole is not None:
        mask[0, hole] = 0
    masked = torch.triu(torch.ones((input_length, input_length)), diagonal=1).bool()
    if hole is not None:
        masked[:, hole] = True  # no query looks at the masked key
    fired = []

    def attn_scores_hook(attn_scores, hook):
        assert torch.all(attn_scores[:, :, masked] == float("-inf")), "masked scores are not -inf"
        attn_scores[:, :, ~masked] = low_attn_score
        fired.append(hook.name)
        return attn_scores

    def attn_hook(attn, hook):
        assert torch.all(attn[:, :, masked] == 0), "the pattern attends outside the mask"
        fired.append(hook.name)
        return attn

    fwd_hooks = [(utils.get_act_name("attn_scores", layer), attn_scores_hook),
                 (utils.get_act_name("attn", layer), attn_hook)]
    model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=fwd_hooks)
    assert len(fired) == 2


def test_masked_tokens(model):
    tokens = model.to_tokens(PROMPTS)

    # Part 1: a mask of all ones gives what no mask gives
    full_mask = torch.ones_like(tokens)
    no_mask_out = model(tokens)
    full_mask_out = model(tokens, attention_mask=full_mask)
    assert torch.allclose(no_mask_out, full_mask_out), "Full mask should be equivalent to no mask"

    # Part 2: a column of zeros gives what removing that position gives
    remove_tok_idx = 2
    edited_tokens = torch.cat([tokens[:, :remove_tok_idx], tokens[:, remove_tok_idx + 1:]], dim=1)
    edited_mask = full_mask.clone()
    edited_mask[:, remove_tok_idx] = 0
    edited_no_mask_out = model(edited_tokens)
    edited_mask_out = model(tokens, attention_mask=edited_mask)
    edited_mask_out = torch.cat([edited_mask_out[:, :remove_tok_idx], edited_mask_out[:, remove_tok_idx + 1:]], dim=1)
    assert torch.allclose(edited_no_mask_out, edited_mask_out, atol=1e-4), "Edited mask should be equivalent to no mask"


def _holed(model):
    """PROMPTS right-padded, with zeros inside both rows' masks (row 1 also left-padded by one)."""
    tokens = model.to_tokens(PROMPTS, padding_side="right")
    mask = utils.get_attention_mask(model.tokenizer, tokens, True).clone()
    mask[0, 2] = 0
    mask[1, 0], mask[1, 4], mask[1, 5] = 0, 0, 0
    return tokens, mask


def test_holes_in_the_mask_against_transformer_lens(model_name, model, reference):
    ref = reference[model_name]
    tokens, mask = _holed(model)
    real = mask.bool()
    names = lambda name: name.endswith(("hook_resid_pre", "hook_resid_post", "attn.hook_z", "mlp_out",
                                        "hook_pattern"))
    logits, cache = model.run_with_cache(tokens, attention_mask=mask, names_filter=names)
    ref_logits, ref_cache = ref.run_with_cache(tokens, attention_mask=mask, names_filter=names)
    assert torch.allclose(logits[real], ref_logits[real], atol=1e-4)
    assert len(cache.keys()) == 5 * model.cfg.n_layers
    for name in cache.keys():
        if not name.endswith("hook_pattern"):
            assert torch.allclose(cache[name][real], ref_cache[name][real], atol=1e-4), name
            continue
        for b in range(tokens.shape[0]):  # [batch, head, query, key] among the row's real tokens
            q = real[b].nonzero().flatten()
            got, want = cache[name][b][:, q][:, :, q], ref_cache[name][b][:, q][:, :, q]
            assert torch.allclose(got, want, atol=1e-4), name


def test_holes_in_the_mask_with_a_write(model_name, model, reference):
    tokens, mask = _holed(model)
    steer = torch.linspace(-1, 1, model.cfg.d_model)

    def add_at_third(resid, hook):
        resid[:, 3] += steer
        return resid

    hooks = [("blocks.0.hook_resid_post", add_at_third)]
    logits = model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=hooks)
    ref_logits = reference[model_name].run_with_hooks(tokens, attention_mask=mask, fwd_hooks=hooks)
    real = mask.bool()
    assert torch.allclose(logits[real], ref_logits[real], atol=1e-4)
    assert not torch.allclose(logits[real], model(tokens, attention_mask=mask)[real], atol=1e-3)
