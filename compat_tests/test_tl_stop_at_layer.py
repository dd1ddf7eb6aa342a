"""TransformerLens's stop_at_layer tests, run against xmix-lens.

Source: TransformerLensOrg/TransformerLens, tests/integration/test_stop_at_layer.py at commit
1a81f6df4fe9366f71ea569e45f580718e51daa4 (the stored version; it tests `HookedTransformer`). Each TL
case is kept under its own name and parametrized over the session's tiny Llama and tiny GPT-2.

Changes from the original:
* Model: TL builds a fresh random HookedTransformer per case (3 layers; 4 in test_stop_at_final;
  d_model 10, vocab 50); here the session's 2-layer tiny engines (`served` fixture). Input: the
  same shape of random token ids (2 x 10, ids < 20), from a fixed seed.
* Layer indices moved to keep each case's meaning on 2 layers: test_stop_at_final's stop_at_layer=-1
  ends after block n_layers - 2 (TL: blocks.2 of 4; here blocks.0), and the checks on later blocks
  follow n_layers; test_manual_hooks (TL: stop at -1 of 3 layers, hooks on embed, block 0, block 1
  and block 2, three firing) hooks embed, blocks[0].hook_mlp_out, blocks[0].hook_resid_mid and
  blocks[1].attn.hook_z, so three fire before the stop as in TL, and compares with
  blocks.{n_layers - 2}.hook_resid_post.
* hook_pos_embed is asserted present only on GPT-2 (learned positions); Llama has rotary positions
  and no such activation.
"""
import pytest
import torch

MODELS = ["tiny-llama", "tiny-gpt2"]


@pytest.fixture(params=MODELS)
def setup(request, served):
    model = served[request.param]
    model.reset_hooks(including_permanent=True)
    rand_input = torch.randint(0, 20, (2, 10), generator=torch.Generator().manual_seed(0))
    yield model, rand_input, request.param == "tiny-gpt2"
    model.reset_hooks(including_permanent=True)


def _check_embeds(cache, gpt2):
    assert "hook_embed" in cache.keys()
    if gpt2:
        assert "hook_pos_embed" in cache.keys()


def test_stop_at_embed(setup):
    model, rand_input, gpt2 = setup
    _, normal_cache = model.run_with_cache(rand_input)
    output, cache = model.run_with_cache(rand_input, stop_at_layer=0)
    assert torch.allclose(output, normal_cache["blocks.0.hook_resid_pre"])
    _check_embeds(cache, gpt2)
    assert "blocks.0.hook_resid_pre" not in cache.keys()
    assert "ln_final.hook_normalized" not in cache.keys()


def test_run_with_hooks(setup):
    model, rand_input, _ = setup
    fired = []

    def count(act, hook):
        fired.append(hook.name)

    output = model.run_with_hooks(rand_input, stop_at_layer=1, fwd_hooks=[
        ("hook_embed", count), ("blocks.0.attn.hook_k", count), ("blocks.1.mlp.hook_pre", count)])
    _, normal_cache = model.run_with_cache(rand_input, stop_at_layer=1)
    assert torch.allclose(output, normal_cache["blocks.0.hook_resid_post"])
    assert len(fired) == 2


def test_manual_hooks(setup):
    model, rand_input, _ = setup
    n = model.cfg.n_layers
    _, normal_cache = model.run_with_cache(rand_input)
    fired = []

    def count(act, hook):
        fired.append(hook.name)

    model.hook_embed.add_hook(count)
    model.blocks[0].hook_mlp_out.add_hook(count)
    model.blocks[n - 2].hook_resid_mid.add_hook(count)
    model.blocks[n - 1].attn.hook_z.add_hook(count)
    output = model(rand_input, stop_at_layer=-1)
    assert torch.allclose(output, normal_cache[f"blocks.{n - 2}.hook_resid_post"])
    assert len(fired) == 3


def test_stop_at_layer_1(setup):
    model, rand_input, gpt2 = setup
    _, normal_cache = model.run_with_cache(rand_input)
    output, cache = model.run_with_cache(rand_input, stop_at_layer=1)
    assert torch.allclose(output, normal_cache["blocks.0.hook_resid_post"])
    _check_embeds(cache, gpt2)
    assert "blocks.0.hook_resid_pre" in cache.keys()
    assert "blocks.0.hook_resid_post" in cache.keys()
    assert "blocks.1.hook_resid_pre" not in cache.keys()
    assert "ln_final.hook_normalized" not in cache.keys()
    for key in cache.keys():
        assert key.startswith("blocks.0") or key in ("hook_embed", "hook_pos_embed"), f"unexpected key {key}"


def test_stop_at_final(setup):
    model, rand_input, gpt2 = setup
    n = model.cfg.n_layers
    _, normal_cache = model.run_with_cache(rand_input)
    output, cache = model.run_with_cache(rand_input, stop_at_layer=-1)
    assert torch.allclose(output, normal_cache[f"blocks.{n - 2}.hook_resid_post"])
    _check_embeds(cache, gpt2)
    for layer in range(n - 1):
        assert f"blocks.{layer}.hook_resid_pre" in cache.keys()
        assert f"blocks.{layer}.hook_resid_post" in cache.keys()
    assert f"blocks.{n - 1}.hook_resid_pre" not in cache.keys()
    assert "ln_final.hook_normalized" not in cache.keys()


def _check_all_layers(model, cache, gpt2):
    _check_embeds(cache, gpt2)
    for layer in range(model.cfg.n_layers):
        assert f"blocks.{layer}.hook_resid_pre" in cache.keys()
        assert f"blocks.{layer}.hook_resid_post" in cache.keys()
    assert "ln_final.hook_normalized" in cache.keys()


def test_no_stop_logit_output(setup):
    model, rand_input, gpt2 = setup
    normal_output = model(rand_input)
    output, cache = model.run_with_cache(rand_input, stop_at_layer=None)
    assert torch.allclose(output, normal_output)
    assert isinstance(output, torch.Tensor)
    assert output.shape == (2, 10, model.cfg.d_vocab)
    _check_all_layers(model, cache, gpt2)


def test_no_stop_no_output(setup):
    model, rand_input, gpt2 = setup
    output, cache = model.run_with_cache(rand_input, stop_at_layer=None, return_type=None)
    assert output is None
    _check_all_layers(model, cache, gpt2)
