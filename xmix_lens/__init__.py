"""xmix-lens: TransformerLens hooks compiled into a vLLM serving engine.

    from xmix_lens import HookedTransformer      # was: from transformer_lens import HookedTransformer
    model = HookedTransformer.from_pretrained("smollm2-135m")

The names below are imported on first use, so that `import xmix_lens.ir` (or trace, lower) loads
the hook IR alone: no vLLM, no model code (docs/architecture.md, "Layers").
"""
import importlib

_EXPORTS = {
    "ActivationCache": "cache", "App": "app", "AppRun": "app", "HookPoint": "hook_points",
    "HookedServedModel": "model", "HookedTransformer": "model",
    "NonFiniteError": "planner", "TraceError": "trace", "store": "stores", "topk_mask": "functional",
    "export": "model", "evaluate": "evaluation", "set_verbosity": "verbosity",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name == "utils":  # TransformerLens's utilities (xmix_lens/utils.py): `xmix_lens.utils` without importing it
        return importlib.import_module(".utils", __name__)  # the import binds it here: later lookups skip this
    if name not in _EXPORTS:
        raise AttributeError(f"module 'xmix_lens' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | {"utils"})
