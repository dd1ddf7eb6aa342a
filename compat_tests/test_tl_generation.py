"""TransformerLens's generation tests, run against xmix-lens.

Sources (TransformerLensOrg/TransformerLens, the stored versions the code index holds); every case keeps its
TL name and asserts the same behaviour, in code written anew for xmix-lens:
* tests/acceptance/test_generate_batch.py at 1aa008691defed6e94432e056cb59d9d74eec0f3 (HookedTransformer).
* tests/acceptance/test_hooked_transformer.py at a3b883de5b6f35a0f5d693ec74189c12b0af5342 (HookedTransformer):
  test_bloom_similarity_with_hf_model_with_kv_cache_activated.
* tests/integration/model_bridge/test_bridge_vs_hooked_comparison.py at 0747132d9f623bdfd32076ab5e57c83e5ea606e7:
  test_generation_consistency (HookedTransformer's generate against the bridge's; here xmix-lens's).
* tests/integration/model_bridge/test_bridge_generation.py at 16f7d6ce3bde55e16836dba33c1bd85a344a0821 and
  test_generate_attention_mask.py at 5b247c5d03b16ba6b05b1aef150d8a19eeb7ee94: TL 4.x's tests of generate's
  arguments (max_new_tokens, do_sample, temperature, top_k, padding_side; the bridge's attention_mask).
* tests/integration/model_bridge/test_batched_generate_position_ids.py at 1f8224d5e147c98e8f43f0d310e32bbd1578a4b6:
  test_accepted_model_generates_identically_with_and_without_cache.

Changes from the originals:
* Models: TL's hub models (gpt2, bloom-560m, distilgpt2) become the session's tiny Llama and tiny GPT-2
  engines (`served`); the attention-mask cases (distilgpt2 in TL) run on the tiny GPT-2 only.
* Where TL compares a model with itself (batched vs one by one, cached vs uncached), the case also compares
  xmix-lens's result with TransformerLens 4.3's bridge on the same weights (`reference`), always with
  use_past_kv_cache=False: with its KV cache, TL 4.3's bridge generates other tokens than without it on
  both tiny models (compat_tests/test_tl_utils.py), so it fails test_ht_generate_batch_matches_individual
  and the use_past_kv_cache=True attention-mask cases itself.
* test_bloom_similarity_with_hf_model_with_kv_cache_activated: TL builds the model with
  default_prepend_bos=False; here the shared engine gets prepend_bos=False per call, and HF's generate the
  same prompt tokens with an all-ones attention mask.
* test_bridge_generation.py's classes are flattened into functions of the same names. Not ported:
  test_compat_greedy_matches_non_compat (the bridge's compatibility mode); from
  test_generate_attention_mask.py the cases that spy on the HF module's forward or patch the bridge's
  tokenizer away (test_the_mask_reaches_every_step_not_just_the_first,
  test_inputs_embeds_forwards_the_mask_untouched, test_padding_side_without_a_tokenizer_is_an_error,
  test_padding_side_without_a_pad_token_is_an_error, test_a_tokenizerless_bridge_still_accepts_an_explicit_mask);
  from test_batched_generate_position_ids.py the OPT cases (a hub model; TL's position-id gate).
"""
import pytest
import torch

MODELS = ["tiny-llama", "tiny-gpt2"]
BATCH_PROMPTS = ["Hello, my dog is cute", "This is a much longer text. Hello, my cat is cute"]
ARGMAX = dict(temperature=0.0, do_sample=False)  # test_bridge_generation.py's greedy settings


@pytest.fixture(params=MODELS)
def pair(request, served, reference):
    """xmix-lens's engine and TransformerLens's bridge on the same weights."""
    return served[request.param], reference[request.param].bridge


def tl_generate(tl, input, **kwargs):
    """TransformerLens's generate, without its KV cache (see the module's docstring)."""
    input = input.cpu() if isinstance(input, torch.Tensor) else input
    return tl.generate(input, **{"use_past_kv_cache": False, "verbose": False, **kwargs})


