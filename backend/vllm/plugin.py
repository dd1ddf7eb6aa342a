"""The `vllm.general_plugins` entry point: runs in every vLLM process before a model is built."""


def register() -> None:
    from vllm import ModelRegistry

    # a plain dict, not imported from instrumented.py: that module imports vLLM's model code, which
    # must not happen this early in every vLLM process; the registry imports it lazily.
    for arch, cls in {
        "LlamaForCausalLM": "xmix_lens.backend.vllm.instrumented:XmixLlamaForCausalLM",
        "GPT2LMHeadModel": "xmix_lens.backend.vllm.instrumented:XmixGPT2LMHeadModel",
    }.items():
        ModelRegistry.register_model(arch, cls)
