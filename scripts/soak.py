"""Soak test: many randomized calls from two threads, each result compared with the same call run
alone on a fresh prefix cache.

    .venv/bin/python -m scripts.soak --requests 10000 --out bench/results/2026-11-30-soak.json

Calls mix plain forward passes, per-call hooks (steering, position writes, reads), run_batch, apps
chosen per row (resident and traced), generate, identical and long prompts (prefix caching stays
on), hooks that write NaN (NonFiniteError expected) and hooks that raise. A request is one row of a
call. The reference is each call alone, after `reset_prefix_cache()`, before the soak; the soak runs
the same calls in a shuffled order from two threads. A mismatch is a call whose logits differ by
more than TOL, whose tokens or app reads differ, or whose outcome (value or error type) differs.
tests/test_soak.py runs a 500-request version in CI.
"""
import argparse
import json
import queue
import random
import threading
import time

import torch

from xmix_lens import App, NonFiniteError

TOL = 1e-3  # a prefix-cache hit computes the prompt in two pieces: logits move by float rounding
WORDS = "the cat sat on a mat while one two three quick brown foxes jump over lazy dogs far away".split()
SITES = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_pre", "blocks.0.mlp.hook_post"]


class RaisedByHook(Exception):
    pass


def prompts(rng: random.Random, n: int) -> list[str]:
    """A pool with repeats and long prompts (past one 128-token KV block, so that the prefix cache hits)."""
    pool = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20))) for _ in range(12)]
    pool += [" ".join(WORDS * 9)[: rng.randint(500, 700)] for _ in range(3)]
    return [rng.choice(pool) for _ in range(n)]


def install_apps(model) -> list[str]:
    d = model.cfg.d_model
    g = torch.Generator().manual_seed(5)
    v, w = 3 * torch.randn(d, generator=g), torch.randn(d, generator=g)
    steer = App("soak-steer", fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act + v)])
    probe = App("soak-probe")
    probe.fwd_hooks = [("blocks.1.hook_resid_post", lambda act, hook: probe.outputs.update(score=act @ w))]
    last = App("soak-last")  # selects a position: traced into each call, not resident
    last.fwd_hooks = [("blocks.1.hook_resid_post", lambda act, hook: last.outputs.update(last=act[:, -1] @ w))]
    for app in (steer, probe, last):
        model.install(app)
    return [app.name for app in (steer, probe, last)]


def make_call(rng: random.Random, model, apps: list[str]):
    """(kind, rows, run): run(model) gives the call's values, to compare."""
    kind = rng.choice(["plain", "hooks", "hooks", "cache", "batch", "apps", "generate", "generate", "nan", "raise"])
    rows = prompts(rng, rng.randint(1, 4))
    site, k, coef, side = rng.choice(SITES), rng.randint(1, 6), rng.uniform(-4, 4), rng.choice(["left", "right"])
    v = torch.randn(model.feature_shapes[site], generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))

    def steer(act, hook):
        return act + coef * v

    def first_k(act, hook):
        act[:, :k] += coef

    if kind == "plain":
        return kind, len(rows), lambda m: [m(rows, padding_side=side)]
    if kind == "hooks":
        hooks = [(site, steer), ("blocks.1.hook_resid_post", first_k)]
        return kind, len(rows), lambda m: [m.run_with_hooks(rows, fwd_hooks=hooks, padding_side=side)]
    if kind == "cache":
        def run(m):
            logits, cache = m.run_with_cache(rows, names_filter=site, padding_side=side)
            return [logits, cache[site]]
        return kind, len(rows), run
    if kind == "batch":
        other = prompts(rng, rng.randint(1, 3))
        return kind, len(rows) + len(other), lambda m: m.run_batch([(rows, [(site, steer)]), (other, [])])
    if kind == "apps":
        selection = [rng.sample(apps, rng.randint(0, len(apps))) for _ in rows]

        def run(m):
            out = m.run_with_hooks(rows, apps=selection)
            if not hasattr(out, "outputs"):  # no row chose an app
                return [out]
            return [out.result] + [value for name in sorted(out.outputs) for _, value in sorted(out.outputs[name].items())]
        return kind, len(rows), run
    if kind == "generate":
        hooks = [(site, steer)] if rng.random() < 0.5 else []
        return kind, len(rows), lambda m: [m.generate(rows, max_new_tokens=4, do_sample=False, return_type="tokens",
                                                      padding_side=side, fwd_hooks=hooks)]
    if kind == "nan":
        return kind, len(rows), lambda m: [m.run_with_hooks(rows, fwd_hooks=[(site, lambda act, hook: act / 0.0)])]

    def raising(act, hook):
        raise RaisedByHook("a hook that raises")

    return kind, len(rows), lambda m: [m.run_with_hooks(rows, fwd_hooks=[(site, raising)])]