# ---- tests/acceptance/test_generate_batch.py ----
def test_ht_generate_batch_matches_individual(pair):
    xl, tl = pair
    individual = [xl.generate(p, verbose=False, do_sample=False) for p in BATCH_PROMPTS]
    batched = xl.generate(BATCH_PROMPTS, verbose=False, do_sample=False)
    assert batched == individual
    assert individual == [tl_generate(tl, p, do_sample=False) for p in BATCH_PROMPTS]


def test_ht_generate_batch_without_kv_cache(pair):
    xl, tl = pair
    individual = [xl.generate(p, verbose=False, do_sample=False, use_past_kv_cache=False) for p in BATCH_PROMPTS]
    batched = xl.generate(BATCH_PROMPTS, verbose=False, do_sample=False, use_past_kv_cache=False)
    assert batched == individual
    assert batched == tl_generate(tl, BATCH_PROMPTS, do_sample=False)


def test_batched_text_comes_back_as_tokens_left_padded(pair):
    """Beyond TL's file: return_type="tokens" on a batch of strings gives TL's layout, the prompts
    left-padded, a row that stopped at EOS filled with EOS (one stop id, or several)."""
    xl, tl = pair
    free = xl.generate(BATCH_PROMPTS, max_new_tokens=6, return_type="tokens", stop_at_eos=False, **ARGMAX)
    assert torch.equal(free.cpu(), tl_generate(tl, BATCH_PROMPTS, max_new_tokens=6, return_type="tokens",
                                               stop_at_eos=False, **ARGMAX))
    early = int(free[0, -4])  # row 0's third new token, made its stop token
    for stop in (early, [early, xl.tokenizer.eos_token_id]):
        ours = xl.generate(BATCH_PROMPTS, max_new_tokens=6, return_type="tokens", eos_token_id=stop, **ARGMAX)
        theirs = tl_generate(tl, BATCH_PROMPTS, max_new_tokens=6, return_type="tokens", eos_token_id=stop, **ARGMAX)
        assert ours.tolist() == theirs.tolist()


