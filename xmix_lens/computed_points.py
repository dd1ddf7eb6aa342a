"""Computed hook points: TransformerLens hook points that vLLM's forward never materialises.

HookedTransformer materialises, per block (hook_points.COMPUTED_POINTS, in firing order):
    hook_attn_in          [batch, pos, head, d_model]     the residual, one copy per head (cfg.use_attn_in)
    hook_q/k/v_input      [batch, pos, head, d_model]     one copy per query / key-value head (cfg.use_split_qkv_input)
    attn.hook_q/k_normed  [batch, head, pos, d_head]      a family with q/k norms (Qwen3): TransformerLens's
                                                          layout, heads first; reads only. OLMo 3's norms are
                                                          over the whole projection: [batch, pos, heads * d_head]
    mlp.hook_expert_weights / _indices  [batch, pos, experts] / [batch, pos, k]   a mixture of experts'
                                                          choice, from the router's logits; reads only
    attn.hook_attn_scores, attn.hook_pattern              (attention_points.py)
    attn.hook_result      [batch, pos, head, d_model]     each head's share of attn_out (cfg.use_attn_result)
    hook_mlp_in           [batch, pos, d_model]           the residual the MLP branch reads (cfg.use_hook_mlp_in)
and after the blocks unembed.hook_out, the logits. The served engine computes none of them, so
each is computed after the pass from the pass's reads of its `sources` (engine hook points of the
same block, read after their own hooks: what the model used).

A hook that changes one changes what follows it. `targets` turns the changed value into what it
implies at engine hook points of the same block: the query/key/value a changed input gives, the z a
changed pattern gives, the attn_out of changed head results, the MLP's normalised input. The model
writes those, before the hooks already there, in a further pass over the same traced plans (model.py,
`_fire_computed`), so everything downstream, the other computed points included, sees the change.
The logits (unembed.hook_out) are changed on the host: they are the call's result.

The weights these need (W_Q ... b_O, the norm's) are TransformerLens's, from model.tl.
"""
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import attention_points
from .families import FAMILIES


def sources(point: str, family: str) -> tuple[str, ...]:
    """The engine hook points (block-relative) whose reads compute `point`."""
    if point in ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input"):
        return ("hook_resid_pre",)
    if point in ("attn.hook_attn_scores", "attn.hook_pattern"):
        q, k = attention_points.query_key_names(family, 0)
        return (q.split(".", 2)[2], k.split(".", 2)[2], "attn.hook_v")
    if point in ("attn.hook_q_normed", "attn.hook_k_normed"):
        return (f"attn.hook_{point[10]}",)
    if point in ("mlp.hook_expert_weights", "mlp.hook_expert_indices"):
        return ("mlp.gate.hook_out",)
    if point == "attn.hook_result":
        return ("attn.hook_z",)
    if point == "hook_mlp_in":
        return ("hook_resid_mid",)
    return ()


@dataclass
class Block:
    """What computing one block's points needs: its reads (block-relative name -> act), TransformerLens's
    block (weights), the model's config and the padded layout's attention mask."""

    reads: dict[str, torch.Tensor]
    tl_block: Callable  # () -> model.tl.blocks[L], booted only if a write needs weights
    cfg: object
    mask: torch.Tensor  # attention_points.allowed
    scores: dict[str, torch.Tensor] = field(default_factory=dict)  # "engine" / "hooked": attention scores


