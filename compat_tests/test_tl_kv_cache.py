"""TransformerLens's KV-cache tests, run against xmix-lens.

Source: TransformerLensOrg/TransformerLens, tests/integration/test_kv_cache.py at commit
527cb60cecbae938d93de9e528d79242ae768d25 (the stored version the code index holds; it tests
`HookedTransformer` with `past_kv_cache`). Every case keeps its TL name and asserts the same behaviour;
the code is written anew for xmix-lens.

Changes from the original:
* Models: TL loads the hub models "gpt2-small" (atol 1e-4) and "pythia-14m" (1e-2) with
  `default_padding_side="left"`. Here: the session's tiny GPT-2 and tiny Llama engines (atol 1e-4), their
  tokenizer's padding side set to "left" for the case and put back afterwards.
* The cache class is TransformerLens 4.3's `TransformerLensKeyValueCache` (TL's file imports it under its
  3.x name `HookedTransformerKeyValueCache`).
* test_kv_cache_and_start_at_layer stops at layer 2 and starts at layer 1 (TL: 4 and 3; the tiny models
  have two layers) and caches only the residual (`names_filter`): a continued call refuses hooks on
  attention patterns, which run_with_cache's default caches (see the added case).
* Added, not in TL's file: a hook on a continued call sees only the call's tokens, and its write
  changes the continuation's logits as the same write on the whole sequence does; continuing a past
  that hooks wrote into, and attention-pattern hooks on a continued call, are refused with the reason.
"""
import pytest
import torch as t
from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache as HookedTransformerKeyValueCache

ATOL = 1e-4


@pytest.fixture(params=["tiny-gpt2", "tiny-llama"])
def pretrained(request, served):
    model = served[request.param]
    side = model.tokenizer.padding_side
    model.tokenizer.padding_side = "left"
    yield model, ATOL
    model.tokenizer.padding_side = side


def _cache(model, batch):
    return HookedTransformerKeyValueCache.init_cache(model.cfg, model.cfg.device, batch)


def _staten_island(model):
    """TL's prompt, its one new token, both together, and the logits of both run without a cache."""
    pre_prompt_tokens = model.to_tokens("I went to Staten Island,")
    single_new_token = model.to_tokens(" Sharon", prepend_bos=False)
    full_prompt_tokens = t.cat([pre_prompt_tokens, single_new_token], dim=-1)
    return pre_prompt_tokens, single_new_token, full_prompt_tokens, model(full_prompt_tokens)


def test_single_new_token(pretrained):
    model, atol = pretrained
    pre_prompt_tokens, single_new_token, full_prompt_tokens, no_cache_logits = _staten_island(model)
    assert full_prompt_tokens.shape[-1] == pre_prompt_tokens.shape[-1] + 1
    past_kv_cache = _cache(model, pre_prompt_tokens.shape[0])
    model(pre_prompt_tokens, past_kv_cache=past_kv_cache)
    with_cache_logits = model(single_new_token, past_kv_cache=past_kv_cache)
    assert t.allclose(no_cache_logits[:, -1], with_cache_logits[:, -1], atol=atol)
    assert t.allclose(no_cache_logits[:, -1:], with_cache_logits, atol=atol)


def test_multiple_new_tokens(pretrained):
    model, atol = pretrained
    pre_prompt_tokens = model.to_tokens("I went to Staten Island,")
    new_tokens = model.to_tokens(" to buy myself a mandolin", prepend_bos=False)
    new_tokens_len = new_tokens.shape[-1]
    full_prompt_tokens = t.cat([pre_prompt_tokens, new_tokens], dim=-1)
    no_cache_logits = model(full_prompt_tokens)
    past_kv_cache = _cache(model, pre_prompt_tokens.shape[0])
    model(pre_prompt_tokens, past_kv_cache=past_kv_cache)
    with_cache_logits = model(new_tokens, past_kv_cache=past_kv_cache)
    assert t.allclose(no_cache_logits[:, -1], with_cache_logits[:, -1], atol=atol)
    assert t.allclose(no_cache_logits[:, -new_tokens_len:], with_cache_logits, atol=atol)


