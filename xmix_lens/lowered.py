"""Lowered programs: what a hook site executes. Plain data, no user Python.

A hook on one hook point lowers to a list of ops, run in order on the site tensor x [T, F]
(the flattened tokens of one engine step). Each op touches the tokens of its pass whose padded
position is selected, and is an instance of a kernel template (kernels/): its behaviour is the
contents of its tensors, so changing a parameter never changes code.

What an op kind does is told by its class, so that code running ops asks the op, never its type,
and a new kind is a new class.
"""
import hashlib
from dataclasses import dataclass, field, replace
from typing import ClassVar, NamedTuple

import torch

from .ops import OPS


class _OpKind:
    """What every op kind tells of itself. Each kind's class adds `uses_token_tables` (a tensor holds
    a value per token of a pass: patching from a cache) and `describe()` (one line: which template
    runs, on which tokens, with which parameters); a kind that may take slopes adds `with_param_tables`."""

    writes: ClassVar[bool]  # changes x's selected rows in place; else delivers a value per token (a read)
    is_program: ClassVar[bool] = False  # runs a generated per-token program; else a parametric template
    _tensor_fields: ClassVar[tuple[str, ...]] = ()  # a template's tensors, in named_tensors' order

    def may_take_slope(self, field: str) -> bool:
        """Whether a request param's value may move this field (a name of named_tensors) by a slope."""
        return False

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The op's tensors by field name ("scale", "bias", ..., "consts[i]" of a program)."""
        return [(n, t) for n in self._tensor_fields if (t := getattr(self, n)) is not None]

    def to_device(self, device, moved: dict | None = None):
        """The op with its tensors on the engine's device: moved once, when a pass opens, never per step.

        Store buffers are allocated there already, and must stay the same tensors (they are live);
        `moved` maps id(tensor) to the device tensor already made for it (stores moved beforehand)."""
        def move(t):
            if not isinstance(t, torch.Tensor):
                return t
            return moved[id(t)] if moved and id(t) in moved else t.to(device)

        return replace(self, **self._moved_fields(move))

    def _moved_fields(self, move) -> dict:
        """The fields that hold tensors, their tensors moved by `move`."""
        return {n: move(getattr(self, n)) for n in self._tensor_fields}

    def digest(self) -> bytes:
        """Bytes that change whenever what the op does changes (its kind, positions and tensors)."""
        h = hashlib.sha256(type(self).__name__.encode())
        stores = getattr(self, "store_tables", {})  # a store's values change as requests run: its name counts
        if self.is_program:
            h.update(repr([(o.op, o.args, o.shape) for o in self.program.ops]).encode())
        h.update(repr((sorted(stores.items()), getattr(getattr(self, "store", None), "name", None))).encode())
        tables = {f"consts[{i}]" for i in stores}
        for t in [self.positions] + [t for name, t in self.named_tensors() if name not in tables]:
            if t is not None:
                h.update(repr((t.dtype, tuple(t.shape))).encode())
                h.update(t.detach().cpu().contiguous().numpy().tobytes())
        return h.digest()

    def structure(self) -> tuple:
        """What the op does apart from its tensors' values: its kind, program, positions, stores and
        its tensors' shapes. An op of the same structure takes another's values in place (an
        installed app's set_params), so that a CUDA graph that launches it replays with them."""
        stores = getattr(self, "store_tables", {})
        tables = {f"consts[{i}]" for i in stores}
        program = tuple((o.op, o.args, o.shape) for o in self.program.ops) if self.is_program else None
        positions = None if self.positions is None else tuple(self.positions.tolist())
        return (type(self).__name__, program, positions, tuple(sorted(stores.items())),
                getattr(getattr(self, "store", None), "name", None),
                tuple((name, tuple(t.shape)) for name, t in self.named_tensors() if name not in tables))

    def keeps_finite(self) -> bool:
        """Whether finite activations stay finite under the op: its tensors are finite and, for a
        program, none of its ops can make an inf or a NaN of finite values (xmix_lens.ops: `finite`)."""
        program_ok = not self.is_program or all(OPS[o.op].finite for o in self.program.ops)
        return program_ok and all(bool(torch.isfinite(t).all()) for _, t in self.named_tensors()
                                  if t.is_floating_point())

    def _where(self) -> str:
        if self.positions is None:
            return "every position"
        return f"positions {self.positions.nonzero().flatten().tolist()}"


def _moved_slopes(slopes: dict, move) -> dict:
    return {p: {f: move(t) for f, t in by_field.items()} for p, by_field in slopes.items()}


def _sink(store) -> str:
    """Where a read's value goes."""
    return f"store {store.name!r}" if store is not None else "the host"


