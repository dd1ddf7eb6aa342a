"""TransformerLens's hook bookkeeping (its `HookedRootModule`), apart from the model.

A `HookedRoot` owns the hook points (`hook_dict`) and everything TransformerLens users do to
them: `add_hook`, `hooks()` blocks and their context levels, `reset_hooks`. It runs nothing: the
model (model.py) and the planner (planner.py) read the hooks on the hook points when a pass is
traced. One lock serializes calls from several threads (`one_call_at_a_time`).
"""
import contextlib
import functools
import threading
from collections.abc import Callable, Iterable

import torch

from . import hook_points
from .hook_points import HookPoint

HookFn = Callable[..., torch.Tensor | None]
HookSpec = tuple[str | Callable[[str], bool], HookFn]


def one_call_at_a_time(method: Callable) -> Callable:
    """Calls of one model from several threads run one after another (a notebook's widgets, a web
    demo, an evaluation script's workers): the hooks a call adds to the hook points are its own
    until it returns, and vLLM's in-process engine is driven by one caller at a time."""
    @functools.wraps(method)
    def serialized(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return serialized


class HookedRoot:
    """The hook points of a model and TransformerLens's ways of adding and removing hooks."""

    context_level = 0  # how many hooks() blocks are open: the level their hooks are added at

    def __init__(self, hook_dict: dict[str, HookPoint], cfg):
        self.hook_dict, self.cfg = hook_dict, cfg
        self.mod_dict = hook_dict
        # one call at a time: a call's hooks sit on the shared hook points while it traces, and
        # vLLM's in-process engine serves one caller (see one_call_at_a_time)
        self.lock = threading.RLock()

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

    @one_call_at_a_time
    def reset_hooks(self, clear_contexts: bool = True, direction: str = "both", including_permanent: bool = False,
                    level: int | None = None) -> None:
        if clear_contexts:
            for hp in self.hook_dict.values():
                hp.clear_context()
        self.remove_all_hook_fns(direction, including_permanent, level)

    def resolve_hooks(self, fwd_hooks: Iterable[HookSpec], bwd_hooks=()) -> list[tuple[str, HookFn]]:
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

    def has_backward_hooks(self) -> bool:
        return any(hp.bwd_hooks for hp in self.hook_dict.values())

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Iterable[HookSpec] = (), bwd_hooks=(), reset_hooks_end: bool = True,
              clear_contexts: bool = False):
        """Hooks added for the duration of the block, at the block's context level (TransformerLens's
        rule): on exit, also when the block raises, reset_hooks_end removes the non-permanent hooks of
        that level (and clear_contexts every hook point's ctx). Other threads' calls wait until the
        block ends (its hooks are on the shared hook points)."""
        with self.lock:
            resolved = self.resolve_hooks(fwd_hooks, bwd_hooks)
            backward = self._resolve_specs(bwd_hooks, "bwd_hook")
            self.context_level += 1
            try:
                for name, fn in resolved:
                    self.hook_dict[name].add_hook(fn, level=self.context_level)
                for name, fn in backward:  # they make the block's calls run in model.tl (see model.forward)
                    self.hook_dict[name].add_hook(fn, dir="bwd", level=self.context_level)
                yield self
            finally:
                if reset_hooks_end:
                    self.reset_hooks(clear_contexts, including_permanent=False, level=self.context_level)
                self.context_level -= 1

    @contextlib.contextmanager
    def silenced(self, names: Iterable[str]):
        """The forward hooks on these hook points set aside for the block, then put back."""
        kept = {name: self.hook_dict[name].fwd_hooks for name in names}
        try:
            for name in kept:
                self.hook_dict[name].fwd_hooks = []
            yield
        finally:
            for name, hooks in kept.items():
                self.hook_dict[name].fwd_hooks = hooks
