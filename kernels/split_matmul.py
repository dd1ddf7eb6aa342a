"""Matmuls of x split over programs (split-K), summed in the same launch.

A generated kernel (program_kernel.py) gives each program one block of 16 rows at a time, and
its tl.dot walks all of x's features in turn. At a decode step of 32 tokens that is 2 programs on
a GPU of 132 SMs, each reading all of W: an SAE encoder's 4096 x 64 read took 41 us, ~35 times
its floor. Split, the launch has SPLIT_K programs for each row block, program (b, s) taking
chunk s of the features:

    partial[s, i, column : column + N] = x[rows[i], chunk s] @ W[chunk s, :]

and then counting itself in at its block's arrival counter. The program that arrives last has
every other's partials in view: it sums its rows' S partials in order s = 0, 1, ... (the same sum
every run, unlike atomic adds into one row), sets the counter back to zero, and runs the rest of
the program; the others are done. One launch, where a launch of partial products before the
kernel took two (a second launch in every decode step, gated or not). A block of gated-off rows
does nothing here either: no partials, no arrival.

The counters are one buffer per device (`arrival_counters`), zero between launches since each
launch leaves them as it found them; launches on a stream run in turn, so every split launch
shares it. The executor makes it before any CUDA graph is captured: a launch inside a capture
allocates nothing that must outlive the capture.
"""
import torch
import triton
import triton.language as tl

from .program_format import MAX_BLOCK_ROWS, MAX_DOT_TILE, sm_count

MAX_SPLIT = 16  # the most programs a row block's matmul is split over (a power of two: each is a kernel)
MIN_CHUNK = 256  # the fewest input features a program's share is worth a launch for
ARRIVAL_COUNTERS = 1024  # row blocks a split launch may have (split_count splits launches of few)


@triton.jit
def store_partial_product(x_ptr, x_row_stride, rows, live, entries, R, w_ptr, partial_ptr, partial_split_stride,
                          F: tl.constexpr, N: tl.constexpr, LANES: tl.constexpr, COLUMN: tl.constexpr,
                          SPLIT_WIDTH: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
                          BLOCK_ROWS: tl.constexpr):
    """partial[s, entries, COLUMN : COLUMN + N] = x[rows, chunk s] @ W[chunk s] for this program's
    share s = tl.program_id(1); a gated-off row's partials are zeros."""
    lanes = tl.arange(0, LANES)[None, :]
    product = tl.zeros((BLOCK_ROWS, LANES), dtype=tl.float32)
    start = tl.program_id(1) * CHUNK
    for f0 in range(start, start + CHUNK, TILE):
        f = f0 + tl.arange(0, TILE)
        x_tile = tl.load(x_ptr + rows * x_row_stride + f[None, :], mask=live & (f[None, :] < F),
                         other=0.0).to(tl.float32)
        w_tile = tl.load(w_ptr + f[:, None] * N + lanes, mask=(f[:, None] < F) & (lanes < N), other=0.0)
        product += tl.dot(x_tile, w_tile, input_precision="tf32x3")  # as the unsplit matmul's own
    split = tl.program_id(1).to(tl.int64) * partial_split_stride
    tl.store(partial_ptr + split + entries.to(tl.int64) * SPLIT_WIDTH + COLUMN + lanes, product,
             mask=(entries < R) & (lanes < N))


@triton.jit
def arrived_last(counter_ptr, SPLIT_K: tl.constexpr):
    """Counts this program in at its row block's counter: whether it is the last of the SPLIT_K to
    arrive, which then sees every other's partials and sets the counter back to zero."""
    tl.debug_barrier()  # every thread of the program has stored its partials before the count
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")  # releases this program's partials, acquires the others'
    last = arrived == SPLIT_K - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0)
    return last


def split_chunk(F: int, S: int) -> int:
    """The features of each program's share: whole tiles of every matmul's tl.dot, as even as they go."""
    return triton.cdiv(triton.cdiv(F, S), MAX_DOT_TILE) * MAX_DOT_TILE


_counters: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's arrival counters (int32 zeros), made on first call, which must come before any
    CUDA-graph capture that launches split kernels (the executor calls it when it is made)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split_matmul.arrival_counters({device}) was first called inside a CUDA-graph "
                               "capture; call it before capturing (the executor does when it is made)")
        counters = _counters[device] = torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)
    return counters


def split_count(F: int, R: int, device: torch.device) -> int:
    """Over how many programs a launch of R rows splits its matmuls of x: as many as give each of
    the GPU's SMs two programs at most (a power of two up to MAX_SPLIT, each share at least
    MIN_CHUNK features; an H200's SAE read of 4096 x 64: 6.7 / 8.9 / 12.7 us at 32 / 256 / 512 rows,
    against 41 unsplit); 1 (no split) for many rows, and on the CPU, whose interpreter runs programs
    in turn."""
    if device.type != "cuda":
        return 1
    most = min(MAX_SPLIT, F // MIN_CHUNK, 2 * sm_count(device) // triton.cdiv(R, MAX_BLOCK_ROWS))
    return 1 << (most.bit_length() - 1) if most >= 2 else 1
