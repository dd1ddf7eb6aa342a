"""Triton templates that hook sites run inside the forward pass, each beside its torch twin.

The GPU engine calls the Triton launchers; the CPU engine calls the `_torch` twins, which take
the same arguments and do the same math.
"""

from .affine_write import affine_write, affine_write_torch
from .gather_rows import gather_rows, gather_rows_torch
from .project_read import project_read, project_read_torch

__all__ = [
    "affine_write", "affine_write_torch",
    "gather_rows", "gather_rows_torch",
    "project_read", "project_read_torch",
]
