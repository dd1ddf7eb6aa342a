"""TransformerLens's own objects for a served model, so that a TransformerLens user's code runs
unchanged on it (API layer; the only module besides cache.py that imports transformer_lens).

- `bridge_config`: `model.cfg`, a `transformer_lens.config.TransformerBridgeConfig` built from the
  HF config by TransformerLens's own translation (no weights loaded), as `boot_transformers` builds it.
- `load_tokenizer`: the tokenizer as TransformerLens sets it up (`encode` adds BOS where its does).
- `boot_tl`: a TransformerBridge on the same weights, on the CPU in fp32, in compatibility mode
  without weight processing: `model.tl`, where the weights (`model.W_Q`, `model.blocks[0].attn.W_O`)
  and everything gradient-based (backward hooks, `.backward()`) come from.
- `ComponentView`: `model.blocks[i].attn` and friends: the served model's hook points, TL's weights.
- `HookMirror`: the served model's hook functions, put on the TL model's hook points for a call
  that runs there.

Editing TL's weights (model.tl, model.W_U, ...) never changes what the engine serves: vLLM holds
its own copy of the weights.
"""
import copy

import torch

from .hook_points import HookPoint, canonical_name

READ_ONLY = ("the served model's weights live in its vLLM engine: {what} is TransformerLens's copy (model.tl, on "
             "the CPU), and editing it would not change what the engine computes. Edit the activations with hooks "
             "instead, or edit model.tl and run model.tl itself")


def load_tokenizer(model_dir):
    """The tokenizer TransformerLens 4.3's boot makes: loaded with add_bos_token=True (so that
    `tokenizer.encode(text)` prepends BOS where TransformerLens's does), then normalised (pad, BOS
    and EOS tokens, padding side) by its setup_tokenizer."""
    from transformer_lens.model_bridge.sources._hf_format import setup_tokenizer
    from transformer_lens.utilities.hf_utils import autotokenizer_with_special_token_compat
    from transformers import AutoTokenizer

    try:
        tokenizer = autotokenizer_with_special_token_compat(str(model_dir), auto_tokenizer=AutoTokenizer,
                                                            add_bos_token=True)
    except ValueError:  # TransformerLens's fallback: tokenizers that refuse add_bos_token
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return setup_tokenizer(tokenizer)


def bridge_config(hf_config, model_name: str, dtype: torch.dtype, tokenizer, family: str):
    """TransformerLens's config for this model, as `TransformerBridge.boot_transformers` builds it
    (its HF-config translation, then its architecture adapter's settings, then its tokenizer
    probe), plus `family` ("llama" / "gpt2"), the served model's own. `device` is "cpu" until the
    engine is built (HookedServedModel.from_pretrained sets the engine's)."""
    from transformer_lens.factories.architecture_adapter_factory import ArchitectureAdapterFactory
    from transformer_lens.model_bridge.sources._bridge_builder import (build_bridge_config_from_hf,
                                                                      detect_tokenizer_bos_eos)
    from transformer_lens.model_bridge.sources._hf_format import determine_architecture_from_hf_config

    hf_config = copy.deepcopy(hf_config)  # the translation may add fields; the caller's config stays as it was
    architecture = determine_architecture_from_hf_config(hf_config)
    cfg = build_bridge_config_from_hf(hf_config, architecture, model_name, dtype)
    cfg = ArchitectureAdapterFactory.select_architecture_adapter(cfg).cfg  # norm type, rotary, gated MLP ...
    cfg.tokenizer_prepends_bos, cfg.tokenizer_appends_eos = detect_tokenizer_bos_eos(tokenizer)
    if cfg.d_vocab_out == -1:  # as the bridge's constructor completes it
        cfg.d_vocab_out = cfg.d_vocab
    cfg.device = "cpu"
    cfg.family = family
    return cfg


def tl_device(device: torch.device) -> str:
    """A torch device as TransformerLens writes cfg.device: "cpu", "cuda" (the first GPU), "cuda:1"."""
    if device.type == "cuda" and device.index in (None, 0):
        return "cuda"
    return str(device)


