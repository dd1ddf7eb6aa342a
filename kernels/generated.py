"""Kernels generated for per-token programs: the hooks that no parametric template covers.

    for i, r in enumerate(rows):
        x[r] = program(x[r])              a write (out is None)
        out[dest[i]] = program(x[r])      a read

A TokenProgram (xmix_lens.lowered) is a list of ops over per-token values of shape () or (n,).
`generate_kernel` writes Triton source for the program's *structure* into a file under CACHE_DIR,
imports it and keeps it, keyed on that structure, for the life of the process:

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
a sum). `x @ W` (the site row times a constant) runs as tl.dot over tiles of x's columns read
from memory once a program's row blocks reach 16 rows (x's row is not held in registers unless an
op other than a matmul reads it). Any other `a @ W` runs one rank-1 update per input feature
(CUDA-core FMAs, W's rows streamed once per block of rows), its input read back a column at a time
from x itself or from a scratch row the program owns, since registers cannot be indexed by lane. The result is
materialised whole: relu(x @ W_enc + b) @ W_dec holds the k SAE features of BLOCK_ROWS tokens
at once, which is what keeps topk_mask (a whole-row decision) correct. BLOCK_ROWS shrinks as
values widen (16 rows up to 1024 lanes, 4 at 4096, 2 at 8192). A launch runs at most
PROGRAMS_PER_SM programs per SM, program p taking row blocks p, p + programs, ..., so that the
scratch (programs x BLOCK_ROWS x the staged inputs' widths, fp32) stays bounded.

Limits (each raises NotImplementedError naming the op):
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
The math is fp32; the result is cast to the destination's dtype.

Example: steering through a gate, x + relu(x . d) * v with F = 200, generates

    @triton.jit
    def program_kernel(
        x_ptr, x_row_stride, rows_ptr, R, table_index_ptr, out_ptr, out_row_stride, dest_ptr, scratch_ptr,
        c0_ptr, c1_ptr,
        WRITE: tl.constexpr, BLOCK_ROWS: tl.constexpr, SCRATCH_WIDTH: tl.constexpr,
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
            if tl.max(tl.max(live.to(tl.int32), axis=1), axis=0) > 0:
                v0 = tl.load(x_ptr + rows * x_row_stride + lanes200, mask=live & in200, other=0.0).to(tl.float32)
                v1 = tl.load(c0_ptr + lanes200, mask=in200, other=0.0)
                v2 = v0 * v1
                v3 = tl.sum(tl.where(in200, v2, 0.0), axis=1, keep_dims=True)
                v4 = tl.maximum(v3, 0.0)
                v5 = tl.load(c1_ptr + lanes200, mask=in200, other=0.0)
                v6 = v4 * v5
                v7 = v0 + v6
                if WRITE:
                    tl.store(x_ptr + rows * x_row_stride + lanes200, v7.to(x_ptr.dtype.element_ty), mask=live & in200)
                else:
                    dest = tl.load(dest_ptr + entries, mask=live, other=0).to(tl.int64)
                    tl.store(out_ptr + dest * out_row_stride + lanes200, v7.to(out_ptr.dtype.element_ty), mask=live & in200)

    (the file also lists the program in a header comment; tests check that this example is current).
"""

import hashlib
import importlib.util
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as torch_functional
import triton

from ..lowered import TokenProgram

log = logging.getLogger(__name__)

MAX_LANES = 8192
# Lanes of one value a program holds (BLOCK_ROWS x the widest value's lanes): 16K fp32 is 32
# registers a thread at 16 warps, so that a few live values fit in the register file.
LANES_PER_PROGRAM = 16384
MAX_BLOCK_ROWS = 16  # more rows a program only slows decode steps (few rows)
MAX_TOPK = 128
PROGRAMS_PER_SM = 4  # the grid on a GPU: enough programs to hide latency, a bounded scratch
CACHE_DIR = Path(tempfile.gettempdir()) / "xmix_lens_generated"

