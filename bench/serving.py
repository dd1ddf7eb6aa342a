"""Serving overhead against native vLLM: ITL, TTFT and throughput as ratios, modes alternated.

    python -m bench.serving --model PATH --dummy --workloads decode --repeats 3 --out results.json
    python -m bench.serving --model PATH --toy --eager-engines        # CPU: a small run CI makes

Engines (all in-process, as the facade runs vLLM; one of each, built once):
  native       vLLM's LLM, CUDA graphs on
  native_twin  a second native LLM, built after the others (native_twin): two engines of one
               build ran vLLM's own kernels up to 2% apart, consistently within one pair
               (FlashAttention a step 9-11 us slower in the later one, the cause not pinned down:
               bench/results/2026-12-03-gpu-bench-native-twin-decode.json);
               its ratio to native is that floor under "within noise", which the repeats on one
               pair of engines do not show
  production   xmix-lens with seven apps installed as it is built (their sites armed, nothing else);
               its modes choose what every request runs: installed_idle (none), steer (one
               steering write), seven (all seven: writes, a conditional write, reads delivered)
  research     xmix-lens with every hook point armed, nothing active (armed_idle)
  eager        vLLM with enforce_eager and a torch forward hook adding the steering vector
               (the approach of the peers that force eager mode) (eager_hook)
Each repeat draws fresh random prompt ids, the same for every mode, and runs the modes in turn
(A B C ... A B C ...), after one warm-up run of each. Per run: mean and P99 inter-token latency,
mean time to first token, total token throughput (prompt + output tokens / wall time), and on the
xmix-lens engines the control plane's host time per step (`host_ms_per_step`,
ControlPlane.prepare_step; its CPU time, and the wall time per decode step alone; and the time after
each launch, the read logs' moves beside the GPU, `host_ms_after_launch_per_step`: `HOST_FIELDS`),
when its slowest decode step's preparation ended (`host_max_decode_step_ended_ms`, on the clock of
`slowest_decode_steps`: whether it is one of the run's slowest steps), the share of decode steps
whose forward was queued while the GPU was still busy with the step before
(`decode_launched_gpu_busy`: their host time hidden; on a GPU, with reads) and the new host chunks
its read logs made (`read_chunks_made`);
and the mean and P99 ITL of the decode window (`decode_itl_ms`, `decode_p99_itl_ms`: gaps that start
once every request has its first token, so that no step holds a prefill chunk, whose interleaving
makes the whole run's ITL vary); the collector's pauses and what it tracked before the run, whose
heap is frozen first as vLLM's own serving benchmark freezes it (`freeze_heap`). Per engine: the tokens its KV cache holds and whether vLLM
schedules asynchronously (prepares a step while the GPU runs the one before, hiding host work).
With --profile, decode steps, the prefill step (what TTFT is made of) and a mixed step (a prefill
among decodes: where P99 ITL falls) of each workload are
profiled on native vLLM and with the seven apps active (decode steps also on the production
engine with no app chosen: what installed-idle costs): every CUDA kernel's time and launches,
xmix-lens's own and the step's total, and on the host the step's wall time and the CUDA runtime
calls (those inside prepare_step apart); each installed op's kernel at each workload's decode
batch against its floor (bench/kernels.py); and, before any run, decode steps of native (and
native_twin) and of the idle production engine in turn, twice (`fresh_decode_steps`: vLLM's own
kernels on engines whose KV pools have no history; `--kv-blocks` makes the pools one size).
"""
import argparse
import gc
import os
import platform
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from bench import write_result
from bench.kernels import renormalized_sites, resident_kernel_times
from xmix_lens import App
from xmix_lens.backend.control import HostTime
from xmix_lens.model import in_process_environment

# every engine here in-process, the native baseline too, as from_pretrained sets it for its own
in_process_environment()

WORKLOADS = {"decode": (32, 128, 256), "gpu": (256, 128, 128), "throughput": (512, 256, 128)}
TOY_WORKLOADS = {"decode": (3, 12, 6)}
HOST_FIELDS = tuple(HostTime().ms_per_step())  # the control plane's host time per step, as measured
MODES = ["native", "native_twin", "installed_idle", "armed_idle", "steer", "seven", "eager_hook"]


