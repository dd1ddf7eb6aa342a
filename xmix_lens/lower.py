"""Lowering: a hook point's Graph -> the ops its site runs (xmix_lens.lowered).

Values are tracked per token, over the flattened features of one version x of the activation.
Most stay affine:

    value[t] = x[t][features] * scale + (x[t] @ U) @ V + bias[t]

with `features` an index into x's features (None: all of them, in order), U [F, K], V [K, O] and
bias [O] or per token [B, P, O]. Adding, scaling by constants, matmul / einsum / sums with
constants, selecting positions or heads, reshaping and permuting feature dims all keep that form,
so such writes lower to the parametric affine_write template and reads to gather_rows /
project_read: installing or changing them fills buffers and never generates code.

Anything else (a product of two traced values, relu, where, softmax, comparisons, max, norm)
becomes an `Expr`, a per-token expression DAG that lowers to a TokenProgram: a kernel generated
for the program (GeneratedWrite / GeneratedRead).
"""
from dataclasses import dataclass

import torch

from .ir import Graph, Node, evaluate_node
from .lowered import AffineWrite, GeneratedRead, GeneratedWrite, LoweredOp, Read, TokenOp, TokenProgram
from .ops import OPS
from .trace import TraceError


def _numel(shape) -> int:
    return int(torch.tensor(shape, dtype=torch.long).prod()) if shape else 1


