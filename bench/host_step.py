"""The control plane's host time per step, alone: `ControlPlane.prepare_step` with the seven bench
apps (bench/serving.py) active on every request, decode steps (one token a request), no forward.

    python -m bench.host_step --model DIR --out results.json      # DIR: an HF folder (its shapes)
    python -m bench.host_step --model DIR --dummy --device cuda   # a config folder, dummy weights

A plane on the CPU (`--device cuda` for one on the GPU: pinned staging, its copies and events),
requests that finish every --request-steps steps (their reads taken, as a server does, and timed:
`take_ms_per_request`) and new ones that take their places. What bench/serving.py's
`host_ms_per_step` measures inside an engine, without the engine: the difference is time the host
waits there.
"""
import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np
import torch

from bench import write_result
from bench.serving import seven_apps
from xmix_lens import HookedServedModel
from xmix_lens.backend.vllm.control import ControlPlane


def measure(model, device: torch.device, requests: int, steps: int, request_steps: int) -> tuple[float, float]:
    """Mean host ms per prepared step, after a warm-up; and per finished request, the ms of taking
    its reads (a batch's requests taken together, as a pass's or an API request's are)."""
    apps, _ = seven_apps(model.cfg)
    runtime = model.engine.runtime
    plane = ControlPlane(device, max(requests, 256), max_requests=requests)
    for app in apps:
        plane.install(app.name, runtime._place_all(model._lower_app(app.name, app.fwd_hooks).ops, resident=True))
    names = [app.name for app in apps]
    query_start = np.arange(requests + 1)
    first_positions = np.arange(requests)  # each request's computed tokens, on the host as vLLM's runner keeps them
    seconds, take_seconds, ids = [], [], []
    for step in range(steps):
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
        started = time.perf_counter()
        plane.prepare_step(ids, query_start, requests, first_positions)
        seconds.append(time.perf_counter() - started)
    return 1e3 * statistics.fmean(seconds[len(seconds) // 5:]), 1e3 * statistics.fmean(take_seconds)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", default="32,256,512")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--request-steps", type=int, default=128, help="steps a batch of requests lives")
    parser.add_argument("--dummy", action="store_true", help="load_format=dummy (a config folder, no weights)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    model = HookedServedModel.from_pretrained(args.model, enforce_eager=True, max_model_len=128,
                                              **({"load_format": "dummy"} if args.dummy else {}))
    try:
        result = {"command": "python -m bench.host_step " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "machine": {"platform": platform.platform(), "processor": platform.processor()},
                  "versions": {"torch": torch.__version__, "numpy": np.__version__},
                  "host_ms_per_step": {}, "take_ms_per_request": {}}
        for n in args.requests.split(","):
            result["host_ms_per_step"][n], result["take_ms_per_request"][n] = measure(
                model, torch.device(args.device), int(n), args.steps, args.request_steps)
    finally:
        model.shutdown()
    print(json.dumps({k: result[k] for k in ("host_ms_per_step", "take_ms_per_request")}))
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
