"""The one custom op every hook site calls: `torch.ops.xmix.site(x, site_id)`.

It is declared as mutating `x`, with a fake impl, so torch.compile keeps it in the graph as an
opaque call (and CUDA-graph capture records the kernels it launches) instead of tracing into it.
Its body hands `x` to the site runtime, which applies the programs armed at that site this step.
"""
import torch

from . import runtime


@torch.library.custom_op("xmix::site", mutates_args=("x",))
def site(x: torch.Tensor, site_id: int) -> None:
    runtime.run_active_site(x, site_id)


@site.register_fake
def _site_fake(x: torch.Tensor, site_id: int) -> None:
    return None
