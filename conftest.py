"""Shared pytest fixtures: one compiled vLLM engine and one TransformerLens reference per model.

Engines are expensive (a compiled SmolLM2 engine takes ~45-60 s to start on 2 cores), so each
model gets one session-scoped engine, built on first use, with torch.compile on as users get it.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import pytest  # noqa: E402
import torch  # noqa: E402

# CI has no GPU: Triton kernels run in the interpreter (tests/gpu runs them compiled). Triton reads
# this when a kernel is decorated, so it must be set before anything imports xmix_lens.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny_models import tiny_gpt2, tiny_llama  # noqa: E402
from xmix_lens.model_files import ensure_smollm2  # noqa: E402

MODEL_DIRS = {
    "tiny-llama": tiny_llama,
    "tiny-gpt2": tiny_gpt2,
    "smollm2": ensure_smollm2,
}


class _PerModel:
    """Builds one object per model name on first use and keeps it for the session."""

    def __init__(self, build):
        self.build, self.built = build, {}

    def __getitem__(self, name: str):
        if name not in self.built:
            self.built[name] = self.build(MODEL_DIRS[name]())
        return self.built[name]


@pytest.fixture(scope="session")
def served():
    from xmix_lens import HookedServedModel

    return _PerModel(lambda path: HookedServedModel.from_pretrained(str(path), max_model_len=256))


@pytest.fixture(scope="session")
def reference():
    from compat_tests.reference import TLReference

    return _PerModel(TLReference)
