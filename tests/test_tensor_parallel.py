"""Hooks under vLLM tensor parallelism (TP=2, vLLM's multiprocess workers on the CPU) equal the same
hooks on the session's one-rank engine: the driver-worker seam (backend/vllm/remote.py), ops placed
per rank at sharded sites (sharding.py) with real collectives, rank-0 read delivery, vocabulary
shards gathered for the logits. The model is the tiny Llama (4 heads, 2 KV heads: both split over
2 ranks). tests/gpu/test_tp_gpu.py runs the same comparison on two GPUs in bf16."""
import pytest
import torch

from xmix_lens import App, HookedServedModel
from xmix_lens.backend import sharding
from tests.tiny_models import tiny_llama

MODEL = "tiny-llama"
PROMPTS = ["The cat sat on the mat and looked", "One two three", "A quick brown fox jumps over"]
TOL = dict(rtol=1e-4, atol=1e-4)  # fp32; TP changes only the order of the matmuls' sums


def ranks_engine(**layout) -> HookedServedModel:
    """The tiny Llama on vLLM's multiprocess CPU workers, `layout` its parallel sizes."""
    # vLLM's CPU workers bind their threads to one NUMA node each; this machine has one node, so
    # have vLLM split its cores between the ranks as if they were several nodes
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_SIM_MULTI_NUMA", "1")
        return HookedServedModel.from_pretrained(str(tiny_llama()), max_model_len=256,
                                                 distributed_executor_backend="mp", **layout)


@pytest.fixture(scope="module")
def tp2():
    model = ranks_engine(tensor_parallel_size=2)
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def tp1(served):
    return served[MODEL]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


class Hooks:
    """Reads, writes, a conditional write and a head ablation, at replicated and sharded sites."""

    def __init__(self, cfg):
        H, D, d, M = cfg.n_heads, cfg.d_head, cfg.d_model, cfg.d_mlp
        self.v = 2.0 * torch.randn(d, generator=_gen(1))
        self.w_z = torch.randn(H * D, 3, generator=_gen(2))
        u = torch.randn(M, generator=_gen(3))
        self.u = u / u.norm()
        self.kept = {}

    def cases(self):
        kept, shared = self.kept, {}
        return {
            # replicated site: the same write on every rank
            "steer_resid": [("blocks.0.hook_resid_mid", lambda act, hook: act + self.v)],
            # head 3 of 4 lives on rank 1 alone: a local plan
            "ablate_head": [("blocks.1.attn.hook_z", _zero_head(3))],
            "scale_q": [("blocks.0.attn.hook_q", lambda act, hook: act * 0.5)],
            # a conditional write whose condition spans every head: a gather plan
            "conditional_z": [("blocks.0.attn.hook_z", _damp_when_large)],
            # a direction over all MLP features: a low-rank write across blocks (gather)
            "project_out_mlp": [("blocks.1.mlp.hook_post", lambda act, hook: act - (act @ self.u)[..., None] * self.u)],
            "gelu_pre": [("blocks.0.mlp.hook_pre", lambda act, hook: torch.relu(act) * 1.5)],
            # reads: a projection over heads (reduce), a whole site (gather), the residual (replicated)
            "probe_z": [("blocks.1.attn.hook_z", lambda act, hook: kept.update(z=act.flatten(-2) @ self.w_z))],
            "read_k": [("blocks.0.attn.hook_k", lambda act, hook: kept.update(k=act))],
            "read_resid": [("blocks.1.hook_resid_post", lambda act, hook: kept.update(r=act[:, -1]))],
            # a value kept at one hook point and written at a later one: a store, which the driver
            # sends to the workers together with the view of it the writer reads
            "kept_then_written": [("blocks.0.hook_resid_post", lambda act, hook: shared.update(a=act)),
                                  ("blocks.1.hook_resid_mid", lambda act, hook: act + 0.5 * shared["a"])],
        }


def _damp_when_large(act, hook):
    flat = act.flatten(-2)
    return torch.where(flat.norm(dim=-1)[..., None] > 1.0, flat * 0.25, flat).reshape(act.shape)


def _zero_head(h):
    def hook(act, hook):
        act[:, :, h] = 0.0
    return hook


@pytest.mark.parametrize("case", ["steer_resid", "ablate_head", "scale_q", "conditional_z", "project_out_mlp",
                                  "gelu_pre", "probe_z", "read_k", "read_resid", "kept_then_written"])
def test_hooks_under_tp2_equal_one_rank(tp1, tp2, case):
    assert_hooks_equal(tp1, tp2, case)


def assert_hooks_equal(one_rank, ranks, case: str) -> None:
    """The case's logits and reads on the engine of several ranks equal the one-rank engine's."""
    results = []
    for model in (one_rank, ranks):
        hooks = Hooks(model.cfg)
        logits = model.run_with_hooks(PROMPTS, fwd_hooks=hooks.cases()[case])
        results.append((logits, dict(hooks.kept)))
    (logits1, kept1), (logits2, kept2) = results
    plain = one_rank(PROMPTS)
    assert (logits1 - plain).abs().max() > 1e-3 or kept1, f"{case} changed nothing: the comparison would be empty"
    torch.testing.assert_close(logits2, logits1, **TOL)
    assert kept2.keys() == kept1.keys()
    for key in kept1:
        torch.testing.assert_close(kept2[key], kept1[key], **TOL)


def test_which_plans_the_cases_get(tp1):
    """The cases above cover every plan kind (so the comparison exercises every collective)."""
    hooks, kinds = Hooks(tp1.cfg), set()
    for case in ("ablate_head", "conditional_z", "probe_z"):  # all at attn.hook_z
        ops = tp1.planner.lower_app(case, hooks.cases()[case]).ops
        ((_, (op,)),) = ops.items()
        kinds.add(sharding.plan(op, tp1.cfg.n_heads * tp1.cfg.d_head, 2).kind)
    assert kinds == {"local", "gather", "reduce"}


