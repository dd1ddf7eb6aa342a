"""vLLM model classes with hook sites: subclasses registered over vLLM's own architectures.

Each subclass builds vLLM's model unchanged, then installs the armed sites (see sites.py) and
tells the site runtime where each token of a step belongs before the forward runs. Which sites
are armed comes from the engine's `additional_config={"xmix_lens": {"armed": [...] | "all"}}`;
with no such entry nothing is armed and the model runs as vLLM's own.
"""
import torch
from vllm.model_executor.models.gpt2 import GPT2LMHeadModel
from vllm.model_executor.models.llama import LlamaForCausalLM

from .runtime import SiteRuntime
from .sites import install_sites, site_names


def _xmix_config(vllm_config) -> dict:
    extra = vllm_config.additional_config or {}
    return extra.get("xmix_lens", {}) if isinstance(extra, dict) else {}


def armed_sites(vllm_config, family: str, n_layers: int) -> set[str]:
    armed = _xmix_config(vllm_config).get("armed", [])
    every = site_names(family, n_layers)
    return set(every) if armed == "all" else set(armed) & set(every)


def _max_step_tokens(vllm_config) -> int:
    """The most tokens one forward can hold: a scheduled step, or a padded CUDA-graph batch."""
    captured = vllm_config.compilation_config.cudagraph_capture_sizes or [0]
    return max(vllm_config.scheduler_config.max_num_batched_tokens, max(captured))


class _Instrumented:
    family: str

    def _install(self, vllm_config) -> None:
        n_layers = vllm_config.model_config.hf_config.num_hidden_layers
        armed = armed_sites(vllm_config, self.family, n_layers)
        names = install_sites(self, self.family, n_layers, armed)
        self.xmix_runtime = SiteRuntime(self.family, names, armed, torch.device(vllm_config.device_config.device),
                                        _max_step_tokens(vllm_config), _xmix_config(vllm_config).get("apps_key"))

    def forward(self, input_ids, positions, *args, **kwargs):
        self.xmix_runtime.begin_step(positions)
        return super().forward(input_ids, positions, *args, **kwargs)


class XmixLlamaForCausalLM(_Instrumented, LlamaForCausalLM):
    family = "llama"

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._install(vllm_config)


class XmixGPT2LMHeadModel(_Instrumented, GPT2LMHeadModel):
    family = "gpt2"

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._install(vllm_config)


