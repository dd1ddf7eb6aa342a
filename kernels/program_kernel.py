"""The launcher of kernels generated for per-token programs: the hooks no parametric template covers.

    for i, r in enumerate(rows):
        x[r] = program(x[r])              a write (out is None)
        out[dest[i]] = program(x[r])      a read

A program (program_format.py: the triple `(ops, consts, output)`, as xmix_lens.lowered's
TokenProgram) is a list of ops over per-token values of shape () or (n,). `generate_kernel` writes
Triton source (program_source.py) for the program's *structure* into a file under CACHE_DIR,
imports it and keeps it, keyed on that structure, for the life of the process; `run_program`
launches it. program_torch.py is its torch twin.

  structure (a new kernel)      the ops, their shapes, which const each op reads, pow exponents,
                                which clamp bounds exist, which operands are numbers, F
  data (the same kernel)        the const tensors, numbers used as operands, clamp bounds, topk k

so new constants or coefficients never regenerate. In an op's "value" arguments an int is an
earlier op's index and a float is a number: write `mul v 2.0`, not `mul v 2`.

How a kernel holds values: one program takes BLOCK_ROWS rows at a time and keeps every value
in registers as a [BLOCK_ROWS, lanes] block (lanes: the next power of two >= n; 1 for () and
(1,)), or [1, lanes] when the value is made of constants only (it broadcasts). Lanes past n are
padding holding anything: elementwise ops never mix lanes, and the ops that do (reductions,
softmax, topk_mask, matmul, the final store) mask the padding out (-inf before a max, 0 before
a sum). `a @ W` (a value times a constant) runs over tiles of a's features read from memory: from x
itself when a is the site row (x's row is not held in registers unless an op other than a matmul
reads it), else from a scratch row the program owns, since registers cannot be indexed by lane.
A tile is a tl.dot once a program's row blocks reach 16 rows and W 16 outputs (in tf32x3: three
TF32 tensor-core products, ~1e-6 relative, where ieee fp32 ran on the FMA units); otherwise
(narrow outputs, such as the dot product of a gate, or wide rows in blocks of 4) a broadcast
product summed over the tile, tiles as wide as keep that product within 8K registers' elements:
a 4096-wide dot product is 2 tiles, not 4096 dependent loads (the bench apps' two program kernels
took 0.37 ms of every H200 decode step that way, whatever the batch). The result is
materialised whole: relu(x @ W_enc + b) @ W_dec holds the k SAE features of BLOCK_ROWS tokens
at once, which is what keeps topk_mask (a whole-row decision) correct. BLOCK_ROWS shrinks as
values widen (16 rows up to 1024 lanes, 4 at 4096, 2 at 8192); a launch of too few rows to give
every SM a program takes fewer a program (launch_block_rows: 1 at a decode step), where no tl.dot
needs 16. A launch runs at most PROGRAMS_PER_SM programs per SM, program p taking row blocks p,
p + programs, ..., so that the scratch (programs x BLOCK_ROWS x the staged inputs' widths, fp32)
stays bounded. A launch of too few row blocks to fill the GPU (a decode step) splits each tl.dot
matmul of x over programs (split_matmul.py: SPLIT_K programs a row block store partial products,
and the last of them to arrive sums them in order and runs the rest of the program, in the same
launch).

Limits (program_format.py; each raises NotImplementedError naming the op):
  * a value of at most MAX_LANES features (F and every n, matmul outputs included)
  * topk_mask with k <= MAX_TOPK (k passes over the row: the k-th largest by repeated maxima)
Numerics: fp32 math; tanh is 2 sigmoid(2a) - 1 (absolute error ~1e-7 near 0); pow is
products for integer exponents |p| <= 4, sqrt/rsqrt for +-0.5, else exp(p log|a|) (negative
bases: sign kept for odd integers, NaN otherwise, as torch); pow 0 is refused (fold it).
topk_mask keeps every lane >= the k-th largest value counted with multiplicity, so values tied
with it all stay (more than k lanes only on exact ties). NaN inputs to max, min, relu, clamp,
softmax and topk_mask are unspecified.

Contracts (shared with the torch twin):
  x            [T, F] fp32 or bf16, rows contiguous (a row stride is allowed); a write is in place
  rows         [R] int32, distinct token indices into x; -1 skips the entry (a gated-off token)
  table_index  [R] int32, each token's row into every `table` const (None without table ops)
  consts       fp32 contiguous on x's device: const () or (n,), matmul [n, k],
               table [N, n] or, for (), [N] or [N, 1]
  out          [capacity, n] (n = 1 for a () result), rows contiguous, any float dtype
  dest         [R] int32, distinct slots in out
  renorm       a write's, at a residual site (rms_norm_rows.Renorm): renorm.out's rows made again as
               the RMSNorm of the rows the launch wrote, from the values it stored (the row is held)
The math is fp32; the result is cast to the destination's dtype.

Example: steering through a gate, x + relu(x . d) * v with F = 200, generates

    @triton.jit(do_not_specialize=('R',))
    def program_kernel(
        x_ptr, x_row_stride, rows_ptr, R, table_index_ptr, out_ptr, out_row_stride, dest_ptr, scratch_ptr,
        weight_ptr, eps,
        c0_ptr, c1_ptr,
        WRITE: tl.constexpr, BLOCK_ROWS: tl.constexpr, SCRATCH_WIDTH: tl.constexpr,
        RENORM: tl.constexpr,
    ):
        lanes200 = tl.arange(0, 256)[None, :]
        in200 = lanes200 < 200
        # Program p takes row blocks p, p + num_programs, ...: a bounded grid bounds the scratch.
        for block in range(tl.program_id(0), tl.cdiv(R, BLOCK_ROWS), tl.num_programs(0)):
            entries = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
            live = entries < R
            # int64 offsets: T * F can pass 2**31 on large engine steps.
            rows = tl.load(rows_ptr + entries, mask=live, other=0).to(tl.int64)
            live = live & (rows >= 0)  # a row of -1 is a token this launch leaves alone
            # a block of gated-off rows (every row, in an idle graph-replayed step) does nothing
            busy = tl.max(tl.max(live.to(tl.int32), axis=1), axis=0) > 0
            if busy:
                v0 = tl.load(x_ptr + rows * x_row_stride + lanes200, mask=live & in200, other=0.0).to(tl.float32)
                v1 = tl.load(c0_ptr + lanes200, mask=in200, other=0.0)
                v2 = v0 * v1
                v3 = tl.sum(tl.where(in200, v2, 0.0), axis=1, keep_dims=True)
                v4 = tl.maximum(v3, 0.0)
                v5 = tl.load(c1_ptr + lanes200, mask=in200, other=0.0)
                v6 = v4 * v5
                v7 = v0 + v6
                if WRITE:
                    written = v7.to(x_ptr.dtype.element_ty)
                    tl.store(x_ptr + rows * x_row_stride + lanes200, written, mask=live & in200)
                    if RENORM:  # the renorm template (rms_norm_rows.py) on the rows just written, held here
                        written = written.to(tl.float32)
                        mean_square = tl.sum(tl.where(in200, written * written, 0.0), axis=1, keep_dims=True) / 200.0
                        weight = tl.load(weight_ptr + lanes200, mask=in200, other=0.0)
                        normalized = normalized_row(written, mean_square, weight, eps)
                        tl.store(out_ptr + rows * out_row_stride + lanes200, normalized.to(out_ptr.dtype.element_ty), mask=live & in200)
                else:
                    dest = tl.load(dest_ptr + entries, mask=live, other=0).to(tl.int64)
                    tl.store(out_ptr + dest * out_row_stride + lanes200, v7.to(out_ptr.dtype.element_ty), mask=live & in200)

    (the file also lists the program in a header comment, and a write's kernel imports
    `normalized_row` from rms_norm_rows.py; tests check that this example is current).
"""

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from .program_format import MAX_TOPK, PROGRAMS_PER_SM, Plan, check_arguments, plan, sm_count, structure
from .program_source import Source, import_kernel
from .rms_norm_rows import Renorm
from .split_matmul import ARRIVAL_COUNTERS, arrival_counters, split_chunk, split_count

