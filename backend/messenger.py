"""The messenger: installed apps' reads, from the device's step values to each request's results.

A read op writes each live token's value into its `step_values`: its columns of a `ReadArea`, one
device buffer [max_tokens, width] that the read ops installed together share, token-major. When
the next step is prepared the control plane queues the copy home of the finished step's rows of
each area: ONE copy per area and step, whatever the number of read ops (every copy is a CUDA call
the host makes each step: with one copy per read op, queueing them was most of the control plane's
host time a decode step on the H200, `host_ms_home_per_decode_step` in
bench/results/2026-12-03-gpu-bench-gc-pauses-256-512.json). The copy lands in a pinned slot
(stream ordered, non-blocking), and its rows, every op's columns at once, move into the area's
`ReadLog` (plain host chunks, each row tagged with its position and, per op, its request) when
the slot comes round again, steps later: its copy is done by then (`HomeCopies`). A request's values are gathered from the log once, when taken.

Per step that is one copy per area, one event record, and three numpy copies on the host (the
values, the positions, the owners): no Python object per request, step or token stays behind
(the garbage collector has nothing to walk).
"""
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from . import cudart

CHUNK_BYTES = 4 << 20  # a read log's values come in chunks of about this size, an area's landing slots too
LANDING_SLOTS = 8  # an area's pinned buffers that its copies home land in, in turn
_chunk_maker: tuple[int, ThreadPoolExecutor] | None = None  # (its process, the thread making read logs' chunks)


def _make_ahead(make) -> Future:
    """`make()` on a helper thread, so that a read log's next chunk is ready before a step needs it. One thread per process: a forked worker does not inherit its parent's."""
    global _chunk_maker
    if _chunk_maker is None or _chunk_maker[0] != os.getpid():
        _chunk_maker = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="xmix-read-log"))
    return _chunk_maker[1].submit(make)


class HomeCopies:
    """The copies home, in the order they are queued on the device's stream: all of a step's copies,
    every area's, are marked by one event recorded after the last of them (`mark`), and a landing
    slot's values are moved once a mark after their copy is done (`wait`). A wait is for a mark at
    least LAG steps old where the slot's own is older: one synchronize covers the moves of the
    next steps too. So a steady step makes one event record and a fraction of a synchronize (each
    straight to the CUDA runtime: `cudart`). On the CPU the copies are done when made."""

    EVENTS = 16  # marks' events, recorded in turn
    LAG = 4  # a mark this many steps old is done in practice: vLLM prepares at most a step ahead of the GPU

    def __init__(self, pin: bool):
        self.pinned = pin  # the landing slots pinned, the copies non-blocking
        self._events = [cudart.Event() for _ in range(self.EVENTS)] if pin else None
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
        """Until the copies that mark number `mark` covers are done (marked now if it is not made
        yet); waits for the newest mark LAG old instead where that is later."""
        if self._events is None or mark < self.done:
            return
        if mark == self.marks:
            self.mark()
        mark = max(mark, self.marks - 1 - self.LAG)
        self._events[mark % self.EVENTS].synchronize()
        self.done = mark + 1

    def wait_all(self) -> None:
        self.wait(self.marks - 1)

    def pending(self, mark: int) -> bool | None:
        """Whether the device has not yet reached mark number `mark` (None on the CPU: no events)."""
        if self._events is None:
            return None
        return mark >= self.done and not self._events[mark % self.EVENTS].query()

    def reached(self, mark: int) -> bool:
        """Whether mark number `mark` is made and the device is past it, asked without waiting (then
        so are the marks before it: one stream)."""
        if mark >= self.marks:
            return False
        if self._events is not None and mark >= self.done:
            if not self._events[mark % self.EVENTS].query():
                return False
            self.done = mark + 1
        return True


NOBODY = (np.iinfo(np.int64).max, -1)  # the (lowest, highest) request number of rows that are nobody's


