"""Start-up of a research engine against an unhooked vLLM engine of the same model: where the seconds go.

    python -m bench.startup --model DIR --out results.json           # DIR: an HF checkpoint (or smollm2-135m)
    python -m bench.startup --model DIR --dummy --warm 2 ...         # a config folder, random weights (GPU)

Each start is a process of its own, as a notebook kernel's first cell: `python` until the engine
answers. The first of each kind starts cold (fresh vLLM, Inductor and Triton caches in a folder of
this run), the next `--warm` ones reuse those caches, as a second session on the same machine does:
  native    vllm.LLM of the model, in xmix-lens's in-process environment
  research  HookedTransformer.from_pretrained(DIR) (every hook point armed, as a researcher's default)
A start reports its wall time to the engine's first answer (`ready_s`, measured by this process,
interpreter start included), the seconds of its imports (`-X importtime`, top-level modules) and of
vLLM's engine phases, timed by wrapping vLLM's worker and runner methods in the child only:
device init, model load, profile run, KV-cache set-up, compile-or-warm-up, kernel warm-up, graph capture. Phases
nest (capture runs inside compile-or-warm-up) and imports happen inside them, so they do not add up.
"""
import functools
import importlib.abc
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

from bench import child_engine_kwargs, child_engine_parser, run_header, write_result
from xmix_lens.model_files import resolve_model

# module -> class (None: the module's own functions) -> the methods whose seconds a start reports (only those
# the class itself defines)
PHASES = {
    "vllm.v1.worker.gpu_worker": {"Worker": ("init_device", "load_model", "determine_available_memory",
                                             "initialize_from_config", "compile_or_warm_up_model")},
    "vllm.v1.worker.cpu_worker": {"CPUWorker": ("init_device", "determine_available_memory",
                                                "compile_or_warm_up_model")},
    "vllm.v1.worker.gpu.model_runner": {"GPUModelRunner": ("profile_run", "capture_model")},
    "vllm.v1.worker.gpu_model_runner": {"GPUModelRunner": ("profile_run", "capture_model")},
    "vllm.entrypoints.llm": {"LLM": ("__init__",)},
    "vllm.model_executor.warmup.kernel_warmup": {None: ("kernel_warmup",)},  # a module function
}
READY = "STARTUP_READY "


class _TimePhases(importlib.abc.MetaPathFinder):
    """Wraps PHASES' methods as their modules are imported, so the child imports nothing early
    (xmix-lens sets vLLM's environment and logging before vLLM is first imported)."""

    def __init__(self, seconds: dict):
        self.seconds = seconds

    def find_spec(self, name, path, target=None):
        if name not in PHASES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            for class_name, methods in PHASES[name].items():
                owner = module if class_name is None else getattr(module, class_name)
                for method in methods:
                    if method in vars(owner):
                        label = method if class_name is None else f"{class_name}.{method}"
                        setattr(owner, method, self._timed(getattr(owner, method), label))

        spec.loader.exec_module = exec_module
        return spec

    def _timed(self, method, label):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
        return timed


def child(args) -> dict:
    """One start in this process; its phases' seconds."""
    seconds = {}
    sys.meta_path.insert(0, _TimePhases(seconds))
    engine = child_engine_kwargs(args, max_model_len=args.max_model_len, **json.loads(args.engine_args))
    start = time.perf_counter()
    if args.child == "native":
        from xmix_lens.model import in_process_environment

        in_process_environment()
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, **engine)
        llm.generate([TokensPrompt(prompt_token_ids=[100, 101, 102])], SamplingParams(max_tokens=2), use_tqdm=False)
    else:
        from xmix_lens import HookedTransformer

        model = HookedTransformer.from_pretrained(args.model, dtype=args.dtype, **engine)
        model.generate(torch.tensor([[100, 101, 102]]), max_new_tokens=2, verbose=False)
    seconds["in_python"] = time.perf_counter() - start
    return seconds


def import_seconds(stderr: str) -> float:
    """The seconds of the top-level imports `-X importtime` printed (each includes what it imported)."""
    total = 0
    for match in re.finditer(r"^import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", stderr, re.MULTILINE):
        total += int(match.group(1))  # an unindented name: imported by the program itself
    return total / 1e6


def start(args, kind: str, caches: str) -> dict:
    """One start of `kind` in a process of its own, with its caches under `caches`."""
    command = [sys.executable, "-X", "importtime", "-m", "bench.startup", "--child", kind, "--model", args.model,
               "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--engine-args", args.engine_args,
               "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    command += [flag for flag, on in (("--dummy", args.dummy), ("--eager", args.eager)) if on]
    environment = {**os.environ, "VLLM_CACHE_ROOT": os.path.join(caches, "vllm"),
                   "TRITON_CACHE_DIR": os.path.join(caches, "triton"),
                   "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor")}
    with tempfile.TemporaryFile("w+") as stderr_file:  # a file: -X importtime's lines would fill a pipe's buffer
        began = time.perf_counter()
        child_process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr_file, text=True, env=environment)
        ready, phases = None, None
        for line in child_process.stdout:
            if line.startswith(READY):
                ready, phases = time.perf_counter() - began, json.loads(line.removeprefix(READY))
        child_process.wait()
        stderr_file.seek(0)
        stderr = stderr_file.read()
    if child_process.returncode or phases is None:
        raise RuntimeError(f"the {kind} start failed:\n{stderr[-3000:]}")
    return {"ready_s": ready, "imports_s": import_seconds(stderr), "phases_s": phases}


def main(argv=None) -> dict:
    parser = child_engine_parser(__doc__.split("\n")[0])
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--engine-args", default="{}", help="more of vLLM's engine arguments, as JSON, for both kinds")
    parser.add_argument("--warm", type=int, default=2, help="warm starts of each kind after its cold one")
    parser.add_argument("--kinds", default="native,research", help="which starts, comma-separated")
    args = parser.parse_args(argv)
    args.model = str(resolve_model(args.model))  # a name from_pretrained takes ("smollm2-135m") or a folder
    if args.child:
        print(READY + json.dumps(child(args)), flush=True)
        return {}
    result = run_header("bench.startup", argv)
    for kind in args.kinds.split(","):
        with tempfile.TemporaryDirectory(prefix=f"xmix-startup-{kind}-") as caches:
            result[kind] = {"cold": start(args, kind, caches), "warm": [start(args, kind, caches) for _ in range(args.warm)]}
        warm = [run["ready_s"] for run in result[kind]["warm"]]
        print(f"{kind}: cold {result[kind]['cold']['ready_s']:.1f} s, warm {', '.join(f'{s:.1f}' for s in warm)} s",
              flush=True)
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
