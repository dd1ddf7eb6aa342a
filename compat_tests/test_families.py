"""The families beyond Llama and GPT-2 (xmix_lens/families.py), each on a tiny random checkpoint of its
own (tests/tiny_models.py), against TransformerLens's bridge on the same weights: every hook point's
cache, attention patterns, writes at residual, attention and MLP points, generate with a hook, both
padding sides; the seven shipped apps resident in the engine, exported and served.

Each family gets one compiled engine for this module, shut down when it ends (the suite's memory)."""
import importlib
import sys

import pytest
import torch

from compat_tests.reference import TLReference
from compare import PROMPTS, cache_bound, direction, max_diff, real_mask
from tests.test_serving_config import Server, free_port
from tests.test_shipped_apps import assert_resident_equals_per_call, shipped_apps
from tests.tiny_models import (tiny_gemma2, tiny_gemma3, tiny_mistral, tiny_neox, tiny_olmo2, tiny_olmo3, tiny_phi3,
                               tiny_qwen2, tiny_qwen3, tiny_qwen3_moe)
from xmix_lens import HookedServedModel
from xmix_lens.backend.vllm.sites import FAMILY_SITES
from xmix_lens.families import FAMILIES
from xmix_lens.hook_points import is_computed
from xmix_lens.request_choice import APPS_KEY

FAMILY_MODELS = {"qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "mistral": tiny_mistral, "phi3": tiny_phi3,
                 "gemma2": tiny_gemma2, "gemma3": tiny_gemma3, "gpt_neox": tiny_neox, "qwen3_moe": tiny_qwen3_moe,
                 "olmo2": tiny_olmo2, "olmo3": tiny_olmo3}
# Hook points xmix-lens serves that TransformerLens 4.3's bridge lacks for a family (its Phi-3 and GPT-NeoX
# adapters have no rotary hooks; the engine's are the query and key its attention layer gets, after the
# rotary embedding, as on Llama)
BEYOND_TRANSFORMER_LENS = {"phi3": ("attn.hook_rot_q", "attn.hook_rot_k"),
                           "gpt_neox": ("attn.hook_rot_q", "attn.hook_rot_k")}
ATTENTION = ("attn.hook_attn_scores", "attn.hook_pattern")  # [batch, head, query, key]
# Qwen3's, Gemma 3's: [batch, head, pos, d_head], TL's (OLMo 3's, over the whole projection: [batch, pos, d])
HEADS_FIRST = ("attn.hook_q_normed", "attn.hook_k_normed")
# A mixture of experts' router points, [batch, pos, ...] here; TransformerLens's bridge flattens them to
# [batch * pos, ...] (docs/hook-points.md)
ROUTER = ("mlp.gate.hook_out", "mlp.hook_expert_weights", "mlp.hook_expert_indices")
COMPUTED = ATTENTION + HEADS_FIRST + ROUTER[1:]  # the computed points on by default, as TransformerLens's
WRITTEN = ["blocks.0.hook_resid_pre", "blocks.0.attn.hook_q", "blocks.0.attn.hook_v", "blocks.1.attn.hook_z",
           "blocks.0.hook_attn_out", "blocks.1.hook_mlp_out", "blocks.1.hook_resid_post"]


@pytest.fixture(scope="module", params=list(FAMILY_MODELS))
def family(request):
    """(name, the compiled xmix-lens engine, TransformerLens's bridge, the tolerance, the folder): the
    tolerance is 50x the unhooked logit difference at real positions (compare.tolerance's rule)."""
    folder = FAMILY_MODELS[request.param]()
    xl = HookedServedModel.from_pretrained(str(folder), max_model_len=256)
    tl = TLReference(folder)
    tokens = xl.to_tokens(PROMPTS)
    unhooked = max_diff(xl(tokens), tl.run_with_hooks(tokens), real_mask(tl, tokens, "right"))
    try:
        assert unhooked < 5e-5, f"unhooked logits {unhooked:.2g} from TransformerLens's (the tiny models' bound)"
        yield request.param, xl, tl, max(50 * unhooked, 1e-4), folder
    finally:
        xl.shutdown()


