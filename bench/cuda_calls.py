"""What a step's CUDA calls cost the host, through torch and straight to the runtime
(backend/cudart.py), with the host's caches warm and cold. GPU only.

    python -m bench.cuda_calls --out results.json

Per call, the median host time over --calls calls: a step's copy home of --rows rows of the seven
bench apps' read area (66 bf16 columns) into a pinned slot; the copy of a step's control rows
(the seven apps' ops, --rows tokens wide) from pinned staging into the control buffer's strided
view, as torch's two copies by way of a contiguous device buffer and as one runtime call; and an
event's record and query. With
--evict-caches MIB (cold) each call is preceded, outside its timing, by writes through a buffer of
that many MiB, as an engine's other work between two preparations leaves the caches
(bench/host_step.py).
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
from xmix_lens.backend import cudart

WIDTH = 66  # the seven bench apps' read area: a probe (2) and SAE features (64)
SLOTS = 8
CONTROL_OPS, CONTROL_TOKENS = 7, 8192  # the seven bench apps' resident ops; a control buffer's tokens


def calls(rows: int) -> dict:
    """Each measured call, by name, as a function of the call's number (its landing slot turns)."""
    values = torch.randn(max(rows, 1024), WIDTH, device="cuda").to(torch.bfloat16)
    landing = torch.empty(SLOTS, rows, WIDTH, dtype=torch.bfloat16, pin_memory=True)
    copies = [cudart.copy_home(landing[slot], values[:rows]) for slot in range(SLOTS)]
    control = torch.empty(CONTROL_OPS, 2, CONTROL_TOKENS, dtype=torch.int32, device="cuda")
    staged = torch.zeros(CONTROL_OPS, 2, rows, dtype=torch.int32, pin_memory=True)
    contiguous = torch.empty_like(staged, device="cuda")
    target = control[:, :, :rows]  # the views made once, as the control plane keeps them
    rows_copy = cudart.copy_rows_to_device(target, staged)

    def rows_torch(i):
        contiguous.copy_(staged, non_blocking=True)
        target.copy_(contiguous)

    event, twin = cudart.Event(), torch.cuda.Event()
    twin.record()
    return {"copy_torch": lambda i: landing[i % SLOTS].copy_(values[:rows], non_blocking=True),
            "copy_runtime": lambda i: copies[i % SLOTS](),
            "rows_torch": rows_torch,
            "rows_runtime": lambda i: rows_copy(),
            "record_torch": lambda i: twin.record(),
            "record_runtime": lambda i: event.record(),
            "query_torch": lambda i: twin.query(),
            "query_runtime": lambda i: event.query()}


def measure(rows: int, n_calls: int, evict: np.ndarray | None) -> dict:
    timed = calls(rows)
    seconds = {name: [] for name in timed}
    for i in range(n_calls):
        for name, call in timed.items():
            if evict is not None:
                evict += 1  # every cache line of a buffer larger than the caches written
            started = time.perf_counter()
            call(i)
            seconds[name].append(time.perf_counter() - started)
        torch.cuda.synchronize()
    warm_up = n_calls // 5
    return {name: 1e6 * statistics.median(s[warm_up:]) for name, s in seconds.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="32,256,512")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--evict-caches", type=int, default=64, metavar="MIB")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    evict = np.zeros(args.evict_caches << 17, dtype=np.int64)  # 8-byte words
    result = {"command": "python -m bench.cuda_calls " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "device": torch.cuda.get_device_name()},
              "versions": {"torch": torch.__version__}, "us_per_call": {}}
    for rows in map(int, args.rows.split(",")):
        result["us_per_call"][rows] = {"warm": measure(rows, args.calls, None), "cold": measure(rows, args.calls, evict)}
    print(json.dumps(result["us_per_call"]))
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
