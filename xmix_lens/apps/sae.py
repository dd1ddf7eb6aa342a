"""Sparse autoencoders in SAELens's on-disk format: a folder with `cfg.json` (d_in, d_sae,
hook_name, activation_fn, ...) and `sae_weights.safetensors` (W_enc [d_in, d_sae], b_enc [d_sae],
W_dec [d_sae, d_in], b_dec [d_in])."""
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..functional import topk_mask

_WEIGHTS = {"W_enc": ("d_in", "d_sae"), "b_enc": ("d_sae",), "W_dec": ("d_sae", "d_in"), "b_dec": ("d_in",)}


@dataclass
class SAE:
    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor
    hook_name: str
    activation: str = "relu"  # or "topk"
    k: int | None = None  # for "topk"
    cfg: dict = field(default_factory=dict)  # the rest of cfg.json, kept as read

    def __post_init__(self):
        d_in, d_sae = self.W_enc.shape
        sizes = {"d_in": d_in, "d_sae": d_sae}
        for name, dims in _WEIGHTS.items():
            want = tuple(sizes[d] for d in dims)
            if tuple(getattr(self, name).shape) != want:
                raise ValueError(f"SAE {name} is {list(getattr(self, name).shape)}; with W_enc [{d_in}, {d_sae}] it "
                                 f"must be {list(want)} ({' x '.join(dims)})")
        if self.activation not in ("relu", "topk"):
            raise ValueError(f"SAE activation {self.activation!r}: use 'relu' or 'topk'")
        if self.activation == "topk" and not (isinstance(self.k, int) and 1 <= self.k <= d_sae):
            raise ValueError(f"a top-k SAE needs an int k in [1, {d_sae}], got {self.k!r}")

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations; the same code runs eagerly and inside a traced hook."""
        pre = (x - self.b_dec) @ self.W_enc + self.b_enc
        return topk_mask(torch.relu(pre), self.k) if self.activation == "topk" else torch.relu(pre)

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        return f @ self.W_dec + self.b_dec


def load_sae(folder) -> SAE:
    """An SAE saved by SAELens (or `save_sae`); checks cfg.json's sizes against the weights."""
    from safetensors.torch import load_file

    folder = Path(folder)
    for name in ("cfg.json", "sae_weights.safetensors"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing; an SAELens SAE folder holds cfg.json and "
                                    f"sae_weights.safetensors")
    cfg = json.loads((folder / "cfg.json").read_text())
    weights = load_file(str(folder / "sae_weights.safetensors"))
    missing = [k for k in _WEIGHTS if k not in weights] + [k for k in ("d_in", "d_sae", "hook_name") if k not in cfg]
    if missing:
        raise ValueError(f"{folder}: missing {missing}; expected cfg.json keys d_in, d_sae, hook_name and tensors "
                         f"{list(_WEIGHTS)}")
    if tuple(weights["W_enc"].shape) != (cfg["d_in"], cfg["d_sae"]):
        raise ValueError(f"{folder}: cfg.json says d_in {cfg['d_in']}, d_sae {cfg['d_sae']}, but W_enc is "
                         f"{list(weights['W_enc'].shape)}")
    activation = cfg.get("activation_fn", cfg.get("activation_fn_str", "relu"))
    k = (cfg.get("activation_fn_kwargs") or {}).get("k")
    return SAE(*(weights[k_].float() for k_ in _WEIGHTS), hook_name=cfg["hook_name"], activation=activation, k=k,
               cfg=cfg)


def save_sae(sae: SAE, folder, **cfg_extra) -> Path:
    """Write an SAE as SAELens does: cfg.json and sae_weights.safetensors."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**sae.cfg, **cfg_extra, "d_in": sae.d_in, "d_sae": sae.d_sae, "hook_name": sae.hook_name,
           "activation_fn": sae.activation, "activation_fn_kwargs": {"k": sae.k} if sae.k else {},
           "apply_b_dec_to_input": True, "normalize_activations": "none", "dtype": "float32"}
    (folder / "cfg.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: getattr(sae, k).contiguous() for k in _WEIGHTS}, str(folder / "sae_weights.safetensors"))
    return folder