def seven_apps(cfg, steer_std: float = 0.05) -> tuple[list[App], torch.Tensor]:
    """Seven apps over the model's layers: five writes (one conditional), two reads (into
    `app.outputs`, so that they can be exported and served); and the steering vector of the first
    (the eager engine's forward hook adds the same), of `steer_std` per feature. A mixture of experts
    has no single MLP hidden layer (no `mlp.hook_post`): its MLP scale is on the block's output."""
    g = torch.Generator().manual_seed(0)
    L, d = cfg.n_layers, cfg.d_model
    v = torch.randn(d, generator=g) * steer_std
    u = torch.randn(d, generator=g)
    u /= u.norm()
    probe = torch.randn(d, 2, generator=g)
    encoder, bias = torch.randn(d, 64, generator=g) / d**0.5, torch.zeros(64)

    def at(fraction):  # a layer a fraction of the way through the model
        return min(L - 1, int(fraction * L))

    def ablate_head(act, hook):
        act[:, :, 0] = 0.0

    mlp_point = "hook_mlp_out" if getattr(cfg, "num_experts", None) else "mlp.hook_post"

    probe_read, sae_features = App("probe_read"), App("sae_features")
    probe_read.fwd_hooks = [(f"blocks.{at(0.9)}.hook_resid_post",
                             lambda act, hook: probe_read.outputs.__setitem__("score", act @ probe))]
    sae_features.fwd_hooks = [(f"blocks.{at(0.5)}.hook_resid_post",
                               lambda act, hook: sae_features.outputs.__setitem__("features",
                                                                                  torch.relu(act @ encoder + bias)))]
    writes = {
        "steer": [(f"blocks.{at(0.5)}.hook_resid_post", lambda act, hook: act + v)],
        "ablate_direction": [(f"blocks.{at(0.6)}.hook_resid_pre", lambda act, hook: act - (act @ u)[..., None] * u)],
        "conditional_steer": [(f"blocks.{at(0.25)}.hook_resid_post",
                               lambda act, hook: act + torch.relu(act @ u)[..., None] * v)],
        "head_ablation": [(f"blocks.{at(0.3)}.attn.hook_z", ablate_head)],
        "mlp_scale": [(f"blocks.{at(0.5)}.{mlp_point}", lambda act, hook: act * 1.05)],
    }
    return [App(n, fwd_hooks=h) for n, h in writes.items()] + [probe_read, sae_features], v


def served_apps(model) -> list[App]:
    """The seven apps for `xmix-lens export --apps bench.serving:served_apps` (the served benchmark)."""
    return seven_apps(model.cfg)[0]


def engine_kwargs(args) -> dict:
    # no prefix caching: a mode would reuse the KV of the mode before it (same prompts, same engine)
    kwargs = {"max_model_len": args.max_model_len, "gpu_memory_utilization": args.gpu_memory_utilization,
              "enable_prefix_caching": False}
    if args.dummy:
        kwargs["load_format"] = "dummy"
    if args.kv_blocks:  # KV pools of one size (by default each engine's is what its free memory holds)
        kwargs["num_gpu_blocks_override"] = args.kv_blocks
    if args.eager_engines:
        kwargs["enforce_eager"] = True
    if args.tensor_parallel_size > 1:  # vLLM's worker processes, one per GPU, for every engine
        kwargs.update(tensor_parallel_size=args.tensor_parallel_size, distributed_executor_backend="mp")
    return kwargs


def build_engines(args, modes):
    """The engines the modes run on (native always: the baseline)."""
    from vllm import LLM

    from xmix_lens import HookedServedModel
    from xmix_lens.backend.vllm.adapter import keep_workspace

    common = engine_kwargs(args)
    built, seconds = {}, {}

    def timed(name, make):
        keep_workspace()  # the engine built before keeps its scratch memory (adapter.keep_workspace)
        start = time.time()
        built[name] = make()
        seconds[name] = time.time() - start

    timed("native", lambda: LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, **common))
    cfg = _cfg(args)
    apps, steering_vector = seven_apps(cfg, args.steer_std)
    armed = sorted({name for app in apps for name, _ in app.fwd_hooks})
    if {"installed_idle", "steer", "seven"} & set(modes):
        timed("production", lambda: HookedServedModel.from_pretrained(args.model, dtype=args.dtype, armed=armed,
                                                                       apps=apps, **common))
    if "armed_idle" in modes:
        timed("research", lambda: HookedServedModel.from_pretrained(args.model, dtype=args.dtype, **common))
    if "native_twin" in modes:
        timed("native_twin", lambda: LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, **common))
    if "eager_hook" in modes:
        timed("eager", lambda: LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True,
                                   **{**common, "enforce_eager": True}))
        _add_eager_steering_hook(built["eager"], int(apps[0].fwd_hooks[0][0].split(".")[1]), steering_vector)
    return built, [a.name for a in apps], seconds


