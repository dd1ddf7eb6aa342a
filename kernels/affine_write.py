"""The parametric write template: an affine map plus a low-rank update, in place on chosen rows.

    for i, r in enumerate(rows):
        x[r] = x[r] * scale[scale_idx[i]] + bias[bias_idx[i]] + (x[r] @ U) @ V

One template, many interventions, all of them buffer contents:
steering (scale 1, bias v), zero ablation (scale 0, bias 0), scaling (scale s, bias 0),
projecting out a unit direction d (scale 1, bias 0, U = d[:, None], V = -d[None, :]),
activation patching (scale 0, bias = the patched row) and clamping (setting) a direction's
coefficient to c (project d out, bias c * d).

Contracts (shared with the torch twin):
  x          [T, F] fp32 or bf16, rows contiguous (a row stride is allowed), written in place
  rows       [R] int32, distinct token indices into x; -1 skips the entry (a gated-off token)
  scale      [S, F] fp32 contiguous, scale_idx [R] int32 into it (repeats welcome)
  bias       [N, F] fp32 contiguous, bias_idx  [R] int32 into it (repeats welcome)
  U [F, K], V [K, F] fp32 contiguous, K >= 0 (K == 0: no low-rank term)
The math is fp32; the result is cast to x's dtype.

Two kernels: `affine_write_kernel` takes rows in blocks of 16 (the feature axis split over
programs without a low-rank term; tl.dot for one of rank > 16), `affine_write_row_kernel` one row
per program for ranks 1 to 16 (on an H200, projecting a direction out of 32 tokens of 4,096
features: 4.0 us, bench/kernels.py), and for any rank up to 16 with a renorm (`Renorm`: a write
at a residual site, whose rows the norm after it must normalise again; rms_norm_rows.py): a
program that owns its row normalises it again in the same launch.
"""

import triton
import triton.language as tl

from .program_format import NARROW_PRODUCT
from .rms_norm_rows import Renorm, normalized_row, rms_norm_rows, rms_norm_rows_torch

BLOCK_ROWS = 16  # tl.dot needs >= 16; more rows a program only slows decode steps (few rows)
BLOCK_FEATURES = 128
# Ranks up to this take one row per program and sum broadcast products instead of tl.dot: in
# 16-row blocks a decode step of 32 tokens had 2 programs, each walking a 4096-wide row in 32
# dependent steps twice; one row a program walks it in two tiles, with 16x the programs.
NARROW_RANK = 16
# Features a row program holds at once (registers), and its warps: a 4096-wide row in one tile of
# 8 warps took 2.5 us (rank 0) and 3.9 us (rank 1) with its renorm at 32 rows on an H200, against
# 3.2 and 5.2 in two tiles of 4 warps (bench/results/2026-12-03-gpu-row-tiles.json).
MAX_ROW_TILE = 4096


def row_warps(tile: int) -> int:
    return 8 if tile >= 4096 else 4


