"""Lowered ops under simulated tensor parallelism (backend/sharding.py): a site's features split
over ranks as vLLM shards heads and MLP features; each plan, run on the shards with its collectives
done in torch, must equal the op on the whole site. Plans are checked too: shard-local where the op
maps each shard to itself, a collective only where it needs one."""
import pytest
import torch

from xmix_lens import kernels
from xmix_lens.backend import sharding
from xmix_lens.lower import lower
from xmix_lens.lowered import AffineWrite, Read
from xmix_lens.trace import Tracer

H, D = 4, 8  # heads x head size at attn.hook_z: F = 32
F = H * D
SITE = "blocks.0.attn.hook_z"
gen = torch.Generator().manual_seed(0)
d_all = torch.randn(H, D, generator=gen)
d_all /= d_all.norm()
d_head0 = torch.zeros(H, D)
d_head0[0] = torch.randn(D, generator=gen)
d_head0 /= d_head0.norm()
w = torch.randn(H * D, 3, generator=gen)
v = torch.randn(H, D, generator=gen)


def zero_head(act, hook):
    act[:, :, 3] = 0.0


def project_out(d):
    """act minus its component along d, a direction over all heads' features (d: [H, D])."""
    flat_d = d.flatten()

    def hook(act, hook):
        flat = act.flatten(-2)
        return (flat - (flat @ flat_d)[..., None] * flat_d).reshape(act.shape)
    return hook


def norm_gate(act, hook):
    flat = act.flatten(-2)
    return (flat * torch.sigmoid(flat.norm(dim=-1))[..., None]).reshape(act.shape)


HOOKS = {  # name: (hook, the plan expected with 2 ranks)
    "zero_head": (zero_head, "local"),
    "steer": (lambda act, hook: act + v, "local"),
    "scale": (lambda act, hook: act * 0.5, "local"),
    "project_out_across_heads": (project_out(d_all), "gather"),
    "project_out_in_one_head": (project_out(d_head0), "local"),
    "probe": (lambda act, hook: KEPT.append(act.flatten(-2) @ w), "reduce"),
    "relu_gate_elementwise": (lambda act, hook: torch.relu(act) * 2.0 + act, "local"),
    "norm_gate": (norm_gate, "gather"),
}
KEPT = []  # where the probe keeps its value: a kept value is a read


def lowered(hook):
    """The hook's one op, traced for one token as an installed app is."""
    tracer = Tracer(SITE, (1, 1, H, D), torch.float32)
    tracer.call(hook, None)
    tracer.finish()
    KEPT.clear()
    (op,) = lower(tracer.graph)
    return op


def whole(op, x):
    """The op on the unsharded site (the torch twins the CPU engine runs)."""
    rows = torch.arange(x.shape[0], dtype=torch.int32)
    if isinstance(op, AffineWrite):
        zeros = torch.zeros_like(rows)
        kernels.affine_write_torch(x, rows, op.scale[None], zeros, op.bias[None], zeros, op.U, op.V)
        return None
    if isinstance(op, Read):
        return x @ op.W + (op.bias if op.bias is not None else 0) if op.W is not None else x.clone()
    if hasattr(op, "key"):
        out = torch.empty(x.shape[0], 1)
        kernels.run_program_torch(x, rows, op.program, None, out, rows)
        return out
    kernels.run_program_torch(x, rows, op.program, None)
    return None


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(HOOKS))
def test_sharded_plan_equals_the_whole_site(name, world):
    hook, expected_kind = HOOKS[name]
    op = lowered(hook)
    p = sharding.plan(op, F, world)
    if world == 2:
        assert p.kind == expected_kind, f"{name}: planned {p.kind}"
    x = torch.randn(7, F, generator=torch.Generator().manual_seed(world))
    reference = x.clone()
    read = whole(op, reference)
    shards = [s.clone() for s in x.split(F // world, dim=1)]
    value = sharding.run_sharded(p, shards)
    torch.testing.assert_close(torch.cat(shards, dim=1), reference, rtol=1e-5, atol=1e-5)
    if read is not None:
        torch.testing.assert_close(value, read, rtol=1e-5, atol=1e-5)


def test_a_collective_is_needed_only_where_the_op_mixes_shards():
    """Projecting out a direction within one head is local; one spread over every head needs the
    whole row (a gather), and running it shard-local instead gives a wrong result."""
    op = lowered(HOOKS["project_out_across_heads"][0])
    p = sharding.plan(op, F, 2)
    x = torch.randn(5, F, generator=torch.Generator().manual_seed(9))
    reference = x.clone()
    whole(op, reference)
    wrong = [s.clone() for s in x.split(F // 2, dim=1)]
    sharding.run_sharded(sharding.ShardPlan("local", op, 2), wrong)  # no gather
    assert (torch.cat(wrong, dim=1) - reference).abs().max() > 1e-2
    assert p.kind == "gather"
    assert sharding.plan(lowered(HOOKS["project_out_in_one_head"][0]), F, 2).kind == "local"


def test_a_reduce_read_adds_its_bias_once_and_resident_reads_gather():
    """Each rank's partial projection carries the bias on rank 0 only (the all-reduce would count
    it once per rank otherwise); an installed app's read runs as a gather (see `place`)."""
    op = lowered(lambda act, hook: KEPT.append(act.flatten(-2) @ w + 1.0))
    p = sharding.plan(op, F, 2)
    assert p.kind == "reduce" and op.bias is not None
    parts = [sharding.for_rank(p, F, rank) for rank in range(2)]
    assert parts[0].W.shape == (F // 2, 3) and bool(parts[0].bias.eq(1).all()) and not parts[1].bias.any()
    assert sharding.place(op, F, 1, 2, resident=True).kind == "gather"
    assert sharding.place(op, F, 1, 2).op.W.shape == (F // 2, 3)


def test_replicated_and_sharded_sites_are_named():
    assert sharding.is_sharded("blocks.3.attn.hook_z") and sharding.is_sharded("blocks.0.mlp.hook_post")
    assert not sharding.is_sharded("blocks.3.hook_resid_post") and not sharding.is_sharded("blocks.0.hook_attn_out")
