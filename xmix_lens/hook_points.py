"""Hook points: TransformerLens's names, feature shapes and bookkeeping, for a served model.

As in TransformerLens, a `HookPoint` is one named place in the forward pass holding the functions
added to it (`fwd_hooks`), and `hook_dict` maps every name to its HookPoint. Unlike TransformerLens
the functions are not called by the forward pass itself: they are traced when a pass starts and run
in the engine as lowered programs (see trace.py, lower.py).

The names of a model, in the order TransformerLens fires them, and the per-token feature shape of
each hook point's act are defined here, for every backend, from the model's family (families.py):
a backend places each name somewhere in its engine (backend/vllm/sites.py) and numbers sites by
their index in `hook_names`.
"""
import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .families import FAMILIES, Family

# TransformerLens 4.x bridge names -> the 3.x name they alias (same HookPoint)
_ALIASES = {
    r"blocks\.(\d+)\.hook_in": r"blocks.\1.hook_resid_pre",
    r"blocks\.(\d+)\.hook_out": r"blocks.\1.hook_resid_post",
    r"blocks\.(\d+)\.attn\.hook_out": r"blocks.\1.hook_attn_out",
    r"blocks\.(\d+)\.mlp\.hook_out": r"blocks.\1.hook_mlp_out",
    r"embed\.hook_out": "hook_embed",
    r"pos_embed\.hook_out": "hook_pos_embed",
    r"ln_final\.hook_out": "ln_final.hook_normalized",
    r"blocks\.(\d+)\.attn\.([qkv])\.hook_out": r"blocks.\1.attn.hook_\2",
    r"blocks\.(\d+)\.attn\.o\.hook_in": r"blocks.\1.attn.hook_z",
    r"blocks\.(\d+)\.mlp\.out\.hook_in": r"blocks.\1.mlp.hook_post",
    r"blocks\.(\d+)\.attn\.hook_(attn_in|[qkv]_input)": r"blocks.\1.hook_\2",
}


def _lacking(has: Callable[[Family], bool]) -> str:
    """The families without a feature, as messages write them."""
    return " / ".join(family.title for family in FAMILIES.values() if not has(family))


# Hook points TransformerLens has for some families only, with the reason a model of another lacks them.
_UNSUPPORTED = {
    r"blocks\.\d+\.attn\.hook_rot_[qk]":
        f"{_lacking(lambda f: f.rotary)} has no rotary embedding (TransformerLens has no hook_rot_q/k for it "
        f"either); use attn.hook_q / hook_k",
    r"blocks\.\d+\.attn\.hook_[qk]_normed":
        f"{_lacking(lambda f: f.qk_norm)} has no norm on the query and key (TransformerLens has no "
        f"hook_q_normed/k_normed for it either); use attn.hook_q / hook_k",
    r"blocks\.\d+\.ln[12]\.hook_(scale|normalized)":
        f"{_lacking(lambda f: f.pre_norms)} has no norm before attention and the MLP, only after them (TransformerLens "
        f"has no ln1 / ln2 for it either, only ln1_post / ln2_post); attention reads hook_resid_pre and the MLP "
        f"hook_resid_mid as they are",
    r"blocks\.\d+\.(hook_resid_mid|hook_mlp_in)":
        f"{_lacking(lambda f: not f.parallel)}'s attention and MLP read the same residual, in parallel "
        f"(TransformerLens has no hook_resid_mid for it either); use hook_resid_pre",
    r"blocks\.\d+\.mlp\.(gate\.hook_out|hook_expert_weights|hook_expert_indices)":
        f"{_lacking(lambda f: f.moe)}'s MLP is not a mixture of experts; use ln2.hook_normalized and mlp.hook_pre",
    r"blocks\.\d+\.mlp\.hook_pre_linear":
        f"{_lacking(lambda f: f.gated_mlp and not f.moe)}'s MLP is not gated, or is a mixture of experts "
        f"(TransformerLens has no hook_pre_linear for it either); use mlp.hook_pre, or a mixture's mlp.hook_in",
    r"blocks\.\d+\.mlp\.hook_(pre|post)":
        f"{_lacking(lambda f: not f.moe)}'s MLP is a mixture of experts, with no single hidden layer; use "
        f"mlp.hook_in, mlp.gate.hook_out (the router's logits) and hook_mlp_out",
}

