"""Tracing: run a hook function once on a proxy activation and record what it does as IR.

The proxy is a torch.Tensor subclass with no data whose `__torch_function__` records each op into
the hook point's `Graph`. TransformerLens calls a hook once per forward pass, and so do we: the
function is traced when a pass starts, with the pass's padded shape, so Python side effects
(counters, `cache[name] = act`) happen once per pass as in TransformerLens. A proxy the function
keeps (stored in a dict or list it closes over) becomes a read; when the pass ends it is swapped,
in place, for the real tensor (`torch.utils.swap_tensors`), so the user's container holds values.
Tensors a hook makes like act (`torch.zeros_like(act)`, `act.new_full(...)`) and random draws
(`torch.randn_like(act)`, `torch.randn(act.shape)`) are host tensors, constants of the pass: a draw is
made from torch's generator when the pass is traced, one per call as TransformerLens draws one per
forward, and is refused where one trace serves many tokens (generated tokens; installed apps).
Anything outside the IR raises `TraceError` naming the hook, the line and the supported form.
"""
import contextlib
import contextvars
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from .ir import Graph, Node
from .ops import ELEMENTWISE, OPS, REDUCTIONS


class TraceError(Exception):
    """A hook function does something the hook IR cannot express."""


def hook_that_raised(error: BaseException) -> tuple[str, str] | None:
    """(function name, hook point) of the hook function that raised `error` while it was traced
    (Tracer.call notes it on the exception, whose type is kept); None for other errors."""
    return getattr(error, "_xmix_hook", None)


# The tracers whose hook functions are being called, innermost last: what `store.get` inside a hook,
# and an op on a value kept from another hook point, are recorded into. A context variable, so that
# threads tracing at once never see each other's.
_calling: contextvars.ContextVar[tuple["Tracer", ...]] = contextvars.ContextVar("xmix_lens_calling", default=())


# what the hooks being traced are reused for, when one trace serves many tokens (see traced_once_for)
_traced_once_for: contextvars.ContextVar[str | None] = contextvars.ContextVar("xmix_lens_traced_once_for",
                                                                              default=None)
_GENERATED_TOKENS = ("every generated token (generate traces its hooks once for all decode steps, and installing "
                     "an app traces them so too)")


@contextlib.contextmanager
def traced_once_for(what: str):
    """Hooks traced in the block serve `what` (an installed app's every request) from this one trace:
    random draws in them are refused (they would repeat), naming `what`."""
    token = _traced_once_for.set(what)
    try:
        yield
    finally:
        _traced_once_for.reset(token)


def current_tracer() -> "Tracer | None":
    calling = _calling.get()
    return calling[-1] if calling else None


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
    "arithmetic (+ - * / neg abs pow sqrt rsqrt) with numbers, constant tensors and other traced values; relu gelu "
    "sigmoid tanh exp log softmax(-1); comparisons and logical ops; torch.where; clamp; sum mean max min "
    "norm over the last dim; xmix_lens.topk_mask; @ / matmul / einsum / einops.einsum with constant tensors; reshape view "
    "flatten permute transpose of feature dims (einops.rearrange); act[:, k], act[:, a:b], act[:, mask], "
    "act[:, :, head(s)]; assignment into act (act[act > t] = v) and the in-place spelling of every op (add_ "
    "clamp_ masked_fill_ zero_ fill_ copy_ ...) on act and its selections; returning a new act; .clone() .detach() "
    ".cpu() .to(); constants made like act (zeros_like ones_like full_like new_zeros new_full) and random draws "
    "(randn_like rand_like torch.randn(act.shape)), drawn once per call"
)

_METADATA = {"dim", "size", "numel", "__len__", "__format__", "__get__", "__repr__", "ndimension"}
_IDENTITY = {"clone", "detach", "cpu", "to", "contiguous", "float", "cuda", "requires_grad_", "type_as"}
# torch's names for the op table's ops (xmix_lens/ops.py); _ELEMENTWISE: those whose arguments are one or two
# traced values (pow, clamp and where read numbers or three values: `record` reads their arguments)
_ELEMENTWISE = {alias: name for name, op in ELEMENTWISE.items() for alias in op.aliases
                if set(op.args) == {"value"} and len(op.args) <= 2}
_REDUCE = {alias: name for name, op in REDUCTIONS.items() for alias in op.aliases}
# the other elementwise spellings (pow, clamp, where, masked_fill, ...): `record` reads their arguments
_SPELLED = {alias: name for name, op in ELEMENTWISE.items() for alias in op.aliases if alias not in _ELEMENTWISE}
_ROOTS = {"sqrt": 0.5, "rsqrt": -0.5}  # spellings of pow with their exponent


def _in_place(alias: str) -> str:
    return f"__i{alias[2:]}" if alias.startswith("__") else f"{alias}_"


