"""Every shipped app (xmix_lens.apps) resident in the engine at once, exported in one config, and
served by `xmix-lens serve` as the README writes it: on deep models (30 and 80 layers: directional
ablation has 61 and 161 ops, one control row), and exported, installed and served on the tiny Llama
and GPT-2 and on SmolLM2.

The oracle of a resident app is the same app's hook functions run per call (run_with_hooks with
them as fwd_hooks: traced for the call's own shape, a path tests/test_apps.py checks against
TransformerLens); of a served app, the in-process engine with the same config installed."""
import sys

import pytest
import torch

from tests.test_serving_config import Server, free_port
from tests.tiny_models import tiny_gpt2, tiny_llama
from xmix_lens import HookedServedModel, apps
from xmix_lens.request_choice import APPS_KEY, READS_KEY

SHIPPED = ("actadd", "ablate", "truth", "cast", "harm", "iti", "sae")
PROMPTS = ["The cat sat on the mat and looked", "One two three four", "A quick brown fox jumps"]


def shipped_apps(cfg, seed: int = 0) -> list:
    """The seven apps of xmix_lens.apps on random directions of this model's sizes, spread over its layers."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    L, d, mid = cfg.n_layers, cfg.d_model, cfg.n_layers // 2
    sae = apps.SAE(r(d, 32) / d**0.5, torch.zeros(32), r(32, d), torch.zeros(d), f"blocks.{mid}.hook_resid_post")
    return [
        apps.activation_addition("actadd", {mid: r(d)}, coef=2.0),
        apps.directional_ablation("ablate", r(d), L),
        apps.linear_probe("truth", f"blocks.{L - 1}.hook_resid_post", r(d)),
        apps.conditional_steering("cast", "blocks.0.hook_resid_post", r(d), 0.0, {mid: r(d)}),
        apps.harmful_request_detector("harm", "blocks.0.hook_resid_post", r(d), 0.0, refusal_directions={L - 1: r(d)}),
        apps.inference_time_intervention("iti", {(0, 1): r(cfg.d_head), (mid, 0): r(cfg.d_head)}, cfg.n_heads),
        apps.sae_features("sae", sae, read=[1, 2], clamp={3: 4.0}),
    ]


def hooks_of(built: list) -> list:
    return [hook for app in built for hook in app.fwd_hooks]


def assert_resident_equals_per_call(model, built: list) -> None:
    """The apps selected in the engine equal their hook functions run per call, and their writes move
    the logits far beyond the difference between the two paths."""
    names = [app.name for app in built]
    resident = model.run_with_hooks(PROMPTS, apps=names, padding_side="left")
    per_call = model.run_with_hooks(PROMPTS, fwd_hooks=hooks_of(built), padding_side="left")
    plain = model(PROMPTS, padding_side="left")
    mask = model.to_tokens(PROMPTS, padding_side="left") != model.tokenizer.pad_token_id
    gap = float((resident.result - per_call).abs()[mask].max())
    assert gap < 1e-3 * float(per_call.abs().max()), gap
    assert float((resident.result - plain).abs()[mask].max()) > 100 * max(gap, 1e-6)
    compared = 0
    for app in built:  # every read, as the per-call run left it in app.outputs
        for output, theirs in app.outputs.items():
            ours = resident.outputs[app.name][output]
            assert ours.shape == theirs.shape, (app.name, output)
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
            compared += float(theirs.abs().max()) > 0.1
    assert compared >= 4  # reads that are not all zero


@pytest.fixture(scope="module", params=[30, 80], ids=lambda n: f"{n}-layers")
def deep(request):
    """An eager engine of a deep, narrow random Llama, with every shipped app installed."""
    model = HookedServedModel.from_pretrained(str(tiny_llama(n_layers=request.param, d_model=64, d_mlp=128,
                                                             n_heads=2, n_kv_heads=1)),
                                              enforce_eager=True, max_model_len=128)
    built = shipped_apps(model.cfg)
    for app in built:
        model.install(app)
    yield model, built
    model.shutdown()


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_app_is_resident_at_once_on_a_deep_model(deep, name):
    model, _ = deep
    assert name in model.engine.installed


def test_the_resident_shipped_apps_equal_their_hooks_per_call_on_a_deep_model(deep):
    model, built = deep
    assert len(built[1].fwd_hooks) == 2 * model.cfg.n_layers + 1  # the ablation's ops: one control row
    assert_resident_equals_per_call(model, built)


@pytest.mark.parametrize("names", [["cast"], ["harm"], list(SHIPPED)])
def test_resident_prompt_level_stores_gate_generated_tokens_as_per_call(deep, names):
    """cast and harm keep their prompt's mean in the engine, per request: the generated tokens read it."""
    model, built = deep
    chosen = [app for app in built if app.name in names]
    resident = model.generate(PROMPTS, max_new_tokens=6, do_sample=False, padding_side="left", apps=names,
                              return_type="tokens")
    per_call = model.generate(PROMPTS, max_new_tokens=6, do_sample=False, padding_side="left",
                              fwd_hooks=hooks_of(chosen), return_type="tokens")
    assert torch.equal(resident.result, per_call)
    for app in chosen:  # the stores' reads: the prompt's value, the same for the prompt and its tokens
        for output, theirs in app.outputs.items():
            if app.name in ("cast", "harm"):
                torch.testing.assert_close(resident.outputs[app.name][output], theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_shipped_apps_export_and_install_from_their_config(served, tmp_path, name):
    """Exported in one config and installed from it, the apps give what their hooks give per call."""
    model = served[name]
    built = shipped_apps(model.cfg)
    names = model.install_config(model.export(built, tmp_path / "apps"))
    try:
        assert names == [app.name for app in built] and set(names) <= set(model.engine.installed)
        assert_resident_equals_per_call(model, built)
    finally:
        for app in names:
            model.uninstall(app)


SERVED_MODELS = {"tiny-llama": lambda: str(tiny_llama()), "tiny-gpt2": lambda: str(tiny_gpt2()),
                 "smollm2": lambda: "smollm2-135m"}  # SmolLM2 by its embedded name, as the README serves it


@pytest.fixture(scope="module", params=list(SERVED_MODELS))
def app_server(request, served, tmp_path_factory):
    """`xmix-lens serve CONFIG -- MODEL` with the seven apps exported, no memory or dtype flag; and the
    in-process model with the same config installed; the name clients send."""
    model, name = served[request.param], SERVED_MODELS[request.param]()
    config = model.export(shipped_apps(model.cfg), tmp_path_factory.mktemp("shipped") / "apps")
    port = free_port()
    command = [sys.executable, "-m", "xmix_lens.cli", "serve", str(config), "--", name, "--enforce-eager",
               "--max-model-len", "256", "--port", str(port)]
    server = Server(command, tmp_path_factory.mktemp("server") / "server.log", port)
    names = model.install_config(config)
    try:
        assert server.wait_ready(), server.output()[-3000:]
        yield server, model, names, name
    finally:
        server.stop()
        for app in names:
            model.uninstall(app)


def test_serve_says_its_model_dtype_and_memory(app_server):
    server, _, names, name = app_server
    said = server.output().splitlines()[0]
    assert said.startswith(f"xmix-lens serve: model {name}")
    assert ("(folder " in said) == (name == "smollm2-135m")  # an embedded name's folder is said
    assert "dtype float32 (the apps were exported at it" in said and "KV cache 0." in said, said
    assert [m.id for m in server.client().models.list().data] == [name]
    assert f"xmix-lens: installing apps {names}" in server.output() and sorted(names) == sorted(SHIPPED)


@pytest.mark.parametrize("choice", [["actadd"], ["ablate"], ["iti"], ["sae"], list(SHIPPED)])
def test_served_shipped_apps_run_as_in_process(app_server, choice):
    server, model, _, name = app_server
    ids = model.to_tokens(PROMPTS[0], prepend_bos=False)[0].tolist()
    served = server.complete(name, ids, {APPS_KEY: ",".join(choice)})
    ours = model.generate(torch.tensor([ids]), max_new_tokens=len(served), do_sample=False, stop_at_eos=False,
                          apps=choice).result[0, len(ids):].tolist()
    assert served == ours
    # every choice here writes: its logits move (a random direction ablated may keep the greedy tokens)
    moved = model.run_with_hooks(torch.tensor([ids]), apps=choice).result - model(torch.tensor([ids]))
    assert float(moved.abs().max()) > 0.05


def test_served_and_in_process_reads_agree_to_the_dtypes_precision(app_server):
    server, model, _, name = app_server
    ids = model.to_tokens(PROMPTS[1], prepend_bos=False)[0].tolist()
    out = server.client().completions.create(
        model=name, prompt=ids, max_tokens=4, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, "vllm_xargs": {APPS_KEY: "sae", READS_KEY: "all"}})
    read = out.model_extra["xmix_reads"][0]["apps"]["sae"]["features"]
    sequence = ids + out.choices[0].token_ids
    ours = model.run_with_hooks(torch.tensor([sequence]), apps=["sae"]).outputs["sae"]["features"][0]
    assert read["positions"][: len(ids)] == list(range(len(ids)))
    theirs = torch.tensor(read["values"])
    assert theirs.dtype == torch.float32 and theirs.abs().max() > 0.1
    torch.testing.assert_close(theirs, ours[read["positions"]], rtol=1e-4, atol=1e-4)  # float32 on both sides


@pytest.mark.parametrize("app,outputs", [("truth", ["last"]), ("cast", ["similarity", "gate"]),
                                         ("harm", ["score", "flag"])])
def test_a_served_read_of_the_last_position_is_the_prompts_end(app_server, app, outputs):
    """Reads of act[:, -1] (truth's `last`; cast's and harm's reads of their prompt-level stores) come
    back by default at the prompt's last position, equal to the in-process call's."""
    server, model, _, name = app_server
    ids = model.to_tokens(PROMPTS[2], prepend_bos=False)[0].tolist()
    out = server.client().completions.create(model=name, prompt=ids, max_tokens=2, temperature=0,
                                             extra_body={"vllm_xargs": {APPS_KEY: app}})
    ours = model.run_with_hooks(torch.tensor([ids]), apps=[app]).outputs[app]
    for output in outputs:
        read = out.model_extra["xmix_reads"][0]["apps"][app][output]
        assert read["positions"] == [len(ids) - 1]
        torch.testing.assert_close(torch.tensor(read["values"]), ours[output], rtol=1e-4, atol=1e-4)