# K == 1 (one direction) is the common case, and Triton's default specialisation of arguments
# equal to 1 made that kernel 2x slower on an H200 than K == 2: keep K a plain runtime value.
@triton.jit(do_not_specialize=["R", "K"])  # R: a step's rows, a kernel for every count
def affine_write_kernel(
    x_ptr, x_row_stride, rows_ptr, R, F, K,
    scale_ptr, scale_idx_ptr, bias_ptr, bias_idx_ptr, u_ptr, v_ptr,
    BLOCK_ROWS: tl.constexpr, BLOCK_FEATURES: tl.constexpr, BLOCK_RANK: tl.constexpr,
    HAS_LOW_RANK: tl.constexpr,
):
    # Program (i, j) owns rows[i * BLOCK_ROWS : (i + 1) * BLOCK_ROWS] and the feature blocks
    # j, j + num_programs(1), j + 2 * num_programs(1), ...
    entries = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    entry_mask = entries < R
    # int64 offsets: T * F can pass 2**31 on large engine steps.
    rows = tl.load(rows_ptr + entries, mask=entry_mask, other=0).to(tl.int64)
    entry_mask &= rows >= 0  # a row of -1 is a token this launch leaves alone
    # a block of gated-off rows (every row, in an idle graph-replayed step) reads nothing
    F_live = tl.where(tl.max(entry_mask.to(tl.int32), axis=0) > 0, F, 0)
    scale_rows = tl.load(scale_idx_ptr + entries, mask=entry_mask, other=0).to(tl.int64)
    bias_rows = tl.load(bias_idx_ptr + entries, mask=entry_mask, other=0).to(tl.int64)
    features = tl.arange(0, BLOCK_FEATURES)
    ranks = tl.arange(0, BLOCK_RANK)

    if HAS_LOW_RANK:
        # x[r] @ U reduces over the whole row, so it must be complete before any feature of the
        # row is overwritten. The launcher gives such a program whole rows (num_programs(1) == 1):
        # nobody else writes them, and this program reads every feature before writing one.
        projection = tl.zeros((BLOCK_ROWS, BLOCK_RANK), dtype=tl.float32)
        for f0 in range(0, F_live, BLOCK_FEATURES):
            cols = f0 + features
            mask = entry_mask[:, None] & (cols < F)[None, :]
            x_block = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
            u_mask = (cols < F)[:, None] & (ranks < K)[None, :]
            u_block = tl.load(u_ptr + cols[:, None] * K + ranks[None, :], mask=u_mask, other=0.0)
            # ieee, not tf32: the twin's fp32 matmul is exact-ish, and projecting a direction out
            # with 10-bit mantissas would leave a visible residue.
            projection += tl.dot(x_block.to(tl.float32), u_block, input_precision="ieee")

    for f0 in range(tl.program_id(1) * BLOCK_FEATURES, F_live, tl.num_programs(1) * BLOCK_FEATURES):
        cols = f0 + features
        mask = entry_mask[:, None] & (cols < F)[None, :]
        x_offsets = rows[:, None] * x_row_stride + cols[None, :]
        # Load, then widen: bf16 arithmetic (and bf16 tl.dot in the interpreter) is unreliable.
        x_block = tl.load(x_ptr + x_offsets, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + scale_rows[:, None] * F + cols[None, :], mask=mask, other=0.0)
        bias = tl.load(bias_ptr + bias_rows[:, None] * F + cols[None, :], mask=mask, other=0.0)
        y = x_block * scale + bias
        if HAS_LOW_RANK:
            v_mask = (ranks < K)[:, None] & (cols < F)[None, :]
            v_block = tl.load(v_ptr + ranks[:, None] * F + cols[None, :], mask=v_mask, other=0.0)
            y += tl.dot(projection, v_block, input_precision="ieee")
        tl.store(x_ptr + x_offsets, y.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["K"])
