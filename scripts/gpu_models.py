"""The config folders that the GPU benchmarks and tests load with dummy weights (`load_format="dummy"`):
`.gpumodel`, a small Llama (d_model 1024, 8 layers, 16 heads), and `.gpumodel8b`, Llama-3-8B's
shapes (hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336, vocab 128256), each with the
embedded SmolLM2's tokenizer files; and one folder a family at a public model's shape
(`FAMILY_SHAPES`), written where the GPU test or bench needs it with `.gpumodel8b`'s tokenizer
(`family_folder`; `--families` writes them under `.gpufamilies/`). All are ignored by git (a fresh
machine makes them again):

    .venv/bin/python scripts/gpu_models.py                                  # here: the Llama folders
    python3 scripts/gpu_models.py --families qwen3-8b qwen3-30b-a3b         # there: under .gpufamilies/
"""
import argparse
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    ".gpumodel": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                      intermediate_size=4096, vocab_size=49152, tie_word_embeddings=True),
    ".gpumodel8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}),
}
# the families beyond Llama at a public model's shape: transformers config class, architecture, its config.json's sizes
FAMILY_SHAPES = {
    "qwen3-8b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False)),
    "qwen2.5-7b": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)),
    "mistral-7b-v0.3": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=32768, sliding_window=None)),
    "phi-3-mini": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=3072, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=8192, vocab_size=32064, sliding_window=None)),
    "gemma-2-9b": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=3584, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        intermediate_size=14336, vocab_size=256000, query_pre_attn_scalar=256, sliding_window=4096)),
    "gemma-3-12b": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=3840, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        intermediate_size=15360, vocab_size=262208, query_pre_attn_scalar=256, sliding_window=1024)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False)),
    "olmo-2-7b": ("Olmo2Config", "Olmo2ForCausalLM", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=11008, vocab_size=100352, tie_word_embeddings=False)),
    "olmo-3-7b": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=11008, vocab_size=100278, sliding_window=4096, tie_word_embeddings=False)),
    "pythia-6.9b": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=16384,
        vocab_size=50432, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False)),
}


def write(folder: Path, shape: dict, smollm2: Path) -> None:
    config = json.loads((smollm2 / "config.json").read_text())  # a Llama config: its norms, rope, tokens
    config.update(shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"], dtype="bfloat16",
                  max_position_embeddings=8192)
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for f in smollm2.iterdir():  # the tokenizer files
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")):
            shutil.copy(f, folder / f.name)


def family_folder(name: str, root: Path, tokenizer_folder: Path = ROOT / ".gpumodel8b", layers: int | None = None) -> Path:
    """A config folder of the family's shape under `root` (`layers` of its blocks where given), with
    `tokenizer_folder`'s tokenizer (its ids fit every family's vocabulary). Written with the transformers
    of the machine that loads it."""
    import transformers

    config_class, architecture, shape = FAMILY_SHAPES[name]
    tokens = json.loads((tokenizer_folder / "config.json").read_text())
    if layers:
        shape = {**shape, "num_hidden_layers": layers}
    config = getattr(transformers, config_class)(
        **shape, max_position_embeddings=4096, bos_token_id=tokens["bos_token_id"],
        eos_token_id=tokens["eos_token_id"], pad_token_id=tokens.get("pad_token_id", tokens["eos_token_id"]))
    config.architectures = [architecture]
    folder = root / name
    config.save_pretrained(folder)
    for f in tokenizer_folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, folder / f.name)
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILY_SHAPES), help="write these under .gpufamilies/")
    parser.add_argument("--layers", type=int, help="with --families: the first LAYERS blocks only (two engines of a "
                                                   "30B mixture side by side on one 80 GB card)")
    args = parser.parse_args()
    if args.families:
        for name in args.families:
            print(family_folder(name, ROOT / ".gpufamilies", layers=args.layers))
    else:
        from xmix_lens.model_files import ensure_smollm2

        smollm2 = ensure_smollm2()
        for name, shape in SHAPES.items():
            write(ROOT / name, shape, smollm2)
            print(ROOT / name)
