"""TransformerLens's ActivationCache acceptance tests (logit attribution, apply_ln), run against xmix-lens.

Source: TransformerLensOrg/TransformerLens, tests/acceptance/test_activation_cache.py at commit
0f232d9df54b6ffb4d61aa8f1c6c67edbe372548 (the stored version; it tests `HookedTransformer`). Each TL
case keeps its name and is parametrized over the session's tiny Llama and tiny GPT-2.

Changes from the original:
* Model: TL loads the hub model "solu-2l" (per case) with center_unembed, center_writing_weights,
  fold_ln and refactor_factored_attn_matrices. Here the session engines (`served` fixture) serve
  the raw weights (weight processing is a TL load-time option, not what is tested; served processed
  weights are tested in test_weight_processing.py). The
  IOI prompts and name pairs are TL's; every name is one token in both tokenizers (SmolLM2's for
  the tiny Llama, GPT-2's for the tiny GPT-2), as they are in solu-2l's.
* The references are computed as TL computes them, from the same model and cache: the residual
  stack scaled by `cache.apply_ln_to_stack`, dotted with the answer directions of
  `model.tokens_to_residual_directions`. TL's einsum (fancy_einsum) is written with torch.einsum.
* Tolerances: TL's atol=1e-7 checks are kept where TL has them (the two ways share one cache).
  test_logit_attrs_works_for_all_input_shapes used isclose's defaults (atol 1e-8), which fp32
  rounding between the two summation orders exceeds near zero; it uses atol=1e-5 (ROUNDING).
* test_accumulated_resid_with_apply_ln: the original asserts `accumulated_resid(apply_ln=True) ==
  apply_ln_to_stack(accumulated_resid())`, the semantics of TL's ActivationCache at that commit.
  TL 4.x changed it on purpose (its docstring: apply_ln "recomputes normalization statistics (mean
  and variance/RMS) for each intermediate state in the stack", the logit lens), and TL 4.3 fails the
  original assertion itself, on raw and on processed weights (checked 2026-12-01). The cache here
  is TL 4.3's class, so the case asserts TL 4.3's values on the same weights, and that they are not
  the old ones. The other apply_ln cases (decompose_resid, stack_head_results, ...) are unchanged.
"""
import pytest
import torch

MODELS = ["tiny-llama", "tiny-gpt2"]
IOI_PROMPT_FORMATS = [
    "When John and Mary went to the shops,{} gave the bag to",
    "When Tom and James went to the park,{} gave the ball to",
    "When Dan and Sid went to the shops,{} gave an apple to",
    "After Martin and Amy went to the park,{} gave a drink to",
]
# test_logit_attrs_works_for_all_input_shapes: TL uses isclose's default atol (1e-8); the logit
# attributions (|x| up to ~2 here) and the reference sum over d_model in different orders, which in
# fp32 differs by up to ~1e-6 (7e-7 measured on the tiny Llama, 2026-12-01).
ROUNDING = 1e-5
IOI_NAMES = [(" Mary", " John"), (" Tom", " James"), (" Dan", " Sid"), (" Martin", " Amy")]


def ioi_tokens_and_answer_tokens(model):
    prompts, answer_tokens = [], []
    for fmt, names in zip(IOI_PROMPT_FORMATS, IOI_NAMES):
        for j in range(2):
            correct, incorrect = names[j], names[1 - j]
            answer_tokens.append((model.to_single_token(correct), model.to_single_token(incorrect)))
            prompts.append(fmt.format(incorrect))  # the correct answer is the indirect object
    return model.to_tokens(prompts, prepend_bos=True), torch.tensor(answer_tokens)


@pytest.fixture(params=MODELS)
def model(request, served):
    m = served[request.param]
    m.reset_hooks(including_permanent=True)
    return m


@pytest.fixture
def ioi(model):
    tokens, answer_tokens = ioi_tokens_and_answer_tokens(model)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    return tokens, answer_tokens, cache


def logit_diff_directions(model, answer_tokens):
    dirs = model.tokens_to_residual_directions(answer_tokens)
    return dirs[:, 0] - dirs[:, 1]


@torch.no_grad()
def test_logit_attrs_matches_reference_code(model, ioi):
    tokens, answer_tokens, cache = ioi
    accumulated = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1)
    scaled = cache.apply_ln_to_stack(accumulated, layer=-1, pos_slice=-1)
    ref = torch.einsum("...bd,bd->...", scaled, logit_diff_directions(model, answer_tokens)) / len(tokens)
    ours = cache.logit_attrs(accumulated, pos_slice=-1, tokens=answer_tokens[:, 0],
                             incorrect_tokens=answer_tokens[:, 1]).mean(dim=-1)
    assert torch.isclose(ref, ours, atol=1e-7).all()


