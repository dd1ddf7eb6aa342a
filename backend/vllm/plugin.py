"""The `vllm.general_plugins` entry point: runs in every vLLM process before a model is built."""


def register() -> None:
    from vllm import ModelRegistry

    from ...families import ARCHITECTURES

    # by name, not by class: instrumented.py imports vLLM's model code, which must not happen this early
    # in every vLLM process; the registry imports it lazily.
    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, f"xmix_lens.backend.vllm.instrumented:Xmix{arch}")
