"""Served soak: many clients at once against `xmix-lens serve` with the seven bench apps, some streaming,
some closing their stream after its first event; the server's memory and the reads it holds, sampled
as the requests go by.

    .venv/bin/python -m scripts.served_soak --requests 10000 --out bench/results/NAME.json

Each request chooses all seven apps (`vllm_xargs`) and gets its reads: 60% whole responses, 20%
streams read to the end, 20% streams closed after their first event (the client goes away). Every
`--sample-every` requests: the resident memory of the server's process tree and `xmix_reads_held`
(/metrics, after one more request whose fetch refreshes it). The result says whether the reads held
came back to 0 and how much the memory grew after the first sample. `--native`: the same requests,
choosing nothing, against vLLM's own server (what its memory does under the same load).
"""
import argparse
import json
import random
import re
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import psutil

from bench import write_result
from bench.served import SEVEN, Server, free_port
from xmix_lens.request_choice import APPS_KEY


def tree_rss(pid: int) -> int:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


def reads_held(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return max(float(v) for v in re.findall(r"^xmix_reads_held(?:\{[^}]*\})? (\S+)$", text, re.M))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m scripts.served_soak")
    p.add_argument("--model", help="a model folder (default: the tests' tiny Llama)")
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--sample-every", type=int, default=1000)
    p.add_argument("--native", action="store_true", help="vLLM's own server, requests choosing nothing")
    p.add_argument("--out")
    args = p.parse_args(argv)
    from bench.serving import served_apps
    from xmix_lens import HookedServedModel

    model_dir = args.model
    if model_dir is None:
        from tests.tiny_models import tiny_llama
        model_dir = str(tiny_llama())
    folder = tempfile.mkdtemp(prefix="soak-")
    model = HookedServedModel.from_pretrained(model_dir, enforce_eager=True, max_model_len=256)
    try:
        config = str(model.export(served_apps(model), Path(folder) / "apps"))
    finally:
        model.shutdown()
    port = free_port()
    # one KV cache size for both servers: the same engine but for the apps
    vllm_args = [model_dir, "--max-model-len", "256", "--port", str(port), "--kv-cache-memory-bytes", str(256 << 20)]
    if args.native:
        command = [sys.executable, "-m", "xmix_lens.backend.vllm.serve_main", *vllm_args, "--dtype", "float32"]
    else:
        command = [sys.executable, "-m", "xmix_lens.cli", "serve", config, "--", *vllm_args]
    server = Server(command, Path(folder) / "server.log", port, {"VLLM_PLUGINS": ""} if args.native else None)
    rng = random.Random(0)
    result = {"command": "python -m scripts.served_soak " + " ".join(argv if argv is not None else sys.argv[1:]),
              "samples": [], "outcomes": {}}
    try:
        if not server.wait_ready():
            raise RuntimeError(server.output()[-3000:])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        body = {"ignore_eos": True, **({} if args.native else {"vllm_xargs": {APPS_KEY: ",".join(SEVEN)}})}

        def one(i: int) -> str:
            kind, prompt = rng.choices(["whole", "stream", "gone"], [6, 2, 2])[0], f"request {i} " * rng.randint(1, 20)
            kwargs = dict(model=model_dir, prompt=prompt, max_tokens=rng.randint(1, 16), extra_body=body)
            if kind == "whole":
                reads = client.completions.create(**kwargs).model_extra.get("xmix_reads")
            else:
                events = client.completions.create(stream=True, **kwargs)
                if kind == "gone":
                    next(iter(events))
                    events.close()
                    return kind
                reads = list(events)[-1].model_extra.get("xmix_reads")
            return kind if args.native or reads[0]["apps"] else f"{kind} without reads"

        started = time.time()
        with ThreadPoolExecutor(args.clients) as pool:
            for first in range(0, args.requests, args.sample_every):
                for outcome in pool.map(one, range(first, min(first + args.sample_every, args.requests))):
                    result["outcomes"][outcome] = result["outcomes"].get(outcome, 0) + 1
                one(-1)  # a whole response: its fetch refreshes xmix_reads_held
                result["samples"].append({"requests": min(first + args.sample_every, args.requests),
                                          "seconds": time.time() - started, "rss_mb": tree_rss(server.process.pid) / 2**20,
                                          "reads_held": None if args.native else reads_held(port)})
                write_result(result, args.out)
                print(result["samples"][-1], flush=True)
        samples = result["samples"]
        result["reads_held_at_end"] = samples[-1]["reads_held"]
        result["rss_growth_after_first_sample_mb"] = samples[-1]["rss_mb"] - samples[0]["rss_mb"]
        write_result(result, args.out)
    finally:
        server.stop()
    return result


if __name__ == "__main__":
    print(json.dumps({k: v for k, v in main().items() if k != "samples"}, indent=1))
