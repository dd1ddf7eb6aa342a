"""TransformerLens's left-padding tests, run against xmix-lens.

Source: TransformerLensOrg/TransformerLens, tests/integration/test_left_padding.py at commit
0f4caf902f12c8a937390d7456861b53fb34f3ea (the stored version the code index holds; it tests
`HookedTransformer`). Every case keeps its TL name and asserts the same behaviour; the code is written
anew for xmix-lens.

Changes from the original:
* Models: TL loads the hub models "gpt2-small" and "facebook/opt-125m" (both with learned positional
  embeddings). Here: the session's tiny GPT-2 for the `pos_embed` cases (a Llama has no positional
  embedding: its positions are rotary), and the tiny GPT-2 and tiny Llama for the outputs comparison.
* `model.pos_embed(tokens, offset, attention_mask=...)` is HookedTransformer's signature, which this
  file calls; TransformerLens 4.3's bridge fails these cases (its pos_embed is Hugging Face's
  Embedding of position ids: "unexpected keyword argument 'attention_mask'"). xmix-lens serves
  HookedTransformer's (tl_surface.hooked_pos_embed), so they run here as written.
* The KV-cache object is TransformerLens 4.3's `TransformerLensKeyValueCache` (the file imports it from
  `past_key_value_caching`, its 3.x home); these cases use only its attention-mask bookkeeping.
* Cases that set `model.tokenizer.padding_side` on the shared engine put it back afterwards.
* test_left_padding_by_comparing_outputs caches TL's shorthand names ("k6a", "pre2", "embed", "k6",
  "scale4ln1", "pre5"); the tiny models have two layers, so each layer index is taken modulo the
  model's layers ("k0a", "pre0", ...).
"""
import pytest
import torch

from transformer_lens import utilities as utils

PROMPTS = ["Hello world!", "How are you today?", "I'm fine, thank you.", "I am happy."]
ATOL = 1e-4


def padding_side_kept(model):
    """The shared engine, its tokenizer's padding side put back after the case."""
    side = model.tokenizer.padding_side
    yield model
    model.tokenizer.padding_side = side


@pytest.fixture(params=["tiny-gpt2", "tiny-llama"])
def model(request, served):
    yield from padding_side_kept(served[request.param])


@pytest.fixture
def gpt2(served):
    yield from padding_side_kept(served["tiny-gpt2"])


def check_outputs_identity(i, single, left, right, left_start, left_end, right_start, right_end):
    assert torch.allclose(left[i, left_start:left_end], right[i, right_start:right_end], atol=ATOL)
    assert torch.allclose(left[i, left_start:left_end], single[0], atol=ATOL)
    assert torch.allclose(right[i, right_start:right_end], single[0], atol=ATOL)


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("prepend_bos", [True, False])
def test_pos_embed(gpt2, padding_side, prepend_bos):
    model = gpt2
    model.tokenizer.padding_side = padding_side
    tokens = model.to_tokens(PROMPTS, prepend_bos=prepend_bos)
    str_tokens = model.to_str_tokens(PROMPTS, prepend_bos=prepend_bos)
    attention_mask = utils.get_attention_mask(model.tokenizer, tokens, prepend_bos)
    output_pos_embed = model.pos_embed(tokens, 0, attention_mask=attention_mask)
    assert output_pos_embed.shape == (tokens.shape[0], tokens.shape[1], model.pos_embed.W_pos.shape[1])
    target_position_ids = torch.tensor(sum([list(range(len(t))) for t in str_tokens], []), device=tokens.device)
    target_output_pos_embed = model.pos_embed.W_pos[target_position_ids, :]
    attended_output_pos_embed = output_pos_embed[attention_mask.bool()]
    assert torch.allclose(attended_output_pos_embed, target_output_pos_embed, atol=1e-4)
    assert output_pos_embed[~attention_mask.bool()].sum() == 0


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("prepend_bos", [True, False])
def test_pos_embed_with_cache(gpt2, padding_side, prepend_bos):
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    model = gpt2
    model.tokenizer.padding_side = padding_side
    tokens = model.to_tokens(PROMPTS, prepend_bos=prepend_bos)
    tokens_2 = model.to_tokens(PROMPTS, prepend_bos=False)
    past_kv_cache = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, tokens.shape[0])
    str_tokens = model.to_str_tokens(PROMPTS, prepend_bos=prepend_bos)
    str_tokens_2 = model.to_str_tokens(PROMPTS, prepend_bos=False)
    attention_mask = utils.get_attention_mask(model.tokenizer, tokens, prepend_bos)
    past_kv_cache.append_attention_mask(attention_mask)
    attention_mask_2 = utils.get_attention_mask(model.tokenizer, tokens_2, False)
    cached_attention_mask = past_kv_cache.append_attention_mask(attention_mask_2)
    output_pos_embed = model.pos_embed(tokens_2, tokens.shape[1], attention_mask=cached_attention_mask)
    target_position_ids = torch.tensor(
        sum([list(range(len(t1), len(t1) + len(t2))) for t1, t2 in zip(str_tokens, str_tokens_2)], []),
        device=tokens.device)
    target_output_pos_embed = model.pos_embed.W_pos[target_position_ids, :]
    attended_output_pos_embed = output_pos_embed[attention_mask_2.bool()]
    assert torch.allclose(attended_output_pos_embed, target_output_pos_embed, atol=1e-4)
    assert output_pos_embed[~attention_mask_2.bool()].sum() == 0


def test_left_padding_by_comparing_outputs(model):
    num_str_tokens_list = [len(t) for t in model.to_str_tokens(PROMPTS)]

    model.tokenizer.padding_side = "left"
    left_logits, left_cache = model.run_with_cache(PROMPTS)
    left_last_logits = left_logits[:, -1, :]
    left_first_token_positions = left_logits.shape[1] - torch.tensor(num_str_tokens_list, device=left_logits.device)
    left_first_logits = left_logits[torch.arange(len(PROMPTS)), left_first_token_positions, :].squeeze(1)

    model.tokenizer.padding_side = "right"
    right_logits, right_cache = model.run_with_cache(PROMPTS)
    right_last_token_positions = torch.tensor(num_str_tokens_list, device=right_logits.device) - 1
    right_last_logits = right_logits[torch.arange(len(PROMPTS)), right_last_token_positions, :].squeeze(1)
    right_first_logits = right_logits[:, 0, :]

    assert torch.allclose(left_last_logits, right_last_logits, atol=1e-4)
    assert torch.allclose(left_first_logits, right_first_logits, atol=1e-4)

    n = model.cfg.n_layers
    names = [f"k{6 % n}a", f"pre{2 % n}", "embed", f"k{6 % n}", f"scale{4 % n}ln1", f"pre{5 % n}"]
    right_token_start = 0
    left_token_end = left_logits.shape[1]
    for i, (prompt, left_token_start, right_token_end) in enumerate(
            zip(PROMPTS, left_first_token_positions.tolist(), (right_last_token_positions + 1).tolist())):
        single_logits, single_cache = model.run_with_cache(prompt)
        assert right_token_end - right_token_start == left_token_end - left_token_start == single_logits.shape[1]
        check_outputs_identity(i, single_logits, left_logits, right_logits, left_token_start, left_token_end,
                               right_token_start, right_token_end)
        for name in names:
            check_outputs_identity(i, single_cache[name], left_cache[name], right_cache[name], left_token_start,
                                   left_token_end, right_token_start, right_token_end)