def affine_write_row_kernel(
    x_ptr, x_row_stride, rows_ptr, F, K,
    scale_ptr, scale_idx_ptr, bias_ptr, bias_idx_ptr, u_ptr, v_ptr,
    weight_ptr, out_ptr, out_row_stride, eps,
    BLOCK_FEATURES: tl.constexpr, BLOCK_RANK: tl.constexpr, HAS_LOW_RANK: tl.constexpr, RENORM: tl.constexpr,
):
    # Program i owns rows[i] whole (a narrow low-rank term, or a renorm): it reads every feature of
    # the row for x[r] @ U before it writes one, and nobody else touches the row.
    entry = tl.program_id(0)
    row = tl.load(rows_ptr + entry).to(tl.int64)
    live = row >= 0  # a row of -1 is a token this launch leaves alone: it reads nothing
    F_live = tl.where(live, F, 0)
    scale_row = tl.load(scale_idx_ptr + entry).to(tl.int64)  # every entry has both (the grid is R programs)
    bias_row = tl.load(bias_idx_ptr + entry).to(tl.int64)
    features = tl.arange(0, BLOCK_FEATURES)
    ranks = tl.arange(0, BLOCK_RANK)
    rank_mask = ranks < K

    projection = tl.zeros((BLOCK_RANK,), dtype=tl.float32)
    if HAS_LOW_RANK:
        for f0 in range(0, F_live, BLOCK_FEATURES):
            cols = f0 + features
            x_row = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < F, other=0.0).to(tl.float32)
            u_block = tl.load(u_ptr + cols[:, None] * K + ranks[None, :],
                              mask=(cols < F)[:, None] & rank_mask[None, :], other=0.0)
            projection += tl.sum(x_row[:, None] * u_block, axis=0)

    squares = tl.zeros((BLOCK_FEATURES,), dtype=tl.float32)  # of the written row, for the renorm
    for f0 in range(0, F_live, BLOCK_FEATURES):
        cols = f0 + features
        mask = cols < F
        x_row = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + scale_row * F + cols, mask=mask, other=0.0)
        bias = tl.load(bias_ptr + bias_row * F + cols, mask=mask, other=0.0)
        y = x_row * scale + bias
        if HAS_LOW_RANK:
            v_block = tl.load(v_ptr + ranks[:, None] * F + cols[None, :],
                              mask=rank_mask[:, None] & mask[None, :], other=0.0)
            y += tl.sum(projection[:, None] * v_block, axis=0)
        written = y.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * x_row_stride + cols, written, mask=mask)
        if RENORM:
            squares += tl.where(mask, written.to(tl.float32) * written.to(tl.float32), 0.0)

    if RENORM:  # the renorm template (rms_norm_rows.py) on the row just written, read back
        tl.debug_barrier()  # every thread's stores are visible before any thread reads them
        mean_square = tl.sum(squares, axis=0) / F
        for f0 in range(0, F_live, BLOCK_FEATURES):
            cols = f0 + features
            mask = cols < F
            x_row = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
            y = normalized_row(x_row, mean_square, w, eps)
            tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def affine_write(x, rows, scale, scale_idx, bias, bias_idx, U, V, renorm: Renorm | None = None) -> None:
    """x[rows[i]] = x[rows[i]] * scale[scale_idx[i]] + bias[bias_idx[i]] + (x[rows[i]] @ U) @ V; with
    `renorm` (a write at a residual site), renorm.out's rows then made again as the RMSNorm of x's.

    In place; rows must be distinct (a repeated row could be read after being overwritten).
    Uniqueness is not checked here: checking would synchronise the device mid-forward.
    """
    F = x.shape[1]
    R, K = rows.numel(), U.shape[1]
    assert x.stride(1) == 1, "x rows must be contiguous"
    assert scale.shape[1] == F and bias.shape[1] == F and U.shape == (F, K) and V.shape == (K, F)
    assert scale_idx.numel() == R and bias_idx.numel() == R
    assert scale.is_contiguous() and bias.is_contiguous() and U.is_contiguous() and V.is_contiguous()
    if R == 0:
        return
    if K <= NARROW_RANK and (K > 0 or renorm is not None):
        # whole rows a program: the renorm runs in the same launch (a row the program wrote itself)
        rank = triton.next_power_of_2(max(K, 1))
        tile = min(triton.next_power_of_2(F), MAX_ROW_TILE, NARROW_PRODUCT // rank)
        weight, eps, out = renorm if renorm is not None else (x, 0.0, x)  # x: unused pointers
        assert renorm is None or (out.stride(1) == 1 and weight.shape == (F,) and out.shape[1] == F)
        affine_write_row_kernel[(R,)](
            x, x.stride(0), rows, F, K, scale, scale_idx, bias, bias_idx, U, V,
            weight, out, out.stride(0), eps,
            BLOCK_FEATURES=tile, BLOCK_RANK=rank, HAS_LOW_RANK=K > 0, RENORM=renorm is not None,
            num_warps=row_warps(tile),
        )
        return
    has_low_rank = K > 0
    # Without the low-rank term every element is read and written by one program only, so the
    # feature axis can be split; with it, each program must own whole rows (see the kernel).
    feature_programs = 1 if has_low_rank else triton.cdiv(F, BLOCK_FEATURES)
    grid = (triton.cdiv(R, BLOCK_ROWS), feature_programs)
    affine_write_kernel[grid](
        x, x.stride(0), rows, R, F, K,
        scale, scale_idx, bias, bias_idx, U, V,
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_FEATURES=BLOCK_FEATURES,
        BLOCK_RANK=max(16, triton.next_power_of_2(K)), HAS_LOW_RANK=has_low_rank,
    )
    if renorm is not None:  # a wide low-rank term (rows in blocks): the renorm's own launch
        rms_norm_rows(x, rows, *renorm)


def affine_write_torch(x, rows, scale, scale_idx, bias, bias_idx, U, V, renorm: Renorm | None = None) -> None:
    """The same write in plain torch (what the CPU engine runs)."""
    live = rows >= 0
    rows_live, scale_idx, bias_idx = rows[live], scale_idx[live], bias_idx[live]
    x_rows = x[rows_live].float()
    y = x_rows * scale[scale_idx] + bias[bias_idx]
    if U.shape[1] > 0:
        y += (x_rows @ U) @ V
    x[rows_live] = y.to(x.dtype)
    if renorm is not None:
        rms_norm_rows_torch(x, rows, *renorm)
