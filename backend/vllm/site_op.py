"""The custom ops every hook site calls: `torch.ops.xmix.site(x, site_id)`; for a hook point that
is a column slice of a layer's output, `torch.ops.xmix.site_cols(x, site_id, start, end)`; for a
residual hook point after vLLM's fused add + RMSNorm, `torch.ops.xmix.residual_site(x, out, weight,
eps, site_id)`: its writes make the norm's output `out` again on the rows they change, in their own
launches (sites.py, kernels/rms_norm_rows.py).

All are declared as mutating what they write, with a fake impl, so torch.compile keeps them in the graph as
opaque calls (and CUDA-graph capture records the kernels they launch) instead of tracing into them.
Their body hands `x` (or its columns [start, end)) to the site runtime of the engine whose forward
is running, which applies the programs armed at that site this step. That runtime is found in
vLLM's forward context, where the model registered it as vLLM's own layers register themselves
(`register_site_runtime`, `running_site_runtime`): several engines in one process each reach their own.

Why `site_cols` takes the whole tensor and not the slice: vLLM compiles with auto-functionalization
v1 (`enable_auto_functionalized_v2 = False`), and under v1 Inductor mis-compiles two custom ops
mutating two views of one base (the second write is lost or reads stale memory; q, k, v slices of
one qkv output are exactly that). A mutation of the whole tensor is functionalized like any other
site; the slice is taken inside the op, on real tensors.
"""
import torch
from vllm.forward_context import get_forward_context, is_forward_context_available

from xmix_lens.kernels import Renorm

# Where a model's site runtime is registered in vLLM's static forward context (the dict vLLM's
# attention layers register themselves in, read back through the forward context while a forward runs).
SITE_RUNTIME = "xmix_lens.site_runtime"


def register_site_runtime(vllm_config, runtime) -> None:
    vllm_config.compilation_config.static_forward_context[SITE_RUNTIME] = runtime


def running_site_runtime():
    """The site runtime of the engine whose forward is running, or None outside a forward."""
    if not is_forward_context_available():
        return None
    return get_forward_context().no_compile_layers.get(SITE_RUNTIME)


@torch.library.custom_op("xmix::site", mutates_args=("x",))
def site(x: torch.Tensor, site_id: int) -> None:
    runtime = running_site_runtime()
    if runtime is not None:
        runtime.run_site(x, site_id)


@site.register_fake
def _site_fake(x: torch.Tensor, site_id: int) -> None:
    return None


@torch.library.custom_op("xmix::site_cols", mutates_args=("x",))
def site_cols(x: torch.Tensor, site_id: int, start: int, end: int) -> None:
    runtime = running_site_runtime()
    if runtime is not None:
        runtime.run_site(x[..., start:end], site_id)


@site_cols.register_fake
def _site_cols_fake(x: torch.Tensor, site_id: int, start: int, end: int) -> None:
    return None


@torch.library.custom_op("xmix::residual_site", mutates_args=("x", "out"))
def residual_site(x: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, eps: float, site_id: int) -> None:
    runtime = running_site_runtime()
    if runtime is not None:
        runtime.run_site(x, site_id, Renorm(weight, eps, out))


@residual_site.register_fake
def _residual_site_fake(x: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, eps: float, site_id: int) -> None:
    return None