def canonical_name(name: str, own=()) -> str:
    """The 3.x name a TransformerLens 4.x spelling aliases; a name of the model's own (`own`: Gemma 2's
    attn.hook_out is the attention's output before its norm, not hook_attn_out) is itself."""
    if name in own:
        return name
    for alias, target in _ALIASES.items():
        if re.fullmatch(alias, name):
            return re.sub(alias, target, name)
    return name


_DIRECTIONS = ("fwd", "bwd")


def _directions(dir: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """The hook lists `dir` names: "fwd", "bwd", or (where `allowed` has it) "both"."""
    if dir not in allowed:
        raise ValueError(f"invalid direction {dir!r}; use one of {list(allowed)}")
    return _DIRECTIONS if dir == "both" else (dir,)


@dataclass(eq=False)
class LensHandle:
    """A hook function added to a hook point (TransformerLens's LensHandle). `hook` is the
    function itself (TransformerLens keeps a torch RemovableHandle there and the function in
    `user_hook`: nothing here registers torch module hooks)."""

    hook: Callable
    is_permanent: bool = False
    context_level: int | None = None  # the `hooks()` block that added it; None outside one

    @property
    def user_hook(self) -> Callable:
        return self.hook

    def matches(self, including_permanent: bool, level: int | None) -> bool:
        """In scope of a has_hooks / remove_hooks call (TransformerLens's rule)."""
        if self.is_permanent and not including_permanent:
            return False
        return level is None or self.context_level == level


@dataclass(eq=False)
class HookPoint:
    """One named place in the forward pass and the functions added to it. Built without a name
    (TransformerLens's HookPoint()), it is named when put in a model's hook_dict. Forward hooks are
    traced into the engine; backward hooks are only kept here (`bwd_hooks`), for whatever runs a
    backward pass."""

    name: str | None = None
    fwd_hooks: list[LensHandle] = field(default_factory=list)
    bwd_hooks: list[LensHandle] = field(default_factory=list)
    ctx: dict = field(default_factory=dict)

    def add_hook(self, hook: Callable, dir: str = "fwd", is_permanent: bool = False, level: int | None = None,
                 prepend: bool = False) -> LensHandle:
        """Add `hook(act, hook=self)`, last (or first with prepend); returns its handle."""
        (direction,) = _directions(dir, _DIRECTIONS)
        handle = LensHandle(hook, is_permanent, level)
        hooks = self.fwd_hooks if direction == "fwd" else self.bwd_hooks
        hooks.insert(0, handle) if prepend else hooks.append(handle)
        return handle

    def add_perma_hook(self, hook: Callable, dir: str = "fwd") -> LensHandle:
        return self.add_hook(hook, dir=dir, is_permanent=True)

    def has_hooks(self, dir: str = "both", including_permanent: bool = True, level: int | None = None) -> bool:
        return any(h.matches(including_permanent, level)
                   for d in _directions(dir, (*_DIRECTIONS, "both")) for h in self.hooks_of(d))

    def remove_hooks(self, dir: str = "fwd", including_permanent: bool = False, level: int | None = None) -> None:
        for d in _directions(dir, (*_DIRECTIONS, "both")):
            kept = [h for h in self.hooks_of(d) if not h.matches(including_permanent, level)]
            setattr(self, f"{d}_hooks", kept)

    def __call__(self, x):
        """Run the forward hooks eagerly on a tensor, as TransformerLens's HookPoint module does (a served
        model never calls this: it traces the hooks into its engine)."""
        for handle in list(self.fwd_hooks):
            out = handle.hook(x, hook=self)
            x = x if out is None else out
        return x

    def hooks_of(self, dir: str) -> list[LensHandle]:
        return self.fwd_hooks if dir == "fwd" else self.bwd_hooks

    def clear_context(self) -> None:
        self.ctx = {}

    def layer(self) -> int:
        if self.name is None:
            raise ValueError("this HookPoint has no name yet: it is named when put in a model's hook_dict")
        match = re.match(r"blocks\.(\d+)\.", self.name)
        if match is None:
            raise ValueError(f"{self.name} is not inside a block")
        return int(match.group(1))

    def __repr__(self) -> str:
        return f"HookPoint({self.name!r}, {len(self.fwd_hooks)} fwd, {len(self.bwd_hooks)} bwd hooks)"


# One block's hook points in firing order (HookedTransformer's order). The engine places every one
# of them (a site), except the COMPUTED ones, which the API layer computes after a pass from the
# engine's reads of it (xmix_lens/computed_points.py): vLLM's forward never materialises them.
COMPUTED_POINTS = ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input", "attn.hook_q_normed",
                   "attn.hook_k_normed", "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_result",
                   "hook_mlp_in", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "unembed.hook_out")
