"""The CUDA calls a step makes for its control rows and reads, through ctypes: the rows' copy to the
device, the reads' copy home, and their events' record, query and synchronize.

Through torch each call walks the dispatcher and its checks, and in an engine the host's caches
are cold when a step is prepared (the rest of the step ran between two preparations), so what a
call costs is the code it walks. On the H200's host, with 64 MiB written before each call,
torch's `copy_` of a step's rows took 126-138 us, `Event.record` 68-72 and `Event.query` 13-14,
against 25-27, 13-14 and 11 us for the same calls into the CUDA runtime (`bench/cuda_calls.py`:
bench/results/2026-12-03-gpu-cuda-calls.json). The calls go to the runtime torch loaded, on
torch's current stream, so they are ordered as torch's own would be.
"""
import ctypes
import functools

import torch

HOST_TO_DEVICE, DEVICE_TO_HOST = 1, 2  # cudaMemcpyKind
NOT_READY = 600  # cudaErrorNotReady: what cudaEventQuery returns for work not done yet


@functools.cache
def _runtime() -> ctypes.CDLL:
    """The CUDA runtime library torch loaded (its streams and events are torch's)."""
    with open("/proc/self/maps") as maps:
        loaded = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    if not loaded:
        raise RuntimeError("xmix-lens: torch has not loaded a CUDA runtime library (libcudart.so), which the "
                           "reads' copies home call; use a torch build for CUDA that links it dynamically (the "
                           "pip wheels do)")
    runtime = ctypes.CDLL(loaded[0])
    runtime.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    runtime.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                          ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    runtime.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    runtime.cudaEventQuery.argtypes = [ctypes.c_void_p]
    runtime.cudaEventSynchronize.argtypes = [ctypes.c_void_p]
    return runtime


def _checked(call: str, status: int) -> None:
    if status:
        raise RuntimeError(f"xmix-lens: {call} failed with CUDA error {status}")


def copy_home(target: torch.Tensor, source: torch.Tensor):
    """A call queueing `target` <- `source` (a device tensor into pinned host memory, both
    contiguous, of one size) on the current stream, non-blocking: as `target.copy_(source,
    non_blocking=True)` would, for the addresses they have now."""
    assert source.is_contiguous() and target.is_contiguous() and source.nbytes == target.nbytes
    memcpy, current_stream = _runtime().cudaMemcpyAsync, torch._C._cuda_getCurrentRawStream
    to, of, size, device = target.data_ptr(), source.data_ptr(), source.nbytes, source.device.index

    def copy() -> None:
        _checked("cudaMemcpyAsync", memcpy(to, of, size, DEVICE_TO_HOST, current_stream(device)))
    return copy


def copy_rows_to_device(target: torch.Tensor, source: torch.Tensor):
    """A call queueing `target` <- `source` (a contiguous tensor in pinned host memory into a device
    tensor of its shape whose rows, the last dimension, are contiguous and evenly spaced: a slice of
    the last dimension, such as `control[:ops, :, :width]`) on the current stream, non-blocking: one
    cudaMemcpy2DAsync. Through torch that is two copies, the pinned block into a contiguous device
    buffer and that into the view: torch copies from a strided view of pinned memory by way of
    pageable memory, which waits for the GPU to finish the work queued before it."""
    assert source.is_contiguous() and target.shape == source.shape and target.dtype == source.dtype
    assert target.stride(-1) == 1 and all(target.stride(i) == target.stride(i + 1) * target.shape[i + 1]
                                          for i in range(target.dim() - 2)), "rows not evenly spaced"
    memcpy_2d, current_stream = _runtime().cudaMemcpy2DAsync, torch._C._cuda_getCurrentRawStream
    item, row = target.element_size(), target.shape[-1]
    to, pitch, of = target.data_ptr(), target.stride(-2) * item if target.dim() > 1 else row * item, source.data_ptr()
    rows, device = target.numel() // row if row else 0, target.device.index

    def copy() -> None:
        _checked("cudaMemcpy2DAsync", memcpy_2d(to, pitch, of, row * item, row * item, rows, HOST_TO_DEVICE,
                                                current_stream(device)))
    return copy


class Event:
    """A CUDA event of the current device, as `torch.cuda.Event()`, its calls made directly."""

    def __init__(self):
        self._torch = torch.cuda.Event()  # owns the handle, which it makes at its first record
        self._torch.record()
        self._handle, self._device = self._torch.cuda_event, torch.cuda.current_device()
        runtime = _runtime()
        self._record, self._query, self._synchronize = (runtime.cudaEventRecord, runtime.cudaEventQuery,
                                                        runtime.cudaEventSynchronize)
        self._current_stream = torch._C._cuda_getCurrentRawStream

    def record(self) -> None:
        """On the current stream."""
        _checked("cudaEventRecord", self._record(self._handle, self._current_stream(self._device)))

    def query(self) -> bool:
        """Whether the work before the last record is done."""
        status = self._query(self._handle)
        if status != NOT_READY:
            _checked("cudaEventQuery", status)
        return status == 0

    def synchronize(self) -> None:
        _checked("cudaEventSynchronize", self._synchronize(self._handle))
