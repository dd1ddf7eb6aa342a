"""TransformerLens for a CUDA machine without network whose image lacks it: its wheel and those of the
pure-Python packages its import needs, at this checkout's versions, into the ignored `.whl/` (carried
there beside the staged vLLM 0.26.0 wheels), then installed there into vLLM's site folder, each only where
the image lacks the module (the image's own packages are left as they are).

    .venv/bin/python scripts/gpu_wheels.py download            # here, once per machine (about 7 MB)
    python3 scripts/gpu_wheels.py install                      # there, after `. .gpu/bin/env.sh`
"""
import glob
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

WHEELS = ".whl"
# distribution -> the module it provides; sdist-only packages (transformers-stream-generator) are
# left out: TransformerLens does not import them when it is imported
PACKAGES = {"transformer-lens": "transformer_lens", "einops": "einops", "fancy-einsum": "fancy_einsum",
            "jaxtyping": "jaxtyping", "wadler-lindig": "wadler_lindig", "beartype": "beartype",
            "typeguard": "typeguard", "accelerate": "accelerate", "datasets": "datasets", "xxhash": "xxhash",
            "multiprocess": "multiprocess", "sentencepiece": "sentencepiece", "rich": "rich",
            "markdown-it-py": "markdown_it", "mdurl": "mdurl", "python-dateutil": "dateutil"}


def download() -> None:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in PACKAGES]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "-d", WHEELS, *pins], check=True)


def install(target: str = "/tmp/site") -> None:
    module = {name.replace("-", "_"): mod for name, mod in PACKAGES.items()}
    missing = [w for w in sorted(glob.glob(f"{WHEELS}/*.whl"))
               if importlib.util.find_spec(module[os.path.basename(w).split("-")[0]]) is None]
    print("installing", [os.path.basename(w) for w in missing])
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", target, "--upgrade", *missing], check=True)


if __name__ == "__main__":
    {"download": download, "install": install}[sys.argv[1]]()
