"""Lowered ops under tensor parallelism: which run shard-local, which need a collective.

vLLM's tensor parallelism (TP = world ranks) shards some sites' features and replicates others:
  replicated  residual stream, attention and MLP outputs, norms: every rank holds all F features
  sharded     attn.hook_q/k/v/z (heads: rank r holds heads [r H/w, (r+1) H/w)), mlp.hook_pre and
              mlp.hook_post (features: rank r holds [r F/w, (r+1) F/w)); contiguous blocks of the
              flattened feature row either way
At a replicated site every rank runs the op unchanged (writes land identically on every rank) and
only rank 0 delivers reads. At a sharded site an op is split by `plan`:
  local       the op maps each shard to itself: rank r runs it on its block with its block of every
              parameter (a head selection, steering, scaling, an elementwise program)
  reduce      a read or low-rank term that sums over features (x @ W, x @ U): each rank computes the
              partial sum over its block, the ranks sum them (all-reduce), then each applies its block
  gather      anything else (a program with a reduction, softmax, matmul or top-k over the row): the
              ranks gather the whole row, run the op, and each keeps its block

`run_sharded` applies a plan to per-rank shards with the collectives done in torch (sums and
concatenations over the list of shards): the simulation the CPU tests use, and the reference the
engine's multi-GPU path must match.
"""
from dataclasses import dataclass, replace

import torch

from xmix_lens import kernels
from xmix_lens.lowered import AffineWrite, GeneratedRead, GeneratedWrite, LoweredOp, Read, TokenProgram

# per-token program ops that never mix features: a program made of these (and constants) is shard-local
_ELEMENTWISE = {"x", "const", "add", "sub", "mul", "div", "gt", "ge", "lt", "le", "eq", "ne", "logical_and",
                "logical_or", "neg", "abs", "relu", "gelu", "sigmoid", "tanh", "exp", "log", "logical_not", "pow",
                "where", "clamp"}

SHARDED_SITES = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z", "mlp.hook_pre", "mlp.hook_post")


def is_sharded(hook_name: str) -> bool:
    return hook_name.split(".", 2)[-1] in SHARDED_SITES


@dataclass
class ShardPlan:
    kind: str  # "local", "reduce" or "gather"
    op: LoweredOp
    world: int

    def block(self, rank: int, F: int) -> slice:
        width = F // self.world
        return slice(rank * width, (rank + 1) * width)


def plan(op: LoweredOp, F: int, world: int) -> ShardPlan:
    """How `op`, lowered for the whole site of F features, runs when F is split over `world` ranks."""
    if F % world:
        raise ValueError(f"a site of {F} features does not split over {world} ranks")
    if getattr(op, "positions", None) is not None or isinstance(op, AffineWrite) and op.per_token_bias:
        raise NotImplementedError("planned for per-token ops at every position (what installed apps run); "
                                  "position selections and per-token tables are not planned under TP yet")
    if isinstance(op, AffineWrite):
        low_rank_local = op.U.shape[1] == 0 or all(_within_one_block(op.U[:, k], op.V[k], world)
                                                  for k in range(op.U.shape[1]))
        return ShardPlan("local" if low_rank_local else "reduce", op, world)
    if isinstance(op, Read):
        return ShardPlan("gather" if op.W is None else "reduce", op, world)
    program: TokenProgram = op.program
    elementwise = all(o.op in _ELEMENTWISE for o in program.ops) and all(c.numel() in (1, F) for c in program.consts)
    return ShardPlan("local" if elementwise and isinstance(op, GeneratedWrite) else "gather", op, world)


def _within_one_block(u: torch.Tensor, v: torch.Tensor, world: int) -> bool:
    """Whether a rank-1 term reads and writes features of one shard only."""
    used = (u != 0).reshape(world, -1).any(1) | (v != 0).reshape(world, -1).any(1)
    return int(used.sum()) <= 1


def run_sharded(p: ShardPlan, shards: list[torch.Tensor]) -> torch.Tensor | None:
    """Apply the plan to the ranks' shards [T, F / world] (writes in place); a read's value, once."""
    op, F = p.op, sum(s.shape[1] for s in shards)
    rows = torch.arange(shards[0].shape[0], dtype=torch.int32)
    blocks = [p.block(r, F) for r in range(p.world)]
    if p.kind == "gather":
        whole = torch.cat(shards, dim=1)
        value = _run_whole(op, whole, rows)
        for shard, b in zip(shards, blocks):
            shard.copy_(whole[:, b])
        return value
    if isinstance(op, Read):  # reduce: partial projections, summed over ranks
        partial = sum(s.float() @ op.W[b] for s, b in zip(shards, blocks))
        return partial + (op.bias if op.bias is not None else 0)
    if isinstance(op, AffineWrite):
        partials = [s.float() @ op.U[b] for s, b in zip(shards, blocks)]
        total = sum(partials)  # the all-reduce a "reduce" plan needs
        for s, b, partial in zip(shards, blocks, partials):
            low_rank = total if p.kind == "reduce" else partial
            s.copy_((s.float() * op.scale[b] + op.bias[b] + low_rank @ op.V[:, b]).to(s.dtype))
        return None
    for s, b in zip(shards, blocks):  # a local (elementwise) program on each block
        kernels.run_program_torch(s, rows, _block_program(op.program, b, F), None)
    return None


def _block_program(program: TokenProgram, b: slice, F: int) -> TokenProgram:
    """An elementwise program for one block of the features: F-wide values and constants cut to it."""
    width = b.stop - b.start
    ops = [replace(o, shape=(width,) if o.shape == (F,) else o.shape) for o in program.ops]
    consts = [c if c.numel() == 1 else c.reshape(-1)[b].contiguous() for c in program.consts]
    return TokenProgram(ops, consts, program.output)


def _run_whole(op: LoweredOp, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
    if isinstance(op, Read):
        out = torch.empty(len(rows), x.shape[1])
        kernels.gather_rows_torch(x, rows, out, rows)
        return out
    if isinstance(op, GeneratedRead):
        out = torch.empty(len(rows), int(torch.tensor(op.feature_shape).prod()) if op.feature_shape else 1)
        kernels.run_program_torch(x, rows, op.program, None, out, rows)
        return out
    kernels.run_program_torch(x, rows, op.program, None)
    return None