# --- the program format: what each op's args are ------------------------------------------------
# "value": an earlier op's index (int) or a number (float); "const": an index into program.consts;
# "exponent": a number written into the code; "bound": a number or None; "count": an int.
_BINARY = ("add", "sub", "mul", "div", "gt", "ge", "lt", "le", "eq", "ne", "logical_and", "logical_or")
_UNARY = ("neg", "abs", "relu", "gelu", "sigmoid", "tanh", "exp", "log", "logical_not")
_REDUCTIONS = ("sum", "mean", "max", "min", "norm")
ARGS = {
    "x": (), "const": ("const",), "table": ("const",),
    **{name: ("value", "value") for name in _BINARY},
    **{name: ("value",) for name in _UNARY + _REDUCTIONS + ("softmax", "unsqueeze")},
    "pow": ("value", "exponent"), "where": ("value", "value", "value"), "clamp": ("value", "bound", "bound"),
    "matmul": ("value", "const"), "topk_mask": ("value", "count"),
}
NUMBER = "#"  # in a structure: a number the kernel takes at launch, not one written into its code


def _structure(program: TokenProgram, F: int) -> tuple:
    """The program with its data left out: the key of its kernel. Checks each arg's kind."""
    ops = []
    for i, op in enumerate(program.ops):
        kinds = ARGS.get(op.op)
        if kinds is None:
            raise ValueError(f"op {i}: unknown op {op.op!r}")
        if len(op.args) != len(kinds):
            raise ValueError(f"op {i} ({op.op}): takes {len(kinds)} args, got {op.args}")
        args = tuple(_structural_arg(i, op, kind, arg, len(program.consts)) for kind, arg in zip(kinds, op.args))
        ops.append((op.op, args, tuple(op.shape)))
    return F, program.output, tuple(ops)


def _structural_arg(i, op, kind, arg, n_consts):
    is_int = isinstance(arg, int) and not isinstance(arg, bool)
    if kind == "value" and is_int and 0 <= arg < i:
        return arg
    if kind == "value" and isinstance(arg, float):
        return NUMBER
    if kind == "const" and is_int and 0 <= arg < n_consts:
        return arg
    if kind == "exponent" and (is_int or isinstance(arg, float)) and arg != 0:
        return float(arg)
    if kind == "bound" and (arg is None or is_int or isinstance(arg, float)):
        return None if arg is None else NUMBER
    if kind == "count" and is_int:
        return NUMBER
    expected = {"value": "an earlier op's index (int) or a number (float)", "const": "a const index",
                "exponent": "a nonzero number (fold pow 0)", "bound": "a number or None", "count": "an int"}[kind]
    raise ValueError(f"op {i} ({op.op}): {arg!r} is not {expected}")


@dataclass(frozen=True)
class _Plan:
    """A checked structure and what its kernel needs: the shapes, lanes and launch layout."""

    F: int
    output: int
    ops: tuple  # (name, structural args, shape) per op
    widths: tuple  # per op: n for (n,), 1 for () and (1,)
    numbers: tuple  # (op index, arg index) of each number passed at launch, in kernel order
    consts: tuple  # (const index, expected shape; None where any size goes) of each const read
    scratch: tuple  # (matmul op index, first scratch column) of each matmul staging its input
    scratch_width: int
    block_rows: int
    num_warps: int


def _broadcast(i, name, shapes):
    sizes = {s for s in shapes if s not in ((), (1,))}
    if len(sizes) > 1:
        raise ValueError(f"op {i} ({name}): operands of shapes {sorted(sizes)} do not broadcast")
    return sizes.pop() if sizes else (1,) if (1,) in shapes else ()