def vllm_config(engine):
    from xmix_lens import HookedServedModel

    llm = engine.engine.llm if isinstance(engine, HookedServedModel) else engine
    return llm.llm_engine.vllm_config


def kv_capacity_tokens(engine) -> int:
    """How many tokens an engine's KV cache holds (a workload that needs more preempts requests,
    and their recomputation makes its timings vary from run to run)."""
    cache = vllm_config(engine).cache_config
    return cache.num_gpu_blocks * cache.block_size


def _cfg(args):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(args.model)
    return SimpleNamespace(n_layers=hf.num_hidden_layers, d_model=hf.hidden_size,
                           num_experts=getattr(hf, "num_experts", None))


def _add_eager_steering_hook(llm, layer: int, v: torch.Tensor) -> None:
    """A torch forward hook on a decoder layer of vLLM's model, adding v to its output."""
    from xmix_lens.backend.vllm.adapter import in_process_runner

    model = in_process_runner(llm).model
    params = next(model.parameters())
    v = v.to(params.device, params.dtype)

    def add(module, inputs, output):
        hidden, residual = output  # vLLM's Llama layer: the residual stream is hidden + residual
        return hidden + v, residual

    model.model.layers[layer].register_forward_hook(add)


class GCPauses:
    """The garbage collector's collections during a run (`gc.callbacks`), as [when it ended (ms after
    `start`), generation, ms] for those of at least MIN_MS: a collection stops the engine's steps
    in this process, so one in a step's gap shows in the slowest steps (`latencies`)."""

    MIN_MS = 1.0

    def __init__(self, start: float):
        self.start, self.began, self.pauses, self.collections = start, 0.0, [], [0, 0, 0]

    def __enter__(self):
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._observe)

    def _observe(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self.began = now
            return
        self.collections[info["generation"]] += 1
        if 1e3 * (now - self.began) >= self.MIN_MS:
            self.pauses.append([1e3 * (now - self.start), info["generation"], 1e3 * (now - self.began)])

    def fields(self) -> dict:
        return {"gc_collections": self.collections, "gc_pauses": self.pauses}


def freeze_heap() -> int:
    """The objects the collector tracks outside the frozen heap (what a collection of the oldest
    generation walks: the earlier runs' results, what the engines made since they froze theirs),
    then all of it frozen, as vLLM's own serving benchmark does before it runs (`freeze_gc_heap`,
    vllm/benchmarks/serve.py): a run's collections then walk what that run makes, in every mode
    alike. On the H200 120-1,400 objects were outside the frozen heap before a run
    (`gc_tracked_before_run` in bench/results/2026-12-03-gpu-bench-read-areas.json): the
    collections' pauses in a run (5-24 ms of the oldest generation at 256 and 512 requests,
    native's too) walk what the run itself makes, not what the bench kept."""
    from vllm.utils.gc_utils import freeze_gc_heap

    tracked = len(gc.get_objects())
    freeze_gc_heap()
    return tracked


def run_once(llm, prompts, out_len) -> dict:
    """Submit every request at once and step the engine; time each request's tokens (and the
    garbage collector's pauses: GCPauses), the heap frozen first (`freeze_heap`)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0, detokenize=False)
    tracked = freeze_heap()
    start = time.perf_counter()
    seen, times, tokens = {}, {}, {}
    with GCPauses(start) as collector:
        for i, p in enumerate(prompts):
            engine.add_request(f"bench-{time.monotonic_ns()}-{i}", TokensPrompt(prompt_token_ids=p), params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                n = len(out.outputs[0].token_ids)
                if n > seen.get(out.request_id, 0):
                    times.setdefault(out.request_id, []).append((now, n - seen.get(out.request_id, 0)))
                    seen[out.request_id] = n
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    total = sum(len(p) for p in prompts) + sum(seen.values())
    return {**latencies(times, start), **collector.fields(), "gc_tracked_before_run": tracked,
            "throughput_tok_s": total / wall, "wall_s": wall, "started": start,
            "tokens": [tokens[k] for k in sorted(tokens)]}


SLOWEST_STEPS = 6  # the decode window's slowest steps, recorded per run: P99 ITL is about its 3rd at 32 requests


def latencies(times: dict, start: float) -> dict:
    """Mean and P99 ITL, mean TTFT, and the decode window's mean and P99 ITL (gaps that start once
    every request has its first token: no step of it holds a prefill chunk) from each request's
    [(time, new tokens)], in ms; and the decode window's slowest steps, as [its index in the window
    (0: the step after the last first token), ms, when it ended (ms after `start`)] (every request
    of a step shares its gap: at 32 requests and 256 tokens P99 ITL is the window's 3rd slowest
    step, at 256 requests and 128 tokens its 2nd: a handful of steps a run)."""
    ttft = [t[0][0] - start for t in times.values()]
    last_first_token = max(t[0][0] for t in times.values())
    gaps, decode_gaps = [], []
    for t in times.values():
        for (a, _), (b, n) in zip(t, t[1:]):
            gaps += [(b - a) / n] * n
            if a >= last_first_token:
                decode_gaps += [(b - a) / n] * n
    # the decode window's steps (the times any request got tokens): where its tail falls
    steps = sorted({at for t in times.values() for at, _ in t if at >= last_first_token})
    step_gaps = [(i, b - a, b) for i, (a, b) in enumerate(zip(steps, steps[1:]))]
    slowest = sorted(step_gaps, key=lambda gap: -gap[1])[:SLOWEST_STEPS]
    # none in the decode window where the last request's first token is its last: NaN, not a run cut short
    return {"mean_itl_ms": 1e3 * statistics.fmean(gaps), "p99_itl_ms": 1e3 * p99(gaps),
            "decode_itl_ms": 1e3 * statistics.fmean(decode_gaps) if decode_gaps else float("nan"),
            "decode_p99_itl_ms": 1e3 * p99(decode_gaps) if decode_gaps else float("nan"),
            "mean_ttft_ms": 1e3 * statistics.fmean(ttft),
            "slowest_decode_steps": [[i, 1e3 * gap, 1e3 * (end - start)] for i, gap, end in slowest],
            "decode_steps": len(step_gaps)}


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))]


def control_plane(engines, mode):
    """The control plane of the xmix-lens engine a mode runs on (None: vLLM's own)."""
    name = {"installed_idle": "production", "steer": "production", "seven": "production",
            "armed_idle": "research"}.get(mode)
    return engines[name].engine.runtime.control if name else None


def timed_run(engines, app_names, mode, prompts, out_len) -> dict:
    """One run of a mode, with its engine's control-plane host time per step (wall and CPU; and
    the wall time of decode steps alone)."""
    control = control_plane(engines, mode)
    if control is not None:
        control.host_time = HostTime(check_launches=True)
        chunks_before = read_chunks_made(control)
    run = run_once(set_mode(engines, app_names, mode), prompts, out_len)
    started = run.pop("started")
    if control is not None:
        run.update(control.host_time.ms_per_step())
        # on slowest_decode_steps' clock: whether the host's slowest step is one of the run's slowest
        host = control.host_time
        run["host_max_decode_step_ended_ms"] = 1e3 * (host.decode_max_at - started) if host.decode_steps else None
        run["steps"] = control.host_time.steps
        run["read_chunks_made"] = read_chunks_made(control) - chunks_before
    return run


def read_chunks_made(control) -> int:
    """The host chunks the engine's read logs have made (the logs' only allocations)."""
    return control.read_chunks_made


def set_mode(engines, app_names, mode):
    """The engine a mode runs on, with the production engine's active apps chosen for it."""
    if mode in ("native", "native_twin"):
        return engines[mode]
    if mode == "armed_idle":
        return engines["research"].engine.llm
    if mode == "eager_hook":
        return engines["eager"]
    production = engines["production"]
    production.engine.runtime.set_default_apps({"installed_idle": (), "steer": ("steer",), "seven": app_names}[mode])
    return production.engine.llm


def reset(engines, app_names) -> None:
    """After a workload: no app active, the reads of requests nobody collects dropped."""
    if "production" in engines:
        set_mode(engines, app_names, "installed_idle")
        engines["production"].engine.runtime.clear_results()


def against(values: list[float], base: list[float]) -> dict:
    """A mode's repeats against a baseline's: the ratio of their medians; the median of each repeat
    against the baseline's of the same repeat (modes alternate: a drift of the machine between
    repeats cancels); the noise, the relative spread (max - min) / median of either's repeats."""
    ratio = statistics.median(values) / statistics.median(base)
    noise = max((max(v) - min(v)) / statistics.median(v) for v in (values, base))
    return {"ratio": ratio, "paired_ratio": statistics.median(v / b for v, b in zip(values, base)),
            "noise": noise, "within_noise": abs(ratio - 1) <= noise}


def summarise(runs: dict) -> dict:
    """Per mode and metric, its repeats against native's; with a native twin, also against the
    twin's (`against_twin`: a second native engine, the distance two engines of one build keep)."""
    metrics = ["mean_itl_ms", "p99_itl_ms", "mean_ttft_ms", "throughput_tok_s", "decode_itl_ms", "decode_p99_itl_ms"]
    summary = {}
    for mode, repeats in runs.items():
        row = {}
        for m in metrics:
            values = [r[m] for r in repeats]
            vs_native = against(values, [r[m] for r in runs["native"]])
            row[m] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                      "ratio_to_native": vs_native["ratio"], "paired_ratio": vs_native["paired_ratio"],
                      "noise": vs_native["noise"], "within_noise": vs_native["within_noise"]}
            if "native_twin" in runs and mode not in ("native", "native_twin"):
                row[m]["against_twin"] = against(values, [r[m] for r in runs["native_twin"]])
        for field in HOST_FIELDS:
            host = [r[field] for r in repeats if r.get(field) is not None]
            if host:
                row[field] = {"median": statistics.median(host), "max": max(host)}
        summary[mode] = row
    return summary


