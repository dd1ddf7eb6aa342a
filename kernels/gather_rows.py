"""The read template: copy chosen rows of a site into the device ring buffer.

    for i, r in enumerate(rows):
        out[dest[i]] = x[r]

The messenger drains `out` to the host after the step, so `out` usually has another dtype than
the site (bf16 activations kept as fp32 for the user): the copy converts.

Contracts (shared with the torch twin):
  x     [T, F] fp32 or bf16, rows contiguous (a row stride is allowed)
  rows  [R] int32 token indices into x
  out   [capacity, F] any float dtype, rows contiguous; only rows dest[:] are written
  dest  [R] int32 slots in out, distinct
"""

import triton
import triton.language as tl

BLOCK_ROWS = 32
BLOCK_FEATURES = 128


@triton.jit(do_not_specialize=["R"])  # R: a step's rows, a kernel for every count
def gather_rows_kernel(
    x_ptr, x_row_stride, rows_ptr, out_ptr, out_row_stride, dest_ptr, R, F,
    BLOCK_ROWS: tl.constexpr, BLOCK_FEATURES: tl.constexpr,
):
    entries = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_FEATURES + tl.arange(0, BLOCK_FEATURES)
    # int64 offsets: T * F can pass 2**31 on large engine steps.
    rows = tl.load(rows_ptr + entries, mask=entries < R, other=0).to(tl.int64)
    live = (entries < R) & (rows >= 0)  # a row of -1 is a token this launch leaves alone
    mask = live[:, None] & (cols < F)[None, :]
    slots = tl.load(dest_ptr + entries, mask=live, other=0).to(tl.int64)
    values = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask)
    tl.store(out_ptr + slots[:, None] * out_row_stride + cols[None, :],
             values.to(out_ptr.dtype.element_ty), mask=mask)


def gather_rows(x, rows, out, dest) -> None:
    """out[dest[i]] = x[rows[i]], converted to out's dtype."""
    R, F = rows.numel(), x.shape[1]
    assert x.stride(1) == 1 and out.stride(1) == 1, "rows of x and out must be contiguous"
    assert out.shape[1] == F and dest.numel() == R
    if R == 0:
        return
    grid = (triton.cdiv(R, BLOCK_ROWS), triton.cdiv(F, BLOCK_FEATURES))
    gather_rows_kernel[grid](
        x, x.stride(0), rows, out, out.stride(0), dest, R, F,
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_FEATURES=BLOCK_FEATURES,
    )


def gather_rows_torch(x, rows, out, dest) -> None:
    """The same copy in plain torch (what the CPU engine runs)."""
    live = rows >= 0
    rows, dest = rows[live], dest[live]
    out[dest] = x[rows].to(out.dtype)
