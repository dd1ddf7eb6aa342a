"""App configs (xmix_lens/app_config.py): export -> load -> install gives the original apps' results
bit for bit, and every kind of bad config is refused before an engine starts, naming the app, the
field and the fix."""
import contextlib
import json
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import tiny_gpt2, tiny_llama
from xmix_lens import App, HookedServedModel, app_config
from xmix_lens.backend.engine import ServedRequest

PROMPTS = ["Hello World! How are you", "Hi"]


def make_apps(d_model: int) -> list[App]:
    """A steering write, a per-token probe read, and a generated (nonlinear) gate; the steer's
    `coef` and the gate's `gain` are request params (a served request may set them)."""
    g = torch.Generator().manual_seed(0)
    v, d = torch.randn(d_model, generator=g), torch.randn(d_model, generator=g)
    d = d / d.norm()
    probe = App("probe")

    def score(act, hook):
        probe.outputs["score"] = act @ d

    probe.fwd_hooks = [("blocks.1.hook_resid_post", score)]
    steer = {"v": v, "coef": torch.tensor(1.0)}
    gate = {"gain": torch.tensor(1.0)}
    return [App("steer", fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act + steer["v"] * steer["coef"])],
                params=steer, request_params={"coef": (-4.0, 4.0)}),
            probe,
            App("gate", fwd_hooks=[("blocks.1.hook_resid_pre",
                                    lambda act, hook: act + torch.relu(act @ d)[..., None] * (v * gate["gain"]))],
                params=gate, request_params={"gain": (0.0, 8.0)})]


@contextlib.contextmanager
def installed(model, apps: list[App]):
    """The model with the apps installed, for a block (uninstalled after it)."""
    for app in apps:
        model.install(app)
    try:
        yield model
    finally:
        for app in apps:
            model.uninstall(app.name)


@pytest.fixture(scope="module")
def exported(served, tmp_path_factory):
    """The apps installed in the session's tiny Llama, their results there, and their config."""
    model = served["tiny-llama"]
    apps = make_apps(model.cfg.d_model)
    with installed(model, apps):
        names = [app.name for app in apps]
        results = (model.run_with_hooks(PROMPTS, apps=names),
                   model.generate(PROMPTS, max_new_tokens=5, do_sample=False, apps=["steer", "gate"]))
        folder = model.export(names, tmp_path_factory.mktemp("config") / "apps")
    return results, folder


@pytest.fixture(scope="module")
def from_config(exported):
    """A compiled engine serving the exported config (every hook point armed, as by default)."""
    _, folder = exported
    model = HookedServedModel.from_pretrained(str(tiny_llama()), max_model_len=256, config=str(folder))
    yield model
    model.shutdown()


def test_export_load_install_is_bit_identical(exported, from_config):
    (forward, generated), _ = exported
    model = from_config
    assert set(model.app_registry.resident) == {"steer", "probe", "gate"}
    out = model.run_with_hooks(PROMPTS, apps=["steer", "probe", "gate"])
    assert torch.equal(out.result, forward.result)
    assert torch.equal(out.outputs["probe"]["score"], forward.outputs["probe"]["score"])
    assert model.generate(PROMPTS, max_new_tokens=5, do_sample=False, apps=["steer", "gate"]).result \
        == generated.result
    assert not torch.equal(model(PROMPTS), forward.result)  # the apps did something


def sites_run(model, call) -> set[str]:
    """The hook points whose sites ran in the steps of `call()`."""
    runtime, ran = model.engine.runtime, []
    run_site = runtime.run_site
    runtime.run_site = lambda x, site_id, renorm=None: (ran.append(site_id), run_site(x, site_id, renorm))[-1]
    try:
        call()
    finally:
        del runtime.run_site
    return {runtime.site_names[i] for i in ran}


def serve_one(model) -> list[int]:
    """A request as a server sends it (no app chosen): its greedy tokens."""
    request = ServedRequest("one", model.to_tokens(PROMPTS[0])[0].tolist(), {"max_tokens": 4, "temperature": 0.0})
    (result,) = model.engine.serve([request], in_flight=1)
    return result.tokens


