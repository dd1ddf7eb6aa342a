"""GPU only (vllm 0.26.0): a research call's results and the weights where TransformerLens puts them.

Not collected by CI (pyproject ignores tests/gpu). Run there as:
    python3 tests/gpu/tp_compare.py make-model .gpumodel /tmp/tpmodel
    XMIX_GPU_MODEL=/tmp/tpmodel XMIX_GPU_OUT=$OUT python3 -m pytest -q tests/gpu/test_research_gpu.py -o addopts=""
One engine (vLLM's default compilation and CUDA graphs) on a seeded random bf16 checkpoint, and
TransformerLens's bridge booted on the same folder on the GPU in bf16. Checked (the CPU twin:
compat_tests/test_where_results_live.py):
  - logits, losses, cached activations and backward-hook gradients: on the GPU in bf16, as TL's;
  - every parameter of model.tl is a view of the engine's own memory (no second copy of the model);
  - the weights equal TransformerLens's.
"""
import os

import pytest
import torch

import xmix_lens  # noqa: F401  (its from_pretrained sets vLLM's environment for the in-process engine)
from gpu_results import Results
from xmix_lens import HookedServedModel

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "Steering vectors move the residual stream"]
RESULTS = Results("research_gpu.json")


@pytest.fixture(scope="module")
def pair():
    from transformer_lens.model_bridge import TransformerBridge

    folder = os.environ["XMIX_GPU_MODEL"]
    model = HookedServedModel.from_pretrained(folder, dtype="bfloat16", gpu_memory_utilization=0.3)
    tl = TransformerBridge.boot_transformers(folder, device="cuda", dtype=torch.bfloat16)
    tl.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    yield model, tl
    model.shutdown()


def where(t: torch.Tensor) -> tuple:
    return t.dtype, t.device.type


def test_results_on_the_gpu_in_the_models_dtype(pair):
    model, tl = pair
    tokens = model.to_tokens(PROMPTS)
    found = {}
    for name, kwargs in (("logits", {}), ("loss", {"return_type": "loss"}),
                         ("loss_per_token", {"return_type": "loss", "loss_per_token": True})):
        ours, theirs = model(tokens, **kwargs), tl(tokens.cuda(), **kwargs)
        found[name] = [str(where(ours)), str(where(theirs))]
        assert where(ours) == where(theirs) == (torch.bfloat16, "cuda"), name
    points = ["blocks.0.hook_resid_post", "blocks.3.attn.hook_z"]
    _, cache = model.run_with_cache(tokens, names_filter=points)
    _, tl_cache = tl.run_with_cache(tokens.cuda(), names_filter=points)
    for point in points:
        found[point] = [str(where(cache[point])), str(where(tl_cache[point]))]
        assert where(cache[point]) == where(tl_cache[point]), point
    grads = {}
    for name, m, t in (("ours", model, tokens), ("theirs", tl, tokens.cuda())):
        m.add_hook("blocks.1.hook_resid_post", lambda g, hook, name=name: grads.update({name: g}), dir="bwd")
        try:
            m(t, return_type="loss").backward()
        finally:
            m.reset_hooks()
    found["gradient"] = [str(where(grads["ours"])), str(where(grads["theirs"]))]
    assert where(grads["ours"]) == where(grads["theirs"]) == (torch.bfloat16, "cuda")
    RESULTS.record("results", **found)


def test_model_tl_is_the_engines_memory(pair):
    model, tl = pair
    engine = model.engine.checkpoint_tensors()
    served = {t.untyped_storage().data_ptr() for t in engine.values()}
    params = dict(model.tl.named_parameters())
    shared = [n for n, p in params.items() if p.untyped_storage().data_ptr() in served]
    for name in ("W_E", "W_Q", "W_O", "W_in", "W_out", "W_U"):
        assert torch.equal(getattr(model, name), getattr(tl, name)), name
        assert getattr(model, name).device.type == "cuda"
    RESULTS.record("weights", parameters=len(params), engines_memory=len(shared),
                   not_shared=sorted(set(params) - set(shared)))
    assert len(shared) == len(params)