EXPECTED = {"nan": "NonFiniteError", "raise": "error"}  # other kinds: "ok"


def outcome(model, run):
    """("ok", values) or (the error's type name, None). Logits are kept as their first VOCAB_KEPT
    entries and their argmax (a call's full logits are tens of MB; a leak or a poisoned cache
    changes every entry)."""
    try:
        return "ok", [kept(t) for value in run(model) for t in kept_parts(value)]
    except Exception as e:  # noqa: BLE001 (compared like any outcome)
        return type(e).__name__, None


VOCAB_KEPT = 64


def kept_parts(t: torch.Tensor) -> list[torch.Tensor]:
    if t.is_floating_point() and t.dim() == 3 and t.shape[-1] > 4 * VOCAB_KEPT:  # logits [batch, pos, vocab]
        return [t[..., :VOCAB_KEPT], t.argmax(-1)]
    return [t]


def kept(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def as_expected(kind: str, status: str) -> bool:
    want = EXPECTED.get(kind, "ok")
    return status == want or want == "error" and status != "ok"


def same(a, b) -> bool:
    if a[0] != b[0]:
        return False
    if a[1] is None:
        return True
    return len(a[1]) == len(b[1]) and all(
        x.shape == y.shape and (torch.equal(x, y) if not x.is_floating_point() else _close(x, y))
        for x, y in zip(a[1], b[1]))


def _close(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Within TOL, NaN where both are NaN (rows without an app read NaN)."""
    return bool((((x - y).abs() <= TOL) | (x.isnan() & y.isnan())).all())


def soak(model, requests: int, seed: int = 0, threads: int = 2) -> dict:
    rng = random.Random(seed)
    apps = install_apps(model)
    try:
        calls, kinds, count = [], [], 0
        while count < requests:
            kind, rows, run = make_call(rng, model, apps)
            calls.append(run)
            kinds.append(kind)
            count += rows
        start = time.time()
        reference = []
        for run in calls:
            model.engine.llm.reset_prefix_cache()
            reference.append(outcome(model, run))
        reference_s = time.time() - start
        order = list(range(len(calls)))
        rng.shuffle(order)
        todo, results = queue.Queue(), {}
        for i in order:
            todo.put(i)

        def worker():
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                results[i] = outcome(model, calls[i])

        start = time.time()
        workers = [threading.Thread(target=worker) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        soak_s = time.time() - start
    finally:
        for name in apps:
            model.uninstall(name)
    mismatches = [i for i in range(len(calls)) if not same(results[i], reference[i])]
    unexpected = [i for i in range(len(calls)) if not as_expected(kinds[i], reference[i][0])]
    counts = {}
    for kind, (status, _) in zip(kinds, reference):
        counts[f"{kind}: {status}"] = counts.get(f"{kind}: {status}", 0) + 1
    return {"requests": count, "calls": len(calls), "threads": threads, "mismatches": len(mismatches),
            "mismatched_calls": [(i, kinds[i], reference[i][0], results[i][0]) for i in mismatches[:10]],
            "unexpected_outcomes": len(unexpected),
            "unexpected_calls": [(i, kinds[i], reference[i][0]) for i in unexpected[:10]],
            "outcomes": counts, "reference_s": round(reference_s, 1), "soak_s": round(soak_s, 1)}


def main() -> None:
    from xmix_lens import HookedServedModel
    from tests.tiny_models import tiny_llama

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = HookedServedModel.from_pretrained(str(tiny_llama()), max_model_len=256)
    summary = soak(model, args.requests, args.seed)
    summary = {"command": f".venv/bin/python -m scripts.soak --requests {args.requests} --seed {args.seed}",
               "model": "tiny random Llama (tests/tiny_models.py), compiled CPU engine, prefix caching on",
               **summary}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
