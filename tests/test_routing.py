"""Per-request routing: many passes with different hooks (and none) in one engine at once.

Every request's logits must equal running it alone with its pass's hooks. The hooks move logits
far beyond the tolerance, so a token routed to another request's hooks shows; a test-only switch
that shifts the routing by one request proves that the check catches it."""
import random

import torch

MODEL = "tiny-llama"
TOL = 1e-4


def hook_sets(d_model: int, seed: int) -> list[list]:
    g = torch.Generator().manual_seed(seed)
    v, d = torch.randn(d_model, generator=g) * 3, torch.randn(d_model, generator=g)
    d = d / d.norm()
    return [
        [],
        [("blocks.0.hook_resid_post", lambda act, hook: act + v)],
        [("blocks.1.hook_resid_pre", lambda act, hook: act - (act @ d)[..., None] * d * 4.0)],
        [("blocks.0.hook_mlp_out", lambda act, hook: act * -2.0)],
        [("blocks.1.attn.hook_z", lambda act, hook: act.__setitem__((slice(None), slice(None), 1), 0.0)),
         ("ln_final.hook_normalized", lambda act, hook: act + torch.relu(act @ d)[..., None] * v)],
        [("blocks.0.hook_resid_post", lambda act, hook: act.__setitem__((slice(None), -1), act[:, -1] * 3.0))],
    ]


def mixed_workload(d_model: int, n_requests: int, seed: int):
    """Passes of 1-12 random prompts (2-12 tokens: the thousand requests' fp32 logits over the whole
    vocabulary are held at once; with up to 24 tokens this file peaked at 5.6 GB resident, the
    suite's peak, against 3.3 GB now), each pass with one of the hook sets."""
    rng = random.Random(seed)
    sets = hook_sets(d_model, seed)
    passes, total = [], 0
    while total < n_requests:
        n = min(rng.randint(1, 12), n_requests - total)
        rows = [[rng.randrange(3, 40000) for _ in range(rng.randint(2, 12))] for _ in range(n)]
        passes.append((rows, sets[rng.randrange(len(sets))]))
        total += n
    return passes


def alone(model, row: list[int], width: int, hooks) -> torch.Tensor:
    """The request run by itself, in the same padded layout as in its pass (act[:, -1] is the
    pass's last padded position, as in TransformerLens)."""
    tokens = torch.zeros(1, width, dtype=torch.long)
    mask = torch.zeros(1, width, dtype=torch.long)
    tokens[0, : len(row)], mask[0, : len(row)] = torch.tensor(row), 1
    return model.run_with_hooks(tokens, fwd_hooks=hooks, attention_mask=mask)[0, : len(row)]


def count_leaks(model, passes, together, sample: int = 100) -> int:
    """Requests whose logits, served together, differ from their pass served alone; and, for a
    random sample of requests, from the request served alone."""
    leaks = 0
    for (rows, hooks), logits in zip(passes, together):
        by_itself = model.run_with_hooks(rows, fwd_hooks=hooks)
        for i, row in enumerate(rows):
            leaks += int((logits[i, : len(row)] - by_itself[i, : len(row)]).abs().max() > TOL)
    everyone = [(p, i) for p, (rows, _) in enumerate(passes) for i in range(len(rows))]
    for p, i in random.Random(0).sample(everyone, min(sample, len(everyone))):
        rows, hooks = passes[p]
        width = max(len(r) for r in rows)
        leaks += int((together[p][i, : len(rows[i])] - alone(model, rows[i], width, hooks)).abs().max() > TOL)
    return leaks


def test_thousand_mixed_requests_are_isolated(served):
    model = served[MODEL]
    passes = mixed_workload(model.cfg.d_model, 1000, seed=1234)
    assert sum(len(rows) for rows, _ in passes) == 1000
    assert count_leaks(model, passes, model.run_batch(passes)) == 0


def test_shifted_routing_is_caught(served, monkeypatch):
    """Each request's tokens routed as the next request's: the isolation check must see it."""
    from xmix_lens.backend.vllm import runtime

    model = served[MODEL]
    passes = mixed_workload(model.cfg.d_model, 60, seed=99)
    step_requests = runtime.adapter.step_requests

    def shifted(runner):
        req_ids, query_start = step_requests(runner)
        return req_ids[1:] + req_ids[:1], query_start

    monkeypatch.setattr(runtime.adapter, "step_requests", shifted)
    together = model.run_batch(passes)
    monkeypatch.undo()
    assert count_leaks(model, passes, together) > 5
