"""Partial products of a generated kernel's `x @ W`, split over the input features (split-K).

A generated kernel (program_kernel.py) gives each program one block of 16 rows at a time, and
its tl.dot walks all of x's features in turn. At a decode step of 32 tokens that is 2 programs on
a GPU of 132 SMs, each reading all of W: an SAE encoder's 4096 x 64 read took 41 us, ~35 times
its floor. Split, S programs share each row block, program (b, s) taking a chunk of the features:

    partial[s, i, column : column + N] = x[rows[i], chunk s] @ W[chunk s, :]

and the generated kernel then sums its rows' S partials in order s = 0, 1, ... (the same sum
every run, unlike atomic adds) before the rest of the program. A block of gated-off rows does
nothing here either; its partials are never read.
"""
from functools import cache

import torch
import triton
import triton.language as tl

from .program_format import MAX_BLOCK_ROWS, dot_tile

MAX_SPLIT = 16  # the most programs a row block's matmul is split over (a power of two: each is a kernel)
MIN_CHUNK = 256  # the fewest input features a program's share is worth a launch for


@triton.jit
def partial_products_kernel(
    x_ptr, x_row_stride, rows_ptr, R, w_ptr, F, partial_ptr, partial_split_stride, column,
    N: tl.constexpr, LANES: tl.constexpr, PARTIAL_WIDTH: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    entries = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    live = entries < R
    rows = tl.load(rows_ptr + entries, mask=live, other=0).to(tl.int64)  # int64: T * F can pass 2**31
    live = live & (rows >= 0)
    if tl.max(tl.max(live.to(tl.int32), axis=1), axis=0) > 0:
        lanes = tl.arange(0, LANES)[None, :]
        product = tl.zeros((BLOCK_ROWS, LANES), dtype=tl.float32)
        start = tl.program_id(1) * CHUNK
        for f0 in range(start, start + CHUNK, TILE):
            f = f0 + tl.arange(0, TILE)
            x_tile = tl.load(x_ptr + rows * x_row_stride + f[None, :], mask=live & (f[None, :] < F),
                             other=0.0).to(tl.float32)
            w_tile = tl.load(w_ptr + f[:, None] * N + lanes, mask=(f[:, None] < F) & (lanes < N), other=0.0)
            product += tl.dot(x_tile, w_tile, input_precision="tf32x3")  # as the generated kernel's own
        split = tl.program_id(1).to(tl.int64) * partial_split_stride
        tl.store(partial_ptr + split + entries.to(tl.int64) * PARTIAL_WIDTH + column + lanes, product,
                 mask=(entries < R) & (lanes < N))


def partial_products(x: torch.Tensor, rows: torch.Tensor, W: torch.Tensor, partial: torch.Tensor, column: int) -> None:
    """partial[s, i, column : column + N] = x[rows[i], chunk s] @ W[chunk s] for s < S, partial [S, R, width]."""
    S, R, width = partial.shape
    F, N = W.shape
    tile = dot_tile(N, MAX_BLOCK_ROWS)
    chunk = triton.cdiv(triton.cdiv(F, S), tile) * tile
    partial_products_kernel[(triton.cdiv(R, MAX_BLOCK_ROWS), S)](
        x, x.stride(0), rows, R, W, F, partial, R * width, column,
        N=N, LANES=triton.next_power_of_2(N), PARTIAL_WIDTH=width, CHUNK=chunk, TILE=tile, BLOCK_ROWS=MAX_BLOCK_ROWS,
    )


@cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_count(F: int, R: int, device: torch.device) -> int:
    """Over how many programs a launch of R rows splits its matmuls of x: as many as fill the
    GPU's SMs with programs (a power of two up to MAX_SPLIT, each share at least MIN_CHUNK
    features); 1 (no split) for many rows, and on the CPU, whose interpreter runs programs in turn."""
    if device.type != "cuda":
        return 1
    most = min(MAX_SPLIT, F // MIN_CHUNK, _sms(device) // triton.cdiv(R, MAX_BLOCK_ROWS))
    return 1 << (most.bit_length() - 1) if most >= 2 else 1
