"""xmix-lens: TransformerLens hooks compiled into a vLLM serving engine.

    from xmix_lens import HookedTransformer      # was: from transformer_lens import HookedTransformer
    model = HookedTransformer.from_pretrained("smollm2-135m")
"""
import os

# vLLM reads these when it is imported: the in-process engine (the model object and the site
# runtime live in this process), and a KV-cache size that fits a CPU machine.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from .app import App, AppRun  # noqa: E402
from .cache import ActivationCache  # noqa: E402
from .functional import topk_mask  # noqa: E402
from .hook_points import HookPoint  # noqa: E402
from .model import HookedServedConfig, HookedServedModel, HookedTransformer  # noqa: E402
from .stores import store  # noqa: E402
from .trace import TraceError  # noqa: E402

__all__ = ["ActivationCache", "App", "AppRun", "HookPoint", "HookedServedConfig", "HookedServedModel", "HookedTransformer",
           "TraceError", "store", "topk_mask"]
