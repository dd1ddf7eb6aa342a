"""GPU only (vllm 0.26.0): TransformerLens's wider API on a compiled engine with CUDA graphs.

Not collected by CI (pyproject ignores tests/gpu). Run there on a tiny GPT-2 folder (the CPU tests'
tests/tiny_models.tiny_gpt2, saved in fp16 to travel) as:
    XMIX_GPU_MODEL=.gpumodel_gpt2 XMIX_GPU_OUT=$OUT python3 -m pytest -q tests/gpu/test_tl_api_gpu.py -o addopts=""
Checked against TransformerLens's bridge on the GPU in fp32 with the same processing (the CPU twins:
compat_tests/test_weight_processing.py, tests/test_generate.py, compat_tests/test_model_surface.py,
compat_tests/test_idioms.py):
  - fold_ln's unembedding bias b_U registered on vLLM 0.26's output layer and passed to its logits
    processor: logits, b_U and greedy tokens as TransformerLens's processed model's;
  - generate's output_logits and input embeddings; run_with_cache's pos_slice; a constant write into
    one batch row.
"""
import os

import pytest
import torch

import xmix_lens  # noqa: F401  (its from_pretrained sets vLLM's environment for the in-process engine)
from gpu_results import Results
from xmix_lens import HookedTransformer

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "Steering vectors move the residual stream"]
RESULTS = Results("tl_api_gpu.json")
RTOL = 1e-3  # engine (vLLM on the GPU, fp32) against TransformerLens (HF eager, fp32): of the largest value


@pytest.fixture(scope="module")
def pair():
    from transformer_lens.model_bridge import TransformerBridge

    folder = os.environ["XMIX_GPU_MODEL"]
    model = HookedTransformer.from_pretrained(folder, fold_ln=True, gpu_memory_utilization=0.3,
                                              default_padding_side="right")
    tl = TransformerBridge.boot_transformers(folder, device="cuda", dtype=torch.float32)
    tl.enable_compatibility_mode(disable_warnings=True, **model.processing)
    yield model, tl
    model.shutdown()


def diff(a, b) -> float:
    """The largest difference, relative to the largest value of b."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))


def test_folded_unembedding_bias(pair):
    model, tl = pair
    tokens = tl.to_tokens(PROMPTS[:1])
    logits = model(tokens)
    ours = model.generate(tokens, max_new_tokens=8, do_sample=False, return_type="tokens")
    theirs = tl.generate(tokens, max_new_tokens=8, do_sample=False, stop_at_eos=False, verbose=False,
                         use_past_kv_cache=False)
    RESULTS.record("folded_unembedding_bias", b_U_max=float(model.b_U.detach().abs().max()), b_U_diff=diff(model.b_U, tl.b_U),
                   logits_diff=diff(logits, tl(tokens)), tokens_equal=bool(torch.equal(ours, theirs)),
                   compiled_engine=not model.engine.llm.llm_engine.vllm_config.model_config.enforce_eager)
    assert float(model.b_U.detach().abs().max()) > 0.01 and diff(model.b_U, tl.b_U) < 1e-6
    assert diff(logits, tl(tokens)) < RTOL and torch.equal(ours, theirs)


def test_generate_output_logits_and_embeddings(pair):
    model, tl = pair
    tokens = tl.to_tokens(PROMPTS[:1])
    ours = model.generate(tokens, max_new_tokens=4, do_sample=False, output_logits=True)
    theirs = tl.generate(tokens, max_new_tokens=4, do_sample=False, stop_at_eos=False, verbose=False,
                         output_logits=True, use_past_kv_cache=False)
    embeds = tl.W_E[tokens]  # token embeddings: the model adds the positions'
    from_embeds = model.generate(embeds, max_new_tokens=4, do_sample=False)
    RESULTS.record("generate", sequences_equal=bool(torch.equal(ours.sequences, theirs.sequences)),
                   step_logits_diff=max(diff(a, b) for a, b in zip(ours.logits, theirs.logits)),
                   embeddings_tokens_equal=bool(torch.equal(from_embeds, ours.sequences[:, tokens.shape[1]:])))
    assert torch.equal(ours.sequences, theirs.sequences)
    assert max(diff(a, b) for a, b in zip(ours.logits, theirs.logits)) < RTOL
    assert torch.equal(from_embeds, ours.sequences[:, tokens.shape[1]:])


def test_pos_slice_and_batch_row_write(pair):
    model, tl = pair
    tokens = tl.to_tokens(PROMPTS)
    names = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_z"]
    _, ours = model.run_with_cache(tokens, names_filter=names, pos_slice=(1, 4))
    _, theirs = tl.run_with_cache(tokens, names_filter=names, pos_slice=(1, 4))

    def ablate_row(act, hook):
        act[1, :] = 0.0

    written = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", ablate_row)])
    expected = tl.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", ablate_row)])
    RESULTS.record("pos_slice_and_batch_row_write", pos_slice_diff=max(diff(ours[n], theirs[n]) for n in names),
                   batch_row_write_logits_diff=diff(written, expected), where=str(ours[names[0]].device))
    assert max(diff(ours[n], theirs[n]) for n in names) < RTOL and ours[names[0]].is_cuda
    assert diff(written, expected) < RTOL