@torch.no_grad()
def test_logit_attrs_works_for_all_input_shapes(model, ioi):
    tokens, answer_tokens, cache = ioi
    accumulated = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, return_labels=False)
    scaled = cache.apply_ln_to_stack(accumulated, layer=-1, pos_slice=-1)
    ref = torch.einsum("...d,...d->...", scaled, logit_diff_directions(model, answer_tokens))

    got = cache.logit_attrs(accumulated, pos_slice=-1, tokens=answer_tokens[:, 0],
                            incorrect_tokens=answer_tokens[:, 1])
    assert torch.isclose(ref, got, atol=ROUNDING).all(), "all tokens"

    b = -1
    variants = {
        "single token (tensor)": dict(tokens=answer_tokens[b, 0], incorrect_tokens=answer_tokens[b, 1]),
        "single token (int)": dict(tokens=int(answer_tokens[b, 0]), incorrect_tokens=int(answer_tokens[b, 1])),
        "single token (str)": dict(tokens=model.to_string(answer_tokens[b, 0]),
                                   incorrect_tokens=model.to_string(answer_tokens[b, 1])),
    }
    for label, toks in variants.items():
        got = cache.logit_attrs(accumulated, batch_slice=b, pos_slice=-1, **toks)
        assert torch.isclose(ref[:, b], got, atol=ROUNDING).all(), label

    got = cache.logit_attrs(accumulated[:, b, :], has_batch_dim=False, batch_slice=b, pos_slice=-1,
                            tokens=answer_tokens[b, 0], incorrect_tokens=answer_tokens[b, 1])
    assert torch.isclose(ref[:, b], got, atol=ROUNDING).all(), "stack without a batch dim"

    batch = [2, 5, 7]
    got = cache.logit_attrs(accumulated, batch_slice=batch, pos_slice=-1,
                            tokens=answer_tokens[batch, 0], incorrect_tokens=answer_tokens[batch, 1])
    assert torch.isclose(ref[:, batch], got, atol=ROUNDING).all(), "list batch slice"


@torch.no_grad()
@pytest.mark.parametrize("name", MODELS)
def test_accumulated_resid_with_apply_ln(name, served, reference):
    """TL 4.x's semantics (see the header): the final norm recomputed for each layer's residual, as
    TransformerLens 4.3 computes it on the same weights."""
    tokens, _ = ioi_tokens_and_answer_tokens(served[name])
    _, cache = served[name].run_with_cache(tokens)
    _, theirs = reference[name].bridge.run_with_cache(tokens)
    got = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, apply_ln=True)
    ref = theirs.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, apply_ln=True)
    assert torch.allclose(ref, got, atol=1e-4)
    scaled_by_final = cache.apply_ln_to_stack(cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1),
                                              layer=-1, pos_slice=-1)
    assert not torch.allclose(scaled_by_final, got, atol=1e-4)  # the 3.x semantics the original asserted


@torch.no_grad()
def test_decompose_resid_with_apply_ln(ioi):
    _, _, cache = ioi
    ref = cache.apply_ln_to_stack(cache.decompose_resid(layer=-1, pos_slice=-1), layer=-1, pos_slice=-1)
    got = cache.decompose_resid(layer=-1, pos_slice=-1, apply_ln=True)
    assert torch.isclose(ref, got, atol=1e-7).all()


@torch.no_grad()
def test_stack_head_results_with_apply_ln(ioi):
    _, _, cache = ioi
    ref = cache.apply_ln_to_stack(cache.stack_head_results(layer=-1, pos_slice=-1), layer=-1, pos_slice=-1)
    got = cache.stack_head_results(layer=-1, pos_slice=-1, apply_ln=True)
    assert torch.isclose(ref, got, atol=1e-7).all()


@torch.no_grad()
def test_stack_neuron_results_with_apply_ln(ioi):
    _, _, cache = ioi
    ref = cache.apply_ln_to_stack(cache.stack_neuron_results(layer=-1, pos_slice=-1), layer=-1, pos_slice=-1)
    got = cache.stack_neuron_results(layer=-1, pos_slice=-1, apply_ln=True)
    assert torch.isclose(ref, got, atol=1e-7).all()