@dataclass
class AffineWrite(_OpKind):
    """x[t] <- x[t] * scale + bias[t] + (x[t] @ U) @ V at the selected tokens (kernels.affine_write)."""

    writes: ClassVar[bool] = True
    _tensor_fields: ClassVar[tuple[str, ...]] = ("scale", "bias", "U", "V")

    positions: torch.Tensor | None  # bool [P] over padded positions; None: every position
    scale: torch.Tensor  # [F]
    bias: torch.Tensor  # [F], or [B, P, F] when it differs per token (patching from a cache)
    U: torch.Tensor  # [F, K]
    V: torch.Tensor  # [K, F]
    # per-request parameters (app configs): {param: {"bias": slope}}, bias = bias + (value - default) * slope
    slopes: dict = field(default_factory=dict)

    @property
    def per_token_bias(self) -> bool:
        return self.bias.dim() == 3

    @property
    def uses_token_tables(self) -> bool:
        return self.per_token_bias

    def may_take_slope(self, field: str) -> bool:
        return field == "bias"  # the added term: a request's value adds in proportion

    def with_param_tables(self, fields: set[str], slots: int) -> tuple["AffineWrite", dict]:
        """The op with its bias held as a table [slots, F] (slot 0 the default), read per token as a
        per-token bias; and that table by field name."""
        table = self.bias.expand(slots, *self.bias.shape).clone()
        return replace(self, bias=table[:, None]), {"bias": table}

    def _moved_fields(self, move) -> dict:
        return super()._moved_fields(move) | {"slopes": _moved_slopes(self.slopes, move)}

    def describe(self) -> str:
        changed = int((self.scale != 1).sum())
        bias = "per-token bias table" if self.per_token_bias else ("bias" if bool(self.bias.any()) else "no bias")
        return (f"affine_write (parametric) at {self._where()}: scale changes {changed} of {self.scale.numel()} "
                f"features, low rank {self.U.shape[1]}, {bias}")


@dataclass
class Read(_OpKind):
    """value[t] = x[t] @ W + bias[t] at the selected tokens, delivered to the host into read `key`.

    W None means the identity (kernels.gather_rows), else kernels.project_read. The host result has
    the traced value's shape: [B, P, *feature_shape], or [B, *feature_shape] when `keeps_pos` is
    False (one selected position). Positions a request does not have (padding) read as zero.
    """

    writes: ClassVar[bool] = False
    _tensor_fields: ClassVar[tuple[str, ...]] = ("bias", "W")

    key: object  # any hashable, unique within a pass
    positions: torch.Tensor | None
    keeps_pos: bool
    W: torch.Tensor | None  # [F, O]
    bias: torch.Tensor | None  # [O], or [B, P, O] per token
    feature_shape: tuple[int, ...]
    store: object = None  # a StoreSpec: the value goes to that device store instead of the host

    @property
    def uses_token_tables(self) -> bool:
        return self.bias is not None and self.bias.dim() > 1

    def describe(self) -> str:
        template = "gather_rows" if self.W is None else f"project_read W{list(self.W.shape)}"
        return (f"{template} (parametric) at {self._where()} -> {_sink(self.store)}, "
                f"value {list(self.feature_shape)} per token")


# --- generated programs: what falls outside the parametric templates -----------------------------
class TokenOp(NamedTuple):
    """One op of a per-token program (xmix_lens.ops lists them); args are indices of earlier ops or Python numbers.

    In value arguments an int is an earlier op's index and a float is a number (`mul v 2.0`).

    Values are per token: shape () (a scalar per token) or (n,) (a feature vector per token).
    Ops (elementwise ones broadcast () against (n,)):
      x                          the site tensor's row for this token, shape (F,)
      const i                    program.consts[i], the same for every token, shape () or (n,)
      table i                    program.consts[i][flat index of the token], per token (patching)
      add sub mul div a b        arithmetic;  neg abs a;  pow a p (p a number)
      relu gelu sigmoid tanh exp log a
      softmax a                  over the feature dim
      gt ge lt le eq ne a b      comparisons -> 0.0 / 1.0;  logical_and logical_or a b;  logical_not a
      where c a b                c != 0 ? a : b;  clamp a lo hi (lo, hi numbers or None)
      sum mean max min norm a    reductions over the feature dim -> ()
      matmul a i                 a (n,) @ program.consts[i] (n, k) -> (k,);  a () * row vector when n == 1
      topk_mask a k              a where a is among its k largest features, else 0 (SAE top-k)
      unsqueeze a                () -> (1,)
    """

    op: str
    args: tuple
    shape: tuple[int, ...]


class TokenProgram(NamedTuple):
    """A per-token program as generated kernels take it: plain tuples and tensors, launch arguments."""

    ops: list[TokenOp]
    consts: list[torch.Tensor]
    output: int  # index of the op whose value is the program's result


