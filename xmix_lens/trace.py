"""Tracing: run a hook function once on a proxy activation and record what it does as IR.

The proxy is a torch.Tensor subclass with no data whose `__torch_function__` records each op into
the hook point's `Graph`. TransformerLens calls a hook once per forward pass, and so do we: the
function is traced when a pass starts, with the pass's padded shape, so Python side effects
(counters, `cache[name] = act`) happen once per pass as in TransformerLens. A proxy the function
keeps (stored in a dict or list it closes over) becomes a read; when the pass ends it is swapped,
in place, for the real tensor (`torch.utils.swap_tensors`), so the user's container holds values.
Anything outside the IR raises `TraceError` naming the hook, the line and the supported form.
"""
import os
import sys
from collections import Counter
from collections.abc import Callable

import torch

from .ir import Graph, Node


class TraceError(Exception):
    """A hook function does something the hook IR cannot express."""


_OWN_DIRS = (os.path.dirname(__file__), os.path.dirname(torch.__file__))


def _user_line() -> str:
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIRS):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    import linecache

    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno}: {code}"


SUPPORTED = (
    "+, -, * with Python numbers and constant tensors; unary -; act @ direction (or matrix); "
    ".sum(-1); [..., None] / .unsqueeze(-1); position selection act[:, k]; assignment "
    "act[:, k] = value / act[:] = value / act += value; returning a new act; "
    ".clone() / .detach() / .cpu() / .to(...)"
)

_METADATA = {"dim", "size", "numel", "__len__", "__format__", "__get__", "__repr__"}
_IDENTITY = {"clone", "detach", "cpu", "to", "contiguous", "float", "cuda", "requires_grad_"}
_BINARY = {"add": "add", "__add__": "add", "__radd__": "add", "sub": "sub", "__sub__": "sub",
           "__rsub__": "rsub", "rsub": "rsub", "mul": "mul", "__mul__": "mul", "__rmul__": "mul",
           "matmul": "matmul", "__matmul__": "matmul"}
_INPLACE = {"add_": "add", "__iadd__": "add", "sub_": "sub", "__isub__": "sub", "mul_": "mul", "__imul__": "mul"}
_CONTROL_FLOW = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "numpy"}


class TracedTensor(torch.Tensor):
    """A data-less stand-in for a hook's activation (or a value computed from it)."""

    _node: Node
    _tracer: "Tracer"
    _view: tuple | None  # (base proxy, position) when this is act[:, k] of a traced act

    @staticmethod
    def __new__(cls, tracer: "Tracer", node: Node, dtype: torch.dtype, view=None):
        t = torch.Tensor._make_wrapper_subclass(cls, node.shape, dtype=dtype, device="meta")
        t._node, t._tracer, t._view = node, tracer, view
        return t

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"TracedTensor({list(self.shape)}, {self._node})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TraceError(f"operation {func} reached the dispatcher; supported: {SUPPORTED}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        tracer = next(a._tracer for a in _flat(args, kwargs) if isinstance(a, TracedTensor))
        return tracer.record(name, args, kwargs)


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


