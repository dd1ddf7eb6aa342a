"""Lowered programs: what a hook site executes. Plain data, no user Python.

A hook on one hook point lowers to a list of ops, run in order on the site tensor x [T, F]
(the flattened tokens of one engine step). Each op touches the tokens of its pass whose padded
position is selected, and is an instance of a kernel template (kernels/): its behaviour is the
contents of its tensors, so changing a parameter never changes code.
"""
from dataclasses import dataclass

import torch


@dataclass
class AffineWrite:
    """x[t] <- x[t] * scale + bias[t] + (x[t] @ U) @ V at the selected tokens (kernels.affine_write)."""

    positions: torch.Tensor | None  # bool [P] over padded positions; None: every position
    scale: torch.Tensor  # [F]
    bias: torch.Tensor  # [F], or [B, P, F] when it differs per token (patching from a cache)
    U: torch.Tensor  # [F, K]
    V: torch.Tensor  # [K, F]

    @property
    def per_token_bias(self) -> bool:
        return self.bias.dim() == 3


@dataclass
class Read:
    """value[t] = x[t] @ W + bias[t] at the selected tokens, delivered to the host into read `key`.

    W None means the identity (kernels.gather_rows), else kernels.project_read. The host result has
    the traced value's shape: [B, P, *feature_shape], or [B, *feature_shape] when `keeps_pos` is
    False (one selected position). Positions a request does not have (padding) read as zero.
    """

    key: object  # any hashable, unique within a pass
    positions: torch.Tensor | None
    keeps_pos: bool
    W: torch.Tensor | None  # [F, O]
    bias: torch.Tensor | None  # [O], or [B, P, O] per token
    feature_shape: tuple[int, ...]


LoweredOp = AffineWrite | Read
