"""ActivationCache: what `run_with_cache` returns, indexed as TransformerLens's cache is."""
import torch

# short names TransformerLens accepts in cache[name, layer(, sublayer)]
_SHORT = {
    "embed": "hook_embed",
    "pos_embed": "hook_pos_embed",
    "resid_pre": "blocks.{L}.hook_resid_pre",
    "resid_mid": "blocks.{L}.hook_resid_mid",
    "resid_post": "blocks.{L}.hook_resid_post",
    "attn_out": "blocks.{L}.hook_attn_out",
    "mlp_out": "blocks.{L}.hook_mlp_out",
    "normalized": "blocks.{L}.{S}.hook_normalized",
    "q": "blocks.{L}.attn.hook_q",
    "k": "blocks.{L}.attn.hook_k",
    "v": "blocks.{L}.attn.hook_v",
    "z": "blocks.{L}.attn.hook_z",
    "pre": "blocks.{L}.mlp.hook_pre",
    "post": "blocks.{L}.mlp.hook_post",
}


class ActivationCache:
    def __init__(self, cache_dict: dict[str, torch.Tensor], model, has_batch_dim: bool = True):
        self.cache_dict = cache_dict
        self.model = model
        self.has_batch_dim = has_batch_dim

    def _key(self, key) -> str:
        if isinstance(key, str):
            if key in self.cache_dict or key not in _SHORT:
                return key
            key = (key,)
        name, *rest = key
        template = _SHORT.get(name, name)
        if "{L}" in template:
            if not rest:
                raise KeyError(f"{name!r} needs a layer: cache[{name!r}, layer]")
            layer = rest[0] % self.model.cfg.n_layers
            sub = rest[1] if len(rest) > 1 else None
            if "{S}" in template and sub is None:
                raise KeyError(f"{name!r} needs a sublayer: cache[{name!r}, layer, 'ln1' | 'ln2']")
            return template.format(L=layer, S=sub)
        if name == "normalized" and rest == ["ln_final"] or name == "ln_final":
            return "ln_final.hook_normalized"
        return template

    def __getitem__(self, key) -> torch.Tensor:
        name = self._key(key)
        if name not in self.cache_dict:
            raise KeyError(f"{name!r} is not in the cache; cached: {list(self.cache_dict)}")
        return self.cache_dict[name]

    def __contains__(self, key) -> bool:
        try:
            return self._key(key) in self.cache_dict
        except KeyError:
            return False

    def __len__(self) -> int:
        return len(self.cache_dict)

    def __iter__(self):
        return iter(self.cache_dict)

    def keys(self):
        return self.cache_dict.keys()

    def values(self):
        return self.cache_dict.values()

    def items(self):
        return self.cache_dict.items()

    def remove_batch_dim(self) -> "ActivationCache":
        if self.has_batch_dim:
            for name, value in self.cache_dict.items():
                if value.shape[0] != 1:
                    raise ValueError(f"remove_batch_dim needs batch size 1; {name} has {value.shape[0]}")
                self.cache_dict[name] = value[0]
            self.has_batch_dim = False
        return self

    def accumulated_resid(self, layer: int | None = None) -> torch.Tensor:
        """The residual stream before each layer and after the last: [layers + 1, batch, pos, d_model]."""
        n = self.model.cfg.n_layers if layer is None else layer
        parts = [self[f"blocks.{L}.hook_resid_pre"] for L in range(n)]
        if layer is None:
            parts.append(self[f"blocks.{n - 1}.hook_resid_post"])
        return torch.stack(parts)

    def __repr__(self) -> str:
        return f"ActivationCache with keys {list(self.cache_dict)}"
