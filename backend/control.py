"""The graph-safe control plane: resident ops, gated per token through fixed-address buffers.

An app installed in an engine becomes *resident*: its lowered ops stay at their sites for the
life of the engine, with their tensors at fixed device addresses. At a site, every resident op is
launched over all of the step's tokens, every step, with the same arguments:

    rows  = control[app, ROWS, :T]    token t, or -1 where the op leaves the token alone
    table = control[app, TABLE, :T]   the token's request's slot in the app's per-request tables (0: defaults)
    put   = control[app, PUT, :T]     its slot where the token is one of its request's prompt, else 0

Both follow from the requests' choice of the app alone, so every op of an app reads its app's
control row: an app takes one row however many ops it has (directional ablation on an 80-layer
model has 161), and the rows are the apps' bits in a request's uint64 mask.

and a read writes token t's value into row t of its `step_values`.

So a CUDA graph captured with the op in it replays correctly whatever requests, apps and
parameters a later step has: between steps the host only writes buffers.
  - choosing a request's apps (`select`) and activating or deactivating an app: the host's
    per-request app sets, turned into `control` rows before each step (one host-to-device copy);
  - new parameters (`set_params`): copied into the op's tensors in place;
  - a request's own values of an app's request params (app configs: `xmix.<app>.<param>`): an op
    whose bias or program consts move with them holds them as a table, row 0 the defaults, and a
    request with values gets a row of its own (its slot) while it runs: bias = default +
    (value - default) * slope, written when the request is selected.
  - a prompt-level store (`store.put(key, v, reduce="mean" | "sum")`, then `store.get(key)` at the same
    or a later hook point, on the prompt and on every generated token): per app and store, device
    tables of a row per request slot. A put launch adds its prompt tokens' values into their
    request's row (`put`; other tokens into row 0, cleared after) and makes the row's value (the
    mean: the sum over the count); a get is a program's table of those values, read at the
    token's slot (`table`). A request's row is cleared in the step that computes its position 0,
    so that a recomputed (preempted) request counts each position once. As the per-call path, a
    prompt split over chunked-prefill steps sees, in its first chunks, the mean so far.
Nothing is recaptured, restarted or drained for any of these.

Reads (the messenger, messenger.py): a read op writes each live token's value into its
`step_values`, in the model's dtype: its columns of a read area, which the read ops installed
before graph capture share. When the next step is prepared, the host queues one copy home per
area of the finished step's rows, and each op's columns move into its read log (host memory per
read op, in the same dtype) a few steps later, each row tagged with its request's number and its
position (known on the host: vLLM computes the device's positions from each request's computed
tokens, which it keeps there too). One buffer is enough: that copy is queued on the stream before
the next step's forward, which overwrites it. A request's values are gathered from the log once,
when they are taken (`take_results`). A position computed twice (preemption recomputes a
request; chunked prefill never does) keeps its latest value: nothing is lost or duplicated.
Device memory, per engine: control MAX_RESIDENT_APPS x CONTROL_KINDS x max_tokens int32, and per read op
max_tokens x width in the model's dtype (its step values).

Most decode steps have the rows of the step before (the same requests, choices and token counts):
then nothing is staged or copied, and the host's work is the reads' copies home.

An op installed after the engine captured its CUDA graphs is not in them. Its launches run only in
steps the engine runs without graphs: requests that select such an app make their steps eager
(`needs_eager_steps`), which is correct and reported, never a silently dropped hook.
"""
import hashlib
import time
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import torch

from xmix_lens.kernels import Renorm
from xmix_lens.lowered import LoweredOp, TokenProgram, named_tensors, op_digest, to_device

from .executor import Executor
from . import cudart
from .messenger import NOBODY, HomeCopies, ReadArea, owners_range
from .sharding import Placed, on_site

MAX_RESIDENT_APPS = 64  # control rows, one an app: its bit in a request's uint64 mask
STAGING_BUFFERS = 2  # so that a copy still in flight is never overwritten by the next step's staging
ROWS, TABLE, PUT = 0, 1, 2
CONTROL_KINDS = 3  # rows a control row holds per token: ROWS, TABLE and PUT
REDUCTIONS = ("mean", "sum")  # what a resident store folds its prompt's values with


class ResidentCapacityError(ValueError):
    """No control row left for an app."""


@dataclass
class ResidentOp:
    app: str
    site: int
    index: int  # its app's row of the control buffer
    op: LoweredOp
    step_values: torch.Tensor | None = None  # reads: the step's values, [max_tokens, width] (row t: token t)
    area: ReadArea | None = None  # reads: the device buffer whose `columns` are its step values
    columns: slice | None = None
    area_op: int = -1  # reads: its number among the area's ops (its tags in the area's log)
    captured: bool = False  # launched while a CUDA graph was being captured
    compiled: bool = False  # its kernel compiled at every launch configuration (ControlPlane._compile_ahead)
    retired: bool = False  # its app was uninstalled; kept only because a captured graph launches it
    placed: Placed | None = None  # at a sharded site of a TP engine: how this rank runs it
    tables: dict = field(default_factory=dict)  # field ("bias", "consts[i]") -> [slots, ...]: row 0 the default
    store: "ResidentStore | None" = None  # a put: the store its values fold into (step_values: its scratch)
    indexed: bool = False  # whether it reads its app's per-request table rows (request values, or a store's)

    @property
    def reads_home(self) -> bool:
        """A read whose values this rank keeps in its area's log (TP: rank 0's)."""
        return self.area is not None and self.area.log is not None


@dataclass
class ResidentStore:
    """A prompt-level store of a resident app: per request slot (row 0: trash), the sum of its
    prompt's values, their count and the value gets read (`values`: the mean, or the sum itself)."""

    reduce: str
    sums: torch.Tensor  # [slots, O] float32
    counts: torch.Tensor  # [slots] float32
    values: torch.Tensor  # [slots, O] float32: what a get's table reads
    divisors: torch.Tensor  # [slots] float32: counts, at least 1 (made in place: a launch allocates nothing)
    ones: torch.Tensor  # [max_tokens] float32: a token's count

    @classmethod
    def make(cls, reduce: str, width: int, slots: int, max_tokens: int, device) -> "ResidentStore":
        sums = torch.zeros(slots, width, dtype=torch.float32, device=device)
        counts = torch.zeros(slots, dtype=torch.float32, device=device)
        values = sums if reduce == "sum" else torch.zeros_like(sums)
        return cls(reduce, sums, counts, values, torch.ones_like(counts),
                   torch.ones(max_tokens, dtype=torch.float32, device=device))

    def fold(self, step_values: torch.Tensor, put: torch.Tensor) -> None:
        """The step's prompt tokens' values into their requests' rows (`put`: each token's slot, 0
        where it adds nothing), and the rows' values made again."""
        self.sums.index_add_(0, put, step_values)
        self.counts.index_add_(0, put, self.ones[: put.shape[0]])
        self.sums[0].zero_()
        self.counts[0].zero_()
        if self.reduce == "mean":
            torch.clamp(self.counts, min=1.0, out=self.divisors)
            torch.div(self.sums, self.divisors[:, None], out=self.values)

    def clear(self, slots: torch.Tensor) -> None:
        for t in (self.sums, self.counts, self.values):
            t.index_fill_(0, slots, 0.0)


