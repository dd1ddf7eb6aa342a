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
import hashlib
import os
import tempfile
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from . import hook_points, stores
from .backend.vllm.sites import feature_shape
from .cache import ActivationCache
from .hook_points import HookPoint
from .lower import lower
from .lowered import AffineWrite, GeneratedWrite, Read, describe, op_digest
from .models import resolve_model
from .trace import Tracer

HookFn = Callable[..., torch.Tensor | None]
HookSpec = tuple[str | Callable[[str], bool], HookFn]
_FINAL = "ln_final.hook_normalized"
_LOGITS_KEY = ("logits", 0)


@dataclass
class HookedServedConfig:
    n_layers: int
    d_model: int
    n_heads: int
    d_head: int
    d_vocab: int
    n_ctx: int
    d_mlp: int
    n_key_value_heads: int
    family: str
    model_name: str
    dtype: torch.dtype
    default_prepend_bos: bool = True


def _config_from_hf(hf, family: str, name: str, dtype: torch.dtype) -> HookedServedConfig:
    if family == "gpt2":
        n_heads, d_model = hf.n_head, hf.n_embd
        return HookedServedConfig(hf.n_layer, d_model, n_heads, d_model // n_heads, hf.vocab_size, hf.n_positions,
                                  hf.n_inner or 4 * d_model, n_heads, family, name, dtype)
    n_heads, d_model = hf.num_attention_heads, hf.hidden_size
    return HookedServedConfig(hf.num_hidden_layers, d_model, n_heads, getattr(hf, "head_dim", None) or d_model // n_heads,
                              hf.vocab_size, hf.max_position_embeddings, hf.intermediate_size,
                              getattr(hf, "num_key_value_heads", n_heads), family, name, dtype)


