"""The control plane's host time per step, alone: `ControlPlane.prepare_step` with the seven bench
apps (bench/serving.py) active on every request, decode steps (one token a request), no forward.

    python -m bench.host_step --model DIR --out results.json      # DIR: an HF folder (its shapes)
    python -m bench.host_step --model DIR --dummy --device cuda   # a config folder, dummy weights

A plane on the CPU (`--device cuda` for one on the GPU: pinned staging, its copies and events),
requests that finish every --request-steps steps (their reads taken, as a server does, and timed:
`take_ms_per_request`) and new ones that take their places, their prompts of --prompt-len tokens
prepared first, whole, at most --prefill-tokens tokens a step (vLLM's chunked prefill; timed
apart: `host_ms_per_prefill_step`), each step followed by what the engine calls once its forward
is queued (`ControlPlane.launched`: the read logs' moves, `host_ms_after_launch_per_step`). What bench/serving.py's
`host_ms_per_step` measures inside an engine, without the engine: the difference is time the host
waits there. Per step, the wall time and the preparing thread's CPU time (`host_cpu_ms_per_step`).

With --busy-thread a thread runs pure-Python work beside the steps, as vLLM's own threads do in an
engine: each torch call in a step lets go of the GIL, and the step then waits until that thread
gives it back (up to `sys.getswitchinterval()`, 5 ms by default) — a wait the wall time shows and
the CPU time does not.

With --evict-caches MIB each step is preceded (outside its timing) by writes through a buffer of
that many MiB, larger than the host's caches: inside an engine the rest of a step's work (the
scheduler, the output processing, on the CPU the forward itself) runs between two preparations and
leaves their code and data out of the caches, which the steps here otherwise find warm.
"""
import argparse
import json
import platform
import statistics
import sys
import threading
import time

import numpy as np
import torch

from bench import write_result
from bench.serving import HOST_FIELDS, seven_apps
from xmix_lens import HookedServedModel
from xmix_lens.backend.control import ControlPlane, HostTime

FIELDS = HOST_FIELDS + ("take_ms_per_request",)
BUSY_THREAD = "host-step-busy"


def measure(model, device: torch.device, requests: int, steps: int, request_steps: int,
            evict: np.ndarray | None = None, prompt_len: int = 128, prefill_tokens: int = 4096) -> dict:
    """After a warm-up (the first batch of requests), the host ms per prepared step (wall and this
    thread's CPU time; prefill steps and decode steps apart); and per finished request, the ms of
    taking its reads (a batch's requests taken together, as a pass's or an API request's are)."""
    apps, _ = seven_apps(model.cfg)
    runtime = model.engine.runtime
    per_prefill = max(1, prefill_tokens // prompt_len)  # whole prompts a prefill step
    plane = ControlPlane(device, max(requests, 256, per_prefill * prompt_len), max_requests=requests)
    for app in apps:
        plane.install(app.name, runtime._place_all(model.planner.lower_app(app.name, app.fwd_hooks).ops, resident=True))
    names = [app.name for app in apps]
    query_start = np.arange(requests + 1)
    take_seconds, ids = [], []
    for step in range(steps):
        # the warm-up not counted: the first batch of requests, while the read logs grow to the chunks
        # they recycle from then on (each new chunk is made on a helper thread, in a few ms: a step here
        # takes a tenth of a ms, not an engine's milliseconds, so the steps would wait for it)
        if step == request_steps:
            plane.host_time = HostTime()
        if step % request_steps == 0:  # a new batch of requests; the last one's reads are taken
            plane.drain()
            started = time.perf_counter()
            plane.take_results(ids)
            if ids:
                take_seconds.append((time.perf_counter() - started) / len(ids))
            for old in ids:
                plane.forget(old)
            ids = [f"{step}-{r}" for r in range(requests)]
            for new in ids:
                plane.select(new, names)
            for first in range(0, requests, per_prefill):  # their prompts, whole, a chunk of them a step
                chunk = ids[first:first + per_prefill]
                if evict is not None:
                    evict += 1
                plane.prepare_step(chunk, np.arange(len(chunk) + 1) * prompt_len, len(chunk) * prompt_len,
                                   np.zeros(len(chunk), dtype=np.int64))
                plane.launched()  # as the engine calls it once the step's forward is queued
        if evict is not None:
            evict += 1  # every cache line of a buffer larger than the caches written
        # each request's computed tokens, on the host as vLLM's runner keeps them
        first_positions = np.full(requests, prompt_len + step % request_steps, dtype=np.int64)
        plane.prepare_step(ids, query_start, requests, first_positions)
        plane.launched()
    return {**plane.host_time.ms_per_step(), "take_ms_per_request": 1e3 * statistics.fmean(take_seconds)}


def busy_python(stop: threading.Event) -> None:
    """Pure-Python work until stopped (dict updates: a scheduler's kind of work), holding the GIL
    but at switch intervals."""
    table = {}
    while not stop.is_set():
        for i in range(1000):
            table[i % 97] = i


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", default="32,256,512")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--request-steps", type=int, default=128, help="steps a batch of requests lives")
    parser.add_argument("--prompt-len", type=int, default=128, help="each request's prompt tokens")
    parser.add_argument("--prefill-tokens", type=int, default=4096, help="the most tokens a prefill step holds")
    parser.add_argument("--dummy", action="store_true", help="load_format=dummy (a config folder, no weights)")
    parser.add_argument("--busy-thread", action="store_true", help="a thread of pure-Python work beside the steps")
    parser.add_argument("--evict-caches", type=int, default=0, metavar="MIB",
                        help="before each step, write through a buffer of this many MiB (the host's caches cold, as in an engine)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    model = HookedServedModel.from_pretrained(args.model, enforce_eager=True, max_model_len=128,
                                              **({"load_format": "dummy"} if args.dummy else {}))
    try:
        result = {"command": "python -m bench.host_step " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "machine": {"platform": platform.platform(), "processor": platform.processor()},
                  "versions": {"torch": torch.__version__, "numpy": np.__version__},
                  "switch_interval_s": sys.getswitchinterval(), **{field: {} for field in FIELDS}}
        evict = np.zeros(args.evict_caches << 17, dtype=np.int64) if args.evict_caches else None  # 8-byte words
        stop = threading.Event()
        if args.busy_thread:
            threading.Thread(target=busy_python, args=(stop,), name=BUSY_THREAD, daemon=True).start()
        try:
            for n in args.requests.split(","):
                measured = measure(model, torch.device(args.device), int(n), args.steps, args.request_steps, evict,
                                   args.prompt_len, args.prefill_tokens)
                for field in FIELDS:
                    result[field][n] = measured[field]
        finally:
            stop.set()
    finally:
        model.shutdown()
    print(json.dumps({field: result[field] for field in FIELDS}))
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