def test_the_family_is_served_by_its_own_record(family):
    name, xl, _, _, _ = family
    assert xl.cfg.family == name
    engine_model = xl.engine.llm.llm_engine.model_config
    assert engine_model.hf_config.architectures[0] in FAMILIES[name].architectures
    # the vLLM class of the family's placements (OLMo 2's is OLMo 3's: vLLM's own would be its Transformers backend)
    module, _, vllm_class = FAMILY_SITES[name].model_class.partition(":")
    assert isinstance(xl.engine.runtime.model_runner.model, getattr(importlib.import_module(module), vllm_class))


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_every_hook_point_caches_as_transformer_lens(family, padding_side):
    name, xl, tl, tol, _ = family
    mask = real_mask(tl, tl.to_tokens(PROMPTS, padding_side=padding_side), padding_side)
    served = [n for n in xl.hook_dict if not is_computed(n) or n.endswith(COMPUTED)]
    _, ours = xl.run_with_cache(PROMPTS, names_filter=served, padding_side=padding_side)
    _, theirs = tl.run_with_cache(PROMPTS, names_filter=served, padding_side=padding_side)
    assert set(ours.keys()) == set(served) and len(served) > 15 * xl.cfg.n_layers
    assert {n for n in served if n not in theirs} == {n for n in served if n.endswith(BEYOND_TRANSFORMER_LENS.get(name, ()))}
    for name, value in ours.items():
        if name not in theirs:
            continue
        if name.endswith(ROUTER):
            value, real = value.flatten(0, 1), mask.flatten()
            assert value.shape == theirs[name].shape, name
            if name.endswith("indices"):
                assert torch.equal(value[real], theirs[name][real]), name
            else:
                assert (value - theirs[name]).abs()[real].max() <= cache_bound(theirs[name], real, tol), name
            continue
        assert value.shape == theirs[name].shape, name
        if name.endswith(ATTENTION):  # real queries, real keys
            causal = torch.ones(mask.shape[1], mask.shape[1], dtype=torch.bool).tril()  # scores above it: -inf
            both = mask[:, None, :, None] & mask[:, None, None, :] & causal
            assert (value - theirs[name]).abs()[both.expand_as(value)].max() <= tol, name
        elif name.endswith(HEADS_FIRST) and value.dim() == 4:
            real = mask[:, None, :, None].expand_as(value)
            assert (value - theirs[name]).abs()[real].max() <= cache_bound(theirs[name], real, tol), name
        else:
            assert max_diff(value, theirs[name], mask) <= cache_bound(theirs[name], mask, tol), name


def writes_match(xl, tl, tol, point, padding_side, forms=("steer", "zero_position")):
    mask = real_mask(tl, tl.to_tokens(PROMPTS, padding_side=padding_side), padding_side)
    pos = -1 if padding_side == "left" else 1

    def steer(act, hook):
        return act + 2.0 * direction(act.shape[-1], 1)

    def zero_position(act, hook):
        act[:, pos] = 0.0

    base = xl(PROMPTS, padding_side=padding_side)
    for fn in [{"steer": steer, "zero_position": zero_position}[form] for form in forms]:
        ours = xl.run_with_hooks(PROMPTS, fwd_hooks=[(point, fn)], padding_side=padding_side)
        theirs = tl.run_with_hooks(PROMPTS, fwd_hooks=[(point, fn)], padding_side=padding_side)
        assert max_diff(ours, theirs, mask) < tol, fn.__name__
        assert max_diff(ours, base, mask) > 50 * tol, f"{fn.__name__} did not move the logits"


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("point", WRITTEN)
def test_writes_move_the_logits_as_in_transformer_lens(family, point, padding_side):
    _, xl, tl, tol, _ = family
    writes_match(xl, tl, tol, point, padding_side)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_writes_inside_the_mlp_as_in_transformer_lens(family, padding_side):
    """The MLP's hidden layer, or a mixture of experts' input."""
    name, xl, tl, tol, _ = family
    writes_match(xl, tl, tol, "blocks.1.mlp.hook_in" if FAMILIES[name].moe else "blocks.1.mlp.hook_post",
                 padding_side)