@dataclass(frozen=True)
class AppInfo:
    """What the driver needs of an installed app (and can be sent back from a TP engine's workers)."""

    name: str
    digest: bytes  # of what its ops do now: the prefix-cache salt of requests that select it
    reads: bool  # whether it reads: its requests must compute every position (no prefix-cache reuse)
    version: int

    @classmethod
    def of_ranks(cls, infos: list["AppInfo"]) -> "AppInfo":
        """One app's info from every rank of an engine, as one: tensor-parallel ranks answer alike;
        pipeline stages each hold the app's ops at their own hook points (each has its digest)."""
        distinct = list(dict.fromkeys(infos))
        if len(distinct) == 1:
            return distinct[0]
        digest = hashlib.sha256(b"".join(info.digest for info in distinct)).digest()
        return cls(distinct[0].name, digest, any(info.reads for info in distinct), distinct[0].version)


@dataclass
class ResidentApp:
    name: str
    ops: list[ResidentOp]
    row: int  # its control row, which all its ops read; also its bit in the requests' masks
    stores: dict = field(default_factory=dict)  # name -> ResidentStore: its prompt-level stores
    version: int = 0
    digest: bytes = b""  # of what its ops do now: the prefix-cache salt of requests that select it
    params: dict = field(default_factory=dict)  # request params: name -> (default, lowest, highest)

    def refresh_digest(self) -> None:
        h = hashlib.sha256()
        for entry in self.ops:
            h.update(op_digest(entry.op))
        self.digest = h.digest()

    def info(self) -> AppInfo:
        return AppInfo(self.name, self.digest, any(op.step_values is not None for op in self.ops), self.version)


class _Choices(NamedTuple):
    """A step's requests' choices, made once and reused while neither they nor their requests change."""

    version: int  # the plane's choices version they were made at
    req_ids: list
    bits: np.ndarray  # [requests] uint64: each request's active apps (bit i: the i-th installed app)
    any_on: bool  # whether any request has an active app
    numbers: np.ndarray | None  # [requests]: each request's number in the read logs
    serial: int  # one per _Choices made: equal serials, equal choices
    kept: tuple | None = None  # ([requests], [requests]) int64: the positions [first, end) whose reads go home; None: all


@dataclass
class _Step:
    """A prepared step whose reads are not queued home yet."""

    reads: list  # [(area, owner [tokens, area's ops], owner's range)]: ControlPlane._read_plan's of the step
    positions: np.ndarray  # [tokens] int64: each token's position in its request


@dataclass
class HostTime:
    """The control plane's host time in prepare_step (bench fields): wall time and this thread's CPU
    time (their difference is time waited: for the GIL held by another thread, for the device, for
    the OS); the wall time of steps holding a prefill (prepared before their forward: in TTFT where
    the GPU waits for them). And for decode steps alone (a token a request: most of a generation's steps, those
    whose host time a host-bound engine shows in its ITL; a prefill step's is prepared beside a
    forward tens to hundreds of times longer): their wall time, their slowest, the part spent
    queueing the step before's reads home (the copies' CUDA calls, the moves on the host that the
    last launch left), and how many were launched while the GPU was still busy with the work queued
    before them: with vLLM's async scheduling the host prepares a step while the GPU runs the one
    before, and a step queued before the GPU ran out of work left it no gap, so the host time before
    its launch, ours included, was hidden (`ControlPlane.launched`; on a GPU only, and only where
    `check_launches`: an event query a step, which a serving engine need not make). And the time
    after each launch, moving read logs' landed rows beside the GPU (`after_launch`)."""

    check_launches: bool = False

    wall: float = 0.0
    cpu: float = 0.0
    steps: int = 0
    decode_wall: float = 0.0
    decode_steps: int = 0
    decode_max: float = 0.0  # the slowest decode step's (a step late in the host shows in P99 ITL)
    decode_max_at: float = 0.0  # when it ended (perf_counter): which of the run's steps it was
    decode_home: float = 0.0  # of decode steps' wall time, queueing the step before's reads home
    decode_launches: int = 0  # decode steps whose launch was checked (a GPU, reads queued home)
    decode_launches_gpu_busy: int = 0  # of those, launched with the GPU still busy
    after_launch: float = 0.0  # in launched(): the read logs' moves made beside the GPU (ReadArea.move_ahead)

    def add(self, wall: float, cpu: float, decode: bool, home: float = 0.0) -> None:
        self.wall += wall
        self.cpu += cpu
        self.steps += 1
        if decode:
            self.decode_wall += wall
            self.decode_steps += 1
            if wall > self.decode_max:
                self.decode_max, self.decode_max_at = wall, time.perf_counter()
            self.decode_home += home

    def launched(self, gpu_busy: bool) -> None:
        self.decode_launches += 1
        self.decode_launches_gpu_busy += gpu_busy

    def ms_per_step(self) -> dict:
        decode_steps = max(self.decode_steps, 1)
        launches = self.decode_launches
        prefill_steps = self.steps - self.decode_steps  # steps holding a prefill (or a chunk of one)
        return {"host_ms_per_step": 1e3 * self.wall / max(self.steps, 1),
                "host_cpu_ms_per_step": 1e3 * self.cpu / max(self.steps, 1),
                "host_ms_per_prefill_step": (1e3 * (self.wall - self.decode_wall) / prefill_steps
                                             if prefill_steps else None),
                "host_ms_per_decode_step": 1e3 * self.decode_wall / decode_steps,
                "host_ms_max_decode_step": 1e3 * self.decode_max,
                "host_ms_home_per_decode_step": 1e3 * self.decode_home / decode_steps,
                "decode_launched_gpu_busy": self.decode_launches_gpu_busy / launches if launches else None,
                "host_ms_after_launch_per_step": 1e3 * self.after_launch / max(self.steps, 1)}


