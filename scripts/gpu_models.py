"""The config folders that the GPU benchmarks and tests load with dummy weights (`load_format="dummy"`):
`.gpumodel`, a small Llama (d_model 1024, 8 layers, 16 heads), and `.gpumodel8b`, Llama-3-8B's
shapes (hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336, vocab 128256), each with the
embedded SmolLM2's tokenizer files. Both are ignored by git (a fresh machine makes them again):

    .venv/bin/python scripts/gpu_models.py
"""
import json
import shutil
from pathlib import Path

from xmix_lens.model_files import ensure_smollm2

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    ".gpumodel": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                      intermediate_size=4096, vocab_size=49152, tie_word_embeddings=True),
    ".gpumodel8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}),
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


if __name__ == "__main__":
    smollm2 = ensure_smollm2()
    for name, shape in SHAPES.items():
        write(ROOT / name, shape, smollm2)
        print(ROOT / name)
