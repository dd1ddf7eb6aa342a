"""The serving benchmark's harness, run once at toy size on the CPU (the GPU figures come from the
same harness on the lent H200: bench/results/, docs/benchmarks.md).

Speed is not asserted here (CPU timings of a toy say nothing); what the numbers stand on is: every
mode ran, the idle modes serve what native vLLM serves, and the steering mode steers exactly as the
eager torch-hook approach does."""
import gc
import json
import statistics

import pytest

from bench import serving
from tests.tiny_models import tiny_llama


@pytest.fixture(autouse=True)
def engines_shut_down(monkeypatch):
    """Shuts the harness's engines down after the test: main() leaves them running, and a running
    in-process vLLM engine (KV cache included) is never garbage-collected."""
    from xmix_lens import HookedServedModel
    from xmix_lens.backend.vllm import adapter

    built, build = [], serving.build_engines

    def recording(*args, **kwargs):
        result = build(*args, **kwargs)
        built.extend(result[0].values())
        return result

    monkeypatch.setattr(serving, "build_engines", recording)
    yield
    for engine in built:
        if isinstance(engine, HookedServedModel):
            engine.shutdown()
        else:  # a native vLLM LLM
            adapter.shutdown_workers(engine)


def test_harness_runs_every_mode_and_the_modes_do_what_they_claim(tmp_path):
    out = tmp_path / "toy.json"
    serving.main(["--model", str(tiny_llama()), "--toy", "--eager-engines", "--repeats", "2",
                  "--max-model-len", "128", "--dtype", "float32", "--profile", "--kv-blocks", "64", "--out", str(out)])
    assert gc.get_freeze_count() == 0  # each run froze the heap; the bench unfroze it (its engines collectable)
    result = json.loads(out.read_text())
    assert result["steer_std"] == 0.05  # a real model's (not --dummy)
    decode = result["workloads"]["decode"]
    assert set(decode["summary"]) == set(serving.MODES)
    for mode, row in decode["summary"].items():
        assert len(decode["runs"][mode]) == 2
        for metric in ("mean_itl_ms", "p99_itl_ms", "mean_ttft_ms", "throughput_tok_s", "decode_itl_ms",
                       "decode_p99_itl_ms"):
            assert row[metric]["median"] > 0 and row[metric]["min"] <= row[metric]["median"] <= row[metric]["max"]
        assert row["mean_itl_ms"]["ratio_to_native"] == row["mean_itl_ms"]["median"] / \
            decode["summary"]["native"]["mean_itl_ms"]["median"]
        twin = decode["summary"]["native_twin"]["mean_itl_ms"]["median"]
        assert (mode in ("native", "native_twin")) != ("against_twin" in row["mean_itl_ms"])
        if "against_twin" in row["mean_itl_ms"]:  # each xmix-lens mode against the second native engine too
            assert row["mean_itl_ms"]["against_twin"]["ratio"] == row["mean_itl_ms"]["median"] / twin
    same = decode["tokens_equal_native"]
    assert all(same["installed_idle"]) and all(same["armed_idle"])  # idle apps and sites change nothing
    assert all(same["native_twin"])  # a second native engine: the same tokens (it differs only in where it lies)
    assert not any(same["steer"]) and not any(same["seven"])  # active apps do change the output
    assert all(same["steer_vs_eager_hook"])  # the installed steering app equals a torch forward hook
    for mode in ("installed_idle", "steer", "seven"):  # the control plane's host time per step
        assert all(r["steps"] > 0 and r["host_ms_per_step"] > 0 for r in decode["runs"][mode]), mode
        assert decode["summary"][mode]["host_ms_per_step"]["median"] > 0
        # the thread's CPU time in the same calls: positive, and no more than their wall time
        assert all(0 < r["host_cpu_ms_per_step"] <= r["host_ms_per_step"] * 1.05 for r in decode["runs"][mode]), mode
        assert all(r["host_ms_per_decode_step"] > 0 for r in decode["runs"][mode]), mode  # decode steps seen
        assert all(r["host_ms_per_prefill_step"] > 0 for r in decode["runs"][mode]), mode  # and the prompts' steps
        assert all(r["host_ms_max_decode_step"] >= r["host_ms_per_decode_step"] >= r["host_ms_home_per_decode_step"]
                   for r in decode["runs"][mode]), mode
        assert (mode != "seven") or all(r["host_ms_home_per_decode_step"] > 0 for r in decode["runs"][mode])  # reads
        # after each launch, the read logs' moves beside the GPU (the production engine has read areas)
        assert all(r["host_ms_after_launch_per_step"] > 0 for r in decode["runs"][mode]), mode
        # when the host's slowest decode step ended: inside the run, on the clock of its slowest steps
        assert all(0 < r["host_max_decode_step_ended_ms"] <= 1e3 * r["wall_s"] for r in decode["runs"][mode]), mode
        # whether the GPU was busy at a step's launch: asked of the copies' events, which the CPU has not
        assert all(r["decode_launched_gpu_busy"] is None for r in decode["runs"][mode]), mode
    for mode in serving.MODES:  # each run's slowest decode steps, slowest first, inside the window
        for r in decode["runs"][mode]:
            ms = [gap for _, gap, _ in r["slowest_decode_steps"]]
            assert ms == sorted(ms, reverse=True) and all(0 <= i < r["decode_steps"] for i, _, _ in r["slowest_decode_steps"])
            assert all(0 < end <= 1e3 * r["wall_s"] for _, _, end in r["slowest_decode_steps"])
            assert len(r["gc_collections"]) == 3
            assert all(0 < at <= 1e3 * r["wall_s"] and gen in (0, 1, 2) and ms >= 1.0 for at, gen, ms in r["gc_pauses"])
    assert all(r["steps"] == 0 for r in decode["runs"]["armed_idle"])  # no resident op: nothing to prepare
    assert all(r["host_max_decode_step_ended_ms"] is None for r in decode["runs"]["armed_idle"])
    # the read log's new chunks: the two reading apps' area's first one as its first rows move home
    # (a landing slot's rows move when it comes round again: LANDING_SLOTS steps, more than the toy's
    # warm-up run has); the toy's reads then fit it, and no mode without a read makes any
    assert [r["read_chunks_made"] for r in decode["runs"]["seven"]] in ([0, 0], [1, 0])
    assert all(r["read_chunks_made"] == 0 for r in decode["runs"]["installed_idle"])
    assert "host_ms_per_step" not in decode["summary"]["native"]
    # --kv-blocks: one pool size for every engine
    capacity = set(result["kv_capacity_tokens"].values())
    assert len(result["kv_capacity_tokens"]) == 5 and len(capacity) == 1 and capacity.pop() % 64 == 0
    # before any run, the native engines and the idle production engine in turn, the latter's control
    # plane inside its steps
    fresh = result["fresh_decode_steps"]
    assert [p["mode"] for p in fresh] == ["native", "native_twin", "installed_idle"] * 2
    assert all(p["per_step_of"] == serving.PROFILED_STEPS and p["host"]["step_wall_us"] > 0 for p in fresh)
    assert all(("prepare_step_us" in p["host"]) == (p["mode"] == "installed_idle") for p in fresh)
    # the production engine's decode steps with no app chosen, profiled as the seven apps' are
    idle = decode["decode_step_idle"]
    assert idle["per_step_of"] == serving.PROFILED_STEPS and 0 < idle["host"]["prepare_step_us"] < idle["host"]["step_wall_us"]
    # the profiled decode steps: the control plane's time is inside the step's, and only with apps
    for step in serving.PROFILED_STEP_KINDS:
        native, seven = decode[f"{step}_step_native"]["host"], decode[f"{step}_step_kernels"]["host"]
        assert "prepare_step_us" not in native and native["step_wall_us"] > 0
        assert 0 < seven["prepare_step_us"] < seven["step_wall_us"]
    # the mixed step: the batch's second half prefilled while its first half decodes
    assert decode["mixed_step_kernels"]["decoding"] == decode["requests"] // 2
    assert decode["mixed_step_kernels"]["per_step_of"] == 1
    # the prefill step: one step over the whole prompts; the decode steps after short prompts
    assert decode["prefill_step_kernels"]["per_step_of"] == 1
    assert decode["prefill_step_kernels"]["prompt_len"] == decode["prompt_len"]
    assert decode["decode_step_kernels"]["prompt_len"] == serving.PROFILED_PROMPT_LEN
    # every op of the seven apps timed at the decode batch, against the bytes it must move
    floors = result["kernel_floors"]["ops"]
    assert sorted({row["app"] for row in floors}) == sorted(result["apps"])
    # the writes at residual sites timed with their renorm, as the engine runs them; no other op
    renormed = {row["app"] for row in floors if row["op"].endswith(" + renorm")}
    assert renormed == {"steer", "ablate_direction", "conditional_steer"}
    for row in floors:
        assert row["tokens"] == decode["requests"] and row["us"] > 0
        assert row["bytes"] >= row["tokens"] * row["features"] * 4  # x's rows at least, fp32 here
    assert result["command"].startswith("python -m bench.serving")
    # whether a workload fits each engine's KV cache (else preemption makes the timings vary)
    assert set(result["kv_capacity_tokens"]) == {"native", "native_twin", "production", "research", "eager"}
    assert all(tokens > 0 for tokens in result["kv_capacity_tokens"].values())
    assert set(result["async_scheduling"]) == set(result["kv_capacity_tokens"])  # each engine's, as vLLM set it
    assert all(isinstance(on, bool) for on in result["async_scheduling"].values())
    assert decode["kv_tokens_needed"] == decode["requests"] * (decode["prompt_len"] + decode["output_len"])
    for mode, row in decode["summary"].items():  # each repeat against native's of the same repeat
        runs = zip(decode["runs"][mode], decode["runs"]["native"])
        ratios = [r["mean_itl_ms"] / n["mean_itl_ms"] for r, n in runs]
        assert row["mean_itl_ms"]["paired_ratio"] == pytest.approx(sum(ratios) / 2)  # the median of two