# in-place spelling -> its out-of-place spelling: `x.clamp_(a, b)` is `x.clamp(a, b)` written into x
_OUT_OF_PLACE = {_in_place(alias): alias for name, op in ELEMENTWISE.items() for alias in op.aliases
                 if not alias.startswith("__r")}
# in-place ops with no out-of-place spelling: the value each writes into the tensor it is called on
_WRITES = {"zero_": lambda args: 0.0, "fill_": lambda args: args[1], "copy_": lambda args: args[1]}
# tensors made like act: constants of the pass, built on the host (`act.device` reads as the CPU while traced)
_FILLED_LIKE = {"zeros_like": 0.0, "ones_like": 1.0, "empty_like": 0.0, "new_zeros": 0.0, "new_ones": 1.0,
                "new_empty": 0.0}
_DRAWN_LIKE = {"randn_like": torch.randn, "rand_like": torch.rand}
# torch functions that draw from torch's random number generators (on any tensor, traced or not)
_RANDOM = {"randn", "rand", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson", *_DRAWN_LIKE,
           "randint_like", "normal_", "uniform_", "bernoulli_", "random_", "exponential_", "cauchy_", "log_normal_",
           "geometric_"}
# reversed operands (2 - act), and act @ a constant (a linear map, not an elementwise op)
_OTHER_BINARY = {"__rsub__": "rsub", "rsub": "rsub", "__rtruediv__": "rdiv", "matmul": "matmul", "__matmul__": "matmul"}
_NUMPY = ("a numpy array met a traced value: numpy runs outside the engine; convert the array to a tensor first: "
          "torch.as_tensor(array, dtype=torch.float32)")
_CONTROL_FLOW = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "numpy", "any", "all"}


class TracedTensor(torch.Tensor):
    """A data-less stand-in for a hook's activation (or a value computed from it)."""

    _node: Node
    _tracer: "Tracer"
    _view: tuple | None  # (base proxy, pos, heads) when this is a selection of a traced act

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
        if func is torch.Tensor.where:  # act.where(cond, other) is torch.where(cond, act, other)
            args = (args[1], args[0], *args[2:])
        if getattr(func, "__self__", None) is torch.Tensor.device:
            return _HOST  # `torch.zeros(act.shape, device=act.device)`: a host constant of the pass
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        # the tracer of the hook being called: a value from an earlier hook point (kept in a dict)
        # is used here, not recorded into the graph it came from
        tracer = current_tracer() or next(a._tracer for a in _flat(args, kwargs)
                                          if isinstance(a, TracedTensor) and not isinstance(a, ParamProxy))
        return tracer.record(name, *tracer.localized(args, kwargs))


_HOST = torch.device("cpu")


class _RandomDraws(TorchFunctionMode):
    """Active while a hook function runs: every random draw it makes (on a traced value or not,
    `torch.randn_like(act)` or `torch.randn(act.shape)`) is checked by the tracer first."""

    def __init__(self, tracer: "Tracer"):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in _RANDOM:
            self.tracer.check_draw(func.__name__)
        return func(*args, **(kwargs or {}))


