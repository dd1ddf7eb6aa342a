"""Research throughput against TransformerLens on the same device and weights, as ratios.

    python -m bench.research --model DIR --out results.json     # DIR: an HF checkpoint (real weights)
    python -m bench.research --model DIR --toy                   # the CPU run the tests make

Three tasks a researcher runs over many prompts (random token ids, the same for both):
  cache     run_with_cache over N prompts, four residual hook points cached, return_type=None
  steer     run_with_hooks with a steering write at the middle layer, return_type="loss"
  generate  greedy generate with the same steering hook (`model.hooks(...)`), G prompts
  generate_many  the same over M prompts (a sweep's size: the engine's batching against TL's batches)
xmix-lens gets each task as one call (the engine batches it); TransformerLens (its
TransformerBridge, compatibility mode without weight processing: the weights vLLM serves) in
batches of --tl-batch, with its KV cache for generate. Both run under torch.no_grad (as research
code does; TransformerLens otherwise records autograd graphs). Each task runs once to warm up,
then --repeats times, alternating the two. The ratio is TransformerLens's seconds over xmix-lens's.
The same engine's vLLM, without hooks (`LLM.generate` of the same prompts, every prompt token
computed: one token for the forward tasks, the new tokens for generate, and for the loss task each
prompt token's log-probability, the loss's own work), is timed beside them as the floor a hooked
call could reach.
With --profile, each task runs once more on xmix-lens and on vLLM without hooks under cProfile (the
host functions with the most own time) and, on a GPU, under torch's profiler (the device's kernel time and launches against
the call's wall time: whether the call waits on the host or on the GPU).
"""
import argparse
import cProfile
import importlib.metadata
import pstats
import statistics
import sys
import time
import uuid

import torch

from bench import write_result
from compat_tests.reference import TLReference
from xmix_lens import HookedServedModel

SIZES = {"full": {"n": 1000, "len": 64, "gen_prompts": 64, "gen_many": 1000, "gen_len": 16, "new": 64},
         "toy": {"n": 6, "len": 8, "gen_prompts": 2, "gen_many": 5, "gen_len": 4, "new": 3}}


def steering(cfg, layer: int):
    v = torch.randn(cfg.d_model, generator=torch.Generator().manual_seed(0)) * 0.05

    def steer(act, hook):
        return act + v.to(act.device, act.dtype)

    return [(f"blocks.{layer}.hook_resid_post", steer)]


