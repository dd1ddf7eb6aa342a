"""The op table: every op a hook can compute, written once.

Tracing maps torch's functions to these names (`aliases`), the IR evaluates them (`torch`), lowering
tells elementwise ops from reductions (`kind`), generated kernels check a program's arguments
(`args`) and their torch twin runs `torch`, and tensor parallelism runs an op on each rank's block
of features where it `shards` ("local") or on the gathered row ("gather"). Adding an op is a row
here plus its Triton code in kernels/program_source.py.

`torch` is the op per token over the last (feature) dim: a reduction drops that dim.
Arg kinds: "value" (a traced value; in a TokenProgram an earlier op's index, or a float number),
"const" (an index into a TokenProgram's consts), "exponent" (a number written into the kernel's
code), "bound" (a number or None), "count" (an int).

Besides the computing ops, a TokenProgram has structural ops (kind "program"): `x` (the site row),
`const` and `table` (constants, per program or per token), `matmul` (a value times a constant
matrix) and `unsqueeze` (a () value as (1,)). Only per-token programs use them; the IR expresses
the same with its own nodes (act, const, linear, reshape).
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .functional import topk_mask


@dataclass(frozen=True)
class Op:
    name: str
    kind: str  # "elementwise", "reduction", "row" (mixes the row's features, keeps its shape), "program"
    args: tuple[str, ...]
    torch: Callable | None  # per token over the feature dim; None for structural ops
    shards: str  # "local": each rank runs its block; "gather": the op needs the whole row
    # torch function / method names traced as this op; their in-place spellings (add_, __iadd__, clamp_,
    # masked_fill_) are traced as the op followed by a write into the tensor they were called on
    aliases: tuple[str, ...] = ()
    # whether finite values give a finite one: not so a division (by 0), exp (overflow), log (of 0 or
    # less) or pow (0 to a negative power); a hook's non-finite writes are reported only where they are
    # looked for, in host-planned passes (planner.py: a call's resident ops keep finite values finite)
    finite: bool = True


def _float(test: Callable) -> Callable:
    return lambda *a: test(*a).float()


_TABLE = [
    # elementwise, two values
    Op("add", "elementwise", ("value", "value"), torch.add, "local", ("add", "__add__", "__radd__")),
    Op("sub", "elementwise", ("value", "value"), torch.sub, "local", ("sub", "__sub__", "subtract")),
    Op("mul", "elementwise", ("value", "value"), torch.mul, "local",
       ("mul", "__mul__", "__rmul__", "multiply")),
    Op("div", "elementwise", ("value", "value"), torch.div, "local",
       ("div", "__truediv__", "true_divide", "divide"), finite=False),
    Op("gt", "elementwise", ("value", "value"), _float(torch.gt), "local", ("gt", "__gt__", "greater")),
    Op("ge", "elementwise", ("value", "value"), _float(torch.ge), "local", ("ge", "__ge__")),
    Op("lt", "elementwise", ("value", "value"), _float(torch.lt), "local", ("lt", "__lt__", "less")),
    Op("le", "elementwise", ("value", "value"), _float(torch.le), "local", ("le", "__le__")),
    Op("eq", "elementwise", ("value", "value"), _float(torch.eq), "local", ("eq", "__eq__")),
    Op("ne", "elementwise", ("value", "value"), _float(torch.ne), "local", ("ne", "__ne__")),
    Op("logical_and", "elementwise", ("value", "value"), lambda a, b: ((a != 0) & (b != 0)).float(), "local",
       ("logical_and", "__and__")),
    Op("logical_or", "elementwise", ("value", "value"), lambda a, b: ((a != 0) | (b != 0)).float(), "local",
       ("logical_or", "__or__")),
    # elementwise, one value
    Op("neg", "elementwise", ("value",), torch.neg, "local", ("neg", "__neg__", "negative")),
    Op("abs", "elementwise", ("value",), torch.abs, "local", ("abs", "__abs__")),
    Op("relu", "elementwise", ("value",), torch.relu, "local", ("relu",)),
    Op("gelu", "elementwise", ("value",), F.gelu, "local", ("gelu",)),
    Op("sigmoid", "elementwise", ("value",), torch.sigmoid, "local", ("sigmoid",)),
    Op("tanh", "elementwise", ("value",), torch.tanh, "local", ("tanh",)),
    Op("exp", "elementwise", ("value",), torch.exp, "local", ("exp",), finite=False),
    Op("log", "elementwise", ("value",), torch.log, "local", ("log",), finite=False),
    Op("logical_not", "elementwise", ("value",), lambda a: (a == 0).float(), "local", ("logical_not", "__invert__")),
    # elementwise with numbers
    # (their torch spellings' arguments are read in trace.py: sqrt is pow 0.5, masked_fill(m, v) is where(m, v, x))
    Op("pow", "elementwise", ("value", "exponent"), torch.pow, "local", ("pow", "__pow__", "sqrt", "rsqrt"),
       finite=False),
    Op("where", "elementwise", ("value", "value", "value"), lambda c, a, b: torch.where(c != 0, a, b), "local",
       ("where", "masked_fill")),
    Op("clamp", "elementwise", ("value", "bound", "bound"), torch.clamp, "local",
       ("clamp", "clip", "clamp_min", "clamp_max")),
    # reductions over the feature dim
    Op("sum", "reduction", ("value",), lambda a: a.sum(-1), "gather", ("sum",)),
    Op("mean", "reduction", ("value",), lambda a: a.mean(-1), "gather", ("mean",)),
    Op("max", "reduction", ("value",), lambda a: a.amax(-1), "gather", ("max", "amax")),
    Op("min", "reduction", ("value",), lambda a: a.amin(-1), "gather", ("min", "amin")),
    Op("norm", "reduction", ("value",), lambda a: torch.linalg.vector_norm(a, dim=-1), "gather",
       ("norm", "vector_norm")),
    # ops that mix the row's features and keep its shape
    Op("softmax", "row", ("value",), lambda a: a.softmax(-1), "gather"),
    Op("topk_mask", "row", ("value", "count"), topk_mask, "gather"),
    # the structure of per-token programs
    Op("x", "program", (), None, "local"),
    Op("const", "program", ("const",), None, "local"),
    Op("table", "program", ("const",), None, "gather"),
    Op("matmul", "program", ("value", "const"), None, "gather"),
    Op("unsqueeze", "program", ("value",), None, "gather"),
]

OPS: dict[str, Op] = {op.name: op for op in _TABLE}


def of_kind(*kinds: str) -> dict[str, Op]:
    return {name: op for name, op in OPS.items() if op.kind in kinds}


ELEMENTWISE = of_kind("elementwise")
REDUCTIONS = of_kind("reduction")
