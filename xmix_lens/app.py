"""Apps: named, versioned bundles of hooks and parameters, installed in one engine, chosen per request.

    app = xmix_lens.App("joy", fwd_hooks=[("blocks.12.hook_resid_post", steer)], params={"v": v})
    model.install(app)
    run = model.run_with_hooks(prompts, apps=[["joy"], [], ["joy", "probe"]])   # one list per row
    run.result, run.outputs["probe"]["score"]

An App is plain data: `name`, `fwd_hooks` (TransformerLens hook specs), `params` (the tensors its
hooks close over, updated in place by `model.set_params`), `version` (bumped by each update) and
`outputs`, the dict its hooks keep reads in (`app.outputs["score"] = act[:, -1] @ w`). Hooks are
traced per pass, as any hook; an app's reads of one call come back in `AppRun.outputs[app.name]`.

Order at a hook point: the selected apps first, in install order (as TransformerLens runs hooks in
the order they were added), then hooks added to the hook point by other means (`add_hook`,
`hooks()`, a call's own `fwd_hooks`, `run_with_cache`'s caching hooks), which therefore see what
the apps wrote. Which apps a request selects never changes that order.

Rows of one call that select different app subsets become one pass per subset; all passes are in
the engine together (`_run_passes`) and each pass's hooks touch only its own rows.
"""
import contextlib
import functools
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import hook_points

_INSTALL_TRACE_SHAPE = (1, 16)  # the pass an app is traced for at install, to fail early on bad sizes


@dataclass(eq=False)
class App:
    """A named bundle of hooks and their parameter tensors.

    `param_sites` lets install check sizes before anything runs: {param name: (hook point, dim)}
    says that `params[name].shape[dim]` must equal the last feature size of that hook point
    (d_model at residual points, d_head at `attn.hook_z`, ...)."""

    name: str
    fwd_hooks: list = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    param_sites: dict[str, tuple[str, int]] = field(default_factory=dict)
    version: int = 0
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"an app's name is a non-empty string without spaces; got {self.name!r}")
        self.fwd_hooks = list(self.fwd_hooks)
        for spec in self.fwd_hooks:
            if not (isinstance(spec, tuple) and len(spec) == 2 and callable(spec[1])):
                raise ValueError(f"app {self.name!r}: each fwd_hook is (hook name or filter, function); got {spec!r}")
        for key, value in self.params.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"app {self.name!r}: param {key!r} must be a tensor, got {type(value).__name__}")
        for key in self.param_sites:
            if key not in self.params:
                raise ValueError(f"app {self.name!r}: param_sites names {key!r}, which is not in params "
                                 f"{sorted(self.params)}")

    def set_params(self, **values) -> int:
        """Copy new values into the parameter tensors (the hooks see them from the next call on);
        returns the new version."""
        for key, value in values.items():
            if key not in self.params:
                raise KeyError(f"app {self.name!r} has no param {key!r}; its params: {sorted(self.params)}")
            value = torch.as_tensor(value)
            if value.shape != self.params[key].shape:
                raise ValueError(f"app {self.name!r}: param {key!r} is {list(self.params[key].shape)}, the new value "
                                 f"is {list(value.shape)}; pass a tensor of the same shape (or build a new App)")
        for key, value in values.items():
            self.params[key].copy_(torch.as_tensor(value))
        self.version += 1
        return self.version


class AppRun(NamedTuple):
    """What a call with apps returns: `result` is what the call returns without apps (logits,
    tokens, text, ...); `outputs[app][key]` holds each app's reads, batch-first over the call's
    rows (NaN in rows that did not select the app). For generate, `outputs` are the prompt's
    reads and `generated_outputs` those kept while generating (the last token's)."""

    result: object
    outputs: dict
    generated_outputs: dict
    selection: list  # per row: the names of the apps it ran, in install order


