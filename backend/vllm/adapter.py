"""Everything that depends on vLLM's internals and versions (CPU 0.27.1, GPU 0.26.0) lives here."""
from vllm.forward_context import get_forward_context, is_forward_context_available


def model_runner(llm):
    """The in-process model runner of an `LLM` (needs VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    try:
        core = llm.llm_engine.engine_core.engine_core
    except AttributeError as e:
        raise RuntimeError(
            "xmix-lens needs vLLM's in-process engine: set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            "before vLLM is imported (importing xmix_lens first sets it)") from e
    runner = core.model_executor.driver_worker.worker.model_runner
    if not hasattr(runner, "input_batch") and not hasattr(runner, "xmix_input_batch"):
        # vLLM's newer GPU runner (0.26) builds each step's batch in a local variable: keep the
        # latest one where the site runtime can read the step's request order
        prepare = runner.prepare_inputs

        def prepare_and_keep(*args, **kwargs):
            runner.xmix_input_batch = batch = prepare(*args, **kwargs)
            return batch

        runner.xmix_input_batch = None
        runner.prepare_inputs = prepare_and_keep
    return runner


def step_requests(runner) -> tuple[list[str], list[int]]:
    """The request ids of the running step, in token order, and their token offsets [n + 1]."""
    if runner is None or not is_forward_context_available():
        return [], []
    batch = getattr(runner, "xmix_input_batch", None)
    if batch is not None:  # vLLM 0.26's GPU runner
        n = batch.num_reqs
        return list(batch.req_ids[:n]), batch.query_start_loc_np[: n + 1].tolist()
    metadata = get_forward_context().attn_metadata
    if not metadata:
        return [], []
    per_layer = metadata if isinstance(metadata, dict) else metadata[0]
    query_start = next(iter(per_layer.values())).query_start_loc.tolist()
    return list(runner.input_batch.req_ids[: len(query_start) - 1]), query_start
