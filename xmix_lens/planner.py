"""The planner: a call's hooks become passes the engine runs, and their outcomes the call's result.

model.py (the TransformerLens API) hands it the call's rows and the hooks on the hook points:
  1. every hook function is traced once on a proxy of its act (trace.py) and lowered (lower.py);
  2. rows that select the same apps share one pass (`PassPlan`); resident apps whose params were
     edited in place are lowered again first (`sync_resident`);
  3. the engine runs the passes (backend/engine.py's contract); the proxies the hook functions
     kept become the values read;
  4. hooks on computed points (attention patterns, per-head results, logits) are called on values
     computed from the pass's reads, and a pass runs again where they change one.
"""
import dataclasses
import itertools
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from . import attention_points, computed_points, hook_points
from .app import App, AppRegistry, AppRun, RowGroup, attached, group_rows, merged, resident_reads, snapshot
from .hooked_root import HookedRoot, HookFn, HookSpec
from .lower import lower
from .lowered import RESIDENT_TRACE_LEN, Read, resident_form
from .passes import PassPlan, PhaseOps
from .resident_calls import ResidentCalls
from .trace import Tracer, TraceSession, as_parameters, traced_once_for

FINAL = "unembed.hook_in"  # the final norm's output, read for the logits
UNEMBED_OUT = "unembed.hook_out"
_LOGITS_KEY = ("logits", 0)


class NonFiniteError(RuntimeError):
    """Hooks wrote NaN or infinite values into a call's activations (model.on_nonfinite = "raise")."""


class Rows(NamedTuple):
    """A call's tokens [B, P] with TransformerLens's mask, and per row its real tokens (the engine's
    request) and where each sits in the padded layout (`places`: int64 [n] of padded positions).

    A mask may have zeros anywhere, as TransformerLens's may: a masked token is left out of the row's
    request, so the real tokens after it take the positions after the previous real token, and no
    token attends to it (TransformerLens's semantics: the same as removing it from the input)."""

    tokens: torch.Tensor
    mask: torch.Tensor
    rows: list[list[int]]
    places: list[torch.Tensor]
    contexts: list[int] | None = None  # per row, tokens before the call's, that no hook sees (continued)

    @classmethod
    def of(cls, tokens: torch.Tensor, mask: torch.Tensor, d_vocab: int) -> "Rows":
        if tokens.dim() != 2 or 0 in tokens.shape:
            raise ValueError(f"tokens must be [batch, pos] with batch >= 1 and pos >= 1, got {list(tokens.shape)}")
        # numpy on the host, not torch: torch's ops on host tensors of a call's size took about 5 ms each
        # in the engine's process on the H100's host (Rows.of was 66 ms of a 1,000-row call's host
        # profile: bench/results/2026-12-07-gpu-research-2.8b-h100-prompt-logprobs-baseline.json)
        on_host = mask.detach().cpu()
        on_host = on_host.float() if on_host.dtype == torch.bfloat16 else on_host  # numpy has no bfloat16
        ids, real = tokens.detach().cpu().numpy(), on_host.numpy() != 0
        if ids.max() >= d_vocab or ids.min() < 0:
            raise ValueError(f"token ids must lie in [0, {d_vocab}); got {int(ids.min())}..{int(ids.max())}")
        lengths = real.sum(1)
        if not lengths.all():
            raise ValueError(f"row {int(np.flatnonzero(lengths == 0)[0])}: the attention mask marks no real token; vLLM "
                             f"runs no request of no tokens: drop the row, or mark at least one of its tokens 1")
        lengths = lengths.tolist()
        places = list(torch.from_numpy(np.nonzero(real)[1]).split(lengths))
        flat = ids[real].tolist()
        starts = [0] + list(itertools.accumulate(lengths))
        rows = [flat[a:b] for a, b in zip(starts, starts[1:])]
        return cls(tokens, mask, rows, places)

    @classmethod
    def of_lists(cls, lists: list[list[int]], pad_token_id: int, d_vocab: int) -> "Rows":
        """Token-id lists of different lengths: each row's tokens are all real, right-padded."""
        width = max(len(r) for r in lists)
        tokens = torch.full((len(lists), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(lists), width, dtype=torch.long)
        for i, r in enumerate(lists):
            if r:
                tokens[i, : len(r)], mask[i, : len(r)] = token_ids(torch.as_tensor(r)), 1
        return cls.of(tokens, mask, d_vocab)


def token_ids(tokens: torch.Tensor) -> torch.Tensor:
    """Token ids as int64, refusing floats and bools (a cast would silently change them)."""
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"token ids are integers, got {tokens.dtype}: pass integer ids (tokens.long() if they hold "
                        f"whole numbers), or strings to tokenize")
    return tokens.long()


