"""Attention scores and patterns: the hook points vLLM's fused attention never materialises.

TransformerLens fires, inside each attention layer,
    hook_attn_scores  [batch, head, query_pos, key_pos]  q . k / sqrt(d_head), -inf where a query
                      may not look (a later key, or a padding key)
    hook_pattern      [batch, head, query_pos, key_pos]  softmax of the scores over keys (0 where
                      every key is masked)
and then z = pattern @ v. The served engine computes attention in one fused kernel, so these are
computed here, on the device the reads land on, from the pass's reads of the query and key the
attention layer received (after the rotary embedding and after any hooks on hook_q/k, hook_rot_q/k)
and of the values. A hook that changes them changes z: `z_from` gives the z that the changed pattern
makes, and the model writes it at hook_z in a further pass (computed_points.targets).

Positions are over the batch's padded layout, as every act is: row b's real tokens are where its
attention mask is 1. Masked query positions are fully masked (the engine computes
nothing there; TransformerLens computes the pad tokens' own attention there).
"""
import torch

from .families import FAMILIES


def query_key_names(family: str, layer: int) -> tuple[str, str]:
    """The hook points whose reads are the query and key attention uses: rotated for rotary families."""
    rotated = "rot_" if FAMILIES[family].rotary else ""
    return f"blocks.{layer}.attn.hook_{rotated}q", f"blocks.{layer}.attn.hook_{rotated}k"


def allowed(real: torch.Tensor) -> torch.Tensor:
    """[batch, 1, query, key] bool from the real tokens [batch, pos]: key j is a real token of the
    row at or before real query i."""
    pos = torch.arange(real.shape[1], device=real.device)
    causal = pos[:, None] >= pos[None, :]  # [query, key]
    return (causal[None] & real[:, None, :] & real[:, :, None])[:, None]


def _repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[batch, pos, kv_heads, d_head] -> [batch, pos, n_heads, d_head]: grouped-query attention's
    query heads h * kv / n .. share key/value head h // (n_heads / kv_heads)."""
    return x.repeat_interleave(n_heads // x.shape[2], dim=2)


def scores_from(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """hook_attn_scores from q [batch, pos, head, d_head] and k [batch, pos, kv_head, d_head]: divided
    by sqrt(d_head) (Gemma 2's sqrt(query_pre_attn_scalar)), soft-capped where the model caps them
    (cfg.attn_scores_soft_cap > 0: cap * tanh(scores / cap), Gemma 2's)."""
    window = getattr(cfg, "window_size", None)
    if window and q.shape[1] > window:
        raise NotImplementedError(f"attention scores and patterns are computed without the model's sliding window "
                                  f"({window} tokens), so not for a pass of {q.shape[1]} positions: use shorter inputs")
    k = _repeat_kv(k.float(), q.shape[2])
    scale = (getattr(cfg, "query_pre_attn_scalar", None) or q.shape[-1]) ** 0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) / scale
    cap = getattr(cfg, "attn_scores_soft_cap", -1.0)
    if cap > 0:
        scores = cap * torch.tanh(scores / cap)
    return scores.masked_fill(~mask, float("-inf"))


def pattern_from(scores: torch.Tensor) -> torch.Tensor:
    """hook_pattern: softmax over keys; a query with every key masked gets zeros, as in TransformerLens."""
    return torch.nan_to_num(scores.float().softmax(-1), nan=0.0)


def z_from(pattern: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """hook_z [batch, pos, head, d_head] that a (possibly edited) pattern gives with values v."""
    v = _repeat_kv(v.float(), pattern.shape[1])
    return torch.einsum("bhqk,bkhd->bqhd", pattern.float(), v)
