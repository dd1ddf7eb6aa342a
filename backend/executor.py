"""The executor: one launch path per lowered op kind, its kernels chosen once.

Everything that runs lowered ops calls `Executor.run`: a host-planned pass on its tokens
(vllm/runtime.py), installed apps' resident ops over every token of a step (control.py), and
the tensor-parallel plans simulated on the CPU (sharding.py). A write changes x's selected
rows in place; a read fills `out[dest]`. The kernels are chosen when the executor is made: the
Triton templates and generated kernels on a CUDA device, their torch twins elsewhere (Triton
compiles no CPU code; tests run the Triton kernels in its interpreter against the twins).
"""
from typing import NamedTuple

import torch

from xmix_lens import kernels
from xmix_lens.kernels.program_kernel import launch_row_counts
from xmix_lens.kernels.split_matmul import arrival_counters
from xmix_lens.lowered import AffineWrite, GeneratedRead, GeneratedWrite, LoweredOp, Read


class Kernels(NamedTuple):
    affine_write: object
    gather_rows: object
    project_read: object
    run_program: object


TRITON = Kernels(kernels.affine_write, kernels.gather_rows, kernels.project_read, kernels.run_program)
TORCH = Kernels(kernels.affine_write_torch, kernels.gather_rows_torch, kernels.project_read_torch,
                kernels.run_program_torch)


class Executor:
    def __init__(self, device: torch.device, max_tokens: int):
        device = torch.device(device)
        self.kernels = TRITON if device.type == "cuda" else TORCH
        # the index of a shared (not per-token) bias row, for every token: allocated once, so that a
        # launch inside a CUDA-graph capture allocates nothing
        self.zeros = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        if device.type == "cuda":  # and so the generated kernels' arrival counters (split_matmul.py)
            arrival_counters(device)

    def run(self, op: LoweredOp, x: torch.Tensor, rows: torch.Tensor, table_index: torch.Tensor | None = None,
            out: torch.Tensor | None = None, dest: torch.Tensor | None = None,
            renorm: kernels.Renorm | None = None) -> None:
        """Run `op` on x's rows (int32, -1 skipped). `table_index`: each row's index into per-token
        tables ([B, P, ...] flattened), for ops that have them. Reads write `out[dest]`. `renorm`: at a
        residual site, the norm's output after it, whose rows a write makes again (a read ignores it)."""
        self._launches[type(op)](self, op, x, rows, table_index, out, dest, renorm)

    def launch_row_counts(self, op: LoweredOp, F: int, most: int) -> list[int]:
        """Row counts at which launches of `op` at a site of F features compile every kernel that its
        launches of up to `most` rows use (programs' kernels: launch_row_counts); none where one
        launch compiles the only kernel (the templates) or nothing is compiled (the torch twins)."""
        if self.kernels is not TRITON or not op.is_program:
            return []
        return launch_row_counts(op.program, F, self.zeros.device, most)

    def _affine_write(self, op: AffineWrite, x, rows, table_index, out, dest, renorm) -> None:
        zeros = self.zeros[: rows.numel()]
        if op.per_token_bias:
            self.kernels.affine_write(x, rows, op.scale[None], zeros, op.bias.reshape(-1, op.bias.shape[-1]),
                                      table_index, op.U, op.V, renorm)
        else:
            self.kernels.affine_write(x, rows, op.scale[None], zeros, op.bias[None], zeros, op.U, op.V, renorm)

    def _read(self, op: Read, x, rows, table_index, out, dest, renorm) -> None:
        if op.W is None:
            self.kernels.gather_rows(x, rows, out, dest)
            return
        width = op.W.shape[1]
        shared = op.bias is not None and op.bias.dim() == 1
        self.kernels.project_read(x, rows, op.W, op.bias if shared else torch.zeros(width, device=x.device), out, dest)
        if op.bias is not None and not shared:  # a per-token bias, added where it is known
            out[dest.long()] += op.bias.reshape(-1, width)[table_index.long()]

    def _program(self, op: GeneratedWrite | GeneratedRead, x, rows, table_index, out, dest, renorm) -> None:
        table_index = self.zeros[: rows.numel()] if table_index is None else table_index
        if op.writes:
            self.kernels.run_program(x, rows, op.program, table_index, renorm=renorm)
        else:
            self.kernels.run_program(x, rows, op.program, table_index, out, dest)

    # each op kind's launch path (a new kind adds its own)
    _launches = {AffineWrite: _affine_write, Read: _read, GeneratedWrite: _program, GeneratedRead: _program}