@cache
def _plan(structure: tuple) -> _Plan:
    F, output, ops = structure
    shapes, widths, numbers, consts, scratch, scratch_width = [], [], [], {}, [], 0

    def expect_const(i, index, shape):
        if consts.setdefault(index, shape) != shape:
            raise ValueError(f"op {i}: const {index} read as {shape} and as {consts[index]}")

    for i, (name, args, shape) in enumerate(ops):
        kinds = ARGS[name]
        operands = [a for kind, a in zip(kinds, args) if kind == "value"]
        if operands and all(a == NUMBER for a in operands):
            raise ValueError(f"op {i} ({name}): every operand is a number; fold it before lowering")
        operand_shapes = [() if a == NUMBER else shapes[a] for a in operands]
        numbers += [(i, j) for j, a in enumerate(args) if a == NUMBER]
        if len(shape) > 1 or shape == (0,):
            raise ValueError(f"op {i} ({name}): values are () or (n,) with n >= 1, not {shape}")
        width = shape[0] if shape else 1
        if name == "x":
            computed = (F,)
        elif name == "const":
            computed = shape
            expect_const(i, args[0], shape)
        elif name == "table":
            computed = shape
            expect_const(i, args[0], (None, *shape))
        elif name in _REDUCTIONS:
            computed = ()
        elif name == "unsqueeze":
            if operand_shapes[0] != ():
                raise ValueError(f"op {i} (unsqueeze): takes a () value, not {operand_shapes[0]}")
            computed = (1,)
        elif name == "matmul":
            computed = shape
            expect_const(i, args[1], (widths[args[0]], width))
            if widths[args[0]] > 1 and ops[args[0]][0] != "x":  # x's columns are read from x
                scratch.append((i, scratch_width))
                scratch_width += widths[args[0]]
        else:  # elementwise, softmax and topk_mask keep the broadcast operand shape
            computed = _broadcast(i, name, operand_shapes)
        if computed != shape:
            raise ValueError(f"op {i} ({name}): declared shape {shape}, its operands give {computed}")
        if width > MAX_LANES:
            raise NotImplementedError(
                f"op {i} ({name}): a value of {width} features; generated kernels hold at most {MAX_LANES}")
        shapes.append(shape)
        widths.append(width)
    if not 0 <= output < len(ops):
        raise ValueError(f"output {output} is not an op of this {len(ops)}-op program")

    # x's row is held in registers only where an op other than a matmul reads it (a matmul reads
    # x's columns from memory), so an SAE encoder's read keeps full row blocks, and tl.dot
    held = [w for i, w in enumerate(widths) if ops[i][0] != "x" or _x_held(i, output, ops)]
    widest = max(triton.next_power_of_2(w) for w in held or [1])
    block_rows = max(1, min(MAX_BLOCK_ROWS, LANES_PER_PROGRAM // widest))
    return _Plan(
        F=F, output=output, ops=ops, widths=tuple(widths), numbers=tuple(numbers),
        consts=tuple(sorted(consts.items())), scratch=tuple(scratch), scratch_width=scratch_width,
        # 16 warps for 16K lanes: 32 fp32 registers a thread per value (ptxas for sm_90 reports no
        # spills for F = 4096 steering or a 576 -> 4096 -> 576 top-k SAE)
        block_rows=block_rows, num_warps=min(16, max(4, block_rows * widest // 1024)),
    )


def _x_held(x: int, output: int, ops: tuple) -> bool:
    """Whether op x's value (the site row) is needed whole: it is the result, or an op other than
    a matmul's input reads it."""
    readers = [(name, j) for name, args, _ in ops for j, (kind, a) in enumerate(zip(ARGS[name], args))
               if kind == "value" and a == x]
    return output == x or any(name != "matmul" or j != 0 for name, j in readers)


def _dot_tile(n: int, block_rows: int) -> int:
    """The input features a matmul of x takes per tl.dot (0: no tl.dot, rank-1 updates instead).
    tl.dot needs 16 rows and 16 outputs at least; wider outputs take fewer features a tile so
    that the tile of W stays within registers."""
    lanes = triton.next_power_of_2(n)
    return 0 if block_rows < 16 or lanes < 16 else max(16, min(64, 8192 // lanes))


# --- the generator ---------------------------------------------------------------------------------
_UNARY_CODE = {
    "neg": "-{a}", "abs": "tl.abs({a})", "relu": "tl.maximum({a}, 0.0)", "sigmoid": "tl.sigmoid({a})",
    "tanh": "2.0 * tl.sigmoid(2.0 * {a}) - 1.0", "exp": "tl.exp({a})", "log": "tl.log({a})",
    "gelu": "0.5 * {a} * (1.0 + tl.erf({a} * 0.7071067811865476))",  # exact gelu, as torch's default
    "logical_not": "({a} == 0.0).to(tl.float32)", "unsqueeze": "{a}",
}
_BINARY_CODE = {
    "add": "{a} + {b}", "sub": "{a} - {b}", "mul": "{a} * {b}", "div": "{a} / {b}",
    "gt": "({a} > {b}).to(tl.float32)", "ge": "({a} >= {b}).to(tl.float32)",
    "lt": "({a} < {b}).to(tl.float32)", "le": "({a} <= {b}).to(tl.float32)",
    "eq": "({a} == {b}).to(tl.float32)", "ne": "({a} != {b}).to(tl.float32)",
    "logical_and": "(({a} != 0.0) & ({b} != 0.0)).to(tl.float32)",
    "logical_or": "(({a} != 0.0) | ({b} != 0.0)).to(tl.float32)",
}


_MINUS_INFINITY = 'float("-inf")'


def _pow_code(a: str, p: float) -> str:
    if p == int(p) and abs(p) <= 4:
        product = " * ".join([a] * int(abs(p)))
        return product if p > 0 else f"1.0 / ({product})"
    if abs(p) == 0.5:
        return f"tl.sqrt({a})" if p > 0 else f"tl.rsqrt({a})"
    if p != int(p):
        return f"tl.exp({p!r} * tl.log({a}))"  # NaN for a < 0, as torch.pow
    magnitude = f"tl.exp({p!r} * tl.log(tl.abs({a})))"
    return magnitude if p % 2 == 0 else f"tl.where({a} < 0.0, -{magnitude}, {magnitude})"


class _Source:
    """Writes the kernel of one plan. Op i's value is v<i>, const j's pointer c<j>_ptr, number m s<m>."""

    def __init__(self, plan: _Plan):
        self.plan = plan
        self.number_names = {place: f"s{m}" for m, place in enumerate(plan.numbers)}
        self.lane_widths, self.mask_widths = set(), set()

    # names of the lane indices of an n-wide value and of its real (not padding) lanes
    def lanes(self, n: int) -> str:
        self.lane_widths.add(n)
        return f"lanes{n}"

    def mask(self, n: int, live: bool = False) -> str:
        if n > 1:
            self.mask_widths.add(n)
        return " & ".join((["live"] if live else []) + ([f"in{n}"] if n > 1 else []))

    def load(self, address: str, n: int, live: bool = False) -> str:
        mask = self.mask(n, live)
        return f"tl.load({address}, mask={mask}, other=0.0)" if mask else f"tl.load({address})"

    def masked(self, value: str, n: int, fill: str) -> str:
        return f"tl.where({self.mask(n)}, {value}, {fill})" if n > 1 else value

    def operand(self, i: int, j: int) -> str:
        arg = self.plan.ops[i][1][j]
        return self.number_names[(i, j)] if arg == NUMBER else f"v{arg}"

    def describe(self, i: int) -> str:
        name, args, shape = self.plan.ops[i]
        shown = []
        for j, (kind, arg) in enumerate(zip(ARGS[name], args)):
            if kind == "const":
                shown.append(f"c{arg}")
            elif kind in ("exponent", "bound") and arg != NUMBER:
                shown.append(repr(arg))
            else:
                shown.append(self.operand(i, j))
        if name in ("x", "const", "table"):
            text = {"x": "x", "const": "{}", "table": "{}[table_index]"}[name].format(*shown)
        else:
            text = f"{name}({', '.join(shown)})"
        return f"#     v{i} = {text:<40} {shape}"

    def op(self, i: int) -> list[str]:
        name, args, _ = self.plan.ops[i]
        v, n, F = f"v{i}", self.plan.widths[i], self.plan.F
        a = self.operand(i, 0) if args and ARGS[name][0] == "value" else None
        width_in = self.plan.widths[args[0]] if a and args[0] != NUMBER else 1  # the first operand's lanes
        if name == "x":
            if not _x_held(i, self.plan.output, self.plan.ops):
                return [f"# {v} = x: read from x a tile at a time by the matmuls of it, not held whole"]
            return [f"{v} = {self.load(f'x_ptr + rows * x_row_stride + {self.lanes(F)}', F, live=True)}.to(tl.float32)"]
        if name == "const":
            return [f"{v} = {self.load(f'c{args[0]}_ptr + {self.lanes(n)}', n)}"]
        if name == "table":
            stride = "" if n == 1 else f" * {n}"
            return [f"{v} = {self.load(f'c{args[0]}_ptr + table_rows{stride} + {self.lanes(n)}', n, live=True)}"]
        if name in _UNARY_CODE:
            return [f"{v} = " + _UNARY_CODE[name].format(a=a)]
        if name in _BINARY_CODE:
            return [f"{v} = " + _BINARY_CODE[name].format(a=a, b=self.operand(i, 1))]
        if name == "where":
            return [f"{v} = tl.where({a} != 0.0, {self.operand(i, 1)}, {self.operand(i, 2)})"]
        if name == "clamp":
            expression = a
            if args[1] is not None:
                expression = f"tl.maximum({expression}, {self.operand(i, 1)})"
            if args[2] is not None:
                expression = f"tl.minimum({expression}, {self.operand(i, 2)})"
            return [f"{v} = {expression}"]
        if name == "pow":
            return [f"{v} = {_pow_code(a, args[1])}"]
        if name in _REDUCTIONS:
            fill = {"max": _MINUS_INFINITY, "min": 'float("inf")'}.get(name, "0.0")
            reduce = {"max": "tl.max", "min": "tl.min"}.get(name, "tl.sum")
            squared = f"{a} * {a}" if name == "norm" else a
            expression = f"{reduce}({self.masked(squared, width_in, fill)}, axis=1, keep_dims=True)"
            finish = {"mean": f"{expression} / {width_in}.0", "norm": f"tl.sqrt({expression})"}
            return [f"{v} = " + finish.get(name, expression)]
        if name == "softmax":
            return [
                f"# {v} = softmax({a}): padding lanes are -inf for the max and 0 for the sum",
                f"peak{i} = tl.max({self.masked(a, n, _MINUS_INFINITY)}, axis=1, keep_dims=True)",
                f"exp{i} = {self.masked(f'tl.exp({a} - peak{i})', n, '0.0')}",
                f"{v} = exp{i} / tl.sum(exp{i}, axis=1, keep_dims=True)",
            ]
        if name == "topk_mask":
            k, lanes, past = self.number_names[(i, 1)], self.lanes(n), triton.next_power_of_2(n)
            return [
                f"# {v} = topk_mask({a}, {k}): take the maximum {k} - 1 times, each time removing one lane",
                "# holding it (the lowest), so tied values count once each; the maximum left is the",
                f"# {k}-th largest value, and every lane >= it stays.",
                f"remaining{i} = {self.masked(a, n, _MINUS_INFINITY)}",
                f"for _ in range({k} - 1):",
                f"    top{i} = tl.max(remaining{i}, axis=1, keep_dims=True)",
                f"    first{i} = tl.min(tl.where(remaining{i} == top{i}, {lanes}, {past}), axis=1, keep_dims=True)",
                f"    remaining{i} = tl.where({lanes} == first{i}, {_MINUS_INFINITY}, remaining{i})",
                f"{v} = tl.where({a} >= tl.max(remaining{i}, axis=1, keep_dims=True), {a}, 0.0)",
            ]
        assert name == "matmul", name
        w, lanes = f"c{args[1]}_ptr", self.lanes(n)
        if width_in == 1:
            return [f"{v} = {a} * {self.load(f'{w} + {lanes}', n)}  # a [1] @ [1, {n}]: a scaled row"]
        row = self.load(f"{w} + j * {n} + {lanes}", n)
        accumulate = [f"{v} = tl.zeros((BLOCK_ROWS, {triton.next_power_of_2(n)}), dtype=tl.float32)",
                      f"for j in range({width_in}):"]
        tile = _dot_tile(n, self.plan.block_rows)
        if self.plan.ops[args[0]][0] == "x" and tile:
            return [
                f"# {v} = {a} @ {w[:-4]}, [{width_in}] @ [{width_in}, {n}]: tl.dot over tiles of {tile} input",
                "# features, x's columns read from x itself (ieee: fp32 sums, as the twin's matmul)",
                f"{v} = tl.zeros((BLOCK_ROWS, {triton.next_power_of_2(n)}), dtype=tl.float32)",
                f"for f0 in range(0, {width_in}, {tile}):",
                f"    f = f0 + tl.arange(0, {tile})",
                f"    x_tile = tl.load(x_ptr + rows * x_row_stride + f[None, :], mask=live & (f[None, :] < {width_in}),"
                " other=0.0).to(tl.float32)",
                f"    w_tile = tl.load({w} + f[:, None] * {n} + {lanes}, mask=(f[:, None] < {width_in}) & {self.mask(n)},"
                " other=0.0)",
                f"    {v} += tl.dot(x_tile, w_tile, input_precision=\"ieee\")",
            ]
        if self.plan.ops[args[0]][0] == "x":
            return [
                f"# {v} = {a} @ {w[:-4]}, [{width_in}] @ [{width_in}, {n}]: a rank-1 update per input feature,",
                "# the columns read from x itself",
                *accumulate,
                "    x_j = tl.load(x_ptr + rows * x_row_stride + j, mask=live, other=0.0).to(tl.float32)",
                f"    {v} += x_j * {row}",
            ]
        offset = dict(self.plan.scratch)[i]
        staged = f"scratch_rows + {offset}" if offset else "scratch_rows"
        return [
            f"# {v} = {a} @ {w[:-4]}, [{width_in}] @ [{width_in}, {n}]: a rank-1 update per input feature.",
            f"# Registers cannot be indexed by lane: {a} goes through this program's scratch rows, read back",
            "# a column at a time.",
            f"tl.store({staged} + {self.lanes(width_in)}, {a}, mask={self.mask(width_in)})",
            "tl.debug_barrier()  # every thread's stores are visible before any thread reads a column",
            *accumulate,
            f"    {v} += tl.load({staged} + j) * {row}",
            "tl.debug_barrier()  # every column is read before the next row block overwrites them",
        ]

    def store(self) -> list[str]:
        plan = self.plan
        v, n = f"v{plan.output}", plan.widths[plan.output]
        read = [
            "dest = tl.load(dest_ptr + entries, mask=live, other=0).to(tl.int64)",
            f"tl.store(out_ptr + dest * out_row_stride + {self.lanes(n)}, {v}.to(out_ptr.dtype.element_ty), "
            f"mask={self.mask(n, live=True)})",
        ]
        if plan.ops[plan.output][2] != (plan.F,):
            return read  # only (F,) results can be written back
        return [
            "if WRITE:",
            f"    tl.store(x_ptr + rows * x_row_stride + {self.lanes(n)}, {v}.to(x_ptr.dtype.element_ty), "
            f"mask={self.mask(n, live=True)})",
            "else:",
            *("    " + line for line in read),
        ]

    def text(self) -> str:
        plan = self.plan
        body = [line for i in range(len(plan.ops)) for line in self.op(i)] + self.store()
        consts = [f"c{index}_ptr" for index, _ in plan.consts]
        numbers = list(self.number_names.values())
        setup = []
        for n in sorted(self.lane_widths | self.mask_widths):
            setup.append(f"lanes{n} = tl.arange(0, {triton.next_power_of_2(n)})[None, :]")
            if n in self.mask_widths:
                setup.append(f"in{n} = lanes{n} < {n}")
        if plan.scratch:
            setup += ["# this program's own scratch rows, reused by each row block it takes",
                      "slots = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)",
                      "scratch_rows = scratch_ptr + slots[:, None] * SCRATCH_WIDTH"]
        rows = [
            "entries = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]",
            "live = entries < R",
            "# int64 offsets: T * F can pass 2**31 on large engine steps.",
            "rows = tl.load(rows_ptr + entries, mask=live, other=0).to(tl.int64)",
            "live = live & (rows >= 0)  # a row of -1 is a token this launch leaves alone",
        ]
        if any(name == "table" for name, _, _ in plan.ops):
            rows.append("table_rows = tl.load(table_index_ptr + entries, mask=live, other=0).to(tl.int64)")
        return "\n".join([
            f"# Generated by xmix_lens.kernels.generated from a per-token program's structure (F = {plan.F}),",
            "# rewritten whenever that structure is seen anew: edits are lost. The program, per token",
            "# (c<j> program.consts[j], s<m> numbers passed at launch):",
            *(self.describe(i) for i in range(len(plan.ops))),
            f"#     result: v{plan.output}",
            "",
            "import triton",
            "import triton.language as tl",
            "",
            "",
            "@triton.jit",
            "def program_kernel(",
            "    x_ptr, x_row_stride, rows_ptr, R, table_index_ptr, out_ptr, out_row_stride, dest_ptr, scratch_ptr,",
            *([f"    {', '.join(consts)},"] if consts else []),
            *([f"    {', '.join(numbers)},"] if numbers else []),
            "    WRITE: tl.constexpr, BLOCK_ROWS: tl.constexpr, SCRATCH_WIDTH: tl.constexpr,",
            "):",
            *("    " + line for line in setup),
            "    # Program p takes row blocks p, p + num_programs, ...: a bounded grid bounds the scratch.",
            "    for block in range(tl.program_id(0), tl.cdiv(R, BLOCK_ROWS), tl.num_programs(0)):",
            *("        " + line for line in rows),
            "        # a block of gated-off rows (every row, in an idle graph-replayed step) does nothing",
            "        if tl.max(tl.max(live.to(tl.int32), axis=1), axis=0) > 0:",
            *("            " + line for line in body),
            "",
        ])


def _import(source: str):
    """Writes source to CACHE_DIR (Triton reads kernels' source from real files) and imports it."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = CACHE_DIR / f"program_{digest}.py"
    if not path.exists() or path.read_text() != source:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        # Written whole, then renamed into place: another engine process importing the same program
        # at the same moment never reads half a file.
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(source)
        os.replace(partial, path)
    name = f"xmix_lens_generated_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as a plain import would, for tools that look kernels' modules up
    spec.loader.exec_module(module)
    return path, module.program_kernel


# --- the launcher --------------------------------------------------------------------------------
def _arguments(plan: _Plan, x, rows, program, table_index, out, dest):
    """Checks a launch (the kernel's and the twin's alike); returns the consts and numbers it passes."""
    R = rows.numel()
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x must be [T, F] with contiguous rows")
    if rows.dtype != torch.int32:
        raise ValueError(f"rows must be int32, not {rows.dtype}")
    if any(name == "table" for name, _, _ in plan.ops) and (
            table_index is None or table_index.dtype != torch.int32 or table_index.numel() != R):
        raise ValueError("a program with table ops needs table_index, int32 [R]")
    if out is None and plan.ops[plan.output][2] != (plan.F,):
        raise ValueError(f"a write's result has shape ({plan.F},), not {plan.ops[plan.output][2]}")
    if out is not None and (out.dim() != 2 or out.shape[1] != plan.widths[plan.output] or out.stride(1) != 1):
        raise ValueError(f"out must be [capacity, {plan.widths[plan.output]}] with contiguous rows")
    if out is not None and (dest is None or dest.dtype != torch.int32 or dest.numel() != R):
        raise ValueError("a read needs dest, int32 [R]")
    consts = []
    for index, shape in plan.consts:
        const = program.consts[index]
        if shape[:1] == (None,):  # a table: [N, *shape], any N; a () table may also be [N, 1]
            fits = const.dim() in (1, 2) and math.prod(const.shape[1:]) == math.prod(shape[1:])
        else:
            fits = tuple(const.shape) == shape
        if not fits or const.dtype != torch.float32 or not const.is_contiguous() or const.device != x.device:
            wanted = tuple("N" if s is None else s for s in shape)
            raise ValueError(f"const {index} must be fp32 contiguous {wanted} on {x.device}, "
                             f"not {const.dtype} {tuple(const.shape)} on {const.device}")
        consts.append(const)
    numbers = []
    for i, j in plan.numbers:
        number = program.ops[i].args[j]
        if plan.ops[i][0] == "topk_mask" and not 1 <= number <= plan.widths[i]:
            raise ValueError(f"op {i} (topk_mask): k = {number} with {plan.widths[i]} features")
        # bounds as floats: an int would reach Triton as an i32 argument, another signature to compile
        numbers.append(number if plan.ops[i][0] == "topk_mask" else float(number))
    return consts, numbers


@cache
def _max_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return sys.maxsize  # the interpreter runs programs one after another: nothing to bound
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


@dataclass
class GeneratedKernel:
    """The kernel of one program structure; called like run_program, for any program of that structure."""

    plan: _Plan
    source: str
    path: Path  # the generated file
    fn: object  # its @triton.jit program_kernel
    seconds: float  # the time generating it took (writing and importing; Triton compiles at first launch)

    def __call__(self, x, rows, program, table_index, out=None, dest=None) -> None:
        plan = self.plan
        consts, numbers = _arguments(plan, x, rows, program, table_index, out, dest)
        for (i, _), number in zip(plan.numbers, numbers):
            if plan.ops[i][0] == "topk_mask" and number > MAX_TOPK:
                raise NotImplementedError(f"op {i} (topk_mask): k = {number}; generated kernels take k <= {MAX_TOPK}")
        R = rows.numel()
        if R == 0:
            return
        programs = min(triton.cdiv(R, plan.block_rows), _max_programs(x.device))
        # x stands in for the pointers a launch does not use
        scratch = x
        if plan.scratch_width:
            scratch = torch.empty(programs * plan.block_rows, plan.scratch_width, dtype=torch.float32,
                                  device=x.device)
        write = out is None
        self.fn[(programs,)](
            x, x.stride(0), rows, R, rows if table_index is None else table_index,
            x if write else out, 0 if write else out.stride(0), rows if write else dest, scratch,
            *consts, *numbers,
            WRITE=write, BLOCK_ROWS=plan.block_rows, SCRATCH_WIDTH=plan.scratch_width, num_warps=plan.num_warps,
        )


_kernels: dict[tuple, GeneratedKernel] = {}


def generate_kernel(program: TokenProgram, F: int) -> tuple[GeneratedKernel, float]:
    """The kernel of program's structure for sites of F features, and the seconds this call spent
    generating it: 0.0 when the structure was seen before, as for new consts or numbers."""
    structure = _structure(program, F)
    kernel = _kernels.get(structure)
    if kernel is not None:
        return kernel, 0.0
    start = time.perf_counter()
    plan = _plan(structure)
    source = _Source(plan).text()
    path, fn = _import(source)
    seconds = time.perf_counter() - start
    kernel = _kernels[structure] = GeneratedKernel(plan, source, path, fn, seconds)
    log.info("generated the kernel of a %d-op program in %.3f s: %s", len(plan.ops), seconds, path)
    return kernel, seconds


def run_program(x, rows, program, table_index, out=None, dest=None) -> None:
    """x[rows[i]] = program(x[rows[i]]) (out None), else out[dest[i]] = program(x[rows[i]]).

    Generates the program's kernel on first use (see generate_kernel), then launches it. In
    place for writes; rows must be distinct (not checked: that would synchronise the device).
    """
    generate_kernel(program, x.shape[1])[0](x, rows, program, table_index, out, dest)


# --- the torch twin ----------------------------------------------------------------------------------
_TORCH_OPS = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "gt": lambda a, b: (a > b).float(), "ge": lambda a, b: (a >= b).float(),
    "lt": lambda a, b: (a < b).float(), "le": lambda a, b: (a <= b).float(),
    "eq": lambda a, b: (a == b).float(), "ne": lambda a, b: (a != b).float(),
    "logical_and": lambda a, b: ((a != 0) & (b != 0)).float(),
    "logical_or": lambda a, b: ((a != 0) | (b != 0)).float(),
    "neg": torch.neg, "abs": torch.abs, "relu": torch.relu, "gelu": torch_functional.gelu,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "exp": torch.exp, "log": torch.log,
    "logical_not": lambda a: (a == 0).float(), "unsqueeze": lambda a: a,
    "sum": lambda a: a.sum(-1, keepdim=True), "mean": lambda a: a.mean(-1, keepdim=True),
    "max": lambda a: a.amax(-1, keepdim=True), "min": lambda a: a.amin(-1, keepdim=True),
    "norm": lambda a: torch.linalg.vector_norm(a, dim=-1, keepdim=True),
    "softmax": lambda a: a.softmax(-1), "pow": torch.pow,
    "where": lambda c, a, b: torch.where(c != 0, a, b),
    "clamp": lambda a, lo, hi: a.clamp(lo, hi),
    "matmul": lambda a, w: a @ w,
    # the k-th largest counted with multiplicity; every lane tied with it stays, as in the kernel
    "topk_mask": lambda a, k: torch.where(a >= a.topk(k, dim=-1).values[:, -1:], a, 0.0),
}


def run_program_torch(x, rows, program, table_index, out=None, dest=None) -> None:
    """The same program in plain torch, for all R tokens at once (what the CPU engine runs).

    A value is [R, n], [R, 1] for () and (1,), or [1, n] when made of constants only.
    """
    plan = _plan(_structure(program, x.shape[1]))
    _arguments(plan, x, rows, program, table_index, out, dest)
    live = rows >= 0
    rows = rows[live]
    table_index = table_index[live] if table_index is not None else None
    dest = dest[live] if dest is not None else None
    R = rows.numel()
    if R == 0:
        return
    values = []
    for op in program.ops:
        if op.op == "x":
            value = x[rows].float()
        elif op.op == "const":
            value = program.consts[op.args[0]].reshape(1, -1)
        elif op.op == "table":
            value = program.consts[op.args[0]][table_index].reshape(R, -1)
        else:
            args = []
            for kind, arg in zip(ARGS[op.op], op.args):
                if kind == "value":
                    arg = values[arg] if isinstance(arg, int) else torch.tensor(arg, device=x.device)
                elif kind == "const":
                    arg = program.consts[arg]
                args.append(arg)
            value = _TORCH_OPS[op.op](*args)
        values.append(value)
    result = values[program.output].expand(R, plan.widths[program.output])
    if out is None:
        x[rows] = result.to(x.dtype)
    else:
        out[dest] = result.to(out.dtype)
