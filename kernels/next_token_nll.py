"""The loss template: each row's negative log-likelihood of its next token, from fp32 logits, in one read.

    for n in range(N):
        if targets[n] >= 0:
            z = cap(logits[n] + bias)            # cap: soft-capping, z -> softcap * tanh(z / softcap)
            nll[n] = logsumexp(z) - z[targets[n]]

`return_type="loss"` needs log_softmax over the whole vocabulary at every position: on the research
checkpoint 64,000 positions x 49,152 entries, 12.6 GB of fp32 logits. Written in torch (add the bias,
slice off each row's last position, log_softmax, gather) it passes over them four times and makes
three copies; here each program reads its row once, keeping a running maximum and sum of exponentials
per lane (an online logsumexp), so only the matmul's own output is ever written.

Contracts (shared with the torch twin):
  logits   [N, V] fp32, rows contiguous (a row stride is allowed)
  bias     [V] fp32
  targets  [N] int64 token ids; -1 skips the row (a sequence's last position has no next token)
  nll      [N] fp32; only rows with a target are written
  softcap  0 for none
"""

import torch
import triton
import triton.language as tl

TILE = 2048  # vocabulary entries a program holds at once
FLOOR = tl.constexpr(-3.0e38)  # below any logit


@triton.jit
def capped(z, softcap):
    """Gemma 2's soft-capping, softcap * tanh(z / softcap), with tanh written from exp."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * z / softcap) + 1.0))


@triton.jit
def next_token_nll_kernel(
    logits_ptr, row_stride, bias_ptr, targets_ptr, nll_ptr, V, softcap,
    TILE: tl.constexpr, SOFTCAP: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)  # int64 offsets: N * V passes 2**31
    target = tl.load(targets_ptr + n)
    if target < 0:
        return
    row = logits_ptr + n * row_stride
    # a finite floor, not -inf: a lane past the vocabulary's end never makes -inf - -inf (nan)
    running_max = tl.full([TILE], FLOOR, dtype=tl.float32)
    running_sum = tl.zeros([TILE], dtype=tl.float32)
    for start in range(0, V, TILE):
        cols = start + tl.arange(0, TILE)
        z = tl.load(row + cols, mask=cols < V, other=0.0) + tl.load(bias_ptr + cols, mask=cols < V, other=0.0)
        if SOFTCAP:
            z = capped(z, softcap)
        z = tl.where(cols < V, z, FLOOR)
        new_max = tl.maximum(running_max, z)
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.where(cols < V, tl.exp(z - new_max), 0.0)
        running_max = new_max
    row_max = tl.max(running_max, axis=0)
    total = tl.sum(running_sum * tl.exp(running_max - row_max), axis=0)
    z_target = tl.load(row + target) + tl.load(bias_ptr + target)
    if SOFTCAP:
        z_target = capped(z_target, softcap)
    tl.store(nll_ptr + n, row_max + tl.log(total) - z_target)


def next_token_nll(logits, bias, targets, nll, softcap: float = 0.0) -> None:
    """nll[n] = logsumexp(z) - z[targets[n]], z = cap(logits[n] + bias), for each n with a target."""
    N, V = logits.shape
    assert logits.stride(1) == 1, "rows of logits must be contiguous"
    assert logits.dtype == bias.dtype == nll.dtype and bias.shape == (V,) and targets.shape == nll.shape == (N,)
    if N == 0:
        return
    next_token_nll_kernel[(N,)](logits, logits.stride(0), bias, targets, nll, V, float(softcap or 0.0),
                                TILE=min(TILE, triton.next_power_of_2(V)), SOFTCAP=bool(softcap))


def next_token_nll_torch(logits, bias, targets, nll, softcap: float = 0.0) -> None:
    """The same in plain torch (what the CPU engine runs): log_softmax, then the target's entry."""
    z = logits + bias  # every row, then the live ones kept: a masked copy first would pass over the logits again
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    every = -z.log_softmax(-1).gather(-1, targets.clamp(min=0)[:, None])[:, 0]
    live = targets >= 0
    nll[live] = every[live]
