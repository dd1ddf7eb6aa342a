"""Model families: one record per family of models the package serves (`Family`), by name (`FAMILIES`).

A family is the Hugging Face architectures whose models have the same TransformerLens hook points
and the same checkpoint layout. Its record holds everything engine-neutral that differs between
families: which hook points a block has (hook_points.py makes a model's names from it), which
query and key attention uses (attention_points.py), and how the family's Hugging Face checkpoint
is made of TransformerLens's weights (tl_surface.py). Where an engine places the hook points is
the engine's own: vLLM's placements are backend/vllm/sites.py's FAMILY_SITES, keyed by the family's
name. Adding a family is a record here and its placements there (docs/architecture.md).
"""
from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True)
class Family:
    """One family of models.

    name           model.cfg.family; the key of FAMILIES and of an engine's placements
    title          the family as messages write it
    architectures  the Hugging Face architectures it serves (config.json's "architectures")
    positions      "rotary": q and k are rotated per position (attn.hook_rot_q / hook_rot_k);
                   "learned": a position embedding is added to the token's (hook_pos_embed)
    gated_mlp      the MLP's activation input has a linear half beside it (mlp.hook_pre_linear)
    checkpoint     the Hugging Face checkpoint made of TransformerLens's weights (tl_surface's weight
                   processing): (tensor name, layout (tl_surface.LAYOUTS), TransformerLens weights...);
                   "{L}" in a name makes it block L's, of block L's weights; several weights are
                   concatenated along the output dim (a linear layer's first, a Conv1D's last: one fused
                   tensor); a layout "per_head_<layout>" puts the weights' rows head after head (NeoX's
                   fused q, k, v). The output layer's weight (W_U, `unembedding`) is every family's.
    unplaced       TransformerLens's block weights the checkpoint has no place for: weight processing
                   must leave them zero
    qk_norm        each head's query and key pass an RMS norm before the rotary embedding
                   (attn.hook_q_normed / hook_k_normed)
    qk_norm_over   "head": the norm is over each head's d_head (Qwen3, Gemma 3; TransformerLens shows the
                   normed values heads first, [batch, head, pos, d_head]); "projection": over the whole
                   query / key projection, all heads together (OLMo 3; [batch, pos, heads * d_head])
    pre_norms      norms before attention and the MLP (ln1, ln2); without them (OLMo 3) attention and
                   the MLP read the residual itself: x + ln1_post(attn(x)), then h + ln2_post(mlp(h))
    post_norms     norms on the attention's and the MLP's outputs too (Gemma 2): hook_attn_out and
                   hook_mlp_out are after them, attn.hook_out and mlp.hook_out before them
    moe            the MLP is a mixture of experts: its input (mlp.hook_in), the router's logits
                   (mlp.gate.hook_out) and what the router chose (computed), its output; no single
                   hidden layer (hook_pre / hook_post)
    parallel       attention and MLP both read the block's input (x + attn(ln1(x)) + mlp(ln2(x))): no
                   hook_resid_mid, nor hook_mlp_in
    unembedding    the output layer's name in the checkpoint and in vLLM's model (transformers' lm_head)
    tied           vLLM serves the family only with the unembedding tied to the embedding
    refuses        (config field, value or test of the value, why): checkpoints of the architecture the
                   family does not serve
    """

    name: str
    title: str
    architectures: tuple[str, ...]
    positions: Literal["rotary", "learned"]
    gated_mlp: bool
    checkpoint: tuple[tuple[str, ...], ...]
    unplaced: tuple[str, ...] = ()
    qk_norm: bool = False
    qk_norm_over: Literal["head", "projection"] = "head"
    pre_norms: bool = True
    post_norms: bool = False
    moe: bool = False
    parallel: bool = False
    unembedding: str = "lm_head"
    tied: bool = False
    refuses: tuple[tuple[str, object, str], ...] = ()

    @property
    def rotary(self) -> bool:
        return self.positions == "rotary"