PROFILED_PROMPT_LEN, PROFILED_STEPS = 16, 4  # the decode steps profiled: after prompts this short
# every Triton kernel in kernels/ (tests/test_bench.py checks the list against them)
XMIX_KERNELS = ("affine_write_kernel", "affine_write_row_kernel", "gather_rows_kernel", "next_token_nll_kernel",
                "program_kernel", "project_read_kernel", "project_read_row_kernel", "rms_norm_rows_kernel")


def idle_time(intervals: list[tuple[float, float]]) -> float:
    """The time between the first start and the last end that no interval covers."""
    idle, reached = 0.0, None
    for start, end in sorted(intervals):
        if reached is not None and start > reached:
            idle += start - reached
        reached = end if reached is None else max(reached, end)
    return idle


PROFILED_STEP_KINDS = ("decode", "prefill", "mixed")


def step_profile(llm, prompts, control=None, kind="decode") -> dict:
    """Profiled steps of a kind: "decode" steps (graph-replayed on a GPU; prompts cut to
    PROFILED_PROMPT_LEN, so that the whole batch prefills in the first step); the "prefill" step, the
    first of the whole prompts (their prefill, or its first chunk); the "mixed" step, the first of
    the whole prompts of the batch's second half while its first half decodes (a prefill chunk among
    decodes: the steps where the whole run's P99 ITL falls). Per CUDA kernel name, launches and device
    time (the step's total and xmix-lens's share); on the host, the step's wall time and the CUDA
    runtime calls by name (a long cudaMemcpyAsync or a synchronize is the host waiting for the GPU),
    also those made inside the control plane's `prepare_step` (`control`: the engine's); and the
    GPU's idle time a step (`gpu_idle_us`: no kernel or copy running), which host work that vLLM's
    scheduling does not overlap with the GPU adds to."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0, detokenize=False)
    whole = max(len(p) for p in prompts)
    decoding = {"decode": prompts, "prefill": [], "mixed": prompts[: len(prompts) // 2]}[kind]
    for i, p in enumerate(decoding):  # short prompts: prefilled in one step, then decoding
        engine.add_request(f"profile-{i}", TokensPrompt(prompt_token_ids=p[:PROFILED_PROMPT_LEN]), params)
    for _ in range(3 if decoding else 0):  # the prefill, and the first decode steps
        engine.step()
    for i, p in enumerate(prompts[len(decoding):], start=len(decoding)):  # whole prompts, prefilled next
        engine.add_request(f"profile-{i}", TokensPrompt(prompt_token_ids=p), params)
    steps = PROFILED_STEPS if kind == "decode" else 1
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.synchronize()
    prepare = control.prepare_step if control is not None else None
    if control is not None:  # labelled for the profile only (the instance attribute is removed after)
        def labelled(*args, **kwargs):
            with record_function("xmix.prepare_step"):
                return prepare(*args, **kwargs)
        control.prepare_step = labelled
    try:
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * gpu) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            if gpu:
                torch.cuda.synchronize()
            wall = time.perf_counter() - started
    finally:
        if control is not None:
            del control.prepare_step
    while engine.has_unfinished_requests():
        engine.step()
    events = prof.events()
    kernels, calls, in_prepare = {}, {}, {}
    windows = [(e.time_range.start, e.time_range.end) for e in events if e.name == "xmix.prepare_step"]
    for e in events:
        if e.device_type.name == "CUDA" and e.name != "xmix.prepare_step":  # the label's GPU range: no kernel
            k = kernels.setdefault(e.name, {"launches": 0, "us": 0.0})
            k["launches"] += 1 / steps
            k["us"] += e.device_time / steps
        elif e.name.startswith("cuda"):  # a CUDA runtime call, on the host
            inside = any(a <= e.time_range.start and e.time_range.end <= b for a, b in windows)
            for table in (calls, in_prepare) if inside else (calls,):
                c = table.setdefault(e.name, {"calls": 0, "us": 0.0, "max_us": 0.0})
                c["calls"] += 1 / steps
                c["us"] += e.time_range.elapsed_us() / steps
                c["max_us"] = max(c["max_us"], e.time_range.elapsed_us())
    total = sum(k["us"] for k in kernels.values())
    ours = sum(k["us"] for name, k in kernels.items() if name in XMIX_KERNELS)
    host = {"step_wall_us": 1e6 * wall / steps, "runtime_calls": calls}
    if gpu:  # whether the host keeps the GPU waiting: its idle time between the window's first and last kernel
        busy = [(e.time_range.start, e.time_range.end) for e in events
                if e.device_type.name == "CUDA" and e.name != "xmix.prepare_step"]
        host["gpu_idle_us"] = idle_time(busy) / steps
    if windows:
        host["prepare_step_us"] = sum(b - a for a, b in windows) / steps
        host["runtime_calls_in_prepare_step"] = in_prepare
    return {"requests": len(prompts), "prompt_len": PROFILED_PROMPT_LEN if kind == "decode" else whole,
            "decoding": len(decoding) if kind == "mixed" else None, "per_step_of": steps,
            "step_gpu_us": total, "xmix_us": ours, "xmix_share": ours / total if total else None, "kernels": kernels,
            "host": host}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dummy", action="store_true", help="load_format=dummy (random weights)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workloads", default="decode")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--toy", action="store_true", help="tiny workloads (the CPU run in CI)")
    parser.add_argument("--eager-engines", action="store_true", help="every engine enforce_eager (CPU speed)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="every engine's TP ranks (GPUs)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="every engine's KV cache this many blocks (vLLM's num_gpu_blocks_override): equal pools")
    parser.add_argument("--profile", action="store_true",
                        help="profile decode and prefill steps natively and with seven apps (kernels, host calls)")
    parser.add_argument("--steer-std", type=float, default=None,
                        help="the steering vector's per-feature std; by default 0.05 (small beside a real model's "
                             "residual), with --dummy 5e-5: a dummy model's activations are about 1e-3, where 0.05 "
                             "makes every token's residual the same vector and its GEMMs ran faster than native's "
                             "(likely less power drawn: bench/results/2026-12-03-gpu-bench-landing-slots.json)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown or "native" not in modes:
        parser.error(f"--modes: unknown {unknown}; choose from {MODES}, native included (the baseline)")
    if "eager_hook" in modes and args.tensor_parallel_size > 1:
        parser.error("eager_hook adds a torch hook to an in-process model: drop it from --modes under TP")
    if args.steer_std is None:
        args.steer_std = 5e-5 if args.dummy else 0.05
    engines, app_names, build_seconds = build_engines(args, modes)
    vocab = engines["native"].llm_engine.model_config.get_vocab_size()
    table = TOY_WORKLOADS if args.toy else WORKLOADS
    result = {"command": "python -m bench.serving " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                          "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
              "versions": {"torch": torch.__version__, "vllm": __import__("vllm").__version__},
              "engine_build_s": build_seconds, "apps": app_names, "steer_std": args.steer_std, "workloads": {},
              "kv_capacity_tokens": {name: kv_capacity_tokens(engine) for name, engine in engines.items()},
              # whether vLLM prepares the next step while the GPU runs this one (host work hidden)
              "async_scheduling": {name: vllm_config(engine).scheduler_config.async_scheduling
                                   for name, engine in engines.items()}}
    gen = torch.Generator().manual_seed(1234)
    if args.profile and "production" in engines:  # each op's kernel at each workload's decode batch
        production = engines["production"]
        runtime = production.engine.runtime
        result["kernel_floors"] = resident_kernel_times(
            runtime.control, getattr(torch, args.dtype), [table[w][0] for w in args.workloads.split(",")],
            renormalized_sites(runtime.family, production.cfg.n_layers, runtime.site_id))
        # decode steps of the native engines and of the idle production engine, alternately, before any
        # run: vLLM's own kernels compared on engines whose KV pools have no history yet (each
        # workload's profiles come after its runs)
        n, in_len, _ = table[args.workloads.split(",")[0]]
        batch = torch.randint(100, vocab - 100, (n, in_len), generator=torch.Generator().manual_seed(4321)).tolist()
        fresh_modes = [m for m in ("native", "native_twin") if m in engines] + ["installed_idle"]
        result["fresh_decode_steps"] = [
            {"mode": mode, **step_profile(set_mode(engines, app_names, mode), batch, control_plane(engines, mode))}
            for mode in fresh_modes * 2]
        reset(engines, app_names)
        write_result(result, args.out)
    for workload in args.workloads.split(","):
        n, in_len, out_len = table[workload]
        needed = n * (in_len + out_len)
        if needed > min(result["kv_capacity_tokens"].values()):
            print(f"bench.serving: {workload} needs {needed} KV tokens, more than an engine holds "
                  f"({result['kv_capacity_tokens']}): requests will be preempted (raise --gpu-memory-utilization)",
                  file=sys.stderr)

        def prompts():
            return torch.randint(100, vocab - 100, (n, in_len), generator=gen).tolist()

        warm = prompts()
        for mode in modes:
            run_once(set_mode(engines, app_names, mode), warm, out_len)
        runs = {mode: [] for mode in modes}
        for _ in range(args.repeats):
            batch = prompts()
            for mode in modes:
                runs[mode].append(timed_run(engines, app_names, mode, batch, out_len))
        same_tokens = {mode: [r["tokens"] == n_r["tokens"] for r, n_r in zip(runs[mode], runs["native"])]
                       for mode in modes}
        if "steer" in modes and "eager_hook" in modes:  # the same steering, two ways
            same_tokens["steer_vs_eager_hook"] = [a["tokens"] == b["tokens"]
                                                  for a, b in zip(runs["steer"], runs["eager_hook"])]
        for mode in modes:
            for r in runs[mode]:
                r.pop("tokens")
        result["workloads"][workload] = {"requests": n, "prompt_len": in_len, "output_len": out_len,
                                         "kv_tokens_needed": needed,
                                         "runs": runs, "summary": summarise(runs),
                                         "tokens_equal_native": same_tokens}
        reset(engines, app_names)
        if args.profile and "production" in engines:
            batch = prompts()
            profiled = result["workloads"][workload]
            for kind in PROFILED_STEP_KINDS:  # native, and with the seven apps
                profiled[f"{kind}_step_native"] = step_profile(engines["native"], batch, kind=kind)
                llm = set_mode(engines, app_names, "seven")
                profiled[f"{kind}_step_kernels"] = step_profile(llm, batch, control_plane(engines, "seven"), kind)
            llm = set_mode(engines, app_names, "installed_idle")
            profiled["decode_step_idle"] = step_profile(llm, batch, control_plane(engines, "installed_idle"))
            reset(engines, app_names)
        write_result(result, args.out)  # after each workload: a run cut short keeps what it measured
    gc.unfreeze()  # the runs' heap collectable again: a caller's engines among it (the tests call main)
    return result


if __name__ == "__main__":
    main()
