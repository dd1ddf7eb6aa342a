"""Host memory of a research engine against an unhooked vLLM engine of the same model.

    python -m bench.host_memory --model DIR --out results.json     # DIR: an HF checkpoint
    python -m bench.host_memory --model DIR --dummy ...            # a config folder, random weights (GPU)

Each engine is built in a process of its own (an engine gives its memory back only when its process
exits), the same way:
  native    vllm.LLM of the model, in xmix-lens's in-process environment
  research  HookedTransformer.from_pretrained(DIR) (every hook point armed), then what a researcher
            touches: a hooked call with a cache, W_E and W_U, and model.tl (TransformerLens's model
            on the engine's weights; not with --dummy, whose folder holds no weights for it)
Each reports its resident set (VmRSS) after the build and after the touches, and its peak (VmHWM).
`research_over_native_gib` is what xmix-lens holds on the host beyond vLLM.
"""
import json
import subprocess
import sys

import torch

from bench import child_engine_kwargs, child_engine_parser, run_header, write_result

GIB = 1 << 30


def host_memory() -> dict:
    """This process's resident set and its peak, in GiB (Linux /proc)."""
    with open("/proc/self/status") as f:
        kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))}
    return {"rss_gib": kib["VmRSS"] * 1024 / GIB, "peak_gib": kib["VmHWM"] * 1024 / GIB}


def native(args) -> dict:
    from xmix_lens.model import in_process_environment

    in_process_environment()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, **child_engine_kwargs(args, max_model_len=256))
    built = host_memory()
    llm.generate([TokensPrompt(prompt_token_ids=list(range(100, 116)))] * 4, SamplingParams(max_tokens=4),
                 use_tqdm=False)
    return {"built": built, "used": host_memory()}


def research(args) -> dict:
    from xmix_lens import HookedTransformer

    model = HookedTransformer.from_pretrained(args.model, dtype=args.dtype, **child_engine_kwargs(args, max_model_len=256))
    built = host_memory()
    v = torch.zeros(model.cfg.d_model, device=model.cfg.device, dtype=model.cfg.dtype)
    tokens = torch.randint(100, model.cfg.d_vocab - 100, (4, 16))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_resid_post"))
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act + v)])
    touched = {"W_E": str(model.W_E.device), "W_U": str(model.W_U.device), "cache": str(next(iter(cache.values())).device)}
    if not args.dummy:
        touched["tl_parameters"] = sum(p.numel() for p in model.tl.parameters())
    return {"built": built, "used": host_memory(), "touched": touched}


def main(argv=None) -> dict:
    args = child_engine_parser(__doc__.split("\n")[0]).parse_args(argv)
    if args.child:
        print("HOST_MEMORY " + json.dumps((native if args.child == "native" else research)(args)), flush=True)
        return {}
    command = [sys.executable, "-m", "bench.host_memory", "--model", args.model, "--dtype", args.dtype,
               "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    command += [flag for flag, on in (("--dummy", args.dummy), ("--eager", args.eager)) if on]
    result = run_header("bench.host_memory", argv)
    for child in ("native", "research"):
        done = subprocess.run(command + ["--child", child], capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("HOST_MEMORY ")]
        if done.returncode or not lines:
            raise RuntimeError(f"the {child} engine's process failed:\n{done.stderr[-3000:]}")
        result[child] = json.loads(lines[-1].removeprefix("HOST_MEMORY "))
    result["research_over_native_gib"] = result["research"]["used"]["rss_gib"] - result["native"]["used"]["rss_gib"]
    print(f"host memory: native {result['native']['used']['rss_gib']:.2f} GiB, research "
          f"{result['research']['used']['rss_gib']:.2f} GiB ({result['research_over_native_gib']:+.2f})", flush=True)
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