@dataclass
class _Layout:
    """The resident ops as arrays, for preparing a step in a few numpy operations whatever their
    number (made again after an install or an uninstall)."""

    rows: np.ndarray | slice  # the installed apps' control rows ([n] int64; a slice where consecutive)
    shifts: np.ndarray  # [n, 1] uint64: each app's bit (its row)
    reads: np.ndarray  # per op with a read log: its app's position in `rows`
    read_ops: list  # those ops
    table_apps: list  # apps with per-request table rows: an op's request-value tables, or stores
    store_apps: list  # apps with prompt-level stores
    store_bits: int  # their bits
    at: dict  # app name -> its position in `rows`


@dataclass
class ControlPlane:
    device: torch.device
    max_tokens: int
    apps: dict[str, ResidentApp] = field(default_factory=dict)
    # control row -> its app; None where an app was uninstalled (the row is free again), unless a
    # CUDA graph captured one of its ops: then the retired app keeps the row, never written again
    rows: list[ResidentApp | None] = field(default_factory=list)
    by_site: dict[int, list[ResidentOp]] = field(default_factory=dict)
    selected: dict[str, frozenset] = field(default_factory=dict)  # vLLM request id -> its apps
    defaults: frozenset = frozenset()  # the apps of requests that chose none (e.g. sent to vLLM directly)
    comm: object = None  # a TP engine's collectives (sharding.TPCollectives), for ops placed as a gather
    delivers: bool = True  # whether this rank sends reads home (TP: rank 0 only)
    max_requests: int = 256  # requests running at once (vLLM's max_num_seqs): table rows besides the defaults
    read_dtype: torch.dtype = torch.float32  # reads' values on the device and in the logs: the model's dtype
    capturing_late: bool = False  # graphs of apps installed late are being captured (adapter.LateAppGraphs)

    def __post_init__(self):
        pin = self.device.type == "cuda"
        # its own executor: launches whose arguments are all fixed-address buffers
        self.executor = Executor(self.device, self.max_tokens)
        self.control = torch.full((MAX_RESIDENT_APPS, CONTROL_KINDS, self.max_tokens), -1, dtype=torch.int32,
                                  device=self.device)
        self.control[:, TABLE:] = 0
        self._tokens = torch.arange(self.max_tokens, dtype=torch.int32, device=self.device)  # a read's row per token
        self._gated_off = torch.full((self.max_tokens,), -1, dtype=torch.int32, device=self.device)  # rows no op runs on
        # A step's rows are staged on the host as one contiguous [apps, kinds, width] block at the front of
        # a flat pinned buffer, copied into `control[:apps, :, :width]` by one runtime call
        # (`_row_copier`). Staging buffers take turns (device="cpu" explicitly: vLLM builds the model
        # under a default-device context).
        # They are written through numpy views: with torch ops on these host tensors (which may hand
        # large fills to torch's intra-op threads) a prefill step's preparation took 44 ms in the
        # engine on the H200 under the profiler, 3.3 ms through numpy (prefill_step_kernels at 256
        # requests: bench/results/2026-12-02-gpu-bench-reads-in-model-dtype.json, ...-numpy-staging.json).
        self._staging = [torch.empty(MAX_RESIDENT_APPS * CONTROL_KINDS * self.max_tokens, dtype=torch.int32, device="cpu",
                                     pin_memory=pin) for _ in range(STAGING_BUFFERS)]
        self._staging_np = [buffer.numpy() for buffer in self._staging]
        self._staged_count = 0
        # made once and recorded again each time (no object per step)
        self._staged_events = [cudart.Event() for _ in range(STAGING_BUFFERS)] if pin else None
        # per staging buffer, the (rows, width, tokens) and layout of the step it last held
        self._staged_shape: list[tuple | None] = [None] * STAGING_BUFFERS
        self._staged_layout: list[_Layout | None] = [None] * STAGING_BUFFERS
        # per staging buffer, ((rows, width), its copy to `control`), kept: each torch call, a slice
        # too, lets go of the GIL (see ReadLog)
        self._row_copies: list[tuple] = [((0, 0), None)] * STAGING_BUFFERS
        self._in_control: tuple | None = None  # what the rows in `control` were made from (_prepare's key)
        # the areas with a read op on in those rows: [(area, owner [tokens, area's ops]: each token's
        # request number per op, -1 where the op is off)] (held: an uninstall before the copy home frees rows)
        self._read_plan: list = []
        self._areas: list[ReadArea] = []  # the last takes the read ops installed until a graph captures one
        self._copies_home = HomeCopies(pin)  # the read logs' copies home, and their event
        self._unqueued: _Step | None = None  # the prepared step whose reads are not queued home yet
        self._pin = pin
        self._number: dict[str, int] = {}  # request id -> its number in the read logs
        self._next_number = 0
        self._layout: _Layout | None = None
        # the last step's requests and their masks and numbers, reused while neither changes
        self._choices_version = 0
        self._selected_sites: tuple | None = None  # (choices version, *selected_sites())
        self._last_choices: _Choices | None = None
        self._choices_made = 0
        self.host_time = HostTime()  # in prepare_step (bench fields)
        self._launch_mark: int | None = None  # the prepared decode step's mark, until its launch
        self._bit: dict[str, int] = {}  # app name -> its bit in the per-request masks
        self._request_bits: dict[str, int] = {}  # request id -> the bits of its selected apps
        self._default_bits = 0
        self._idle = True  # the device rows are all -1
        self._free_slots = list(range(1, self.max_requests + 1))  # table rows for requests' own values
        self._slot: dict[str, tuple[int, frozenset]] = {}  # request id -> (its table row, apps that use it)
        self._prompt_len: dict[str, int] = {}  # request id -> its prompt's length (for prompt-level stores)
        self._reads_kept: dict[str, tuple[int, int]] = {}  # request id -> the positions [first, end) its reads keep
        self._kept_computed: set[str] = set()  # requests whose kept positions have all been in a prepared step

    @property
    def ops(self) -> list[ResidentOp]:
        """Every op at a site: installed apps' and, kept for captured graphs, retired ones."""
        return [op for app in self.rows if app is not None for op in app.ops]

    # --- installing and choosing (between steps) --------------------------------------------------
    def install(self, name: str, ops_by_site: dict[int, list[LoweredOp]], params: dict | None = None) -> ResidentApp:
        if name in self.apps:
            raise ValueError(f"an app named {name!r} is installed already; uninstall it or choose another name")
        free = [i for i, app in enumerate(self.rows) if app is None] + list(range(len(self.rows), MAX_RESIDENT_APPS))
        if not free:
            held = sum(self.apps.get(app.name) is not app for app in self.rows)
            raise ResidentCapacityError(
                f"installing {name!r} needs a control row; this engine's {MAX_RESIDENT_APPS} control rows (one an app) "
                f"are taken ({held} held by uninstalled apps that CUDA graphs captured). Uninstall apps you no longer "
                "use, or build a new engine (from_pretrained) for more")
        check_resident(name, ops_by_site)  # every op checked before any is installed
        row = free[0]
        stores = {op.store.name: ResidentStore.make(op.store.reduce, _read_width(op), self.max_requests + 1,
                                                    self.max_tokens, self.device)
                  for ops in ops_by_site.values() for op, _ in map(_unplaced, ops) if getattr(op, "store", None)}
        resident, reads = [], []
        for site, ops in ops_by_site.items():
            for op in ops:
                op, placed = _unplaced(op)
                if stores and placed is not None:
                    raise ValueError(f"app {name!r}: prompt-level stores on a tensor-parallel engine are not "
                                     "supported; serve it with tensor_parallel_size 1")
                if getattr(op, "W", None) is not None and op.bias is None:  # a projection read without bias
                    op = replace(op, bias=torch.zeros(op.W.shape[1]))  # allocated once, not per launch
                op, tables = self._with_tables(name, _bound_to(to_device(op, self.device), stores), placed)
                entry = ResidentOp(name, site, row, op, placed=placed, tables=tables,
                                   indexed=bool(tables or _store_tables(op)))
                if getattr(op, "store", None) is not None:  # a put: its values fold into the store
                    entry.store = stores[op.store.name]
                    entry.step_values = torch.zeros(self.max_tokens, _read_width(op), dtype=torch.float32,
                                                    device=self.device)
                elif not op.writes:
                    reads.append(entry)
                self.by_site.setdefault(site, []).append(entry)
                resident.append(entry)
        if reads:
            self._place_reads(reads)
        app = self.apps[name] = ResidentApp(name, resident, row, stores, params=dict(params or {}))
        app.refresh_digest()
        self.rows += [None] * (row + 1 - len(self.rows))
        self.rows[row] = app
        self._bit[name] = row
        self._layout = None
        self._choices_version += 1  # the cached masks may lack read-log numbers the new app needs
        return app

    def _place_reads(self, reads: list[ResidentOp]) -> None:
        """New read ops' step values: columns of the last area, made again wider while no CUDA graph
        has captured an op of it (its ops get new views; their rows so far go home first and move
        into the new area's log), else of a new area (a captured graph writes to the last one's
        addresses)."""
        last = self._areas[-1] if self._areas else None
        kept = []
        if last is not None and not any(o.captured for o in self.ops if o.area is last):
            self.drain()
            kept = [o for o in self.ops if o.area is last]
            self._areas.pop()
        area = ReadArea([_read_width(o.op) for o in kept + reads], self.max_tokens, self.read_dtype, self.device,
                        self._copies_home if self.delivers else None, self._alive_numbers)
        if kept and area.log is not None:
            area.log.absorb(last.log, [(o.area_op, o.columns, i, area.columns[i]) for i, o in enumerate(kept)])
        for i, entry in enumerate(kept + reads):
            entry.area, entry.area_op, entry.columns = area, i, area.columns[i]
            entry.step_values = area.values[:, entry.columns]
        self._areas.append(area)

    def _with_tables(self, app: str, op: LoweredOp, placed) -> tuple[LoweredOp, dict]:
        """The op with each field its request params move held as a table [slots, ...] (row 0 the
        default), as its kind holds one (`with_param_tables`: a write's bias, a program's consts)."""
        fields = {f for by_field in op.slopes.values() for f in by_field} if hasattr(op, "slopes") else set()
        if not fields:
            return op, {}
        if placed is not None:
            raise ValueError(f"app {app!r}: request params at a hook point split over tensor-parallel ranks are not "
                             "supported; serve it with tensor_parallel_size 1")
        return op.with_param_tables(fields, self.max_requests + 1)

    def set_params(self, name: str, ops_by_site: dict[int, list[LoweredOp]]) -> int:
        """New tensors for an installed app's ops, copied in place: same structure, same addresses."""
        app = self._app(name)
        new = [_unplaced(op) for site in ops_by_site for op in ops_by_site[site]]
        if [(o.site, o.op.structure(), o.placed and o.placed.kind) for o in app.ops] != [
                (site, op.structure(), placed and placed.kind) for site in ops_by_site
                for op, placed in map(_unplaced, ops_by_site[site])]:
            raise ValueError(f"the new parameters of {name!r} change what its hooks do, not only their values; "
                             "install it as a new app instead")
        for entry, (op, _) in zip(app.ops, new):
            for old, value in zip(_tensors(entry.op), _tensors(op)):
                old.copy_(value)
        app.version += 1
        app.refresh_digest()
        return app.version

    def uninstall(self, name: str) -> None:
        """Remove an app; its control row (and bit) is free for later installs. If a CUDA graph
        captured one of its ops, that op keeps its launch (the graph replays it) and the app its row,
        gated off for good: no request can select it, and its row is never written again."""
        app = self.apps.pop(self._app(name).name)
        del self._bit[name]
        for op in app.ops:
            if op.captured:
                op.retired = True
            else:
                self.by_site[op.site].remove(op)
        captured = [op for op in app.ops if op.retired]
        self.rows[app.row] = ResidentApp(name, captured, app.row) if captured else None
        self.selected = {r: names - {name} for r, names in self.selected.items()}
        self.defaults -= {name}
        self._request_bits = {r: self._bits(names) for r, names in self.selected.items()}
        self._default_bits = self._bits(self.defaults)
        self._layout = None
        self._choices_version += 1

    def check_installed(self, names) -> None:
        for name in names:
            self._app(name)

    def select(self, req_id: str, names, values: dict | None = None, prompt_len: int | None = None,
               reads_kept: tuple[int, int] | None = None) -> None:
        """A request's apps; `values` {app: {param: value}}: its own values of their request params;
        `prompt_len`: its prompt's length, which apps with prompt-level stores need; `reads_kept`:
        the positions [first, end) whose reads go home (a served request that wants its prompt's end
        only: none of its decode steps' values is copied, logged or searched), None: every position."""
        self.check_installed(names)
        storing = {app for app in names if self.apps[app].stores}
        if storing and prompt_len is None:
            raise ValueError(f"apps {sorted(storing)} keep prompt-level stores: choosing them needs the request's "
                             "prompt length")
        self.selected[req_id] = frozenset(names)
        self._request_bits[req_id] = self._bits(names)
        self._numbered(req_id)
        self._choices_version += 1
        if prompt_len is not None:
            self._prompt_len[req_id] = prompt_len
        if reads_kept is None:
            self._reads_kept.pop(req_id, None)
        else:
            self._reads_kept[req_id] = reads_kept
        valued = {app: v for app, v in (values or {}).items() if app in names and v}
        if (valued or storing) and req_id not in self._slot:  # a row of its own in the apps' tables
            if not self._free_slots:
                raise RuntimeError(f"{self.max_requests} requests with their own app-param values or stores run "
                                   "already")
            slot = self._free_slots.pop()
            self._slot[req_id] = (slot, frozenset(valued) | storing)
            for app in set(valued) | storing:
                by_param, params = valued.get(app, {}), self.apps[app].params
                for entry in self.apps[app].ops:
                    for f, table in entry.tables.items():
                        row = table[0].clone()
                        for param, value in by_param.items():
                            slope = entry.op.slopes.get(param, {}).get(f)
                            if slope is not None:
                                row += (value - params[param][0]) * slope
                        table[slot].copy_(row)

    def release_values(self, req_id: str) -> None:
        """A request stops running: its table row is free (its choice may stay, for its reads)."""
        slot = self._slot.pop(req_id, None)
        self._prompt_len.pop(req_id, None)
        if slot is not None:
            self._free_slots.append(slot[0])
            self._choices_version += 1  # a step's table rows name it no more

    def set_defaults(self, names) -> None:
        self.check_installed(names)
        if storing := sorted(name for name in names if self.apps[name].stores):
            raise ValueError(f"apps {storing} keep prompt-level stores, which need each request's prompt length: "
                             "choose them per request (vllm_xargs, or apps= in a call), not as defaults")
        self.defaults = frozenset(names)
        self._default_bits = self._bits(names)
        self._choices_version += 1

    def forget(self, req_id: str) -> None:
        """A finished request: its choice and any reads not taken (its rows in the read logs are
        nobody's from now on, also those of its last steps still on their way home)."""
        self.selected.pop(req_id, None)
        self._request_bits.pop(req_id, None)
        self._number.pop(req_id, None)
        self._reads_kept.pop(req_id, None)
        self._kept_computed.discard(req_id)
        self.release_values(req_id)
        self._choices_version += 1

    def kept_computed(self, req_id: str) -> bool:
        """Whether a request that keeps some positions' reads only (`select(reads_kept=...)`) has had
        them all in prepared steps: once those steps' copies are home (`bring_home`), its reads are
        complete, though it may still run."""
        return req_id in self._kept_computed

    def read_by_default(self, req_id: str) -> bool:
        """Whether the reads of a request that chose no apps were kept (it ran the default apps)."""
        return req_id in self._number and req_id not in self.selected

    @property
    def read_chunks_made(self) -> int:
        """The host chunks the read logs of the areas in use have made (the logs' only allocations: a bench field)."""
        return sum(area.log.chunks_made for area in self._areas if area.log is not None)

    def take_results(self, req_ids: list[str]) -> list[dict]:
        """Per request, each read's values so far, by (app, read key): (positions [n], values
        [n, width]), sorted by position. The caller drains first (`drain`)."""
        numbers = [self._number.get(r) for r in req_ids]
        known = [n for n in numbers if n is not None]
        out = [{} for _ in req_ids]
        if not known:
            return out
        for op in self.ops:
            if not op.reads_home:
                continue
            taken = op.area.take(known, op.area_op)
            for results, number in zip(out, numbers):
                if number in taken:
                    results[(op.app, op.op.key)] = taken[number]
        return out

    def clear_reads(self) -> None:
        """Every read so far dropped (those of requests that no call collects, sent to vLLM directly)."""
        self.drain()
        for area in self._areas:
            if area.log is not None:
                area.log.clear()

    def _alive_numbers(self) -> np.ndarray:
        return np.fromiter(self._number.values(), dtype=np.int64, count=len(self._number))

    def _numbered(self, req_id: str) -> int:
        number = self._number.get(req_id)
        if number is None:
            number = self._number[req_id] = self._next_number
            self._next_number += 1
            self._choices_version += 1
        return number

    def _app(self, name: str) -> ResidentApp:
        if name not in self.apps:
            raise KeyError(f"no app named {name!r} is installed; installed: {sorted(self.apps)}")
        return self.apps[name]

    @property
    def needs_eager_steps(self) -> bool:
        """Whether a request in flight uses an op that no captured CUDA graph contains."""
        return self._selects({o.app for o in self.ops if not o.captured})

    def selected_sites(self) -> tuple[frozenset[int], frozenset[int]]:
        """The sites of the ops that a request in flight (or the defaults) selects, and those of
        them where a selected op writes (an op with step values reads)."""
        cached = self._selected_sites
        if cached is None or cached[0] != self._choices_version:
            chosen = self._default_bits
            for bits in self._request_bits.values():
                chosen |= bits
            selected = {site: [o for o in ops if not o.retired and chosen >> self._bit[o.app] & 1]
                        for site, ops in self.by_site.items()}
            cached = self._selected_sites = (
                self._choices_version, frozenset(site for site, ops in selected.items() if ops),
                frozenset(site for site, ops in selected.items() if any(o.step_values is None for o in ops)))
        return cached[1], cached[2]

    def late_apps(self) -> tuple[str, ...]:
        """The installed apps with an op that vLLM's own graphs do not hold (installed after them)."""
        return tuple(name for name, app in self.apps.items() if any(not o.captured for o in app.ops))

    def resident_sites(self) -> tuple[frozenset[int], frozenset[int]]:
        """The sites of every op in use (not retired), and those where one writes."""
        live = {site: [o for o in ops if not o.retired] for site, ops in self.by_site.items()}
        return (frozenset(site for site, ops in live.items() if ops),
                frozenset(site for site, ops in live.items() if any(o.step_values is None for o in ops)))

    def gate_off(self) -> None:
        """Every op off on every token, on the device (the next prepared step stages its rows anew):
        a capture's warm-up then launches them on no token."""
        self.control[:, ROWS] = -1
        self.control[:, TABLE:] = 0
        self._in_control, self._idle = None, True

    def _selects(self, apps: set[str]) -> bool:
        return bool(apps) and any(names & apps for names in [*self.selected.values(), self.defaults])

    # --- per step ---------------------------------------------------------------------------------
    def prepare_step(self, req_ids: list[str], query_start, n_tokens: int, first_positions,
                     n_padded: int | None = None) -> None:
        """Fill the control rows for the coming step and queue the previous step's reads home.
        `first_positions`: each request's position of its first token in the step, on the host
        (its computed tokens: vLLM's runners keep them there); the tokens after it follow in order."""
        if not self.ops:
            return
        started, cpu_started = time.perf_counter(), time.thread_time()
        marked = self._queue_home()
        queued = time.perf_counter()
        self._prepare(req_ids, query_start, n_tokens, first_positions, n_padded)
        decode = n_tokens == len(req_ids)
        self.host_time.add(time.perf_counter() - started, time.thread_time() - cpu_started,
                           decode=decode, home=queued - started)
        # the mark is queued behind the step before's work and ahead of this step's forward
        self._launch_mark = self._copies_home.marks - 1 if marked and decode and self.host_time.check_launches else None

    def launched(self) -> None:
        """After the engine queued the prepared step's forward: whether the GPU had not yet reached
        the step's mark, i.e. was still busy with the work before it (HostTime, a bench field). A
        lower bound of the steps launched with no gap: asked after the launch, not at it. Then the
        read logs' moves of the next step's landing slots, made now, beside the GPU (with vLLM's
        async scheduling the host next waits for the step before's output), not in the next
        step's preparation, before its launch (`ReadArea.move_ahead`; HostTime.after_launch)."""
        mark, self._launch_mark = self._launch_mark, None
        if mark is not None:
            busy = self._copies_home.pending(mark)
            if busy is not None:
                self.host_time.launched(busy)
        if self._areas:
            started = time.perf_counter()
            for area in self._areas:
                area.move_ahead()
            self.host_time.after_launch += time.perf_counter() - started

    def _prepare(self, req_ids, query_start, n_tokens, first_positions, n_padded) -> None:
        n = len(req_ids)
        query_start = np.asarray(query_start[: n + 1])
        layout = self._layout or self._make_layout()
        choices = self._choices(req_ids, need_numbers=len(layout.reads) > 0)
        if not choices.any_on and self._idle:
            return  # the device rows are all -1 already (up to max_tokens): nothing to write
        # a step with no app resets every row (idle steps after it skip the copy); others the step's
        width = max(n_padded or n_tokens, n_tokens) if choices.any_on else self.max_tokens
        # the rows follow from this (the same requests and choices, token counts and layout): in most
        # decode steps it is the step before's, whose rows `control` holds already
        key = (choices.serial, n_tokens, width, query_start.tobytes())
        positions = prompt = None
        if layout.store_bits and np.any(choices.bits & np.uint64(layout.store_bits)):
            # a store folds its prompt tokens: which tokens are, and its rows cleared at position 0
            positions = token_positions(first_positions, query_start, n, n_tokens)
            lengths = np.fromiter((self._prompt_len.get(r, 0) for r in req_ids), dtype=np.int64, count=n)
            prompt = positions < np.repeat(lengths, np.diff(query_start))
            key += (prompt.tobytes(),)
            self._clear_stores(layout, [r for r, first in zip(req_ids, first_positions[:n]) if first == 0])
        if self._in_control != key:
            self._stage(layout, query_start, n_tokens, width, choices.bits, choices.numbers, req_ids, prompt)
            self._in_control = key
        self._idle = not choices.any_on
        if not self._read_plan:
            return
        if positions is None:
            positions = token_positions(first_positions, query_start, n, n_tokens)
        reads = self._read_plan
        if choices.kept is not None:
            per_request = np.diff(query_start)
            reads = _kept_reads(self._read_plan, choices.kept, positions, per_request)
            # a request whose last kept position is in this step has all its kept reads once the step is done
            last = np.repeat(choices.kept[1] - 1, per_request)
            for i in np.unique(np.repeat(np.arange(n), per_request)[positions == last]):
                self._kept_computed.add(req_ids[i])
        self._unqueued = _Step(reads, positions) if reads else None

    def _clear_stores(self, layout, starting: list[str]) -> None:
        """The store rows of requests whose position 0 this step computes (new, or recomputed)."""
        slots = {}
        for r in starting:
            slot, apps = self._slot.get(r, (0, ()))
            for app in layout.store_apps:
                if app.name in apps:
                    slots.setdefault(app.name, []).append(slot)
        for app in layout.store_apps:
            if app.name in slots:
                index = torch.tensor(slots[app.name], dtype=torch.int64, device=self.device)
                for store in app.stores.values():
                    store.clear(index)

    def _stage(self, layout, query_start, n_tokens, width, request_bits, numbers, req_ids, prompt) -> None:
        """A step's rows into `control` (staged on the host, one copy to the device), and the read ops
        it runs with each of their tokens' request numbers. `prompt`: which tokens are of their
        request's prompt (None where no app with stores runs in the step)."""
        turn = self._staged_count % STAGING_BUFFERS
        self._staged_count += 1
        if self._pin:
            self._staged_events[turn].synchronize()  # its copy from two stagings ago is long done
        rows_used = len(self.rows)
        size = rows_used * CONTROL_KINDS * width
        staging = self._staging_np[turn][:size].reshape(rows_used, CONTROL_KINDS, width)
        shape = (rows_used, width, n_tokens)
        if self._staged_shape[turn] != shape or self._staged_layout[turn] is not layout:
            # what no step of this shape and layout writes below: -1 past the tokens and in rows of
            # no op, table rows 0 (kept between such steps: two fills less)
            staging[:, ROWS] = -1
            staging[:, TABLE:] = 0
            self._staged_shape[turn], self._staged_layout[turn] = shape, layout
        per_request = np.diff(query_start)
        tokens = np.arange(n_tokens, dtype=np.int32)
        # [apps, tokens]: whether the app runs on the token, from each request's bits repeated per
        # token (shifting the bits per token instead, a 4,096-token prefill step took 0.69 ms
        # against 0.52 on the CPU with cold caches, `bench/host_step.py`; a prefill step is prepared
        # before its forward, in its TTFT)
        on = np.repeat((request_bits[None, :] >> layout.shifts) & 1 == 1, per_request, axis=1)
        staging[layout.rows, ROWS, :n_tokens] = np.where(on, tokens, -1)
        for app in layout.table_apps:  # each token's table row: its request's own, else 0 (the defaults)
            if not self._slot:
                staging[app.row, TABLE:, :n_tokens] = 0
                continue
            own = np.repeat(np.fromiter((slot if app.name in apps else 0
                                         for slot, apps in (self._slot.get(r, (0, ())) for r in req_ids)),
                                        dtype=np.int32, count=len(req_ids)), per_request)
            staging[app.row, TABLE, :n_tokens] = own
            if app.stores:  # the prompt tokens of requests that run it fold into their rows
                staging[app.row, PUT, :n_tokens] = 0 if prompt is None else np.where(on[layout.at[app.name]] & prompt,
                                                                                     own, 0)
        # launches read rows [:T], T (x's tokens, padding included) <= width: the rest may be stale
        dims, copy = self._row_copies[turn]
        if dims != (rows_used, width):
            copy = self._row_copier(turn, rows_used, width)
            self._row_copies[turn] = ((rows_used, width), copy)
        copy()
        if self._pin:
            self._staged_events[turn].record()
        plan: dict[ReadArea, np.ndarray] = {}  # per area with an op on: each token's owner per op
        if len(layout.reads) and self.delivers:
            read_on = on[layout.reads]
            owners = np.where(read_on, np.repeat(numbers, per_request), -1)
            for op, op_on, owner in zip(layout.read_ops, read_on, owners):
                if op_on.any():
                    if op.area not in plan:
                        plan[op.area] = np.full((n_tokens, len(op.area.columns)), -1, dtype=np.int64)
                    plan[op.area][:, op.area_op] = owner
        self._read_plan = [(area, owner, owners_range(owner)) for area, owner in plan.items()]

    def _row_copier(self, turn: int, rows_used: int, width: int):
        """The copy of staging buffer `turn`'s [apps, kinds, width] block into `control[:apps, :, :width]`: on
        a GPU one runtime call, stream ordered and non-blocking (`cudart.copy_rows_to_device`; through
        torch it was two copies by way of a contiguous device buffer: 91-101 us of host time on the
        H200's host with cold caches, against 29-32 us, `bench/cuda_calls.py`); on the CPU numpy's
        (see ReadArea._copier)."""
        size = rows_used * CONTROL_KINDS * width
        target = self.control[:rows_used, :, :width]
        if not self._pin:
            source, target_np = self._staging_np[turn][:size].reshape(rows_used, CONTROL_KINDS, width), target.numpy()
            return lambda: np.copyto(target_np, source)
        return cudart.copy_rows_to_device(target, self._staging[turn][:size].view(rows_used, CONTROL_KINDS, width))

    def _make_layout(self) -> _Layout:
        self._in_control = None  # rows made for other ops
        apps = sorted(self.apps.values(), key=lambda app: app.row)  # a retired app's row stays -1: selected by nobody
        at = {app.name: i for i, app in enumerate(apps)}
        read_ops = [op for app in apps for op in app.ops if op.reads_home]
        indices = [app.row for app in apps]
        consecutive = indices == list(range(indices[0], indices[0] + len(indices))) if indices else False
        self._layout = _Layout(slice(indices[0], indices[-1] + 1) if consecutive
                               else np.array(indices, dtype=np.int64),
                               np.array(indices, dtype=np.uint64).reshape(-1, 1),
                               np.array([at[op.app] for op in read_ops], dtype=np.int64), read_ops,
                               [app for app in apps if app.stores or any(op.tables for op in app.ops)],
                               [app for app in apps if app.stores], sum(1 << app.row for app in apps if app.stores),
                               at)
        return self._layout

    def _choices(self, req_ids: list[str], need_numbers: bool) -> _Choices:
        """The last step's choices while its requests and their choices are the same (most decode
        steps), else made by plain dict lookups per request."""
        last = self._last_choices
        if last is not None and last.version == self._choices_version and last.req_ids == req_ids:
            return last
        chosen, default = self._request_bits, self._default_bits
        bits = np.fromiter((chosen.get(r, default) for r in req_ids), dtype=np.uint64, count=len(req_ids))
        numbers = self._request_numbers(req_ids) if need_numbers else None
        kept = None
        if need_numbers and self._reads_kept and not self._reads_kept.keys().isdisjoint(req_ids):
            everything = (0, np.iinfo(np.int64).max)
            first, end = np.array([self._reads_kept.get(r, everything) for r in req_ids], dtype=np.int64).reshape(-1, 2).T
            kept = (first, end)
        self._choices_made += 1
        self._last_choices = _Choices(self._choices_version, list(req_ids), bits, bool(bits.any()), numbers,
                                      self._choices_made, kept)
        return self._last_choices

    def _request_numbers(self, req_ids: list[str]) -> np.ndarray:
        """Each request's number in the read logs; requests that chose nothing get one while
        default apps are set (their reads are kept, for a later call that takes them)."""
        known = self._number
        numbers = np.fromiter((known.get(r, -1) for r in req_ids), dtype=np.int64, count=len(req_ids))
        if self.defaults:
            for i in np.flatnonzero(numbers < 0):
                numbers[i] = self._numbered(req_ids[i])
        return numbers

    def _bits(self, names) -> int:
        return sum(1 << self._bit[n] for n in names)

    def launch(self, x: torch.Tensor, site_id: int, renorm: Renorm | None = None) -> None:
        """The site's resident ops over all of x's tokens: the same launches every step. `renorm`:
        at a residual site, the norm's output that each write makes again on the rows it wrote."""
        ops = self.by_site.get(site_id)
        if not ops:
            return
        T = x.shape[0]
        if T > self.max_tokens:
            raise RuntimeError(f"a step of {T} tokens; the control plane holds {self.max_tokens}")
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        for entry in ops:
            entry.captured |= capturing and not self.capturing_late  # in vLLM's own graphs
            rows = self.control[entry.index, ROWS, :T]
            tables = self.control[entry.index, TABLE, :T] if entry.indexed else None
            with on_site(entry.placed, x, self.comm) as x_op:  # a gather plan: the whole row
                if not entry.compiled and not capturing:
                    self._compile_ahead(entry, x_op, renorm)
                if entry.step_values is None:
                    self.executor.run(entry.op, x_op, rows, tables, renorm=renorm)
                else:
                    self.executor.run(entry.op, x_op, rows, tables, out=entry.step_values, dest=self._tokens[:T])
            if entry.store is not None:
                entry.store.fold(entry.step_values[:T], self.control[entry.index, PUT, :T])

    def _compile_ahead(self, entry: ResidentOp, x: torch.Tensor, renorm: Renorm | None) -> None:
        """The op launched once at each launch configuration of its kernel, on rows all gated off
        (nothing read or written), at its first launch outside a CUDA-graph capture: for a served
        config, vLLM's profile run, before the server is ready. Triton compiles a kernel per
        configuration at its first launch, and each compiled while serving stalled the steps
        around it for hundreds of milliseconds (the seven apps on the H200: served TTFT 2x native's
        until every prefill size had come by)."""
        entry.compiled = True
        for R in self.executor.launch_row_counts(entry.op, x.shape[1], self.max_tokens):
            rows = self._gated_off[:R]
            tables = self.control[entry.index, TABLE, :R] if entry.indexed else None
            if entry.step_values is None:
                self.executor.run(entry.op, x, rows, tables, renorm=renorm)
            else:
                self.executor.run(entry.op, x, rows, tables, out=entry.step_values, dest=self._tokens[:R])

    # --- the messenger ----------------------------------------------------------------------------
    def _queue_home(self) -> bool:
        """Queue the copy home of the prepared step's reads, one per area (its forward is on the
        stream before anything that runs after it: stream ordered, the copy waits for it); whether
        there were any (then marked)."""
        step, self._unqueued = self._unqueued, None
        if step is None:
            return False
        for area, owner, owners in step.reads:
            area.queue(owner, step.positions, owners)
        self._copies_home.mark()
        return True

    def bring_home(self, req_ids: list[str]) -> list[bool]:
        """These requests' reads of the steps run so far into the read logs, as far as the device
        is past their copies, never waiting for it; per request, whether all its reads are home.
        A server asks for a request's reads once vLLM has returned its last token, so its steps'
        forwards, and in practice their copies, are done; a drain would wait for the newest
        step's forward too, and with vLLM's async scheduling a drain per finished request cost
        served steps their overlap with the GPU. A request whose rows are in a step still on the
        device (vLLM may schedule a request once more before it sees it has finished) is asked
        for again."""
        numbers = np.array([self._number.get(r, -1) for r in req_ids], dtype=np.int64)
        if not (numbers >= 0).any():
            return [True] * len(req_ids)
        step = self._unqueued
        if step is not None and any(np.isin(owner, numbers[numbers >= 0]).any() for _, owner, _ in step.reads):
            self._queue_home()  # stream ordered: its copy waits for its forward, done or not
        home = []
        for number in numbers:
            mine = np.array([number])
            home.append(number < 0 or all(area.bring_home(mine) for area in self._areas))
        return home

    def drain(self) -> None:
        """Every read of the steps run so far in the read logs (before results are taken)."""
        self._queue_home()
        self._copies_home.wait_all()
        for area in self._areas:
            area.settle()


