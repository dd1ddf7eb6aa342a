"""Lowered ops under tensor parallelism: which run shard-local, which need a collective.

vLLM's tensor parallelism (TP = world ranks) shards some sites' features and replicates others:
  replicated  residual stream, attention and MLP outputs, norms: every rank holds all F features
  sharded     attn.hook_q/k/v/z, hook_rot_q/k (heads: rank r holds heads [r H/w, (r+1) H/w)),
              mlp.hook_pre, hook_pre_linear and mlp.hook_post (features: rank r holds [r F/w, (r+1) F/w));
              contiguous blocks of the flattened feature row either way
At a replicated site every rank runs the op unchanged (writes land identically on every rank) and
only rank 0 delivers reads. At a sharded site an op is split by `plan`:
  local       the op maps each shard to itself: rank r runs it on its block with its block of every
              parameter (a head selection, steering, scaling, an elementwise program, a low-rank
              term inside one block)
  reduce      a projection read (x @ W): each rank computes the partial sum over its block, an
              all-reduce sums them (rank 0 alone adds the bias)
  gather      anything else (a low-rank term across blocks, a program with a reduction, softmax,
              matmul or top-k over the row, an identity read): the ranks gather the whole row, run
              the op, and each keeps its block

`place` turns an op into what one rank of an engine runs (`Placed`); the site runtime and the
control plane run it with `on_site` and the engine's collectives (vllm/runtime.py: `TPCollectives`). `run_sharded`
runs a plan over a list of shards, the collectives done in torch: the CPU simulation of the same
plans, against the op on the whole site.
"""
import contextlib
import math
from dataclasses import dataclass, replace

import torch

from xmix_lens.lowered import LoweredOp, TokenProgram
from xmix_lens.ops import OPS

from .executor import Executor

SHARDED_SITES = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_z",
                 "mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post")


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
    if op.is_program:
        program: TokenProgram = op.program
        # ops that never mix features (the op table's "local" ops) and constants cut in blocks: shard-local
        elementwise = all(OPS[o.op].shards == "local" for o in program.ops) \
            and all(c.numel() in (1, F) for c in program.consts)
        return ShardPlan("local" if elementwise and op.writes else "gather", op, world)
    if op.writes:  # an affine write
        low_rank_local = op.U.shape[1] == 0 or all(_within_one_block(op.U[:, k], op.V[k], world)
                                                  for k in range(op.U.shape[1]))
        return ShardPlan("local" if low_rank_local else "gather", op, world)
    return ShardPlan("gather" if op.W is None else "reduce", op, world)  # a read: the identity, or a projection


def _within_one_block(u: torch.Tensor, v: torch.Tensor, world: int) -> bool:
    """Whether a rank-1 term reads and writes features of one shard only."""
    used = (u != 0).reshape(world, -1).any(1) | (v != 0).reshape(world, -1).any(1)
    return int(used.sum()) <= 1


def for_rank(p: ShardPlan, F: int, rank: int) -> LoweredOp:
    """The op rank `rank` runs: its block of a local or reduce plan, the whole op of a gather plan."""
    op, b = p.op, p.block(rank, F)
    if p.kind == "gather":
        return op
    if op.is_program:
        return replace(op, program=_block_program(op.program, b, F))
    if op.writes:  # an affine write
        return replace(op, scale=op.scale[b], bias=op.bias[..., b], U=op.U[b], V=op.V[:, b])
    # a read's reduce plan: a partial projection; the bias is added once, by rank 0
    bias = op.bias if op.bias is None or rank == 0 else torch.zeros_like(op.bias)
    return replace(op, W=op.W[b], bias=bias)


def _block_program(program: TokenProgram, b: slice, F: int) -> TokenProgram:
    """An elementwise program for one block of the features: F-wide values and constants cut to it."""
    width = b.stop - b.start
    ops = [o._replace(shape=(width,) if o.shape == (F,) else o.shape) for o in program.ops]
    consts = [c if c.numel() == 1 else c.reshape(-1)[b].contiguous() for c in program.consts]
    return TokenProgram(ops, consts, program.output)


# --- in an engine: one rank's view ---------------------------------------------------------------
@dataclass
class Placed:
    """An op at a sharded site of a TP engine, as one rank runs it."""

    kind: str
    op: LoweredOp  # on the rank's block (local, reduce) or on the gathered row (gather)
    block: slice  # the rank's features of the whole row


def place(op: LoweredOp, F: int, rank: int, world: int, resident: bool = False) -> Placed:
    """What rank `rank` runs for `op` at a sharded site of F features. A resident read runs as a
    gather (built when a read's rows alternated between two ring slots, which a replayed CUDA graph
    could not all-reduce in place; with one buffer of step values that reason is gone, and an
    in-place all-reduce is not tried yet)."""
    p = plan(op, F, world)
    if resident and p.kind == "reduce":
        p = replace(p, kind="gather")
    return Placed(p.kind, for_rank(p, F, rank), p.block(rank, F))


@contextlib.contextmanager
def on_site(placed: Placed | None, x: torch.Tensor, comm):
    """The tensor an op runs on: x (a replicated site, or the rank's block), or for a gather plan the
    whole row, gathered from every rank and written back to this rank's block afterwards."""
    if placed is None or placed.kind != "gather":
        yield x
        return
    whole = comm.all_gather(x)
    yield whole
    if placed.op.writes:
        x.copy_(whole[:, placed.block])


# --- the CPU simulation ----------------------------------------------------------------------------
def run_sharded(p: ShardPlan, shards: list[torch.Tensor]) -> torch.Tensor | None:
    """Apply the plan to the ranks' shards [T, F / world] (writes in place); a read's value, once."""
    F = sum(s.shape[1] for s in shards)
    rows = torch.arange(shards[0].shape[0], dtype=torch.int32)
    if p.kind == "gather":
        whole = torch.cat(shards, dim=1)
        value = _run(p.op, whole, rows)
        for rank, shard in enumerate(shards):
            shard.copy_(whole[:, p.block(rank, F)])
        return value
    values = [_run(for_rank(p, F, rank), shard, rows) for rank, shard in enumerate(shards)]
    return sum(values) if p.kind == "reduce" else None  # the all-reduce a reduce plan needs


def _run(op: LoweredOp, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
    """The op on every token of x (the torch twins of the kernels); a read's value."""
    executor = Executor(torch.device("cpu"), len(rows))
    if op.writes:
        executor.run(op, x, rows)
        return None
    out = torch.empty(len(rows), math.prod(op.feature_shape))
    executor.run(op, x, rows, out=out, dest=rows)
    return out
