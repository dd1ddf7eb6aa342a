"""The per-token program format that generated kernels take, and its checks.

A program is a plain triple `(ops, consts, output)`:

  ops      a sequence of `(name, args, shape)` triples, one per op, in order: `name` an op of
           the op table (xmix_lens.ops.OPS), `args` as its arg kinds say, `shape` the op's value
           per token, () or (n,) with n >= 1
  consts   a sequence of fp32 tensors that "const" args index
  output   the index of the op whose value is the program's result

xmix_lens.lowered.TokenProgram and TokenOp are NamedTuples with exactly these fields, so the
lowering's programs pass as they are; the kernels read the triples positionally and import no
IR class. An op's args by kind (xmix_lens.ops): "value" an earlier op's index (int) or a number
(float: write `mul v 2.0`, not `mul v 2`), "const" an index into consts, "exponent" a nonzero
number written into the kernel's code, "bound" a number or None, "count" an int.

`structure` leaves a program's data out (the key its kernel is cached on), `plan` checks that
structure (shapes, broadcasting, which consts are read as what, the limits below) and lays its
kernel out, and `check_arguments` checks one launch, for the kernel and its torch twin alike.
"""

import math
from dataclasses import dataclass
from functools import cache

import torch
import triton

from ..ops import OPS, REDUCTIONS

ARGS = {name: op.args for name, op in OPS.items()}  # each op's arg kinds
NUMBER = "#"  # in a structure: a number the kernel takes at launch, not one written into its code

MAX_LANES = 8192
# Lanes of one value a program holds (BLOCK_ROWS x the widest value's lanes): 16K fp32 is 32
# registers a thread at 16 warps, so that a few live values fit in the register file.
LANES_PER_PROGRAM = 16384
MAX_BLOCK_ROWS = 16  # more rows a program only slows decode steps (few rows)
MAX_TOPK = 128
MAX_DOT_TILE = 64  # the most input features a tl.dot tile takes (dot_tile)
PROGRAMS_PER_SM = 4  # the grid on a GPU: enough programs to hide latency, a bounded scratch

__all__ = ["ARGS", "NUMBER", "REDUCTIONS", "MAX_LANES", "LANES_PER_PROGRAM", "MAX_BLOCK_ROWS", "MAX_TOPK",
           "MAX_DOT_TILE", "PROGRAMS_PER_SM", "Plan", "structure", "plan", "x_held", "dot_tile", "narrow_tile",
           "check_arguments", "sm_count"]


def structure(program, F: int) -> tuple:
    """The program with its data left out: the key of its kernel. Checks each arg's kind."""
    ops, consts, output = program
    checked = []
    for i, (name, args, shape) in enumerate(ops):
        kinds = ARGS.get(name)
        if kinds is None:
            raise ValueError(f"op {i}: unknown op {name!r}")
        if len(args) != len(kinds):
            raise ValueError(f"op {i} ({name}): takes {len(kinds)} args, got {args}")
        args = tuple(_structural_arg(i, name, kind, arg, len(consts)) for kind, arg in zip(kinds, args))
        checked.append((name, args, tuple(shape)))
    return F, output, tuple(checked)


def _structural_arg(i, name, kind, arg, n_consts):
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
    raise ValueError(f"op {i} ({name}): {arg!r} is not {expected}")