class _Registry:
    """The apps installed in one model and the default selection (`activate`)."""

    def __init__(self):
        self.apps: dict[str, App] = {}  # install order
        self.active_all: set[str] = set()  # active for every row of a call without apps=
        self.active_rows: dict[int, set[str]] = {}  # active for these rows of such calls
        # apps whose ops are resident in the engine (graph-safe; backend/vllm/control.py):
        # name -> {read key: (output name, per-token feature shape)}
        self.resident: dict[str, dict] = {}

    def check_names(self, names: Iterable[str], where: str) -> list[str]:
        names = [names] if isinstance(names, str) else list(names)
        for name in names:
            if name not in self.apps:
                raise ValueError(f"{where} names app {name!r}, which is not installed (installed: {list(self.apps)}); "
                                 f"install it first with model.install(app), or fix the name")
        return names

    def ordered(self, names: Iterable[str]) -> tuple[str, ...]:
        wanted = set(names)
        return tuple(n for n in self.apps if n in wanted)

    def selection(self, apps, n_rows: int) -> list[tuple[str, ...]] | None:
        """Each row's apps in install order, or None when no row runs any app."""
        if apps is None:
            if not self.active_all and not self.active_rows:
                return None
            rows = [self.ordered(self.active_all | self.active_rows.get(i, set())) for i in range(n_rows)]
        elif isinstance(apps, str) or all(isinstance(a, str) for a in apps):
            rows = [self.ordered(self.check_names(apps, "apps="))] * n_rows
        else:
            apps = list(apps)
            if len(apps) != n_rows:
                raise ValueError(f"apps= has {len(apps)} per-request lists for {n_rows} requests; pass one list per "
                                 f"request, or one list of names for all")
            rows = [self.ordered(self.check_names(a, f"request {i}'s apps=")) for i, a in enumerate(apps)]
        return rows if any(rows) else None


def registry(model) -> _Registry:
    return model.__dict__.setdefault("_app_registry", _Registry())


# --- installing, activating, parameters ------------------------------------------------------------
def install(model, app: App) -> App:
    """Check an app against this model (hook names, parameter sizes, that it traces) and install it."""
    reg = registry(model)
    if not isinstance(app, App):
        raise TypeError(f"install takes an xmix_lens.App, got {type(app).__name__}")
    if app.name in reg.apps:
        raise ValueError(f"an app named {app.name!r} is already installed; uninstall it first, or change its "
                         f"parameters with model.set_params({app.name!r}, ...)")
    for hook_name, _ in app.fwd_hooks:
        try:
            hook_points.resolve(model.hook_dict, hook_name)
        except ValueError as e:
            raise ValueError(f"app {app.name!r}: {e}") from None
    for key, (hook_name, dim) in app.param_sites.items():
        (site,) = hook_points.resolve(model.hook_dict, hook_name)
        want, shape = model.feature_shapes[site][-1], tuple(app.params[key].shape)
        if len(shape) <= dim or shape[dim] != want:
            raise ValueError(f"app {app.name!r}: param {key!r} has shape {list(shape)}, but {site} carries {want} "
                             f"features per token (act is {list(_INSTALL_TRACE_SHAPE + model.feature_shapes[site])}), "
                             f"so dim {dim} must be {want}; build the app from vectors of this model at this hook point")
    _check_traces(model, app)
    reg.apps[app.name] = app
    _make_resident(model, app)
    return app


def _make_resident(model, app: App) -> None:
    """Install the app's ops in the engine itself when its hooks are per token (no position
    selection, no stores, no per-token tables): selected per request by buffer writes, inside the
    engine's CUDA graphs when it was built with the app (`from_pretrained(apps=...)`). Other apps
    are traced into each call's passes."""
    from .trace import TraceError

    reg = registry(model)
    try:
        ops, kept = model._lower_app(app.name, app.fwd_hooks)
        names = {id(value): key for key, value in app.outputs.items()}
        if any(id(proxy) not in names for _, proxy in kept):
            return  # it keeps values elsewhere than in app.outputs: only a traced pass returns them
        reads = {key: (names[id(proxy)], tuple(proxy.shape[2:])) for key, proxy in kept}
        if app.name not in model.runtime.installed:  # from_pretrained(apps=...) installed it already
            model.runtime.install_app(app.name, ops)
        reg.resident[app.name] = reads
    except (TraceError, ValueError, NotImplementedError):
        return  # not per token: run per call
    finally:
        app.outputs.clear()


def _check_traces(model, app: App) -> None:
    """Trace the app alone, for a prompt and for generated tokens, so errors surface at install."""
    from .trace import TraceError

    try:
        with _attached(model, [app]):
            prompt = model._trace_hooks(*_INSTALL_TRACE_SHAPE)
            model._trace_hooks(_INSTALL_TRACE_SHAPE[0], 1, inherited=prompt.per_request_stores, phase="decode")
    except (TraceError, KeyError, ValueError, RuntimeError) as e:
        sizes = {k: list(v.shape) for k, v in app.params.items()}
        raise ValueError(f"app {app.name!r} does not trace on this model ({e}); its params have shapes {sizes}: "
                         f"check that they match the hook points' sizes (docs/hook-points.md)") from e
    finally:
        app.outputs.clear()