class Tracer:
    """Records the hooks of one hook point into one Graph."""

    def __init__(self, hook_name: str, act_shape: tuple[int, ...], dtype: torch.dtype):
        self.graph = Graph(hook_name, act_shape)
        self.dtype = dtype
        self.proxies: list[TracedTensor] = []
        self.version = self.graph.add("act", (), act_shape, 2)
        self.act: TracedTensor | None = None  # the proxy handed to the hook being traced
        self.hook_label = hook_name

    def proxy(self, node: Node, view=None) -> TracedTensor:
        p = TracedTensor(self, node, self.dtype, view)
        self.proxies.append(p)
        return p

    def fail(self, what: str) -> TraceError:
        return TraceError(f"hook {self.hook_label!r} at {_user_line()}\n  {what}\n  supported: {SUPPORTED}")

    # --- running hook functions -----------------------------------------------------------------
    def call(self, fn: Callable, hook) -> None:
        """Trace fn(act, hook=hook) on the current version of act."""
        self.hook_label = f"{getattr(fn, '__name__', fn)} on {self.graph.hook_name}"
        act = self.act = self.proxy(self.version)
        result = fn(act, hook=hook)
        if result is None or (isinstance(result, TracedTensor) and result._node is self.version):
            return
        if not isinstance(result, TracedTensor) or result.shape != act.shape:
            got = list(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            raise self.fail(f"returned {got}; a hook returns None or a tensor shaped like act {list(act.shape)}")
        self.version = self.graph.add("write", (self.version, result._node, None), act.shape, 2, _user_line())

    def finish(self) -> list[TracedTensor]:
        """Close the graph; returns the proxies the hook functions kept (they become reads)."""
        self.graph.output = self.version
        self.act = None
        view_refs = Counter(id(p._view[0]) for p in self.proxies if p._view is not None)
        kept = []
        for i in range(len(self.proxies)):
            # references: the list, getrefcount's argument, and views of it; more means kept
            if sys.getrefcount(self.proxies[i]) > 2 + view_refs[id(self.proxies[i])]:
                kept.append(self.proxies[i])
        self.proxies.clear()
        for key, p in enumerate(kept):
            self.graph.reads[key] = p._node
        return kept

    # --- recording ops --------------------------------------------------------------------------
    def node_of(self, x) -> Node:
        if isinstance(x, TracedTensor):
            return x._node
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return self.graph.add("const", (torch.tensor(float(x)),), (), 0)
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() or x.dtype == torch.bool:
                return self.graph.add("const", (x.detach().to("cpu", torch.float32),), x.shape, 0)
        raise self.fail(f"cannot use a {type(x).__name__} as an operand")

    def binary(self, op: str, a, b) -> Node:
        if op == "rsub":
            op, a, b = "sub", b, a
        na, nb = self.node_of(a), self.node_of(b)
        token_dims = max(na.token_dims, nb.token_dims)
        if op == "matmul":
            if nb.token_dims or nb.op != "const" or len(nb.shape) > 2 or na.token_dims == 0:
                raise self.fail("matmul needs a traced value on the left and a constant vector or matrix on the right")
            if na.shape[-1] != nb.shape[0]:
                raise self.fail(f"matmul of {list(na.shape)} with {list(nb.shape)}: inner sizes differ")
            return self.graph.add("matmul", (na, nb), na.shape[:-1] + nb.shape[1:], token_dims, _user_line())
        try:
            shape = torch.broadcast_shapes(na.shape, nb.shape)
        except RuntimeError:
            raise self.fail(f"shapes {list(na.shape)} and {list(nb.shape)} do not broadcast "
                            f"(act is {list(self.graph.act_shape)})") from None
        if len(shape) > max(len(na.shape) if na.token_dims else 0, len(nb.shape) if nb.token_dims else 0):
            raise self.fail(f"a constant of shape {list((nb if na.token_dims else na).shape)} adds dims in front of "
                            f"the traced value {list((na if na.token_dims else nb).shape)}")
        return self.graph.add(op, (na, nb), shape, token_dims, _user_line())

    def record(self, name: str, args: tuple, kwargs: dict):
        if name in _CONTROL_FLOW:
            raise self.fail(f"`{name}` on a traced value: Python control flow and host reads cannot run in the "
                            f"engine; use arithmetic (e.g. a mask multiplied in) instead of `if`")
        x = args[0]
        if name in _IDENTITY:
            if name == "to" and any(isinstance(a, torch.dtype) and a.is_floating_point is False for a in args[1:]):
                raise self.fail("casting a traced value to a non-float dtype")
            return self.proxy(x._node)
        if name in _BINARY and not kwargs:
            return self.proxy(self.binary(_BINARY[name], x, args[1]))
        if name in _INPLACE and not kwargs:
            return self.inplace(x, self.binary(_INPLACE[name], x, args[1]))
        if name in ("neg", "__neg__"):
            n = x._node
            return self.proxy(self.graph.add("neg", (n,), n.shape, n.token_dims, _user_line()))
        if name == "sum":
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
            n = x._node
            if dim not in (-1, len(n.shape) - 1) or len(n.feature_shape) == 0:
                raise self.fail("sum is supported over the last feature dim only (dim=-1); sums over positions "
                                "or the batch mix tokens")
            out = self.graph.add("sum", (n,), n.shape[:-1], n.token_dims, _user_line())
            if keepdim:
                out = self.graph.add("unsqueeze", (out,), out.shape + (1,), out.token_dims, _user_line())
            return self.proxy(out)
        if name == "unsqueeze":
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if dim != -1:
                raise self.fail("unsqueeze is supported at dim=-1 only")
            n = x._node
            return self.proxy(self.graph.add("unsqueeze", (n,), n.shape + (1,), n.token_dims, _user_line()))
        if name == "__getitem__":
            return self.getitem(x, args[1])
        if name == "__setitem__":
            return self.setitem(x, args[1], args[2])
        raise self.fail(f"`{name}` is not in the hook IR")

    def position_of(self, node: Node, key) -> int | None | str:
        """Parse an index into: a position k (act[:, k]), None (all: act[:] / act[...]), 'newaxis'."""
        key = key if isinstance(key, tuple) else (key,)
        rest = [k for k in key[2:] if k is not Ellipsis and k != slice(None)]
        if key in ((Ellipsis,), (slice(None),), (slice(None), slice(None))):
            return None
        if key == (Ellipsis, None):
            return "newaxis"
        if node.token_dims == 2 and len(key) >= 2 and key[0] == slice(None) and isinstance(key[1], int) and not rest:
            P = node.shape[1]
            if not -P <= key[1] < P:
                raise self.fail(f"position {key[1]} is outside the padded length {P}")
            return key[1] % P
        raise self.fail(f"index {key!r}: supported are act[:, k] (one position), act[:], act[...] and x[..., None]")

    def getitem(self, x: TracedTensor, key):
        n = x._node
        pos = self.position_of(n, key)
        if pos is None:
            return self.proxy(n)
        if pos == "newaxis":
            return self.proxy(self.graph.add("unsqueeze", (n,), n.shape + (1,), n.token_dims, _user_line()))
        sel = self.graph.add("select_pos", (n, pos), n.shape[:1] + n.shape[2:], 1, _user_line())
        return self.proxy(sel, view=(x, pos))

    def setitem(self, x: TracedTensor, key, value) -> None:
        if x is not self.act:
            raise self.fail("assignment into a value other than the hook's own act (a copy, or an "
                            "intermediate): assign into act itself, or return the new value")
        pos = self.position_of(x._node, key)
        if pos == "newaxis":
            raise self.fail("assignment through [..., None]")
        target = x._node.shape if pos is None else x._node.shape[:1] + x._node.shape[2:]
        v = self.node_of(value)
        if v.op == "select_pos" and v.args == (self.version, pos):
            return  # writing act[:, k] back into itself, as `act[:, k] += v` does after the in-place add
        try:
            if torch.broadcast_shapes(v.shape, target) != torch.Size(target):
                raise RuntimeError
        except RuntimeError:
            raise self.fail(f"cannot assign a value of shape {list(v.shape)} to a slot of shape {list(target)}") from None
        self.version = self.graph.add("write", (self.version, v, pos), x._node.shape, 2, _user_line())
        x._node = self.version

    def inplace(self, x: TracedTensor, value: Node) -> TracedTensor:
        """x op= v: a write into act (or into act[:, k] when x is that view)."""
        if x._view is not None:
            base, pos = x._view
            self.setitem(base, (slice(None), pos), self.proxy(value))
            x._node = self.graph.add("select_pos", (self.version, pos), value.shape, 1)
            return x
        if x is not self.act:
            x._node = value  # an in-place op on an intermediate value: just rebind it
            return x
        self.setitem(x, (Ellipsis,), self.proxy(value))
        return x
