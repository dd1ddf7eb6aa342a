"""The hook IR: a small typed graph of what a hook function does to its activation.

A `Graph` holds the nodes of the hooks traced at one hook point for one pass, in program order.
Every value has TransformerLens's padded layout: `token_dims` leading dims are tokens
([batch, pos] = 2, or [batch] = 1 after one position was selected), then the feature dims.
Each write makes a new version of the activation; reads name the node whose value they want.
The graph prints like torch.fx and evaluates in plain torch (`evaluate`), which is the oracle the
lowered programs are tested against.

Ops (n: a node, c: a constant tensor):
  act()                          the activation arriving at the hook point (version 0)
  const(c)                       a constant: a direction, a cached activation, a probe
  select(n, pos, heads)          n[:, pos] and/or n[..., heads, :]; pos / heads: None (all), an int
                                 (the dim is dropped) or a tuple of ints (kept)
  write(version, n, pos, heads)  version with n written at those positions and heads
  reshape(n, shape) / permute(n, dims)   of the feature dims only
  param(name)                    an installed app's parameter, by name (its value comes with lowering)
  linear(n, fn, *c)              a linear map of the feature dims by constants (matmul, einsum, sum
                                 over features): fn(basis, *values of c) applied to an identity basis
  <elementwise>(n, ...)          the op table's elementwise ops (xmix_lens/ops.py): add sub mul div
                                 neg abs pow relu gelu sigmoid tanh exp log gt ge lt le eq ne
                                 logical_and logical_or logical_not where clamp
  <reduction>(n)                 max min norm over the last feature dim (sum/mean are `linear`)
  softmax(n) / topk_mask(n, k)   over the last feature dim
  store(spec)                    a value another hook point put into a store (see store.py)
"""
from dataclasses import dataclass, field

import torch

from .ops import OPS

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
    phase: str = "prefill"  # "decode": the hooks as they run on each generated token
    nodes: list[Node] = field(default_factory=list)
    reads: dict[int, Node] = field(default_factory=dict)  # read key -> node whose value is read
    stores: dict = field(default_factory=dict)  # StoreSpec -> node whose value it takes (store.put)
    params: dict = field(default_factory=dict)  # app parameter name -> its param node
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
        lines += [f"    store[{spec.name!r}, reduce={spec.reduce}] = {n}" for spec, n in self.stores.items()]
        lines.append(f"    return {self.output}")
        return "\n".join(lines)


def _fmt(arg) -> str:
    if isinstance(arg, torch.Tensor):
        return f"tensor{list(arg.shape)}"
    if callable(arg):
        return getattr(arg, "label", "fn")
    return repr(arg)


def index_key(token_dims: int, pos, heads) -> tuple:
    """The torch index for select/write: [:, pos] over tokens, then heads on the first feature dim."""
    key = [slice(None)]
    if token_dims == 2:
        key.append(slice(None) if pos is None else (list(pos) if isinstance(pos, tuple) else pos))
    if heads is not None:
        key.append(list(heads) if isinstance(heads, tuple) else heads)
    return tuple(key)


def evaluate(graph: Graph, act: torch.Tensor, stores: dict | None = None,
             params: dict | None = None) -> dict[Node, torch.Tensor]:
    """Run the graph eagerly in torch on a padded activation; returns every node's value.

    `stores` maps each StoreSpec the graph reads to its value [batch, pos, ...]; `params` each app
    parameter name to its tensor."""
    env: dict[Node, torch.Tensor] = {}
    for n in graph.nodes:
        a = [env[x] if isinstance(x, Node) else x for x in n.args]
        if n.op == "act":
            env[n] = act
        elif n.op == "store":
            env[n] = stores[a[0]]
        elif n.op == "param":
            env[n] = params[a[0]]
        else:
            env[n] = evaluate_node(n, a)
    return env


def evaluate_node(n: Node, a: list):
    """One node's value from its arguments' values (every op but act, store and param)."""
    if n.op == "const":
        return a[0]
    if n.op in OPS and OPS[n.op].torch is not None:  # elementwise ops, reductions, softmax, topk_mask
        return OPS[n.op].torch(*a)
    if n.op == "linear":
        return a[1](a[0], *a[2:])
    if n.op == "reshape":
        return a[0].reshape(a[0].shape[: n.token_dims] + tuple(a[1]))
    if n.op == "permute":
        return a[0].permute(*range(n.token_dims), *(n.token_dims + d for d in a[1]))
    if n.op == "select":
        x, pos, heads = a
        if pos is not None:
            x = x[:, list(pos) if isinstance(pos, tuple) else pos]
        if heads is not None:
            x = x[(slice(None),) * n.token_dims + (list(heads) if isinstance(heads, tuple) else heads,)]
        return x
    if n.op == "write":
        out = a[0].clone()
        out[index_key(2, a[2], a[3])] = a[1]
        return out
    raise ValueError(f"unknown op {n.op}")