def token_positions(first_positions, query_start: np.ndarray, n: int, n_tokens: int) -> np.ndarray:
    """Each token's position in its request: its request's first, plus its index past the request's start."""
    if n_tokens == n:  # a decode step: each request's one token (a copy: vLLM reuses its buffer)
        return np.array(first_positions[:n], dtype=np.int64)
    return np.repeat(np.asarray(first_positions[:n], dtype=np.int64) - query_start[:-1],
                     np.diff(query_start)) + np.arange(n_tokens, dtype=np.int64)


def _kept_reads(plan: list, kept: tuple, positions: np.ndarray, per_request: np.ndarray) -> list:
    """A step's read plan less the tokens at positions their requests keep no reads of (owner -1);
    an area left with no owned token is left out (nothing of it goes home this step)."""
    first, end = kept
    inside = (positions >= np.repeat(first, per_request)) & (positions < np.repeat(end, per_request))
    if inside.all():
        return plan
    reads = []
    for area, owner, _ in plan:
        owner = np.where(inside[:, None], owner, -1)
        owners = owners_range(owner)
        if owners != NOBODY:
            reads.append((area, owner, owners))
    return reads


def _read_width(op: LoweredOp) -> int:
    return int(np.prod(op.feature_shape, dtype=np.int64))


def _store_tables(op: LoweredOp) -> dict:
    return getattr(op, "store_tables", None) or {}


