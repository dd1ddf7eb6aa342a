"""Everything that depends on vLLM's internals and versions (CPU 0.27.1, GPU 0.26.0) lives here."""
from vllm.forward_context import get_forward_context, is_forward_context_available

_model_runner = None


def bind_model_runner(llm) -> object:
    """Find the in-process model runner of an `LLM` (needs VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    global _model_runner
    try:
        core = llm.llm_engine.engine_core.engine_core
    except AttributeError as e:
        raise RuntimeError(
            "xmix-lens needs vLLM's in-process engine: set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            "before vLLM is imported (xmix_lens sets it on import unless you set it yourself)") from e
    _model_runner = core.model_executor.driver_worker.worker.model_runner
    return _model_runner


def model_of(llm):
    return bind_model_runner(llm).model if _model_runner is None else _model_runner.model


def step_requests() -> tuple[list[str], list[int]]:
    """The request ids of the running step, in token order, and their token offsets [n + 1]."""
    if _model_runner is None or not is_forward_context_available():
        return [], []
    metadata = get_forward_context().attn_metadata
    if not metadata:
        return [], []
    any_layer = next(iter(metadata.values())) if isinstance(metadata, dict) else next(iter(metadata[0].values()))
    query_start = any_layer.query_start_loc.tolist()
    n_requests = len(query_start) - 1
    return list(_model_runner.input_batch.req_ids[:n_requests]), query_start
