"""Hook points: TransformerLens's names, feature shapes and bookkeeping, for a served model.

As in TransformerLens, a `HookPoint` is one named place in the forward pass holding the functions
added to it (`fwd_hooks`), and `hook_dict` maps every name to its HookPoint. Unlike TransformerLens
the functions are not called by the forward pass itself: they are traced when a pass starts and run
in the engine as lowered programs (see trace.py, lower.py).

The names of a model, in the order TransformerLens fires them, and the per-token feature shape of
each hook point's act are defined here, for every backend: a backend places each name somewhere in
its engine (backend/vllm/sites.py) and numbers sites by their index in `hook_names`.
"""
import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass, field

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
}

# Hook points TransformerLens has that the served path does not offer yet, with the reason.
_UNSUPPORTED = {
    r"blocks\.\d+\.attn\.hook_(pattern|attn_scores)":
        "vLLM's fused attention kernels never materialise the attention pattern or scores",
}


def canonical_name(name: str) -> str:
    for alias, target in _ALIASES.items():
        if re.fullmatch(alias, name):
            return re.sub(alias, target, name)
    return name


@dataclass(eq=False)
class LensHandle:
    """A hook function added to a hook point (TransformerLens's LensHandle)."""

    hook: Callable
    is_permanent: bool = False


@dataclass(eq=False)
class HookPoint:
    name: str
    fwd_hooks: list[LensHandle] = field(default_factory=list)
    ctx: dict = field(default_factory=dict)

    def add_hook(self, hook: Callable, dir: str = "fwd", is_permanent: bool = False, prepend: bool = False) -> None:
        if dir != "fwd":
            raise ValueError(f"{dir!r} hooks are not supported: a serving engine runs no backward pass; "
                             "use dir='fwd' (or run TransformerLens itself for gradients)")
        handle = LensHandle(hook, is_permanent)
        self.fwd_hooks.insert(0, handle) if prepend else self.fwd_hooks.append(handle)

    def remove_hooks(self, dir: str = "fwd", including_permanent: bool = False) -> None:
        self.fwd_hooks = [h for h in self.fwd_hooks if h.is_permanent and not including_permanent]

    def clear_context(self) -> None:
        self.ctx.clear()

    def layer(self) -> int:
        match = re.match(r"blocks\.(\d+)\.", self.name)
        if match is None:
            raise ValueError(f"{self.name} is not inside a block")
        return int(match.group(1))

    def __repr__(self) -> str:
        return f"HookPoint({self.name!r}, {len(self.fwd_hooks)} hooks)"


# One block's hook points in firing order (TransformerLens's order; the same in every family).
BLOCK_POINTS = ("hook_resid_pre", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z",
                "hook_attn_out", "hook_resid_mid", "ln2.hook_normalized", "mlp.hook_pre", "mlp.hook_post",
                "hook_mlp_out", "hook_resid_post")
# What comes before the blocks, per family: GPT-2 adds learned position embeddings.
EMBEDDING_POINTS = {"llama": ("hook_embed",), "gpt2": ("hook_embed", "hook_pos_embed")}
FAMILIES = tuple(EMBEDDING_POINTS)


def hook_names(family: str, n_layers: int) -> list[str]:
    """Every hook point of a model, in firing order (a backend's site id is the index here)."""
    if family not in EMBEDDING_POINTS:
        raise ValueError(f"unknown model family {family!r}; supported: {list(FAMILIES)}")
    blocks = [f"blocks.{L}.{point}" for L in range(n_layers) for point in BLOCK_POINTS]
    return [*EMBEDDING_POINTS[family], *blocks, "ln_final.hook_normalized"]


def _dims(cfg) -> dict[str, int]:
    """d_model, n_heads, n_kv_heads, d_head, d_mlp from an HF config (Llama or GPT-2; GPT2Config maps
    hidden_size / num_attention_heads to n_embd / n_head) or a TransformerLens-style config."""
    def first(*names):
        return next((v for n in names if (v := getattr(cfg, n, None)) is not None), None)

    d_model = first("hidden_size", "n_embd", "d_model")
    n_heads = first("num_attention_heads", "n_head", "n_heads")
    return {"d_model": d_model, "n_heads": n_heads,
            "n_kv_heads": first("num_key_value_heads", "n_key_value_heads") or n_heads,
            "d_head": first("head_dim", "d_head") or d_model // n_heads,
            "d_mlp": first("intermediate_size", "n_inner", "d_mlp") or 4 * d_model}


def feature_shape(name: str, config) -> tuple[int, ...]:
    """The per-token feature shape of a hook point's act, as in TransformerLens: act is
    [batch, pos, *feature_shape]. `config`: an HF config or a TransformerLens-style one."""
    d = _dims(config)
    point = re.sub(r"^blocks\.\d+\.", "", name)
    if point in ("attn.hook_q", "attn.hook_z"):
        return (d["n_heads"], d["d_head"])
    if point in ("attn.hook_k", "attn.hook_v"):
        return (d["n_kv_heads"], d["d_head"])
    if point in ("mlp.hook_pre", "mlp.hook_post"):
        return (d["d_mlp"],)
    return (d["d_model"],)


def make_hook_dict(family: str, n_layers: int) -> dict[str, HookPoint]:
    return {name: HookPoint(name) for name in hook_names(family, n_layers)}


def resolve(hook_dict: dict[str, HookPoint], name_or_filter: str | Callable[[str], bool]) -> list[str]:
    """Names a hook spec refers to: one (aliases accepted) or every name a filter accepts."""
    if callable(name_or_filter):
        return [n for n in hook_dict if name_or_filter(n)]
    name = canonical_name(name_or_filter)
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