def _bound_to(op: LoweredOp, stores: dict[str, ResidentStore]) -> LoweredOp:
    """The op with each table of a store (`store_tables`) the store's per-request values."""
    if not _store_tables(op):
        return op
    consts = [stores[op.store_tables[i]].values if i in op.store_tables else c for i, c in enumerate(op.program.consts)]
    return replace(op, program=TokenProgram(op.program.ops, consts, op.program.output))


def check_resident(app: str, ops_by_key: dict) -> None:
    """Whether an app's lowered ops can be resident; a clear error naming the first that cannot."""
    for ops in ops_by_key.values():
        for op in ops:
            _check_resident(app, op)


def _unplaced(op) -> tuple[LoweredOp, Placed | None]:
    return (op.op, op) if isinstance(op, Placed) else (op, None)


def _check_resident(app: str, op: LoweredOp) -> None:
    """A resident op runs on every token of the requests that select it: it must be per token."""
    op, _ = _unplaced(op)
    if op.positions is not None:
        raise ValueError(f"app {app!r}: a hook selects positions; an installed app's hooks run on every "
                         "token (write act + v, not act[:, -1] += v; read per token, reduce on the host)")
    store = getattr(op, "store", None)
    if store is not None and store.reduce not in REDUCTIONS:
        kind = ("a value per token (store.put without reduce, or a value of another hook point)"
                if store.reduce is None else f"reduce={store.reduce!r}")
        raise ValueError(f"app {app!r}: store {store.name!r} keeps {kind}; an installed app's stores fold "
                         f"the prompt with reduce= one of {REDUCTIONS}. Run it with run_with_hooks")
    if op.uses_token_tables:
        raise ValueError(f"app {app!r}: a hook uses per-token tables (patching from a cache); "
                         "run it with run_with_hooks")


def _tensors(op: LoweredOp) -> list[torch.Tensor]:
    """An op's parameter tensors (a store's tables are the engine's, not parameters)."""
    tables = {f"consts[{i}]" for i in _store_tables(op)}
    return [t for name, t in named_tensors(op) if name not in tables]
