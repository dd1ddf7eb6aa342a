"""Serving behaviour under the hooks: prefix caching stays on without leaking KV across hooks,
and chunked prefill neither loses nor duplicates reads."""
import pytest
import torch

from xmix_lens import HookedServedModel, store
from tests.tiny_models import tiny_llama

MODEL = "tiny-llama"
PROMPT = "The quick brown fox jumps over the lazy dog and then runs far away into the woods"
# vLLM's CPU backend caches KV in blocks of 128 tokens: only a prompt past a full block can hit
LONG_PROMPT = " ".join([PROMPT] * 9)


def steer(scale: float, d_model: int):
    v = torch.randn(d_model, generator=torch.Generator().manual_seed(11))

    def hook(act, hook):
        return act + scale * v

    return [("blocks.0.hook_resid_post", hook)]


def test_prefix_cache_is_shared_only_under_the_same_writes(served):
    model = served[MODEL]
    d = model.cfg.d_model
    assert model.to_tokens(LONG_PROMPT).shape[1] > model.engine.llm.llm_engine.vllm_config.cache_config.block_size
    first = model.generate(LONG_PROMPT, max_new_tokens=4, do_sample=False, fwd_hooks=steer(2.0, d))
    again = model.generate(LONG_PROMPT, max_new_tokens=4, do_sample=False, fwd_hooks=steer(2.0, d))
    assert again == first
    assert model.last_run_stats["cached_tokens"] > 0  # same hooks and parameters: KV reused
    other = model.generate(LONG_PROMPT, max_new_tokens=4, do_sample=False, fwd_hooks=steer(-2.0, d))
    assert model.last_run_stats["cached_tokens"] == 0  # other parameters: nothing reused
    plain = model.generate(LONG_PROMPT, max_new_tokens=4, do_sample=False)
    assert model.last_run_stats["cached_tokens"] == 0  # KV computed under writes never serves plain requests
    assert len({first, other, plain}) == 3


def test_reads_see_every_position_even_when_cached(served):
    model = served[MODEL]
    model.generate(LONG_PROMPT, max_new_tokens=2, do_sample=False)
    model.generate(LONG_PROMPT, max_new_tokens=2, do_sample=False)
    assert model.last_run_stats["cached_tokens"] > 0  # plain requests do share the prefix cache
    logits, cache = model.run_with_cache(LONG_PROMPT, names_filter="blocks.1.hook_resid_post")
    assert model.last_run_stats["cached_tokens"] == 0
    assert bool((cache["blocks.1.hook_resid_post"][0].abs().sum(-1) > 0).all())


def eager_tiny_llama(**engine_kwargs) -> HookedServedModel:
    """A small eager engine (seconds to start) with the scheduling limits a test needs."""
    return HookedServedModel.from_pretrained(str(tiny_llama()), enforce_eager=True, max_num_seqs=4, **engine_kwargs)


@pytest.fixture(scope="module")
def chunked():
    """An eager engine whose steps hold at most 16 tokens: longer prompts are prefilled in chunks."""
    model = eager_tiny_llama(max_model_len=128, max_num_batched_tokens=16)
    yield model
    model.shutdown()  # frees its KV cache now: an engine left running lives until the session ends


def test_chunked_prefill_loses_and_duplicates_no_reads(served, chunked):
    reference = served[MODEL]
    prompts = [PROMPT, PROMPT + " again and again", "Short one"]
    steps = []
    begin = chunked.engine.runtime.begin_step

    def counting(positions):
        steps.append(positions.shape[0])
        begin(positions)

    chunked.engine.runtime.begin_step = counting
    try:
        ours, cache = chunked.run_with_cache(prompts)
    finally:
        del chunked.engine.runtime.begin_step
    lengths = [len(chunked.to_tokens(p)[0]) for p in prompts]
    # prompts spread over several steps of at most 16 tokens, each token computed once
    assert max(steps) <= 16 and len(steps) >= 3 and sum(steps) == sum(lengths)
    theirs, full = reference.run_with_cache(prompts)
    for i, n in enumerate(lengths):
        assert (ours[i, :n] - theirs[i, :n]).abs().max() < 1e-4
        for name in ("blocks.0.hook_resid_pre", "blocks.1.hook_mlp_out", "ln_final.hook_normalized"):
            assert (cache[name][i, :n] - full[name][i, :n]).abs().max() < 1e-4, name


def test_chunked_prefill_writes_and_per_token_stores(served, chunked):
    reference = served[MODEL]
    w = torch.randn(chunked.cfg.d_model, generator=torch.Generator().manual_seed(5))
    v = torch.randn(chunked.cfg.d_model, generator=torch.Generator().manual_seed(6))

    def hooks():
        ctx = {}
        return [("blocks.0.hook_resid_post", lambda act, hook: ctx.update(s=act @ w)),
                ("blocks.1.hook_resid_pre", lambda act, hook: act + torch.tanh(ctx["s"])[..., None] * v)]

    ours = chunked.run_with_hooks([PROMPT, PROMPT + " and more"], fwd_hooks=hooks())
    theirs = reference.run_with_hooks([PROMPT, PROMPT + " and more"], fwd_hooks=hooks())
    n0 = len(chunked.to_tokens(PROMPT)[0])
    assert (ours[0, :n0] - theirs[0, :n0]).abs().max() < 1e-4
    assert (ours[1] - theirs[1]).abs().max() < 1e-4


@pytest.fixture(scope="module")
def cramped():
    """An eager engine with KV room for about one long request at a time: vLLM preempts
    (and later recomputes) requests as they grow."""
    model = eager_tiny_llama(max_model_len=256, num_gpu_blocks_override=4)
    yield model
    model.shutdown()


def test_preemption_neither_loses_nor_duplicates(served, cramped):
    reference = served[MODEL]
    w = torch.randn(cramped.cfg.d_model, generator=torch.Generator().manual_seed(8))
    v = 4.0 * torch.randn(cramped.cfg.d_model, generator=torch.Generator().manual_seed(9))
    prompts = [" ".join([PROMPT] * 6), " ".join([PROMPT] * 5) + " indeed", " ".join([PROMPT] * 6) + " yes",
               " ".join([PROMPT] * 5)]

    def hooks():
        def probe(act, hook):
            store.put("cond", act @ w, reduce="mean")

        def gate(act, hook):
            return act + torch.tanh(store.get("cond"))[..., None] * v

        return [("blocks.0.hook_resid_post", probe), ("blocks.1.hook_resid_pre", gate)]

    seen = []
    begin = cramped.engine.runtime.begin_step

    def recording(positions):
        begin(positions)
        if cramped.engine.runtime.step is not None:
            step = cramped.engine.runtime.step
            seen.extend(zip(step.row.tolist(), step.decode.tolist(), positions.tolist()))

    cramped.engine.runtime.begin_step = recording
    try:
        ours = cramped.generate(prompts, max_new_tokens=120, do_sample=False, return_type="tokens", fwd_hooks=hooks())
    finally:
        del cramped.engine.runtime.begin_step
    assert len(seen) > len(set(seen)), "no position was computed twice: the engine did not preempt"
    alone = [reference.generate(p, max_new_tokens=120, do_sample=False, return_type="tokens", fwd_hooks=hooks())[0]
             for p in prompts]
    lengths = [cramped.to_tokens(p).shape[1] for p in prompts]
    for row, length, expected in zip(ours, lengths, alone):  # a batch comes back left-padded, as from TL
        assert torch.equal(row[max(lengths) - length:][: len(expected)], expected)
