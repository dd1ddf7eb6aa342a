"""GPU only (vllm 0.26.0): the seven shipped apps (xmix_lens.apps) built into one engine run inside
its CUDA graphs: prompt-level stores (cast, harm), reads of the last position (truth), the SAE,
ITI and directional ablation at every layer.

Not collected by CI (pyproject ignores tests/gpu). Run there as:
    XMIX_GPU_MODEL=.gpumodel XMIX_GPU_OUT=$OUT python3 -m pytest -q tests/gpu/test_shipped_apps_gpu.py -o addopts=""
Checked: generating with all seven chosen runs no step outside the graphs and gives the tokens and
the per-request reads of the same hook functions run per call (host-planned, without graphs).
"""
import json
import os
from types import SimpleNamespace

import pytest
import torch

import xmix_lens  # noqa: F401  (its from_pretrained sets vLLM's environment for the in-process engine)
from gpu_results import Results
from tests.test_shipped_apps import PROMPTS, SHIPPED, hooks_of, shipped_apps
from xmix_lens import HookedServedModel

pytestmark = pytest.mark.gpu

NEW = 12
RESULTS = Results("shipped_apps_gpu.json")


@pytest.fixture(scope="module")
def engine():
    path = os.environ.get("XMIX_GPU_MODEL", ".gpumodel")
    hf = json.load(open(os.path.join(path, "config.json")))
    cfg = SimpleNamespace(n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                          d_head=hf["hidden_size"] // hf["num_attention_heads"])
    built = shipped_apps(cfg)
    model = HookedServedModel.from_pretrained(path, dtype="bfloat16", load_format="dummy", max_model_len=512,
                                              gpu_memory_utilization=0.3, apps=built)
    yield model, built
    model.shutdown()


def test_the_seven_apps_run_inside_the_graphs_as_their_hooks_per_call(engine):
    model, built = engine
    assert set(model.engine.installed) == set(SHIPPED)
    control = model.engine.runtime.control
    captured = {f"{o.app}:{type(o.op).__name__}": o.captured for o in control.ops}
    eager_before = model.engine.runtime.eager_steps
    resident = model.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, padding_side="left", stop_at_eos=False,
                              apps=list(SHIPPED), return_type="tokens")
    eager_resident = model.engine.runtime.eager_steps - eager_before
    per_call = model.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, padding_side="left", stop_at_eos=False,
                              fwd_hooks=hooks_of(built), return_type="tokens")
    plain = model.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, padding_side="left", stop_at_eos=False,
                           return_type="tokens")
    stores = {f"{app.name}.{output}": (resident.outputs[app.name][output].tolist(), value.tolist())
              for app in built if app.name in ("cast", "harm") for output, value in app.outputs.items()}
    RESULTS.record("shipped_apps", captured=captured, eager_steps_resident=eager_resident,
                   tokens_resident=resident.result.tolist(), tokens_per_call=per_call.tolist(),
                   tokens_plain=plain.tolist(), store_reads_resident_and_per_call=stores)
    assert all(captured.values())  # every op's launch is in the captured graphs
    assert eager_resident == 0
    assert torch.equal(resident.result, per_call)
    assert not torch.equal(resident.result, plain)
    for resident_value, per_call_value in stores.values():
        torch.testing.assert_close(torch.tensor(resident_value), torch.tensor(per_call_value), atol=2e-2, rtol=2e-2)