def value(point: str, b: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """(act the hooks get, what the engine's pass used): equal except for hook_pattern after a hook
    changed hook_attn_scores."""
    dtype = b.cfg.dtype
    if point in ("hook_attn_in", "hook_q_input"):
        act = _per_head(b.reads["hook_resid_pre"], b.cfg.n_heads)
    elif point in ("hook_k_input", "hook_v_input"):
        act = _per_head(b.reads["hook_resid_pre"], _kv_heads(b.cfg))
    elif point in ("attn.hook_q_normed", "attn.hook_k_normed"):
        x = b.reads[sources(point, b.cfg.family)[0]]
        weight = getattr(b.tl_block().attn, f"{point[10]}_norm").weight.to(x.device).float()
        gain = weight + 1 if getattr(b.cfg, "rmsnorm_uses_offset", False) else weight  # Gemma's norms: 1 + w
        if FAMILIES[b.cfg.family].qk_norm_over == "projection":  # OLMo 3: over all heads together
            x = x.flatten(2)  # [batch, pos, heads * d_head], as TransformerLens lays it out
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + b.cfg.eps) * gain
        # per head: [batch, head, pos, d_head], as TransformerLens lays it out
        act = (normed if normed.dim() == 3 else normed.transpose(1, 2)).to(dtype)
    elif point in ("mlp.hook_expert_weights", "mlp.hook_expert_indices"):
        weights, indices = _routed(b.reads["mlp.gate.hook_out"], b.cfg)
        act = weights.to(dtype) if point == "mlp.hook_expert_weights" else indices
    elif point == "attn.hook_attn_scores":
        q, k = (b.reads[name] for name in sources(point, b.cfg.family)[:2])
        act = attention_points.scores_from(q, k, b.mask.to(q.device), b.cfg).to(dtype)
        b.scores["engine"] = act
    elif point == "attn.hook_pattern":
        if "engine" not in b.scores:
            value("attn.hook_attn_scores", b)
        used = attention_points.pattern_from(b.scores["engine"]).to(dtype)
        return attention_points.pattern_from(b.scores.get("hooked", b.scores["engine"])).to(dtype), used
    elif point == "attn.hook_result":
        W_O = b.tl_block().attn.W_O.to(b.reads["attn.hook_z"].device)  # [head, d_head, d_model]
        act = torch.einsum("bphd,hdm->bphm", b.reads["attn.hook_z"].float(), W_O).to(dtype)
    elif point == "hook_mlp_in":
        act = b.reads["hook_resid_mid"].clone()
    else:
        raise KeyError(point)
    return act, act


def hooked(point: str, b: Block, act: torch.Tensor) -> None:
    """Keep what the hooks made of a point that later points of the block compute from."""
    if point == "attn.hook_attn_scores":
        b.scores["hooked"] = act


def targets(point: str, b: Block, act: torch.Tensor) -> dict[str, torch.Tensor]:
    """The values to write at engine hook points (block-relative names) so that the pass runs with `act`
    (what the hooks made of the point) in place of what it computed."""
    if point == "attn.hook_attn_scores":
        return {}  # its effect is the pattern's, which fires next
    if point in ("mlp.hook_expert_weights", "mlp.hook_expert_indices"):
        raise NotImplementedError(f"a hook changed {point}, which is served for reading only: write at "
                                  f"mlp.gate.hook_out (the router's logits) to change the routing")
    if point in ("attn.hook_q_normed", "attn.hook_k_normed"):
        # a norm's output has unit RMS: most values written there are no hook_q's, and writing the
        # rotated value would need the rotary embedding on the host
        raise NotImplementedError(f"a hook changed {point}, which is served for reading only: write at "
                                  f"attn.hook_rot_{point[10]} (the normed value after the rotary embedding, what "
                                  f"attention uses) or attn.hook_{point[10]} (before the norm)")
    if point == "attn.hook_pattern":
        return {"attn.hook_z": attention_points.z_from(act, b.reads["attn.hook_v"])}
    attn = b.tl_block().attn
    if point == "hook_attn_in":
        return {"attn.hook_q": _project(b, act, attn.W_Q, attn.b_Q),
                "attn.hook_k": _project(b, _per_kv_head(act, b.cfg, "hook_attn_in"), attn.W_K, attn.b_K),
                "attn.hook_v": _project(b, _per_kv_head(act, b.cfg, "hook_attn_in"), attn.W_V, attn.b_V)}
    if point in ("hook_q_input", "hook_k_input", "hook_v_input"):
        which = point[5]
        return {f"attn.hook_{which}": _project(b, act, getattr(attn, f"W_{which.upper()}"),
                                               getattr(attn, f"b_{which.upper()}"))}
    if point == "attn.hook_result":
        b_O = attn.b_O
        out = act.float().sum(2)
        # with a norm after attention (Gemma 2, OLMo 3) the heads' sum is the attention's output before it
        after = "attn.hook_out" if FAMILIES[b.cfg.family].post_norms else "hook_attn_out"
        return {after: out if b_O is None else out + b_O.to(out.device)}
    if point == "hook_mlp_in":
        if not FAMILIES[b.cfg.family].pre_norms:
            # the MLP reads the residual itself, which the skip connection shares: no engine point holds the
            # MLP's input alone
            raise NotImplementedError(f"a hook changed hook_mlp_in, which {FAMILIES[b.cfg.family].title} models serve "
                                      f"for reading only: their MLP reads hook_resid_mid itself (no ln2 before it), "
                                      f"and a write there changes the residual too; write at mlp.hook_pre / "
                                      f"hook_pre_linear, or at hook_resid_mid")
        centred, scale = _norm_parts(act, b.cfg)
        return {"ln2.hook_scale": scale, "ln2.hook_normalized": centred / scale}
    raise KeyError(point)


