"""Lowering: a hook point's Graph -> the ops its site runs (xmix_lens.lowered).

Every value in the IR is tracked as an affine function of one version of the activation:

    value[t] = x[t] * scale + (x[t] @ U) @ V + bias[t]        (x = act at that version, per token)

with `scale` [F] or None, U [F, K], V [K, O] and bias [O] or per token [B, P, O]. Adding,
subtracting, scaling by constants, contracting with constant vectors or matrices, summing features
and selecting a position all keep that form, so each write lowers to the parametric affine_write
template and each read to gather_rows / project_read — no code generated, only buffers filled.
What leaves the form (a product of two traced values, say) is reported with its line.
"""
from dataclasses import dataclass

import torch

from .ir import Graph, Node
from .lowered import AffineWrite, LoweredOp, Read
from .trace import TraceError


@dataclass
class Affine:
    version: Node
    scale: torch.Tensor | None  # [F]
    U: torch.Tensor  # [F, K]
    V: torch.Tensor  # [K, O]
    bias: torch.Tensor  # [O] or [B, P, O]
    feature_shape: tuple[int, ...]
    position: int | None  # the selected padded position, None when every position is present

    @property
    def is_identity(self) -> bool:
        return (self.scale is not None and bool((self.scale == 1).all()) and self.U.shape[1] == 0
                and self.bias.dim() == 1 and not bool(self.bias.any()))


def _fail(node: Node, graph: Graph, what: str) -> TraceError:
    return TraceError(f"hook point {graph.hook_name!r} at {node.where}\n  {what}")


