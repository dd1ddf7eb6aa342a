"""Residual sites beside vLLM's fused residual add + RMSNorm (backend/vllm/sites.py): the fused op
runs as it does without sites, and only the rows a write at a site changed are normalised again."""
import torch

from xmix_lens.backend.executor import Executor
from xmix_lens.lowered import AffineWrite
from xmix_lens.backend.vllm import site_op, sites


def test_a_residual_write_leaves_vllms_fused_norm_and_renormalizes_the_rows_it_wrote(monkeypatch):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    T, F, SITE = 40, 64, 7
    g = torch.Generator().manual_seed(0)
    written = torch.tensor([1, 3, 17])
    rows = torch.full((T,), -1, dtype=torch.int32)  # the write's control rows: -1 where it is off
    rows[written] = written.int()
    v = torch.randn(F, generator=g)

    steer = AffineWrite(None, torch.ones(F), v, torch.zeros(F, 0), torch.zeros(0, F))

    class OneResidentWrite:  # the site runtime of an engine with one write at the site: x[written] += v
        executor = Executor(torch.device("cpu"), T)

        def run_site(self, x, site_id, renorm=None):
            assert site_id == SITE and renorm is not None
            self.executor.run(steer, x, rows, renorm=renorm)

    monkeypatch.setattr(site_op, "running_site_runtime", OneResidentWrite)
    with set_current_vllm_config(VllmConfig()):
        norm = RMSNorm(F, eps=1e-5).to(torch.bfloat16)
        torch.nn.init.normal_(norm.weight, generator=g)
        x, residual = (torch.randn(T, F, generator=g).bfloat16() for _ in range(2))
        native_out, native_sum = norm(x.clone(), residual.clone())
        active = sites.ActiveSites()
        active.ids = active.written = frozenset({SITE})
        none = sites.SiteIds((), (), active)
        sites._wrap_norm(norm, sites.SiteIds((SITE,), (SITE,), active), none, none, none)
        out, resid = norm(x.clone(), residual.clone())

    expected_sum = native_sum.clone()
    expected_sum[written] = (native_sum[written].float() + v).bfloat16()
    assert torch.equal(resid, expected_sum)
    kept = torch.ones(T, dtype=torch.bool)
    kept[written] = False
    # bit for bit vLLM's fused output (normalising the rounded bf16 sum instead differs: 0.03 here)
    assert torch.equal(out[kept], native_out[kept])
    s = resid[written].float()  # vLLM's RMSNorm of the written sum
    expected = ((s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16() * norm.weight).bfloat16()
    assert torch.equal(out[written], expected)
    assert not torch.equal(out[written], native_out[written])


def test_a_residual_read_in_a_step_run_uncompiled_runs_as_a_plain_site(monkeypatch):
    """A step run uncompiled knows its sites only read (`ActiveSites.written`): the norm's output is
    vLLM's fused one, and the site runs without a renorm (nothing to normalise again)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    T, F, SITE = 8, 32, 3
    g = torch.Generator().manual_seed(1)
    calls = []

    class OneRead:
        def run_site(self, x, site_id, renorm=None):
            calls.append(("site" if renorm is None else "residual_site", site_id, x.clone()))

    monkeypatch.setattr(site_op, "running_site_runtime", OneRead)
    with set_current_vllm_config(VllmConfig()):
        norm = RMSNorm(F, eps=1e-5).to(torch.bfloat16)
        x, residual = (torch.randn(T, F, generator=g).bfloat16() for _ in range(2))
        native_out, native_sum = norm(x.clone(), residual.clone())
        active = sites.ActiveSites()
        active.ids = frozenset({SITE})  # on in the step, written by nobody
        none = sites.SiteIds((), (), active)
        sites._wrap_norm(norm, sites.SiteIds((SITE,), (SITE,), active), none, none, none)
        out, resid = norm(x.clone(), residual.clone())

    assert [c[0] for c in calls] == ["site"] and torch.equal(calls[0][2], native_sum)  # the site read the sum
    assert torch.equal(out, native_out) and torch.equal(resid, native_sum)