def owners_range(owner: np.ndarray) -> tuple[int, int]:
    """The lowest and highest request number among owner's tags (-1: nobody's), NOBODY where none."""
    tagged = owner[owner >= 0]
    return (int(tagged.min()), int(tagged.max())) if len(tagged) else NOBODY


@dataclass(eq=False)
class _Chunk:
    values: torch.Tensor  # [rows, width]: an area's columns, the reads' dtype
    values_np: np.ndarray  # the same memory as numpy sees it (_as_numpy)
    positions: np.ndarray  # [rows] int64
    owner: np.ndarray  # [rows, ops] int64: per op of the area, the number of the request the row is of; -1: nobody's
    used: int = 0
    owners: tuple[int, int] = NOBODY  # the lowest and highest request number its rows were tagged with


class ReadLog:
    """An area's values of every step, on the host, until their requests take them.

    Rows are appended a step at a time (moved from an area's landing slot, every op's columns at
    once), each tagged with its position and, per read op of the area, the number of the request
    its token belongs to (-1 where the op was off). Requests' rows are found by one lookup of their
    numbers over an op's tags when they are taken, those finishing together at once (`take`). When
    the log needs a chunk it first recycles its oldest ones with no request alive in the range of
    request numbers its rows were tagged with, so memory follows the reads not yet taken; a new
    chunk is made ahead, on a helper thread (`_make_ahead`). The range, kept as rows are appended,
    makes the check one comparison over the requests alive: one over a 4 MiB chunk's tags took
    milliseconds, four chunks checked in one step where the old chunks held requests still alive
    (on the H200 the slowest prepared step at 256 requests took 2.7 ms that way and 0.8-1.0 ms with
    the ranges: bench/results/2026-12-04-gpu-bench-twin-seven-256-512.json).

    The chunks are plain host memory: pinning memory is a driver call, and each pinned chunk made
    while the engine ran cost a step in the tail: on the H200 a new 4 MiB chunk took 2.2 ms inline
    (bench/results/2026-12-02-gpu-chunk-alloc.json), and made on a helper thread the steps around it
    were still slower (bench/results/2026-12-02-gpu-bench-chunks-made-ahead.json). A new chunk's
    pages are written once on the helper thread (numpy lets go of the GIL there): a page's first
    write faults, and on the steps' thread the first pass through a chunk cost many times the
    copies' own time (`bench/host_step.py`).

    The log is written with numpy, not torch: every torch call, a slice included, lets go of the
    GIL and then waits to get it back, up to `sys.getswitchinterval()` (5 ms) while another thread
    runs Python (vLLM's do: `bench/host_step.py --busy-thread`)."""

    RECYCLE_CHECKS = 4  # oldest chunks looked at when a chunk is needed

    def __init__(self, width: int, ops: int, dtype: torch.dtype, alive, chunk_rows: int | None = None):
        self.width, self.ops, self.dtype, self.alive = width, ops, dtype, alive  # alive(): numbers of the requests alive
        self.chunk_rows = chunk_rows or _rows_of(CHUNK_BYTES, dtype.itemsize * width)
        self.chunks: list[_Chunk] = []  # in the order they were filled (a recycled chunk goes last)
        self.chunks_made = 0  # a bench field: new chunks are the log's only allocations
        self._spare = _make_ahead(self._new_chunk)  # the next new chunk, made ahead

    def append(self, values: np.ndarray, positions: np.ndarray, owner: np.ndarray,
               owners: tuple[int, int] | None = None) -> None:
        """A step's rows: values [n, width] as `_as_numpy` sees them, each row's position and per op
        its request's number (owner [n, ops], -1: nobody's); `owners`: owner's range of request
        numbers or a wider one (`owners_range(owner)` where not given)."""
        lowest, highest = owners_range(owner) if owners is None else owners
        done, n = 0, len(positions)
        while done < n:
            chunk = self.chunks[-1] if self.chunks and self.chunks[-1].used < self.chunk_rows else self._next_chunk()
            k = min(n - done, self.chunk_rows - chunk.used)
            rows = slice(chunk.used, chunk.used + k)
            chunk.values_np[rows] = values[done:done + k]
            chunk.positions[rows] = positions[done:done + k]
            chunk.owner[rows] = owner[done:done + k]
            chunk.owners = (min(chunk.owners[0], lowest), max(chunk.owners[1], highest))
            chunk.used += k
            done += k

    def _next_chunk(self) -> _Chunk:
        alive = None
        for chunk in self.chunks[: self.RECYCLE_CHECKS]:
            if alive is None:
                alive = self.alive()
            lowest, highest = chunk.owners
            if not ((alive >= lowest) & (alive <= highest)).any():
                self.chunks.remove(chunk)
                chunk.used, chunk.owners = 0, NOBODY
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
                      np.full((self.chunk_rows, self.ops), -1, dtype=np.int64))

    def take(self, numbers: list[int], op: int, columns: slice) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Requests' (positions [n], values [n, width of `columns`]) of op number `op` by position,
        the latest value of a position computed twice; their rows are then nobody's for that op.
        One pass over the log for all of them (a pass's or an API request's requests finish
        together): a request's rows are found by one lookup over the tags, not by one comparison
        over the log per request. Requests with no rows are left out. Rows still in a landing slot
        are not here: the caller drains first."""
        wanted = np.asarray(numbers, dtype=np.int64)
        if not self.chunks or not len(wanted):
            return {}
        owners, positions, chunk_of, rows = [], [], [], []
        for c, chunk in enumerate(self.chunks):  # in fill order: later rows are later steps
            tags = chunk.owner[:chunk.used, op]
            found = np.flatnonzero(np.isin(tags, wanted, kind="table"))
            if len(found):
                owners.append(tags[found])
                positions.append(chunk.positions[found])
                chunk_of.append(np.full(len(found), c))
                rows.append(found)
                chunk.owner[found, op] = -1
        if not owners:
            return {}
        owners, positions = np.concatenate(owners), np.concatenate(positions)
        order = np.lexsort((positions, owners))  # stable: rows of one (request, position) stay in fill order
        owners, positions = owners[order], positions[order]
        last = np.append((owners[1:] != owners[:-1]) | (positions[1:] != positions[:-1]), True)
        kept = order[last]  # each (request, position)'s last row, by request and position
        owners, positions = owners[last], positions[last]
        chunk_of, rows = np.concatenate(chunk_of)[kept], np.concatenate(rows)[kept]
        values = self._gather(chunk_of, rows, columns)
        starts = np.flatnonzero(np.append(True, owners[1:] != owners[:-1]))
        bounds = np.append(starts, len(owners))
        return {int(owners[a]): (torch.from_numpy(positions[a:b]), values[a:b])
                for a, b in zip(bounds[:-1], bounds[1:])}

    def _gather(self, chunk_of: np.ndarray, rows: np.ndarray, columns: slice) -> torch.Tensor:
        """The values in `columns` of rows[i] of chunk chunk_of[i], in that order: one copy from a
        single chunk, else one per chunk. index_select and index_copy_, not advanced indexing: for
        64 rows 7 us either way, against 13 us on an idle 2-core host and 5 ms on a busy one
        (torch's intra-op threads)."""
        if (chunk_of == chunk_of[0]).all():
            return self.chunks[chunk_of[0]].values[:, columns].index_select(0, torch.from_numpy(rows))
        values = torch.empty(len(rows), columns.stop - columns.start, dtype=self.dtype)
        for c in np.unique(chunk_of):
            at = np.flatnonzero(chunk_of == c)
            from_chunk = self.chunks[c].values[:, columns].index_select(0, torch.from_numpy(rows[at]))
            values.index_copy_(0, torch.from_numpy(at), from_chunk)
        return values

    def absorb(self, old: "ReadLog", moves: list[tuple[int, slice, int, slice]]) -> None:
        """The rows of another log (an area's before it was made again wider), for the ops that
        moves name: (op there, its columns there, op here, its columns here). Rows nobody there
        still owns are left behind. The old log's copies must be done."""
        ops_there = [m[0] for m in moves]
        for chunk in old.chunks:
            kept = np.flatnonzero((chunk.owner[:chunk.used, ops_there] >= 0).any(axis=1))
            if not len(kept):
                continue
            values = np.zeros((len(kept), self.width), dtype=chunk.values_np.dtype)
            owner = np.full((len(kept), self.ops), -1, dtype=np.int64)
            for op_there, columns_there, op_here, columns_here in moves:
                values[:, columns_here] = chunk.values_np[kept, columns_there]
                owner[:, op_here] = chunk.owner[kept, op_there]
            self.append(values, chunk.positions[kept], owner)

    def clear(self) -> None:
        for chunk in self.chunks:
            chunk.owner[:chunk.used] = -1
            chunk.owners = NOBODY


class ReadArea:
    """The step values of read ops side by side on the device: [max_tokens, width], token-major,
    each op's `columns` its step values (a view: the kernels take a row stride). A step's rows of
    every op in the area go home in one copy, into the next of LANDING_SLOTS pinned slots, and
    move, all columns at once, into the area's log when the slot comes round again (oldest slot
    first, so the log's rows stay in step order). A step of more rows than a slot holds goes in
    pieces, one slot each; one that fills more than LANDING_SLOTS - 1 slots waits for its first
    pieces' copies.

    Made for the read ops installed until a CUDA graph captures one of them (the control plane
    makes the area again, wider, for each install before that, and the new area's log absorbs the
    old one's rows); an install after that gets an area of its own: the captured graphs write to
    this one's addresses."""

    def __init__(self, widths: list[int], max_tokens: int, dtype: torch.dtype, device: torch.device,
                 copies: HomeCopies | None, alive):
        starts = np.cumsum([0, *widths]).tolist()
        self.columns = [slice(a, b) for a, b in zip(starts, starts[1:])]  # per op, in the order of `widths`
        self.values = torch.zeros(max_tokens, starts[-1], dtype=dtype, device=device)
        self.copies = copies  # None: nothing goes home (a TP rank other than 0)
        self.log = None if copies is None else ReadLog(starts[-1], len(widths), dtype, alive)
        if copies is None:
            return
        self.slot_rows = min(max_tokens, _rows_of(CHUNK_BYTES, dtype.itemsize * starts[-1]))
        self._landing = _host_empty((LANDING_SLOTS, self.slot_rows, starts[-1]), dtype, copies.pinned)
        self._landing_np = _as_numpy(self._landing)
        # per slot, the (first row, rows) of its last copy and that copy (`_copier`), kept: a steady
        # step's is the step before's (each torch call, a slice too, costs: see ReadLog)
        self._copies: list[tuple] = [(-1, -1, None)] * LANDING_SLOTS
        self._moves: list[tuple | None] = [None] * LANDING_SLOTS  # per slot: what to move once its copy is done
        self._turns = 0  # slots used so far: the next is turns % LANDING_SLOTS, the oldest copy

    def queue(self, owner: np.ndarray, positions: np.ndarray, owners: tuple[int, int]) -> None:
        """Queue the copy home of a step's first len(positions) rows (stream ordered: they are the
        step's once it is done) and their move into the log, tagged with `positions` and `owner`
        [rows, ops]: each token's request number per op, -1 where the op was off (`owners`: their
        range, `owners_range`)."""
        n = len(positions)
        for first in range(0, n, self.slot_rows):
            rows = min(self.slot_rows, n - first)
            slot = self._turns % LANDING_SLOTS
            self._turns += 1
            self._move(slot)  # the slot's last copy, into the log first
            kept_first, kept_rows, copy = self._copies[slot]
            if (kept_first, kept_rows) != (first, rows):
                copy = self._copier(first, rows, slot)
                self._copies[slot] = (first, rows, copy)
            copy()
            self._moves[slot] = (first, rows, owner, positions, owners, self.copies.marks)

    def move_ahead(self) -> None:
        """The landed rows of the slot the next copy takes (the oldest), into the log now, unless
        they are the last step's (their copy may not be done): called once a step's forward is
        queued (ControlPlane.launched), when the host works beside the GPU, so that the next step's
        preparation, which the GPU may be waiting for, finds that slot free."""
        if self.copies is None:
            return
        slot = self._turns % LANDING_SLOTS
        move = self._moves[slot]
        if move is not None and move[-1] < self.copies.marks - 1:
            self._move(slot)

    def _copier(self, first: int, rows: int, slot: int):
        """The copy of rows [first, first + rows) into the slot: on a GPU stream ordered and
        non-blocking, one runtime call (`cudart`); on the CPU numpy's (torch's copy of more than
        32,768 elements runs on its intra-op threads, and with one of them kept waiting by another
        thread on the core, steps stalled up to 7.7 ms: `bench/host_step.py` at 512 requests)."""
        if self.values.device.type == "cpu":
            source, target = _as_numpy(self.values)[first:first + rows], self._landing_np[slot, :rows]
            return lambda: np.copyto(target, source)
        return cudart.copy_home(self._landing[slot, :rows], self.values[first:first + rows])

    def _move(self, slot: int) -> None:
        move, self._moves[slot] = self._moves[slot], None
        if move is None:
            return
        first, rows, owner, positions, owners, mark = move
        self.copies.wait(mark)
        values, positions, owner = self._landing_np[slot, :rows], positions[first:first + rows], owner[first:first + rows]
        owned = (owner >= 0).any(axis=1)
        if not owned.all():  # rows of tokens no op keeps (reading apps off, or a position not kept) stay out of the log
            kept = np.flatnonzero(owned)
            values, positions, owner = values[kept], positions[kept], owner[kept]
        self.log.append(values, positions, owner, owners)

    def settle(self) -> None:
        """Every landed row into the log (waits for copies not done yet)."""
        if self.copies is not None:
            for turn in range(self._turns, self._turns + LANDING_SLOTS):  # oldest first
                self._move(turn % LANDING_SLOTS)

    def bring_home(self, numbers: np.ndarray) -> bool:
        """The landed rows into the log, oldest slot first (the log keeps step order), as far as
        copies the device is past go, never waiting; whether no row of these requests (numbers)
        is left in a slot whose copy is not done."""
        if self.copies is None:
            return True
        for turn in range(self._turns, self._turns + LANDING_SLOTS):
            slot = turn % LANDING_SLOTS
            move = self._moves[slot]
            if move is None:
                continue
            if not self.copies.reached(move[-1]):
                return not any(self._holds(self._moves[t % LANDING_SLOTS], numbers)
                               for t in range(turn, self._turns + LANDING_SLOTS))
            self._move(slot)
        return True

    @staticmethod
    def _holds(move: tuple | None, numbers: np.ndarray) -> bool:
        if move is None:
            return False
        first, rows, owner, _, (lowest, highest), _ = move
        if not ((numbers >= lowest) & (numbers <= highest)).any():
            return False
        return bool(np.isin(owner[first:first + rows], numbers).any())

    def take(self, numbers: list[int], op: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Op number `op`'s values of these requests (ReadLog.take); the area settled first."""
        return self.log.take(numbers, op, self.columns[op])


def _rows_of(budget: int, row_bytes: int) -> int:
    """Rows of row_bytes in about `budget` bytes (a chunk, a landing slot): 256 at least, 65,536 at most."""
    return max(256, min(65536, budget // max(row_bytes, 1)))


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a host tensor's memory, as integers of its element size (numpy has no
    bfloat16): copies through it are numpy's, not torch calls (see ReadLog)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy()


def _host_empty(shape: tuple, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    # a normal tensor, also when made during a step (vLLM runs those in inference mode): the log is
    # written outside it too (drain, before results are taken)
    with torch.inference_mode(False):
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