def _routed(logits: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax router's choice from its logits [batch, pos, experts], as TransformerLens's bridge shows it:
    the top-k experts' weights (renormalised to sum to 1 where the model does: norm_topk_prob) in place
    among the experts, zeros elsewhere, and their indices [batch, pos, k], heaviest first."""
    probs = logits.float().softmax(-1)
    top, indices = probs.topk(cfg.experts_per_token, dim=-1)
    if getattr(cfg, "norm_topk_prob", False):
        top = top / top.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter(-1, indices, top), indices


def position_dim(point: str, family: str) -> int:
    """The dim of a computed point's act that runs over positions (queries, for attention): the normed query
    and key are heads first, except where the norm is over the whole projection (OLMo 3's)."""
    if point.endswith("_normed") and FAMILIES[family].qk_norm_over == "projection":
        return 1
    return 2 if point.endswith(("attn.hook_attn_scores", "attn.hook_pattern", "_normed")) else 1


def _kv_heads(cfg) -> int:
    return getattr(cfg, "n_key_value_heads", None) or cfg.n_heads


def _per_head(x: torch.Tensor, n: int) -> torch.Tensor:
    """[batch, pos, d_model] -> [batch, pos, n, d_model]: one copy per head (TransformerLens's
    repeat_along_head_dimension)."""
    return x[:, :, None, :].expand(-1, -1, n, -1).clone()


def _per_kv_head(act: torch.Tensor, cfg, point: str) -> torch.Tensor:
    """hook_attn_in's copies [batch, pos, head, d_model] for the keys and values: one per key-value head.
    Under grouped-query attention the heads that share a key-value head must hold the same copy."""
    kv = _kv_heads(cfg)
    if kv == act.shape[2]:
        return act
    groups = act.unflatten(2, (kv, act.shape[2] // kv))
    if not torch.equal(groups, groups[:, :, :, :1].expand_as(groups)):
        raise ValueError(f"a hook on {point} gave different copies to query heads that share a key-value head "
                         f"({act.shape[2] // kv} query heads per key-value head): their keys and values are one; "
                         f"use set_use_split_qkv_input(True) and hook_q_input / hook_k_input / hook_v_input")
    return groups[:, :, :, 0]


def _norm_parts(x: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(x centred (LayerNorm) or as is (RMSNorm), in fp32; hook_scale [..., 1]), as the served norms compute."""
    x = x.float()
    centred = x - x.mean(-1, keepdim=True) if cfg.normalization_type.startswith("LN") else x
    return centred, (centred.pow(2).mean(-1, keepdim=True) + cfg.eps).sqrt()


def _project(b: Block, inputs: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Per head: ln1 of that head's input copy (the copy itself where the family has no ln1: OLMo 3), times
    the head's weights [head, d_model, d_head]."""
    normed = inputs.float()
    if FAMILIES[b.cfg.family].pre_norms:
        ln1 = b.tl_block().ln1
        centred, scale = _norm_parts(inputs, b.cfg)
        normed = centred / scale * ln1.w.to(inputs.device)
        if getattr(ln1, "b", None) is not None:
            normed = normed + ln1.b.to(inputs.device)
    out = torch.einsum("bphm,hmd->bphd", normed, W.to(inputs.device))
    return out if bias is None else out + bias.to(inputs.device)
