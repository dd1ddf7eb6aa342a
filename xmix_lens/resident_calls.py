"""A call's per-token hooks as a resident app: `generate`'s hooks inside the engine's CUDA graphs.

Host-planned ops (runtime.py) choose each step's tokens on the host, so every step of a call that
has them runs the model's Python, without CUDA graphs: a hooked `generate` kept a third of the
engine's speed on the H200. Resident ops (control.py) are gated per token through fixed-address
buffers instead, and run inside graphs: the engine's own, for apps built with it, or graphs the
engine captures on first use for apps installed later (backend/vllm/adapter.py, variant graphs).

So where a `generate` call's hooks are per token (the same lowered ops on the prompt and on each
generated token, on every position, reading nothing, keeping finite values finite), they become
a resident app that only the call's requests select. Apps are kept by the structure of their ops
(`LoweredOp.structure`): a later call with hooks of the same structure copies its values into the
kept app's tensors in place (set_params), so the graphs that captured them replay; at most
`KEPT` structures are kept, the least recently used uninstalled first.

Why not every call: a call that reads (`run_with_cache`, a kept tensor, the logits of
`run_with_hooks`) wants its values on the device in the pass's layout, which host-planned reads
give and resident reads (the messenger: host memory, per request) do not; a hook that writes
per row or position is not per token; and non-finite writes are reported only by host-planned
passes, so ops that could make them (a division, exp, log, pow) stay there.
"""
import itertools
import threading
from collections import OrderedDict

from .passes import PhaseOps

KEPT = 4  # structures kept resident between calls (each holds one of the engine's control rows)


class ResidentCalls:
    """The resident apps of one engine's per-token calls, by the structure of their ops."""

    def __init__(self, planner):
        self.planner = planner  # its engine installs the apps (set once the engine is built)
        self._kept: OrderedDict[tuple, list[str]] = OrderedDict()  # structure -> its apps (one per call at once)
        self._busy: set[str] = set()
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self.enabled = True

    def acquire(self, prompt: PhaseOps, decode: PhaseOps) -> str | None:
        """The name of a resident app doing what the call's hooks do, its values set, marked busy
        until `release`; None where the hooks are not per token (module docstring)."""
        ops = per_token_ops(prompt, decode)
        if not self.enabled or ops is None:
            return None
        if self.planner.engine.why_not_resident("call", ops) is not None:
            return None
        key = tuple((point, tuple(op.structure() for op in point_ops)) for point, point_ops in ops.items())
        with self._lock:
            names = self._kept.setdefault(key, [])
            self._kept.move_to_end(key)
            free = next((n for n in names if n not in self._busy), None)
            if free is None:
                self._evict()
                free = f"(call {next(self._numbers)})"
                try:
                    self.planner.engine.install_app(free, ops)
                except ValueError:  # no control row left: the call runs host-planned
                    return None
                names.append(free)
            else:
                self.planner.engine.set_app_params(free, ops)
            self._busy.add(free)
            return free

    @property
    def kept(self) -> set[str]:
        """The names of the apps kept for calls (none is a user's app)."""
        return {n for names in self._kept.values() for n in names}

    def __contains__(self, name: str) -> bool:
        """Whether `name` is one of these apps, in use by a call."""
        return name in self._busy

    def release(self, name: str) -> None:
        with self._lock:
            self._busy.discard(name)

    def _evict(self) -> None:
        """Uninstall the least recently used structures' idle apps beyond KEPT."""
        while len(self._kept) > KEPT:
            key, names = next(iter(self._kept.items()))
            idle = [n for n in names if n not in self._busy]
            if not idle:
                return
            for name in idle:
                self.planner.engine.uninstall_app(name)
                names.remove(name)
            if not names:
                del self._kept[key]


def per_token_ops(prompt: PhaseOps, decode: PhaseOps) -> dict | None:
    """The call's ops by hook point where the prompt's and the generated tokens' are the same
    per-token writes that keep finite values finite and nothing is read or stored; else None."""
    if not prompt.ops or prompt.kept or decode.kept or prompt.per_request_stores:
        return None
    if prompt.ops.keys() != decode.ops.keys():
        return None
    for point, ops in prompt.ops.items():
        others = decode.ops[point]
        if len(ops) != len(others):
            return None
        for op, other in zip(ops, others):
            if not op.writes or op.positions is not None or op.uses_token_tables or getattr(op, "store_tables", None) \
                    or not op.keeps_finite() or op.digest() != other.digest():
                return None
    return prompt.ops