def _matmul(t: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    return t @ W


class ParamProxy(TracedTensor):
    """An app parameter while its app is traced for the engine (`as_parameters`): a named input
    of the graph, not a constant, so that new values are lowered again without calling the hooks.
    It belongs to whichever hook's tracer uses it."""

    _param: str

    @staticmethod
    def __new__(cls, name: str, like: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device="meta")
        t._param = name
        return t

    @property
    def _tracer(self) -> "Tracer":
        tracer = current_tracer()
        if tracer is None:
            raise TraceError(f"app parameter {self._param!r} used outside a hook while its app is traced")
        return tracer

    @property
    def _node(self) -> Node:
        return self._tracer.param_node(self._param, tuple(self.shape))

    _view = None

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"ParamProxy({self._param!r}, {list(self.shape)})"


@contextlib.contextmanager
def as_parameters(params: dict[str, torch.Tensor]):
    """The tensors of `params` stand for named graph inputs while the block traces hooks that
    closed over them: each is swapped in place (torch.utils.swap_tensors) with a ParamProxy, and
    swapped back after, also when the block raises."""
    proxies = {name: ParamProxy(name, tensor) for name, tensor in params.items()}
    swapped = []
    try:
        for name, tensor in params.items():
            torch.utils.swap_tensors(tensor, proxies[name])
            swapped.append(name)
        yield
    finally:
        for name in swapped:
            torch.utils.swap_tensors(params[name], proxies[name])


def _size(args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The size a `new_*` method was given: new_zeros(2, 3), new_zeros((2, 3)) or new_zeros(size=...)."""
    size = kwargs.get("size", args[0] if len(args) == 1 else args)
    return tuple(size) if isinstance(size, (tuple, list, torch.Size)) else (size,)


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


# The stores of a pass (what `store.put` / `store.get` of stores.py make): the tracer's records, which
# lowering, the engine and app configs take from it.
@dataclass(eq=False)
class StoreSpec:
    """One store of a pass: where it is written, how, and the device buffer consumers read."""

    name: str
    reduce: str | None  # None: per token; "last": the value of one selected position; or stores.REDUCTIONS
    feature_shape: tuple[int, ...]
    buffer: torch.Tensor | None = None  # [B, P, O]: what consumers read at (row, position)
    row_buffer: torch.Tensor | None = None  # [B, 1, O]: a per-request value, for generated tokens
    per_token: torch.Tensor | None = None  # [B, P, O] the values a reduction folds
    written: torch.Tensor | None = None  # [B, P] which positions have been written

    def __repr__(self) -> str:
        return f"store({self.name!r})"


@dataclass
class TraceSession:
    """The stores of the hooks being traced: the prompt's (prefill), or the generated tokens'
    (decode), which also see the prompt's per-request stores."""

    batch: int
    padded_len: int
    stores: dict[str, StoreSpec] = field(default_factory=dict)
    inherited: dict[str, StoreSpec] = field(default_factory=dict)  # the prompt's, seen while decoding

    def find(self, name: str) -> StoreSpec | None:
        return self.stores.get(name) or self.inherited.get(name)

    def per_request(self) -> dict[str, StoreSpec]:
        return {name: spec for name, spec in self.stores.items() if spec.reduce is not None}

    def allocate(self, device) -> None:
        """Device buffers for the stores this session's hooks write."""
        for spec in self.stores.values():
            O = 1
            for s in spec.feature_shape:
                O *= s
            spec.buffer = torch.zeros(self.batch, self.padded_len, O, device=device)
            spec.row_buffer = torch.zeros(self.batch, 1, O, device=device)
            spec.per_token = torch.zeros(self.batch, self.padded_len, O, device=device)
            spec.written = torch.zeros(self.batch, self.padded_len, dtype=torch.bool, device=device)


class Tracer:
    """Records the hooks of one hook point into one Graph."""

    def __init__(self, hook_name: str, act_shape: tuple[int, ...], dtype: torch.dtype,
                 session: TraceSession | None = None, phase: str = "prefill"):
        self.graph = Graph(hook_name, act_shape, phase)
        self.dtype = dtype
        # the stores of the pass being traced, shared by the tracers of all its hook points
        self.session = session if session is not None else TraceSession(*act_shape[:2])
        self.proxies: list[TracedTensor] = []
        self.version = self.graph.add("act", (), act_shape, 2)
        self.act: TracedTensor | None = None  # the proxy handed to the hook being traced
        self.hook_label = hook_name

    def proxy(self, node: Node, view=None) -> TracedTensor:
        p = TracedTensor(self, node, self.dtype, view)
        self.proxies.append(p)
        return p

    def fail(self, what: str, list_supported: bool = True) -> TraceError:
        where = f"hook {self.hook_label!r} at {_user_line()}\n  {what}"
        return TraceError(f"{where}\n  supported: {SUPPORTED}" if list_supported else where)

    def check_draw(self, name: str) -> None:
        """A random draw is a constant of the pass, drawn on the host from torch's generator when the
        hook is traced: one draw per call, as TransformerLens draws one per forward. Generated
        tokens share one trace (so do an installed app's requests): refused there, not repeated."""
        reused = _traced_once_for.get() or (_GENERATED_TOKENS if self.graph.phase == "decode" else None)
        if reused is not None:
            raise self.fail(
                f"`{name}` draws random numbers, but this hook is traced once for {reused}: the same numbers would "
                f"repeat at each token, where TransformerLens draws fresh ones at every forward. Draw in per-call "
                f"passes (run_with_hooks, run_with_cache, forward: one draw per call, as in TransformerLens), or "
                f"draw the tensor outside the hook and close over it (the same numbers at every token, on purpose)",
                list_supported=False)

    # --- running hook functions -----------------------------------------------------------------
    def call(self, fn: Callable, hook) -> None:
        """Trace fn(act, hook=hook) on the current version of act."""
        fn_name = getattr(fn, "__name__", repr(fn))
        self.hook_label = f"{fn_name} on {self.graph.hook_name}"
        act = self.act = self.proxy(self.version)
        token = _calling.set(_calling.get() + (self,))
        try:
            with _RandomDraws(self):
                result = fn(act, hook=hook)
        except TraceError:
            raise
        except Exception as e:  # the function's own error: kept as it is (its type), naming the hook
            if hook_that_raised(e) is None:
                e._xmix_hook = (fn_name, self.graph.hook_name)
                e.add_note(f"raised by hook function {fn_name!r} on {self.graph.hook_name}, traced on act "
                           f"{list(act.shape)}")
            raise
        finally:
            _calling.reset(token)
        if result is None or (isinstance(result, TracedTensor) and result._node is self.version):
            return
        if isinstance(result, TracedTensor) and not isinstance(result, ParamProxy) and result._tracer is not self:
            # a value kept at an earlier hook point (`return saved["a"]`): shared through a store
            result = self.proxy(self.imported(result))
        if not isinstance(result, torch.Tensor) or result.shape != act.shape:
            got = f"a tensor of shape {list(result.shape)}" if isinstance(result, torch.Tensor) else \
                f"a {type(result).__name__}"
            raise self.fail(f"returned {got}; a hook returns None or a tensor of act's shape {list(act.shape)} "
                            f"(act edited, or a new value for it)")
        # a tensor made without act (`return torch.zeros(act.shape)`) is a constant that becomes act, as in
        # TransformerLens
        self.version = self.add("write", (self.version, self.node_of(result), None, None), act.shape, 2)

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
        if isinstance(x, ParamProxy):
            return x._node
        if isinstance(x, TracedTensor) and x._tracer is not self:
            return self.imported(x)
        if isinstance(x, TracedTensor):
            return x._node
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return self.graph.add("const", (torch.tensor(float(x)),), (), 0)
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() or x.dtype == torch.bool:
                return self.graph.add("const", (x.detach().to("cpu", torch.float32),), x.shape, 0)
            raise self.fail(f"a {x.dtype} tensor of shape {list(x.shape)} as an operand: constant tensors in a hook "
                            f"are float (or bool masks); convert it to float first (v.float())")
        if hasattr(x, "__array__"):
            raise self.fail(_NUMPY)
        raise self.fail(f"cannot use a {type(x).__name__} as an operand")

    def add(self, op: str, args: tuple, shape, token_dims: int) -> Node:
        return self.graph.add(op, args, shape, token_dims, _user_line())

    def binary(self, op: str, a, b) -> Node:
        if op in ("rsub", "rdiv"):
            op, a, b = op[1:], b, a
        na, nb = self.node_of(a), self.node_of(b)
        if op == "matmul":
            if nb.token_dims or nb.shape == () or na.token_dims == 0:
                raise self.fail("matmul needs a traced value on the left and a constant vector or matrix on the right")
            if na.shape[-1] != nb.shape[0]:
                raise self.fail(f"matmul of {list(na.shape)} with {list(nb.shape)}: inner sizes differ")
            return self.linear(na, _matmul, na.shape[:-1] + nb.shape[1:], "matmul", nb)
        try:
            shape = tuple(torch.broadcast_shapes(na.shape, nb.shape))
        except RuntimeError:
            raise self.fail(f"shapes {list(na.shape)} and {list(nb.shape)} do not broadcast "
                            f"(act is {list(self.graph.act_shape)})") from None
        # the operand with token dims fixes the layout; two constants (a scalar parameter times a
        # vector, in either order) broadcast as torch does
        traced = nb if nb.token_dims > na.token_dims else na
        if traced.token_dims and len(shape) > len(traced.shape):
            const = nb if traced is na else na
            raise self.fail(f"a constant of shape {list(const.shape)} adds dims in front of the traced value "
                            f"{list(traced.shape)}")
        return self.add(op, (na, nb), shape, traced.token_dims)

    def elementwise(self, name: str, args: tuple) -> Node:
        """An elementwise op of the table on one value, or on two (broadcast)."""
        if len(OPS[name].args) == 2:
            return self.binary(name, args[0], args[1])
        n = self.node_of(args[0])
        return self.add(name, (n,), n.shape, n.token_dims)

    def linear(self, n: Node, fn: Callable, shape, label: str, *constants: Node) -> Node:
        """A linear map of n's feature dims by constants: fn(t, *constants' values) maps
        [k, *features] -> [k, *out_features]."""
        fn.label = label
        return self.add("linear", (n, fn, *constants), shape, n.token_dims)

    def reduce(self, name: str, x: "TracedTensor", args: tuple, kwargs: dict):
        n = x._node
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if name in ("norm", "vector_norm"):
            p = kwargs.get("p", kwargs.get("ord", args[1] if len(args) > 1 else 2))
            dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
            if p not in (2, 2.0, "fro", None):
                raise self.fail("norm is supported as the 2-norm over the last dim: x.norm(dim=-1)")
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 and name not in ("norm", "vector_norm") else False)
        if dim not in (-1, len(n.shape) - 1) or not n.feature_shape:
            raise self.fail(f"{name} is supported over the last feature dim only (dim=-1); reductions over "
                            f"positions or the batch mix tokens, which one hook cannot do")
        shape = n.shape[:-1]
        if name in ("sum", "mean"):
            scale = 1.0 / n.shape[-1] if name == "mean" else 1.0
            out = self.linear(n, lambda t, s=scale: t.sum(-1) * s, shape, name)
        else:
            out = self.add(_REDUCE[name], (n,), shape, n.token_dims)
        if keepdim:
            out = self.add("reshape", (out, out.feature_shape + (1,)), shape + (1,), n.token_dims)
        return self.proxy(out)

    def localized(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Arguments with values traced at other hook points replaced by this graph's store reads."""
        def local(a):
            if isinstance(a, TracedTensor) and not isinstance(a, ParamProxy) and a._tracer is not self:
                return self.proxy(self.imported(a))
            if isinstance(a, (list, tuple)):
                return type(a)(local(b) for b in a)
            return a

        return tuple(local(a) for a in args), {k: local(v) for k, v in kwargs.items()}

    def record(self, name: str, args: tuple, kwargs: dict):
        if name == "__array__":  # numpy converting a traced value: `act + np_array`
            raise self.fail(_NUMPY)
        if name in _CONTROL_FLOW:
            raise self.fail(f"`{name}` on a traced value: Python control flow and host reads cannot run in the "
                            f"engine; use arithmetic or torch.where instead of `if`")
        x = args[0]
        if name in _IDENTITY:
            if any(isinstance(a, torch.dtype) and not a.is_floating_point for a in list(args[1:]) + list(kwargs.values())):
                raise self.fail("casting a traced value to a non-float dtype")
            return self.proxy(x._node)
        if kwargs.get("inplace"):  # F.relu(act, inplace=True)
            return self.write_into(x, self.record(name, args, {k: v for k, v in kwargs.items() if k != "inplace"}))
        if name in _OUT_OF_PLACE:
            return self.write_into(x, self.record(_OUT_OF_PLACE[name], args, kwargs))
        if name in _WRITES:
            return self.write_into(x, _WRITES[name](args))
        if name in _FILLED_LIKE or name in _DRAWN_LIKE or name in ("full_like", "new_full"):
            return self.made_like(name, x, args, kwargs)
        if set(kwargs) == {"alpha"} and _ELEMENTWISE.get(name) in ("add", "sub"):  # add(x, y, alpha=a): x + a * y
            return self.record(name, (x, self.record("mul", (args[1], kwargs["alpha"]), {})), {})
        if name in _OTHER_BINARY and not kwargs:
            return self.proxy(self.binary(_OTHER_BINARY[name], x, args[1]))
        if name in _ELEMENTWISE and not kwargs:
            return self.proxy(self.elementwise(_ELEMENTWISE[name], args))
        if name in ("gelu",) and kwargs.get("approximate", "none") != "none":
            raise self.fail("gelu is supported with approximate='none'")
        if name in _REDUCE:
            return self.reduce(name, x, args, kwargs)
        op = _SPELLED.get(name)
        if op == "pow":
            exponent = _ROOTS.get(name, args[1] if len(args) > 1 else kwargs.get("exponent"))
            if not isinstance(exponent, (int, float)):
                raise self.fail("pow is supported with a constant number exponent")
            n = x._node
            return self.proxy(self.add("pow", (n, float(exponent)), n.shape, n.token_dims))
        if op == "clamp":
            lo = kwargs.get("min", args[1] if len(args) > 1 else None)
            hi = kwargs.get("max", args[2] if len(args) > 2 else None)
            if name == "clamp_max":
                lo, hi = None, lo
            if not all(v is None or isinstance(v, (int, float)) for v in (lo, hi)):
                raise self.fail("clamp is supported with number bounds")
            n = x._node
            return self.proxy(self.add("clamp", (n, lo, hi), n.shape, n.token_dims))
        if op == "where":  # x.masked_fill(mask, v) is where(mask, v, x)
            spelled = args[:3] if name == "where" else (args[1], args[2], x)
            cond, a, b = (self.node_of(v) for v in spelled)
            shape = tuple(torch.broadcast_shapes(cond.shape, a.shape, b.shape))
            return self.proxy(self.add("where", (cond, a, b), shape, max(cond.token_dims, a.token_dims, b.token_dims)))
        if name == "topk_mask":
            n, k = x._node, args[1]
            if not isinstance(k, int) or not n.feature_shape or not 1 <= k <= n.shape[-1]:
                raise self.fail(f"topk_mask needs an int k in [1, {n.shape[-1] if n.shape else 0}] over the last dim")
            return self.proxy(self.add("topk_mask", (n, k), n.shape, n.token_dims))
        if name == "softmax":
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            n = x._node
            if dim not in (-1, len(n.shape) - 1) or not n.feature_shape:
                raise self.fail("softmax is supported over the last feature dim (dim=-1)")
            return self.proxy(self.add("softmax", (n,), n.shape, n.token_dims))
        if name == "einsum":
            return self.einsum(args, kwargs)
        if name in ("reshape", "view", "flatten", "unsqueeze", "squeeze"):
            return self.reshape(name, x, args[1:], kwargs)
        if name in ("permute", "transpose"):
            return self.permute(name, x, args[1:])
        if name == "__getitem__":
            return self.getitem(x, args[1])
        if name == "__setitem__":
            return self.setitem(x, args[1], args[2])
        raise self.fail(f"`{name}` is not in the hook IR")

    def param_node(self, name: str, shape: tuple[int, ...]) -> Node:
        """This graph's node of an app parameter (one per name)."""
        if name not in self.graph.params:
            self.graph.params[name] = self.graph.add("param", (name,), shape, 0)
        return self.graph.params[name]

    # --- stores: values shared with hooks at other hook points -----------------------------------
    def store_put(self, name: str, value: "TracedTensor", reduce: str | None, session: TraceSession) -> StoreSpec:
        n = value._node
        if n.token_dims == 1 and reduce is not None:
            raise self.fail(f"store {name!r}: reduce={reduce!r} over positions of a value that already selected "
                            f"one position")
        kind = reduce if reduce is not None else ("last" if n.token_dims == 1 else None)
        spec = StoreSpec(name, kind, n.feature_shape)
        session.stores[name] = spec
        self.graph.stores[spec] = n
        return spec

    def store_get(self, spec: StoreSpec) -> "TracedTensor":
        shape = self.graph.act_shape[:2] + spec.feature_shape
        return self.proxy(self.add("store", (spec,), shape, 2))

    def imported(self, x: "TracedTensor") -> Node:
        """A value traced at another hook point, used here: shared through a per-token store."""
        if x._node.token_dims != 2:
            raise self.fail("a value from another hook point that selected positions; share per-request values "
                            "with xmix_lens.store.put / store.get (broadcast over positions)")
        name = f"{x._tracer.graph.hook_name}:{x._node.name}"
        spec = self.session.stores.get(name) or x._tracer.store_put(name, x, None, self.session)
        return self.store_get(spec)._node

    # --- shapes of feature dims -------------------------------------------------------------------
    def reshape(self, name: str, x: "TracedTensor", args: tuple, kwargs: dict):
        n = x._node
        td = n.token_dims
        probe = torch.empty(n.shape, device="meta")
        if name == "flatten":
            start = kwargs.get("start_dim", args[0] if args else 0)
            end = kwargs.get("end_dim", args[1] if len(args) > 1 else -1)
            out = probe.flatten(start, end)
        elif name in ("unsqueeze", "squeeze"):
            out = getattr(probe, name)(*args)
        else:
            shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
            out = probe.reshape(*shape)
        if tuple(out.shape[:td]) != n.shape[:td]:
            raise self.fail(f"{name} to {list(out.shape)} changes the token dims {list(n.shape[:td])}; only "
                            f"feature dims may be reshaped inside a hook")
        return self.proxy(self.add("reshape", (n, tuple(out.shape[td:])), tuple(out.shape), td))

    def permute(self, name: str, x: "TracedTensor", args: tuple):
        n = x._node
        td, nd = n.token_dims, len(n.shape)
        if name == "transpose":
            d0, d1 = (a % nd for a in args)
            dims = list(range(nd))
            dims[d0], dims[d1] = dims[d1], dims[d0]
        else:
            dims = [d % nd for d in (args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args)]
        if dims[:td] != list(range(td)):
            raise self.fail(f"{name} moves token dims; only feature dims may be permuted inside a hook")
        out = tuple(n.shape[d] for d in dims)
        return self.proxy(self.add("permute", (n, tuple(d - td for d in dims[td:])), out, td))

    def einsum(self, args: tuple, kwargs: dict):
        equation, *operands = args
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = list(operands[0])
        equation = equation.replace(" ", "")
        if "..." in equation or len(operands) != 2 or "->" not in equation:
            raise self.fail("einsum is supported with two operands (a traced value and a constant) and an explicit "
                            "output, without '...'")
        ins, out = equation.split("->")
        subs = ins.split(",")
        traced_at = [i for i, o in enumerate(operands) if isinstance(o, TracedTensor) and o._node.token_dims]
        if len(traced_at) != 1:
            raise self.fail("einsum needs exactly one traced operand; the other must be a constant")
        t = traced_at[0]
        n, const = operands[t]._node, self.node_of(operands[1 - t])
        td = n.token_dims
        tokens = subs[t][:td]
        if out[:td] != tokens or any(ch in subs[1 - t] or ch in out[td:] for ch in tokens):
            raise self.fail(f"einsum {equation!r}: the traced operand's leading token letters {tokens!r} must lead "
                            f"the output and appear nowhere else")
        # the same contraction over the features, for any leading dims (tokens, or a basis)
        feat = ["..." + subs[t][td:], subs[1 - t]] if t == 0 else [subs[1 - t], "..." + subs[t][td:]]
        feature_eq = f"{feat[0]},{feat[1]}->...{out[td:]}"
        fn = (lambda b, W: torch.einsum(feature_eq, b, W)) if t == 0 else (lambda b, W: torch.einsum(feature_eq, W, b))
        shape = tuple(torch.einsum(equation, *[torch.empty(o.shape, device="meta") for o in operands]).shape)
        return self.proxy(self.linear(n, fn, shape, f"einsum({equation})", const))

    # --- indexing ----------------------------------------------------------------------------------
    def parse_index(self, node: Node, key):
        """An index into a traced value -> (pos, heads), or 'newaxis' for x[..., None].

        pos / heads: None (all), an int (dim dropped) or a tuple of ints (dim kept)."""
        key = key if isinstance(key, tuple) else (key,)
        # index arrays and lists (act[:, [0, 2]], TransformerLens's Slice of positions) as tuples: they
        # compare with Ellipsis and slices below without an elementwise truth value
        key = tuple(_index_tuple(k) for k in key)
        if key == (Ellipsis, None):
            return "newaxis"
        if any(k is None for k in key):
            raise self.fail(f"index {key!r}: a new axis is supported as x[..., None] alone; index first, then "
                            f"add the axis")
        if Ellipsis in key:
            i = key.index(Ellipsis)
            key = key[:i] + (slice(None),) * (len(node.shape) - len(key) + 1) + key[i + 1:]
        key = key + (slice(None),) * (len(node.shape) - len(key))
        if len(key) > len(node.shape) or key[0] != slice(None):
            raise self.fail(f"index {key!r}: the batch dim must be taken whole (act[:, ...])")
        td = node.token_dims
        pos = self.index_along(key[1], node.shape[1], "position") if td == 2 else None
        feature_key = key[td:]
        heads = self.index_along(feature_key[0], node.shape[td], "feature") if feature_key else None
        if any(k != slice(None) for k in feature_key[1:]):
            raise self.fail(f"index {key!r}: inside the features only the first feature dim (heads) can be indexed")
        return pos, heads

    def index_along(self, k, size: int, what: str):
        if isinstance(k, slice):
            return None if k == slice(None) else tuple(range(size)[k])
        if isinstance(k, int):
            if not -size <= k < size:
                raise self.fail(f"{what} {k} is outside the size {size}")
            return k % size
        if isinstance(k, TracedTensor):
            raise self.fail("indexing with a traced value (a data-dependent selection); use a mask multiplied in "
                            "or torch.where")
        k = torch.as_tensor(k)
        if k.dtype == torch.bool:
            if k.shape != (size,):
                raise self.fail(f"a boolean {what} mask must have length {size}, got {list(k.shape)}")
            return tuple(k.nonzero().flatten().tolist())
        if k.dim() == 1 and not k.is_floating_point():
            return tuple(int(i) % size for i in k.tolist())
        raise self.fail(f"unsupported {what} index {k!r}")

    @staticmethod
    def selected_shape(n: Node, pos, heads) -> tuple[tuple[int, ...], int]:
        """Shape and token dims of n[:, pos][..., heads, :] (see ir.evaluate's select)."""
        probe = torch.empty(n.shape, device="meta")
        if pos is not None:
            probe = probe[:, list(pos) if isinstance(pos, tuple) else pos]
        td = n.token_dims - (1 if isinstance(pos, int) else 0)
        if heads is not None:
            probe = probe[(slice(None),) * td + (list(heads) if isinstance(heads, tuple) else heads,)]
        return tuple(probe.shape), td

    def select_node(self, n: Node, pos, heads) -> Node:
        shape, td = self.selected_shape(n, pos, heads)
        return self.add("select", (n, pos, heads), shape, td)

    def getitem(self, x: "TracedTensor", key):
        n = x._node
        parsed = self.parse_index(n, key)
        if parsed == "newaxis":
            return self.proxy(self.add("reshape", (n, n.feature_shape + (1,)), n.shape + (1,), n.token_dims))
        pos, heads = parsed
        if pos is None and heads is None:
            return self.proxy(n)
        # as in torch, ints and slices give a view (an in-place op on it writes act); lists and masks a copy
        basic = all(k is Ellipsis or isinstance(k, (int, slice)) for k in (key if isinstance(key, tuple) else (key,)))
        return self.proxy(self.select_node(n, pos, heads), view=(x, pos, heads) if basic else None)

    def setitem(self, x: "TracedTensor", key, value) -> None:
        if x is not self.act:
            raise self.fail("assignment into a value other than the hook's own act (a copy, or an "
                            "intermediate): assign into act itself, or return the new value")
        if isinstance(key, TracedTensor):  # act[act > t] = v: a mask computed from act, elementwise
            if key.shape != x.shape:
                raise self.fail(f"assignment through a traced mask of shape {list(key.shape)}: a mask computed from "
                                f"act must have act's shape {list(x.shape)} (or use torch.where)")
            self.write_into(x, self.record("masked_fill", (x, key, value), {}))
            return
        first = _index_tuple(key[0] if isinstance(key, tuple) and key else key)
        if first is not Ellipsis and first is not None and not isinstance(first, TracedTensor) and first != slice(None):
            return self.write_batch_rows(x, key, value)
        parsed = self.parse_index(x._node, key)
        if parsed == "newaxis":
            raise self.fail("assignment through [..., None]")
        pos, heads = parsed
        v = self.node_of(value)
        if v.op == "select" and v.args == (self.version, pos, heads):
            return  # act[k] written back into itself, as `act[:, k] += v` does after the in-place add
        slot, _ = self.selected_shape(x._node, pos, heads)
        try:
            if tuple(torch.broadcast_shapes(v.shape, slot)) != slot:
                raise RuntimeError
        except RuntimeError:
            raise self.fail(f"cannot assign a value of shape {list(v.shape)} to a slot of shape {list(slot)}") from None
        self.version = self.add("write", (self.version, v, pos, heads), x._node.shape, 2)
        x._node = self.version

    def write_batch_rows(self, x: "TracedTensor", key, value) -> None:
        """act[1, :] = 0 (TransformerLens's tests do it): some batch rows written with a constant, as
        torch.where(mask, the value there, act) with the mask and the value constants of act's shape."""
        if isinstance(value, TracedTensor):
            raise self.fail(f"assignment of a traced value into batch rows (act[{key!r}] = ...): rows of a batch are "
                            f"separate requests in the engine; write a constant there, or use torch.where with a "
                            f"mask over the batch")
        mask = torch.zeros(x.shape, dtype=torch.bool)
        written = torch.zeros(x.shape, dtype=x.dtype)
        try:
            mask[key] = True
            written[key] = torch.as_tensor(value, dtype=x.dtype)
        except (IndexError, RuntimeError) as e:
            raise self.fail(f"cannot assign into act[{key!r}] of shape {list(x.shape)}: {e}") from None
        new = torch.where(mask, written, x)
        self.version = self.add("write", (self.version, self.node_of(new), None, None), x._node.shape, 2)
        x._node = self.version

    def write_into(self, x, value) -> "TracedTensor":
        """An in-place op's result (a traced value, a constant or a number) written into x."""
        if not isinstance(x, TracedTensor):
            raise self.fail("an in-place op on a constant tensor with a traced operand (`z += act` where z is not "
                            "act): write it out of place, `z = z + act`")
        return self.inplace(x, self.node_of(value))

    def made_like(self, name: str, x: "TracedTensor", args: tuple, kwargs: dict) -> torch.Tensor:
        """torch.zeros_like(act), act.new_full(size, v), torch.randn_like(act), ...: a host tensor, a
        constant of the pass (random ones drawn now from torch's generator, as TransformerLens draws them
        when its hook runs)."""
        like = name.endswith("_like")
        shape = tuple(x.shape) if like else _size(args[1:2] if name == "new_full" else args[1:], kwargs)
        dtype = kwargs.get("dtype") or x.dtype
        if name in _DRAWN_LIKE:
            return _DRAWN_LIKE[name](shape, dtype=dtype)
        value = _FILLED_LIKE.get(name, kwargs.get("fill_value", args[-1] if len(args) > (1 if like else 2) else None))
        if not isinstance(value, (int, float, bool)):
            raise self.fail(f"{name} with fill value {value!r}: the value must be a number (for a value computed "
                            f"from act, use torch.where or arithmetic)")
        return torch.full(shape, value, dtype=dtype)

    def inplace(self, x: "TracedTensor", value: Node) -> "TracedTensor":
        """x op= v: a write into act (or into act[k] when x is such a view of it)."""
        if x._view is not None:
            base, pos, heads = x._view
            self.setitem(base, self.key_of(pos, heads), self.proxy(value))
            x._node = self.select_node(self.version, pos, heads)
            return x
        if x is not self.act:
            x._node = value  # an in-place op on an intermediate value: just rebind it
            return x
        self.setitem(x, (Ellipsis,), self.proxy(value))
        return x

    @staticmethod
    def key_of(pos, heads) -> tuple:
        def part(p):
            return slice(None) if p is None else (list(p) if isinstance(p, tuple) else p)
        return (slice(None), part(pos), part(heads))


def _index_tuple(k):
    """An index array or list as a tuple of its elements; any other index as it is."""
    if isinstance(k, list):
        return tuple(k)
    if isinstance(k, np.ndarray) or (isinstance(k, torch.Tensor) and not isinstance(k, TracedTensor) and k.dim() == 1):
        return tuple(k.tolist())
    return k
