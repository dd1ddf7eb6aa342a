"""The graph-safe control plane: resident ops, gated per token through fixed-address buffers.

An app installed in an engine becomes *resident*: its lowered ops stay at their sites for the
life of the engine, with their tensors at fixed device addresses. At a site, every resident op is
launched over all of the step's tokens, every step, with the same arguments:

    rows  = control[op, ROWS, :T]    token t, or -1 where the op leaves the token alone
    table = control[op, TABLE, :T]   the row of the op's request-value tables the token uses (0: defaults)

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
Nothing is recaptured, restarted or drained for any of these.

Reads (the messenger): a read op writes each live token's value into its `step_values`, in the
model's dtype. When the next step is prepared, the host queues the copy of the finished step's rows
into the op's read log (ReadLog: host memory per read op, in the same dtype; the copy lands in a
pinned slot on a GPU, stream ordered and non-blocking, and moves into the log's plain host chunks a
few steps later: no conversion on the device, no driver call as the log grows), each row tagged with its request's
number and its position (known on the host: vLLM computes the device's positions from each
request's computed tokens, which it keeps there too). One buffer is enough: that copy is queued on the stream before the next step's forward,
which overwrites it. Per step that is one copy and two small numpy arrays per read op, whatever the
number of requests: no Python object per request, step or token stays behind (the garbage
collector has nothing to walk). A request's values are gathered from the log once, when they are
taken (`take_results`). A position computed twice (preemption recomputes a request; chunked
prefill never does) keeps its latest value: nothing is lost or duplicated. Device memory, per
engine: control 2 x MAX_RESIDENT_OPS x max_tokens int32, and per read op max_tokens x width in the
model's dtype (its step values).

Most decode steps have the rows of the step before (the same requests, choices and token counts):
then nothing is staged or copied, and the host's work is the reads' copies home.

An op installed after the engine captured its CUDA graphs is not in them. Its launches run only in
steps the engine runs without graphs: requests that select such an app make their steps eager
(`needs_eager_steps`), which is correct and reported, never a silently dropped hook.
"""
import hashlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import torch

from xmix_lens.lowered import (AffineWrite, GeneratedRead, GeneratedWrite, LoweredOp, Read, TokenOp, TokenProgram,
                               named_tensors, op_digest, to_device)

from ..executor import Executor
from .sharding import Placed, on_site

MAX_RESIDENT_OPS = 64  # control rows; also the most apps (one bit each in a request's uint64 mask)
STAGING_BUFFERS = 2  # so that a copy still in flight is never overwritten by the next step's staging
ROWS, TABLE = 0, 1


class ResidentCapacityError(ValueError):
    """No control rows left for an app's resident ops."""


@dataclass
class ResidentOp:
    app: str
    site: int
    index: int  # its row of the control buffer
    op: LoweredOp
    step_values: torch.Tensor | None = None  # reads: the step's values, [max_tokens, width] (row t: token t)
    log: "ReadLog | None" = None  # reads: every step's values on the host, until their requests take them
    captured: bool = False  # launched while a CUDA graph was being captured
    retired: bool = False  # its app was uninstalled; kept only because a captured graph launches it
    placed: Placed | None = None  # at a sharded site of a TP engine: how this rank runs it
    tables: dict = field(default_factory=dict)  # field ("bias", "consts[i]") -> [slots, ...]: row 0 the default


@dataclass(frozen=True)
class AppInfo:
    """What the driver needs of an installed app (and can be sent back from a TP engine's workers)."""

    name: str
    digest: bytes  # of what its ops do now: the prefix-cache salt of requests that select it
    reads: bool  # whether it reads: its requests must compute every position (no prefix-cache reuse)
    version: int


@dataclass
class ResidentApp:
    name: str
    ops: list[ResidentOp]
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


@dataclass
class _Step:
    """A prepared step whose reads are not queued home yet."""

    read_ops: list  # the read ops on in the step (held: an uninstall before the copy home frees their rows)
    owners: np.ndarray  # [len(read_ops), tokens]: each token's request number, -1 where the op is off
    positions: np.ndarray  # [tokens] int64: each token's position in its request


