"""ActivationCache: what `run_with_cache` returns. It is TransformerLens's own ActivationCache
(a subclass), so that its methods (accumulated_resid, decompose_resid, stack_head_results,
logit_attrs, apply_ln_to_stack, ...) run unchanged: the served model's hook names are
TransformerLens's names, and they read the model's cfg, weights (`model.blocks[L].attn.W_O`,
TransformerLens's own, see tl_surface.py) and the cached activations.

What is added here: the TransformerLens 4.x bridge names (`blocks.0.hook_out`) index the same
entries as their 3.x names, and a missing entry is a KeyError that lists what was cached.
"""
import torch
from transformer_lens import ActivationCache as TLActivationCache

from .hook_points import canonical_name


class ActivationCache(TLActivationCache):
    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, str):
            key = canonical_name(key, self.cache_dict)
        try:
            return super().__getitem__(key)
        except KeyError as e:
            raise KeyError(f"{key!r} ({e.args[0]}) is not in the cache; cached: {list(self.cache_dict)}. Cache it "
                           f"with run_with_cache(names_filter=...), or check the name against model.hook_dict") from None

    def __contains__(self, key) -> bool:
        try:
            self[key]
        except KeyError:
            return False
        return True
