"""GPU only (the lent H200, vllm 0.26.0): installed apps run inside replayed CUDA graphs.

Not collected by CI (pyproject ignores tests/gpu). Run there as:
    XMIX_GPU_MODEL=.gpumodel XMIX_GPU_OUT=$OUT python3 -m pytest -q tests/gpu/test_graphs_gpu.py -o addopts=""
One engine, vLLM's default compilation and CUDA-graph mode, dummy weights. Apps installed as it is
built (so its graphs contain their launches): a steering write, a gated write (a generated
kernel), a head ablation and a probe read. Checked:
  - graphs are captured and replayed while requests select apps: no step falls back to eager;
  - the apps take effect in decode steps (the tokens change; the probe reads generated positions);
  - the result equals the same hooks run per call (host-planned, in steps without graphs);
  - default apps (requests that choose none), reselecting and re-parameterising change results
    with no new capture.
"""
import json
import os
import time
from types import SimpleNamespace

import pytest
import torch

import xmix_lens  # noqa: F401  (its from_pretrained sets vLLM's environment for the in-process engine)
from gpu_results import Results
from xmix_lens import HookedServedModel
from xmix_lens.backend.control import HostTime
from xmix_lens.passes import PassPlan

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "Steering vectors move", "One two three four five six seven eight"]
NEW = 16
RESULTS = Results("graphs_gpu.json")
record = RESULTS.record


class Hooks:
    def __init__(self, d_model: int):
        g = torch.Generator().manual_seed(0)
        self.v = torch.randn(d_model, generator=g) * 0.05  # dummy weights are tiny: so are activations
        d = torch.randn(d_model, generator=g)
        self.d = d / d.norm()
        self.w = torch.randn(d_model, 2, generator=g)

    def apps(self, v=None):
        v = self.v if v is None else v
        d = self.d

        def zero_head(act, hook):
            act[:, :, 3] = 0.0

        return {
            "steer": [("blocks.2.hook_resid_post", lambda act, hook: act + v)],
            "gate": [("blocks.5.hook_resid_post", lambda act, hook: act + torch.relu(act @ d)[..., None] * v * 50)],
            "zero_head": [("blocks.1.attn.hook_z", zero_head)],
        }


class Replays:
    """Counts the runner's CUDA-graph replays (FULL) and piecewise-graph runs."""

    def __init__(self, runner):
        manager = runner.cudagraph_manager
        self.full = self.piecewise = 0
        full, piecewise = manager.run_fullgraph, manager.run_pw_graph

        def run_full(*a, **k):
            self.full += 1
            return full(*a, **k)

        def run_pw(*a, **k):
            self.piecewise += 1
            return piecewise(*a, **k)

        manager.run_fullgraph, manager.run_pw_graph = run_full, run_pw

    def take(self):
        counts = (self.full, self.piecewise)
        self.full = self.piecewise = 0
        return counts


@pytest.fixture(scope="module")
def engine():
    from vllm.compilation.counter import compilation_counter

    path = os.environ.get("XMIX_GPU_MODEL", ".gpumodel")
    d_model = json.load(open(os.path.join(path, "config.json")))["hidden_size"]
    hooks = Hooks(d_model)
    probe_kept = {}
    apps = hooks.apps()
    apps["probe"] = [("blocks.6.hook_resid_post", lambda act, hook: probe_kept.update(s=act @ hooks.w))]
    start = time.time()
    model = HookedServedModel.from_pretrained(path, dtype="bfloat16", load_format="dummy", max_model_len=512,
                                              gpu_memory_utilization=0.3,
                                              apps=[SimpleNamespace(name=n, fwd_hooks=h) for n, h in apps.items()])
    config = model.engine.llm.llm_engine.vllm_config.compilation_config
    record("engine", seconds=time.time() - start, cudagraph_mode=str(config.cudagraph_mode),
           compilation_mode=str(config.mode), captures=compilation_counter.num_gpu_runner_capture_triggers,
           resident_captured={f"{o.app}:{o.index}": o.captured for o in model.engine.runtime.control.ops})
    runner = model.engine.runtime.model_runner
    return model, hooks, Replays(runner), compilation_counter


