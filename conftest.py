"""Shared pytest fixtures: one compiled vLLM engine and one TransformerLens reference per model.

Engines are expensive (a compiled SmolLM2 engine takes ~45-60 s to start on 2 cores), so each
model gets one session-scoped engine, built on first use, with torch.compile on as users get it.

Memory (the suite's peak is kept under 6 GB): every engine the suite builds gets a small KV
cache (_cap_kv_cache); fixtures that build engines of their own shut them down when their module
ends (a running in-process vLLM engine is never garbage-collected); freed memory goes back to the
system after each module; and the routing test, which holds 4 GB of logits, runs first
(pytest_collection_modifyitems).
"""
import ctypes
import gc
import importlib.abc
import importlib.util
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import pytest  # noqa: E402
import torch  # noqa: E402

# CI has no GPU: Triton kernels run in the interpreter (tests/gpu runs them compiled). Triton reads
# this when a kernel is decorated, so it must be set before anything imports xmix_lens.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# vLLM's CPU platform gives every engine VLLM_CPU_KVCACHE_SPACE whole GiB of KV cache (from_pretrained sets
# 1), all of it touched at start-up, and the variable overrides an engine's kv_cache_memory_bytes.
# The suite's engines (max_model_len <= 256, at most 32 prompts at a time on SmolLM2, up to vLLM's
# 256 sequences at a time on the tiny models) need far less: room for TEST_KV_CACHE_BLOCKS blocks
# (of 128 tokens; 48 are 270 MiB for SmolLM2, 46 KiB a token in fp32), and at least
# TEST_KV_CACHE_MIN_BYTES (512 blocks of the tiny Llama, 256 of the tiny GPT-2). The cap is
# applied where vLLM sets the size (its CPU platform's config check, run as each engine's config
# is made; TP workers get the size from it), once vLLM imports that module: importing vLLM here would cost
# every run, unit tests included, seconds.
TEST_KV_CACHE_BLOCKS = 48
TEST_KV_CACHE_MIN_BYTES = 64 * 2**20


def _cap_kv_cache(cpu_platform_module) -> None:
    platform = cpu_platform_module.CpuPlatform
    check = platform.check_and_update_config.__func__

    def check_and_cap(cls, vllm_config) -> None:
        check(cls, vllm_config)
        model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
        if model is None:
            return
        per_token = (2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size()
                     * model.dtype.itemsize)  # K and V, this rank's share
        cap = max(TEST_KV_CACHE_BLOCKS * cache.block_size * per_token, TEST_KV_CACHE_MIN_BYTES)
        cache.kv_cache_memory_bytes = min(cache.kv_cache_memory_bytes or cap, cap)

    platform.check_and_update_config = classmethod(check_and_cap)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` right after `name` is first imported (it does not import it itself)."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # the other finders find it
        spec = importlib.util.find_spec(fullname)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            self.then(module)

        spec.loader.exec_module = exec_module
        return spec


if "vllm.platforms.cpu" in sys.modules:
    _cap_kv_cache(sys.modules["vllm.platforms.cpu"])
else:
    sys.meta_path.insert(0, _AfterImport("vllm.platforms.cpu", _cap_kv_cache))

from tests.tiny_models import (tiny_gemma2, tiny_gemma3, tiny_gpt2, tiny_llama, tiny_mistral, tiny_neox,  # noqa: E402
                               tiny_olmo2, tiny_olmo3, tiny_phi3, tiny_qwen2, tiny_qwen3, tiny_qwen3_moe)
from xmix_lens.model_files import ensure_smollm2  # noqa: E402

MODEL_DIRS = {
    "tiny-llama": tiny_llama,
    "tiny-gpt2": tiny_gpt2,
    "smollm2": ensure_smollm2,
    # the other families' (compat_tests/test_families.py builds their engines itself, one module long)
    "tiny-qwen2": tiny_qwen2,
    "tiny-qwen3": tiny_qwen3,
    "tiny-mistral": tiny_mistral,
    "tiny-phi3": tiny_phi3,
    "tiny-neox": tiny_neox,
    "tiny-gemma2": tiny_gemma2,
    "tiny-gemma3": tiny_gemma3,
    "tiny-qwen3-moe": tiny_qwen3_moe,
    "tiny-olmo2": tiny_olmo2,
    "tiny-olmo3": tiny_olmo3,
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


try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim  # glibc
except (OSError, AttributeError):
    _malloc_trim = None


@pytest.fixture(scope="module", autouse=True)
def _return_freed_memory():
    """After each test module (its own fixtures torn down first): collect what it dropped and hand
    glibc's free heap pages back to the system, which glibc keeps otherwise (2 GB after the routing
    test, so that every later module ran on top of them)."""
    yield
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)


# The routing test's 1,000 requests come back as 4 GB of logits (SmolLM2's 49,152-token vocabulary,
# fp32, as its assertion needs them). Run first, they meet only the tiny Llama's engine (a 5.7 GB
# peak, 2026-11-30); later, SmolLM2's engine and the TransformerLens references would be there too (7.9 GB).
# The notebooks run before both: each in its own kernel process, with its own engine (about 2 GB),
# while this process holds no engine yet.
RUN_FIRST = ("tests/test_notebooks.py", "tests/test_routing.py")


def pytest_collection_modifyitems(config, items):
    def first(item) -> int:
        module = item.nodeid.split("::")[0]
        return RUN_FIRST.index(module) if module in RUN_FIRST else len(RUN_FIRST)

    items.sort(key=first)  # stable: the rest keep their order
