"""Triton templates that hook sites run inside the forward pass, each beside its torch twin.

The GPU engine calls the Triton launchers; the CPU engine calls the `_torch` twins, which take
the same arguments and do the same math.
"""
if __name__ != "xmix_lens.kernels":
    # Found as a top-level `kernels` because a process runs with the repository root on sys.path
    # (`python -c` / `python -m` from the root, vLLM's helper subprocesses). Hugging Face's
    # `kernels` package has that name, and transformers probes it at import: look absent to it
    # (no __version__, no __file__, as it reads a namespace package) instead of shadowing it.
    __file__ = None
else:
    from .affine_write import affine_write, affine_write_torch
    from .gather_rows import gather_rows, gather_rows_torch
    from .next_token_nll import next_token_nll, next_token_nll_torch
    from .program_kernel import generate_kernel, run_program
    from .program_torch import run_program_torch
    from .project_read import project_read, project_read_torch
    from .rms_norm_rows import Renorm, rms_norm_rows, rms_norm_rows_torch

    __all__ = [
        "affine_write", "affine_write_torch",
        "gather_rows", "gather_rows_torch",
        "next_token_nll", "next_token_nll_torch",
        "generate_kernel", "run_program", "run_program_torch",
        "project_read", "project_read_torch",
        "Renorm", "rms_norm_rows", "rms_norm_rows_torch",
    ]