def generate(model, row_apps):
    rows = [model.to_tokens(p)[0].tolist() for p in PROMPTS]
    trace = model.planner.trace_hooks(len(rows), max(map(len, rows)))
    plan = PassPlan(rows, [torch.arange(len(r)) for r in rows], trace, None, NEW, {"temperature": 0.0, "ignore_eos": True},
                    [tuple(apps) for apps in row_apps])
    (outcome,) = model.planner.run([plan])
    return [list(g) for g in outcome.tokens], outcome.results.app_results


def test_apps_run_inside_replayed_graphs_and_equal_per_call_hooks(engine):
    model, hooks, replays, counter = engine
    assert "NONE" not in RESULTS["engine"]["cudagraph_mode"]
    assert all(RESULTS["engine"]["resident_captured"].values())
    captures = counter.num_gpu_runner_capture_triggers
    replays.take()
    plain, _ = generate(model, [set()] * len(PROMPTS))
    eager_before = model.engine.runtime.eager_steps
    chosen = [{"steer", "gate", "zero_head", "probe"}, {"steer"}, {"probe"}]
    control = model.engine.runtime.control
    control.host_time = HostTime(check_launches=True)
    with_apps, reads = generate(model, chosen)
    launches, launched_busy = control.host_time.decode_launches, control.host_time.decode_launches_gpu_busy
    graph_replays = replays.take()
    eager_with_apps = model.engine.runtime.eager_steps - eager_before

    # the same hooks per call, host-planned (steps without graphs), one row at a time
    per_call, per_call_reads = [], []
    for row, names in enumerate(chosen):
        kept = {}
        fwd = [h for n in ("steer", "gate", "zero_head") if n in names for h in hooks.apps()[n]]
        if "probe" in names:
            fwd.append(("blocks.6.hook_resid_post", lambda act, hook, kept=kept: kept.update(s=act @ hooks.w)))
        tokens = model.generate(PROMPTS[row], max_new_tokens=NEW, do_sample=False, return_type="tokens",
                                fwd_hooks=fwd, stop_at_eos=False)
        per_call.append(tokens[0, len(model.to_tokens(PROMPTS[row])[0]):].tolist())
        per_call_reads.append(kept)
    eager_per_call = model.engine.runtime.eager_steps - eager_before - eager_with_apps

    probe_positions = {row: reads[row][next(iter(reads[row]))][0].tolist() for row in (0, 2)}
    prompt_lens = [len(model.to_tokens(p)[0]) for p in PROMPTS]
    record("graphs", captures_before=captures, captures_after=counter.num_gpu_runner_capture_triggers,
           full_replays_and_piecewise_runs_with_apps=graph_replays, eager_steps_with_apps=eager_with_apps,
           eager_steps_per_call=eager_per_call, tokens_plain=plain, tokens_with_apps=with_apps,
           tokens_per_call=per_call, probe_positions=probe_positions, prompt_lens=prompt_lens,
           decode_launches=launches, decode_launches_gpu_busy=launched_busy)
    assert eager_with_apps == 0 and graph_replays[0] > 0  # decode steps replayed FULL graphs
    assert eager_per_call > 0  # the per-call path did run without graphs
    assert with_apps == per_call
    assert with_apps[0] != plain[0] and with_apps[1] != plain[1]
    assert with_apps[2] == plain[2]  # a read changes nothing
    # each decode step but the last queued its reads home, and its launch was checked against the GPU
    assert launches >= NEW - 2 and 0 <= launched_busy <= launches
    for row in (0, 2):  # every prompt position and every generated one but the last
        assert probe_positions[row] == list(range(prompt_lens[row] + NEW - 1))
    assert counter.num_gpu_runner_capture_triggers == captures


def test_toggles_change_results_without_recapture(engine):
    model, hooks, replays, counter = engine
    captures = counter.num_gpu_runner_capture_triggers
    plain, _ = generate(model, [set()] * len(PROMPTS))
    steered, _ = generate(model, [{"steer"}] * len(PROMPTS))
    model.engine.runtime.set_default_apps({"steer"})  # requests that choose no app get it
    try:
        by_default, _ = generate(model, [set()] * len(PROMPTS))
    finally:
        model.engine.runtime.set_default_apps(())
    off, _ = generate(model, [set()] * len(PROMPTS))
    model.engine.runtime.set_app_params("steer", model.planner.lower_app("steer", hooks.apps(v=-hooks.v)["steer"]).ops)
    reversed_, _ = generate(model, [{"steer"}] * len(PROMPTS))
    per_call = [model.generate(p, max_new_tokens=NEW, do_sample=False, return_type="tokens", stop_at_eos=False,
                               fwd_hooks=hooks.apps(v=-hooks.v)["steer"])[0, len(model.to_tokens(p)[0]):].tolist()
                for p in PROMPTS]
    replays.take()
    record("toggles", captures_before=captures, captures_after=counter.num_gpu_runner_capture_triggers,
           plain=plain, steered=steered, default_app=by_default, default_cleared=off, new_params=reversed_,
           new_params_per_call=per_call)
    assert by_default == steered and off == plain and steered != plain
    assert reversed_ == per_call and reversed_ != steered
    assert counter.num_gpu_runner_capture_triggers == captures


