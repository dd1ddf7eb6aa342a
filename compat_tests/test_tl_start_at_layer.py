"""TransformerLens's start_at_layer tests, run against xmix-lens.

Source: TransformerLensOrg/TransformerLens, tests/integration/test_start_at_layer.py at commit
1de52a75c023e4818766c9e9691a68a31258d8e0 (the stored version; it tests `HookedTransformer`). Each TL
case is kept under its own name and parametrized over the session's tiny Llama and tiny GPT-2.

Changes from the original:
* Model: TL builds a fresh random 3-layer HookedTransformer (d_model 10, vocab 50) per case; here the
  session's 2-layer tiny engines (`served` fixture) are used. Layer indices are moved to keep each
  case's meaning on 2 layers: test_run_with_hooks hooks blocks 0 and 1 (not 0, 1, 2), so 2 of its
  hooks fire rather than 3; test_manual_hooks starts at -(n_layers - 1) (TL: -2 of 3 layers, i.e.
  block 1) and its block-2 hook moves to block 1; "blocks.2.*"/"blocks.3.*" checks are dropped or
  moved to the last block; test_start_and_stop stops at 2 (= n_layers), as TL's 3-layer case did
  before its last block.
* The residual-stream input: TL takes `model.input_to_embed(tokens)[0]`; here it is
  blocks.0.hook_resid_pre from our own run_with_cache on the same tokens (the same tensor: what the
  blocks receive). test_start_at_layer_kwargs still calls input_to_embed, the API it is about.
* hook_pos_embed is asserted present only on GPT-2 (learned positions); Llama has rotary positions
  and no such activation. test_start_at_layer_kwargs: TL's model uses "shortformer" positions (a
  TL-only positional embedding type) so its shortformer_pos_embed is not None; ours are Llama
  (rotary) / GPT-2 (standard), where TL itself returns None for it, so that check is dropped. The
  tokenizer's padding_side is set to "left" as in TL, and put back after the case (the engine is
  shared by the whole session).
* test_start_and_stop keeps HookedTransformer's semantics: with stop_at_layer set (here 2 ==
  n_layers) the forward pass returns the residual stream, not logits (TL 4.3's bridge returns
  logits when stop_at_layer == n_layers; HookedTransformer returns the residual whenever
  stop_at_layer is not None).
"""
import pytest
import torch

MODELS = ["tiny-llama", "tiny-gpt2"]
INPUT = "As soon as this ferry boat docks I'm headed to the church to play bingo."


@pytest.fixture(params=MODELS)
def setup_data(request, served):
    model = served[request.param]
    model.reset_hooks(including_permanent=True)
    rand_input = torch.randint(0, 20, (2, 10), generator=torch.Generator().manual_seed(0))
    _, cache = model.run_with_cache(rand_input, names_filter="blocks.0.hook_resid_pre")
    yield {"model": model, "name": request.param, "rand_input": rand_input,
           "rand_embed": cache["blocks.0.hook_resid_pre"].clone()}
    model.reset_hooks(including_permanent=True)


def has_pos_embed(data):
    return data["name"] == "tiny-gpt2"


def test_start_at_layer_1(setup_data):
    model = setup_data["model"]
    output, cache = model.run_with_cache(setup_data["rand_embed"], start_at_layer=1)
    assert output is not None
    assert "hook_embed" not in cache.keys()
    assert "hook_pos_embed" not in cache.keys()
    assert "blocks.0.hook_resid_pre" not in cache.keys()
    assert "blocks.1.hook_resid_pre" in cache.keys()
    assert "ln_final.hook_normalized" in cache.keys()


def test_run_with_hooks(setup_data):
    model = setup_data["model"]
    fired = []

    def count(act, hook):
        fired.append(hook.name)

    output = model.run_with_hooks(
        input=setup_data["rand_embed"], start_at_layer=1,
        fwd_hooks=[("hook_embed", count), ("blocks.0.attn.hook_k", count),
                   ("blocks.1.attn.hook_k", count), ("blocks.1.mlp.hook_pre", count)])
    assert output is not None
    assert len(fired) == 2