log = logging.getLogger(__name__)

def _max_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return sys.maxsize  # the interpreter runs programs one after another: nothing to bound
    return PROGRAMS_PER_SM * sm_count(device)


@dataclass
class GeneratedKernel:
    """The kernel of one program structure; called like run_program, for any program of that structure."""

    plan: Plan
    source: str
    path: Path  # the generated file
    fn: object  # its @triton.jit program_kernel
    seconds: float  # the time generating it took (writing and importing; Triton compiles at first launch)

    def __call__(self, x, rows, program, table_index, out=None, dest=None, renorm: Renorm | None = None,
                 split_k: int | None = None, block_rows: int | None = None) -> None:
        """`renorm`: a write's rows normalised again in the same launch (rms_norm_rows.py); `split_k`:
        over how many programs to split the matmuls of x (split_matmul.py); by default as many as
        fill the GPU, 1 on the CPU; `block_rows`: the rows a program takes at a time, by default
        launch_block_rows's."""
        plan = self.plan
        consts, numbers = check_arguments(plan, x, rows, program, table_index, out, dest, renorm)
        for (i, _), number in zip(plan.numbers, numbers):
            if plan.ops[i][0] == "topk_mask" and number > MAX_TOPK:
                raise NotImplementedError(f"op {i} (topk_mask): k = {number}; generated kernels take k <= {MAX_TOPK}")
        R = rows.numel()
        if block_rows is None:
            block_rows = launch_block_rows(plan, R, x.device)
        elif block_rows != plan.block_rows and (plan.dots or not _fewer_rows(block_rows, plan.block_rows)):
            raise ValueError(f"block_rows={block_rows}: this kernel takes {plan.block_rows} rows a program"
                             + ("" if plan.dots else ", or fewer in a power of two"))
        if R == 0:
            return
        programs = min(triton.cdiv(R, block_rows), _max_programs(x.device))
        # x stands in for the pointers a launch does not use
        scratch = x
        if plan.scratch_width:
            scratch = torch.empty(programs * block_rows, plan.scratch_width, dtype=torch.float32, device=x.device)
        split, S = [], 1
        if plan.split:
            S = split_count(plan.F, R, x.device) if split_k is None else split_k
            partial, counters = x, rows
            if S > 1:
                blocks = triton.cdiv(R, block_rows)
                if programs < blocks or blocks > ARRIVAL_COUNTERS:
                    raise ValueError(f"a launch of {R} rows in {blocks} row blocks does not split its matmuls "
                                     f"(split_matmul.py: {min(programs, ARRIVAL_COUNTERS)} blocks at most); "
                                     "pass split_k=1")
                partial = torch.empty(S, R, plan.split_width, dtype=torch.float32, device=x.device)
                counters = arrival_counters(x.device)
            split = [partial, R * plan.split_width, counters]
        write = out is None
        target = renorm.out if renorm is not None else x if write else out  # a write's out: its renorm's
        self.fn[(programs, S)](
            x, x.stride(0), rows, R, rows if table_index is None else table_index,
            target, target.stride(0), rows if write else dest, scratch,
            *([x, 0.0] if renorm is None else [renorm.weight, renorm.eps]) if plan.writable else [],
            *split, *consts, *numbers,
            WRITE=write, BLOCK_ROWS=block_rows, SCRATCH_WIDTH=plan.scratch_width, num_warps=plan.warps(block_rows),
            **({"RENORM": renorm is not None} if plan.writable else {}),
            **({"SPLIT_K": S, "SPLIT_WIDTH": plan.split_width, "SPLIT_CHUNK": split_chunk(plan.F, S)}
               if plan.split else {}),
        )