LLAMA = Family(
    name="llama", title="Llama", architectures=("LlamaForCausalLM",), positions="rotary", gated_mlp=True,
    checkpoint=(
        ("model.embed_tokens.weight", "as_is", "W_E"),
        ("model.norm.weight", "as_is", "ln_final.w"),
        ("model.layers.{L}.input_layernorm.weight", "as_is", "ln1.w"),
        ("model.layers.{L}.post_attention_layernorm.weight", "as_is", "ln2.w"),
        ("model.layers.{L}.self_attn.q_proj.weight", "heads_linear", "attn.W_Q"),
        ("model.layers.{L}.self_attn.k_proj.weight", "heads_linear", "attn.W_K"),
        ("model.layers.{L}.self_attn.v_proj.weight", "heads_linear", "attn.W_V"),
        ("model.layers.{L}.self_attn.o_proj.weight", "out_heads_linear", "attn.W_O"),
        ("model.layers.{L}.mlp.gate_proj.weight", "linear", "mlp.W_gate"),
        ("model.layers.{L}.mlp.up_proj.weight", "linear", "mlp.W_in"),
        ("model.layers.{L}.mlp.down_proj.weight", "linear", "mlp.W_out"),
    ),
    unplaced=("attn.b_Q", "attn.b_K", "attn.b_V", "attn.b_O", "mlp.b_in", "mlp.b_out"),
)

# Mistral's checkpoint and blocks are Llama's; vLLM serves it with a class of its own
MISTRAL = replace(LLAMA, name="mistral", title="Mistral", architectures=("MistralForCausalLM",))

# Qwen2: Llama's blocks with biases on the query, key and value projections
QWEN2 = replace(
    LLAMA, name="qwen2", title="Qwen2", architectures=("Qwen2ForCausalLM",),
    checkpoint=LLAMA.checkpoint + (
        ("model.layers.{L}.self_attn.q_proj.bias", "flat", "attn.b_Q"),
        ("model.layers.{L}.self_attn.k_proj.bias", "flat", "attn.b_K"),
        ("model.layers.{L}.self_attn.v_proj.bias", "flat", "attn.b_V"),
    ),
    unplaced=("attn.b_O", "mlp.b_in", "mlp.b_out"),
)

# Phi-3: Llama's blocks, its checkpoint's q, k, v and gate, up projections fused (as vLLM's layers are)
PHI3 = replace(
    LLAMA, name="phi3", title="Phi-3", architectures=("Phi3ForCausalLM",),
    checkpoint=tuple(entry for entry in LLAMA.checkpoint if "_proj" not in entry[0] or "o_proj" in entry[0]
                     or "down_proj" in entry[0]) + (
        ("model.layers.{L}.self_attn.qkv_proj.weight", "heads_linear", "attn.W_Q", "attn.W_K", "attn.W_V"),
        ("model.layers.{L}.mlp.gate_up_proj.weight", "linear", "mlp.W_gate", "mlp.W_in"),
    ),
)

# Qwen3: Llama's blocks with an RMS norm on each head's query and key
QWEN3 = replace(
    LLAMA, name="qwen3", title="Qwen3", architectures=("Qwen3ForCausalLM",), qk_norm=True,
    checkpoint=LLAMA.checkpoint + (
        ("model.layers.{L}.self_attn.q_norm.weight", "as_is", "attn.q_norm.weight"),
        ("model.layers.{L}.self_attn.k_norm.weight", "as_is", "attn.k_norm.weight"),
    ),
)

GPT2 = Family(
    name="gpt2", title="GPT-2", architectures=("GPT2LMHeadModel",), positions="learned", gated_mlp=False,
    checkpoint=(
        ("transformer.wte.weight", "as_is", "W_E"),
        ("transformer.wpe.weight", "as_is", "W_pos"),
        ("transformer.ln_f.weight", "as_is", "ln_final.w"),
        ("transformer.ln_f.bias", "as_is", "ln_final.b"),
        ("transformer.h.{L}.ln_1.weight", "as_is", "ln1.w"),
        ("transformer.h.{L}.ln_1.bias", "as_is", "ln1.b"),
        ("transformer.h.{L}.ln_2.weight", "as_is", "ln2.w"),
        ("transformer.h.{L}.ln_2.bias", "as_is", "ln2.b"),
        # Conv1D layout [d_in, d_out]; c_attn's columns are q, k, v, each head after head
        ("transformer.h.{L}.attn.c_attn.weight", "heads_conv1d", "attn.W_Q", "attn.W_K", "attn.W_V"),
        ("transformer.h.{L}.attn.c_attn.bias", "flat", "attn.b_Q", "attn.b_K", "attn.b_V"),
        ("transformer.h.{L}.attn.c_proj.weight", "out_heads_conv1d", "attn.W_O"),
        ("transformer.h.{L}.attn.c_proj.bias", "as_is", "attn.b_O"),
        ("transformer.h.{L}.mlp.c_fc.weight", "as_is", "mlp.W_in"),
        ("transformer.h.{L}.mlp.c_fc.bias", "as_is", "mlp.b_in"),
        ("transformer.h.{L}.mlp.c_proj.weight", "as_is", "mlp.W_out"),
        ("transformer.h.{L}.mlp.c_proj.bias", "as_is", "mlp.b_out"),
    ),
)