def test_a_write_at_the_router_logits_changes_the_routing(family):
    """TransformerLens 4.3 ignores a write at mlp.gate.hook_out (its router has chosen already); the served
    router chooses from the written logits: the experts it reports are the top-k of them, and the
    logits move."""
    name, xl, tl, _, _ = family
    if not FAMILIES[name].moe:
        with pytest.raises(ValueError, match="not a mixture of experts"):
            xl.run_with_hooks(PROMPTS, fwd_hooks=[("blocks.0.mlp.gate.hook_out", lambda act, hook: act)])
        return
    point, shift = "blocks.0.mlp.gate.hook_out", 3.0 * direction(xl.cfg.num_experts, 4)
    hooks = [(point, lambda act, hook: act + shift)]
    plain_logits, plain = xl.run_with_cache(PROMPTS, names_filter=[point, "blocks.0.mlp.hook_expert_indices"])
    with xl.hooks(fwd_hooks=hooks):
        logits, steered = xl.run_with_cache(PROMPTS, names_filter=[point, "blocks.0.mlp.hook_expert_indices"])
    real = real_mask(tl, tl.to_tokens(PROMPTS), "right")
    torch.testing.assert_close(steered[point][real], plain[point][real] + shift)
    expected = steered[point].float().softmax(-1).topk(xl.cfg.experts_per_token, dim=-1).indices
    assert torch.equal(steered["blocks.0.mlp.hook_expert_indices"][real], expected[real])
    assert not torch.equal(expected[real], plain["blocks.0.mlp.hook_expert_indices"][real])
    assert float((logits - plain_logits).abs().max()) > 0.1
    assert torch.equal(tl.run_with_hooks(PROMPTS, fwd_hooks=hooks), tl.run_with_hooks(PROMPTS))  # TL: ignored


def test_normed_query_and_key_are_read_only_where_the_family_has_them(family):
    name, xl, _, _, _ = family
    point = "blocks.0.attn.hook_q_normed"
    if not FAMILIES[name].qk_norm:
        with pytest.raises(ValueError, match="has no norm on the query and key"):
            xl.run_with_hooks(PROMPTS, fwd_hooks=[(point, lambda act, hook: act)])
        return
    with pytest.raises(NotImplementedError, match="served for reading only: write at attn.hook_rot_q"):
        xl.run_with_hooks(PROMPTS, fwd_hooks=[(point, lambda act, hook: act * 0)])
    assert torch.equal(xl(PROMPTS), xl(PROMPTS))  # the engine serves on


def test_norms_before_attention_and_mlp_are_refused_where_the_family_has_none(family):
    """OLMo 3's blocks have norms after attention and the MLP only: ln1 / ln2 are refused by name, and its
    hook_mlp_in (the residual the MLP reads, shared with the skip connection) is read as TransformerLens's
    and served for reading only."""
    name, xl, tl, tol, _ = family
    if FAMILIES[name].pre_norms:
        return
    for point in ("blocks.0.ln1.hook_normalized", "blocks.1.ln2.hook_scale"):
        with pytest.raises(ValueError, match="has no norm before attention and the MLP"):
            xl.run_with_hooks(PROMPTS, fwd_hooks=[(point, lambda act, hook: act)])
    point, mask = "blocks.1.hook_mlp_in", real_mask(tl, tl.to_tokens(PROMPTS), "right")
    xl.set_use_hook_mlp_in(True)
    tl.bridge.set_use_hook_mlp_in(True)
    try:
        _, ours = xl.run_with_cache(PROMPTS, names_filter=[point])
        _, theirs = tl.run_with_cache(PROMPTS, names_filter=[point])
        assert max_diff(ours[point], theirs[point], mask) <= cache_bound(theirs[point], mask, tol)
        with pytest.raises(NotImplementedError, match=f"hook_mlp_in, which {FAMILIES[name].title} models serve for "
                                                      f"reading only"):
            xl.run_with_hooks(PROMPTS, fwd_hooks=[(point, lambda act, hook: act * 0)])
    finally:
        xl.set_use_hook_mlp_in(False)
        tl.bridge.set_use_hook_mlp_in(False)
    assert torch.equal(xl(PROMPTS), xl(PROMPTS))  # the engine serves on