def _fewer_rows(block_rows: int, most: int) -> bool:
    return 1 <= block_rows <= most and block_rows & (block_rows - 1) == 0


def launch_block_rows(plan: Plan, R: int, device: torch.device) -> int:
    """The rows a program of a launch of R rows takes at a time: the plan's, unless the launch is too
    small to give every SM a program that way (a decode step) and no matmul needs the rows for
    tl.dot; then the most rows (a power of two) that still give every SM one. On the CPU the plan's."""
    if device.type != "cuda" or plan.dots:
        return plan.block_rows
    per_sm = max(1, R // sm_count(device))
    return min(plan.block_rows, 1 << (per_sm.bit_length() - 1))


_kernels: dict[tuple, GeneratedKernel] = {}


def generate_kernel(program, F: int) -> tuple[GeneratedKernel, float]:
    """The kernel of program's structure for sites of F features, and the seconds this call spent
    generating it: 0.0 when the structure was seen before, as for new consts or numbers."""
    key = structure(program, F)
    kernel = _kernels.get(key)
    if kernel is not None:
        return kernel, 0.0
    start = time.perf_counter()
    checked = plan(key)
    source = Source(checked).text()
    path, fn = import_kernel(source)
    seconds = time.perf_counter() - start
    kernel = _kernels[key] = GeneratedKernel(checked, source, path, fn, seconds)
    log.info("generated the kernel of a %d-op program in %.3f s: %s", len(checked.ops), seconds, path)
    return kernel, seconds


def launch_row_counts(program, F: int, device: torch.device, most: int) -> list[int]:
    """A row count for each launch configuration (the rows a program takes at a time, the split of
    its matmuls) that launches of 1 to `most` rows take on `device`. Triton compiles a kernel per
    configuration at its first launch (the row count itself is not specialised: NOT_SPECIALIZED), so
    one launch at each of these compiles every kernel that serving can need."""
    kernel_plan = generate_kernel(program, F)[0].plan
    configurations = {}
    for R in range(1, most + 1):
        split = split_count(kernel_plan.F, R, device) if kernel_plan.split else 1
        configurations.setdefault((launch_block_rows(kernel_plan, R, device), split), R)
    return sorted(configurations.values())


def run_program(x, rows, program, table_index, out=None, dest=None, renorm: Renorm | None = None) -> None:
    """x[rows[i]] = program(x[rows[i]]) (out None), else out[dest[i]] = program(x[rows[i]]); a write
    with `renorm` (at a residual site) then makes renorm.out's rows again as the RMSNorm of x's.

    Generates the program's kernel on first use (see generate_kernel), then launches it. In
    place for writes; rows must be distinct (not checked: that would synchronise the device).
    """
    generate_kernel(program, x.shape[1])[0](x, rows, program, table_index, out, dest, renorm)

