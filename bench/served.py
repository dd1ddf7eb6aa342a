"""Served overhead against native vLLM: vLLM's own `vllm bench serve` against native servers and
`xmix-lens serve`, on one machine, as ratios.

    python -m bench.served --model .gpumodel8b --dummy --concurrency 32 128 256 --rounds 4 \
        --modes native native_twin seven --out bench/results/NAME.json
    python -m bench.served --model TINY --concurrency 2 --rounds 2 --prompts-per-client 2 \
        --input-len 16 --output-len 8 --out run.json        # CPU: tests/test_bench.py at toy size

Servers (subprocesses, all started and ready before any request is timed):
  native       vLLM's OpenAI server, no xmix-lens plugin loaded (VLLM_PLUGINS="")
  native_twin  a second one: its distance to native is the noise floor of two servers of one build
  xmix         `xmix-lens serve` with the seven bench apps (bench/serving.py's seven_apps) exported
               (or `--config`), their sites armed, resident in the engine's CUDA graphs
Modes (`--modes`): native and native_twin; on the xmix server, what every request chooses in its
vllm_xargs: none (nothing: the installed-idle cost), steer (one steering write), seven (all seven:
five writes, one conditional, two reads returned with the response at the prompt's end).

Per concurrency: one warm-up run of every mode (not timed: kernels compiled on first use, caches),
then `--rounds` rounds, each running every mode once in turn, the order reversed every other
round (A B C, C B A, ...: a drift of the machine cancels), each round with its own seed (the same
random prompt ids for every mode of the round, new ones the next: no prefix-cache hit across
rounds on any server). A run is `vllm bench serve` called in this process: random prompts of
`--input-len` ids, `--output-len` tokens each (ignore_eos), `--prompts-per-client` x concurrency
prompts, at most `concurrency` in flight. Each run's result JSON is kept whole; per mode and
metric the median of its rounds and its ratio to native's (`bench.serving.against`: also the
paired ratio per round and the spread). Every server runs vLLM's kernel JIT monitor verbose: its
warnings of a kernel compiled while serving are counted per server before the first request, after
each warm-up and at the end; one request choosing all seven apps checks that reads come back. Each
run records its server's counters (`server_counters`: preemptions, read fetches and their time).
`--profile` adds one untimed run of every mode per concurrency with each server process sampling
its main thread (bench/sampler.py): the result's `profile` says where each process spent it. Results are written after every
run, so a run cut short still leaves what it measured.
"""
import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import sampler, write_result
from bench.serving import against

SEVEN = ("steer", "ablate_direction", "conditional_steer", "head_ablation", "mlp_scale", "probe_read", "sae_features")
MODES = {"native": ("native", None), "native_twin": ("native_twin", None), "none": ("xmix", None),
         "steer": ("xmix", ("steer",)), "seven": ("xmix", SEVEN)}
