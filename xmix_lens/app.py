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

Rows of one call that select different app subsets become one pass per subset (`RowGroup`); all
passes are in the engine together and each pass's hooks touch only its own rows. The model's own
methods (model.py) plan those passes; this module holds the App, the registry of a model's apps,
and how a call's per-group results are put back together.
"""
import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import hook_points


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
    # scalar params a served request may set, with their bounds: {param: (lowest, highest)} (export
    # checks that each changes only what a request's value can: docs/serving.md)
    request_params: dict[str, tuple[float, float]] = field(default_factory=dict)
    # the models it is installed in (model.install / uninstall keep this)
    installed_in: list = field(default_factory=list, init=False, repr=False)

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
        for key, bounds in self.request_params.items():
            value = self.params.get(key)
            if value is None or value.numel() != 1 or not value.is_floating_point():
                raise ValueError(f"app {self.name!r}: request_params names {key!r}, which is not a scalar float param")
            lo, hi = (float(b) for b in bounds)
            if not lo <= float(value) <= hi:
                raise ValueError(f"app {self.name!r}: request param {key!r} is {float(value)}, outside its bounds "
                                 f"[{lo}, {hi}]")
        for key in self.param_sites:
            if key not in self.params:
                raise ValueError(f"app {self.name!r}: param_sites names {key!r}, which is not in params "
                                 f"{sorted(self.params)}")

    def set_params(self, **values) -> int:
        """Copy new values into the parameter tensors; returns the new version. Every model the app
        is installed in uses them from its next call on (model.set_params); all values are checked
        before any is copied, and nothing changes if one is refused."""
        if self.installed_in:
            for model in self.installed_in:
                version = model.set_params(self.name, **values)
            return version
        self.write_params(self.checked_params(values))
        self.version += 1
        return self.version

    def checked_params(self, values: dict) -> dict[str, torch.Tensor]:
        """New parameter values as tensors, each checked (name, shape, finite); nothing is changed."""
        checked = {}
        for key, value in values.items():
            if key not in self.params:
                raise KeyError(f"app {self.name!r} has no param {key!r}; its params: {sorted(self.params)}")
            try:
                value = torch.as_tensor(value, dtype=self.params[key].dtype)
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"app {self.name!r}: param {key!r} takes a tensor (or number) of "
                                 f"{self.params[key].dtype}; got {type(value).__name__} ({e})") from None
            if value.shape != self.params[key].shape:
                raise ValueError(f"app {self.name!r}: param {key!r} is {list(self.params[key].shape)}, the new value "
                                 f"is {list(value.shape)}; pass a tensor of the same shape (or build a new App)")
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise ValueError(f"app {self.name!r}: the new value of param {key!r} has NaN or infinite entries; "
                                 "parameters must be finite")
            checked[key] = value
        return checked

    def write_params(self, values: dict[str, torch.Tensor]) -> None:
        for key, value in values.items():
            self.params[key].copy_(value)

    def param_versions(self) -> tuple:
        """The tensors' in-place version counters: they change when anyone writes into a param."""
        return tuple(t._version for t in self.params.values())


class AppRun(NamedTuple):
    """What a call with apps returns: `result` is what the call returns without apps (logits,
    tokens, text, ...); `outputs[app][key]` holds each app's reads, batch-first over the call's
    rows (NaN in rows that did not select the app). For generate, `outputs` are the prompt's
    reads and `generated_outputs` those kept while generating (the last token's)."""

    result: object
    outputs: dict
    generated_outputs: dict
    selection: list  # per row: the names of the apps it ran, in install order


@dataclass
class InstalledApp:
    """One app installed in one model: the App, and how the engine runs it."""

    app: App
    # resident in the engine (graph-safe; backend/control.py): {read key: ResidentRead}; None: its
    # hooks are traced into each call's passes
    reads: dict | None = None
    # a resident app's graphs, its parameters as named inputs: set_params lowers them again
    graphs: list = field(default_factory=list)
    # the app's param_versions() when its resident ops were last lowered: a write into app.params in
    # place is seen, and the engine's copy updated, before the next call uses it
    lowered_versions: tuple = ()
    # {param: (lowest, highest)}: what a request may set for itself (apps from an app config, whose
    # request params the engine holds per-request tables for: backend/control.py)
    request_params: dict = field(default_factory=dict)

    @property
    def resident(self) -> bool:
        return self.reads is not None