def test_latencies_count_the_decode_window_from_the_last_first_token():
    """The decode window's ITL leaves out the gaps that start before every request has its first
    token (steps that may hold a prefill chunk); a step bringing n tokens counts n gaps of 1/n."""
    times = {"a": [(1.0, 1), (1.5, 1), (3.0, 1), (3.1, 1)],  # its 1.0 -> 1.5 gap ends before b's first token
             "b": [(2.5, 1), (3.0, 2)]}
    got = serving.latencies(times, start=0.5)
    assert got["mean_ttft_ms"] == pytest.approx(1e3 * (0.5 + 2.0) / 2)
    assert got["mean_itl_ms"] == pytest.approx(1e3 * (0.5 + 1.5 + 0.1 + 0.25 + 0.25) / 5)
    assert got["decode_itl_ms"] == pytest.approx(1e3 * (0.1 + 0.25 + 0.25) / 3)  # gaps from 3.0 and 2.5 on
    # the P99 is the gap of rank int(0.99 (n - 1)) in order: the 4th of 5, the 2nd of 3
    assert got["p99_itl_ms"] == pytest.approx(1e3 * 0.5)
    assert got["decode_p99_itl_ms"] == pytest.approx(1e3 * 0.25)
    # the window's steps: 2.5 -> 3.0 -> 3.1; the slowest first, by index in the window
    assert got["decode_steps"] == 2
    assert [i for i, _, _ in got["slowest_decode_steps"]] == [0, 1]
    assert [ms for _, ms, _ in got["slowest_decode_steps"]] == pytest.approx([500, 100])
    assert [end for _, _, end in got["slowest_decode_steps"]] == pytest.approx([2500, 2600])  # ms after start
    late = serving.latencies({"a": [(1.0, 1), (2.0, 1)], "b": [(2.0, 1)]}, start=0.0)  # b's first token is its last
    assert late["mean_itl_ms"] == pytest.approx(1e3) and late["decode_itl_ms"] != late["decode_itl_ms"]  # NaN