@pytest.mark.parametrize("pre_padding", ["left", "right", None])
@pytest.mark.parametrize("post_padding", ["left", "right", None])
def test_multi_token_batch(pretrained, pre_padding, post_padding):
    model, atol = pretrained
    padded_batch_pre_prompts = ["It's always locked", "I'd rather be burned in Canada"]
    unpadded_batch_pre_prompts = ["It's always locked", "It's always blocked"]
    padded_batch_post_prompts = [" by the magistrate", " than to freeze here in the South"]
    unpadded_batch_post_prompts = [" by the magistrate", " by the candidate"]

    first_post_prompt_tokens = model.to_tokens(padded_batch_post_prompts[0], prepend_bos=False)
    first_full_prompt_tokens = t.cat([model.to_tokens(padded_batch_pre_prompts[0]), first_post_prompt_tokens], dim=-1)
    first_post_prompt_len = first_post_prompt_tokens.shape[-1]
    first_post_prompt_no_cache_logits = model(first_full_prompt_tokens)[0, -first_post_prompt_len:]

    if pre_padding is None:
        batch_pre_prompt_tokens = model.to_tokens(unpadded_batch_pre_prompts)
    else:
        batch_pre_prompt_tokens = model.to_tokens(padded_batch_pre_prompts, padding_side=pre_padding)
    if post_padding is None:
        batch_post_prompt_tokens = model.to_tokens(unpadded_batch_post_prompts, prepend_bos=False)
    else:
        batch_post_prompt_tokens = model.to_tokens(padded_batch_post_prompts, prepend_bos=False,
                                                   padding_side=post_padding)

    past_kv_cache = _cache(model, batch_pre_prompt_tokens.shape[0])
    model(batch_pre_prompt_tokens, past_kv_cache=past_kv_cache, padding_side=pre_padding)
    past_kv_cache.freeze()
    with_cache_logits = model(batch_post_prompt_tokens, past_kv_cache=past_kv_cache, padding_side=post_padding,
                              prepend_bos=False)
    if post_padding == "left" or post_padding is None:
        first_post_prompt_with_cache_logits = with_cache_logits[0, -first_post_prompt_len:]
    else:
        first_post_prompt_with_cache_logits = with_cache_logits[0, :first_post_prompt_len]
    no_cache_probs = t.softmax(first_post_prompt_no_cache_logits, dim=-1)
    with_cache_probs = t.softmax(first_post_prompt_with_cache_logits, dim=-1)
    assert t.allclose(no_cache_probs, with_cache_probs, atol=atol)


def test_freeze_cache(pretrained):
    model, atol = pretrained
    pre_prompt_tokens = model.to_tokens("I went to Staten Island,")
    new_tokens_1 = model.to_tokens(" I'm headed to the church to play bingo.", prepend_bos=False)
    past_kv_cache_1 = _cache(model, pre_prompt_tokens.shape[0])
    new_tokens_2 = model.to_tokens(" shine your light on me, Miss Liberty", prepend_bos=False)
    past_kv_cache_2 = _cache(model, pre_prompt_tokens.shape[0])

    model(pre_prompt_tokens, past_kv_cache=past_kv_cache_1)
    past_kv_cache_1.freeze()
    with_cache_logits_1 = model(new_tokens_1, past_kv_cache=past_kv_cache_1)

    model(pre_prompt_tokens, past_kv_cache=past_kv_cache_2)
    past_kv_cache_2.freeze()
    model(new_tokens_2, past_kv_cache=past_kv_cache_2)

    # caches frozen at the same point are identical
    assert len(past_kv_cache_1.entries) == len(past_kv_cache_2.entries)
    for entry_1, entry_2 in zip(past_kv_cache_1.entries, past_kv_cache_2.entries):
        assert entry_1.past_keys.shape == entry_2.past_keys.shape
        assert entry_1.past_values.shape == entry_2.past_values.shape
        assert t.allclose(entry_1.past_keys, entry_2.past_keys, atol=1e-3)
        assert t.allclose(entry_1.past_values, entry_2.past_values, atol=1e-3)

    # the same prompt on another cache frozen at the same point gives the same results
    with_cache_2_logits_1 = model(new_tokens_1, past_kv_cache=past_kv_cache_2)
    assert t.allclose(with_cache_logits_1, with_cache_2_logits_1, atol=atol)

    past_kv_cache_2.unfreeze()
    with_cache_2_logits_1 = model(new_tokens_1, past_kv_cache=past_kv_cache_2)
    for entry_1, entry_2 in zip(past_kv_cache_1.entries, past_kv_cache_2.entries):
        assert entry_1.past_keys.shape[1] < entry_2.past_keys.shape[1]
        assert entry_1.past_values.shape[1] < entry_2.past_values.shape[1]

    # the first run after unfreezing still saw the frozen past; the next one sees a longer past
    assert t.allclose(with_cache_logits_1, with_cache_2_logits_1, atol=atol)
    with_cache_2_logits_1 = model(new_tokens_1, past_kv_cache=past_kv_cache_2)
    assert not t.allclose(with_cache_logits_1, with_cache_2_logits_1, atol=atol)


