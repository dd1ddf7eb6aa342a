"""GPU only (the lent 2-GPU machine, vllm 0.26.0): hooks under TP=2 equal TP=1, in bf16, CUDA graphs on.

    python3 tests/gpu/tp_compare.py make-model .gpumodel /tmp/tpmodel   # a seeded random checkpoint
    python3 tests/gpu/tp_compare.py run /tmp/tpmodel 1 /tmp/tp1.pt
    python3 tests/gpu/tp_compare.py run /tmp/tpmodel 2 /tmp/tp2.pt
    python3 tests/gpu/tp_compare.py compare /tmp/tp1.pt /tmp/tp2.pt $OUT/tp_gpu.json

The weights are a real checkpoint (HF's initialisation, seed 0), not load_format=dummy: vLLM draws
dummy weights per rank's shard, so a TP=1 and a TP=2 engine would be two different models.
Each run (one engine, vLLM's default compilation and CUDA-graph mode):
  - the CPU test's hook cases (tests/test_tensor_parallel.py: reads, writes, a conditional write,
    a head ablation, at replicated and sharded sites, each plan kind) run per call: logits, reads;
  - run_with_cache over sharded and replicated sites; greedy generation with hooks;
  - the CPU test's installed apps (a head shift, a read over every head: a gather inside the
    graphs) installed as the engine is built, selected per row; each rank's eager-step count
    while they generate (0: every step kept its CUDA graph).
Tolerance (bf16): a difference at most 5% of the largest reference value, and for the hook cases
at most twice the difference TP makes with no hook at all (TP reorders the sums in bf16).
"""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the CPU test's cases
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the root: tests.tiny_models

import xmix_lens  # noqa: E402,F401  (its from_pretrained sets vLLM's environment for the in-process engine)
from test_tensor_parallel import PROMPTS, Hooks, _apps, _zero_head  # noqa: E402

CACHE_NAMES = ["blocks.0.attn.hook_q", "blocks.0.attn.hook_k", "blocks.1.attn.hook_v", "blocks.1.attn.hook_z",
               "blocks.0.mlp.hook_pre", "blocks.1.mlp.hook_post", "blocks.1.hook_resid_post"]
NEW = 8
REL_TOL = 0.05


def make_model(config_dir: str, out: str) -> None:
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(config_dir)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    for f in Path(config_dir).iterdir():  # the tokenizer files
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            (Path(out) / f.name).write_bytes(f.read_bytes())


def eager_steps(model) -> list[int]:
    runtime = model.engine.runtime
    return runtime.read("eager_steps") if hasattr(runtime, "read") else [runtime.eager_steps]


def run(model_dir: str, tp: int, out: str, dtype: str = "bfloat16") -> None:
    from transformers import AutoConfig

    from xmix_lens import HookedServedModel

    hf = AutoConfig.from_pretrained(model_dir)
    cfg = SimpleNamespace(n_heads=hf.num_attention_heads, d_head=hf.head_dim)
    apps = _apps(cfg, "tp-")
    extra = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    model = HookedServedModel.from_pretrained(model_dir, dtype=dtype, apps=apps,
                                              gpu_memory_utilization=0.4, **extra)
    result = {"tp": tp, "cudagraph_mode": str(model.engine.llm.llm_engine.vllm_config.compilation_config.cudagraph_mode),
              "plain": model(PROMPTS).float(), "cases": {}}
    for case in Hooks(model.cfg).cases():
        h = Hooks(model.cfg)
        logits = model.run_with_hooks(PROMPTS, fwd_hooks=h.cases()[case])
        result["cases"][case] = {"logits": logits.float(), "kept": {k: v.float() for k, v in h.kept.items()}}
    _, cache = model.run_with_cache(PROMPTS, names_filter=CACHE_NAMES)
    result["cache"] = {n: cache[n].float() for n in CACHE_NAMES}
    hooks = [("blocks.1.attn.hook_z", _zero_head(1)), ("blocks.0.hook_resid_post", lambda act, hook: act * 1.5)]
    result["generated_with_hooks"] = model.generate(PROMPTS, max_new_tokens=NEW, fwd_hooks=hooks, do_sample=False,
                                                    stop_at_eos=False, padding_side="left", return_type="tokens")
    selection = [["tp-shift", "tp-zprobe"], [], ["tp-zprobe"]]
    before = eager_steps(model)
    with_apps = model.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, stop_at_eos=False, padding_side="left",
                               return_type="tokens", apps=selection)
    result["apps"] = {"tokens": with_apps.result, "eager_steps_during": [a - b for a, b in zip(eager_steps(model), before)],
                      "outputs": {a: {k: v.float() for k, v in o.items()} for a, o in with_apps.outputs.items()},
                      "logits": model.run_with_hooks(PROMPTS, apps=selection, padding_side="left").result.float()}
    torch.save(result, out)
    model.shutdown()


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    both = torch.isfinite(a) & torch.isfinite(b)  # rows that did not select a read app are NaN in both
    d = (a[both] - b[both]).abs().max().item() if both.any() else 0.0
    scale = a[both].abs().max().item() if both.any() else 0.0
    return {"max_abs_diff": d, "max_abs_ref": scale, "rel": d / scale if scale else 0.0,
            "nan_pattern_equal": bool(torch.equal(torch.isnan(a), torch.isnan(b)))}


