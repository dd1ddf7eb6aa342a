"""Tests of xmix_lens.model_files (embedded SmolLM2, cache, build-once) and tests/tiny_models.py:
model folders that load offline in transformers and TransformerLens.

The first run converts SmolLM2 from GGUF into the user cache (about 30 s); later runs reuse it.
"""

import os

# Everything here is local; fail instead of reaching for a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests import tiny_models
from xmix_lens import model_files

PROMPTS = ["The capital of France is", "Hello world, how are you"]


def load_hf(folder: Path):
    # TransformerLens forces eager attention; sdpa would differ from it by ~1e-3 in fp32.
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return AutoTokenizer.from_pretrained(folder), model.eval()


def prompt_tokens(tokenizer) -> torch.Tensor:
    """The prompts' tokens, cut to a common length so that the batch needs no padding."""
    ids = [tokenizer(prompt).input_ids for prompt in PROMPTS]
    length = min(len(row) for row in ids)
    return torch.tensor([row[:length] for row in ids])


# ---------------------------------------------------------------------------- cache_dir


def test_cache_dir_prefers_xmix_lens_cache_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("XMIX_LENS_CACHE", str(tmp_path / "own"))
    assert model_files.cache_dir() == tmp_path / "own"
    monkeypatch.delenv("XMIX_LENS_CACHE")
    assert model_files.cache_dir() == tmp_path / "xdg" / "xmix-lens"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert model_files.cache_dir() == tmp_path / "home" / ".cache" / "xmix-lens"


# ---------------------------------------------------------------------------- resolve_model


def test_resolve_model_explains_an_unknown_name():
    with pytest.raises(ValueError) as error:
        model_files.resolve_model("gpt2-xl")
    message = str(error.value)
    assert "'gpt2-xl'" in message
    assert "smollm2-135m" in message  # the embedded names
    assert "local folder" in message
    assert "never fetches" in message


def test_resolve_model_explains_a_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        model_files.resolve_model(str(tmp_path))


def test_resolve_model_returns_a_local_folder_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert model_files.resolve_model(str(tmp_path)) == tmp_path


@pytest.mark.parametrize(
    "name", ["smollm2-135m", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"]
)
def test_resolve_model_finds_embedded_smollm2(name):
    assert model_files.resolve_model(name) == model_files.ensure_smollm2()


# ---------------------------------------------------------------------------- SmolLM2


def test_smollm2_folder_keeps_the_gguf_architecture():
    config = json.loads((model_files.ensure_smollm2() / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True  # as in the GGUF file
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)


def test_smollm2_knows_the_capital_of_france():
    tokenizer, model = load_hf(model_files.ensure_smollm2())
    # Plain text, no chat template: the model must be the trained one, not random weights.
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, ids.shape[1]:])


# ---------------------------------------------------------------------------- tiny models

TINY_BUILDERS = [tiny_models.tiny_llama, tiny_models.tiny_gpt2, tiny_models.tiny_qwen2, tiny_models.tiny_qwen3,
                 tiny_models.tiny_mistral, tiny_models.tiny_phi3, tiny_models.tiny_gemma2, tiny_models.tiny_neox,
                 tiny_models.tiny_qwen3_moe, tiny_models.tiny_gemma3]


@pytest.mark.parametrize("build", TINY_BUILDERS)
def test_tiny_model_is_rebuilt_byte_for_byte_from_its_seed(build, monkeypatch, tmp_path):
    cached = build()
    # Build again from scratch in an empty cache; tiny_llama takes its tokenizer from the
    # converted SmolLM2, which is linked in rather than converted again.
    (tmp_path / "smollm2-135m-instruct").symlink_to(model_files.ensure_smollm2())
    monkeypatch.setenv("XMIX_LENS_CACHE", str(tmp_path))
    rebuilt = build()
    assert rebuilt != cached
    for name in ["model.safetensors", "config.json", "tokenizer.json"]:
        assert (rebuilt / name).read_bytes() == (cached / name).read_bytes(), name


@pytest.mark.parametrize("build", TINY_BUILDERS)
def test_tiny_model_differs_for_another_seed(build):
    weights = load_file(build() / "model.safetensors")
    other = load_file(build(seed=1) / "model.safetensors")
    assert weights.keys() == other.keys()
    assert all(not torch.equal(weights[name], other[name]) for name in weights)


@pytest.mark.parametrize("build", TINY_BUILDERS)
def test_tiny_model_logits_spread_and_depend_on_the_prompt(build):
    tokenizer, model = load_hf(build())
    with torch.no_grad():
        logits = model(prompt_tokens(tokenizer)).logits
    assert logits.std(dim=-1).min() > 0.5
    assert (logits[0] - logits[1]).abs().mean() > 0.5


def test_tiny_models_have_the_requested_shapes():
    llama = json.loads((tiny_models.tiny_llama() / "config.json").read_text())
    assert (llama["hidden_size"], llama["num_hidden_layers"], llama["head_dim"]) == (128, 2, 32)
    assert (llama["num_attention_heads"], llama["num_key_value_heads"]) == (4, 2)
    assert (llama["vocab_size"], llama["tie_word_embeddings"]) == (49152, False)
    gpt2 = json.loads((tiny_models.tiny_gpt2() / "config.json").read_text())
    assert (gpt2["n_embd"], gpt2["n_layer"], gpt2["n_head"], gpt2["n_inner"]) == (128, 2, 4, 512)
    assert gpt2["vocab_size"] == 50257


def test_tiny_gpt2_has_gpt2s_tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(tiny_models.tiny_gpt2())
    assert tokenizer("Hello world").input_ids == [15496, 995]
    assert tokenizer.pad_token == tokenizer.eos_token == "<|endoftext|>"


# ---------------------------------------------------------------------------- TransformerLens


@pytest.mark.parametrize("build", [tiny_models.tiny_llama, tiny_models.tiny_gpt2, model_files.ensure_smollm2])
def test_transformer_lens_boots_the_folder_with_hf_logits(build):
    from transformer_lens.model_bridge import TransformerBridge

    folder = build()
    tokenizer, model = load_hf(folder)
    bridge = TransformerBridge.boot_transformers(str(folder), device="cpu")
    bridge.enable_compatibility_mode(no_processing=True)
    # Token ids, not text: TransformerLens would prepend a BOS token that the HF tokenizer
    # does not add.
    tokens = prompt_tokens(tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(bridge(tokens), model(tokens).logits, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------- concurrency


def test_racing_builders_leave_one_finished_folder(tmp_path):
    target = tmp_path / "model"
    both_building = threading.Barrier(2)
    results = []

    def build(folder: Path) -> None:
        (folder / "writer.txt").write_text(threading.current_thread().name)
        both_building.wait()  # neither renames before the other has started

    threads = [
        threading.Thread(target=lambda: results.append(model_files._build_once(target, build)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [target, target]
    assert (target / model_files.FINISHED_MARKER).is_file()
    assert (target / "writer.txt").read_text() in {thread.name for thread in threads}
    assert [path.name for path in tmp_path.iterdir()] == ["model"]  # no temporary folders left
