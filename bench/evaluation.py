"""Offline evaluation throughput against native vLLM: rows per second of `xmix_lens.evaluate` over a
JSONL file, against vLLM's own `LLM.generate` over the same rows' token ids, modes alternated.

    python -m bench.evaluation --model PATH --dummy --rows 2000 --repeats 3 --out results.json
    python -m bench.evaluation --model PATH --toy --eager-engines        # CPU: a small run in CI

Engines (in-process, built once): native vLLM's LLM; xmix-lens with one steering app installed as it
is built (captured in its CUDA graphs), its hook point alone armed (as `xmix-lens eval` arms them). Modes: `native` (LLM.generate, every row at once), `eval_none`
(evaluate, rows choosing no app), `eval_steer` (evaluate, every row choosing the steering app),
`xmix_generate` (LLM.generate on the xmix-lens engine, no app: what the engine costs apart from eval). Each
repeat runs the modes in turn (A B C A B C ...) after a warm-up of each; rows are greedy with a fixed
number of new tokens (EOS ignored), so every mode generates the same number of tokens. Reported per
mode: the median rows/s of the repeats and its ratio to native's; whether eval_none's tokens equal
native's.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

from bench import write_result
from xmix_lens import App
from xmix_lens.model import in_process_environment

in_process_environment()

MODES = ["native", "eval_none", "eval_steer", "xmix_generate"]


def steering_app(n_layers: int, d_model: int) -> App:
    v = torch.randn(d_model, generator=torch.Generator().manual_seed(0)) * 0.05
    return App("steer", fwd_hooks=[(f"blocks.{n_layers // 2}.hook_resid_post", lambda act, hook: act + v)])


def rows(model, n: int, prompt_len: int, new_tokens: int, seed: int) -> list[dict]:
    """Text prompts of about `prompt_len` tokens (random token ids, decoded)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, min(model.cfg.d_vocab, 49152) - 100, (n, prompt_len), generator=gen).tolist()
    return [{"id": i, "prompt": model.tokenizer.decode(r), "max_new_tokens": new_tokens, "stop_at_eos": False}
            for i, r in enumerate(ids)]


def run_native(llm, model, batch: list[dict]) -> tuple[float, list]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=model.to_tokens(r["prompt"], truncate=False)[0].tolist()) for r in batch]
    params = SamplingParams(max_tokens=batch[0]["max_new_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in out]


def run_eval(model, batch: list[dict], apps: list[str], folder: str) -> tuple[float, list]:
    from xmix_lens import evaluate

    path = os.path.join(folder, f"out-{time.monotonic_ns()}.jsonl")
    start = time.perf_counter()
    evaluate(model, [{**r, "apps": apps} for r in batch], path, progress=False)
    seconds = time.perf_counter() - start
    by_id = {r["id"]: r["token_ids"] for r in map(json.loads, open(path))}
    os.remove(path)
    return seconds, [by_id[r["id"]] for r in batch]


def _profile(once, batch, path) -> None:
    import cProfile
    import io
    import pstats

    with open(path, "w") as f:
        for mode in MODES:
            profile = cProfile.Profile()
            profile.enable()
            seconds, _ = once(mode, batch)
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
            f.write(f"=== {mode}: {seconds:.2f} s\n{text.getvalue()}\n")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dummy", action="store_true", help="load_format=dummy (random weights)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--toy", action="store_true", help="a few short rows (the CPU run in CI)")
    parser.add_argument("--eager-engines", action="store_true", help="every engine enforce_eager (CPU speed)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    parser.add_argument("--profile", help="write the host profile (cProfile, by own time) of one run of each mode here")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.toy:
        args.rows, args.prompt_len, args.new_tokens = 24, 8, 4
    from transformers import AutoConfig
    from vllm import LLM

    from xmix_lens import HookedServedModel

    common = {"max_model_len": args.max_model_len, "gpu_memory_utilization": args.gpu_memory_utilization,
              **({"load_format": "dummy"} if args.dummy else {}), **({"enforce_eager": True} if args.eager_engines else {})}
    hf = AutoConfig.from_pretrained(args.model)
    built = {}
    start = time.time()
    llm = LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, **common)
    built["native"] = time.time() - start
    start = time.time()
    steer = steering_app(hf.num_hidden_layers, hf.hidden_size)
    # only the app's hook points armed, as an engine serving a config (and `xmix-lens eval`) arms them
    model = HookedServedModel.from_pretrained(args.model, dtype=args.dtype, apps=[steer],
                                              armed=[name for name, _ in steer.fwd_hooks], **common)
    built["xmix"] = time.time() - start
    runs = {mode: [] for mode in MODES}
    equal, steered = [], []
    with tempfile.TemporaryDirectory() as folder:
        def once(mode, batch):
            if mode in ("native", "xmix_generate"):
                return run_native(llm if mode == "native" else model.engine.llm, model, batch)
            return run_eval(model, batch, ["steer"] if mode == "eval_steer" else [], folder)

        warm = rows(model, min(args.rows, 256), args.prompt_len, args.new_tokens, seed=0)
        for mode in MODES:
            once(mode, warm)
        for repeat in range(args.repeats):
            batch = rows(model, args.rows, args.prompt_len, args.new_tokens, seed=1 + repeat)
            tokens = {}
            for mode in MODES:
                seconds, tokens[mode] = once(mode, batch)
                runs[mode].append({"seconds": seconds, "rows_per_s": len(batch) / seconds})
            equal.append(tokens["eval_none"] == tokens["native"])
            steered.append(tokens["eval_steer"] != tokens["native"])
        if args.profile:
            _profile(once, rows(model, args.rows, args.prompt_len, args.new_tokens, seed=99), args.profile)
    base = statistics.median(r["rows_per_s"] for r in runs["native"])
    summary = {mode: {"rows_per_s": statistics.median(r["rows_per_s"] for r in rs),
                      "ratio_to_native": statistics.median(r["rows_per_s"] for r in rs) / base} for mode, rs in runs.items()}
    result = {"command": "python -m bench.evaluation " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                          "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
              "versions": {"torch": torch.__version__, "vllm": __import__("vllm").__version__},
              "engine_build_s": built, "rows": args.rows, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "runs": runs, "summary": summary, "eval_none_tokens_equal_native": equal,
              "eval_steer_tokens_differ": steered,
              # steps of the xmix engine run without CUDA graphs (0: every eval step replayed its graphs)
              "xmix_eager_steps": getattr(model.engine.runtime, "eager_steps", None)}
    print(json.dumps(summary, indent=1), "eval_none tokens equal native:", equal)
    write_result(result, args.out)
    model.shutdown()
    from xmix_lens.backend.vllm import adapter

    adapter.shutdown_workers(llm)
    return result


if __name__ == "__main__":
    main()