# Computed points TransformerLens fires only while a config switch is on (model.set_use_attn_result(True) ...)
SWITCHED = {"hook_attn_in": "use_attn_in", "hook_q_input": "use_split_qkv_input",
            "hook_k_input": "use_split_qkv_input", "hook_v_input": "use_split_qkv_input",
            "attn.hook_result": "use_attn_result", "hook_mlp_in": "use_hook_mlp_in"}


def _when(on: bool, *points: str) -> tuple[str, ...]:
    return points if on else ()


def _block_points(family: Family, computed: bool) -> tuple[str, ...]:
    return ("hook_resid_pre", *_when(computed, "hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input"),
            *_when(family.pre_norms, "ln1.hook_scale", "ln1.hook_normalized"),
            "attn.hook_q", "attn.hook_k", "attn.hook_v",
            *_when(computed and family.qk_norm, "attn.hook_q_normed", "attn.hook_k_normed"),
            *_when(family.rotary, "attn.hook_rot_q", "attn.hook_rot_k"),
            *_when(computed, "attn.hook_attn_scores", "attn.hook_pattern"), "attn.hook_z",
            *_when(computed, "attn.hook_result"),
            *_when(family.post_norms, "attn.hook_out", "ln1_post.hook_scale", "ln1_post.hook_normalized"),
            "hook_attn_out", *_when(not family.parallel, "hook_resid_mid"),
            *_when(computed and not family.parallel, "hook_mlp_in"),
            *_when(family.pre_norms, "ln2.hook_scale", "ln2.hook_normalized"),
            *(_moe_points(computed) if family.moe else _mlp_points(family)),
            *_when(family.post_norms, "mlp.hook_out", "ln2_post.hook_scale", "ln2_post.hook_normalized"),
            "hook_mlp_out", "hook_resid_post")


def _mlp_points(family: Family) -> tuple[str, ...]:
    return ("mlp.hook_pre", *_when(family.gated_mlp, "mlp.hook_pre_linear"), "mlp.hook_post")


def _moe_points(computed: bool) -> tuple[str, ...]:
    """A mixture of experts' points (TransformerLens's names): its input, the router's logits, what the
    router chose (computed from them)."""
    return ("mlp.hook_in", "mlp.gate.hook_out", *_when(computed, "mlp.hook_expert_weights", "mlp.hook_expert_indices"))


def _names(family: str, n_layers: int, computed: bool) -> list[str]:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; supported: {list(FAMILIES)}")
    record = FAMILIES[family]
    blocks = [f"blocks.{L}.{point}" for L in range(n_layers) for point in _block_points(record, computed)]
    # before the blocks: the token embedding, and a learned position embedding's
    return ["hook_embed", *_when(record.positions == "learned", "hook_pos_embed"), *blocks, "ln_final.hook_scale",
            "ln_final.hook_normalized", "unembed.hook_in", *_when(computed, "unembed.hook_out")]


def hook_names(family: str, n_layers: int) -> list[str]:
    """The hook points the engine places, in firing order (a backend's site id is the index here)."""
    return _names(family, n_layers, computed=False)


def point_names(family: str, n_layers: int) -> list[str]:
    """Every hook point of a model, the computed ones included, in firing order."""
    return _names(family, n_layers, computed=True)


def _point(name: str) -> str:
    """The block-relative part of a name: "attn.hook_z" for "blocks.3.attn.hook_z"."""
    return re.sub(r"^blocks\.\d+\.", "", name)


def is_computed(name: str) -> bool:
    return _point(name) in COMPUTED_POINTS