class AppRegistry:
    """The apps installed in one model and the default selection (`activate`)."""

    def __init__(self):
        self.installed: dict[str, InstalledApp] = {}  # install order
        self.active_all: set[str] = set()  # active for every row of a call without apps=
        self.active_rows: dict[int, set[str]] = {}  # active for these rows of such calls

    @property
    def apps(self) -> dict[str, App]:
        return {name: record.app for name, record in self.installed.items()}

    @property
    def resident(self) -> dict[str, dict]:
        """name -> {read key: ResidentRead} of the apps resident in the engine."""
        return {name: record.reads for name, record in self.installed.items() if record.resident}

    def check_names(self, names: Iterable[str], where: str) -> list[str]:
        names = [names] if isinstance(names, str) else list(names)
        for name in names:
            if name not in self.installed:
                raise ValueError(f"{where} names app {name!r}, which is not installed (installed: {list(self.apps)}); "
                                 f"install it first with model.install(app), or fix the name")
        return names

    def ordered(self, names: Iterable[str]) -> tuple[str, ...]:
        wanted = set(names)
        return tuple(n for n in self.installed if n in wanted)

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

    def activate(self, names, requests: Iterable[int] | None = None) -> None:
        """Make apps run by default in calls that pass no `apps=`: for every request, or for the rows
        of each call whose indices are in `requests`."""
        names = self.check_names(names, "activate")
        if requests is None:
            self.active_all.update(names)
        else:
            for row in requests:
                self.active_rows.setdefault(int(row), set()).update(names)

    def deactivate(self, names=None, requests: Iterable[int] | None = None) -> None:
        """Undo `activate`: these apps (all, if names is None), for every request or for these rows."""
        names = set(self.installed if names is None else self.check_names(names, "deactivate"))
        if requests is None:
            self.active_all -= names
            for row_names in self.active_rows.values():
                row_names -= names
        else:
            for row in requests:
                self.active_rows.get(int(row), set()).difference_update(names)
        self.active_rows = {row: n for row, n in self.active_rows.items() if n}


@contextlib.contextmanager
def attached(hook_dict: dict, apps: Sequence[App]):
    """The apps' hooks put in front of each hook point's hooks (in install order) for the block."""
    added = []
    try:
        for app in reversed(apps):
            for spec_name, fn in reversed(app.fwd_hooks):
                for name in reversed(hook_points.resolve(hook_dict, spec_name)):
                    hp = hook_dict[name]
                    hp.add_hook(fn, prepend=True)
                    added.append((hp, hp.fwd_hooks[0]))
        yield
    finally:
        for hp, handle in added:
            if handle in hp.fwd_hooks:
                hp.fwd_hooks.remove(handle)


@dataclass
class RowGroup:
    """The rows of one call that select the same apps: one pass."""

    apps: tuple[str, ...]
    rows: list[int]
    outputs: dict = field(default_factory=dict)  # app -> {key: value}, the prompt trace's
    generated_outputs: dict = field(default_factory=dict)


def group_rows(selection: list[tuple[str, ...]]) -> list[RowGroup]:
    groups: dict[tuple[str, ...], RowGroup] = {}
    for row, names in enumerate(selection):
        groups.setdefault(names, RowGroup(names, [])).rows.append(row)
    return list(groups.values())


def snapshot(apps: Sequence[App]) -> dict:
    """What the apps' hooks kept while being traced, taken out of their `outputs`."""
    out = {app.name: dict(app.outputs) for app in apps}
    for app in apps:
        app.outputs.clear()
    return out


def merged(groups: list[RowGroup], n_rows: int, which: str) -> dict:
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


def resident_reads(registry: AppRegistry, g: RowGroup, results: list[dict], places: list, width: int,
                   dtype: torch.dtype, generating: bool = False) -> tuple[dict, dict]:
    """A group's reads by resident apps, shaped as the traced path returns them: per app and
    output, [rows, width, *features] at padded prompt positions (`places`: per row, each real token's;
    zero where a row has no token) and, when `generating`, [rows, 1, *features] for the newest token
    read; a read of the last position (`act[:, -1]`: ResidentRead.last) without the position dim, as there."""
    prompt, generated = {}, {}
    for name in g.apps:
        for key, (output, features, last) in (registry.installed[name].reads or {}).items():
            at_prompt = torch.zeros(len(g.rows), width, *features, dtype=dtype)
            newest = torch.zeros(len(g.rows), 1, *features, dtype=dtype)
            for i, per_row in enumerate(results):
                if (name, key) not in per_row:
                    continue
                positions, values = per_row[(name, key)]
                values = values.reshape(len(values), *features).to(dtype)
                in_prompt = positions < len(places[i])
                at_prompt[i, places[i][positions[in_prompt]]] = values[in_prompt]
                if generating and not bool(in_prompt.all()):
                    newest[i, 0] = values[-1]  # positions are sorted: the last is the newest token's
            prompt.setdefault(name, {})[output] = at_prompt[:, -1] if last else at_prompt
            generated.setdefault(name, {})[output] = newest[:, 0] if last else newest
    return prompt, generated
