"""What a new pinned host chunk (CHUNK_BYTES, the size of a read log's chunk) costs a step:
made inline, on the step's thread, or ahead on a helper thread. The measurement behind
`messenger.ReadLog`'s plain-memory chunks and `ReadArea`'s pinned landing slots
(bench/results/2026-12-02-gpu-chunk-alloc.json).

    python -m bench.chunk_alloc --device cuda --out results.json
    python -m bench.chunk_alloc --toy                              # the CPU run the tests make

Steps stand in for an engine's decode steps: a CUDA graph of --layers matmuls of --tokens rows
(plain calls on the CPU), replayed and waited for (so a stall of the device pipeline, which an
engine's overlapped steps would feel, does not show here). Every --every steps a chunk of CHUNK_BYTES
(pinned on a GPU) is made: not at all ("none"), inline before the step ("inline"), or submitted
to a helper thread ("helper"). Per condition: the steps' median, P99 and longest wall time, and
the inline allocations' own times.
"""
import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from bench import write_result
from bench.serving import p99
from xmix_lens.backend.messenger import CHUNK_BYTES


def make_step(device: torch.device, tokens: int, width: int, layers: int):
    x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
    w = torch.randn(width, width, device=device, dtype=torch.bfloat16) / width**0.5

    def forward():
        y = x
        for _ in range(layers):
            y = y @ w
        return y

    if device.type != "cuda":
        return forward
    forward()  # warm (cuBLAS picks its kernels) before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()

    def replay():
        graph.replay()
        torch.cuda.synchronize()
    return replay


def run(step, condition: str, steps: int, every: int, pin: bool) -> dict:
    helper = ThreadPoolExecutor(max_workers=1)
    kept, times, allocations = [], [], []  # kept: the chunks stay alive, as a log's do

    def chunk():
        return torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=pin)

    for i in range(steps):
        started = time.perf_counter()
        if i % every == every - 1:
            if condition == "inline":
                kept.append(chunk())
                allocations.append(time.perf_counter() - started)
            elif condition == "helper":
                kept.append(helper.submit(chunk))
        step()
        times.append(time.perf_counter() - started)
    helper.shutdown()
    ms = [1e3 * t for t in times]
    row = {"median_ms": statistics.median(ms), "p99_ms": p99(ms), "max_ms": max(ms), "chunks": len(kept)}
    if allocations:
        row["inline_allocation_ms"] = {"median": 1e3 * statistics.median(allocations), "max": 1e3 * max(allocations)}
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=20, help="steps between new chunks")
    parser.add_argument("--toy", action="store_true", help="small sizes (the CPU run in CI)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.toy:
        args.tokens, args.width, args.layers, args.steps, args.every = 4, 64, 2, 40, 4
    device = torch.device(args.device)
    step = make_step(device, args.tokens, args.width, args.layers)
    conditions = ("none", "inline", "helper")
    result = {"command": "python -m bench.chunk_alloc " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "chunk_bytes": CHUNK_BYTES, "pinned": device.type == "cuda",
              "conditions": {c: run(step, c, args.steps, args.every, device.type == "cuda") for c in conditions}}
    print(json.dumps(result["conditions"], indent=1))
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