def test_manual_hooks(setup_data):
    model = setup_data["model"]
    n = model.cfg.n_layers
    fired = []

    def count(act, hook):
        fired.append(hook.name)

    model.hook_embed.add_hook(count)
    model.blocks[0].hook_mlp_out.add_hook(count)
    model.blocks[1].hook_resid_mid.add_hook(count)
    model.blocks[n - 1].attn.hook_z.add_hook(count)
    output = model(setup_data["rand_embed"], start_at_layer=-(n - 1))
    assert output is not None
    assert len(fired) == 2


def test_start_at_final(setup_data):
    model = setup_data["model"]
    n = model.cfg.n_layers
    output, cache = model.run_with_cache(setup_data["rand_embed"], start_at_layer=-1)
    assert output is not None
    assert "hook_embed" not in cache.keys()
    assert "hook_pos_embed" not in cache.keys()
    for layer in range(n - 1):
        assert f"blocks.{layer}.hook_resid_pre" not in cache.keys()
        assert f"blocks.{layer}.hook_resid_post" not in cache.keys()
    assert f"blocks.{n - 1}.hook_resid_pre" in cache.keys()
    assert f"blocks.{n - 1}.hook_resid_post" in cache.keys()
    assert f"blocks.{n}.hook_resid_pre" not in cache.keys()
    assert "ln_final.hook_normalized" in cache.keys()


def _assert_all_layers_cached(data, cache):
    assert "hook_embed" in cache.keys()
    if has_pos_embed(data):
        assert "hook_pos_embed" in cache.keys()
    for layer in range(data["model"].cfg.n_layers):
        assert f"blocks.{layer}.hook_resid_pre" in cache.keys()
        assert f"blocks.{layer}.hook_resid_post" in cache.keys()
    assert "ln_final.hook_normalized" in cache.keys()


def test_no_start_logit_output(setup_data):
    model = setup_data["model"]
    output, cache = model.run_with_cache(setup_data["rand_input"], start_at_layer=None)
    assert output is not None
    assert isinstance(output, torch.Tensor)
    assert output.shape == (2, 10, model.cfg.d_vocab)
    _assert_all_layers_cached(setup_data, cache)


def test_no_start_none_output(setup_data):
    model = setup_data["model"]
    output, cache = model.run_with_cache(setup_data["rand_input"], start_at_layer=None, return_type=None)
    assert output is None
    _assert_all_layers_cached(setup_data, cache)


def test_start_and_stop(setup_data):
    model = setup_data["model"]
    output, cache = model.run_with_cache(setup_data["rand_embed"], start_at_layer=1, stop_at_layer=2)
    assert torch.allclose(output, cache["blocks.1.hook_resid_post"])
    assert "hook_embed" not in cache.keys()
    assert "hook_pos_embed" not in cache.keys()
    assert "blocks.0.hook_resid_pre" not in cache.keys()
    assert "blocks.0.hook_resid_post" not in cache.keys()
    assert "blocks.1.hook_resid_pre" in cache.keys()
    assert "blocks.1.hook_resid_post" in cache.keys()
    assert "blocks.2.hook_resid_pre" not in cache.keys()
    assert "ln_final.hook_normalized" not in cache.keys()


def test_start_at_layer_kwargs(setup_data):
    model = setup_data["model"]
    side = model.tokenizer.padding_side
    model.tokenizer.padding_side = "left"  # as TL does; put back below (the engine is shared)
    try:
        resid, tokens, shortformer_pos_embed, attention_mask = model.input_to_embed(INPUT)
        assert tokens is not None and attention_mask is not None
        from_layer_0 = model(resid, tokens=tokens, shortformer_pos_embed=shortformer_pos_embed,
                             attention_mask=attention_mask, start_at_layer=0, return_type="loss")
        normal = model(INPUT, return_type="loss")
    finally:
        model.tokenizer.padding_side = side
    assert from_layer_0 is not None and normal is not None
    assert torch.allclose(torch.as_tensor(from_layer_0), torch.as_tensor(normal))
