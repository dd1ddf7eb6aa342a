"""Lowered programs: what a hook site executes. Plain data, no user Python.

A hook on one hook point lowers to a list of ops, run in order on the site tensor x [T, F]
(the flattened tokens of one engine step). Each op touches the tokens of its pass whose padded
position is selected, and is an instance of a kernel template (kernels/): its behaviour is the
contents of its tensors, so changing a parameter never changes code.
"""
import hashlib
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch


@dataclass
class AffineWrite:
    """x[t] <- x[t] * scale + bias[t] + (x[t] @ U) @ V at the selected tokens (kernels.affine_write)."""

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


@dataclass
class Read:
    """value[t] = x[t] @ W + bias[t] at the selected tokens, delivered to the host into read `key`.

    W None means the identity (kernels.gather_rows), else kernels.project_read. The host result has
    the traced value's shape: [B, P, *feature_shape], or [B, *feature_shape] when `keeps_pos` is
    False (one selected position). Positions a request does not have (padding) read as zero.
    """

    key: object  # any hashable, unique within a pass
    positions: torch.Tensor | None
    keeps_pos: bool
    W: torch.Tensor | None  # [F, O]
    bias: torch.Tensor | None  # [O], or [B, P, O] per token
    feature_shape: tuple[int, ...]
    store: object = None  # a StoreSpec: the value goes to that device store instead of the host





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


@dataclass
class GeneratedWrite:
    """x[t] <- program(x[t]) at the selected tokens, by a kernel generated for the program."""

    positions: torch.Tensor | None
    program: TokenProgram
    # per-request parameters (app configs): {param: {"consts[i]": slope}}, as AffineWrite's
    slopes: dict = field(default_factory=dict)
    # resident ops: {const index: store name}, tables of a per-request store (store.put(..., reduce=)),
    # which the engine binds to the store's per-request values (backend/control.py)
    store_tables: dict = field(default_factory=dict)


@dataclass
class GeneratedRead:
    """value[t] = program(x[t]) at the selected tokens, delivered like a Read."""

    key: object
    positions: torch.Tensor | None
    keeps_pos: bool
    program: TokenProgram
    feature_shape: tuple[int, ...]
    store: object = None  # a StoreSpec: the value goes to that device store instead of the host
    slopes: dict = field(default_factory=dict)  # as GeneratedWrite's
    store_tables: dict = field(default_factory=dict)  # as GeneratedWrite's
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
    if isinstance(op, (Read, GeneratedRead)) and op.store is None and not op.keeps_pos \
            and op.positions is not None and op.positions.tolist() == last:
        op = replace(op, positions=None)
    if isinstance(op, (GeneratedWrite, GeneratedRead)):
        tables = {i: stores[_storage(c)] for i, c in enumerate(op.program.consts) if _storage(c) in stores}
        if tables:
            op = replace(op, store_tables=tables)
    return op


def named_tensors(op: LoweredOp) -> list[tuple[str, torch.Tensor]]:
    """An op's tensors by field name ("scale", "bias", ..., "consts[i]" of a program)."""
    program = getattr(op, "program", None)
    if program is not None:
        return [(f"consts[{i}]", c) for i, c in enumerate(program.consts)]
    return [(n, t) for n in ("scale", "bias", "U", "V", "W") if (t := getattr(op, n, None)) is not None]


def to_device(op: LoweredOp, device, moved: dict | None = None) -> LoweredOp:
    """The op with its tensors on the engine's device: moved once, when a pass opens, never per step.

    Store buffers are allocated there already, and must stay the same tensors (they are live);
    `moved` maps id(tensor) to the device tensor already made for it (stores moved beforehand)."""
    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        return moved[id(t)] if moved and id(t) in moved else t.to(device)

    slopes = {p: {f: move(t) for f, t in by_field.items()} for p, by_field in getattr(op, "slopes", {}).items()}
    if isinstance(op, (GeneratedWrite, GeneratedRead)):
        program = TokenProgram(op.program.ops, [move(c) for c in op.program.consts], op.program.output)
        return replace(op, program=program, slopes=slopes)
    fields = {name: move(getattr(op, name)) for name in ("scale", "bias", "U", "V", "W") if hasattr(op, name)}
    return replace(op, **fields, **({"slopes": slopes} if isinstance(op, AffineWrite) else {}))


def op_digest(op: LoweredOp) -> bytes:
    """Bytes that change whenever what the op does changes (its kind, positions and tensors)."""
    h = hashlib.sha256(type(op).__name__.encode())
    program = getattr(op, "program", None)
    stores = getattr(op, "store_tables", {})  # a store's values change as requests run: its name counts
    tensors = [op.positions] + ([c for i, c in enumerate(program.consts) if i not in stores] if program else
                                [getattr(op, name, None) for name in ("scale", "bias", "U", "V", "W")])
    if program:
        h.update(repr([(o.op, o.args, o.shape) for o in program.ops]).encode())
    h.update(repr((sorted(stores.items()), getattr(getattr(op, "store", None), "name", None))).encode())
    for t in tensors:
        if t is not None:
            h.update(repr((t.dtype, tuple(t.shape))).encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.digest()


def describe(op: LoweredOp) -> str:
    """One line per lowered op: which template runs, on which tokens, with which parameters."""
    where = "every position" if op.positions is None else f"positions {op.positions.nonzero().flatten().tolist()}"
    if isinstance(op, AffineWrite):
        changed = int((op.scale != 1).sum())
        bias = "per-token bias table" if op.per_token_bias else ("bias" if bool(op.bias.any()) else "no bias")
        return (f"affine_write (parametric) at {where}: scale changes {changed} of {op.scale.numel()} features, "
                f"low rank {op.U.shape[1]}, {bias}")
    if isinstance(op, GeneratedWrite):
        return f"generated kernel (write) at {where}: {len(op.program.ops)} ops [{', '.join(o.op for o in op.program.ops)}]"
    sink = f"store {op.store.name!r}" if op.store is not None else "the host"
    if isinstance(op, Read):
        template = "gather_rows" if op.W is None else f"project_read W{list(op.W.shape)}"
        return f"{template} (parametric) at {where} -> {sink}, value {list(op.feature_shape)} per token"
    ops = ", ".join(o.op for o in op.program.ops)
    return f"generated kernel (read -> {sink}) at {where}: {len(op.program.ops)} ops [{ops}]"