@dataclass
class HostTime:
    """The control plane's host time in prepare_step (bench fields): wall time and this thread's CPU
    time (their difference is time waited: for the GIL held by another thread, for the device, for
    the OS). And for decode steps alone (a token a request: most of a generation's steps, those
    whose host time a host-bound engine shows in its ITL; a prefill step's is prepared beside a
    forward tens to hundreds of times longer): their wall time, their slowest, and the part spent
    queueing the step before's reads home (the copies' CUDA calls, the moves on the host)."""

    wall: float = 0.0
    cpu: float = 0.0
    steps: int = 0
    decode_wall: float = 0.0
    decode_steps: int = 0
    decode_max: float = 0.0  # the slowest decode step's (a step late in the host shows in P99 ITL)
    decode_home: float = 0.0  # of decode steps' wall time, queueing the step before's reads home

    def add(self, wall: float, cpu: float, decode: bool, home: float = 0.0) -> None:
        self.wall += wall
        self.cpu += cpu
        self.steps += 1
        if decode:
            self.decode_wall += wall
            self.decode_steps += 1
            self.decode_max = max(self.decode_max, wall)
            self.decode_home += home

    def ms_per_step(self) -> dict:
        decode_steps = max(self.decode_steps, 1)
        return {"host_ms_per_step": 1e3 * self.wall / max(self.steps, 1),
                "host_cpu_ms_per_step": 1e3 * self.cpu / max(self.steps, 1),
                "host_ms_per_decode_step": 1e3 * self.decode_wall / decode_steps,
                "host_ms_max_decode_step": 1e3 * self.decode_max,
                "host_ms_home_per_decode_step": 1e3 * self.decode_home / decode_steps}


@dataclass
class _Layout:
    """The resident ops as arrays, for preparing a step in a few numpy operations whatever their
    number (made again after an install or an uninstall)."""

    rows: np.ndarray | slice  # the control rows of the ops not retired ([n] int64; a slice where consecutive)
    shifts: np.ndarray  # [n, 1] uint64: each op's app bit
    reads: np.ndarray  # positions in `rows` of the ops with a read log
    read_ops: list  # those ops
    table_ops: list  # ops with request-value tables


CHUNK_BYTES = 4 << 20  # a read log's values come in chunks of about this size
LANDING_SLOTS = 4  # a read log's pinned buffers, of a chunk's rows each, that its copies home land in, in turn
_chunk_maker: tuple[int, ThreadPoolExecutor] | None = None  # (its process, the thread making read logs' chunks)


def _make_ahead(make) -> Future:
    """`make()` on a helper thread, so that a read log's next chunk is ready before a step needs it. One thread per process: a forked worker does not inherit its parent's."""
    global _chunk_maker
    if _chunk_maker is None or _chunk_maker[0] != os.getpid():
        _chunk_maker = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="xmix-read-log"))
    return _chunk_maker[1].submit(make)


class HomeCopies:
    """The copies home of the read logs, in the order they are queued on the device's stream: all of a
    step's copies, every log's, are marked by one event recorded after the last of them (`mark`), and a
    landing slot's values are moved once the mark after their copy is done (`wait`). So a steady step
    makes one event record and at most one synchronize whatever the number of read logs (each torch
    call costs the host: see ReadLog). On the CPU the copies are done when made: nothing to record."""

    EVENTS = 16  # marks' events, recorded in turn

    def __init__(self, pin: bool):
        self.pinned = pin  # the landing slots pinned, the copies non-blocking
        self._events = [torch.cuda.Event() for _ in range(self.EVENTS)] if pin else None
        self.marks = 0  # marks made: copies queued now are covered by mark number `marks`
        self.done = 0  # the marks below this are known done

    def mark(self) -> None:
        """After a step's copies."""
        if self._events is not None:
            oldest = self.marks - self.EVENTS  # the mark whose event is recorded again now
            if oldest >= self.done:  # not known done: waited for (16 steps old, in practice done)
                self._events[oldest % self.EVENTS].synchronize()
                self.done = oldest + 1
            self._events[self.marks % self.EVENTS].record()
        self.marks += 1

    def wait(self, mark: int) -> None:
        """Until the copies that mark number `mark` covers are done (marked now if it is not made yet)."""
        if self._events is None or mark < self.done:
            return
        if mark == self.marks:
            self.mark()
        self._events[mark % self.EVENTS].synchronize()
        self.done = mark + 1

    def wait_all(self) -> None:
        self.wait(self.marks - 1)


@dataclass(eq=False)
class _Chunk:
    values: torch.Tensor  # [rows, width], the read's dtype
    values_np: np.ndarray  # the same memory as numpy sees it (_as_numpy)
    positions: np.ndarray  # [rows] int64
    owner: np.ndarray  # [rows] int64: the number of the request each row belongs to; -1: nobody's
    used: int = 0