def _onehot(rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    """M [n_rows, len(rows)] with M[rows[j], j] = 1: `v @ M` picks v[rows]."""
    M = torch.zeros(n_rows, rows.numel())
    M[rows, torch.arange(rows.numel())] = 1.0
    return M


def _pick(feature_shape, heads) -> torch.Tensor:
    """Flattened feature indices of `heads` (an int, a tuple, or None for all) on the first feature dim."""
    idx = torch.arange(_numel(feature_shape)).reshape(feature_shape)
    return idx if heads is None else idx[list(heads) if isinstance(heads, tuple) else heads]


@dataclass(frozen=True)
class Span:
    """Which padded positions a value covers; `keeps_pos` False when one position was selected."""

    positions: tuple[int, ...] | None = None  # None: every position
    keeps_pos: bool = True


@dataclass
class Affine:
    version: Node
    scale: torch.Tensor | None  # [O]
    features: torch.Tensor | None  # [O] long: which of x's features `scale` multiplies; None: all
    U: torch.Tensor  # [F, K]
    V: torch.Tensor  # [K, O]
    bias: torch.Tensor  # [O] or [B, P, O]
    feature_shape: tuple[int, ...]
    span: Span

    @property
    def O(self) -> int:
        return _numel(self.feature_shape)

    def reindexed(self, idx: torch.Tensor, feature_shape) -> "Affine":
        """The same value with its output features picked (and repeated) by idx."""
        features = None if self.scale is None else (idx if self.features is None else self.features[idx])
        return Affine(self.version, None if self.scale is None else self.scale[idx], features, self.U,
                      self.V[:, idx], self.bias[..., idx], tuple(feature_shape), self.span)

    def scale_matrix(self, F: int) -> torch.Tensor:
        """The scale term as a matrix E [F, O]: x[features] * scale == x @ E."""
        if self.scale is None:
            return torch.zeros(F, self.O)
        return _onehot(torch.arange(F) if self.features is None else self.features, F) * self.scale


@dataclass(eq=False)
class Expr:
    """A per-token expression over x (flattened) that is not affine: op, args (Exprs or numbers)."""

    op: str
    args: tuple
    n: int | None  # per-token length; None for a scalar per token
    version: Node
    span: Span
    feature_shape: tuple[int, ...]


def _fail(node: Node, graph: Graph, what: str) -> TraceError:
    return TraceError(f"hook point {graph.hook_name!r} at {node.where}\n  {what}")


class Lowerer:
    def __init__(self, graph: Graph, params: dict[str, torch.Tensor] | None = None):
        self.graph = graph
        self.params = params or {}  # app parameter name -> value, for the graph's param nodes
        B, P, *features = graph.act_shape
        self.B, self.P, self.act_features = B, P, tuple(features)
        self.F = _numel(features)
        self.forms: dict[Node, Affine | Expr | torch.Tensor] = {}

    # --- constants -------------------------------------------------------------------------------
    def per_token(self, c: torch.Tensor, span: Span, fs: tuple[int, ...], node: Node) -> torch.Tensor:
        """A constant on tokens of `span` with features `fs`, flattened: [O] if the same for every
        token, else a [B, P, O] table over padded positions (zero where the span has no token)."""
        lead = (self.B,) + ((len(span.positions) if span.positions else self.P,) if span.keeps_pos else ())
        try:
            shape = torch.broadcast_shapes(c.shape, lead + fs)
        except RuntimeError:
            raise _fail(node, self.graph, f"a constant of shape {list(c.shape)} does not broadcast with "
                                          f"{list(lead + fs)}") from None
        # compared over the constant's own extent on the tokens, not its broadcast: a [d_model] vector
        # over 1,000 x 64 tokens was 65M comparisons, 13 ms of a call's host time
        own = c.reshape((1,) * (len(shape) - c.dim()) + tuple(c.shape))
        rows = own.expand(own.shape[: len(lead)] + fs).reshape(-1, _numel(fs))
        if bool((rows == rows[:1]).all()):
            return rows[0].clone()
        c = c.expand(shape)
        table = torch.zeros(self.B, self.P, _numel(fs))
        where = slice(None) if span.positions is None else list(span.positions)
        table[:, where] = c.reshape(self.B, -1, _numel(fs)) if span.keeps_pos else c.reshape(self.B, 1, -1)
        return table

    # --- shapes ----------------------------------------------------------------------------------
    def widen(self, a, shape: tuple[int, ...]):
        """Broadcast a value's feature dims up to `shape`."""
        if a.feature_shape == tuple(shape):
            return a
        idx = torch.arange(a.O if isinstance(a, Affine) else _numel(a.feature_shape)).reshape(a.feature_shape)
        idx = idx.expand(torch.broadcast_shapes(idx.shape, shape)).reshape(-1)
        if isinstance(a, Affine):
            return a.reindexed(idx, shape)
        return Expr("matmul", (self.as_vector(a), _onehot(idx, _numel(a.feature_shape))), idx.numel(), a.version,
                    a.span, tuple(shape))

    def as_vector(self, e: "Expr") -> "Expr":
        """A scalar-per-token Expr as a length-1 vector, so that matmul applies to it."""
        return Expr("unsqueeze", (e,), 1, e.version, e.span, e.feature_shape) if e.n is None else e

    def to_expr(self, a: Affine) -> Expr:
        F, n = self.F, (None if a.feature_shape == () else a.O)
        x = Expr("x", (), F, a.version, a.span, self.act_features)
        if _is_identity(a, F):
            return x
        terms = []
        if a.scale is not None:
            picked = x if a.features is None else Expr("matmul", (x, _onehot(a.features, F)), a.O, a.version, a.span,
                                                       a.feature_shape)
            terms.append(Expr("mul", (picked, a.scale), a.O, a.version, a.span, a.feature_shape))
        if a.U.shape[1] >= a.O:  # not low rank (`act @ W`: U = W, V = I): one matmul by U @ V
            terms.append(Expr("matmul", (x, a.U @ a.V), a.O, a.version, a.span, a.feature_shape))
        elif a.U.shape[1]:
            low = Expr("matmul", (x, a.U), a.U.shape[1], a.version, a.span, a.feature_shape)
            terms.append(Expr("matmul", (low, a.V), a.O, a.version, a.span, a.feature_shape))
        out = None
        if a.bias.dim() == 3 or bool(a.bias.any()) or not terms:
            out = Expr("table" if a.bias.dim() == 3 else "const", (a.bias,), a.O, a.version, a.span, a.feature_shape)
        for t in terms:
            out = t if out is None else Expr("add", (t, out), a.O, a.version, a.span, a.feature_shape)
        if n is None:  # scalar per token: drop the length-1 dim
            out = Expr("sum", (out,), None, a.version, a.span, a.feature_shape)
        return out

    # --- affine algebra ----------------------------------------------------------------------------
    def add(self, a: Affine, b: Affine, sign: float) -> Affine:
        U, V = torch.cat([a.U, b.U], 1), torch.cat([a.V, sign * b.V], 0)
        if a.scale is None or b.scale is None:  # at most one scale term: keep it as it is
            scale = a.scale if b.scale is None else sign * b.scale
            features = a.features if b.scale is None else b.features
        elif _same(a.features, b.features):
            scale, features = a.scale + sign * b.scale, a.features
        else:  # scale terms on different features: keep a's, carry b's as a low-rank term
            scale, features = a.scale, a.features
            U, V = torch.cat([U, b.scale_matrix(self.F)], 1), torch.cat([V, sign * torch.eye(b.O)], 0)
        return Affine(a.version, scale, features, U, V, a.bias + sign * b.bias, a.feature_shape, a.span)

    def scale_by(self, a: Affine, c: torch.Tensor) -> Affine:
        return Affine(a.version, None if a.scale is None else a.scale * c, a.features, a.U, a.V * c, a.bias * c,
                      a.feature_shape, a.span)

    def linear(self, a: Affine, M: torch.Tensor, out_shape) -> Affine:
        U, V = a.U, a.V @ M
        if a.scale is not None:  # (x[features] * scale) @ M as one more low-rank pair, the smaller way
            E = a.scale_matrix(self.F)
            if a.O <= M.shape[1]:  # x @ E, then @ M: rank O (a logit lens: d_model, not d_vocab)
                U, V = torch.cat([U, E], 1), torch.cat([V, M], 0)
            else:
                U, V = torch.cat([U, E @ M], 1), torch.cat([V, torch.eye(M.shape[1])], 0)
        return Affine(a.version, None, None, U, V, a.bias @ M, tuple(out_shape), a.span)

    # --- visiting nodes ----------------------------------------------------------------------------
    def visit(self, n: Node, ops: list[LoweredOp]) -> None:
        g = self.graph
        args = [self.forms[a] if isinstance(a, Node) else a for a in n.args]
        traced = [a for a in args if isinstance(a, (Affine, Expr))]
        acts = [t for t in traced if t.version is not None]  # store values come from other hook points
        if n.op != "write" and (len({id(t.version) for t in acts}) > 1 or len({t.span for t in traced}) > 1):
            raise _fail(n, g, "combines act from different positions, or from before and after a write; "
                              "ops across positions are not supported inside one hook")
        if n.op == "act":
            self.forms[n] = Affine(n, torch.ones(self.F), None, torch.zeros(self.F, 0), torch.zeros(0, self.F),
                                   torch.zeros(self.F), n.feature_shape, Span())
        elif n.op == "const":
            self.forms[n] = args[0]
        elif n.op == "param":
            if args[0] not in self.params:
                raise _fail(n, g, f"app parameter {args[0]!r} has no value (lower(graph, params=...))")
            self.forms[n] = self.params[args[0]].detach().to("cpu", torch.float32)
        elif not traced and n.op not in ("write", "store"):  # from constants and parameters alone: a value
            self.forms[n] = evaluate_node(n, args)
        elif n.op == "store":  # filled on the device by an earlier hook point, read per token
            spec = args[0]
            length = None if spec.feature_shape == () else _numel(spec.feature_shape)
            # generated tokens read the prompt's per-request value from its one-row-per-request buffer
            table = spec.buffer if spec.buffer.shape[1] == self.P else spec.row_buffer
            self.forms[n] = Expr("table", (table,), length, None, Span(), spec.feature_shape)
        elif n.op == "write":
            self.forms[n] = self.lower_write(n, ops)
        elif n.op in ("add", "sub") and all(isinstance(a, (Affine, torch.Tensor)) for a in args):
            self.forms[n] = self.affine_add(n, args)
        elif n.op in ("mul", "div") and sum(isinstance(a, Affine) for a in args) == 1 and traced == [
                a for a in args if isinstance(a, Affine)] and (n.op == "mul" or isinstance(args[0], Affine)):
            aff = self.widen(traced[0], n.feature_shape)
            c = next(a for a in args if isinstance(a, torch.Tensor))
            factor = self.per_token(c, aff.span, aff.feature_shape, n)
            if factor.dim() == 1:  # the same factor for every token: a scale
                self.forms[n] = self.scale_by(aff, factor if n.op == "mul" else 1.0 / factor)
            else:  # a factor per token (a random mask, a cached run's values): a per-token table in a program
                self.forms[n] = self.expr(n, args)
        elif n.op == "neg" and isinstance(args[0], Affine):
            self.forms[n] = self.scale_by(args[0], torch.tensor(-1.0))
        elif n.op == "linear" and isinstance(args[0], Affine):
            a = args[0]
            basis = torch.eye(a.O).reshape((a.O,) + a.feature_shape)
            M = n.args[1](basis, *args[2:]).reshape(a.O, -1)
            self.forms[n] = self.linear(a, M, n.feature_shape)
        elif n.op == "select":
            self.forms[n] = self.select(n, args[0], args[1], args[2])
        elif n.op in ("reshape", "permute") and isinstance(args[0], Affine):
            a = args[0]
            idx = torch.arange(a.O).reshape(a.feature_shape)
            idx = idx.permute(*args[1]) if n.op == "permute" else idx
            self.forms[n] = a.reindexed(idx.reshape(-1), n.feature_shape)
        else:
            self.forms[n] = self.expr(n, args)

    def affine_add(self, n: Node, args) -> Affine:
        sign = 1.0 if n.op == "add" else -1.0
        a, b = (self.widen(x, n.feature_shape) if isinstance(x, Affine) else x for x in args)
        if isinstance(a, Affine) and isinstance(b, Affine):
            return self.add(a, b, sign)
        if isinstance(a, Affine):
            return Affine(a.version, a.scale, a.features, a.U, a.V, a.bias + sign * self.per_token(b, a.span, a.feature_shape, n),
                          a.feature_shape, a.span)
        negated = self.scale_by(b, torch.tensor(sign))
        return Affine(negated.version, negated.scale, negated.features, negated.U, negated.V,
                      negated.bias + self.per_token(a, negated.span, negated.feature_shape, n), negated.feature_shape, negated.span)

    def select(self, n: Node, a, pos, heads):
        span = a.span
        if pos is not None:
            if span != Span():
                raise _fail(n, self.graph, "selecting positions of a value that already selected positions")
            span = Span((pos,), False) if isinstance(pos, int) else Span(tuple(pos), True)
        idx = _pick(a.feature_shape, heads).reshape(-1)
        if isinstance(a, Affine):
            out = a.reindexed(idx, n.feature_shape)
            out.span = span
            return out
        picked = Expr("matmul", (self.as_vector(a), _onehot(idx, _numel(a.feature_shape))), idx.numel(), a.version,
                      span, n.feature_shape)
        return Expr("sum", (picked,), None, a.version, span, ()) if n.feature_shape == () else picked

    def expr(self, n: Node, args) -> Expr:
        """A node outside the affine forms: build its per-token expression."""
        traced = [a for a in args if isinstance(a, (Affine, Expr))]
        if not traced:
            raise _fail(n, self.graph, f"{n.op} of constants only")
        like = next((a for a in traced if a.version is not None), traced[0])
        length = None if n.feature_shape == () else _numel(n.feature_shape)
        if n.op in OPS and OPS[n.op].kind in ("reduction", "row"):
            if len(like.feature_shape) != 1:
                raise _fail(n, self.graph, f"{n.op} over the last dim is supported on values with one feature dim")
        if n.op == "linear":
            e = self.as_vector(self.to_expr(like) if isinstance(like, Affine) else like)
            basis = torch.eye(_numel(like.feature_shape)).reshape((_numel(like.feature_shape),) + like.feature_shape)
            M = n.args[1](basis, *args[2:]).reshape(_numel(like.feature_shape), -1)
            out = Expr("matmul", (e, M), M.shape[1], like.version, like.span, n.feature_shape)
            return Expr("sum", (out,), None, like.version, like.span, ()) if length is None else out
        if n.op in ("reshape", "permute"):
            idx = torch.arange(_numel(like.feature_shape)).reshape(like.feature_shape)
            idx = (idx.permute(*args[1]) if n.op == "permute" else idx).reshape(-1)
            return Expr("matmul", (self.as_vector(self.as_expr(like)), _onehot(idx, idx.numel())), idx.numel(),
                        like.version, like.span, n.feature_shape)
        operands = []
        for a in args:
            if isinstance(a, (Affine, Expr)):
                elementwise = n.op in OPS and OPS[n.op].kind == "elementwise"
                operands.append(self.as_expr(self.widen(a, n.feature_shape) if elementwise else a))
            elif isinstance(a, torch.Tensor):
                c = self.per_token(a, like.span, n.feature_shape, n)
                operands.append(Expr("table" if c.dim() == 3 else "const", (c if c.dim() == 3 or length else c.reshape(()),),
                                     c.shape[-1] if c.dim() == 3 or length else None, like.version, like.span,
                                     n.feature_shape))
            else:
                operands.append(a)
        span = next((a.span for a in traced if a.span != Span()), like.span)
        return Expr(n.op, tuple(operands), length, like.version, span, n.feature_shape)

    def as_expr(self, a) -> Expr:
        return self.to_expr(a) if isinstance(a, Affine) else a

    # --- writes and reads --------------------------------------------------------------------------
    def lower_write(self, n: Node, ops: list[LoweredOp]) -> Affine:
        version, value, pos, heads = n.args
        form = self.forms[value]
        span = Span() if pos is None else (Span((pos,), False) if isinstance(pos, int) else Span(tuple(pos), True))
        picked = _pick(self.act_features, heads)
        slot_shape, target = tuple(picked.shape), picked.reshape(-1)
        positions = self.position_mask(span)
        if isinstance(form, torch.Tensor):  # a constant: x <- 0 * x + c on the target features
            form = Affine(version, None, None, torch.zeros(self.F, 0), torch.zeros(0, target.numel()),
                          self.per_token(form, span, slot_shape, n), slot_shape, span)
        elif form.version is not None and form.version is not version:
            raise _fail(n, self.graph, "the written value is computed from act before an earlier write")
        elif form.span != span:
            raise _fail(n, self.graph, f"writes positions {span.positions} from a value at positions "
                                       f"{form.span.positions}: ops across positions are not supported in one hook")
        form = self.widen(form, slot_shape)
        if isinstance(form, Expr) and torch.equal(target, torch.arange(self.F)):  # the whole row is replaced
            ops.append(GeneratedWrite(positions, linearize(form)))
        elif isinstance(form, Expr):
            keep = torch.ones(self.F)
            keep[target] = 0.0
            place = _onehot(target, self.F).T
            x = Expr("x", (), self.F, form.version, span, self.act_features)
            kept = Expr("mul", (x, keep), self.F, form.version, span, self.act_features)
            placed = Expr("matmul", (self.as_vector(form), place), self.F, form.version, span, self.act_features)
            program = linearize(Expr("add", (kept, placed), self.F, form.version, span, self.act_features))
            ops.append(GeneratedWrite(positions, program))
        else:
            ops.append(self.affine_write(form, target, positions))
        return Affine(n, torch.ones(self.F), None, torch.zeros(self.F, 0), torch.zeros(0, self.F),
                      torch.zeros(self.F), self.act_features, Span())

    def affine_write(self, form: Affine, target: torch.Tensor, positions) -> AffineWrite:
        F = self.F
        scale = torch.ones(F)
        scale[target] = 0.0
        U, V = form.U, torch.zeros(form.U.shape[1], F)
        V[:, target] = form.V
        if form.scale is not None:
            if form.features is None or torch.equal(form.features, target):
                scale[target] = form.scale
            else:  # the scale term reads other features than it writes: carry it as low rank
                U = torch.cat([U, form.scale_matrix(F)], 1)
                V = torch.cat([V, _onehot(target, F).T], 0)
        bias = torch.zeros(F) if form.bias.dim() == 1 else torch.zeros(self.B, self.P, F)
        bias[..., target] = form.bias
        return AffineWrite(positions, scale, bias.contiguous(), U.contiguous(), V.contiguous())

    def position_mask(self, span: Span) -> torch.Tensor | None:
        if span.positions is None:
            return None
        mask = torch.zeros(self.P, dtype=torch.bool)
        mask[list(span.positions)] = True
        return mask

    def read_op(self, key, n: Node, store=None) -> LoweredOp:
        form = self.forms[n]
        if not isinstance(form, (Affine, Expr)):
            raise _fail(n, self.graph, "a kept value that does not depend on act")
        positions = self.position_mask(form.span)
        keeps = form.span.keeps_pos
        if isinstance(form, Expr):
            return GeneratedRead(key, positions, keeps, linearize(form), form.feature_shape, store)
        if _is_identity(form, self.F):
            return Read(key, positions, keeps, None, None, form.feature_shape, store)
        W = form.scale_matrix(self.F) + form.U @ form.V
        return Read(key, positions, keeps, W.contiguous(), form.bias, form.feature_shape, store)


def _is_identity(a: Affine, F: int) -> bool:
    in_order = a.features is None or torch.equal(a.features, torch.arange(F))
    return (a.scale is not None and in_order and bool((a.scale == 1).all()) and a.U.shape[1] == 0
            and a.bias.dim() == 1 and not bool(a.bias.any()))


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def linearize(root: Expr) -> TokenProgram:
    """An Expr DAG -> a TokenProgram (ops in dependency order, constants deduplicated by identity)."""
    ops: list[TokenOp] = []
    consts: list[torch.Tensor] = []
    index: dict[int, int] = {}

    def const(t: torch.Tensor) -> int:
        consts.append(t.float().contiguous())
        return len(consts) - 1

    def emit(e) -> int | float | None:
        if isinstance(e, torch.Tensor):  # a constant operand of a pointwise op
            ops.append(TokenOp("const", (const(e.reshape(()) if e.numel() == 1 else e.reshape(-1)),),
                               () if e.numel() == 1 else (e.numel(),)))
            return len(ops) - 1
        if not isinstance(e, Expr):
            return e
        if id(e) in index:
            return index[id(e)]
        if e.op in ("const", "table"):
            args = (const(e.args[0].reshape(-1, e.args[0].shape[-1]) if e.op == "table" else e.args[0]),)
        elif e.op == "matmul":
            args = (emit(e.args[0]), const(e.args[1]))
        else:
            args = tuple(emit(a) for a in e.args)
        ops.append(TokenOp(e.op, args, () if e.n is None else (e.n,)))
        index[id(e)] = len(ops) - 1
        return index[id(e)]

    out = emit(root)
    return TokenProgram(ops, consts, out)


def lower(graph: Graph, params: dict[str, torch.Tensor] | None = None) -> list[LoweredOp]:
    """Lower one hook point's graph to its site's ops, in program order (reads at their version)."""
    lowerer = Lowerer(graph, params)
    reads_at: dict[Node, list] = {}  # version -> reads (to the host) and store puts of that version
    for key, n in graph.reads.items():
        reads_at.setdefault(_version_of(n, graph), []).append(((graph.phase, graph.hook_name, key), n, None))
    for spec, n in graph.stores.items():
        reads_at.setdefault(_version_of(n, graph), []).append((("store", spec.name), n, spec))
    writes: list[LoweredOp] = []
    for n in graph.nodes:
        lowerer.visit(n, writes)
    # reads of a version run before the write that replaces it: order ops by version
    ordered: list[LoweredOp] = []
    pending = iter(writes)
    for n in graph.nodes:
        if n.op == "write":
            ordered.append(next(pending))
        for key, value, spec in reads_at.get(n, []):
            ordered.append(lowerer.read_op(key, value, spec))
    return ordered


def _version_of(n: Node, graph: Graph) -> Node:
    """The version node (act or a write) whose value a read of `n` needs; a value computed from
    stores alone (no act) is read against act, the first version."""
    while n.op not in ("act", "write"):
        n = next((a for a in n.args if isinstance(a, Node) and a.token_dims and a.op != "store"), None)
        if n is None:
            return next(v for v in graph.nodes if v.op == "act")
    return n