@dataclass
class Call:
    """The passes of one call and the function that turns their outcomes into what it returns."""

    plans: list[PassPlan]
    finish: Callable


class Planner:
    """Traces, lowers, plans and runs the passes of a model's calls (see the module's docstring)."""

    def __init__(self, root: HookedRoot, feature_shapes: dict, registry: AppRegistry, tl_block: Callable,
                 pad_token_id: int):
        # tl_block(L): TransformerLens's block L on the same weights (booted only when a computed
        # point's write needs its weights)
        self.root, self.cfg, self.hook_dict = root, root.cfg, root.hook_dict
        self.feature_shapes, self.registry, self.tl_block = feature_shapes, registry, tl_block
        self.pad_token_id = pad_token_id
        self.engine = None  # an Engine (backend/engine.py), set once from_pretrained has built it
        self.on_nonfinite = "raise"  # when hooks write NaN or inf: "raise", "warn" or "ignore"
        self.resident_calls = ResidentCalls(self)  # generate's per-token hooks as resident apps

    # --- one forward call -------------------------------------------------------------------------
    def forward_call(self, rows: Rows, return_type, loss_per_token=False, apps=None) -> Call:
        """The passes of one forward call and how their outcomes become its result. Everything is
        checked and traced here, before anything runs: one pass without apps, else one pass per
        group of rows that select the same apps."""
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type {return_type!r}: use 'logits', 'loss', 'both' or None")
        tokens, mask, places = rows.tokens, rows.mask, rows.places
        self.check_length(max(len(r) for r in rows.rows))
        selection = self.registry.selection(apps, len(rows.rows))
        self.sync_resident(selection)
        groups = self.groups(selection, len(rows.rows))
        computed = self.computed_hooks()
        if rows.contexts is not None and (computed or selection):
            what = f"hooks on {list(computed)}" if computed else "apps"
            raise NotImplementedError(f"{what} with past_kv_cache: not served (they need the past's own activations, "
                                      f"which a continued call does not compute again); run the whole sequence")
        source_reads: dict[str, torch.Tensor] = {}
        if computed and len(groups) > 1:
            raise ValueError(f"hooks on {list(computed)} need one pass for the call; these rows select different "
                             f"apps: use run_batch with one (input, fwd_hooks, apps) entry per app subset")
        plans = []
        for g in groups:
            traced = self.traced_apps(g)
            with attached(self.hook_dict, traced), self.root.hooks(self.source_reads(computed, source_reads)):
                # the whole batch's padded width, so that every group's logits and reads line up
                prompt = self.trace_hooks(len(g.rows), tokens.shape[1])
            if return_type is not None or UNEMBED_OUT in computed:
                prompt.ops.setdefault(FINAL, []).append(Read(_LOGITS_KEY, None, True, None, None, (self.cfg.d_model,)))
            g.outputs = snapshot(traced)
            plans.append(self.plan(g, rows, prompt))

        def finish(outcomes: list) -> object:
            if computed:
                outcomes = self.fire_computed(computed, source_reads, plans, outcomes, mask != 0)
            logits = nll = None
            hooked_logits = UNEMBED_OUT in computed  # hooks change the logits, on the host, before any loss
            want_logits = return_type in ("logits", "both") or hooked_logits
            want_nll = return_type in ("loss", "both") and not hooked_logits
            device = self.engine.device  # results where TransformerLens puts them: the model's device and dtype
            if want_logits or want_nll:
                logits = (torch.empty(tokens.shape + (self.cfg.d_vocab,), dtype=self.cfg.dtype, device=device)
                          if want_logits else None)
                nll = torch.empty(tokens.shape[0], tokens.shape[1] - 1, device=device) if want_nll else None
                for g, outcome in zip(groups, outcomes):
                    g_logits, g_nll = self.engine.unembed(outcome.results.result(_LOGITS_KEY),
                                                          tokens[g.rows, 1:] if want_nll else None, want_logits)
                    if want_logits:
                        logits[g.rows] = g_logits
                    if want_nll:
                        nll[g.rows] = g_nll
            if hooked_logits:  # the logits are the call's result: changed here, on the host
                logits = self.call_hooks(UNEMBED_OUT, computed[UNEMBED_OUT], logits)
            result = logits if return_type is not None else None
            if return_type in ("loss", "both"):
                nll = _next_token_nll(logits.float(), tokens.to(device)) if nll is None else nll
                loss = _masked_loss(nll, mask.to(device), loss_per_token).to(self.cfg.dtype)
                result = loss if return_type == "loss" else (logits, loss)
            if selection is None:
                return result
            for g, outcome in zip(groups, outcomes):
                g.outputs.update(resident_reads(self.registry, g, outcome.results.app_results,
                                                [places[i] for i in g.rows], tokens.shape[1], self.cfg.dtype)[0])
            return AppRun(result, merged(groups, len(rows.rows), "outputs"), {}, selection)

        return Call(plans, finish)

    def generate(self, rows: Rows, max_new_tokens: int, sampling: dict, apps=None, progress: str | None = None,
                 prompt_writes: dict | None = None, output_logits: bool = False):
        """Generate from the rows with the hooks on the hook points (traced for the prompt and for
        generated tokens): each row's prompt and new tokens, with apps an AppRun's outputs, and with
        `output_logits` the logits each new token was sampled from (step_logits), else None.
        `prompt_writes` (hook point -> [batch, pos, ...] value) are written on the prompt before any
        hook there: generating from embeddings writes them at hook_embed."""
        P = rows.tokens.shape[1]
        self.check_length(max(len(r) for r in rows.rows) + max_new_tokens)
        selection = self.registry.selection(apps, len(rows.rows))
        self.sync_resident(selection)
        computed = self.computed_hooks()  # fired after generation, on the generated tokens
        groups = self.groups(selection, len(rows.rows))
        plans = []
        for g in groups:
            traced = self.traced_apps(g)
            written = [App("prompt-writes", [(name, _writer(value[g.rows])) for name, value in (prompt_writes or {}).items()])]
            with attached(self.hook_dict, traced):
                with attached(self.hook_dict, written):
                    prompt = self.trace_hooks(len(g.rows), P)
                g.outputs = snapshot(traced)
                decode = self.trace_hooks(len(g.rows), 1, inherited=prompt.per_request_stores, phase="decode")
                g.generated_outputs = snapshot(traced)
            plan = self.plan(g, rows, prompt, decode, max_new_tokens, sampling)
            if selection is None and not (prompt_writes or computed or output_logits):
                plan = self._resident_call(plan)
            plans.append(plan)
        writing = {name for plan in plans for phase in (plan.prompt, plan.decode)
                   for name, ops in phase.ops.items() if any(op.writes for op in ops)}
        writing -= set(prompt_writes or ())
        if (computed or output_logits) and (selection or writing):
            why = "apps are selected" if selection else f"hooks write at {sorted(writing)}"
            asked = f"hooks on {list(computed)} fire" if computed else "output_logits works"
            raise ValueError(f"{asked} in generate only when nothing else changes the pass (computed after it, from "
                             f"a pass over the generated tokens), but {why}: use run_with_hooks on the generated tokens")
        full: list = [None] * len(rows.rows)
        try:
            outcomes = self.run(plans, progress=progress)
        finally:
            for plan in plans:
                if plan.apps and plan.apps[0] and plan.apps[0][0] in self.resident_calls:
                    self.resident_calls.release(plan.apps[0][0])
        for g, plan, outcome in zip(groups, plans, outcomes):
            for row, new in zip(g.rows, outcome.tokens):
                full[row] = rows.rows[row] + list(new)
            prompt_reads, newest_reads = resident_reads(self.registry, g, outcome.results.app_results,
                                                        plan.places, P, self.cfg.dtype, generating=True)
            g.outputs.update(prompt_reads)
            g.generated_outputs.update(newest_reads)
        if computed:
            self.fire_computed_in_generated(computed, rows.rows, full)
        step_logits = self.step_logits(rows.rows, full, prompt_writes) if output_logits else None
        if selection is None:
            return full, None, step_logits
        B = len(rows.rows)
        run = AppRun(None, merged(groups, B, "outputs"), merged(groups, B, "generated_outputs"), selection)
        return full, run, step_logits

    def _resident_call(self, plan: PassPlan) -> PassPlan:
        """The plan with its hooks as a resident app that its rows select, where they are per token
        (resident_calls.py: then its steps can run inside CUDA graphs); else the plan as it is."""
        name = self.resident_calls.acquire(plan.prompt, plan.decode)
        if name is None:
            return plan
        prompt, decode = (dataclasses.replace(phase, ops={}) for phase in (plan.prompt, plan.decode))
        return dataclasses.replace(plan, prompt=prompt, decode=decode, apps=[(name,)] * len(plan.rows))

    def check_length(self, n: int) -> None:
        limit = self.engine.max_model_len
        if n > limit:
            raise ValueError(f"a request needs {n} positions; this engine's max_model_len is {limit} "
                             f"(from_pretrained(max_model_len=...))")

    # --- tracing and planning ---------------------------------------------------------------------
    def trace_hooks(self, B: int, P: int, inherited=None, phase: str = "prefill",
                    hooks: dict[str, list[HookFn]] | None = None, params: dict | None = None) -> PhaseOps:
        """Trace every hook function once for this view of the pass, in firing order, then lower
        each hook point. `inherited`: the prompt's per-request stores, seen by generated tokens.
        `hooks`: hook point -> functions; by default those on the hook points. `params`: the values
        of app parameters traced as graph inputs (trace.as_parameters)."""
        if hooks is None:
            hooks = {name: [h.hook for h in hp.fwd_hooks] for name, hp in self.hook_dict.items()}
        session = TraceSession(B, P, inherited=dict(inherited or {}))
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

    def lower_app(self, name: str, fwd_hooks: Iterable[HookSpec], params: dict | None = None) -> PhaseOps:
        """An installed app's hooks, traced for a pass of RESIDENT_TRACE_LEN positions (they run on
        every token of the requests that select them) and lowered in the engine's resident form
        (lowered.resident_form). Only these hooks are traced, whatever else is on the hook points.
        With `params` (the App's), each parameter is a named input of the graphs, so that new values
        are lowered again from the graphs without calling the hooks."""
        hooks: dict[str, list[HookFn]] = {}
        for point, fn in self.root.resolve_hooks(fwd_hooks, ()):
            if hook_points.is_computed(point):
                raise ValueError(f"app {name!r}: {point} is computed per call from the pass's reads "
                                 f"(xmix_lens/attention_points.py), so it cannot run inside the engine as an app; "
                                 f"run that hook with run_with_hooks")
            hooks.setdefault(point, []).append(fn)
        with traced_once_for(f"app {name!r}'s every request (an installed app is traced once)"):
            if params:
                values = {key: value.detach().clone() for key, value in params.items()}
                with as_parameters(params):
                    traced = self.trace_hooks(1, RESIDENT_TRACE_LEN, hooks=hooks, params=values)
            else:
                traced = self.trace_hooks(1, RESIDENT_TRACE_LEN, hooks=hooks)
        traced.ops = resident_form(traced.ops)
        return traced

    def groups(self, selection: list[tuple[str, ...]] | None, n_rows: int) -> list[RowGroup]:
        """One group of rows per app subset (all rows, no apps, without a selection)."""
        groups = group_rows(selection or [()] * n_rows)
        if len(groups) > 1 and any(hp.fwd_hooks for hp in self.hook_dict.values()):
            # each pass traces the other hooks again: what they keep would hold only the last pass's rows
            raise ValueError("requests of one call select different apps while other hooks are on the hook points "
                             "(fwd_hooks, add_hook, run_with_cache); put those hooks in an App, or use run_batch with "
                             "one (input, fwd_hooks, apps) entry per app subset")
        return groups

    def traced_apps(self, g: RowGroup) -> list[App]:
        """The group's apps that run as traced hooks (the others are resident in the engine)."""
        group_apps = [self.registry.installed[n].app for n in g.apps]
        for app in group_apps:
            app.outputs.clear()
        return [app for app in group_apps if not self.registry.installed[app.name].resident]

    def plan(self, g: RowGroup, rows: Rows, prompt: PhaseOps, decode: PhaseOps | None = None,
             max_new_tokens: int = 1, sampling: dict | None = None) -> PassPlan:
        resident = tuple(n for n in g.apps if self.registry.installed[n].resident)
        return PassPlan([rows.rows[i] for i in g.rows], [rows.places[i] for i in g.rows], prompt, decode,
                        max_new_tokens, sampling or {}, [resident] * len(g.rows) if resident else None, g.rows,
                        [rows.contexts[i] for i in g.rows] if rows.contexts is not None else None)

    # --- running ----------------------------------------------------------------------------------
    def run(self, plans: list[PassPlan], again: bool = False, progress: str | None = None) -> list:
        """Run the passes in the engine; the proxies the hook functions kept become the values read
        (for generated tokens: the last one's). `again`: the plans ran before, so what the hooks kept
        are values already, which take this run's. `progress`: a progress bar of finished rows,
        so described. Returns a PassOutcome (backend/engine.py) per plan."""
        if self.on_nonfinite not in ("raise", "warn", "ignore"):
            raise ValueError(f"model.on_nonfinite = {self.on_nonfinite!r}; use 'raise', 'warn' or 'ignore'")
        outcomes = self.engine.run(plans, progress)
        for plan, outcome in zip(plans, outcomes):
            for key, proxy in plan.prompt.kept + (plan.decode.kept if plan.decode is not None else []):
                value = outcome.results.result(key).to(self.engine.device, self.cfg.dtype)  # (a TP engine's: host)
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

    # --- resident apps ----------------------------------------------------------------------------
    def lower_resident(self, app: App) -> None:
        """The engine's copy of a resident app's tensors, lowered again from its graphs with the
        values in app.params (the hooks are not called) and copied in place: refused, changing
        nothing, if the new values change what its hooks do."""
        record = self.registry.installed[app.name]
        ops = resident_form({g.hook_name: site_ops for g in record.graphs if (site_ops := lower(g, app.params))})
        self.engine.set_app_params(app.name, ops)
        record.lowered_versions = app.param_versions()

    def sync_resident(self, selection: list[tuple[str, ...]] | None) -> None:
        """Resident apps whose params were written in place since they were lowered (app.params[k]
        edited directly) are lowered again before this call uses them."""
        for name in {n for names in selection or () for n in names}:
            record = self.registry.installed[name]
            if record.resident and record.app.param_versions() != record.lowered_versions:
                self.lower_resident(record.app)
                record.app.version += 1

    # --- computed hook points (computed_points.py) ------------------------------------------------
    def computed_hooks(self) -> dict[str, list[HookFn]]:
        """Hooks on computed points, by name, in firing order (a point whose switch is off never fires)."""
        return {name: [h.hook for h in hp.fwd_hooks] for name, hp in self.hook_dict.items()
                if hp.fwd_hooks and hook_points.is_computed(name) and
                (hook_points.switch_of(name) is None or getattr(self.cfg, hook_points.switch_of(name)))}

    def source_reads(self, computed: dict, reads: dict) -> list[tuple[str, HookFn]]:
        """Hooks that keep, into `reads`, each engine hook point the computed points are computed from,
        after the user's hooks there (what the model used)."""
        def keep(act, hook):
            reads[hook.name] = act.detach()

        names = {f"blocks.{self.hook_dict[name].layer()}.{source}" for name in computed if name.startswith("blocks.")
                 for source in computed_points.sources(name.split(".", 2)[2], self.cfg.family)}
        return [(name, keep) for name in self.hook_dict if name in names]

    def fire_computed(self, computed: dict, reads: dict, plans: list[PassPlan], outcomes: list,
                      real: torch.Tensor) -> list:
        """Call the hooks on the computed points of the blocks, in firing order, on the values the pass's
        reads give. After a hook changes one, the pass runs again with what the change implies written
        at engine hook points (computed_points.targets), so that later points see it. Returns the
        outcomes of the last pass."""
        mask = attention_points.allowed(real)
        blocks: dict[int, computed_points.Block] = {}
        writes: dict[str, torch.Tensor] = {}
        for name in self.hook_dict:
            L = self.hook_dict[name].layer() if name.startswith("blocks.") else None
            point = name.split(".", 2)[-1]
            scores_hooked = point == "attn.hook_pattern" and f"blocks.{L}.attn.hook_attn_scores" in computed
            if L is None or not (name in computed or scores_hooked):
                continue
            if L not in blocks:  # its reads are refreshed in place by each further pass (run(again=True))
                blocks[L] = self._block(L, reads, mask)
            block = blocks[L]
            act, used = computed_points.value(point, block)
            act = self.call_hooks(name, computed.get(name, []), act.clone())
            computed_points.hooked(point, block, act)
            if torch.equal(act, used):
                continue
            writes.update({f"blocks.{L}.{target}": value.to(self.cfg.dtype)
                           for target, value in computed_points.targets(point, block, act).items()})
            outcomes = self.run([self._with_writes(plan, writes) for plan in plans], again=True)  # refreshes `reads`
        return outcomes

    def _block(self, L: int, reads: dict[str, torch.Tensor], mask: torch.Tensor) -> computed_points.Block:
        """What computing block L's points needs: its reads (block-relative names), its weights
        (TransformerLens's block, booted only if a write needs them), the config and the attention mask."""
        own = {n.split(".", 2)[2]: act for n, act in reads.items() if n.startswith(f"blocks.{L}.")}
        return computed_points.Block(own, lambda: self.tl_block(L), self.cfg, mask)

    def call_hooks(self, name: str, fns: list[HookFn], act: torch.Tensor) -> torch.Tensor:
        """A computed point's hook functions, called on its value as TransformerLens calls them (a
        returned tensor replaces the act)."""
        for fn in fns:
            out = fn(act, hook=self.hook_dict[name])
            act = act if out is None else out
        return act

    def fire_computed_in_generated(self, computed: dict, prompts: list[list[int]], full: list[list[int]]) -> None:
        """The hooks on computed points in generate, as HookedTransformer's generate (with its KV cache)
        calls them: once on the prompt (act [batch, ..., P, ...], attention [batch, head, P, P]), then
        once per generated token fed back (act [batch, ..., 1, ...], attention [batch, head, 1, keys so
        far]). They are computed from one pass over the prompts and generated tokens, left-padded as
        TransformerLens's generate pads (rows that stopped early continue with padding tokens, as
        there); only reads are allowed (generate checked that nothing writes)."""
        generated, P, steps = self._generated_rows(prompts, full)
        reads: dict[str, torch.Tensor] = {}
        with self.root.silenced(self.hook_dict), self.root.hooks(self.source_reads(computed, reads)):
            call = self.forward_call(generated, "logits" if UNEMBED_OUT in computed else None)
            logits = call.finish(self.run(call.plans))
        allowed = attention_points.allowed(generated.mask != 0)
        values, blocks = {}, {}
        for name in computed:
            if name == UNEMBED_OUT:
                values[name] = logits
                continue
            L, point = self.hook_dict[name].layer(), name.split(".", 2)[2]
            if L not in blocks:
                blocks[L] = self._block(L, reads, allowed)
            values[name] = computed_points.value(point, blocks[L])[0]
        for start, stop in [(0, P)] + [(P + j, P + j + 1) for j in range(steps)]:
            for name, fns in computed.items():
                act = values[name].narrow(computed_points.position_dim(name, self.cfg.family), start, stop - start)
                if name.endswith(("attn.hook_attn_scores", "attn.hook_pattern")):  # keys so far
                    act = act[..., :stop]
                if not torch.equal(self.call_hooks(name, fns, act.clone()), act):
                    raise NotImplementedError(f"a hook on {name} changed it in generate: writes to computed hook "
                                              f"points run in forward passes (run_with_hooks), where a further pass "
                                              f"applies them; generate computes them after generating")

    def step_logits(self, prompts: list[list[int]], full: list[list[int]], prompt_writes: dict | None) -> tuple:
        """TransformerLens's generate(output_logits=True) logits: per new token, [batch, d_vocab], the
        logits it was sampled from (before temperature and top-k/p). Computed from one pass over the
        prompts and generated tokens, laid out as fire_computed_in_generated lays them out (generate
        checked that no hook changes the pass); the hooks are not called again."""
        generated, P, steps = self._generated_rows(prompts, full)
        with self.root.silenced(self.hook_dict):
            call = self.forward_call(generated, "logits")  # no apps: one plan, of every row
            plans = [self._with_writes(plan, prompt_writes) for plan in call.plans] if prompt_writes else call.plans
            logits = call.finish(self.run(plans))
        return tuple(logits[:, P - 1 + j] for j in range(steps + 1))

    def _generated_rows(self, prompts: list[list[int]], full: list[list[int]]) -> tuple[Rows, int, int]:
        """The prompts and their generated tokens but the last, left-padded as TransformerLens's generate
        pads them (rows that stopped early continue with padding tokens, as there): (rows, the padded
        prompt length P, steps), steps being the most new tokens of a row less one."""
        P, steps = max(len(r) for r in prompts), max(len(f) - len(r) for f, r in zip(full, prompts)) - 1
        pad = self.pad_token_id
        tokens = torch.full((len(full), P + steps), pad, dtype=torch.long)
        mask = torch.zeros_like(tokens)
        for b, (row, prompt) in enumerate(zip(full, prompts)):
            seq = (row[: len(prompt) + steps] + [pad] * steps)[: len(prompt) + steps]
            tokens[b, P - len(prompt):], mask[b, P - len(prompt):] = torch.tensor(seq), 1
        return Rows.of(tokens, mask, self.cfg.d_vocab), P, steps

    def _with_writes(self, plan: PassPlan, writes: dict[str, torch.Tensor]) -> PassPlan:
        """The plan with `writes` (hook point -> [batch, pos, ...] value) written at those hook points
        before the ops already there."""
        extra = self.trace_hooks(len(plan.rows), plan.prompt.padded_len,
                                 hooks={name: [_writer(value)] for name, value in writes.items()},
                                 phase="computed writes")
        ops = dict(plan.prompt.ops)
        for name, written in extra.ops.items():
            ops[name] = written + ops.get(name, [])
        return dataclasses.replace(plan, prompt=dataclasses.replace(plan.prompt, ops=ops))


def _writer(value: torch.Tensor):
    """A hook that writes `value` ([batch, pos, ...]) at act's first `pos` positions."""
    def write(act, hook):
        act[:, : value.shape[1]] = value
        return act
    return write


def _next_token_nll(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each position's negative log-likelihood of the next token [B, P - 1] (the engine's `unembed`
    computes the same on its device, where no hook changes the logits)."""
    return -logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]


def _masked_loss(nll: torch.Tensor, mask: torch.Tensor, per_token: bool):
    """TransformerLens's loss: mean negative log-likelihood of each next real token."""
    valid = (mask[:, :-1] * mask[:, 1:]).to(nll.dtype)
    if per_token:
        return nll * valid
    return (nll * valid).sum() / valid.sum()