def uninstall(model, name: str) -> App:
    reg = registry(model)
    reg.check_names([name], "uninstall")
    reg.active_all.discard(name)
    for names in reg.active_rows.values():
        names.discard(name)
    if reg.resident.pop(name, None) is not None:
        model.runtime.uninstall_app(name)
    return reg.apps.pop(name)


def activate(model, names, requests: Iterable[int] | None = None) -> None:
    """Make apps run by default in calls that pass no `apps=`: for every request, or for the rows
    of each call whose indices are in `requests`."""
    reg = registry(model)
    names = reg.check_names(names, "activate")
    if requests is None:
        reg.active_all.update(names)
    else:
        for row in requests:
            reg.active_rows.setdefault(int(row), set()).update(names)


def deactivate(model, names=None, requests: Iterable[int] | None = None) -> None:
    """Undo `activate`: these apps (all, if names is None), for every request or for these rows."""
    reg = registry(model)
    names = set(reg.apps if names is None else reg.check_names(names, "deactivate"))
    if requests is None:
        reg.active_all -= names
        for row_names in reg.active_rows.values():
            row_names -= names
    else:
        for row in requests:
            reg.active_rows.get(int(row), set()).difference_update(names)
    reg.active_rows = {row: n for row, n in reg.active_rows.items() if n}


def set_params(model, name: str, **values) -> int:
    reg = registry(model)
    reg.check_names([name], "set_params")
    app = reg.apps[name]
    version = app.set_params(**values)
    if name in reg.resident:  # the engine's copies of the lowered tensors, updated in place
        try:
            model.runtime.set_app_params(name, model._lower_app(name, app.fwd_hooks)[0])
        finally:
            app.outputs.clear()
    return version


# --- running calls with apps -------------------------------------------------------------------
@contextlib.contextmanager
def _attached(model, apps: Sequence[App]):
    """The apps' hooks put in front of each hook point's hooks (in install order) for the block."""
    added = []
    try:
        for app in reversed(apps):
            for spec_name, fn in reversed(app.fwd_hooks):
                for name in reversed(hook_points.resolve(model.hook_dict, spec_name)):
                    hp = model.hook_dict[name]
                    hp.add_hook(fn, prepend=True)
                    added.append((hp, hp.fwd_hooks[0]))
        yield
    finally:
        for hp, handle in added:
            if handle in hp.fwd_hooks:
                hp.fwd_hooks.remove(handle)


@dataclass
class _Group:
    """The rows of one call that select the same apps: one pass."""

    apps: tuple[str, ...]
    rows: list[int]
    outputs: dict = field(default_factory=dict)  # app -> {key: value}, the prompt trace's
    generated_outputs: dict = field(default_factory=dict)


def _groups(model, selection: list[tuple[str, ...]]) -> list[_Group]:
    groups: dict[tuple[str, ...], _Group] = {}
    for row, names in enumerate(selection):
        groups.setdefault(names, _Group(names, [])).rows.append(row)
    if len(groups) > 1 and any(hp.fwd_hooks for hp in model.hook_dict.values()):
        # each pass traces the other hooks again: what they keep would hold only the last pass's rows
        raise ValueError("requests of one call select different apps while other hooks are on the hook points "
                         "(fwd_hooks, add_hook, run_with_cache); put those hooks in an App, or use run_batch with "
                         "one (input, fwd_hooks, apps) entry per app subset")
    return list(groups.values())


def _snapshot(apps: Sequence[App]) -> dict:
    out = {app.name: dict(app.outputs) for app in apps}
    for app in apps:
        app.outputs.clear()
    return out


def _merged(groups: list[_Group], n_rows: int, which: str) -> dict:
    """Per app and key, the groups' values placed at their rows; NaN where a row lacks the app."""
    merged: dict[str, dict[str, torch.Tensor]] = {}
    for g in groups:
        for app_name, values in getattr(g, which).items():
            for key, value in values.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != len(g.rows):
                    raise ValueError(f"app {app_name!r} kept outputs[{key!r}] of shape "
                                     f"{list(getattr(value, 'shape', []))}; app outputs are batch-first "
                                     f"([batch, ...]), e.g. act[:, -1] @ w")
                slot = merged.setdefault(app_name, {}).get(key)
                if slot is None:
                    slot = torch.full((n_rows,) + tuple(value.shape[1:]), float("nan"), dtype=value.dtype)
                    merged[app_name][key] = slot
                slot[g.rows] = value.to("cpu")
    return merged