def test_kv_cache_with_custom_attention_mask(pretrained):
    model, atol = pretrained
    tokens_pre = model.to_tokens("An apple")
    tokens_post = model.to_tokens(" a day keeps junk the", prepend_bos=False)
    tokens_whole = model.to_tokens("An apple a day keeps the")
    correct_logits = model(tokens_whole)
    past_kv_cache = _cache(model, tokens_pre.shape[0])
    model(tokens_pre, past_kv_cache=past_kv_cache)
    mask = t.ones_like(tokens_post)
    junk = model.to_tokens(" a day keeps", prepend_bos=False).shape[-1]  # TL: [[1, 1, 1, 0, 1]]
    mask[0, junk] = 0
    exp_logits = model(tokens_post, attention_mask=mask, past_kv_cache=past_kv_cache)
    assert t.allclose(correct_logits[:, -1], exp_logits[:, -1], atol=atol)


def test_kv_cache_and_start_at_layer(pretrained):
    model, atol = pretrained
    pre_prompt_tokens, single_new_token, full_prompt_tokens, no_cache_logits = _staten_island(model)
    past_kv_cache = _cache(model, pre_prompt_tokens.shape[0])
    model(pre_prompt_tokens, past_kv_cache=past_kv_cache)
    past_kv_cache.freeze()
    _, toks, shortformer_pos_embed, attn_mask = model.input_to_embed(single_new_token, past_kv_cache=past_kv_cache)
    _, cache = model.run_with_cache(single_new_token, stop_at_layer=2, past_kv_cache=past_kv_cache,
                                    names_filter="blocks.1.hook_resid_pre")
    with_cache_logits = model(cache["blocks.1.hook_resid_pre"], start_at_layer=1, tokens=toks,
                              shortformer_pos_embed=shortformer_pos_embed, attention_mask=attn_mask,
                              past_kv_cache=past_kv_cache)
    assert t.allclose(no_cache_logits[:, -1:], with_cache_logits, atol=atol)


def test_hooks_see_only_the_continued_tokens(pretrained):
    model, atol = pretrained
    pre = model.to_tokens("I went to Staten Island,")
    post = model.to_tokens(" to buy myself a mandolin", prepend_bos=False)
    full = t.cat([pre, post], dim=-1)
    steer = t.linspace(-1, 1, model.cfg.d_model)
    seen = []

    def steer_second(resid, hook):
        seen.append(tuple(resid.shape))
        resid[:, 1] += steer
        return resid

    def steer_second_of_post(resid, hook):
        resid[:, pre.shape[-1] + 1] += steer
        return resid

    past_kv_cache = _cache(model, 1)
    model(pre, past_kv_cache=past_kv_cache)
    continued = model.run_with_hooks(post, past_kv_cache=past_kv_cache,
                                     fwd_hooks=[("blocks.0.hook_resid_post", steer_second)])
    whole = model.run_with_hooks(full, fwd_hooks=[("blocks.0.hook_resid_post", steer_second_of_post)])
    assert seen == [(1, post.shape[-1], model.cfg.d_model)]
    assert t.allclose(continued, whole[:, pre.shape[-1]:], atol=atol)
    assert not t.allclose(continued, model(full)[:, pre.shape[-1]:], atol=1e-3)
    # a past computed under a write would be computed again without it: refused, as TL keeps what it made
    written = r"past was computed under hooks that write at \['blocks.0.hook_resid_post'\]"
    with pytest.raises(NotImplementedError, match=written):
        model(post, past_kv_cache=past_kv_cache)
    frozen = _cache(model, 1)
    model(pre, past_kv_cache=frozen)
    frozen.freeze()
    model.run_with_hooks(post, past_kv_cache=frozen, fwd_hooks=[("blocks.0.hook_resid_post", steer_second)])
    assert t.allclose(model(post, past_kv_cache=frozen), model(full)[:, pre.shape[-1]:], atol=atol)
    with pytest.raises(NotImplementedError, match="with past_kv_cache: not served"):
        model.run_with_hooks(post, past_kv_cache=frozen, fwd_hooks=[("blocks.0.attn.hook_pattern", lambda a, hook: a)])
