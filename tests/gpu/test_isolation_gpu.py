"""GPU only (the lent H200, vllm 0.26.0): a hook that writes NaN never reaches another request.

Not collected by CI (pyproject ignores tests/gpu). Run there as:
    XMIX_GPU_MODEL=.gpumodel XMIX_GPU_OUT=$OUT python3 -m pytest -q tests/gpu/test_isolation_gpu.py -o addopts=""
The CPU test (tests/test_reliability.py) on vLLM's GPU runner, CUDA graphs on: the call is told
which hook point and rows, and plain calls after it equal the same calls before, bit for bit.
"""
import os

import pytest
import torch

import xmix_lens  # noqa: F401  (its from_pretrained sets vLLM's environment for the in-process engine)
from gpu_results import Results
from xmix_lens import HookedServedModel, NonFiniteError

pytestmark = pytest.mark.gpu
RESULTS = Results("isolation_gpu.json")
SITE = "blocks.0.hook_resid_post"
PROMPT = "The quick brown fox jumps over the lazy dog and then runs far away into the woods"


def test_nan_from_a_hook_never_reaches_another_request():
    model = HookedServedModel.from_pretrained(os.environ.get("XMIX_GPU_MODEL", ".gpumodel"), dtype="bfloat16",
                                              load_format="dummy", max_model_len=512, gpu_memory_utilization=0.3)
    long, short = " ".join([PROMPT] * 5), "Hello there my friend"

    def plain():
        return model(short), model.generate(short, max_new_tokens=8, do_sample=False, return_type="tokens")

    before = plain()
    errors = []
    for call in (lambda: model.run_with_hooks(long, fwd_hooks=[(SITE, lambda act, hook: act / 0.0)]),
                 lambda: model.generate(long, max_new_tokens=8, do_sample=False,
                                        fwd_hooks=[(SITE, lambda act, hook: act / 0.0)])):
        with pytest.raises(NonFiniteError) as raised:
            call()
        errors.append(str(raised.value))
    after = plain()
    same = [bool(torch.equal(a, b)) for a, b in zip(after, before)]
    RESULTS.record("nan_isolation", errors=errors, plain_logits_equal=same[0], plain_tokens_equal=same[1],
                   finite_before=bool(torch.isfinite(before[0]).all()))
    assert all(SITE in e for e in errors)
    assert all(same)