def test_the_compiled_model_holds_only_the_sites_of_apps_built_in(served, from_config):
    """An armed hook point with no app's op when the engine is built is left out of the compiled
    model (what serves requests, and what CUDA graphs capture): a served step runs the built-in
    apps' sites only, none in a research engine. A call that reads logits (the final norm's
    output, no app's site) runs vLLM's model uncompiled, with the sites of its own ops only (not
    every armed one, nor the built-in apps' that no request selects), so that calls hooked
    elsewhere, or not at all, compute alike in both engines."""
    research = served["tiny-llama"]
    apps_points = {"blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "blocks.1.hook_resid_pre"}
    assert sites_run(from_config, lambda: serve_one(from_config)) == apps_points
    assert sites_run(research, lambda: serve_one(research)) == set()
    assert serve_one(from_config) == serve_one(research)  # no app chosen: the same model

    def halve(act, hook):
        return act * 0.5

    out = {}
    for name, model in (("config", from_config), ("research", research)):
        out[name] = {}
        for call, hooks in (("plain", []), ("hooked", [("blocks.0.hook_mlp_out", halve)])):
            ran = sites_run(model, lambda: out[name].setdefault(call, model.run_with_hooks(PROMPTS, fwd_hooks=hooks)))
            assert ran == {"unembed.hook_in"} | {point for point, _ in hooks}, (name, call)
    assert torch.equal(out["config"]["plain"], out["research"]["plain"])
    assert torch.equal(out["config"]["hooked"], out["research"]["hooked"])
    assert not torch.equal(out["research"]["hooked"], out["research"]["plain"])  # the hook did something


def test_reads_leave_the_logits_as_they_are_in_bf16():
    """A call that only reads (run_with_cache) gives model()'s logits bit for bit in bf16, where an
    unfused residual add + norm rounds the sum differently: the norms its reads sit at stay vLLM's
    own (sites.py). A write at the same point does change them."""
    model = HookedServedModel.from_pretrained(str(tiny_llama()), dtype="bfloat16", max_model_len=128)
    try:
        tokens = model.to_tokens(PROMPTS)
        points = ["blocks.0.hook_resid_post", "blocks.1.ln2.hook_scale", "blocks.1.ln1.hook_normalized"]
        logits, cache = model.run_with_cache(tokens, names_filter=points)
        assert torch.equal(logits, model(tokens))
        assert all(cache[p].dtype == torch.bfloat16 for p in points)
        steered = model.run_with_hooks(tokens, fwd_hooks=[(points[0], lambda act, hook: act + 0.5)])
        assert not torch.equal(steered, logits)
    finally:
        model.shutdown()


def test_uncompiled_steps_run_vllms_platform_kernels(served):
    """vLLM's custom ops that the compiled model fused from their torch-native forwards run their
    platform kernels in uncompiled steps (a call's hooks), as an enforce_eager engine runs them, and
    in those steps only: between steps each keeps the forward the compiled graph traced, so that an
    engine built later in the process, which vLLM hands the same rotary embedding while this one is
    up (get_rope caches them), traces it as native vLLM does. The hooked call computes what it computed with the native
    forwards."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    model = served["tiny-llama"]
    vllm_model = model.engine.runtime.model_runner.model
    ops = [m for m in vllm_model.modules() if isinstance(m, CustomOp) and type(m).forward_cpu is not CustomOp.forward_cpu]
    rotary = next(m for m in ops if isinstance(m, RotaryEmbeddingBase))
    assert not any(m._forward_method == m.forward_cpu for m in ops)  # between steps: what the graph traced
    traced = [m._forward_method for m in ops]
    hooks = [("blocks.0.hook_mlp_out", lambda act, hook: act * 0.5)]
    ran = []

    def counted(m):
        kernel = m.forward_cpu

        def count_and_run(*args, **kwargs):
            ran.append(type(m).__name__)
            return kernel(*args, **kwargs)
        return count_and_run

    try:
        for m in ops:  # the platform kernel an uncompiled step switches to, looked up on the instance
            m.forward_cpu = counted(m)
        platform = model.run_with_hooks(PROMPTS, fwd_hooks=hooks)
        assert {type(rotary).__name__, "SiluAndMul"} <= set(ran)  # (a kernel may call its submodules' own)
        assert [m._forward_method for m in ops] == traced
        for m in ops:
            m.forward_cpu = m.forward_native
        native = model.run_with_hooks(PROMPTS, fwd_hooks=hooks)
    finally:
        for m in ops:
            m.__dict__.pop("forward_cpu", None)
    torch.testing.assert_close(platform, native, rtol=1e-4, atol=1e-4)


def test_the_folder_holds_json_and_safetensors_only(exported):
    _, folder = exported
    assert sorted(p.name for p in folder.iterdir()) == ["gate.safetensors", "manifest.json", "probe.safetensors",
                                                      "steer.safetensors"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["schema_version"] == app_config.SCHEMA_VERSION
    assert [a["name"] for a in manifest["apps"]] == ["steer", "probe", "gate"]


def test_export_refuses_an_app_that_cannot_be_resident(served, tmp_path):
    model = served["tiny-llama"]
    def double_last(act, hook):
        act[:, -1] *= 2.0
        return act

    last_token = App("last", fwd_hooks=[("blocks.0.hook_resid_post", double_last)])
    with pytest.raises(ValueError, match="selects positions"):
        model.export([last_token], tmp_path / "x")


def test_request_params_are_exported_with_their_slopes(exported):
    """A request param's effect on the ops, as a slope: the op at the param's value p is the
    exported op + (p - default) * slope, which the app lowered at p gives (here: bias = coef * v)."""
    _, folder = exported
    (steer, steer_ops), _, (gate, gate_ops) = app_config.read(folder, tiny_llama())
    assert [(p.name, p.default, p.minimum, p.maximum) for p in steer.params] == [("coef", 1.0, -4.0, 4.0)]
    assert [p.name for p in gate.params] == ["gain"]
    (write,) = steer_ops["blocks.0.hook_resid_post"]
    torch.testing.assert_close(write.slopes["coef"]["bias"], write.bias)  # bias = coef * v, default coef 1
    (program,) = gate_ops["blocks.1.hook_resid_pre"]
    assert set(program.slopes) == {"gain"} and all(f.startswith("consts[") for f in program.slopes["gain"])


def test_export_refuses_a_request_param_that_is_not_an_added_term(served, tmp_path):
    model = served["tiny-llama"]
    params = {"s": torch.tensor(1.0)}
    scaled = App("scaled", fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act * params["s"])],
                 params=params, request_params={"s": (0.0, 2.0)})
    with pytest.raises(ValueError, match=r"request param 's' changes scale .*not an added term"):
        model.export([scaled], tmp_path / "x")
    with pytest.raises(ValueError, match="outside its bounds"):
        App("bad", params={"s": torch.tensor(3.0)}, request_params={"s": (0.0, 2.0)})


# --- bad configs: refused by app_config.read, before any engine starts ---------------------------
@pytest.fixture
def copy(exported, tmp_path):
    _, folder = exported
    target = tmp_path / "apps"
    target.mkdir()
    for p in folder.iterdir():
        (target / p.name).write_bytes(p.read_bytes())
    return target


def edit_manifest(folder, change):
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_config_for_another_model(copy):
    with pytest.raises(app_config.ConfigError, match=r"another model: model.architecture .*export them again"):
        app_config.read(copy, tiny_gpt2())


def test_unknown_op_kind(copy):
    edit_manifest(copy, lambda m: m["apps"][0]["ops"]["blocks.0.hook_resid_post"][0].update(kind="exec"))
    with pytest.raises(app_config.ConfigError, match=r"apps\[0\]\.ops\.blocks\.0\.hook_resid_post\[0\]"):
        app_config.read(copy, tiny_llama())


def test_unknown_program_op(copy):
    def change(m):
        program = m["apps"][2]["ops"]["blocks.1.hook_resid_pre"][0]["program"]
        program["ops"][0]["op"] = "system"
    edit_manifest(copy, change)
    with pytest.raises(app_config.ConfigError, match=r"apps\[2\]\.ops.*program\.ops\[0\]\.op"):
        app_config.read(copy, tiny_llama())


def test_wrong_shape(copy):
    tensors = load_file(copy / "steer.safetensors")
    name = next(k for k in tensors if k.endswith(".bias"))
    tensors[name] = torch.zeros(7)
    save_file(tensors, copy / "steer.safetensors")
    with pytest.raises(app_config.ConfigError, match=rf"app 'steer': .*bias \({name}\) has shape \[7\]"):
        app_config.read(copy, tiny_llama())


def test_missing_tensor(copy):
    tensors = load_file(copy / "steer.safetensors")
    name = next(k for k in tensors if k.endswith(".V"))
    del tensors[name]
    save_file(tensors, copy / "steer.safetensors")
    with pytest.raises(app_config.ConfigError, match=rf"app 'steer': .*names tensor '{name}', which is not in"):
        app_config.read(copy, tiny_llama())


def test_missing_tensor_file(copy):
    (copy / "probe.safetensors").unlink()
    with pytest.raises(app_config.ConfigError, match="app 'probe': probe.safetensors is missing"):
        app_config.read(copy, tiny_llama())


def test_pickle_file_in_the_folder(copy):
    (copy / "extra.pkl").write_bytes(pickle.dumps({"x": 1}))
    with pytest.raises(app_config.ConfigError, match="extra.pkl is not part of the config.*no pickles"):
        app_config.read(copy, tiny_llama())


def test_slopes_of_an_undeclared_param(copy):
    edit_manifest(copy, lambda m: m["apps"][0].update(params=[]))
    with pytest.raises(app_config.ConfigError, match=r"app 'steer': .*slopes names 'coef', which params does not"):
        app_config.read(copy, tiny_llama())


def test_unknown_hook_point(copy):
    edit_manifest(copy, lambda m: m["apps"][0]["ops"].update({"blocks.9.hook_resid_post": []}))
    with pytest.raises(app_config.ConfigError, match=r"app 'steer': ops.blocks.9.hook_resid_post: not a hook point"):
        app_config.read(copy, tiny_llama())


def test_engine_refuses_a_bad_config_before_starting(copy):
    (copy / "extra.pkl").write_bytes(b"")
    with pytest.raises(app_config.ConfigError, match="extra.pkl"):
        HookedServedModel.from_pretrained(str(tiny_llama()), max_model_len=256, config=str(copy))
