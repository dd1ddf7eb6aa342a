"""The installer: apps into a model and its engine, and out of them (xmix_lens/app.py's App).

Each installed app is one record (app.py's `InstalledApp`). An app whose hooks are per token is
made resident in the engine (its lowered ops run on every token of the requests that select it,
inside the CUDA graphs when built with the engine); any other is traced into each call's passes.
Resident apps are exported as app configs (app_config.py) that a server loads without Python.
"""
from pathlib import Path

import torch

from . import app_config, hook_points
from .app import App, InstalledApp, attached
from .lowered import ResidentRead, named_tensors
from .passes import PhaseOps
from .planner import Planner
from .trace import TraceError, hook_that_raised

_INSTALL_TRACE_SHAPE = (1, 16)  # the pass an app is traced for at install, to fail early on bad sizes


class Installer:
    """Installs, exports and uninstalls the apps of one model (its planner's registry and engine)."""

    def __init__(self, planner: Planner, model_dir, owner):
        # owner: the model, which App.installed_in lists (App.set_params calls its set_params)
        self.planner, self.model_dir, self.owner = planner, model_dir, owner
        self.registry, self.cfg = planner.registry, planner.cfg

    def install(self, app: App) -> App:
        """Check an app against the model (hook names, parameter sizes, that it traces) and install it."""
        if not isinstance(app, App):
            raise TypeError(f"install takes an xmix_lens.App, got {type(app).__name__}")
        if app.name in self.registry.installed:
            raise ValueError(f"an app named {app.name!r} is already installed; uninstall it first, or change its "
                             f"parameters with model.set_params({app.name!r}, ...)")
        hook_dict, feature_shapes = self.planner.hook_dict, self.planner.feature_shapes
        for hook_name, _ in app.fwd_hooks:
            try:
                hook_points.resolve(hook_dict, hook_name)
            except ValueError as e:
                raise ValueError(f"app {app.name!r}: {e}") from None
        for key, (hook_name, dim) in app.param_sites.items():
            (site,) = hook_points.resolve(hook_dict, hook_name)
            want, shape = feature_shapes[site][-1], tuple(app.params[key].shape)
            if len(shape) <= dim or shape[dim] != want:
                raise ValueError(f"app {app.name!r}: param {key!r} has shape {list(shape)}, but {site} carries {want} "
                                 f"features per token (act is {list(_INSTALL_TRACE_SHAPE + feature_shapes[site])}),"
                                 f" so dim {dim} must be {want}; build the app from vectors of this model at this hook "
                                 f"point")
        self._check_traces(app)
        self.registry.installed[app.name] = self._made_resident(app)
        app.installed_in.append(self.owner)
        return app

    def _check_traces(self, app: App) -> None:
        """Trace the app alone, for a prompt and for generated tokens, so errors surface at install."""
        try:
            with attached(self.planner.hook_dict, [app]):
                prompt = self.planner.trace_hooks(*_INSTALL_TRACE_SHAPE)
                self.planner.trace_hooks(_INSTALL_TRACE_SHAPE[0], 1, inherited=prompt.per_request_stores,
                                         phase="decode")
        except Exception as e:
            if (raised_by := hook_that_raised(e)) is not None:  # the user's function, not a size or the IR
                fn, point = raised_by
                raise ValueError(f"app {app.name!r}: its hook function {fn!r} on {point} raised "
                                 f"{type(e).__name__}: {e} when traced at install (act "
                                 f"{list(_INSTALL_TRACE_SHAPE + self.planner.feature_shapes[point])}); fix the hook "
                                 f"function (its exception and traceback are chained above)") from e
            if not isinstance(e, (TraceError, KeyError, ValueError, RuntimeError)):
                raise
            sizes = {k: list(v.shape) for k, v in app.params.items()}
            raise ValueError(f"app {app.name!r} does not trace on this model ({e}); its params have shapes {sizes}: "
                             f"check that they match the hook points' sizes (docs/hook-points.md)") from e
        finally:
            app.outputs.clear()

    def _made_resident(self, app: App) -> InstalledApp:
        """The app's record, its ops installed in the engine itself when its hooks are per token and
        keep their reads in app.outputs; otherwise it stays traced per call. An engine out of room
        for them is an error (backend/control.py), never a silent fall-back to per-call hooks."""
        try:
            traced, reads = self.resident_form(app)
        except ValueError:
            return InstalledApp(app)  # its hooks need a pass's shape (positions, stores) or keep values elsewhere
        self.planner.engine.install_app(app.name, traced.ops)
        return InstalledApp(app, reads, traced.graphs, app.param_versions())

    def resident_form(self, app: App) -> tuple[PhaseOps, dict]:
        """The app as the engine keeps it resident: its hooks lowered per token, and its reads
        {read key: ResidentRead}. A ValueError says why it cannot be (its hooks select positions,
        use stores or per-token tables, or keep values outside app.outputs)."""
        try:
            traced = self.planner.lower_app(app.name, app.fwd_hooks, app.params)
            names = {id(value): key for key, value in app.outputs.items()}
        except (TraceError, NotImplementedError) as e:
            raise ValueError(f"app {app.name!r} is not per token: {e}") from e
        finally:
            app.outputs.clear()
        if any(id(proxy) not in names for _, proxy in traced.kept):
            raise ValueError(f"app {app.name!r} keeps values elsewhere than in app.outputs (a closure, a global): "
                             f"only a traced pass can return them; keep its reads in app.outputs[...]")
        if (why := self.planner.engine.why_not_resident(app.name, traced.ops)) is not None:
            raise ValueError(why)
        last = {op.key for ops in traced.ops.values() for op in ops
                if not op.writes and not op.keeps_pos}  # act[:, -1]: [batch, *features]
        return traced, {key: ResidentRead(names[id(proxy)], tuple(proxy.shape[1 if key in last else 2:]), key in last)
                        for key, proxy in traced.kept}

    # --- app configs ------------------------------------------------------------------------------
    def export(self, apps, path) -> Path:
        """Write `apps` (App objects or names of installed apps) as an app config folder (app_config.py)."""
        forms = []
        for app in apps:
            if isinstance(app, str):
                self.registry.check_names([app], "export")
                app = self.registry.installed[app].app
            traced, reads = self.resident_form(app)
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
                return self.resident_form(app)[0].ops
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
                        can_change = op.may_take_slope(field)
                        if not can_change or not torch.allclose(t2 - t0, 2 * slope, rtol=1e-4, atol=1e-6):
                            how = "out of proportion to its value" if can_change else "(not an added term)"
                            raise ValueError(
                                f"app {app.name!r}: request param {name!r} changes {field} of its op at {point} {how}; "
                                f"a request's value can only move a write's added term or a program's constants in "
                                f"proportion (act + {name} * v, not act * {name}); drop it from request_params")
                        op.slopes.setdefault(name, {})[field] = slope

    def install_config(self, path) -> list[str]:
        """Install an app config's apps (`export`) in the running engine; their names."""
        loaded = app_config.read(path, self.model_dir)
        self.install_configured(loaded)
        return [spec.name for spec, _ in loaded]

    def install_configured(self, loaded: list) -> None:
        """Apps from a config (app_config.read), resident in the engine: in the registry under their
        names, with no hooks and no parameters (their tensors are in their ops)."""
        for spec, ops in loaded:
            if spec.name in self.registry.installed:
                raise ValueError(f"app {spec.name!r} is in the config and in apps=; give one of them another name")
            app = App(spec.name, version=spec.version, description=spec.description)
            self.planner.engine.install_app(spec.name, ops, app_config.declared(spec))
            self.registry.installed[spec.name] = InstalledApp(
                app, app_config.reads_of(spec), request_params={p.name: (p.minimum, p.maximum) for p in spec.params})
            app.installed_in.append(self.owner)

    def uninstall(self, name: str) -> App:
        self.registry.check_names([name], "uninstall")
        self.registry.deactivate([name])
        record = self.registry.installed.pop(name)
        if record.resident:
            self.planner.engine.uninstall_app(name)
        record.app.installed_in.remove(self.owner)
        return record.app

    def set_params(self, name: str, **values) -> int:
        """Update an installed app's parameter tensors in place; returns its new version. All
        values are checked, and the engine's copy of a resident app updated, before the version
        changes: a refused update leaves the App, the model and the engine as they were."""
        self.registry.check_names([name], "set_params")
        record = self.registry.installed[name]
        app = record.app
        checked = app.checked_params(values)
        old = {key: app.params[key].clone() for key in checked}
        app.write_params(checked)
        try:
            if record.resident:
                self.planner.lower_resident(app)
        except Exception:
            app.write_params(old)
            if record.resident:
                record.lowered_versions = app.param_versions()
            raise
        app.version += 1
        return app.version
