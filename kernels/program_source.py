"""The Triton source of a generated kernel, written from its plan, and the import of that source.

`Source(plan).text()` writes the module of one program structure (program_format.plan): a header
comment listing the program, then `program_kernel`, a @triton.jit function taking BLOCK_ROWS rows
at a time, whose body has a few lines per op (op i's value is v<i>). `import_kernel` writes that
text into a file under CACHE_DIR (Triton reads kernels' source from real files) and imports it.

Each op of the op table (xmix_lens.ops) has its code here: the templates of elementwise ops and
reductions below, the rest in `Source.op`. Importing this module fails if an op of the table has
none, so that an op added to the table without its kernel code fails loudly.
"""

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import triton

from ..ops import OPS
from .program_format import ARGS, NUMBER, Plan, dot_tile, narrow_tile, x_held

CACHE_DIR = Path(tempfile.gettempdir()) / "xmix_lens_generated"
# integer arguments that change with every step's row count: specialising on them (Triton compiles
# a kernel apart for 1 and for multiples of 16) compiled kernels while serving
NOT_SPECIALIZED = ("R",)
SPLIT_NOT_SPECIALIZED = ("partial_split_stride",)

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

# per reduction over the row's lanes: (the fill of padding lanes, the reduction, what is reduced, the result)
_REDUCTION_CODE = {
    "sum": ("0.0", "tl.sum", "{a}", "{r}"),
    "mean": ("0.0", "tl.sum", "{a}", "{r} / {n}.0"),
    "max": (_MINUS_INFINITY, "tl.max", "{a}", "{r}"),
    "min": ('float("inf")', "tl.min", "{a}", "{r}"),
    "norm": ("0.0", "tl.sum", "{a} * {a}", "tl.sqrt({r})"),
}
# ops written by Source.op itself, beside the templates
_WRITTEN_BY_SOURCE = ("x", "const", "table", "matmul", "where", "clamp", "pow", "softmax", "topk_mask")

_WITHOUT_CODE = sorted(set(OPS) - {*_UNARY_CODE, *_BINARY_CODE, *_REDUCTION_CODE, *_WRITTEN_BY_SOURCE})
if _WITHOUT_CODE:
    raise ImportError(f"ops of xmix_lens.ops without Triton code in {__name__}: {', '.join(_WITHOUT_CODE)}")


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