class ReadLog:
    """One read op's values of every step, on the host, until their requests take them.

    Rows are appended a step at a time, each tagged with the number of the request its token
    belongs to and its position. Requests' rows are found by one lookup of their numbers over the
    tags when they are taken, those finishing together at once (`take`). When the log needs a
    chunk it first recycles its oldest ones whose rows are all nobody's or of requests no longer
    alive, so memory follows the reads not yet taken; a new chunk is made ahead, on a helper thread
    (`_make_ahead`).

    A step's values are copied home into a landing slot (pinned on a GPU: the copy is stream
    ordered and non-blocking), made with the log, and moved into their chunk's rows on the host when
    the slot comes round again (its copy is steps old by then: done, `HomeCopies`) or before a take.
    The chunks are plain host memory: pinning memory is a driver call, and each pinned chunk made
    while the engine ran cost a step in the tail: on the H200 a new 4 MiB chunk took 2.2 ms inline,
    and made on a helper thread the steps around it were still slower (docs/benchmarks.md, session
    15). A step whose values fill more than LANDING_SLOTS - 1 slots waits for its first ones'
    copies. A new chunk's pages are written once on the helper thread (numpy lets go of the GIL
    there): a page's first write faults, and on the steps' thread the first pass through a chunk
    cost 20 times the copies' own time (`ReadLog._move` timed inside `bench/host_step.py` on this
    CPU: 170 against 7 us a step at 256 requests).

    A step's append makes one torch call (the copy home; the step's event is `HomeCopies`'): every
    torch call, a slice included, lets go of the GIL and then waits to get it back, up to
    `sys.getswitchinterval()` (5 ms) while another thread runs Python (vLLM's do: `bench/host_step.py
    --busy-thread`). So the slices of a steady step are made once and kept, and the moves on the
    host are numpy copies."""

    RECYCLE_CHECKS = 4  # oldest chunks looked at when a chunk is needed

    def __init__(self, width: int, dtype: torch.dtype, copies: HomeCopies, alive, chunk_rows: int | None = None):
        self.width, self.dtype, self.alive, self.copies = width, dtype, alive, copies  # alive(): requests alive
        self.chunk_rows = chunk_rows or max(256, min(65536, CHUNK_BYTES // (dtype.itemsize * width)))
        self.chunks: list[_Chunk] = []  # in the order they were filled (a recycled chunk goes last)
        self.chunks_made = 0  # a bench field: new chunks are the log's only allocations
        self._spare = _make_ahead(self._new_chunk)  # the next new chunk, made ahead
        self._landing = _host_empty((LANDING_SLOTS, self.chunk_rows, width), dtype, copies.pinned)
        self._landing_np = _as_numpy(self._landing)
        self._slot_rows: list[tuple[int, torch.Tensor | None]] = [(0, None)] * LANDING_SLOTS  # (n, slot[:n]), kept
        self._source_rows: tuple = (None, 0, None)  # (a step's values buffer, n, its first n rows), kept
        self._moves: list[tuple | None] = [None] * LANDING_SLOTS  # per slot: (rows, chunk, first row, mark) to move
        self._turns = 0  # slots used so far: the next is turns % LANDING_SLOTS, the oldest copy

    def append(self, values: torch.Tensor, positions: np.ndarray, owner: np.ndarray) -> None:
        """Queue a step's copy home (stream ordered: its values are the step's once it is done):
        the first len(owner) rows of `values` (the op's step-values buffer)."""
        done, n = 0, len(owner)
        while done < n:
            chunk = self.chunks[-1] if self.chunks and self.chunks[-1].used < self.chunk_rows else self._next_chunk()
            k = min(n - done, self.chunk_rows - chunk.used)
            self._land(self._first_rows(values, k) if done == 0 else values[done:done + k], k, chunk, chunk.used)
            rows = slice(chunk.used, chunk.used + k)
            chunk.positions[rows] = positions[done:done + k]
            chunk.owner[rows] = owner[done:done + k]
            chunk.used += k
            done += k

    def _first_rows(self, values: torch.Tensor, n: int) -> torch.Tensor:
        """values[:n], the same view as the step before's when the buffer and n are (steady steps)."""
        buffer, rows, view = self._source_rows
        if buffer is not values or rows != n:
            view = values[:n]
            self._source_rows = (values, n, view)
        return view

    def _land(self, values: torch.Tensor, n: int, chunk: _Chunk, first: int) -> None:
        """`values` (n rows) copied into the next landing slot, to move to the chunk's rows from `first` later."""
        slot = self._turns % LANDING_SLOTS
        self._turns += 1
        self._move(slot)  # the slot's last copy, into its chunk first
        rows, target = self._slot_rows[slot]
        if rows != n:
            target = self._landing[slot, :n]
            self._slot_rows[slot] = (n, target)
        target.copy_(values, non_blocking=self.copies.pinned)
        self._moves[slot] = (n, chunk, first, self.copies.marks)

    def _move(self, slot: int) -> None:
        """The slot's landed values into their chunk's rows. Moves run in the order of their copies
        (oldest slot first), so a recycled chunk's rows end with their latest values."""
        move, self._moves[slot] = self._moves[slot], None
        if move is None:
            return
        k, chunk, first, mark = move
        self.copies.wait(mark)
        chunk.values_np[first:first + k] = self._landing_np[slot, :k]

    def _settle(self) -> None:
        """Every landed value into its chunk (waits for copies not done yet)."""
        for turn in range(self._turns, self._turns + LANDING_SLOTS):  # oldest first
            self._move(turn % LANDING_SLOTS)

    def _next_chunk(self) -> _Chunk:
        alive = None
        for chunk in self.chunks[: self.RECYCLE_CHECKS]:
            if alive is None:
                alive = self.alive()
            # request numbers are consecutive integers: a lookup table over their range, not a sort
            if len(alive) == 0 or not np.isin(chunk.owner[:chunk.used], alive, kind="table").any():
                self.chunks.remove(chunk)
                chunk.used = 0
                break
        else:
            chunk, self._spare = self._spare.result(), _make_ahead(self._new_chunk)
            self.chunks_made += 1
        self.chunks.append(chunk)
        return chunk

    def _new_chunk(self) -> _Chunk:
        """A chunk with every page written once (see ReadLog)."""
        values = _host_empty((self.chunk_rows, self.width), self.dtype, pin=False)
        values_np = _as_numpy(values)
        values_np.fill(0)
        return _Chunk(values, values_np, np.full(self.chunk_rows, 0, dtype=np.int64),
                      np.full(self.chunk_rows, -1, dtype=np.int64))

    def take(self, numbers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Requests' (positions [n], values [n, width]) by position, the latest value of a position
        computed twice; their rows are then nobody's. One pass over the log for all of them (a
        pass's or an API request's requests finish together): a request's rows are found by one
        lookup over the tags, not by one comparison over the log per request. Requests with no
        rows are left out."""
        self._settle()
        wanted = np.asarray(numbers, dtype=np.int64)
        if not self.chunks or not len(wanted):
            return {}
        owners, positions, chunk_of, rows = [], [], [], []
        for c, chunk in enumerate(self.chunks):  # in fill order: later rows are later steps
            tags = chunk.owner[:chunk.used]
            found = np.flatnonzero(np.isin(tags, wanted, kind="table"))
            if len(found):
                owners.append(tags[found])
                positions.append(chunk.positions[found])
                chunk_of.append(np.full(len(found), c))
                rows.append(found)
                chunk.owner[found] = -1
        if not owners:
            return {}
        owners, positions = np.concatenate(owners), np.concatenate(positions)
        order = np.lexsort((positions, owners))  # stable: rows of one (request, position) stay in fill order
        owners, positions = owners[order], positions[order]
        last = np.append((owners[1:] != owners[:-1]) | (positions[1:] != positions[:-1]), True)
        kept = order[last]  # each (request, position)'s last row, by request and position
        owners, positions = owners[last], positions[last]
        chunk_of, rows = np.concatenate(chunk_of)[kept], np.concatenate(rows)[kept]
        values = self._gather(chunk_of, rows)
        starts = np.flatnonzero(np.append(True, owners[1:] != owners[:-1]))
        bounds = np.append(starts, len(owners))
        return {int(owners[a]): (torch.from_numpy(positions[a:b]), values[a:b])
                for a, b in zip(bounds[:-1], bounds[1:])}

    def _gather(self, chunk_of: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """The values of rows[i] of chunk chunk_of[i], in that order: one copy from a single chunk,
        else one per chunk. index_select and index_copy_, not advanced indexing: for 64 rows 7 us
        either way, against 13 us on an idle 2-core host and 5 ms on a busy one (torch's intra-op
        threads)."""
        if (chunk_of == chunk_of[0]).all():
            return self.chunks[chunk_of[0]].values.index_select(0, torch.from_numpy(rows))
        values = torch.empty(len(rows), self.width, dtype=self.dtype)
        for c in np.unique(chunk_of):
            at = np.flatnonzero(chunk_of == c)
            from_chunk = self.chunks[c].values.index_select(0, torch.from_numpy(rows[at]))
            values.index_copy_(0, torch.from_numpy(at), from_chunk)
        return values

    def clear(self) -> None:
        for chunk in self.chunks:
            chunk.owner[:chunk.used] = -1


@dataclass
class ControlPlane:
    device: torch.device
    max_tokens: int
    apps: dict[str, ResidentApp] = field(default_factory=dict)
    # control row -> its op; None where an uninstalled app's op was removed (the row is free again)
    slots: list[ResidentOp | None] = field(default_factory=list)
    by_site: dict[int, list[ResidentOp]] = field(default_factory=dict)
    selected: dict[str, frozenset] = field(default_factory=dict)  # vLLM request id -> its apps
    defaults: frozenset = frozenset()  # the apps of requests that chose none (e.g. sent to vLLM directly)
    comm: object = None  # a TP engine's collectives (sharding.TPCollectives), for ops placed as a gather
    delivers: bool = True  # whether this rank sends reads home (TP: rank 0 only)
    max_requests: int = 256  # requests running at once (vLLM's max_num_seqs): table rows besides the defaults
    read_dtype: torch.dtype = torch.float32  # reads' values on the device and in the logs: the model's dtype

    def __post_init__(self):
        pin = self.device.type == "cuda"
        # its own executor: launches whose arguments are all fixed-address buffers
        self.executor = Executor(self.device, self.max_tokens)
        self.control = torch.full((MAX_RESIDENT_OPS, 2, self.max_tokens), -1, dtype=torch.int32, device=self.device)
        self.control[:, TABLE] = 0
        self._tokens = torch.arange(self.max_tokens, dtype=torch.int32, device=self.device)  # a read's row per token
        # A step's rows are staged on the host as one contiguous [ops, 2, width] block at the front of
        # a flat pinned buffer, copied to a device buffer as they are, then into `control` there: a
        # copy from a strided pinned view would go through pageable memory, and such a copy waits
        # for the GPU to finish everything queued before it (the step in flight). Staging buffers
        # take turns (device="cpu" explicitly: vLLM builds the model under a default-device context).
        # They are written through numpy views: with torch ops on these host tensors (which may hand
        # large fills to torch's intra-op threads) a prefill step's preparation took 44 ms in the
        # engine on the H200 under the profiler, 3.3 ms through numpy (docs/benchmarks.md, session 14).
        self._staging = [torch.empty(MAX_RESIDENT_OPS * 2 * self.max_tokens, dtype=torch.int32, device="cpu",
                                     pin_memory=pin) for _ in range(STAGING_BUFFERS)]
        self._staging_np = [buffer.numpy() for buffer in self._staging]
        self._landing = torch.empty(MAX_RESIDENT_OPS * 2 * self.max_tokens, dtype=torch.int32, device=self.device)
        self._staged_count = 0
        # made once and recorded again each time (no object per step)
        self._staged_events = [torch.cuda.Event() for _ in range(STAGING_BUFFERS)] if pin else None
        # per staging buffer, the (rows, width, tokens) and layout of the step it last held
        self._staged_shape: list[tuple | None] = [None] * STAGING_BUFFERS
        self._staged_layout: list[_Layout | None] = [None] * STAGING_BUFFERS
        # per staging buffer, ((rows, width), its views for the copies to `control`), kept: each torch
        # call, a slice too, lets go of the GIL (see ReadLog)
        self._copy_views: list[tuple] = [((0, 0), None)] * STAGING_BUFFERS
        self._in_control: tuple | None = None  # what the rows in `control` were made from (_prepare's key)
        self._read_owners: tuple = ([], None)  # the read ops on in those rows, and each token's request number
        self._copies_home = HomeCopies(pin)  # the read logs' copies home, and their events
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
        self._bit: dict[str, int] = {}  # app name -> its bit in the per-request masks
        self._request_bits: dict[str, int] = {}  # request id -> the bits of its selected apps
        self._default_bits = 0
        self._idle = True  # the device rows are all -1
        self._free_slots = list(range(1, self.max_requests + 1))  # table rows for requests' own values
        self._slot: dict[str, tuple[int, frozenset]] = {}  # request id -> (its table row, apps it set values of)

    @property
    def ops(self) -> list[ResidentOp]:
        """Every op holding a control row: installed apps' and, kept for captured graphs, retired ones."""
        return [op for op in self.slots if op is not None]

    # --- installing and choosing (between steps) --------------------------------------------------
    def install(self, name: str, ops_by_site: dict[int, list[LoweredOp]], params: dict | None = None) -> ResidentApp:
        if name in self.apps:
            raise ValueError(f"an app named {name!r} is installed already; uninstall it or choose another name")
        count = sum(len(ops) for ops in ops_by_site.values())
        free = [i for i, op in enumerate(self.slots) if op is None] + list(range(len(self.slots), MAX_RESIDENT_OPS))
        if count > len(free):
            held = sum(op.retired for op in self.ops)
            raise ResidentCapacityError(
                f"installing {name!r} needs {count} resident ops; this engine has {len(free)} of its "
                f"{MAX_RESIDENT_OPS} control rows free ({held} held by uninstalled apps that CUDA graphs captured). "
                "Uninstall apps you no longer use, or build a new engine (from_pretrained) for more")
        check_resident(name, ops_by_site)  # every op checked before any is installed
        resident = []
        for site, ops in ops_by_site.items():
            for op in ops:
                op, placed = _unplaced(op)
                if isinstance(op, Read) and op.W is not None and op.bias is None:
                    op = replace(op, bias=torch.zeros(op.W.shape[1]))  # allocated once, not per launch
                op, tables = self._with_tables(name, to_device(op, self.device), placed)
                entry = ResidentOp(name, site, free.pop(0), op, placed=placed, tables=tables)
                if isinstance(op, (Read, GeneratedRead)):
                    width = int(np.prod(op.feature_shape, dtype=np.int64))
                    entry.step_values = torch.zeros(self.max_tokens, width, dtype=self.read_dtype, device=self.device)
                    if self.delivers:
                        entry.log = ReadLog(width, self.read_dtype, self._copies_home, self._alive_numbers)
                self.slots += [None] * (entry.index + 1 - len(self.slots))
                self.slots[entry.index] = entry
                self.by_site.setdefault(site, []).append(entry)
                resident.append(entry)
        app = self.apps[name] = ResidentApp(name, resident, params=dict(params or {}))
        app.refresh_digest()
        self._bit[name] = min(set(range(MAX_RESIDENT_OPS)) - set(self._bit.values()))
        self._layout = None
        self._choices_version += 1  # the cached masks may lack read-log numbers the new app needs
        return app

    def _with_tables(self, app: str, op: LoweredOp, placed) -> tuple[LoweredOp, dict]:
        """The op with each field its request params move held as a table [slots, ...] (row 0 the
        default): a write's bias as a per-token bias, a program's const as a `table` op."""
        fields = {f for by_field in op.slopes.values() for f in by_field} if hasattr(op, "slopes") else set()
        if not fields:
            return op, {}
        if placed is not None:
            raise ValueError(f"app {app!r}: request params at a hook point split over tensor-parallel ranks are not "
                             "supported; serve it with tensor_parallel_size 1")
        slots = self.max_requests + 1
        if isinstance(op, AffineWrite):
            table = op.bias.expand(slots, *op.bias.shape).clone()
            return replace(op, bias=table[:, None]), {"bias": table}
        consts, ops, tables = list(op.program.consts), list(op.program.ops), {}
        for f in fields:
            i = int(f[len("consts["):-1])
            consts[i] = tables[f] = consts[i].expand(slots, *consts[i].shape).clone()
        ops = [TokenOp("table", o.args, o.shape) if o.op == "const" and f"consts[{o.args[0]}]" in tables else o
               for o in ops]
        return replace(op, program=TokenProgram(ops, consts, op.program.output)), tables

    def set_params(self, name: str, ops_by_site: dict[int, list[LoweredOp]]) -> int:
        """New tensors for an installed app's ops, copied in place: same structure, same addresses."""
        app = self._app(name)
        new = [_unplaced(op) for site in ops_by_site for op in ops_by_site[site]]
        if [(o.site, _structure(o.op), o.placed and o.placed.kind) for o in app.ops] != [
                (site, _structure(op), placed and placed.kind) for site in ops_by_site
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
        """Remove an app; its bit and the control rows of its ops are free for later installs. An op
        that a CUDA graph captured keeps its row and its launch (the graph replays it), gated off for
        good: no request can select it, and its row is never written again."""
        app = self.apps.pop(self._app(name).name)
        del self._bit[name]
        for op in app.ops:
            if op.captured:
                op.retired = True
            else:
                self.slots[op.index] = None
                self.by_site[op.site].remove(op)
        self.selected = {r: names - {name} for r, names in self.selected.items()}
        self.defaults -= {name}
        self._request_bits = {r: self._bits(names) for r, names in self.selected.items()}
        self._default_bits = self._bits(self.defaults)
        self._layout = None
        self._choices_version += 1

    def check_installed(self, names) -> None:
        for name in names:
            self._app(name)

    def select(self, req_id: str, names, values: dict | None = None) -> None:
        """A request's apps; `values` {app: {param: value}}: its own values of their request params."""
        self.check_installed(names)
        self.selected[req_id] = frozenset(names)
        self._request_bits[req_id] = self._bits(names)
        self._numbered(req_id)
        self._choices_version += 1
        valued = {app: v for app, v in (values or {}).items() if app in names and v}
        if valued and req_id not in self._slot:
            if not self._free_slots:
                raise RuntimeError(f"{self.max_requests} requests with their own app-param values run already")
            slot = self._free_slots.pop()
            self._slot[req_id] = (slot, frozenset(valued))
            for app, by_param in valued.items():
                params = self.apps[app].params
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
        if slot is not None:
            self._free_slots.append(slot[0])
            self._choices_version += 1  # a step's table rows name it no more

    def set_defaults(self, names) -> None:
        self.check_installed(names)
        self.defaults = frozenset(names)
        self._default_bits = self._bits(names)
        self._choices_version += 1

    def forget(self, req_id: str) -> None:
        """A finished request: its choice and any reads not taken (its rows in the read logs are
        nobody's from now on, also those of its last steps still on their way home)."""
        self.selected.pop(req_id, None)
        self._request_bits.pop(req_id, None)
        self._number.pop(req_id, None)
        self.release_values(req_id)
        self._choices_version += 1

    def read_by_default(self, req_id: str) -> bool:
        """Whether the reads of a request that chose no apps were kept (it ran the default apps)."""
        return req_id in self._number and req_id not in self.selected

    def take_results(self, req_ids: list[str]) -> list[dict]:
        """Per request, each read's values so far, by (app, read key): (positions [n], values
        [n, width]), sorted by position. The caller drains first (`drain`)."""
        numbers = [self._number.get(r) for r in req_ids]
        known = [n for n in numbers if n is not None]
        out = [{} for _ in req_ids]
        if not known:
            return out
        for op in self.ops:
            if op.log is None:
                continue
            taken = op.log.take(known)
            for results, number in zip(out, numbers):
                if number in taken:
                    results[(op.app, op.op.key)] = taken[number]
        return out

    def clear_reads(self) -> None:
        """Every read so far dropped (those of requests that no call collects, sent to vLLM directly)."""
        self.drain()
        for op in self.ops:
            if op.log is not None:
                op.log.clear()

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
        self._queue_home()
        queued = time.perf_counter()
        self._prepare(req_ids, query_start, n_tokens, first_positions, n_padded)
        self.host_time.add(time.perf_counter() - started, time.thread_time() - cpu_started,
                           decode=n_tokens == len(req_ids), home=queued - started)

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
        if self._in_control != key:
            self._stage(layout, query_start, n_tokens, width, choices.bits, choices.numbers, req_ids)
            self._in_control = key
        self._idle = not choices.any_on
        read_ops, owners = self._read_owners
        if not read_ops:
            return
        if n_tokens == n:  # a decode step: each request's one token is at its first position (a copy:
            positions = np.array(first_positions[:n], dtype=np.int64)  # vLLM reuses its buffer)
        else:  # each token's position: its request's first, plus its index past the request's start
            positions = np.repeat(np.asarray(first_positions[:n], dtype=np.int64) - query_start[:-1],
                                  np.diff(query_start)) + np.arange(n_tokens, dtype=np.int64)
        self._unqueued = _Step(read_ops, owners, positions)

    def _stage(self, layout, query_start, n_tokens, width, request_bits, numbers, req_ids) -> None:
        """A step's rows into `control` (staged on the host, one copy to the device), and the read ops
        it runs with each of their tokens' request numbers."""
        turn = self._staged_count % STAGING_BUFFERS
        self._staged_count += 1
        if self._pin:
            self._staged_events[turn].synchronize()  # its copy from two stagings ago is long done
        rows_used = len(self.slots)
        size = rows_used * 2 * width
        staging = self._staging_np[turn][:size].reshape(rows_used, 2, width)
        shape = (rows_used, width, n_tokens)
        if self._staged_shape[turn] != shape or self._staged_layout[turn] is not layout:
            # what no step of this shape and layout writes below: -1 past the tokens and in rows of
            # no op, table rows 0 (kept between such steps: two fills less)
            staging[:, ROWS] = -1
            staging[:, TABLE] = 0
            self._staged_shape[turn], self._staged_layout[turn] = shape, layout
        per_request = np.diff(query_start)
        token_bits = np.repeat(request_bits, per_request)
        tokens = np.arange(n_tokens, dtype=np.int32)
        on = (token_bits[None, :] >> layout.shifts) & 1 == 1  # [ops, tokens]: whether the op runs on the token
        staging[layout.rows, ROWS, :n_tokens] = np.where(on, tokens, -1)
        for op in layout.table_ops:  # each token's table row: its request's own, else 0 (the defaults)
            if not self._slot:
                staging[op.index, TABLE, :n_tokens] = 0
                continue
            own = np.fromiter((slot if op.app in apps else 0
                               for slot, apps in (self._slot.get(r, (0, ())) for r in req_ids)),
                              dtype=np.int32, count=len(req_ids))
            staging[op.index, TABLE, :n_tokens] = np.repeat(own, per_request)
        # launches read rows [:T], T (x's tokens, padding included) <= width: the rest may be stale
        dims, views = self._copy_views[turn]
        if dims != (rows_used, width):
            landing = self._landing[:size]
            views = (self._staging[turn][:size], landing, landing.view(rows_used, 2, width),
                     self.control[:rows_used, :, :width])
            self._copy_views[turn] = ((rows_used, width), views)
        staged, landing, landed, rows = views
        landing.copy_(staged, non_blocking=self._pin)
        rows.copy_(landed)
        if self._pin:
            self._staged_events[turn].record()
        read_ops, owners = [], None
        if len(layout.reads) and self.delivers:
            read_on = on[layout.reads]
            live = read_on.any(axis=1)
            if live.any():
                owners = np.where(read_on[live], np.repeat(numbers, per_request), -1)
                read_ops = [op for op, on in zip(layout.read_ops, live) if on]
        self._read_owners = (read_ops, owners)

    def _make_layout(self) -> _Layout:
        self._in_control = None  # rows made for other ops
        ops = [op for op in self.ops if not op.retired]  # a retired op's row stays -1: selected by nobody
        reads = [i for i, op in enumerate(ops) if op.log is not None]
        indices = [op.index for op in ops]
        consecutive = indices == list(range(indices[0], indices[0] + len(indices))) if indices else False
        self._layout = _Layout(slice(indices[0], indices[-1] + 1) if consecutive
                               else np.array(indices, dtype=np.int64),
                               np.array([self._bit[op.app] for op in ops], dtype=np.uint64).reshape(-1, 1),
                               np.array(reads, dtype=np.int64), [ops[i] for i in reads],
                               [op for op in ops if op.tables])
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
        self._choices_made += 1
        self._last_choices = _Choices(self._choices_version, list(req_ids), bits, bool(bits.any()), numbers,
                                      self._choices_made)
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

    def launch(self, x: torch.Tensor, site_id: int) -> None:
        """The site's resident ops over all of x's tokens: the same launches every step."""
        ops = self.by_site.get(site_id)
        if not ops:
            return
        T = x.shape[0]
        if T > self.max_tokens:
            raise RuntimeError(f"a step of {T} tokens; the control plane holds {self.max_tokens}")
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        for entry in ops:
            entry.captured |= capturing
            rows = self.control[entry.index, ROWS, :T]
            tables = self.control[entry.index, TABLE, :T] if entry.tables else None
            with on_site(entry.placed, x, self.comm) as x_op:  # a gather plan: the whole row
                if entry.step_values is None:
                    self.executor.run(entry.op, x_op, rows, tables)
                else:
                    self.executor.run(entry.op, x_op, rows, tables, out=entry.step_values, dest=self._tokens[:T])

    def renormalize_written(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                            site_ids) -> None:
        """`out`, the RMSNorm of x computed before the sites `site_ids` ran on x, made again on the
        tokens of their resident writes (sites.py): one launch per write, the same every step."""
        T = x.shape[0]
        for site_id in site_ids:
            for entry in self.by_site.get(site_id, ()):
                if entry.step_values is None:  # a write
                    self.executor.renormalize(x, self.control[entry.index, ROWS, :T], weight, eps, out)

    # --- the messenger ----------------------------------------------------------------------------
    def _queue_home(self) -> None:
        """Queue the copy of the prepared step's reads into the read logs (its forward is on the
        stream before anything that runs after it: stream ordered, the copy waits for it)."""
        step, self._unqueued = self._unqueued, None
        if step is None:
            return
        for op, owner in zip(step.read_ops, step.owners):
            op.log.append(op.step_values, step.positions, owner)
        self._copies_home.mark()

    def drain(self) -> None:
        """Every read of the steps run so far in the read logs (before results are taken)."""
        self._queue_home()
        self._copies_home.wait_all()


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a host tensor's memory, as integers of its element size (numpy has no
    bfloat16): copies through it are numpy's, not torch calls (see ReadLog)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy()


def _host_empty(shape: tuple, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    # a normal tensor, also when made during a step (vLLM runs those in inference mode): the log is
    # written outside it too (drain, before results are taken)
    with torch.inference_mode(False):
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)


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
    if getattr(op, "store", None) is not None:
        raise ValueError(f"app {app!r}: installed apps do not use stores yet; run it with run_with_hooks")
    if isinstance(op, AffineWrite) and op.per_token_bias or isinstance(op, Read) and op.bias is not None \
            and op.bias.dim() > 1 or isinstance(op, (GeneratedWrite, GeneratedRead)) \
            and any(o.op == "table" for o in op.program.ops):
        raise ValueError(f"app {app!r}: a hook uses per-token tables (patching from a cache); "
                         "run it with run_with_hooks")


def _tensors(op: LoweredOp) -> list[torch.Tensor]:
    return [t for _, t in named_tensors(op)]


def _structure(op: LoweredOp) -> tuple:
    program = getattr(op, "program", None)
    ops = [(o.op, o.args, o.shape) for o in program.ops] if program else None
    return type(op).__name__, ops, [tuple(t.shape) for t in _tensors(op)]