def test_cache_and_generation_under_tp2(tp1, tp2):
    names = ["blocks.0.attn.hook_q", "blocks.0.attn.hook_k", "blocks.1.attn.hook_v", "blocks.1.attn.hook_z",
             "blocks.0.mlp.hook_pre", "blocks.1.mlp.hook_post", "blocks.1.hook_resid_post"]
    logits1, cache1 = tp1.run_with_cache(PROMPTS, names_filter=names)
    logits2, cache2 = tp2.run_with_cache(PROMPTS, names_filter=names)
    torch.testing.assert_close(logits2, logits1, **TOL)
    for name in names:
        torch.testing.assert_close(cache2[name], cache1[name], **TOL)
    hooks = [("blocks.1.attn.hook_z", _zero_head(1)), ("blocks.0.hook_resid_post", lambda act, hook: act * 1.5)]
    out1 = tp1.generate(PROMPTS[0], max_new_tokens=8, fwd_hooks=hooks, do_sample=False, return_type="tokens")
    out2 = tp2.generate(PROMPTS[0], max_new_tokens=8, fwd_hooks=hooks, do_sample=False, return_type="tokens")
    assert torch.equal(out1, out2)


def _apps(cfg, prefix):
    """Installed apps (resident ops) at sharded sites: a head shift (local) and a read over every
    head (gather, its step values filled by row), and a residual probe (replicated)."""
    H, D = cfg.n_heads, cfg.d_head
    shift = App(f"{prefix}shift", params={"s": 3.0 * torch.randn(H, D, generator=_gen(4)) * (torch.arange(H) == 2)[:, None]})
    shift.fwd_hooks.append(("blocks.0.attn.hook_z", lambda act, hook: act + shift.params["s"]))
    probe = App(f"{prefix}zprobe", params={"w": torch.randn(H * D, 2, generator=_gen(5))})
    probe.fwd_hooks.append(("blocks.1.attn.hook_z",
                            lambda act, hook: probe.outputs.update(score=act.flatten(-2) @ probe.params["w"])))
    return [shift, probe]


def test_installed_apps_under_tp2(tp1, tp2):
    assert_apps_equal(tp1, tp2, "tp-")


def assert_apps_equal(one_rank, ranks, prefix: str) -> None:
    """_apps installed, chosen per row and their params changed: the engine of several ranks gives
    the one-rank engine's logits and app reads."""
    runs = []
    for model in (one_rank, ranks):
        apps = _apps(model.cfg, prefix)
        for app in apps:
            model.install(app)
        try:
            info = model.engine.runtime.installed
            assert (info[f"{prefix}shift"].reads, info[f"{prefix}zprobe"].reads) == (False, True)
            runs.append(model.run_with_hooks(PROMPTS, apps=[[f"{prefix}shift", f"{prefix}zprobe"], [],
                                                            [f"{prefix}zprobe"]], padding_side="left"))
            model.set_params(f"{prefix}shift", s=-apps[0].params["s"])
            runs.append(model.run_with_hooks(PROMPTS, apps=[[f"{prefix}shift"], [f"{prefix}shift"], []],
                                             padding_side="left"))
        finally:
            for app in apps:
                model.uninstall(app.name)
    (a1, b1), (a2, b2) = runs[:2], runs[2:]
    for one, two in ((a1, a2), (b1, b2)):
        torch.testing.assert_close(two.result, one.result, **TOL)
        assert two.outputs.keys() == one.outputs.keys()
        for app in one.outputs:
            for key in one.outputs[app]:
                torch.testing.assert_close(two.outputs[app][key], one.outputs[app][key], equal_nan=True, **TOL)
    assert not torch.allclose(a1.result, b1.result)  # the apps did something
    assert not any(name.startswith(prefix) for name in ranks.engine.runtime.installed)


def test_reads_come_home_from_rank_0_only(tp2):
    """Each worker's runtime: rank 1 files no resident reads (rank 0 delivers them once)."""
    app = _apps(tp2.cfg, "tp-once-")[1]
    tp2.install(app)
    try:
        tp2.run_with_hooks(PROMPTS[:1], apps=[[app.name]])
        assert tp2.engine.runtime.read("tp_rank") == [0, 1]
        assert tp2.engine.runtime.read("control.delivers") == [True, False]
    finally:
        tp2.uninstall(app.name)


def test_bad_parallel_layouts_are_refused_before_an_engine_is_built():
    with pytest.raises(ValueError, match="does not divide"):
        HookedServedModel.from_pretrained(str(tiny_llama()), tensor_parallel_size=3)


def test_errors_under_tp_name_the_problem_and_leave_the_engine_usable(tp1, tp2):
    app = _apps(tp2.cfg, "tp-err-")[0]
    tp2.install(app)
    try:
        with pytest.raises(Exception, match="tp-nope"):  # refused in the driver, before any RPC
            tp2.run_with_hooks(PROMPTS[:1], apps=[["tp-nope"]])
        ops = tp2.planner.lower_app(app.name, app.fwd_hooks).ops
        with pytest.raises(ValueError, match="installed already"):  # raised in the workers, sent back as is
            tp2.engine.runtime.install_app(app.name, ops)
        assert tp2.engine.runtime.read("installed")[1].keys() == tp2.engine.runtime.installed.keys()
    finally:
        tp2.uninstall(app.name)
    torch.testing.assert_close(tp2(PROMPTS), tp1(PROMPTS), **TOL)