def tasks(size: dict, n_layers: int):
    """Each task as (name, run on xmix-lens, run on TransformerLens over a batch)."""
    cached = [f"blocks.{i}.hook_resid_post" for i in sorted({0, n_layers // 3, 2 * n_layers // 3, n_layers - 1})]

    def cache(model, tokens):  # the sum of squares of the last cached point: comparable over batches
        _, c = model.run_with_cache(tokens, names_filter=cached, return_type=None)
        return c[cached[-1]].float().square().sum().item()

    def steer(model, tokens, hooks):
        return float(model.run_with_hooks(tokens, fwd_hooks=hooks, return_type="loss"))

    def generate(model, tokens, hooks):
        with model.hooks(fwd_hooks=hooks):
            out = model.generate(tokens, max_new_tokens=size["new"], do_sample=False, stop_at_eos=False,
                                 verbose=False)
        return out.shape[1]

    return cached, {"cache": cache, "steer": steer, "generate": generate}


def native_vllm(model, tokens: torch.Tensor, max_tokens: int, loss: bool = False) -> dict:
    """The engine's vLLM without hooks over the same prompts (CUDA graphs, the compiled model):
    the tokens it generated, and those it took from the prefix cache (none). Every prompt token is
    computed, as a hooked call computes it: a fresh prefix-cache salt per call, or vLLM would serve
    each repeat's prompts from the cache the one before filled (all but a prompt's last token:
    1/64 of the forward work on the forward tasks). With `loss`, vLLM also computes what
    `return_type="loss"` returns, as a vLLM user gets it: each prompt token's log-probability
    (`prompt_logprobs=0`), and `loss` is the mean of their negatives."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                            skip_clone=True, prompt_logprobs=0 if loss else None)  # as the facade's calls send them
    salt = uuid.uuid4().hex
    outs = model.engine.llm.generate([TokensPrompt(prompt_token_ids=row.tolist(), cache_salt=salt) for row in tokens],
                                     params, use_tqdm=False)
    result = {"generated": sum(len(o.outputs[0].token_ids) for o in outs),
              "cached": sum(o.num_cached_tokens or 0 for o in outs)}
    if loss:  # the first position has no log-probability (nothing before it)
        nll = [-entry[token].logprob for o in outs for token, entry in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
        result["loss"] = sum(nll) / len(nll)
    return result


def host_profile(run, top: int = 40) -> dict:
    """One run under cProfile: its wall time, the own time of each package's functions summed
    (`own_by_package`: where a hooked call's extra host time goes, beside vLLM's own call's), the
    functions with the most own time, and xmix-lens's own functions with the most time inside them
    (`cumulative`)."""
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(run)
    wall = time.perf_counter() - start
    rows = [{"function": f"{file.rsplit('site-packages/', 1)[-1]}:{line}:{name}", "calls": calls,
             "own_s": round(own, 4), "cumulative_s": round(cumulative, 4)}
            for (file, line, name), (_, calls, own, cumulative, _) in pstats.Stats(profiler).stats.items()]
    ours = [r for r in rows if "xmix_lens/" in r["function"] or "backend/" in r["function"]]
    by_package: dict[str, float] = {}
    for r in rows:
        package = next((p for p in ("xmix_lens/", "backend/", "kernels/", "vllm/", "torch/", "triton/")
                        if p in r["function"]), "builtins and other")
        by_package[package.rstrip("/")] = by_package.get(package.rstrip("/"), 0.0) + r["own_s"]
    return {"wall_s": round(wall, 4), "own_by_package": {k: round(v, 4) for k, v in sorted(by_package.items())},
            "own": sorted(rows, key=lambda r: -r["own_s"])[:top],
            "cumulative": sorted(ours, key=lambda r: -r["cumulative_s"])[:top]}


def device_profile(run) -> dict:
    """One run under torch's profiler: its wall time, and the CUDA kernels' summed time and launches."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list] = {}
    for e in kernels:
        by_name.setdefault(e.name, [0, 0.0])
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.device_time_total
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
    return {"wall_s": wall, "kernel_s": sum(e.device_time_total for e in kernels) / 1e6, "launches": len(kernels),
            "top_kernels": [{"name": n[:120], "launches": c, "s": t / 1e6} for n, (c, t) in top]}


def batched(run, tokens, batch: int) -> list:
    return [run(tokens[i:i + batch]) for i in range(0, len(tokens), batch)]


def row_weighted_mean(run, tokens, batch: int) -> float:
    """The mean over rows of a per-batch mean (a loss), as one call over every row gives it."""
    return sum(run(tokens[i:i + batch]) * len(tokens[i:i + batch]) for i in range(0, len(tokens), batch)) / len(tokens)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--toy", action="store_true", help="tiny sizes, fp32 (the CPU run the tests make)")
    parser.add_argument("--tl-batch", type=int, default=64, help="TransformerLens's batch size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--profile", action="store_true", help="profile each task on xmix-lens (host, and device)")
    parser.add_argument("--tasks", default="cache,steer,generate,generate_many", help="which tasks, comma-separated")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    size = SIZES["toy" if args.toy else "full"]
    dtype = torch.float32 if args.toy else getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.time()
    kwargs = {"max_model_len": 256}
    if device == "cuda":
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    ours = HookedServedModel.from_pretrained(args.model, dtype=str(dtype).removeprefix("torch."), **kwargs)
    build = {"xmix_lens_s": time.time() - started}
    started = time.time()
    tl = TLReference(args.model, device=device, dtype=dtype).bridge
    build["transformer_lens_s"] = time.time() - started

    cfg = ours.cfg
    cached, runs = tasks(size, cfg.n_layers)
    hooks = steering(cfg, cfg.n_layers // 2)
    gen = torch.Generator().manual_seed(1234)
    vocab = cfg.d_vocab

    def tokens(n, length):
        return torch.randint(100, vocab - 100, (n, length), generator=gen)

    inputs = {"cache": tokens(size["n"], size["len"]), "steer": tokens(size["n"], size["len"]),
              "generate": tokens(size["gen_prompts"], size["gen_len"]),
              "generate_many": tokens(size["gen_many"], size["gen_len"])}
    calls = {
        "cache": (lambda t: runs["cache"](ours, t),
                  lambda t: sum(batched(lambda b: runs["cache"](tl, b.to(device)), t, args.tl_batch))),
        "steer": (lambda t: runs["steer"](ours, t, hooks),
                  lambda t: row_weighted_mean(lambda b: runs["steer"](tl, b.to(device), hooks), t, args.tl_batch)),
        "generate": (lambda t: runs["generate"](ours, t, hooks),
                     lambda t: batched(lambda b: runs["generate"](tl, b.to(device), hooks), t, args.tl_batch)),
    }
    calls["generate_many"] = calls["generate"]
    calls = {name: calls[name] for name in args.tasks.split(",")}
    result = {"command": "python -m bench.research " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "versions": {"torch": torch.__version__, "vllm": __import__("vllm").__version__,
                           "transformer_lens": importlib.metadata.version("transformer-lens")},
              "dtype": str(dtype), "sizes": size, "tl_batch": args.tl_batch, "cached": cached,
              "engine_build_s": build, "tasks": {}}
    for name, (on_ours, on_tl) in calls.items():
        t = inputs[name]
        new_tokens = size["new"] if name.startswith("generate") else 1
        on_native = lambda t: native_vllm(ours, t, new_tokens, loss=name == "steer")  # noqa: E731
        warm = t[: max(2, len(t) // 10)]
        with torch.no_grad():
            on_ours(warm), on_tl(warm), on_native(warm)
        seconds = {"xmix_lens": [], "transformer_lens": [], "vllm_native": []}
        answers = {}
        for _ in range(args.repeats):
            for who, run in (("xmix_lens", on_ours), ("transformer_lens", on_tl), ("vllm_native", on_native)):
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                with torch.no_grad():
                    answers[who] = run(t)
                if device == "cuda":
                    torch.cuda.synchronize()
                seconds[who].append(time.perf_counter() - start)
        ours_s, tl_s, native_s = (statistics.median(seconds[who]) for who in ("xmix_lens", "transformer_lens",
                                                                               "vllm_native"))
        result["tasks"][name] = {"seconds": seconds, "prompts": len(t), "prompts_per_s_xmix": len(t) / ours_s,
                                 "prompts_per_s_tl": len(t) / tl_s, "speedup_vs_tl": tl_s / ours_s,
                                 "native_vllm_over_xmix": native_s / ours_s,
                                 # the same, repeat by repeat: a drift of the host's speed over a run
                                 # (the lent machines' is large) touches both sides of each ratio alike
                                 "native_vllm_over_xmix_paired": statistics.median(
                                     n / o for n, o in zip(seconds["vllm_native"], seconds["xmix_lens"])),
                                 "answer": answers}
        if args.profile:
            with torch.no_grad():  # vLLM without hooks too: what a hooked call adds is the difference
                for who, run in (("", on_ours), ("_native", on_native)):
                    result["tasks"][name]["host_profile" + who] = host_profile(lambda: run(t))
                    if device == "cuda":
                        result["tasks"][name]["device_profile" + who] = device_profile(lambda: run(t))
        print(f"{name}: xmix-lens {ours_s:.3f} s, TransformerLens {tl_s:.3f} s: {tl_s / ours_s:.2f}x; "
              f"vLLM without hooks {native_s:.3f} s: {native_s / ours_s:.2f} "
              f"(paired {result['tasks'][name]['native_vllm_over_xmix_paired']:.2f})", flush=True)
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