# Qwen3-MoE: Qwen3's attention, a mixture of experts in every block (top-k of a softmax router). Weight
# processing is not offered (no checkpoint layout: TransformerLens's expert weights are not mapped)
QWEN3_MOE = replace(QWEN3, name="qwen3_moe", title="Qwen3-MoE", architectures=("Qwen3MoeForCausalLM",), moe=True,
                    checkpoint=(),
                    refuses=(("mlp_only_layers", bool, "blocks with a dense MLP among the experts' are not placed "
                              "(every block of Qwen3-MoE's published models is a mixture of experts)"),
                             ("decoder_sparse_step", lambda step: step not in (None, 1),
                              "blocks with a dense MLP among the experts' are not placed")))

# Gemma 2: Llama's blocks with norms after attention and MLP, embeddings scaled by sqrt(d_model), soft-capped
# attention scores and logits, every other layer's attention in a sliding window; norms weigh by 1 + w
GEMMA2 = replace(
    LLAMA, name="gemma2", title="Gemma 2", architectures=("Gemma2ForCausalLM",), post_norms=True,
    unembedding="model.embed_tokens", tied=True,  # vLLM's Gemma 2 has no lm_head: its logits use the embedding
    checkpoint=tuple(entry for entry in LLAMA.checkpoint if "post_attention_layernorm" not in entry[0]) + (
        ("model.layers.{L}.post_attention_layernorm.weight", "as_is", "ln1_post.w"),
        ("model.layers.{L}.pre_feedforward_layernorm.weight", "as_is", "ln2.w"),
        ("model.layers.{L}.post_feedforward_layernorm.weight", "as_is", "ln2_post.w"),
    ),
)

# Gemma 3 (its text model): Gemma 2's blocks without the soft caps, with (1 + w) RMS norms on each head's
# query and key; its vLLM class has an lm_head (tied or not)
GEMMA3 = replace(GEMMA2, name="gemma3", title="Gemma 3", architectures=("Gemma3ForCausalLM",), qk_norm=True,
                 unembedding="lm_head", tied=False,
                 checkpoint=GEMMA2.checkpoint + (
                     ("model.layers.{L}.self_attn.q_norm.weight", "as_is", "attn.q_norm.weight"),
                     ("model.layers.{L}.self_attn.k_norm.weight", "as_is", "attn.k_norm.weight"),
                 ))

# OLMo 3: norms after attention and the MLP only (none before: TransformerLens's ln1_post / ln2_post, no
# ln1 / ln2), RMS norms over the whole query and key projections (all heads together) before the rotary
# embedding, some layers' attention in a sliding window (layer_types); plain RMS norms (weight w)
OLMO3 = replace(
    LLAMA, name="olmo3", title="OLMo 3", architectures=("Olmo3ForCausalLM",), qk_norm=True, qk_norm_over="projection",
    pre_norms=False, post_norms=True,
    checkpoint=tuple(entry for entry in LLAMA.checkpoint if "layernorm" not in entry[0]) + (
        ("model.layers.{L}.post_attention_layernorm.weight", "as_is", "ln1_post.w"),
        ("model.layers.{L}.post_feedforward_layernorm.weight", "as_is", "ln2_post.w"),
        ("model.layers.{L}.self_attn.q_norm.weight", "as_is", "attn.q_norm.weight"),
        ("model.layers.{L}.self_attn.k_norm.weight", "as_is", "attn.k_norm.weight"),
    ),
)
# OLMo 2: OLMo 3's blocks and weights, every layer full attention (TransformerLens's adapters differ in
# nothing else); vLLM serves it with OLMo 3's model class (backend/vllm/sites.py says how)
OLMO2 = replace(OLMO3, name="olmo2", title="OLMo 2", architectures=("Olmo2ForCausalLM",))