def test_the_collector_records_each_collection_and_its_pause(monkeypatch):
    import time

    monkeypatch.setattr(serving.GCPauses, "MIN_MS", 0.0)
    start = time.perf_counter()
    with serving.GCPauses(start) as collector:
        gc.collect()  # the oldest generation
        gc.collect(0)
    after = 1e3 * (time.perf_counter() - start)
    assert collector.collections[2] >= 1 and collector.collections[0] >= 1
    assert [gen for _, gen, _ in collector.pauses][-2:] == [2, 0]
    assert all(0 < at <= after and 0 <= ms <= at for at, _, ms in collector.pauses)
    gc.collect()  # outside the context: not observed
    assert collector.collections[2] == sum(gen == 2 for _, gen, _ in collector.pauses)


def test_freezing_the_heap_counts_what_a_collection_would_walk_and_leaves_it_out():
    kept = [[i] for i in range(20000)]  # as earlier runs' results are kept
    try:
        tracked = serving.freeze_heap()
        assert tracked >= len(kept)
        assert len(gc.get_objects()) < len(kept) / 10  # frozen: no collection walks them
    finally:
        gc.unfreeze()


def test_the_profile_counts_every_kernel_of_xmix_lens():
    """The decode-step profile's share of xmix-lens's kernels names every Triton kernel in kernels/
    (it once missed three of them); its GPU idle time is the gaps between kernels, overlaps merged."""
    import ast
    from pathlib import Path

    from bench.serving import XMIX_KERNELS, idle_time

    kernels = Path(__file__).parents[1] / "kernels"
    jitted = set()
    for path in kernels.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d).split("(")[0] in ("triton.jit", "jit") for d in node.decorator_list):
                jitted.add(node.name)
    # device functions called from kernels (normalized_row) launch nothing of their own
    jitted = {name for name in jitted if name.endswith("_kernel")}
    assert '"def program_kernel(",' in (kernels / "program_source.py").read_text()  # generated source's kernel
    assert jitted and set(XMIX_KERNELS) == jitted | {"program_kernel"}
    assert idle_time([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (2.5, 2.7)]) == 2.0  # 3..5 only
    assert idle_time([]) == 0.0