_FAMILIES = {"LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt2"}
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class HookedServedModel:
    """A vLLM-served model with TransformerLens hooks. Build it with `from_pretrained`."""

    def __init__(self, llm, model_dir, cfg: HookedServedConfig, tokenizer, runtime,
                 unembed: tuple[torch.Tensor, torch.Tensor] | None):
        # from_pretrained makes the model before its engine (llm, runtime, unembed None): installed
        # apps are traced before the engine is built
        self.llm, self.model_dir, self.cfg, self.tokenizer = llm, model_dir, cfg, tokenizer
        self.runtime = runtime
        # ln_final.hook_normalized -> logits, final norm weight folded in; fp32 on the host
        self.W_U, self.b_U = unembed or (None, None)
        self.hook_dict: dict[str, HookPoint] = hook_points.make_hook_dict(cfg.family, cfg.n_layers)
        self.mod_dict = self.hook_dict
        # per hook point, the per-token feature shape of its act ((d_model,), (n_heads, d_head), ...)
        self.feature_shapes = {name: feature_shape(cfg.family, name, cfg) for name in self.hook_dict}
        self.last_run_stats: dict = {}  # requests, prompt tokens and prefix-cache hits of the last run

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str | torch.dtype = "float32", device: str | None = None,
                        enforce_eager: bool = False, max_model_len: int | None = None,
                        armed: str | Sequence[str] = "all", apps: Sequence = (), **engine_kwargs) -> "HookedServedModel":
        """Build an in-process vLLM engine for a local HF folder or an embedded model's name.

        `armed` is the set of hook points compiled into the engine ("all": a research engine,
        every hook point ready without a rebuild). torch.compile stays on unless enforce_eager, and
        so do CUDA graphs on a GPU. `apps` (objects with `name` and `fwd_hooks`) are installed as
        the engine is built, so that its CUDA graphs contain them (see backend/vllm/control.py).
        """
        from transformers import AutoConfig, AutoTokenizer

        torch_dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
        if torch_dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        if device not in (None, "cpu", "cuda") and not str(device).startswith("cuda"):
            raise ValueError(f"device {device!r}: use 'cpu' or 'cuda' (vLLM picks its platform itself)")
        model_dir = resolve_model(name_or_path)
        hf = AutoConfig.from_pretrained(model_dir)
        arch = (hf.architectures or ["?"])[0]
        if arch not in _FAMILIES:
            raise ValueError(f"architecture {arch} is not supported yet; supported: {sorted(_FAMILIES)}")
        family = _FAMILIES[arch]
        cfg = _config_from_hf(hf, family, str(name_or_path), torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"

        from vllm import LLM

        from .backend.vllm import adapter, control, remote
        from .backend.vllm.sites import unembedding

        _check_tensor_parallel(cfg, engine_kwargs)
        armed_names = armed if armed == "all" else [hook_points.canonical_name(n) for n in armed]
        model = cls(None, model_dir, cfg, tokenizer, None, None)
        xmix_config = {"armed": armed_names}
        with tempfile.TemporaryDirectory(prefix="xmix-apps-") as folder:
            if apps:
                # lowered now and installed while the engine builds its model: before CUDA-graph
                # capture, so that the graphs contain the apps' launches
                lowered = [(app.name, model._lower_app(app.name, app.fwd_hooks)[0]) for app in apps]
                for name, ops in lowered:  # refused now, not halfway through building the engine
                    control.check_resident(name, ops)
                xmix_config["apps_file"] = os.path.join(folder, "apps.pt")
                torch.save(lowered, xmix_config["apps_file"])
            llm = LLM(model=str(model_dir), dtype=str(torch_dtype).removeprefix("torch."), enforce_eager=enforce_eager,
                      max_model_len=max_model_len or min(cfg.n_ctx, 2048), skip_tokenizer_init=True,
                      additional_config={"xmix_lens": xmix_config}, **engine_kwargs)
        runner, model.runtime = adapter.bind(llm)
        model.llm = llm
        if runner is not None:
            model.W_U, model.b_U = unembedding(runner.model, family, cfg.d_vocab)
        else:  # every rank takes part in gathering the vocabulary shards; rank 0's answer
            model.W_U, model.b_U = llm.collective_rpc(remote.unembedding_of, args=(family, cfg.d_vocab))[0]
        from .app import App

        for app in apps:  # xmix_lens.App objects join the model's registry too (selectable by apps=)
            if isinstance(app, App):
                model.install(app)
        return model

    def shutdown(self) -> None:
        """Stop the engine's workers now (under TP, its worker processes exit) rather than at
        interpreter exit. Other engines in this process keep running: vLLM's own engine shutdown
        would also tear down this process's distributed state, which in-process engines share."""
        from .backend.vllm import adapter
        adapter.shutdown_workers(self.llm)

    # --- tokens (TransformerLens's rules) -------------------------------------------------------
    def _tokenize(self, input: str | list[str], prepend_bos: bool | None, padding_side: str | None):
        prepend_bos = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
        texts = [input] if isinstance(input, str) else list(input)
        rows = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        if prepend_bos:
            rows = [[self.tokenizer.bos_token_id] + r for r in rows]
        width = max(len(r) for r in rows)
        side = padding_side or self.tokenizer.padding_side
        tokens = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            span = slice(width - len(r), width) if side == "left" else slice(0, len(r))
            tokens[i, span] = torch.tensor(r, dtype=torch.long)
            mask[i, span] = 1
        return tokens, mask

    def to_tokens(self, input: str | list[str], prepend_bos: bool | None = None, padding_side: str | None = None,
                  move_to_device: bool = True, truncate: bool = True) -> torch.Tensor:
        tokens, _ = self._tokenize(input, prepend_bos, padding_side)
        if truncate and tokens.shape[1] > self.cfg.n_ctx:
            tokens = tokens[:, : self.cfg.n_ctx]
        return tokens

    def to_string(self, tokens) -> str | list[str]:
        tokens = torch.as_tensor(tokens)
        if tokens.dim() == 1:
            return self.tokenizer.decode(tokens.tolist())
        return [self.tokenizer.decode(row.tolist()) for row in tokens]

    def to_str_tokens(self, input, prepend_bos: bool | None = None, padding_side: str | None = None):
        if isinstance(input, list) and input and isinstance(input[0], str):
            return [self.to_str_tokens(s, prepend_bos, padding_side) for s in input]
        tokens = self.to_tokens(input, prepend_bos, padding_side)[0] if isinstance(input, str) else torch.as_tensor(input)
        if tokens.dim() > 1:
            if tokens.shape[0] != 1:
                raise ValueError("to_str_tokens takes one sequence; index a batch row first")
            tokens = tokens[0]
        return [self.tokenizer.decode([t]) for t in tokens.tolist()]

    def _rows(self, input, prepend_bos, padding_side, attention_mask):
        """Tokens [B, P] and, per row, its real tokens and their offset in the padded layout."""
        if isinstance(input, (str, list)) and (isinstance(input, str) or all(isinstance(s, str) for s in input)):
            tokens, mask = self._tokenize(input, prepend_bos, padding_side)
        elif isinstance(input, list) and input and all(isinstance(r, list) for r in input):
            # token-id lists of different lengths: each row's tokens are all real, right-padded
            width = max(len(r) for r in input)
            tokens = torch.full((len(input), width), self.tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros(len(input), width, dtype=torch.long)
            for i, r in enumerate(input):
                tokens[i, : len(r)], mask[i, : len(r)] = torch.tensor(r, dtype=torch.long), 1
        else:
            tokens = torch.as_tensor(input, dtype=torch.long)
            tokens = tokens[None] if tokens.dim() == 1 else tokens
            # TransformerLens treats every token of a tensor as real unless a mask is passed
            mask = torch.ones_like(tokens) if attention_mask is None else torch.as_tensor(attention_mask)
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must be [batch, pos] with pos >= 1, got {list(tokens.shape)}")
        if int(tokens.max()) >= self.cfg.d_vocab or int(tokens.min()) < 0:
            raise ValueError(f"token ids must lie in [0, {self.cfg.d_vocab}); got {int(tokens.min())}..{int(tokens.max())}")
        rows, offsets = [], []
        for b in range(tokens.shape[0]):
            real = mask[b].nonzero().flatten()
            if real.numel() == 0 or bool((real[1:] - real[:-1] != 1).any()):
                raise ValueError(f"row {b}: the attention mask must mark one contiguous run of real tokens")
            rows.append(tokens[b, real].tolist())
            offsets.append(int(real[0]))
        return tokens, mask, rows, offsets

    # --- hooks (TransformerLens's HookedRootModule bookkeeping) ---------------------------------
    def add_hook(self, name, hook: HookFn, dir: str = "fwd", is_permanent: bool = False, prepend: bool = False) -> None:
        for n in hook_points.resolve(self.hook_dict, name):
            self.hook_dict[n].add_hook(hook, dir=dir, is_permanent=is_permanent, prepend=prepend)

    def add_perma_hook(self, name, hook: HookFn, dir: str = "fwd") -> None:
        self.add_hook(name, hook, dir=dir, is_permanent=True)

    def remove_all_hook_fns(self, direction: str = "both", including_permanent: bool = False) -> None:
        for hp in self.hook_dict.values():
            hp.remove_hooks(including_permanent=including_permanent)

    def reset_hooks(self, clear_contexts: bool = True, direction: str = "both", including_permanent: bool = False) -> None:
        if clear_contexts:
            for hp in self.hook_dict.values():
                hp.clear_context()
        self.remove_all_hook_fns(direction, including_permanent)

    def _check_hooks(self, fwd_hooks: Iterable[HookSpec], bwd_hooks) -> list[tuple[str, HookFn]]:
        if bwd_hooks:
            raise ValueError("backward hooks are not supported: a serving engine runs no backward pass; "
                             "use TransformerLens itself for gradient-based methods")
        resolved = []
        for spec in fwd_hooks:
            if not (isinstance(spec, tuple) and len(spec) == 2 and callable(spec[1])):
                raise ValueError(f"each fwd_hook is (name or filter, function); got {spec!r}")
            resolved += [(n, spec[1]) for n in hook_points.resolve(self.hook_dict, spec[0])]
        return resolved

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Iterable[HookSpec] = (), bwd_hooks=(), reset_hooks_end: bool = True,
              clear_contexts: bool = False):
        """Hooks added for the duration of the block; removed on exit, also when the block raises."""
        resolved = self._check_hooks(fwd_hooks, bwd_hooks)
        added = []
        try:
            for name, fn in resolved:
                self.hook_dict[name].add_hook(fn)
                added.append((name, self.hook_dict[name].fwd_hooks[-1]))
            yield self
        finally:
            if reset_hooks_end:
                for name, handle in added:
                    if handle in self.hook_dict[name].fwd_hooks:
                        self.hook_dict[name].fwd_hooks.remove(handle)
                if clear_contexts:
                    for name, _ in added:
                        self.hook_dict[name].clear_context()

    # --- forward passes ---------------------------------------------------------------------------
    def __call__(self, input, return_type: str | None = "logits", **kwargs):
        return self.forward(input, return_type=return_type, **kwargs)

    def run_with_hooks(self, input, fwd_hooks: Iterable[HookSpec] = (), bwd_hooks=(), reset_hooks_end: bool = True,
                       clear_contexts: bool = False, return_type: str | None = "logits", **kwargs):
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts):
            return self.forward(input, return_type=return_type, **kwargs)

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
        ordered = {n: cache[n] for n in names}
        if not return_cache_object:
            return out, ordered
        result = ActivationCache(ordered, self)
        return out, result.remove_batch_dim() if remove_batch_dim else result

    def _cache_names(self, names_filter) -> list[str]:
        if names_filter is None:
            return list(self.hook_dict)
        if isinstance(names_filter, str):
            return hook_points.resolve(self.hook_dict, names_filter)
        if callable(names_filter):
            return hook_points.resolve(self.hook_dict, names_filter)
        wanted = {n for spec in names_filter for n in hook_points.resolve(self.hook_dict, spec)}
        return [n for n in self.hook_dict if n in wanted]

    def forward(self, input, return_type: str | None = "logits", prepend_bos: bool | None = None,
                padding_side: str | None = None, attention_mask=None, loss_per_token: bool = False):
        job = self._forward_job(input, return_type, prepend_bos, padding_side, attention_mask, loss_per_token)
        ((p, _),) = self._run_passes([job.run])
        return job.finish(p)

    def run_batch(self, requests: Sequence[tuple], return_type: str | None = "logits", **kwargs) -> list:
        """Forward passes that each have their own hooks, served together in one engine.

        `requests`: (input, fwd_hooks) pairs. All their rows are in flight at once (vLLM batches
        them as it likes); each pass's hooks touch only its own rows. Returns what
        `run_with_hooks(input, fwd_hooks, return_type)` would, per pair."""
        jobs = []
        for input, fwd_hooks in requests:
            with self.hooks(fwd_hooks):
                jobs.append(self._forward_job(input, return_type, **kwargs))
        return [job.finish(p) for job, (p, _) in zip(jobs, self._run_passes([job.run for job in jobs]))]

    def _forward_job(self, input, return_type, prepend_bos=None, padding_side=None, attention_mask=None,
                     loss_per_token=False) -> "_Job":
        """Trace the hooks on the hook points for one forward pass (checks all input first)."""
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type {return_type!r}: use 'logits', 'loss', 'both' or None")
        tokens, mask, rows, offsets = self._rows(input, prepend_bos, padding_side, attention_mask)
        self._check_length(max(len(r) for r in rows))
        traced = self._trace_hooks(*tokens.shape)
        if return_type is not None:
            traced.ops.setdefault(_FINAL, []).append(Read(_LOGITS_KEY, None, True, None, None, (self.cfg.d_model,)))

        def finish(p):
            if return_type is None:
                return None
            logits = p.result(_LOGITS_KEY) @ self.W_U + self.b_U
            if return_type == "logits":
                return logits
            loss = _next_token_loss(logits, tokens, mask, loss_per_token)
            return loss if return_type == "loss" else (logits, loss)

        return _Job((rows, offsets, traced, None, 1, {}), finish)

    def generate(self, input, max_new_tokens: int = 10, stop_at_eos: bool = True, eos_token_id: int | None = None,
                 do_sample: bool = True, top_k: int | None = None, top_p: float | None = None,
                 temperature: float = 1.0, prepend_bos: bool | None = None, padding_side: str | None = None,
                 return_type: str = "input", seed: int | None = None, fwd_hooks: Iterable[HookSpec] = (),
                 verbose: bool = False):
        """Sample continuations with the hooks on the prompt and on every generated token.

        As TransformerLens's generate with its KV cache: each hook is traced for the prompt
        (act [batch, pos, ...]) and for generated tokens (act [batch, 1, ...], the newest token).
        Returns strings for string input (return_type "input" or "str"), else tokens [batch, pos + new]
        with each row's prompt as given followed by its generated tokens (padded with the pad token)."""
        if return_type not in ("input", "str", "tokens"):
            raise ValueError(f"return_type {return_type!r}: use 'input', 'str' or 'tokens'")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        tokens, mask, rows, offsets = self._rows(input, prepend_bos, padding_side, None)
        self._check_length(max(len(r) for r in rows) + max_new_tokens)
        sampling = {"temperature": temperature if do_sample else 0.0, "top_k": top_k if do_sample and top_k else 0,
                    "top_p": top_p if do_sample and top_p else 1.0, "seed": seed, "ignore_eos": not stop_at_eos}
        if eos_token_id is not None:
            sampling["stop_token_ids"] = [eos_token_id]
        with self.hooks(fwd_hooks):
            prompt = self._trace_hooks(*tokens.shape)
            step = self._trace_hooks(tokens.shape[0], 1, inherited=prompt.per_request_stores, phase="decode")
            ((_, outputs),) = self._run_passes([(rows, offsets, prompt, step, max_new_tokens, sampling)])
        full = [r + list(out) for r, out in zip(rows, outputs)]
        text_out = return_type == "str" or (return_type == "input" and not isinstance(input, torch.Tensor)
                                            and (isinstance(input, str) or isinstance(input[0], str)))
        if text_out:
            texts = [self.tokenizer.decode(t) for t in full]
            return texts[0] if isinstance(input, str) else texts
        width = max(len(t) for t in full)
        out = torch.full((len(full), width), self.tokenizer.pad_token_id, dtype=torch.long)
        for i, t in enumerate(full):
            out[i, : len(t)] = torch.tensor(t)
        return out

    def _check_length(self, n: int) -> None:
        limit = self.llm.llm_engine.model_config.max_model_len
        if n > limit:
            raise ValueError(f"a request needs {n} positions; this engine's max_model_len is {limit} "
                             f"(from_pretrained(max_model_len=...))")

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

    def _trace_hooks(self, B: int, P: int, inherited=None, phase: str = "prefill") -> "TracedHooks":
        """Trace every hook function once for this view of the pass, in firing order, then lower
        each hook point. `inherited`: the prompt's per-request stores, seen by generated tokens."""
        session = stores.TraceSession(B, P, inherited=dict(inherited or {}))
        tracers, kept = [], []
        stores.begin(session)
        try:
            for name, hp in self.hook_dict.items():
                if hp.fwd_hooks:
                    tracer = Tracer(name, (B, P) + self.feature_shapes[name], self.cfg.dtype, phase)
                    for handle in list(hp.fwd_hooks):
                        tracer.call(handle.hook, hp)
                    kept += [((phase, name, key), p) for key, p in enumerate(tracer.finish())]
                    tracers.append(tracer)
        finally:
            stores.begin(None)
        session.allocate(self.runtime.device if self.runtime is not None else torch.device("cpu"))
        ops = {t.graph.hook_name: site_ops for t in tracers if (site_ops := lower(t.graph))}
        return TracedHooks(P, ops, kept, [t.graph for t in tracers], session.per_request())

    def _lower_app(self, name: str, fwd_hooks: Iterable[HookSpec]) -> tuple[dict, list]:
        """An installed app's hooks, traced for one token ([1, 1, ...]: they run on every token of
        the requests that select them) and lowered: (ops per hook point, kept (read key, proxy))."""
        with self.hooks(fwd_hooks):
            traced = self._trace_hooks(1, 1)
        if traced.per_request_stores:
            raise ValueError(f"app {name!r}: installed apps do not use stores yet; run its hooks with run_with_hooks")
        return traced.ops, traced.kept

    def _install_resident(self, name: str, fwd_hooks: Iterable[HookSpec]) -> list:
        """Install an app's lowered ops in the engine (graph-safe; see backend/vllm/control.py).
        Returns its kept (read key, proxy) pairs, to name the values it reads."""
        ops, kept = self._lower_app(name, fwd_hooks)
        self.runtime.install_app(name, ops)
        return kept

    def _run_passes(self, jobs: list[tuple]) -> list[tuple]:
        """Run passes together: each job is (rows, prompt offsets, prompt hooks, generated-token hooks
        or None, max_new_tokens, sampling[, installed apps per row]). Returns (pass, each row's new
        tokens) per job; with apps, `pass.app_results[row]` holds what they read for that row.

        The kept proxies of the hook functions become the values read (for generated tokens: the
        last one's)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        installed = self.runtime.installed
        for job in jobs:  # unknown apps fail before anything is sent to the engine
            for names in (job[6] if len(job) > 6 else ()):
                unknown = sorted(set(names) - set(installed))
                if unknown:
                    raise KeyError(f"no app named {unknown[0]!r} is installed; installed: {sorted(installed)}")
        pass_ids = self.runtime.begin_passes([
            ([len(r) for r in rows], offsets, (prompt.padded_len, prompt.ops),
             (step.padded_len, step.ops) if step is not None else None) for rows, offsets, prompt, step, *_ in jobs])
        names = [[f"xmix-{pass_id}-{row}" for row in range(len(job[0]))] for pass_id, job in zip(pass_ids, jobs)]
        routes, selections, outputs = {}, {}, {}
        self.last_run_stats = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
        try:
            for pass_id, pass_names, (rows, offsets, prompt, step, max_new_tokens, sampling, *selection) in zip(
                    pass_ids, names, jobs):
                row_apps = selection[0] if selection else [()] * len(rows)
                params = SamplingParams(max_tokens=max_new_tokens, detokenize=False, **{"temperature": 0.0, **sampling})
                salt = _cache_salt(prompt, step)
                for row, toks in enumerate(rows):
                    row_salt = _app_salt(installed, row_apps[row], salt)
                    # vLLM makes the id unique (a suffix); the model runner sees that one
                    internal = engine.add_request(pass_names[row],
                                                  TokensPrompt(prompt_token_ids=toks, cache_salt=row_salt), params)
                    routes[internal] = (pass_id, row)
                    if row_apps[row]:
                        selections[internal] = tuple(row_apps[row])
            # one call before the first step (one RPC under TP): where each request's tokens belong
            self.runtime.route(routes, selections)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outputs[out.request_id] = list(out.outputs[0].token_ids)
                        self.last_run_stats["requests"] += 1
                        self.last_run_stats["prompt_tokens"] += len(out.prompt_token_ids or ())
                        self.last_run_stats["cached_tokens"] += out.num_cached_tokens or 0
        finally:
            if len(outputs) < sum(map(len, names)):  # stopped by an error
                engine.abort_request([n for pass_names in names for n in pass_names if n not in outputs])
            finished = self.runtime.finish_passes(pass_ids, list(routes))
        results = []
        for p, pass_names, (_, _, prompt, step, *_) in zip(finished, names, jobs):
            for key, proxy in prompt.kept + (step.kept if step is not None else []):
                torch.utils.swap_tensors(proxy, p.result(key).to(self.cfg.dtype))
            results.append((p, [outputs[name] for name in pass_names]))
        return results

    # --- apps (xmix_lens/app.py) ---
    def install(self, app):
        """Install an xmix_lens.App (checked and traced now); see xmix_lens/app.py."""
        from . import app as apps
        return apps.install(self, app)

    def uninstall(self, name: str):
        from . import app as apps
        return apps.uninstall(self, name)

    def activate(self, names, requests=None) -> None:
        """Run these apps in calls without `apps=`: for every request, or the rows in `requests`."""
        from . import app as apps
        apps.activate(self, names, requests)

    def deactivate(self, names=None, requests=None) -> None:
        from . import app as apps
        apps.deactivate(self, names, requests)

    def set_params(self, name: str, **values) -> int:
        """Update an installed app's parameter tensors in place; returns its new version."""
        from . import app as apps
        return apps.set_params(self, name, **values)

    @property
    def apps(self) -> dict:
        """The installed apps by name, in install order."""
        from . import app as apps
        return dict(apps.registry(self).apps)

    # `apps=` on forward (so __call__, run_with_hooks, run_with_cache), run_batch and generate
    from .app import with_apps_forward as _with_apps_forward
    from .app import with_apps_generate as _with_apps_generate
    from .app import with_apps_run_batch as _with_apps_run_batch
    forward = _with_apps_forward(forward)
    run_batch = _with_apps_run_batch(run_batch)
    generate = _with_apps_generate(generate)
    del _with_apps_forward, _with_apps_generate, _with_apps_run_batch


