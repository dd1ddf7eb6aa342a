"""A read that reduces on the device before the transfer: project chosen rows, keep K numbers.

    for i, r in enumerate(rows):
        out[dest[i]] = x[r] @ W + b

Probe scores, per-token dot products with a direction, logit-lens-like projections: the ring
buffer then carries K values a token instead of F.

Contracts (shared with the torch twin):
  x     [T, F] fp32 or bf16, rows contiguous (a row stride is allowed)
  rows  [R] int32 token indices into x; -1 skips the entry (a gated-off token)
  W     [F, K] fp32 contiguous, b [K] fp32
  out   [capacity, K] any float dtype, rows contiguous; only rows dest[:] are written
  dest  [R] int32 slots in out, distinct
The math is fp32; the result is cast to out's dtype.

Two kernels: `project_read_kernel` takes rows in blocks of 16 and outputs in blocks (tl.dot), for
more than 16 outputs; `project_read_row_kernel` one row per program for up to 16 (on an H200, a
2-value probe of 32 tokens of 4,096 features: 2.9 us, bench/kernels.py).
"""

import triton
import triton.language as tl

from .affine_write import MAX_ROW_TILE, NARROW_RANK as NARROW_OUTPUTS
from .program_format import NARROW_PRODUCT

BLOCK_ROWS = 16  # tl.dot needs >= 16; more rows a program only slows decode steps (few rows)
BLOCK_FEATURES = 128
MAX_BLOCK_OUTPUTS = 64
# Up to NARROW_OUTPUTS outputs (probe scores), one row per program, broadcast products summed per
# tile instead of tl.dot over 16-row blocks: a decode step's few programs walked the row in 32
# dependent steps each (affine_write.py says the same of its low-rank term).


# K == 1 (one probe) is common, and Triton's default specialisation of arguments equal to 1 made
# that kernel 3x slower on an H200 than K == 2: keep K a plain runtime value.
@triton.jit(do_not_specialize=["R", "K"])  # R: a step's rows, a kernel for every count
def project_read_kernel(
    x_ptr, x_row_stride, rows_ptr, w_ptr, b_ptr, out_ptr, out_row_stride, dest_ptr, R, F, K,
    BLOCK_ROWS: tl.constexpr, BLOCK_FEATURES: tl.constexpr, BLOCK_OUTPUTS: tl.constexpr,
):
    # Program (i, j) computes out[dest[rows block i], outputs block j]: a small matmul tile.
    entries = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    outputs = tl.program_id(1) * BLOCK_OUTPUTS + tl.arange(0, BLOCK_OUTPUTS)
    # int64 offsets: T * F can pass 2**31 on large engine steps.
    rows = tl.load(rows_ptr + entries, mask=entries < R, other=0).to(tl.int64)
    live = (entries < R) & (rows >= 0)  # a row of -1 is a token this launch leaves alone
    # a block of gated-off rows (every row, in an idle graph-replayed step) reads nothing
    F_live = tl.where(tl.max(live.to(tl.int32), axis=0) > 0, F, 0)
    features = tl.arange(0, BLOCK_FEATURES)

    accumulator = tl.zeros((BLOCK_ROWS, BLOCK_OUTPUTS), dtype=tl.float32)
    for f0 in range(0, F_live, BLOCK_FEATURES):
        cols = f0 + features
        x_mask = live[:, None] & (cols < F)[None, :]
        x_block = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=x_mask, other=0.0)
        w_mask = (cols < F)[:, None] & (outputs < K)[None, :]
        w_block = tl.load(w_ptr + cols[:, None] * K + outputs[None, :], mask=w_mask, other=0.0)
        # Widen x before the dot (bf16 tl.dot is wrong in the interpreter); ieee, not tf32, so
        # scores match the twin's fp32 matmul rather than drifting by 1e-3 relative.
        accumulator += tl.dot(x_block.to(tl.float32), w_block, input_precision="ieee")
    accumulator += tl.load(b_ptr + outputs, mask=outputs < K, other=0.0)[None, :]

    slots = tl.load(dest_ptr + entries, mask=live, other=0).to(tl.int64)
    out_mask = live[:, None] & (outputs < K)[None, :]
    tl.store(out_ptr + slots[:, None] * out_row_stride + outputs[None, :],
             accumulator.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["K"])
def project_read_row_kernel(
    x_ptr, x_row_stride, rows_ptr, w_ptr, b_ptr, out_ptr, out_row_stride, dest_ptr, F, K,
    BLOCK_FEATURES: tl.constexpr, BLOCK_OUTPUTS: tl.constexpr,
):
    # Program i computes out[dest[i]] for rows[i]: a dot product per output, in tiles of features.
    entry = tl.program_id(0)
    row = tl.load(rows_ptr + entry).to(tl.int64)
    live = row >= 0  # a row of -1 is a token this launch leaves alone: it reads nothing
    F_live = tl.where(live, F, 0)
    features = tl.arange(0, BLOCK_FEATURES)
    outputs = tl.arange(0, BLOCK_OUTPUTS)

    accumulator = tl.zeros((BLOCK_OUTPUTS,), dtype=tl.float32)
    for f0 in range(0, F_live, BLOCK_FEATURES):
        cols = f0 + features
        x_row = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < F, other=0.0).to(tl.float32)
        w_block = tl.load(w_ptr + cols[:, None] * K + outputs[None, :],
                          mask=(cols < F)[:, None] & (outputs < K)[None, :], other=0.0)
        accumulator += tl.sum(x_row[:, None] * w_block, axis=0)
    accumulator += tl.load(b_ptr + outputs, mask=outputs < K, other=0.0)

    slot = tl.load(dest_ptr + entry).to(tl.int64)  # every entry has one (the grid is R programs)
    tl.store(out_ptr + slot * out_row_stride + outputs, accumulator.to(out_ptr.dtype.element_ty),
             mask=outputs < tl.where(live, K, 0))


def project_read(x, rows, W, b, out, dest) -> None:
    """out[dest[i]] = x[rows[i]] @ W + b, computed in fp32, converted to out's dtype."""
    R, (F, K) = rows.numel(), W.shape
    assert x.shape[1] == F and b.shape == (K,) and out.shape[1] == K and dest.numel() == R
    assert x.stride(1) == 1 and out.stride(1) == 1, "rows of x and out must be contiguous"
    assert W.is_contiguous() and b.is_contiguous()
    if R == 0 or K == 0:
        return
    if K <= NARROW_OUTPUTS:
        outputs = triton.next_power_of_2(K)
        tile = min(triton.next_power_of_2(F), MAX_ROW_TILE, NARROW_PRODUCT // outputs)
        project_read_row_kernel[(R,)](
            x, x.stride(0), rows, W, b, out, out.stride(0), dest, F, K,
            BLOCK_FEATURES=tile, BLOCK_OUTPUTS=outputs,
        )
        return
    block_outputs = min(MAX_BLOCK_OUTPUTS, max(16, triton.next_power_of_2(K)))
    grid = (triton.cdiv(R, BLOCK_ROWS), triton.cdiv(K, block_outputs))
    project_read_kernel[grid](
        x, x.stride(0), rows, W, b, out, out.stride(0), dest, R, F, K,
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_FEATURES=BLOCK_FEATURES, BLOCK_OUTPUTS=block_outputs,
    )


def project_read_torch(x, rows, W, b, out, dest) -> None:
    """The same projection in plain torch (what the CPU engine runs)."""
    live = rows >= 0
    rows, dest = rows[live], dest[live]
    out[dest] = (x[rows].float() @ W + b).to(out.dtype)
