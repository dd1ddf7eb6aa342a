"""The torch twin of the generated kernels: a per-token program in plain torch (what the CPU engine runs).

It takes run_program's arguments, checks them as the launcher does (program_format), and runs
each computing op by its torch function in the op table (xmix_lens.ops.OPS[name].torch). The
program's structural ops are written here: x (the selected rows), const and table (the consts),
unsqueeze (the [R, 1] value as it is) and matmul (the value times its const matrix).
"""

import torch

from ..ops import OPS
from .program_format import check_arguments, plan, structure
from .rms_norm_rows import Renorm, rms_norm_rows_torch


def run_program_torch(x, rows, program, table_index, out=None, dest=None, renorm: Renorm | None = None) -> None:
    """The same program in plain torch, for all R tokens at once (what the CPU engine runs).

    A value is [R, n], [R, 1] for () and (1,), or [1, n] when made of constants only.
    """
    checked = plan(structure(program, x.shape[1]))
    check_arguments(checked, x, rows, program, table_index, out, dest, renorm)
    ops, consts, output = program
    all_rows, live = rows, rows >= 0
    rows = rows[live]
    table_index = table_index[live] if table_index is not None else None
    dest = dest[live] if dest is not None else None
    R = rows.numel()
    if R == 0:
        return
    values = []
    for name, op_args, _ in ops:
        if name == "x":
            value = x[rows].float()
        elif name == "const":
            value = consts[op_args[0]].reshape(1, -1)
        elif name == "table":
            value = consts[op_args[0]][table_index].reshape(R, -1)
        else:
            op, args = OPS[name], []
            for kind, arg in zip(op.args, op_args):
                if kind == "value":
                    arg = values[arg] if isinstance(arg, int) else torch.tensor(arg, device=x.device)
                elif kind == "const":
                    arg = consts[arg]
                args.append(arg)
            if name == "unsqueeze":
                value = args[0]  # a () value is [R, 1] already
            elif name == "matmul":
                value = args[0] @ args[1]
            elif op.kind == "reduction":
                value = op.torch(*args).unsqueeze(-1)  # the table's reductions drop the feature dim
            else:
                value = op.torch(*args)
        values.append(value)
    result = values[output].expand(R, checked.widths[output])
    if out is None:
        x[rows] = result.to(x.dtype)
        if renorm is not None:
            rms_norm_rows_torch(x, all_rows, *renorm)
    else:
        out[dest] = result.to(out.dtype)