def test_generate_with_a_hook_gives_transformer_lens_tokens(family):
    _, xl, tl, _, _ = family
    v = 4.0 * direction(xl.cfg.d_model, 2)
    hooks = [("blocks.0.hook_resid_post", lambda act, hook: act + v)]
    tokens = xl.to_tokens("The capital of France is")
    ours = xl.generate(tokens, max_new_tokens=8, do_sample=False, fwd_hooks=hooks)
    with tl.bridge.hooks(fwd_hooks=hooks):
        theirs = tl.bridge.generate(tokens.cpu(), max_new_tokens=8, do_sample=False, use_past_kv_cache=False,
                                    verbose=False)
    plain = xl.generate(tokens, max_new_tokens=8, do_sample=False)
    assert torch.equal(ours.cpu(), theirs)
    assert not torch.equal(ours, plain), "the hook changed no token: the test shows nothing"


def test_the_shipped_apps_are_resident_and_equal_their_hooks(family, tmp_path):
    _, xl, _, _, _ = family
    built = shipped_apps(xl.cfg)
    names = xl.install_config(xl.export(built, tmp_path / "apps"))
    try:
        assert_resident_equals_per_call(xl, built)
    finally:
        for app in names:
            xl.uninstall(app)


def test_the_exported_apps_are_served(family, tmp_path):
    """`xmix-lens serve` with the seven apps exported: a request choosing them gets the in-process
    engine's tokens with the same config installed."""
    _, xl, _, _, folder = family
    config = xl.export(shipped_apps(xl.cfg), tmp_path / "apps")
    port = free_port()
    server = Server([sys.executable, "-m", "xmix_lens.cli", "serve", str(config), "--", str(folder), "--enforce-eager",
                     "--max-model-len", "256", "--port", str(port)], tmp_path / "server.log", port)
    names = xl.install_config(config)
    try:
        assert server.wait_ready(), server.output()[-3000:]
        ids = xl.to_tokens(PROMPTS[0], prepend_bos=False)[0].tolist()
        served = server.complete(str(folder), ids, {APPS_KEY: ",".join(names)})
        ours = xl.generate(torch.tensor([ids]), max_new_tokens=len(served), do_sample=False, stop_at_eos=False,
                           apps=names).result[0, len(ids):].tolist()
        assert served == ours
    finally:
        server.stop()
        for app in names:
            xl.uninstall(app)


def test_an_unsupported_architecture_is_refused_with_the_supported_families(tmp_path):
    import json
    import shutil

    for f in tiny_qwen2().iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError, match=r"FalconForCausalLM is not supported.*Qwen2 \(Qwen2ForCausalLM\)"):
        HookedServedModel.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("build,change,says", [
    (tiny_neox, {"use_parallel_residual": False}, "use_parallel_residual=False: only its parallel blocks"),
    (tiny_qwen3_moe, {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]: blocks with a dense MLP"),
])
def test_a_checkpoint_of_a_kind_the_family_does_not_serve_is_refused(tmp_path, build, change, says):
    import json
    import shutil

    for f in build().iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=says):
        HookedServedModel.from_pretrained(str(tmp_path))