def _forward_plan(model, input, return_type, prepend_bos, padding_side, attention_mask, loss_per_token, apps):
    """Jobs for one forward call with apps, and the function that assembles its result; or None
    when no row runs an app. Everything is checked and traced before anything runs."""
    from .model import _next_token_loss

    if return_type not in ("logits", "loss", "both", None):
        raise ValueError(f"return_type {return_type!r}: use 'logits', 'loss', 'both' or None")
    tokens, mask, rows, offsets = model._rows(input, prepend_bos, padding_side, attention_mask)
    reg = registry(model)
    selection = reg.selection(apps, len(rows))
    if selection is None:
        return None
    groups = _groups(model, selection)
    jobs, runs = [], []
    for g in groups:
        group_apps = [reg.apps[n] for n in g.apps]
        traced = [app for app in group_apps if app.name not in reg.resident]
        for app in group_apps:
            app.outputs.clear()
        with _attached(model, traced):
            # the full batch's padded width, so that every group's logits and reads line up
            job = model._forward_job(tokens[g.rows], "logits" if return_type else None, attention_mask=mask[g.rows])
        jobs.append(job)
        runs.append(job.run + ([_resident_names(reg, g.apps)] * len(g.rows),))
        g.outputs = _snapshot(traced)

    def finish(passes) -> AppRun:
        logits = None
        for g, job, p in zip(groups, jobs, passes):
            part = job.finish(p)
            if part is not None:
                if logits is None:
                    logits = torch.empty((len(rows),) + tuple(part.shape[1:]), dtype=part.dtype)
                logits[g.rows] = part
            g.outputs.update(_resident_reads(model, g, p.app_results, [offsets[i] for i in g.rows],
                                             tokens.shape[1])[0])
        result = logits
        if return_type in ("loss", "both"):
            loss = _next_token_loss(logits, tokens, mask, loss_per_token)
            result = loss if return_type == "loss" else (logits, loss)
        return AppRun(result, _merged(groups, len(rows), "outputs"), {}, selection)

    return runs, finish


def _resident_names(reg: _Registry, names) -> frozenset:
    return frozenset(n for n in names if n in reg.resident)


def _resident_reads(model, g: _Group, results: list[dict], offsets: list[int], width: int,
                    prompt_lens: list[int] | None = None) -> tuple[dict, dict]:
    """A group's reads by resident apps, shaped as the traced path returns them: per app and
    output, [rows, width, *features] at padded prompt positions (zero where a row has no token)
    and, when generating (prompt_lens given), [rows, 1, *features] for the newest token read."""
    reg, prompt, generated = registry(model), {}, {}
    for name in _resident_names(reg, g.apps):
        for key, (output, features) in reg.resident[name].items():
            at_prompt = torch.zeros(len(g.rows), width, *features, dtype=model.cfg.dtype)
            newest = torch.zeros(len(g.rows), 1, *features, dtype=model.cfg.dtype)
            for i, per_row in enumerate(results):
                if (name, key) not in per_row:
                    continue
                positions, values = per_row[(name, key)]
                values = values.reshape(len(values), *features).to(model.cfg.dtype)
                in_prompt = positions < (prompt_lens[i] if prompt_lens else width - offsets[i])
                at_prompt[i, positions[in_prompt] + offsets[i]] = values[in_prompt]
                if prompt_lens and not bool(in_prompt.all()):
                    newest[i, 0] = values[-1]  # positions are sorted: the last is the newest token's
            prompt.setdefault(name, {})[output] = at_prompt
            generated.setdefault(name, {})[output] = newest
    return prompt, generated


