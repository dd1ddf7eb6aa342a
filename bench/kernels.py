"""Each resident op's kernel time against its floor: what `python -m bench.serving --profile` records.

For every op the engine's installed apps hold (the seven of bench/serving.py), at each workload's
decode batch (one token per request, every token live): the launch's time, replayed from a CUDA
graph as the engine replays it, the bytes it must move (x's rows read, and written by a write; its
parameters; a read's outputs; a renorm's output row and x's read again) and the time those bytes
take at the GPU's memory bandwidth. An empty
Triton kernel timed the same way is the launch floor. On the CPU (the toy run in CI) the torch twins
are timed in a loop: the harness is what is tested there, not the numbers.
"""
import math
import time

import torch

from xmix_lens.backend.vllm.sites import site_table
from xmix_lens.kernels import Renorm
from xmix_lens.lowered import named_tensors

H200_BYTES_PER_S = 4.8e12  # HBM3e


def resident_kernel_times(control, dtype: torch.dtype, token_counts, renormalized: set[int] = frozenset(),
                          launches: int = 20, replays: int = 5) -> dict:
    """{"launch_floor_us", "ops": [one row per (op, tokens)]} for the control plane's live ops. A write
    at a site of `renormalized` (residual sites after vLLM's fused add + RMSNorm: `renormalized_sites`)
    is timed as the engine runs it, with its renorm (it writes the norm's output too)."""
    device = control.device
    gen = torch.Generator().manual_seed(0)
    rows = []
    for entry in control.ops:
        if entry.retired:
            continue
        values = entry.step_values
        F, outputs = site_width(entry.op), values.shape[1] if values is not None else 0
        value_bytes = values.element_size() if values is not None else 0
        renorm = values is None and entry.site in renormalized
        for T in token_counts:
            x = (0.1 * torch.randn(T, F, generator=gen)).to(device, dtype)
            every = torch.arange(T, dtype=torch.int32, device=device)
            tables = torch.zeros(T, dtype=torch.int32, device=device) if entry.tables else None
            norm = Renorm(torch.ones(F, dtype=dtype, device=device), 1e-5, torch.empty_like(x)) if renorm else None

            def launch(entry=entry, x=x, every=every, tables=tables, values=values, norm=norm):
                control.executor.run(entry.op, x, every, tables, values, every if values is not None else None, norm)

            us = _time(launch, device, launches, replays)
            moved = T * F * x.element_size() * (1 if values is not None else 2 + 2 * renorm) + value_bytes * T * outputs \
                + sum(t.numel() * t.element_size() for _, t in named_tensors(entry.op))
            floor = 1e6 * moved / H200_BYTES_PER_S
            rows.append({"app": entry.app, "op": describe(entry.op) + " + renorm" * renorm, "features": F, "outputs": outputs,
                         "tokens": T, "us": us, "bytes": moved, "bandwidth_floor_us": floor,
                         "times_floor": us / floor})
    return {"launch_floor_us": _time(_empty_launch(device), device, launches, replays), "ops": rows}


def renormalized_sites(family: str, n_layers: int, site_id: dict[str, int]) -> set[int]:
    """The ids of the residual sites whose writes normalise again (sites.py: the "sum" sites of a
    "norm" placement, beside vLLM's fused add + RMSNorm in a Llama)."""
    return {site_id[name] for _, placement, groups in site_table(family, n_layers) if placement == "norm"
            for name in groups.get("sum", [])}


def site_width(op) -> int:
    """The features of x at the op's site."""
    if op.is_program:
        return next(o.shape[0] for o in op.program.ops if o.op == "x")
    if op.writes:  # an affine write: a scale per feature
        return op.scale.shape[-1]
    return op.W.shape[0] if op.W is not None else math.prod(op.feature_shape)


def describe(op) -> str:
    if op.is_program:
        kinds = sorted({o.op for o in op.program.ops} - {"x", "const"})
        return f"program_kernel {'write' if op.writes else 'read'} ({', '.join(kinds)})"
    if op.writes:
        return f"affine_write (rank {op.U.shape[1]})"
    return "gather_rows" if op.W is None else f"project_read ({op.W.shape[1]} outputs)"


def _empty_launch(device):
    if device.type != "cuda":
        return lambda: None
    import triton

    @triton.jit
    def nothing(x_ptr):
        pass

    flag = torch.zeros(1, device=device)
    return lambda: nothing[(1,)](flag)


def _time(launch, device, launches: int, replays: int) -> float:
    """Microseconds per launch: `launches` captured in one CUDA graph, replayed `replays` times."""
    launch()  # compiles (Triton) before any capture
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(launches * replays):
            launch()
        return 1e6 * (time.perf_counter() - started) / (launches * replays)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            launch()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (launches * replays)