@dataclass(frozen=True)
class Plan:
    """A checked structure and what its kernel needs: the shapes, lanes and launch layout."""

    F: int
    output: int
    ops: tuple  # (name, structural args, shape) per op
    widths: tuple  # per op: n for (n,), 1 for () and (1,)
    numbers: tuple  # (op index, arg index) of each number passed at launch, in kernel order
    consts: tuple  # (const index, expected shape; None where any size goes) of each const read
    scratch: tuple  # (matmul op index, first scratch column) of each matmul staging its input
    scratch_width: int
    block_rows: int  # the most rows a program takes at a time (a launch of few rows takes fewer: dots permitting)
    widest: int  # the lanes of the widest value a program holds per row
    dots: bool  # whether a matmul runs on tl.dot, which needs block_rows (16) rows a program
    # (matmul op index, first partial column) of each tl.dot matmul of x, which a launch of few row
    # blocks splits over programs (split_matmul.py); their outputs side by side in a partial row
    split: tuple = ()
    split_width: int = 0

    def warps(self, block_rows: int) -> int:
        """The warps of a program taking block_rows rows at a time: 16 for 16K lanes, 32 fp32 registers
        a thread per value (ptxas for sm_90 reports no spills for F = 4096 steering or a 576 -> 4096
        -> 576 top-k SAE); 4 at least, and one per 512 lanes of a row (a 4096-wide row of a launch of
        few rows: 8 warps, 3.3 against 3.4 us with 4 and 5.2 in the plan's 4 rows of 16 warps, on an H200)."""
        return min(16, max(4, block_rows * self.widest // 1024, self.widest // 512))

    @property
    def writable(self) -> bool:
        """Whether the result can be written back: of shape (F,), as the site's row."""
        return self.ops[self.output][2] == (self.F,)


def _broadcast(i, name, shapes):
    sizes = {s for s in shapes if s not in ((), (1,))}
    if len(sizes) > 1:
        raise ValueError(f"op {i} ({name}): operands of shapes {sorted(sizes)} do not broadcast")
    return sizes.pop() if sizes else (1,) if (1,) in shapes else ()


@cache
def plan(structure: tuple) -> Plan:
    """Checks a structure (see `structure`) and lays out its kernel; raises NotImplementedError past the limits."""
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
        elif name in REDUCTIONS:
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
    held = [w for i, w in enumerate(widths) if ops[i][0] != "x" or x_held(i, output, ops)]
    widest = max(triton.next_power_of_2(w) for w in held or [1])
    block_rows = max(1, min(MAX_BLOCK_ROWS, LANES_PER_PROGRAM // widest))
    dots = [i for i, (name, args, _) in enumerate(ops)
            if name == "matmul" and widths[args[0]] > 1 and dot_tile(widths[i], block_rows)]
    split, split_width = [], 0
    for i in dots:
        if ops[ops[i][1][0]][0] == "x":
            split.append((i, split_width))
            split_width += widths[i]
    return Plan(
        F=F, output=output, ops=ops, widths=tuple(widths), numbers=tuple(numbers),
        consts=tuple(sorted(consts.items())), scratch=tuple(scratch), scratch_width=scratch_width,
        block_rows=block_rows, widest=widest, dots=bool(dots), split=tuple(split), split_width=split_width,
    )


@cache
def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device, which launches size their grids by."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def x_held(x: int, output: int, ops: tuple) -> bool:
    """Whether op x's value (the site row) is needed whole: it is the result, or an op other than
    a matmul's input reads it."""
    readers = [(name, j) for name, args, _ in ops for j, (kind, a) in enumerate(zip(ARGS[name], args))
               if kind == "value" and a == x]
    return output == x or any(name != "matmul" or j != 0 for name, j in readers)


def dot_tile(n: int, block_rows: int) -> int:
    """The input features a matmul takes per tl.dot (0: no tl.dot, narrow tiles instead: narrow_tile).
    tl.dot needs 16 rows and 16 outputs at least; wider outputs take fewer features a tile so
    that the tile of W stays within registers."""
    lanes = triton.next_power_of_2(n)
    return 0 if block_rows < 16 or lanes < 16 else max(16, min(MAX_DOT_TILE, 8192 // lanes))


# elements of the [rows, tile, outputs] product a narrow matmul sums per tile (in registers)
NARROW_PRODUCT = 8192


def narrow_tile(width_in: int, n: int, block_rows: int) -> int:
    """The input features a matmul without tl.dot (too few rows or outputs) takes per tile: as many
    as keep its [rows, tile, outputs] product within NARROW_PRODUCT elements (a dot product of a
    4096-wide row takes two tiles, not 4096 dependent loads)."""
    widest = NARROW_PRODUCT // (block_rows * triton.next_power_of_2(n))
    return max(1, min(triton.next_power_of_2(width_in), 1 << (max(widest, 1).bit_length() - 1)))


def check_arguments(plan: Plan, x, rows, program, table_index, out, dest, renorm=None):
    """Checks a launch (the kernel's and the twin's alike); returns the consts and numbers it passes."""
    ops, program_consts, _ = program
    R = rows.numel()
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x must be [T, F] with contiguous rows")
    if rows.dtype != torch.int32:
        raise ValueError(f"rows must be int32, not {rows.dtype}")
    if any(name == "table" for name, _, _ in plan.ops) and (
            table_index is None or table_index.dtype != torch.int32 or table_index.numel() != R):
        raise ValueError("a program with table ops needs table_index, int32 [R]")
    if out is None and not plan.writable:
        raise ValueError(f"a write's result has shape ({plan.F},), not {plan.ops[plan.output][2]}")
    if out is not None and (out.dim() != 2 or out.shape[1] != plan.widths[plan.output] or out.stride(1) != 1):
        raise ValueError(f"out must be [capacity, {plan.widths[plan.output]}] with contiguous rows")
    if out is not None and (dest is None or dest.dtype != torch.int32 or dest.numel() != R):
        raise ValueError("a read needs dest, int32 [R]")
    if renorm is not None and (out is not None or renorm.weight.shape != (plan.F,)
                               or renorm.out.shape[1:] != (plan.F,) or renorm.out.stride(1) != 1):
        raise ValueError(f"a renorm goes with a write, its weight [{plan.F}] and its out [T, {plan.F}] "
                         "with contiguous rows")
    consts = []
    for index, shape in plan.consts:
        const = program_consts[index]
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
        number = ops[i][1][j]
        if plan.ops[i][0] == "topk_mask" and not 1 <= number <= plan.widths[i]:
            raise ValueError(f"op {i} (topk_mask): k = {number} with {plan.widths[i]} features")
        # bounds as floats: an int would reach Triton as an i32 argument, another signature to compile
        numbers.append(number if plan.ops[i][0] == "topk_mask" else float(number))
    return consts, numbers