def test_evaluation_harness_runs_every_mode_and_eval_serves_what_native_does(tmp_path):
    """bench/evaluation.py at toy size: rows/s of each mode, eval without apps generating exactly
    native vLLM's tokens, and the steering app changing them."""
    from bench import evaluation

    out = tmp_path / "eval.json"
    evaluation.main(["--model", str(tiny_llama()), "--toy", "--eager-engines", "--repeats", "2", "--dtype", "float32",
                     "--max-model-len", "128", "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["summary"]) == set(evaluation.MODES)
    for mode, runs in result["runs"].items():
        assert len(runs) == 2 and all(r["rows_per_s"] > 0 for r in runs)
    assert result["eval_none_tokens_equal_native"] == [True, True]
    assert result["eval_steer_tokens_differ"] == [True, True]
    assert result["command"].startswith("python -m bench.evaluation")


def test_research_harness_runs_each_task_on_both_and_they_agree(tmp_path):
    """bench/research.py at toy size (fp32 on the CPU): each task timed on xmix-lens and on
    TransformerLens over the same weights and prompts, and their answers agree."""
    from bench import research

    out = tmp_path / "research.json"
    research.main(["--model", str(tiny_llama()), "--toy", "--repeats", "1", "--tl-batch", "4", "--profile",
                   "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["tasks"]) == {"cache", "steer", "generate", "generate_many"}
    for name, task in result["tasks"].items():
        assert task["speedup_vs_tl"] > 0 and len(task["seconds"]["xmix_lens"]) == 1, name
        assert task["native_vllm_over_xmix"] > 0 and len(task["seconds"]["vllm_native"]) == 1, name
        assert task["host_profile"]["own"] and any("engine.py" in row["function"]
                                                   for row in task["host_profile"]["cumulative"])
        assert task["host_profile_native"]["own"]  # vLLM without hooks, profiled beside it
        by_package = task["host_profile"]["own_by_package"]
        assert by_package["vllm"] > 0 and sum(by_package.values()) <= task["host_profile"]["wall_s"] * 1.05, name
    cache, steer, generate = (result["tasks"][n]["answer"] for n in ("cache", "steer", "generate"))
    assert cache["xmix_lens"] == pytest.approx(cache["transformer_lens"], rel=1e-4)
    assert steer["xmix_lens"] == pytest.approx(steer["transformer_lens"], rel=1e-4)
    assert set(generate["transformer_lens"]) == {generate["xmix_lens"]}  # prompt + new tokens, every batch
    many = result["tasks"]["generate_many"]["answer"]
    assert set(many["transformer_lens"]) == {many["xmix_lens"]} and len(many["transformer_lens"]) == 2



def test_the_research_baseline_computes_every_prompt_token_as_a_hooked_call_does(served):
    """vLLM without hooks is timed on the prompts the hooked call just ran, again at every repeat:
    unsalted, it would take all but their last block from the prefix cache, a fraction of the work."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from bench import research

    model = served["tiny-llama"]
    tokens = torch.randint(100, 200, (3, 200), generator=torch.Generator().manual_seed(5))
    assert [research.native_vllm(model, tokens, 1)["cached"] for _ in range(2)] == [0, 0]
    # the loss task's baseline computes the loss a call without hooks returns
    native = research.native_vllm(model, tokens, 1, loss=True)
    assert native["loss"] == pytest.approx(float(model(tokens, return_type="loss")), rel=1e-5)
    # the same prompts unsalted: the second time they come from the cache the first filled
    prompts = [TokensPrompt(prompt_token_ids=row.tolist()) for row in tokens]
    for _ in range(2):
        outs = model.engine.llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in outs)

@pytest.mark.parametrize("busy", [[], ["--busy-thread"], ["--evict-caches", "4"]],
                         ids=["alone", "busy_thread", "evict_caches"])
def test_host_step_harness_times_prepare_step_with_requests_coming_and_going(busy):
    """bench/host_step.py at toy size: a time per step for each request count (wall and CPU, also
    with a thread of Python work beside the steps, and with the caches written over between steps),
    over batches of requests that finish (their reads taken) and are replaced, each batch's prompts
    prepared first in prefill steps (timed apart)."""
    import threading

    from bench import host_step

    result = host_step.main(["--model", str(tiny_llama()), "--requests", "4,8", "--steps", "30",
                             "--request-steps", "7", "--prompt-len", "6", "--prefill-tokens", "12", "--dummy", *busy])
    for field in ("host_ms_per_step", "host_cpu_ms_per_step", "host_ms_per_prefill_step", "take_ms_per_request"):
        assert set(result[field]) == {"4", "8"} and all(v > 0 for v in result[field].values()), field
    assert all(result["host_cpu_ms_per_step"][n] <= result["host_ms_per_step"][n] * 1.05 for n in ("4", "8"))
    busy_threads = [t for t in threading.enumerate() if t.name == host_step.BUSY_THREAD]
    for thread in busy_threads:
        thread.join(timeout=5)
    assert not any(t.is_alive() for t in busy_threads)  # stopped with the run


def test_chunk_alloc_harness_times_steps_with_chunks_made_inline_and_ahead():
    """bench/chunk_alloc.py at toy size: each condition's step times, and the chunks it made (every
    --every steps, none in the baseline)."""
    from bench import chunk_alloc

    result = chunk_alloc.main(["--toy"])
    rows = result["conditions"]
    assert set(rows) == {"none", "inline", "helper"}
    assert rows["none"]["chunks"] == 0 and rows["inline"]["chunks"] == rows["helper"]["chunks"] == 10
    assert all(0 < row["median_ms"] <= row["p99_ms"] <= row["max_ms"] for row in rows.values())
    assert rows["inline"]["inline_allocation_ms"]["median"] > 0 and "inline_allocation_ms" not in rows["helper"]


def test_served_harness_times_every_mode_against_native_servers(tmp_path):
    """bench/served.py at toy size: `vllm bench serve` against a native server and `xmix-lens serve`
    with the seven bench apps exported, every mode in each round; ratios to native, and the seven
    apps' reads returned."""
    from bench import served

    out = tmp_path / "served.json"
    result = served.main(["--model", str(tiny_llama()), "--modes", "native", "none", "seven", "--concurrency", "2",
                          "--rounds", "2", "--prompts-per-client", "2", "--input-len", "16", "--output-len", "6",
                          "--max-model-len", "128", "--dtype", "float32", "--profile", "--out", str(out)])
    assert json.loads(out.read_text())["summary"] == json.loads(json.dumps(result["summary"], default=bool))
    runs = result["runs"][2]
    assert set(runs) == {"native", "none", "seven"}
    for mode, rounds in runs.items():
        assert len(rounds) == 2 and all(r["completed"] == 4 and r["mean_itl_ms"] > 0 for r in rounds)
    assert result["summary"][2]["rounds"] == 2
    ratio = result["summary"][2]["modes"]["seven"]["mean_itl_ms"]["ratio"]
    assert ratio == statistics.median(r["mean_itl_ms"] for r in runs["seven"]) / statistics.median(
        r["mean_itl_ms"] for r in runs["native"])
    assert set(result["seven_reads"]) == {"probe_read", "sae_features"}  # the two reading apps
    assert all(r["positions"] == [15] for outs in result["seven_reads"].values() for r in outs.values())
    assert set(result["compiled_while_serving"]["end"]) == {"native", "xmix"}  # each server's JIT monitor, read
    for r in runs["seven"]:  # each of the 4 responses waited for its reads once; fetched by one RPC or more
        assert r["server"]["xmix_read_wait_seconds_count"] == 4 and r["server"]["xmix_read_fetches_total"] >= 1
        assert 0 < r["server"]["xmix_read_fetch_engine_seconds_total"] < r["duration"]
    assert all("xmix_read_fetches_total" not in r["server"] for r in runs["native"])  # no plugin there
    # --profile: each server's API server and engine core sampled in its own modes' untimed runs
    assert set(result["profiled_runs"][2]) == {"native", "none", "seven"}
    sampled = {(p["label"], p["process"] == "MainProcess") for p in result["profile"] if p["samples"]}
    assert sampled >= {("2/native", True), ("2/native", False), ("2/seven", True), ("2/seven", False)}
    seven_engine = [p for p in result["profile"] if p["label"] == "2/seven" and p["process"] != "MainProcess"]
    assert any(f.startswith("xmix:backend/") for p in seven_engine for f in p["xmix_inclusive"])  # its sites ran
    assert result["command"].startswith("python -m bench.served")


def test_host_memory_harness_compares_a_research_engine_with_vllms_own(tmp_path):
    """bench/host_memory.py on the tiny Llama (eager engines, fp32): each engine in a process of its
    own, what a researcher touches on the model's device, and the research engine within 2 GiB of
    vLLM's own on the host (issue #48's bound: no float32 host copy of the model)."""
    from bench import host_memory

    out = tmp_path / "memory.json"
    host_memory.main(["--model", str(tiny_llama()), "--dtype", "float32", "--eager", "--out", str(out)])
    result = json.loads(out.read_text())
    for who in ("native", "research"):
        assert 0 < result[who]["built"]["rss_gib"] <= result[who]["used"]["peak_gib"]
    touched = result["research"]["touched"]
    assert (touched["W_E"], touched["W_U"], touched["cache"]) == ("cpu",) * 3 and touched["tl_parameters"] > 0
    assert result["research_over_native_gib"] < 2.0


def test_startup_harness_times_each_start_in_a_process_of_its_own(tmp_path):
    """bench/startup.py on the tiny Llama (eager engines, fp32): a cold and a warm start of a research
    engine, each with its imports and vLLM's engine phases, which happened inside the process's wall
    time (the native kind's start is the same code with vllm.LLM in place of from_pretrained)."""
    from bench import startup

    out = tmp_path / "startup.json"
    startup.main(["--model", str(tiny_llama()), "--dtype", "float32", "--eager", "--warm", "1", "--kinds", "research",
                  "--out", str(out)])
    result = json.loads(out.read_text())
    assert "native" not in result
    for run in [result["research"]["cold"], *result["research"]["warm"]]:
        phases = run["phases_s"]
        assert {"LLM.__init__", "Worker.load_model", "in_python"} <= set(phases)
        assert 0 < phases["Worker.load_model"] < phases["LLM.__init__"] < phases["in_python"] < run["ready_s"]
        assert 0 < run["imports_s"] < run["ready_s"]
    assert len(result["research"]["warm"]) == 1
