"""GPU only: the loss kernel (kernels/next_token_nll.py) compiled by Triton, against a float64
oracle and against its torch twin on the same device, at the vocabularies the research bench runs
(the CPU tests run it in Triton's interpreter: tests/test_kernels.py).

    XMIX_GPU_OUT=$OUT python3 -m pytest -q tests/gpu/test_loss_kernel_gpu.py -o addopts=""
"""
import pytest
import torch

from gpu_results import Results
from xmix_lens import kernels

pytestmark = pytest.mark.gpu
RESULTS = Results("loss_kernel_gpu.json")
UNWRITTEN = -7.0


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("V", [5000, 49152, 151936])  # a few tiles; the research checkpoint's; the 2.8B one's
def test_next_token_nll_equals_float64_log_softmax(V, softcap):
    gen = torch.Generator(device="cuda").manual_seed(V)
    N = 2048
    # fp32 rows of a [N, V + 8] product, as the engine hands over a block of its bf16 product
    logits = (torch.randn(N, V + 8, device="cuda", generator=gen) * 6)[:, :V]
    logits[5, 11] = 400.0  # one row's maximum far above the rest: the running sums rescale, not overflow
    bias = torch.randn(V, device="cuda", generator=gen)
    targets = torch.randint(0, V, (N,), device="cuda", generator=gen)
    targets[::64] = -1  # each sequence's last position: no next token, nothing written
    nll = torch.full((N,), UNWRITTEN, device="cuda")
    twin = nll.clone()

    kernels.next_token_nll(logits, bias, targets, nll, softcap)
    kernels.next_token_nll_torch(logits, bias, targets, twin, softcap)

    z = logits.double() + bias.double()
    z = softcap * torch.tanh(z / softcap) if softcap else z
    live = targets >= 0
    oracle = -z.log_softmax(-1).gather(-1, targets.clamp(min=0)[:, None])[:, 0]
    assert (nll[~live] == UNWRITTEN).all()
    error = (nll[live].double() - oracle[live]).abs().max().item()
    twin_error = (twin[live].double() - oracle[live]).abs().max().item()
    RESULTS.record(f"V{V}_softcap{softcap:g}", rows=N, max_abs_error=error, twin_max_abs_error=twin_error,
                   mean_nll=oracle[live].mean().item())
    torch.testing.assert_close(nll[live].double(), oracle[live], rtol=1e-5, atol=1e-4)