@dataclass
class _Job:
    run: tuple  # the arguments of one pass for _run_passes
    finish: Callable  # the pass -> what the caller returns


@dataclass
class TracedHooks:
    """The hooks of one view of a pass (the prompt, or each generated token), traced and lowered."""

    padded_len: int
    ops: dict[str, list]  # hook point -> lowered ops
    kept: list  # (read key, proxy) pairs: proxies the hook functions kept
    graphs: list
    per_request_stores: dict


def _cache_salt(prompt: "TracedHooks", step: "TracedHooks | None") -> str | None:
    """vLLM's prefix-cache salt for a pass's requests.

    KV computed under a pass's writes must never serve a request without the same writes, and a
    pass that reads (or stores) prompt activations needs every position computed, not cached:
    - no ops at all: no salt, the cache is shared with plain requests;
    - only writes, the same for every request: a digest of the ops (same hooks and parameters
      share KV; other parameters get other blocks);
    - reads, stores or per-token tables: a fresh salt, nothing is reused."""
    phases = [prompt] + ([step] if step is not None else [])
    ops = [op for t in phases for site in sorted(t.ops) for op in t.ops[site]]
    if not ops:
        return None
    if any(not isinstance(op, (AffineWrite, GeneratedWrite)) or isinstance(op, AffineWrite) and op.per_token_bias
           or isinstance(op, GeneratedWrite) and any(o.op == "table" for o in op.program.ops) for op in ops):
        return uuid.uuid4().hex
    digest = hashlib.sha256()
    for t in phases:
        for site in sorted(t.ops):
            digest.update(site.encode())
            for op in t.ops[site]:
                digest.update(op_digest(op))
    return digest.hexdigest()