def compare(one: str, two: str, out: str) -> bool:
    r1, r2 = torch.load(one), torch.load(two)
    plain = _diff(r1["plain"], r2["plain"])
    report = {"tolerance": f"max|TP2 - TP1| <= {REL_TOL} max|TP1|; hook cases also <= 2 x the no-hook TP difference",
              "cudagraph_mode": [r1["cudagraph_mode"], r2["cudagraph_mode"]], "no_hooks": plain, "cases": {}}
    ok = plain["rel"] <= REL_TOL
    for case, c1 in r1["cases"].items():
        c2 = r2["cases"][case]
        entry = {"logits": _diff(c1["logits"], c2["logits"]),
                 "hook_effect_on_logits": (c1["logits"] - r1["plain"]).abs().max().item(),
                 "kept": {k: _diff(v, c2["kept"][k]) for k, v in c1["kept"].items()}}
        entry["ok"] = (entry["logits"]["rel"] <= REL_TOL and entry["logits"]["max_abs_diff"]
                       <= 2 * plain["max_abs_diff"] + 1e-3 and all(k["rel"] <= REL_TOL for k in entry["kept"].values()))
        report["cases"][case] = entry
        ok &= entry["ok"]
    report["cache"] = {n: _diff(v, r2["cache"][n]) for n, v in r1["cache"].items()}
    ok &= all(c["rel"] <= REL_TOL for c in report["cache"].values())
    g1, g2 = r1["generated_with_hooks"], r2["generated_with_hooks"]
    report["generated_with_hooks_equal_rows"] = [bool(torch.equal(a, b)) for a, b in zip(g1, g2)]
    a1, a2 = r1["apps"], r2["apps"]
    report["apps"] = {"tokens_equal_rows": [bool(torch.equal(a, b)) for a, b in zip(a1["tokens"], a2["tokens"])],
                      "logits": _diff(a1["logits"], a2["logits"]),
                      "outputs": {app: {k: _diff(v, a2["outputs"][app][k]) for k, v in o.items()}
                                  for app, o in a1["outputs"].items()},
                      "eager_steps_during": {"tp1": a1["eager_steps_during"], "tp2": a2["eager_steps_during"]}}
    ok &= report["apps"]["logits"]["rel"] <= REL_TOL and all(
        d["rel"] <= REL_TOL and d["nan_pattern_equal"] for o in report["apps"]["outputs"].values() for d in o.values())
    ok &= not any(a2["eager_steps_during"]) and not any(a1["eager_steps_during"])
    report["passed"] = bool(ok)
    report["_device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    report["_versions"] = {"torch": torch.__version__, "vllm": __import__("vllm").__version__}
    Path(out).write_text(json.dumps(report, indent=1))
    print(json.dumps({"passed": report["passed"], "no_hooks": plain,
                      "cases": {c: (e["ok"], e["logits"]["rel"]) for c, e in report["cases"].items()},
                      "apps": report["apps"]["eager_steps_during"]}, indent=1))
    return ok


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "make-model":
        make_model(*rest)
    elif command == "run":
        run(rest[0], int(rest[1]), *rest[2:])
    else:
        sys.exit(0 if compare(*rest) else 1)