class Lowerer:
    def __init__(self, graph: Graph):
        self.graph = graph
        B, P, *features = graph.act_shape
        self.B, self.P = B, P
        self.F = int(torch.tensor(features).prod()) if features else 1
        self.forms: dict[Node, Affine | torch.Tensor] = {}

    # --- constants as per-feature or per-token tensors -----------------------------------------
    def const_bias(self, c: torch.Tensor, like: Affine, node: Node) -> torch.Tensor:
        """A constant added to `like`: flattened to [O], or [B, P, O] where it varies per token."""
        O = int(torch.tensor(like.feature_shape).prod()) if like.feature_shape else 1
        token_dims = 2 if like.position is None else 1
        full = (self.B, self.P)[:token_dims] + like.feature_shape
        c = c.expand(torch.broadcast_shapes(c.shape, full)) if c.dim() else c.expand(full)
        per_token = c.reshape(-1, O)
        if bool((per_token == per_token[:1]).all()):
            return per_token[0].clone()
        if token_dims == 1:  # [B, O] for one selected position: place it at that position
            table = torch.zeros(self.B, self.P, O)
            table[:, like.position] = c.reshape(self.B, O)
            return table
        return c.reshape(self.B, self.P, O).clone()

    def const_factor(self, c: torch.Tensor, like: Affine, node: Node) -> torch.Tensor:
        if c.dim() > len(like.feature_shape) and bool((c.reshape(-1) != c.reshape(-1)[0]).any()):
            leading = c.shape[: c.dim() - len(like.feature_shape)]
            if any(s != 1 for s in leading):
                raise _fail(node, self.graph, "a factor that differs per token (batch or position) is not supported; "
                                              "use a per-feature vector or a number")
        return c.reshape(c.shape[c.dim() - len(like.feature_shape):] if like.feature_shape else ())

    # --- algebra on affine forms ---------------------------------------------------------------
    @staticmethod
    def add(a: Affine, b: Affine, sign: float) -> Affine:
        scale = a.scale if b.scale is None else (b.scale * sign if a.scale is None else a.scale + sign * b.scale)
        bias = a.bias + sign * b.bias
        return Affine(a.version, scale, torch.cat([a.U, b.U], 1), torch.cat([a.V, sign * b.V], 0), bias,
                      torch.broadcast_shapes(a.feature_shape, b.feature_shape), a.position)

    def scale_by(self, a: Affine, c: torch.Tensor) -> Affine:
        O = torch.broadcast_shapes(a.feature_shape, c.shape)
        n = int(torch.tensor(O).prod()) if O else 1
        flat = c.expand(O).reshape(n) if O else c.reshape(1)
        V = a.V.expand(a.V.shape[0], n) if a.V.shape[1] == 1 and n > 1 else a.V
        bias = a.bias.expand(*a.bias.shape[:-1], n) if a.bias.shape[-1] == 1 else a.bias
        scale = None
        if a.scale is not None:
            if a.scale.shape[0] != n:
                raise ValueError("feature-size mismatch")
            scale = a.scale * flat
        return Affine(a.version, scale, a.U, V * flat, bias * flat, tuple(O), a.position)

    def widen(self, a: Affine, n: Node) -> Affine:
        """Broadcast a's features up to node n's feature shape (a scalar score times a direction, say)."""
        return a if a.feature_shape == n.feature_shape else self.scale_by(a, torch.ones(n.feature_shape))

    @staticmethod
    def with_bias(a: Affine, bias: torch.Tensor) -> Affine:
        return Affine(a.version, a.scale, a.U, a.V, bias, a.feature_shape, a.position)

    def affine_of(self, n: Node) -> Affine:
        f = self.forms[n]
        if not isinstance(f, Affine):
            raise _fail(n, self.graph, "expected a value computed from act")
        return f

    def visit(self, n: Node, writes: list[LoweredOp]) -> None:
        g, F = self.graph, self.F
        args = [self.forms.get(a, a) if isinstance(a, Node) else a for a in n.args]
        if n.op == "act":
            self.forms[n] = Affine(n, torch.ones(F), torch.zeros(F, 0), torch.zeros(0, F), torch.zeros(F),
                                   n.feature_shape, None)
        elif n.op == "const":
            self.forms[n] = args[0]
        elif n.op in ("add", "sub"):
            a, b = (self.widen(x, n) if isinstance(x, Affine) else x for x in args)
            sign = 1.0 if n.op == "add" else -1.0
            if isinstance(a, Affine) and isinstance(b, Affine):
                if a.version is not b.version or a.position != b.position:
                    raise _fail(n, g, "combines act from different positions or from before and after a write")
                self.forms[n] = self.add(a, b, sign)
            elif isinstance(a, Affine):
                self.forms[n] = self.with_bias(a, a.bias + sign * self.const_bias(b, a, n))
            else:
                negated = self.scale_by(b, torch.tensor(sign))
                self.forms[n] = self.with_bias(negated, negated.bias + self.const_bias(a, negated, n))
        elif n.op == "mul":
            a, b = args
            if isinstance(a, Affine) and isinstance(b, Affine):
                raise _fail(n, g, "a product of two values computed from act is not affine; it needs a generated kernel, "
                                  "which this engine does not build yet")
            aff, c = (a, b) if isinstance(a, Affine) else (b, a)
            self.forms[n] = self.scale_by(aff, self.const_factor(c, aff, n))
        elif n.op == "neg":
            self.forms[n] = self.scale_by(args[0], torch.tensor(-1.0))
        elif n.op in ("matmul", "sum"):
            a = args[0]
            M = args[1] if n.op == "matmul" else torch.ones(a.feature_shape[-1])
            out_shape = tuple(n.feature_shape)
            M2 = M if M.dim() == 2 else M[:, None]
            if len(a.feature_shape) != 1:
                raise _fail(n, g, "contractions are supported on a value with one feature dim")
            O2 = M2.shape[1]
            U = a.U
            V = a.V @ M2
            if a.scale is not None:
                U = torch.cat([U, a.scale[:, None] * M2], 1)
                V = torch.cat([V, torch.eye(O2)], 0)
            bias = a.bias @ M2
            self.forms[n] = Affine(a.version, None, U, V, bias, out_shape, a.position)
        elif n.op == "unsqueeze":
            a = args[0]
            self.forms[n] = Affine(a.version, a.scale, a.U, a.V, a.bias, a.feature_shape + (1,), a.position)
        elif n.op == "select_pos":
            a, pos = args
            if a.position is not None:
                raise _fail(n, g, "selecting a position twice")
            self.forms[n] = Affine(a.version, a.scale, a.U, a.V, a.bias, a.feature_shape, pos)
        elif n.op == "write":
            version, value, pos = n.args
            self.forms[n] = self.lower_write(n, version, value, pos, writes)
        else:
            raise _fail(n, g, f"op {n.op} cannot be lowered")

    def lower_write(self, n: Node, version: Node, value: Node, pos: int | None, ops: list[LoweredOp]) -> Affine:
        F = self.F
        form = self.forms[value]
        if isinstance(form, torch.Tensor):  # a constant written: x <- 0 * x + c
            zero = Affine(version, torch.zeros(F), torch.zeros(F, 0), torch.zeros(0, F), torch.zeros(F),
                          self.graph.act_shape[2:], pos)
            form = Affine(version, zero.scale, zero.U, zero.V, self.const_bias(form, zero, n), zero.feature_shape, pos)
        elif form.version is not version:
            raise _fail(n, self.graph, "the written value is computed from act before an earlier write")
        elif form.position != pos:
            raise _fail(n, self.graph, f"writes position {pos} from a value at position {form.position}: "
                                       "ops across positions are not supported inside one hook")
        scale = torch.zeros(F) if form.scale is None else form.scale
        bias = form.bias.expand(F) if form.bias.dim() == 1 else form.bias.expand(self.B, self.P, F)
        V = form.V.expand(form.V.shape[0], F) if form.V.shape[1] == 1 else form.V
        positions = None
        if pos is not None:
            positions = torch.zeros(self.P, dtype=torch.bool)
            positions[pos] = True
        ops.append(AffineWrite(positions, scale.contiguous(), bias.contiguous(), form.U.contiguous(), V.contiguous()))
        return Affine(n, torch.ones(F), torch.zeros(F, 0), torch.zeros(0, F), torch.zeros(F), self.graph.act_shape[2:],
                      None)

    def read_op(self, key: tuple[str, int], n: Node) -> Read:
        form = self.affine_of(n)
        positions = None
        if form.position is not None:
            positions = torch.zeros(self.P, dtype=torch.bool)
            positions[form.position] = True
        keeps_pos = form.position is None
        if form.is_identity:
            return Read(key, positions, keeps_pos, None, None, form.feature_shape)
        W = form.U @ form.V
        if form.scale is not None:
            W = W + torch.diag(form.scale)
        return Read(key, positions, keeps_pos, W.contiguous(), form.bias, form.feature_shape)


def lower(graph: Graph) -> list[LoweredOp]:
    """Lower one hook point's graph to its site's ops, in program order (reads at their version)."""
    lowerer = Lowerer(graph)
    reads_at: dict[Node, list[int]] = {}
    for key, n in graph.reads.items():
        reads_at.setdefault(lowerer_version_anchor(graph, n), []).append(key)
    ops: list[LoweredOp] = []
    for n in graph.nodes:
        lowerer.visit(n, ops)
    # reads of a version run before the write that replaces it: order ops by version
    ordered: list[LoweredOp] = []
    writes = iter(ops)
    for n in graph.nodes:
        if n.op == "write":
            ordered.append(next(writes))
        for key in reads_at.get(n, []):
            ordered.append(lowerer.read_op((graph.hook_name, key), graph.reads[key]))
    return ordered


def lowerer_version_anchor(graph: Graph, n: Node) -> Node:
    """The version node (act or a write) whose value a read of `n` needs."""
    while n.op not in ("act", "write"):
        n = next(a for a in n.args if isinstance(a, Node) and a.token_dims)
    return n