class Source:
    """Writes the kernel of one plan. Op i's value is v<i>, const j's pointer c<j>_ptr, number m s<m>."""

    def __init__(self, plan: Plan):
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
            if not x_held(i, self.plan.output, self.plan.ops):
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
        if name in _REDUCTION_CODE:
            fill, reduce, reduced, result = _REDUCTION_CODE[name]
            expression = f"{reduce}({self.masked(reduced.format(a=a), width_in, fill)}, axis=1, keep_dims=True)"
            return [f"{v} = " + result.format(r=expression, n=width_in)]
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
        tile = dot_tile(n, self.plan.block_rows)
        from_x = self.plan.ops[args[0]][0] == "x"
        if from_x:  # x's columns read from x itself
            source, source_mask, to_f32 = "x_ptr + rows * x_row_stride", "live & ", ".to(tl.float32)"
            before, after = [], []
        else:  # registers cannot be indexed by lane: the value goes through this program's scratch rows
            offset = dict(self.plan.scratch)[i]
            source, source_mask, to_f32 = f"scratch_rows + {offset}" if offset else "scratch_rows", "", ""
            before = [f"tl.store({source} + {self.lanes(width_in)}, {a}, mask={self.mask(width_in)})",
                      "tl.debug_barrier()  # every thread's stores are visible before any thread reads a tile"]
            after = ["tl.debug_barrier()  # every tile is read before the next row block overwrites them"]
        n_mask = self.mask(n)
        w_mask = f"(f[:, None] < {width_in})" + (f" & {n_mask}" if n_mask else "")
        if tile:
            # tf32x3: three TF32 tensor-core products per tile, close to fp32 as the twin's matmul;
            # ieee fp32 ran on the FMA units, and an SAE read's few programs were compute bound
            # (54 us of an H200 decode step for 64 features of a 4096-wide row)
            how = f"tl.dot over tiles of {tile} input features (tf32x3: near-fp32 sums on tensor cores)"
            accumulate = f"    {v} += tl.dot(in_tile, w_tile, input_precision=\"tf32x3\")"
        else:  # too few rows or outputs for tl.dot: a broadcast product summed over each tile
            tile = narrow_tile(width_in, n, self.plan.block_rows)
            how = f"tiles of {tile} input features, each a broadcast product summed over the tile"
            accumulate = f"    {v} += tl.sum(in_tile[:, :, None] * w_tile[None, :, :], axis=1)"
        product = [
            f"# {v} = {a} @ {w[:-4]}, [{width_in}] @ [{width_in}, {n}]: {how}",
            *before,
            f"{v} = tl.zeros((BLOCK_ROWS, {triton.next_power_of_2(n)}), dtype=tl.float32)",
            f"for f0 in range(0, {width_in}, {tile}):",
            f"    f = f0 + tl.arange(0, {tile})",
            f"    in_tile = tl.load({source} + f[None, :], mask={source_mask}(f[None, :] < {width_in}), other=0.0){to_f32}",
            f"    w_tile = tl.load({w} + f[:, None] * {n} + {lanes}, mask={w_mask}, other=0.0)",
            accumulate,
            *after,
        ]
        column = dict(self.plan.split).get(i)
        if column is None:
            return product
        return [  # a launch of few row blocks splits it (split_matmul.py): its partial products summed in order
            "if SPLIT_K > 1:",
            f"    # {v} = {a} @ {w[:-4]}: the sum of SPLIT_K partial products over chunks of x's features"
            " (from L2: other programs stored them)",
            f"    {v} = tl.zeros((BLOCK_ROWS, {triton.next_power_of_2(n)}), dtype=tl.float32)",
            "    for s in tl.static_range(SPLIT_K):",
            f"        {v} += tl.load(partial_ptr + s * partial_split_stride + entries.to(tl.int64) * SPLIT_WIDTH"
            f" + ({column} + {lanes}), mask={self.mask(n, live=True)}, other=0.0, cache_modifier=\".cg\")",
            "else:",
            *("    " + line for line in product),
        ]

    def store(self) -> list[str]:
        plan = self.plan
        v, n = f"v{plan.output}", plan.widths[plan.output]
        read = [
            "dest = tl.load(dest_ptr + entries, mask=live, other=0).to(tl.int64)",
            f"tl.store(out_ptr + dest * out_row_stride + {self.lanes(n)}, {v}.to(out_ptr.dtype.element_ty), "
            f"mask={self.mask(n, live=True)})",
        ]
        if not plan.writable:
            return read
        lanes, mask, live_mask = self.lanes(n), self.mask(n), self.mask(n, live=True)
        squares = "written * written" if n == 1 else f"tl.where({mask}, written * written, 0.0)"
        return [
            "if WRITE:",
            f"    written = {v}.to(x_ptr.dtype.element_ty)",
            f"    tl.store(x_ptr + rows * x_row_stride + {lanes}, written, mask={live_mask})",
            "    if RENORM:  # the renorm template (rms_norm_rows.py) on the rows just written, held here",
            "        written = written.to(tl.float32)",
            f"        mean_square = tl.sum({squares}, axis=1, keep_dims=True) / {n}.0",
            f"        weight = {self.load(f'weight_ptr + {lanes}', n)}",
            "        normalized = normalized_row(written, mean_square, weight, eps)",
            f"        tl.store(out_ptr + rows * out_row_stride + {lanes}, normalized.to(out_ptr.dtype.element_ty), "
            f"mask={live_mask})",
            "else:",
            *("    " + line for line in read),
        ]

    def partial_products(self) -> list[str]:
        """A split launch's programs each store their share of every split matmul of x, and the
        last of a row block's SPLIT_K to arrive goes on with the program (split_matmul.py)."""
        plan = self.plan
        stores = []
        for i, column in plan.split:
            n, const = plan.widths[i], plan.ops[i][1][1]
            stores.append(f"store_partial_product(x_ptr, x_row_stride, rows, live, entries, R, c{const}_ptr, "
                          f"partial_ptr, partial_split_stride, {plan.F}, {n}, {triton.next_power_of_2(n)}, "
                          f"{column}, SPLIT_WIDTH, SPLIT_CHUNK, {dot_tile(n, plan.block_rows)}, BLOCK_ROWS)")
        return [
            "if SPLIT_K > 1:  # this program's share of the matmuls of x; the block's last to arrive goes on",
            "    if busy:",
            *("        " + line for line in stores),
            "        busy = arrived_last(arrivals_ptr + block, SPLIT_K)",
        ]

    def text(self) -> str:
        plan = self.plan
        writable = plan.writable
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
            f"# Generated by xmix_lens.kernels.program_source from a per-token program's structure (F = {plan.F}),",
            "# rewritten whenever that structure is seen anew: edits are lost. The program, per token",
            "# (c<j> program.consts[j], s<m> numbers passed at launch):",
            *(self.describe(i) for i in range(len(plan.ops))),
            f"#     result: v{plan.output}",
            "",
            "import triton",
            "import triton.language as tl",
            *([""] if writable or plan.split else []),
            *(["from xmix_lens.kernels.rms_norm_rows import normalized_row"] if writable else []),
            *(["from xmix_lens.kernels.split_matmul import arrived_last, store_partial_product"] if plan.split else []),
            "",
            "",
            # a launch's row count changes every step: one compiled kernel for all of them
            f"@triton.jit(do_not_specialize={NOT_SPECIALIZED + (SPLIT_NOT_SPECIALIZED if plan.split else ())!r})",
            "def program_kernel(",
            "    x_ptr, x_row_stride, rows_ptr, R, table_index_ptr, out_ptr, out_row_stride, dest_ptr, scratch_ptr,",
            *(["    weight_ptr, eps,"] if writable else []),
            *(["    partial_ptr, partial_split_stride, arrivals_ptr,"] if plan.split else []),
            *([f"    {', '.join(consts)},"] if consts else []),
            *([f"    {', '.join(numbers)},"] if numbers else []),
            "    WRITE: tl.constexpr, BLOCK_ROWS: tl.constexpr, SCRATCH_WIDTH: tl.constexpr,",
            *(["    RENORM: tl.constexpr,"] if writable else []),
            *(["    SPLIT_K: tl.constexpr, SPLIT_WIDTH: tl.constexpr, SPLIT_CHUNK: tl.constexpr,"]
              if plan.split else []),
            "):",
            *("    " + line for line in setup),
            "    # Program p takes row blocks p, p + num_programs, ...: a bounded grid bounds the scratch.",
            "    for block in range(tl.program_id(0), tl.cdiv(R, BLOCK_ROWS), tl.num_programs(0)):",
            *("        " + line for line in rows),
            "        # a block of gated-off rows (every row, in an idle graph-replayed step) does nothing",
            "        busy = tl.max(tl.max(live.to(tl.int32), axis=1), axis=0) > 0",
            *("        " + line for line in (self.partial_products() if plan.split else [])),
            "        if busy:",
            *("            " + line for line in body),
            "",
        ])


def import_kernel(source: str):
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