# GPT-NeoX (Pythia): parallel attention and MLP, a partial rotary embedding, LayerNorm; its checkpoint's
# query_key_value holds q, k and v head after head
NEOX = Family(
    name="gpt_neox", title="GPT-NeoX", architectures=("GPTNeoXForCausalLM",), positions="rotary", gated_mlp=False,
    parallel=True, unembedding="embed_out",
    refuses=(("use_parallel_residual", False, "only its parallel blocks (Pythia's) are served: TransformerLens's "
              "hook_resid_mid sits in the other kind, which no site table places yet"),),
    checkpoint=(
        ("gpt_neox.embed_in.weight", "as_is", "W_E"),
        ("gpt_neox.final_layer_norm.weight", "as_is", "ln_final.w"),
        ("gpt_neox.final_layer_norm.bias", "as_is", "ln_final.b"),
        ("gpt_neox.layers.{L}.input_layernorm.weight", "as_is", "ln1.w"),
        ("gpt_neox.layers.{L}.input_layernorm.bias", "as_is", "ln1.b"),
        ("gpt_neox.layers.{L}.post_attention_layernorm.weight", "as_is", "ln2.w"),
        ("gpt_neox.layers.{L}.post_attention_layernorm.bias", "as_is", "ln2.b"),
        ("gpt_neox.layers.{L}.attention.query_key_value.weight", "per_head_heads_linear", "attn.W_Q", "attn.W_K",
         "attn.W_V"),
        ("gpt_neox.layers.{L}.attention.query_key_value.bias", "per_head_flat", "attn.b_Q", "attn.b_K", "attn.b_V"),
        ("gpt_neox.layers.{L}.attention.dense.weight", "out_heads_linear", "attn.W_O"),
        ("gpt_neox.layers.{L}.attention.dense.bias", "as_is", "attn.b_O"),
        ("gpt_neox.layers.{L}.mlp.dense_h_to_4h.weight", "linear", "mlp.W_in"),
        ("gpt_neox.layers.{L}.mlp.dense_h_to_4h.bias", "as_is", "mlp.b_in"),
        ("gpt_neox.layers.{L}.mlp.dense_4h_to_h.weight", "linear", "mlp.W_out"),
        ("gpt_neox.layers.{L}.mlp.dense_4h_to_h.bias", "as_is", "mlp.b_out"),
    ),
)

FAMILIES = {family.name: family for family in (LLAMA, MISTRAL, QWEN2, QWEN3, QWEN3_MOE, PHI3, GEMMA2, GEMMA3, OLMO2,
                                               OLMO3, GPT2, NEOX)}

# A checkpoint's config flag: its output layer has a bias, `lm_head.bias` (TransformerLens's b_U), which
# the family's Hugging Face and vLLM models lack (folding GPT-2's final LayerNorm makes one): the
# engine's model and model.tl add it (backend/vllm/instrumented.py, tl_surface.py)
UNEMBEDDING_BIAS = "xmix_unembedding_bias"
ARCHITECTURES = {arch: family for family in FAMILIES.values() for arch in family.architectures}


def family_of(hf_config) -> Family:
    """The family serving a Hugging Face config (its first "architectures" entry), or a ValueError that
    says why not."""
    arch = (hf_config.architectures or ["?"])[0]
    if arch not in ARCHITECTURES:
        supported = ", ".join(f"{f.title} ({', '.join(f.architectures)})" for f in FAMILIES.values())
        raise ValueError(f"architecture {arch} is not supported yet; the supported families: {supported}")
    family = ARCHITECTURES[arch]
    for field, value, why in family.refuses:
        given = getattr(hf_config, field, None)
        if value(given) if callable(value) else given == value:
            raise ValueError(f"this {family.title} checkpoint has {field}={given}: {why}")
    return family