def boot_tl(model_dir):
    """TransformerLens's TransformerBridge on the model folder: CPU, fp32 (gradients in bf16 would
    be too coarse for attribution), compatibility mode without weight processing (raw weights, as
    the engine serves them), in eval mode."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(str(model_dir), device="cpu", dtype=torch.float32)
    bridge.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    return bridge.eval()


def tl_weight(name: str) -> property:
    """A model attribute that is TransformerLens's weight of that name (`model.W_Q`, stacked over
    layers as TransformerLens stacks it), from model.tl; assigning to it is refused."""
    def get(model):
        return getattr(model.tl, name)

    def refuse(model, value):
        raise AttributeError(READ_ONLY.format(what=f"model.{name}"))

    return property(get, refuse, doc=f"TransformerLens's {name} (raw weights, from model.tl; a copy: editing it "
                                     f"does not change the served engine).")


def component(path: str) -> property:
    """A model attribute that is a ComponentView (`model.embed`, `model.ln_final`)."""
    return property(lambda model: ComponentView(model, path), doc=ComponentView.__doc__)


class ComponentView:
    """A part of the served model as TransformerLens names it (`model.blocks[0]`, `.attn`, `.mlp`,
    `.ln1`, `.ln2`, `model.embed`, `model.ln_final` ...). Its hook-point attributes
    (`blocks[0].attn.hook_z`, `ln1.hook_normalized`, `hook_resid_post`) are the served model's
    HookPoints: a hook added there runs in the engine. Every other attribute (`W_Q`, `b_O`, `w`,
    `W_out`, methods) and calling it come from the same part of TransformerLens's model (model.tl,
    booted on first use): read-only as far as the engine is concerned."""

    _PARTS = ("attn", "mlp", "ln1", "ln2")  # a block's parts

    def __init__(self, model, path: str):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_path", path)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        name = canonical_name(f"{self._path}.{attr}")
        if name in self._model.hook_dict:
            return self._model.hook_dict[name]
        if attr in self._PARTS and self._path.count(".") == 1 and self._path.startswith("blocks."):
            return ComponentView(self._model, f"{self._path}.{attr}")
        return getattr(self.tl_module(), attr)

    def tl_module(self):
        """The same part of TransformerLens's model (model.tl)."""
        module = self._model.tl
        for part in self._path.split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        return module

    def __call__(self, *args, **kwargs):
        return self.tl_module()(*args, **kwargs)

    def __setattr__(self, attr: str, value) -> None:
        raise AttributeError(READ_ONLY.format(what=f"{self._path}.{attr}"))

    def __repr__(self) -> str:
        return f"ComponentView({self._path!r}: served hook points, TransformerLens's weights)"


class HookMirror:
    """The served model's hook functions (fwd and bwd), added to the same hook points of
    TransformerLens's model for a call that runs there. They stay on it after the call, so that
    `.backward()` on its result runs the backward hooks; the next sync (or clear) removes them."""

    def __init__(self):
        self.added = []  # (TransformerLens HookPoint, its LensHandle) of what sync added

    def sync(self, tl, hook_dict: dict[str, HookPoint]) -> None:
        self.clear()
        tl_points = tl.hook_dict
        for name, point in hook_dict.items():
            for direction in ("fwd", "bwd"):
                handles = point.fwd_hooks if direction == "fwd" else point.bwd_hooks
                if handles and name not in tl_points:
                    raise ValueError(f"{name} has hooks, but TransformerLens's model has no such hook point, so the "
                                     f"call cannot run there (it runs there because of backward hooks); remove "
                                     f"them for this call")
                for handle in handles:
                    self.added.append((tl_points[name], tl_points[name].add_hook(handle.hook, dir=direction)))

    def clear(self) -> None:
        for point, handle in self.added:
            handle.hook.remove()  # the torch module hook
            for handles in (point.fwd_hooks, point.bwd_hooks):
                if handle in handles:
                    handles.remove(handle)
        self.added = []
