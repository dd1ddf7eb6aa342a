"""Functions for hooks that torch has no single op for, traceable and runnable eagerly alike."""
import torch


def topk_mask(x: torch.Tensor, k: int) -> torch.Tensor:
    """x where x is among the k largest values of its last dim, else 0 (top-k SAE activations).

    Ties with the k-th largest value are all kept. Inside a hook it lowers to one op; anywhere
    else (TransformerLens, a notebook) it runs in torch."""
    if torch.overrides.has_torch_function((x,)):
        return torch.overrides.handle_torch_function(topk_mask, (x,), x, k)
    return torch.where(x >= x.topk(k, dim=-1).values[..., -1:], x, torch.zeros_like(x))
