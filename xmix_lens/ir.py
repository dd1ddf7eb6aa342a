"""The hook IR: a small typed graph of what a hook function does to its activation.

A `Graph` holds the nodes of the hooks traced at one hook point for one pass, in program order.
Every value has TransformerLens's padded layout: `token_dims` leading dims are tokens
([batch, pos] = 2, or [batch] = 1 after a position was selected), then the feature dims.
`act` versions: each write makes a new version of the activation; reads name the node whose
value they want. The graph prints like torch.fx and evaluates in plain torch (`evaluate`),
which is the oracle the lowered programs are tested against.

Ops:
  act()                         the activation arriving at the hook point (version 0)
  const(tensor)                 a constant: a direction, a cached activation, a probe
  add/sub/mul(a, b), neg(a)     elementwise, with torch broadcasting
  matmul(a, const)              contraction of the last feature dim with a constant
  sum(a)                        sum over the last feature dim
  unsqueeze(a)                  a new trailing feature dim of size 1
  select_pos(a, k)              a[:, k]: one padded position (token_dims 2 -> 1)
  write(version, value, k)      version with value written at position k (k None: everywhere)
"""
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Node:
    op: str
    args: tuple
    shape: tuple[int, ...]
    token_dims: int  # leading token dims: 2 [batch, pos], 1 [batch], 0 constant
    where: str = ""  # source line that made it, for error messages
    name: str = ""

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return self.shape[self.token_dims:]

    def __repr__(self) -> str:
        return f"%{self.name}"


@dataclass
class Graph:
    hook_name: str
    act_shape: tuple[int, ...]
    nodes: list[Node] = field(default_factory=list)
    reads: dict[int, Node] = field(default_factory=dict)  # read key -> node whose value is read
    output: Node | None = None  # the final version of act after all hooks

    def add(self, op: str, args: tuple, shape, token_dims: int, where: str = "") -> Node:
        node = Node(op, args, tuple(shape), token_dims, where, name=f"{op}_{len(self.nodes)}")
        self.nodes.append(node)
        return node

    def __str__(self) -> str:
        lines = [f"graph({self.hook_name}: act{list(self.act_shape)}):"]
        for n in self.nodes:
            args = ", ".join(_fmt(a) for a in n.args)
            lines.append(f"    {n.name}{list(n.shape)} = {n.op}({args})")
        lines += [f"    read[{k}] = {n}" for k, n in self.reads.items()]
        lines.append(f"    return {self.output}")
        return "\n".join(lines)


def _fmt(arg) -> str:
    if isinstance(arg, torch.Tensor):
        return f"tensor{list(arg.shape)}"
    return repr(arg)


def evaluate(graph: Graph, act: torch.Tensor) -> dict[Node, torch.Tensor]:
    """Run the graph eagerly in torch on a padded activation; returns every node's value."""
    env: dict[Node, torch.Tensor] = {}

    def val(a):
        return env[a] if isinstance(a, Node) else a

    for n in graph.nodes:
        a = [val(x) for x in n.args]
        if n.op == "act":
            env[n] = act
        elif n.op == "const":
            env[n] = a[0]
        elif n.op in ("add", "sub", "mul"):
            env[n] = getattr(torch, n.op)(a[0], a[1])
        elif n.op == "neg":
            env[n] = -a[0]
        elif n.op == "matmul":
            env[n] = a[0] @ a[1]
        elif n.op == "sum":
            env[n] = a[0].sum(-1)
        elif n.op == "unsqueeze":
            env[n] = a[0].unsqueeze(-1)
        elif n.op == "select_pos":
            env[n] = a[0][:, a[1]]
        elif n.op == "write":
            out = a[0].clone()
            if a[2] is None:
                out[...] = a[1]
            else:
                out[:, a[2]] = a[1]
            env[n] = out
        else:
            raise ValueError(f"unknown op {n.op}")
    return env