def _check_tensor_parallel(cfg, engine_kwargs: dict) -> None:
    """Refused before an engine is built: parallel layouts whose sites the runtime does not place."""
    if engine_kwargs.get("pipeline_parallel_size", 1) != 1:
        raise ValueError("pipeline_parallel_size > 1 is not supported: a rank would hold some layers' hook "
                         "points only; use tensor_parallel_size")
    world = engine_kwargs.get("tensor_parallel_size", 1)
    if world > 1 and cfg.n_heads % world:
        raise ValueError(f"tensor_parallel_size={world} does not divide the model's {cfg.n_heads} attention "
                         "heads; vLLM shards heads evenly: choose a divisor")


def _app_salt(installed: dict, names, salt: str | None) -> str | None:
    """A request's prefix-cache salt with its installed apps: KV computed under an app's writes serves
    only requests whose apps do the same (a digest of their ops: new parameters, or another app
    reinstalled under the name, get other blocks); an app that reads needs every position
    computed, so nothing is reused."""
    if not names:
        return salt
    apps = [installed[n] for n in sorted(names)]
    if any(app.reads for app in apps):
        return uuid.uuid4().hex
    return hashlib.sha256(repr((salt, [a.digest for a in apps])).encode()).hexdigest()


def _next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, per_token: bool):
    """TransformerLens's loss: mean negative log-likelihood of each next real token."""
    log_probs = logits[:, :-1].log_softmax(-1)
    nll = -log_probs.gather(-1, tokens[:, 1:, None])[..., 0]
    valid = (mask[:, :-1] * mask[:, 1:]).to(nll.dtype)
    if per_token:
        return nll * valid
    return (nll * valid).sum() / valid.sum()


HookedTransformer = HookedServedModel