def with_apps_forward(original: Callable) -> Callable:
    """forward (and so __call__, run_with_hooks, run_with_cache) with an `apps=` keyword."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(model, *args, apps=None, **kwargs):
        a = signature.bind(model, *args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        plan = _forward_plan(model, a["input"], a["return_type"], a["prepend_bos"], a["padding_side"],
                             a["attention_mask"], a["loss_per_token"], apps)
        if plan is None:
            return original(model, *args, **kwargs)
        runs, finish = plan
        return finish([p for p, _ in model._run_passes(runs)])

    return forward


def with_apps_run_batch(original: Callable) -> Callable:
    """run_batch whose requests may be (input, fwd_hooks, apps) triples."""

    @functools.wraps(original)
    def run_batch(model, requests, return_type="logits", **kwargs):
        requests = [tuple(r) for r in requests]
        for i, r in enumerate(requests):
            if len(r) not in (2, 3):
                raise ValueError(f"request {i}: use (input, fwd_hooks) or (input, fwd_hooks, apps); got {len(r)} items")
        reg = registry(model)
        if all(len(r) == 2 for r in requests) and not reg.active_all and not reg.active_rows:
            return original(model, requests, return_type, **kwargs)
        plans = []
        for input, fwd_hooks, *apps in requests:
            with model.hooks(fwd_hooks):
                plan = _forward_plan(model, input, return_type, kwargs.get("prepend_bos"), kwargs.get("padding_side"),
                                     kwargs.get("attention_mask"), kwargs.get("loss_per_token", False),
                                     apps[0] if apps else None)
                if plan is None:  # no app in this request: a plain pass, returned as run_with_hooks would
                    job = model._forward_job(input, return_type, **kwargs)
                    plan = ([job.run], lambda passes, job=job: job.finish(passes[0]))
            plans.append(plan)
        passes = [p for p, _ in model._run_passes([run for runs, _ in plans for run in runs])]
        results, at = [], 0
        for runs, finish in plans:
            results.append(finish(passes[at: at + len(runs)]))
            at += len(runs)
        return results

    return run_batch


def with_apps_generate(original: Callable) -> Callable:
    """generate with an `apps=` keyword; returns an AppRun when any row runs an app."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(model, *args, apps=None, **kwargs):
        bound = signature.bind(model, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a["return_type"] not in ("input", "str", "tokens") or a["max_new_tokens"] < 1:
            return original(model, *args, **kwargs)  # its own clear errors
        input = a["input"]
        tokens, _, rows, offsets = model._rows(input, a["prepend_bos"], a["padding_side"], None)
        reg = registry(model)
        selection = reg.selection(apps, len(rows))
        if selection is None:
            return original(model, *args, **kwargs)
        model._check_length(max(len(r) for r in rows) + a["max_new_tokens"])
        sampling = _sampling(a)
        B, P = tokens.shape
        with model.hooks(a["fwd_hooks"]):
            groups = _groups(model, selection)
            jobs = []
            for g in groups:
                group_apps = [reg.apps[n] for n in g.apps]
                traced = [app for app in group_apps if app.name not in reg.resident]
                for app in group_apps:
                    app.outputs.clear()
                with _attached(model, traced):
                    prompt = model._trace_hooks(len(g.rows), P)
                    g.outputs = _snapshot(traced)
                    step = model._trace_hooks(len(g.rows), 1, inherited=prompt.per_request_stores, phase="decode")
                    g.generated_outputs = _snapshot(traced)
                jobs.append(([rows[i] for i in g.rows], [offsets[i] for i in g.rows], prompt, step,
                             a["max_new_tokens"], sampling, [_resident_names(reg, g.apps)] * len(g.rows)))
        new_tokens: list = [None] * B
        for g, job, (p, outs) in zip(groups, jobs, model._run_passes(jobs)):
            for row, out in zip(g.rows, outs):
                new_tokens[row] = list(out)
            prompt_reads, newest_reads = _resident_reads(model, g, p.app_results, job[1], P, [len(r) for r in job[0]])
            g.outputs.update(prompt_reads)
            g.generated_outputs.update(newest_reads)
        full = [r + t for r, t in zip(rows, new_tokens)]
        return AppRun(_format_generated(model, input, full, a["return_type"]), _merged(groups, B, "outputs"),
                      _merged(groups, B, "generated_outputs"), selection)

    return generate


def _sampling(a: dict) -> dict:
    """The same sampling settings HookedServedModel.generate passes to the engine."""
    do_sample = a["do_sample"]
    sampling = {"temperature": a["temperature"] if do_sample else 0.0, "top_k": a["top_k"] if do_sample and a["top_k"] else 0,
                "top_p": a["top_p"] if do_sample and a["top_p"] else 1.0, "seed": a["seed"],
                "ignore_eos": not a["stop_at_eos"]}
    if a["eos_token_id"] is not None:
        sampling["stop_token_ids"] = [a["eos_token_id"]]
    return sampling


def _format_generated(model, input, full: list[list[int]], return_type: str):
    """As HookedServedModel.generate returns: text for text input, else padded token rows."""
    text_in = not isinstance(input, torch.Tensor) and (isinstance(input, str) or isinstance(input[0], str))
    if return_type == "str" or (return_type == "input" and text_in):
        texts = [model.tokenizer.decode(t) for t in full]
        return texts[0] if isinstance(input, str) else texts
    out = torch.full((len(full), max(len(t) for t in full)), model.tokenizer.pad_token_id, dtype=torch.long)
    for i, t in enumerate(full):
        out[i, : len(t)] = torch.tensor(t)
    return out