def switch_of(name: str) -> str | None:
    """The config switch without which TransformerLens never fires this hook point (None: always fires)."""
    return SWITCHED.get(_point(name))


def model_dims(cfg) -> dict[str, int]:
    """d_model, n_heads, n_kv_heads, d_head, d_mlp from an HF config (Llama or GPT-2; GPT2Config maps
    hidden_size / num_attention_heads to n_embd / n_head) or a TransformerLens-style config."""
    def first(*names):
        return next((v for n in names if (v := getattr(cfg, n, None)) is not None), None)

    d_model = first("hidden_size", "n_embd", "d_model")
    n_heads = first("num_attention_heads", "n_head", "n_heads")
    return {"d_model": d_model, "n_heads": n_heads,
            "n_kv_heads": first("num_key_value_heads", "n_key_value_heads") or n_heads,
            "d_head": first("head_dim", "d_head") or d_model // n_heads,
            "d_mlp": first("intermediate_size", "n_inner", "d_mlp") or 4 * d_model,
            "n_experts": first("num_experts", "num_local_experts")}


def feature_shape(name: str, config) -> tuple[int, ...]:
    """The per-token feature shape of a hook point's act, as in TransformerLens: act is
    [batch, pos, *feature_shape]. `config`: an HF config or a TransformerLens-style one."""
    d = model_dims(config)
    point = _point(name)
    if point in ("attn.hook_q", "attn.hook_rot_q", "attn.hook_z"):
        return (d["n_heads"], d["d_head"])
    if point in ("attn.hook_k", "attn.hook_rot_k", "attn.hook_v"):
        return (d["n_kv_heads"], d["d_head"])
    if point in ("mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post"):
        return (d["d_mlp"],)
    if point.endswith("hook_scale"):
        return (1,)
    if point == "mlp.gate.hook_out":  # the router's logits
        return (d["n_experts"],)
    # computed points, [batch, pos, heads, d_model]: per head, HookedTransformer's layout (k and v per key-value head)
    if point in ("hook_attn_in", "hook_q_input", "attn.hook_result"):
        return (d["n_heads"], d["d_model"])
    if point in ("hook_k_input", "hook_v_input"):
        return (d["n_kv_heads"], d["d_model"])
    return (d["d_model"],)


def make_hook_dict(family: str, n_layers: int) -> dict[str, HookPoint]:
    return {name: HookPoint(name) for name in point_names(family, n_layers)}


def resolve(hook_dict: dict[str, HookPoint], name_or_filter: str | Callable[[str], bool], cfg=None) -> list[str]:
    """Names a hook spec refers to: one (aliases accepted) or every name a filter accepts. With
    `cfg`, hook points whose switch (switch_of) is off there are left out of a filter's names and
    refused by name, as TransformerLens refuses a hook on them."""
    def off(n):
        return cfg is not None and (switch := switch_of(n)) is not None and not getattr(cfg, switch, False)

    if callable(name_or_filter):
        return [n for n in hook_dict if name_or_filter(n) and not off(n)]
    name = canonical_name(name_or_filter, hook_dict)
    if name in hook_dict and off(name):
        raise ValueError(f"{name} fires only with cfg.{switch_of(name)} on, as in TransformerLens: call "
                         f"model.set_{switch_of(name)}(True) first")
    if name in hook_dict:
        return [name]
    for pattern, why in _UNSUPPORTED.items():
        if re.fullmatch(pattern, name):
            raise ValueError(f"hook point {name_or_filter!r} is not available in the served model: {why}")
    layer = re.match(r"blocks\.(\d+)\.", name)
    n_layers = len({n.split(".")[1] for n in hook_dict if n.startswith("blocks.")})
    if layer is not None and int(layer.group(1)) >= n_layers:
        raise ValueError(f"unknown hook point {name_or_filter!r}: layer {layer.group(1)} is out of range: this model "
                         f"has {n_layers} layers, blocks.0 … blocks.{n_layers - 1}; use a layer below {n_layers}")
    near = difflib.get_close_matches(name, list(hook_dict), n=5, cutoff=0.6)
    raise ValueError(f"unknown hook point {name_or_filter!r}; nearest valid names: {near or sorted(hook_dict)[:5]}")