# ---- tests/acceptance/test_hooked_transformer.py ----
@pytest.mark.parametrize("model_name", MODELS)
def test_bloom_similarity_with_hf_model_with_kv_cache_activated(served, model_name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import MODEL_DIRS

    text, model, folder = "Hello world!", served[model_name], str(MODEL_DIRS[model_name]())
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    output_tl = model.generate(text, do_sample=False, use_past_kv_cache=True, verbose=False, max_new_tokens=10,
                               prepend_bos=False)
    tokens = hf_tokenizer(text, return_tensors="pt").input_ids
    assert torch.equal(tokens, model.to_tokens(text, prepend_bos=False).cpu())  # the premise: the same prompt
    with torch.no_grad():
        output_hf_tokens = hf_model.generate(tokens, attention_mask=torch.ones_like(tokens), do_sample=False,
                                             max_new_tokens=10, pad_token_id=hf_tokenizer.pad_token_id)
    assert output_tl == hf_tokenizer.decode(output_hf_tokens[0], skip_special_tokens=True)


# ---- tests/integration/model_bridge/test_bridge_vs_hooked_comparison.py ----
def test_generation_consistency(pair):
    xl, tl = pair
    tokens = xl.to_tokens("The future of AI")
    ours, theirs = xl.generate(tokens, max_new_tokens=5, **ARGMAX), tl_generate(tl, tokens, max_new_tokens=5, **ARGMAX)
    assert xl.to_string(ours[0]) == tl.to_string(theirs[0])


# ---- tests/integration/model_bridge/test_bridge_generation.py ----
def test_greedy_produces_tokens(pair):
    xl, tl = pair
    tokens = xl.to_tokens("The quick brown")
    output = xl.generate(tokens, max_new_tokens=5, **ARGMAX)
    assert output.shape[1] > tokens.shape[1]
    assert torch.equal(output.cpu(), tl_generate(tl, tokens, max_new_tokens=5, **ARGMAX))


def test_greedy_is_deterministic(pair):
    xl, _ = pair
    tokens = xl.to_tokens("Hello world")
    assert torch.equal(xl.generate(tokens, max_new_tokens=5, **ARGMAX), xl.generate(tokens, max_new_tokens=5, **ARGMAX))


def test_greedy_output_decodable(pair):
    xl, _ = pair
    text = xl.to_string(xl.generate(xl.to_tokens("The meaning of life"), max_new_tokens=10, **ARGMAX)[0])
    assert isinstance(text, str)
    assert len(text) > len("The meaning of life")


def test_temperature_affects_output(pair):
    xl, _ = pair
    tokens = xl.to_tokens("Once upon a time")
    torch.manual_seed(42)
    out_low = xl.generate(tokens, max_new_tokens=10, temperature=0.1, do_sample=True)
    torch.manual_seed(42)
    out_high = xl.generate(tokens, max_new_tokens=10, temperature=2.0, do_sample=True)
    assert out_low.shape[1] > tokens.shape[1] and out_high.shape[1] > tokens.shape[1]


def test_top_k_limits_vocabulary(pair):
    xl, _ = pair
    tokens = xl.to_tokens("The cat")
    torch.manual_seed(123)
    output = xl.generate(tokens, max_new_tokens=5, temperature=1.0, do_sample=True, top_k=10)
    assert output.shape[1] > tokens.shape[1]
    assert (output >= 0).all() and (output < xl.cfg.d_vocab).all()


def test_single_token_input(pair):
    xl, _ = pair
    tokens = xl.to_tokens("Hello")
    assert xl.generate(tokens, max_new_tokens=3, **ARGMAX).shape[1] > tokens.shape[1]


def test_max_new_tokens_respected(pair):
    xl, _ = pair
    tokens = xl.to_tokens("Test")
    assert xl.generate(tokens, max_new_tokens=5, **ARGMAX).shape[1] <= tokens.shape[1] + 5


# ---- tests/integration/model_bridge/test_batched_generate_position_ids.py ----
def test_accepted_model_generates_identically_with_and_without_cache(pair):
    xl, tl = pair
    prompts = ["The capital of France is the city of", "Hi"]
    kwargs = dict(max_new_tokens=4, do_sample=False, verbose=False, output_logits=True)
    cached = torch.stack(list(xl.generate(list(prompts), use_past_kv_cache=True, **kwargs).logits))
    uncached = torch.stack(list(xl.generate(list(prompts), use_past_kv_cache=False, **kwargs).logits))
    torch.testing.assert_close(cached, uncached, rtol=0, atol=1e-3)
    theirs = torch.stack(list(tl_generate(tl, list(prompts), **kwargs).logits))
    torch.testing.assert_close(uncached.cpu(), theirs, rtol=0, atol=1e-3)


# ---- tests/integration/model_bridge/test_generate_attention_mask.py (tiny GPT-2) ----
GREEDY = dict(max_new_tokens=5, do_sample=False, verbose=False)


@pytest.fixture
def gpt2(served, reference):
    return served["tiny-gpt2"], reference["tiny-gpt2"].bridge


@pytest.fixture
def prompt(gpt2):
    return gpt2[0].to_tokens("The capital of France is")


@pytest.fixture
def unpadded_continuation(gpt2, prompt):
    return gpt2[0].generate(prompt, **GREEDY)[0, prompt.shape[1]:].tolist()


def _left_pad(model, tokens, n_pad):
    pad_id = model.tokenizer.pad_token_id
    pad_id = model.tokenizer.eos_token_id if pad_id is None else pad_id
    padded = torch.cat([torch.full((1, n_pad), pad_id, dtype=tokens.dtype, device=tokens.device), tokens], dim=1)
    mask = torch.cat([torch.zeros(1, n_pad, dtype=torch.long), torch.ones(1, tokens.shape[1], dtype=torch.long)], 1)
    return padded, mask


@pytest.mark.parametrize("use_past_kv_cache", [True, False])
@pytest.mark.parametrize("n_pad", [1, 3, 7])
def test_attention_mask_recovers_the_unpadded_continuation(gpt2, prompt, unpadded_continuation, n_pad,
                                                           use_past_kv_cache):
    padded, mask = _left_pad(gpt2[0], prompt, n_pad)
    out = gpt2[0].generate(padded, attention_mask=mask, use_past_kv_cache=use_past_kv_cache, **GREEDY)
    assert out[0, n_pad + prompt.shape[1]:].tolist() == unpadded_continuation


def test_without_a_mask_the_pads_are_treated_as_context(gpt2, prompt, unpadded_continuation):
    model, tl = gpt2
    padded, _ = _left_pad(model, prompt, 4)
    out = model.generate(padded, **GREEDY)
    assert out[0, 4 + prompt.shape[1]:].tolist() != unpadded_continuation
    assert torch.equal(out.cpu(), tl_generate(tl, padded, **GREEDY))


def test_padding_side_left_is_applied_to_token_input(gpt2, prompt, unpadded_continuation):
    padded, _ = _left_pad(gpt2[0], prompt, 4)
    out = gpt2[0].generate(padded, padding_side="left", **GREEDY)
    assert out[0, 4 + prompt.shape[1]:].tolist() == unpadded_continuation


def test_padding_side_is_restored_afterwards(gpt2, prompt):
    model, _ = gpt2
    before = model.tokenizer.padding_side
    model.generate(_left_pad(model, prompt, 3)[0], padding_side="left", **GREEDY)
    assert model.tokenizer.padding_side == before


def test_explicit_mask_wins_over_the_padding_side_heuristic(gpt2, prompt, unpadded_continuation):
    padded, mask = _left_pad(gpt2[0], prompt, 4)
    out = gpt2[0].generate(padded, attention_mask=mask, padding_side="right", **GREEDY)
    assert out[0, 4 + prompt.shape[1]:].tolist() == unpadded_continuation


def test_interior_gap_needs_the_explicit_mask(gpt2, prompt):
    model, _ = gpt2
    gapped, mask = prompt.clone(), torch.ones_like(prompt)
    gapped[0, 2], mask[0, 2] = model.tokenizer.eos_token_id, 0
    compact = torch.cat([prompt[:, :2], prompt[:, 3:]], dim=1)
    reference = model.generate(compact, **GREEDY)[0, compact.shape[1]:].tolist()
    assert model.generate(gapped, attention_mask=mask, **GREEDY)[0, prompt.shape[1]:].tolist() == reference


def test_rows_padded_to_different_lengths(gpt2):
    model, _ = gpt2
    prompts = [model.to_tokens("The capital of France is"), model.to_tokens("Hello")]
    width = max(t.shape[1] for t in prompts)
    padded = [_left_pad(model, t, width - t.shape[1]) for t in prompts]
    out = model.generate(torch.cat([p for p, _ in padded]), attention_mask=torch.cat([m for _, m in padded]),
                         **GREEDY)
    for index, tokens in enumerate(prompts):
        assert out[index, width:].tolist() == model.generate(tokens, **GREEDY)[0, tokens.shape[1]:].tolist()


def test_unpadded_generation_is_unchanged(gpt2, prompt, unpadded_continuation):
    out = gpt2[0].generate(prompt, attention_mask=torch.ones_like(prompt), **GREEDY)
    assert out[0, prompt.shape[1]:].tolist() == unpadded_continuation


def test_string_and_list_input_still_work(gpt2):
    model, _ = gpt2
    solo = model.generate("The capital of France is", **GREEDY)
    batched = model.generate(["The capital of France is", "Hi"], **GREEDY)
    assert isinstance(solo, str) and solo.startswith("The capital of France is")
    assert batched[0] == solo


def test_mask_shape_must_match_the_prompt(gpt2, prompt):
    with pytest.raises(ValueError, match="attention_mask has shape"):
        gpt2[0].generate(prompt, attention_mask=torch.ones(1, prompt.shape[1] + 5, dtype=torch.long), **GREEDY)
