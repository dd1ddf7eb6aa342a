"""GPU only (vllm 0.26.0): each family beyond Llama and GPT-2 at a real model's shape, dummy bf16 weights,
in a compiled engine with CUDA graphs and two apps built in (a steering write and a probe read).

Not collected by CI (pyproject ignores tests/gpu). Run there one process per family (an engine gives
its GPU memory back only when its process exits), after `. .gpu/bin/env.sh`:
    bash scripts/gpu_families.sh qwen3-8b gemma-2-9b ...
which runs, per family, XMIX_GPU_FAMILIES=<name> python3 -m pytest -q tests/gpu/test_families_gpu.py -o addopts="".
Each config folder is written by scripts/gpu_models.py's family_folder, with XMIX_GPU_MODEL's tokenizer files.
Checked per family: the engine starts compiled with CUDA graphs; generate with both apps chosen runs
no step outside the graphs (their launches captured); the probe reads the steer at the prompt's end; a hooked run_with_cache gives finite activations of TransformerLens's shapes. The
tokens of the same hooks run per call (uncompiled, without graphs) are recorded beside the
resident ones, not asserted: dummy weights give near ties that bf16 rounding decides.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

import xmix_lens  # noqa: F401  (its from_pretrained sets vLLM's environment for the in-process engine)
from gpu_results import Results
from xmix_lens import HookedServedModel, apps

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from gpu_models import FAMILY_SHAPES, family_folder  # noqa: E402  (the folders the GPU bench loads too)

pytestmark = pytest.mark.gpu

CHOSEN = [name for name in os.environ.get("XMIX_GPU_FAMILIES", ",".join(FAMILY_SHAPES)).split(",") if name]
PROMPTS = ["The capital of France is", "Steering vectors move the residual stream of a model"]
NEW = 12
RESULTS = Results("families_gpu.json")


def moe(name: str) -> bool:
    return "num_experts" in FAMILY_SHAPES[name][2]


@pytest.fixture(scope="module", params=CHOSEN)
def engine(request, tmp_path_factory):
    import time

    folder = str(family_folder(request.param, tmp_path_factory.mktemp("families"),
                               Path(os.environ.get("XMIX_GPU_MODEL", ".gpumodel8b"))))
    shape = FAMILY_SHAPES[request.param][2]
    d, L = shape["hidden_size"], shape["num_hidden_layers"]
    direction = torch.randn(d, generator=torch.Generator().manual_seed(0))
    built = [apps.activation_addition("steer", {L // 2: 4.0 * direction / direction.norm()}),
             apps.linear_probe("probe", f"blocks.{L - 1}.hook_resid_post", direction / direction.norm())]
    start = time.perf_counter()
    model = HookedServedModel.from_pretrained(folder, dtype="bfloat16", load_format="dummy", max_model_len=512,
                                              gpu_memory_utilization=0.9, apps=built)  # the MoE: 61 GB
    seconds = time.perf_counter() - start
    yield request.param, model, built, seconds
    model.shutdown()


def test_the_family_serves_its_apps_inside_cuda_graphs(engine):
    name, model, built, seconds = engine
    vllm_config = model.engine.llm.llm_engine.vllm_config
    graphs = str(vllm_config.compilation_config.cudagraph_mode)
    captured = {f"{o.app}:{type(o.op).__name__}": o.captured for o in model.engine.runtime.control.ops}
    eager_before = model.engine.runtime.eager_steps
    resident = model.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, padding_side="left", stop_at_eos=False,
                              apps=["steer", "probe"], return_type="tokens")
    eager_resident = model.engine.runtime.eager_steps - eager_before
    plain = model.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, padding_side="left", stop_at_eos=False,
                           return_type="tokens")
    per_call = model.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, padding_side="left", stop_at_eos=False,
                              fwd_hooks=[hook for app in built for hook in app.fwd_hooks], return_type="tokens")
    # the probe reads the residual along the steering direction: the steer (4 along it, layers earlier)
    # shows there whatever the dummy weights add after it
    probe = model.run_with_hooks(PROMPTS, apps=["probe"], padding_side="left").outputs["probe"]["last"]
    steered = model.run_with_hooks(PROMPTS, apps=["steer", "probe"], padding_side="left").outputs["probe"]["last"]
    shift = (steered.float() - probe.float()).tolist()
    RESULTS.record(name, family=model.cfg.family, start_seconds=round(seconds, 1), cudagraph_mode=graphs,
                   enforce_eager=vllm_config.model_config.enforce_eager, captured=captured,
                   eager_steps_resident=eager_resident, probe_shift_by_steer=shift, probe_last=probe.tolist(),
                   tokens_resident=resident.result.tolist(), tokens_plain=plain.tolist(),
                   tokens_per_call=per_call.tolist(),
                   resident_equals_per_call=bool(torch.equal(resident.result, per_call)))
    assert not vllm_config.model_config.enforce_eager and "NONE" not in graphs
    assert captured and all(captured.values()) and eager_resident == 0
    assert all(abs(x - 4.0) < 1.0 for x in shift), shift


def test_a_hooked_cache_has_transformer_lens_shapes(engine):
    name, model, _, _ = engine
    cfg = model.cfg
    mlp = "blocks.1.mlp.hook_in" if moe(name) else "blocks.1.mlp.hook_post"  # a mixture has no single hidden layer
    names = ["blocks.0.hook_resid_pre", "blocks.0.attn.hook_q", "blocks.0.attn.hook_pattern", mlp,
             "ln_final.hook_normalized"]
    logits, cache = model.run_with_cache(PROMPTS[:1], names_filter=names)
    P = model.to_tokens(PROMPTS[:1]).shape[1]
    shapes = {n: list(cache[n].shape) for n in names}
    RESULTS.record(f"{name}_cache", shapes=shapes, device=str(logits.device), dtype=str(logits.dtype),
                   finite=all(bool(torch.isfinite(cache[n]).all()) for n in names))
    assert shapes["blocks.0.attn.hook_q"] == [1, P, cfg.n_heads, cfg.d_head]
    assert shapes["blocks.0.attn.hook_pattern"] == [1, cfg.n_heads, P, P]
    assert shapes[mlp] == [1, P, cfg.d_model if moe(name) else cfg.d_mlp]
    assert logits.device.type == "cuda" and all(torch.isfinite(cache[n]).all() for n in names)