class _Program(_OpKind):
    """What the generated kinds share: their tensors are the program's consts, a request param may
    move a const, and a `table` const holds a value per token."""

    is_program: ClassVar[bool] = True

    @property
    def uses_token_tables(self) -> bool:
        # a table of a store (store_tables) holds the store's per-request values, not a pass's per token
        return any(o.op == "table" and o.args[0] not in self.store_tables for o in self.program.ops)

    def may_take_slope(self, field: str) -> bool:
        return field.startswith("consts[")

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"consts[{i}]", c) for i, c in enumerate(self.program.consts)]

    def with_param_tables(self, fields: set[str], slots: int) -> tuple["_Program", dict]:
        """The op with each const in `fields` ("consts[i]") held as a table [slots, ...] (slot 0 the
        default), read per token by a `table` op instead of `const`; and those tables by field name."""
        consts, tables = list(self.program.consts), {}
        for f in fields:
            i = int(f[len("consts["):-1])
            consts[i] = tables[f] = consts[i].expand(slots, *consts[i].shape).clone()
        ops = [TokenOp("table", o.args, o.shape) if o.op == "const" and f"consts[{o.args[0]}]" in tables else o
               for o in self.program.ops]
        return replace(self, program=TokenProgram(ops, consts, self.program.output)), tables

    def _moved_fields(self, move) -> dict:
        program = TokenProgram(self.program.ops, [move(c) for c in self.program.consts], self.program.output)
        return {"program": program, "slopes": _moved_slopes(self.slopes, move)}

    def _ops_text(self) -> str:
        return f"{len(self.program.ops)} ops [{', '.join(o.op for o in self.program.ops)}]"


@dataclass
class GeneratedWrite(_Program):
    """x[t] <- program(x[t]) at the selected tokens, by a kernel generated for the program."""

    writes: ClassVar[bool] = True

    positions: torch.Tensor | None
    program: TokenProgram
    # per-request parameters (app configs): {param: {"consts[i]": slope}}, as AffineWrite's
    slopes: dict = field(default_factory=dict)
    # resident ops: {const index: store name}, tables of a per-request store (store.put(..., reduce=)),
    # which the engine binds to the store's per-request values (backend/control.py)
    store_tables: dict = field(default_factory=dict)

    def describe(self) -> str:
        return f"generated kernel (write) at {self._where()}: {self._ops_text()}"


@dataclass
class GeneratedRead(_Program):
    """value[t] = program(x[t]) at the selected tokens, delivered like a Read."""

    writes: ClassVar[bool] = False

    key: object
    positions: torch.Tensor | None
    keeps_pos: bool
    program: TokenProgram
    feature_shape: tuple[int, ...]
    store: object = None  # a StoreSpec: the value goes to that device store instead of the host
    slopes: dict = field(default_factory=dict)  # as GeneratedWrite's
    store_tables: dict = field(default_factory=dict)  # as GeneratedWrite's

    def describe(self) -> str:
        return f"generated kernel (read -> {_sink(self.store)}) at {self._where()}: {self._ops_text()}"


LoweredOp = AffineWrite | Read | GeneratedWrite | GeneratedRead

# An installed app is traced for a pass of this many positions: two, so that a read of the last
# one (`act[:, -1]`) is told apart from one of the first.
RESIDENT_TRACE_LEN = 2


class ResidentRead(NamedTuple):
    """What a resident app's read delivers: `app.outputs[output]`, `feature_shape` per token; with
    `last`, only each request's last position (the hook read `act[:, -1]`)."""

    output: str
    feature_shape: tuple[int, ...]
    last: bool = False


def resident_form(ops_by_point: dict[str, list[LoweredOp]]) -> dict[str, list[LoweredOp]]:
    """An installed app's ops (traced for RESIDENT_TRACE_LEN positions) as the engine keeps them, on
    every token: a read of the last position reads every token, its `keeps_pos` False telling the
    host to keep each request's last position (a resident op cannot know which token is a request's
    last); a program's table of a store the app puts is named in its `store_tables`. Other position
    selections are left as they are, and refused as not per token (control.check_resident)."""
    stores = {_storage(t): op.store.name for ops in ops_by_point.values() for op in ops
              if getattr(op, "store", None) is not None for t in (op.store.buffer, op.store.row_buffer)}
    return {point: [_resident_op(op, stores) for op in ops] for point, ops in ops_by_point.items()}


def _storage(t: torch.Tensor) -> int:
    """Which memory a tensor views (a program's table of a store is a reshaped view of its buffer)."""
    return t.untyped_storage().data_ptr()


def _resident_op(op: LoweredOp, stores: dict[int, str]) -> LoweredOp:
    last = [False] * (RESIDENT_TRACE_LEN - 1) + [True]
    if not op.writes and op.store is None and not op.keeps_pos \
            and op.positions is not None and op.positions.tolist() == last:
        op = replace(op, positions=None)
    if op.is_program:
        tables = {i: stores[_storage(c)] for i, c in enumerate(op.program.consts) if _storage(c) in stores}
        if tables:
            op = replace(op, store_tables=tables)
    return op


# --- the ops' methods as functions, as other modules import them ---------------------------------
def named_tensors(op: LoweredOp) -> list[tuple[str, torch.Tensor]]:
    return op.named_tensors()


def to_device(op: LoweredOp, device, moved: dict | None = None) -> LoweredOp:
    return op.to_device(device, moved)


def op_digest(op: LoweredOp) -> bytes:
    return op.digest()


def describe(op: LoweredOp) -> str:
    """One line per lowered op: which template runs, on which tokens, with which parameters."""
    return op.describe()