METRICS = ("mean_itl_ms", "p99_itl_ms", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
           "output_throughput", "total_token_throughput", "request_throughput")


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.served", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model folder (config.json and tokenizer)")
    p.add_argument("--dummy", action="store_true", help="random weights (load_format dummy)")
    p.add_argument("--config", help="the apps, exported (default: the seven bench apps, exported here)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--concurrency", nargs="+", type=int, default=[32, 128, 256])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prompts-per-client", type=int, default=3)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.28, help="each server's (GPU)")
    p.add_argument("--kv-cache-gib", type=float, help="each server's KV cache (GPU), not profiled: servers "
                   "starting side by side would each count the others' memory as theirs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", help="a folder for the servers' logs (default: beside --out)")
    p.add_argument("--commit", default="", help="the commit measured, recorded with the results")
    p.add_argument("--profile", action="store_true", help="after each concurrency's rounds, one more run of "
                   "every mode, untimed, with each server process sampling its main thread (bench/sampler.py)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    args.model = str(Path(args.model).resolve())  # the name every server serves it under
    return args


def server_args(args, port: int) -> list[str]:
    extra = ["--load-format", "dummy"] if args.dummy else []
    if _on_gpu():
        memory = ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        if args.kv_cache_gib:
            memory += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
    else:  # the CPU harness: a small KV cache, no compile
        memory = ["--kv-cache-memory-bytes", str(256 * 2**20), "--enforce-eager"]
    return [args.model, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--port", str(port),
            "--jit-monitor-verbose",
            "--max-num-seqs", str(max(args.concurrency)), *memory, *extra]


def _on_gpu() -> bool:
    import torch
    return torch.cuda.is_available()


def export_seven(args, folder: str) -> str:
    """The seven bench apps exported for the model (an eager engine of little memory, shut down after)."""
    from bench.serving import served_apps
    from xmix_lens import HookedServedModel

    kwargs = {"load_format": "dummy"} if args.dummy else {}
    if _on_gpu():  # its KV cache given: the native servers start beside it
        kwargs.update(gpu_memory_utilization=0.15, kv_cache_memory_bytes=1 << 30)
    model = HookedServedModel.from_pretrained(args.model, dtype=args.dtype, max_model_len=min(512, args.max_model_len),
                                              enforce_eager=True,
                                              **kwargs)
    try:
        return str(model.export(served_apps(model), folder))
    finally:
        model.shutdown()


class Server:
    """A server subprocess, its output in a file (`log_path`); `wait_ready` polls /v1/models. Its
    environment: this process's less the in-process engine's settings (a server has its own), and `env`."""

    def __init__(self, command: list[str], log_path: Path, port: int, env: dict | None = None):
        from xmix_lens.model import own_process_environment

        self.port, self.log_path = port, Path(log_path)
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**own_process_environment(), **(env or {})})

    def wait_ready(self, timeout: float = 600) -> bool:
        """True once it answers; False if it exited first."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2)
                return True
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"no answer in {timeout} s; its output: {self.output()[-3000:]}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def start_servers(args, servers: set[str], config: str | None, logs: Path) -> dict[str, Server]:
    """The servers started (not waited for); `config`: the xmix server's apps. With --profile every
    process of theirs samples itself while the profile folder's label file says so (bench/sampler.py)."""
    started = {}
    sampled = {}
    if args.profile:
        root = Path(__file__).resolve().parents[1]
        paths = [str(root), str(root / "bench" / "profile_site"), os.environ.get("PYTHONPATH", "")]
        sampled = {sampler.ENV: str(logs / "profile"), "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        (logs / "profile").mkdir(exist_ok=True)
    for name in sorted(servers):
        port = free_port()
        if name == "xmix":
            command = [sys.executable, "-m", "xmix_lens.cli", "serve", config, "--", *server_args(args, port)]
            env = {}
        else:
            command = [sys.executable, "-m", "xmix_lens.backend.vllm.serve_main", *server_args(args, port)]
            env = {"VLLM_PLUGINS": ""}  # no xmix-lens plugin: vLLM as it ships
        started[name] = Server(command, logs / f"{name}.log", port, {**env, **sampled})
    return started


def bench_args(args, server: Server, concurrency: int, prompts: int, seed: int, apps) -> argparse.Namespace:
    """`vllm bench serve`'s arguments for one run."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from xmix_lens.request_choice import APPS_KEY

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    extra = {"vllm_xargs": {APPS_KEY: ",".join(apps)}} if apps else {}
    return parser.parse_args([
        "--backend", "vllm", "--base-url", f"http://127.0.0.1:{server.port}", "--model", args.model,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(prompts),
        "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        *(["--extra-body", json.dumps(extra)] if extra else [])])


def run(args, servers, mode: str, concurrency: int, prompts: int, seed: int) -> dict:
    from vllm.benchmarks.serve import main as bench_serve

    server_name, apps = MODES[mode]
    before = server_counters(servers[server_name])
    result = bench_serve(bench_args(args, servers[server_name], concurrency, prompts, seed, apps))
    if result.get("failed"):
        raise RuntimeError(f"{mode} at {concurrency}: {result['failed']} requests failed")
    after = server_counters(servers[server_name])
    return {**{k: v for k, v in result.items() if not isinstance(v, list)},
            "server": {name: after[name] - before.get(name, 0.0) for name in after}}


SERVER_COUNTERS = ("vllm:num_preemptions_total", "xmix_read_fetches_total", "xmix_read_fetch_engine_seconds_total",
                   "xmix_read_wait_seconds_sum", "xmix_read_wait_seconds_count")


def server_counters(server: Server) -> dict[str, float]:
    """The server's counters of SERVER_COUNTERS on its /metrics (summed over their labels): a run's
    differences say where the served time went (preemptions; read fetches, the engine's time in
    them and the responses' wait for their reads)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30).read().decode()
    totals = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        if name in SERVER_COUNTERS:
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def profiled_runs(args, servers, modes: list[str], concurrency: int, folder: Path) -> dict:
    """One run of each mode with its servers sampling themselves under the label "concurrency/mode"
    (not among the timed rounds: the samples cost the sampled processes a little)."""
    runs = {}
    for mode in modes:
        (folder / "label").write_text(f"{concurrency}/{mode}")
        try:
            runs[mode] = run(args, servers, mode, concurrency, args.prompts_per_client * concurrency,
                             args.seed + 500_000 + concurrency)
        finally:
            (folder / "label").unlink()
        time.sleep(2 * sampler.LABEL_CHECK_S)  # every sampler has seen the label go
    return runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compiled_while_serving(servers: dict) -> dict[str, int]:
    """Per server, the kernels its JIT monitor saw compiled after the server's warm-up (vLLM's own)."""
    return {name: s.log_path.read_text().count("JIT compilation during inference") for name, s in servers.items()}


def seven_reads(args, server: Server) -> dict:
    """One request choosing all seven apps: the outputs its reads came back with."""
    from xmix_lens.request_choice import APPS_KEY

    body = json.dumps({"model": args.model, "prompt": list(range(1, 17)), "max_tokens": 4, "ignore_eos": True,
                       "vllm_xargs": {APPS_KEY: ",".join(SEVEN)}}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    reads = json.loads(urllib.request.urlopen(request, timeout=120).read())["xmix_reads"]
    return {app: {output: {"positions": r["positions"], "values": len(r["values"])} for output, r in outs.items()}
            for app, outs in reads[0]["apps"].items()}


def summarise(runs: dict) -> dict:
    """Per concurrency, mode and metric: the median of its rounds and its ratio to native's
    (`against`), and to native_twin's where there is one; over the rounds every mode finished."""
    summary = {}
    for concurrency, by_mode in runs.items():
        n = min(map(len, by_mode.values()))
        if not n:
            continue
        rows = {}
        for mode, rounds in by_mode.items():
            row = {}
            for m in METRICS:
                values = [r[m] for r in rounds[:n]]
                row[m] = {"median": statistics.median(values),
                          **against(values, [r[m] for r in by_mode["native"][:n]])}
                if "native_twin" in by_mode and mode not in ("native", "native_twin"):
                    row[m]["against_twin"] = against(values, [r[m] for r in by_mode["native_twin"][:n]])["ratio"]
            rows[mode] = row
        summary[concurrency] = {"rounds": n, "modes": rows}
    return summary


def main(argv=None) -> dict:
    args = parse(argv)
    import torch
    import vllm

    result = {"command": "python -m bench.served " + " ".join(argv if argv is not None else sys.argv[1:]),
              "commit": args.commit, "machine": platform.node(),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
              "runs": {}, "compiled_while_serving": {}}
    logs = Path(args.logs or (Path(args.out).parent if args.out else tempfile.mkdtemp()))
    logs.mkdir(parents=True, exist_ok=True)
    needs = {MODES[m][0] for m in args.modes} | {"native"}
    servers = start_servers(args, needs - {"xmix"}, None, logs)  # the native ones start while the apps export
    try:
        if "xmix" in needs:
            config = args.config or export_seven(args, tempfile.mkdtemp(prefix="seven-"))
            servers.update(start_servers(args, {"xmix"}, config, logs))
        for name, server in servers.items():
            if not server.wait_ready():
                raise RuntimeError(f"the {name} server exited: {server.output()[-3000:]}")
        result["compiled_while_serving"]["ready"] = compiled_while_serving(servers)
        modes = ["native", *[m for m in args.modes if m != "native"]]
        for c in args.concurrency:
            for mode in modes:  # warm-up, not timed
                run(args, servers, mode, c, c, args.seed + 100_000 + c)
            result["compiled_while_serving"][f"warm_{c}"] = compiled_while_serving(servers)
            result["runs"][c] = {mode: [] for mode in modes}
            for r in range(args.rounds):
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    prompts = args.prompts_per_client * c
                    result["runs"][c][mode].append(run(args, servers, mode, c, prompts, args.seed + 1000 * r + c))
                    result["summary"] = summarise(result["runs"])
                    write_result(result, args.out)
            if args.profile:
                result.setdefault("profiled_runs", {})[c] = profiled_runs(args, servers, modes, c, logs / "profile")
                write_result(result, args.out)
        result["compiled_while_serving"]["end"] = compiled_while_serving(servers)
        if args.profile:
            time.sleep(sampler.WRITE_S + 1)  # the samplers' last counts written
            result["profile"] = sampler.summary(logs / "profile")
        if "xmix" in servers:
            result["seven_reads"] = seven_reads(args, servers["xmix"])
        write_result(result, args.out)
    finally:
        for server in servers.values():
            server.stop()
    return result


if __name__ == "__main__":
    summary = main()["summary"]
    for c, rows in summary.items():
        for mode, row in rows["modes"].items():
            print(c, mode, {m: round(row[m]["ratio"], 4) for m in ("mean_itl_ms", "p99_itl_ms", "mean_ttft_ms",
                                                                   "output_throughput")})