def _decode_outside_graphs(model, replays, run):
    """(result, steps run without graphs, FULL replays) of run()."""
    eager = model.engine.runtime.eager_steps
    replays.take()
    result = run()
    return result, model.engine.runtime.eager_steps - eager, replays.take()[0]


def test_late_apps_and_per_token_hooks_replay_graphs_captured_for_them(engine):
    """An app installed after the start, and generate's per-token hooks (a template write, a
    generated-kernel write: resident_calls.py), run their decode steps in graphs captured for them
    on first use (adapter.LateAppGraphs), with the tokens of the host-planned path."""
    from xmix_lens import App

    model, hooks, replays, counter = engine
    d, v = hooks.d, hooks.v * 2
    calls = model.planner.resident_calls
    fwd = {"template": [("blocks.3.hook_resid_post", lambda act, hook: act * 0.5 + v)],
           "generated": [("blocks.4.hook_resid_mid",
                          lambda act, hook: act + torch.relu(act @ d)[..., None] * v * 50)]}
    gen = dict(max_new_tokens=NEW, do_sample=False, return_type="tokens", stop_at_eos=False)
    rows = {}
    for name, hooks_ in fwd.items():
        def call():
            return model.generate(PROMPTS, fwd_hooks=hooks_, **gen)

        started = time.perf_counter()
        first, eager_first, full_first = _decode_outside_graphs(model, replays, call)
        seconds_first = time.perf_counter() - started  # with the capture of its graphs
        started = time.perf_counter()
        again, eager_again, full_again = _decode_outside_graphs(model, replays, call)
        seconds_resident = time.perf_counter() - started
        calls.enabled = False
        try:
            started = time.perf_counter()
            host, eager_host, _ = _decode_outside_graphs(model, replays, call)
            seconds_host = time.perf_counter() - started
        finally:
            calls.enabled = True
        rows[name] = dict(eager_steps_first_call=eager_first, full_replays_first_call=full_first,
                          eager_steps_again=eager_again, full_replays_again=full_again,
                          eager_steps_host_planned=eager_host, seconds_first_call=seconds_first,
                          seconds_resident=seconds_resident,
                          seconds_host_planned=seconds_host, tokens_equal_host_planned=torch.equal(again, host),
                          tokens_equal_first=torch.equal(again, first))
        record("late_graphs", **rows)
    late = App("late", [("blocks.2.hook_resid_mid", lambda act, hook: act + v)])
    model.install(late)
    try:
        with_late, eager_late, full_late = _decode_outside_graphs(
            model, replays, lambda: model.generate(PROMPTS, apps=[["late"]] * len(PROMPTS), **gen).result)
        calls.enabled = False
        try:
            host = model.generate(PROMPTS, fwd_hooks=late.fwd_hooks, **gen)
        finally:
            calls.enabled = True
    finally:
        model.uninstall("late")
    rows["installed_late"] = dict(eager_steps=eager_late, full_replays=full_late,
                                  tokens_equal_host_planned=torch.equal(with_late, host))
    late_graphs = model.engine.runtime.late_graphs
    record("late_graphs", **rows, captures_by_vllm=counter.num_gpu_runner_capture_triggers,
           capture_failed=late_graphs.failed)
    assert late_graphs.failed is None
    for row in rows.values():
        assert row.get("eager_steps_again", row.get("eager_steps")) <= 1  # the prompts' prefill step only
        assert row.get("full_replays_again", row.get("full_replays")) >= NEW - 1
        assert row["tokens_equal_host_planned"]
    assert rows["template"]["eager_steps_host_planned"] >= NEW
