"""Triton templates that hook sites run inside the forward pass, each beside its torch twin.

The GPU engine calls the Triton launchers; the CPU engine calls the `_torch` twins, which take
the same arguments and do the same math.
"""
if __name__ != "xmix_lens.kernels":
    # imported as a top-level `kernels` because the repository root is on sys.path (`python -c` or
    # `python -m` run from the root): it would shadow PyPI's `kernels`, which transformers probes.
    raise ImportError("the repository's kernels/ folder is the package xmix_lens.kernels; it was found as a "
                      "top-level `kernels` because the repository root is on sys.path. Run Python from another "
                      "directory, or use .venv/bin/pytest / .venv/bin/xmix-lens")

from .affine_write import affine_write, affine_write_torch
from .gather_rows import gather_rows, gather_rows_torch
from .generated import generate_kernel, run_program, run_program_torch
from .project_read import project_read, project_read_torch

__all__ = [
    "affine_write", "affine_write_torch",
    "gather_rows", "gather_rows_torch",
    "generate_kernel", "run_program", "run_program_torch",
    "project_read", "project_read_torch",
]
