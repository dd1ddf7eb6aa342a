"""The renorm template: RMSNorm again on chosen rows, after a write changed the residual it normalises.

    for r in rows:
        out[r] = (x[r] / sqrt(mean(x[r] ** 2) + eps)) * weight

A residual hook point sits in front of vLLM's fused residual add + RMSNorm. The site runs after
the fused op (which then stays fused, and Inductor's fusions around it intact: sites.py), on the
sum it returns; where a write there changed a token's sum, that token's normalised output is
stale, and this template makes it again. Its rows are the write's own (control rows: -1 where the
write is off), so a step where no write is on launches programs that return at once.

The math is vLLM's RMSNorm's: x in fp32, times the reciprocal root of its mean square plus eps,
cast to the weight's dtype, times the weight, cast to out's dtype.

A write kernel that holds its rows whole (affine_write's row kernel, the generated kernels) takes
the renorm as an epilogue instead (`Renorm`, its arguments; `normalized_row`, its math): the rows it
wrote normalised again in the same launch, one launch a write less at a residual site.

Contracts (shared with the torch twin):
  x       [T, F] fp32 or bf16, rows contiguous (a row stride is allowed)
  rows    [R] int32 token indices into x and out; -1 skips the entry
  weight  [F], x's dtype
  out     [T, F], rows contiguous; only rows[:] are written
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Renorm(NamedTuple):
    """What a write at a residual site passes its kernel: out's rows it writes made again as the
    RMSNorm of x's (`rms_norm_rows`'s arguments but x and rows, which are the write's)."""

    weight: torch.Tensor
    eps: float
    out: torch.Tensor


@triton.jit
def normalized_row(x, mean_square, weight, eps):
    """vLLM's RMSNorm of fp32 values x whose row has this mean square: x times the reciprocal root of
    it plus eps, rounded to the weight's dtype, times the weight, in fp32. A product of two bf16
    values is exact in fp32, so the caller's store rounds it as vLLM's bf16 product does (Triton's
    interpreter mis-multiplies bf16 tensors)."""
    return (x * tl.rsqrt(mean_square + eps)).to(weight.dtype).to(tl.float32) * weight.to(tl.float32)

TILE = 2048  # features a program holds at once (registers): wider rows take several tiles


@triton.jit
def rms_norm_rows_kernel(
    x_ptr, x_row_stride, rows_ptr, weight_ptr, out_ptr, out_row_stride, F, eps,
    TILE: tl.constexpr,
):
    row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)  # int64 offsets: T * F can pass 2**31
    if row < 0:  # a token whose write is off: its fused output stands
        return
    squares = tl.zeros([TILE], dtype=tl.float32)
    for start in range(0, F, TILE):
        cols = start + tl.arange(0, TILE)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < F, other=0.0).to(tl.float32)
        squares += x * x
    mean_square = tl.sum(squares, axis=0) / F
    for start in range(0, F, TILE):
        cols = start + tl.arange(0, TILE)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < F, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + cols, mask=cols < F, other=0.0)
        y = normalized_row(x, mean_square, w, eps)
        tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=cols < F)


def rms_norm_rows(x, rows, weight, eps: float, out) -> None:
    """out[r] = RMSNorm(x[r]) * weight for each r >= 0 in rows."""
    R, F = rows.numel(), x.shape[1]
    assert x.stride(1) == 1 and out.stride(1) == 1, "rows of x and out must be contiguous"
    assert weight.shape == (F,) and out.shape[1] == F
    if R == 0:
        return
    rms_norm_rows_kernel[(R,)](x, x.stride(0), rows, weight, out, out.stride(0), F, eps,
                               TILE=min(TILE, triton.next_power_of_2(F)))


def rms_norm_rows_torch(x, rows, weight, eps: float, out) -> None:
    """The same in plain torch (what the CPU engine runs): vLLM's RMSNorm, written as it is."""
    live = rows[rows >= 0].long()
    xf = x[live].float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out[live] = (y.to(weight.dtype) * weight).to(out.dtype)
