"""GPU only: the CUDA runtime calls a step's control rows and reads make through ctypes
(backend/cudart.py) against torch's own: the rows' copy to the device and the copy home land
the same bytes, on the current stream, after the work queued before it, and nothing else; an event
recorded and queried through them answers as torch's would.

    XMIX_GPU_OUT=$OUT python3 -m pytest -q tests/gpu/test_cudart_gpu.py -o addopts=""
"""
import pytest
import torch

from gpu_results import Results
from xmix_lens.backend import cudart

pytestmark = pytest.mark.gpu
RESULTS = Results("cudart_gpu.json")


def test_the_copy_home_lands_the_rows_after_the_work_queued_before_it():
    values = torch.randn(512, 66, device="cuda").to(torch.bfloat16)
    landing = torch.zeros(300, 66, dtype=torch.bfloat16, pin_memory=True)
    copy = cudart.copy_home(landing[:200], values[100:300])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # the copy goes on whatever stream is current when it runs
        torch.cuda._sleep(50_000_000)  # the device busy a while: the copy must wait for what follows
        values[100:300] += 1
        copy()
        stream.synchronize()
    assert torch.equal(landing[:200], values[100:300].cpu()) and not landing[200:].any()
    RESULTS.record("copy_home", rows=200, equal=True)


def test_the_rows_copy_lands_in_a_strided_view_after_the_work_queued_before_it_and_nowhere_else():
    control = torch.full((8, 2, 300), -7, dtype=torch.int32, device="cuda")  # as ControlPlane.control
    staged = torch.arange(5 * 2 * 120, dtype=torch.int32).view(5, 2, 120).pin_memory()
    copy = cudart.copy_rows_to_device(control[:5, :, :120], staged)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # the device busy a while: the copy must land after what follows
        control.fill_(-3)
        copy()
        stream.synchronize()
    expected = torch.full((8, 2, 300), -3, dtype=torch.int32)
    expected[:5, :, :120] = staged
    assert torch.equal(control.cpu(), expected)
    RESULTS.record("copy_rows_to_device", rows=10, width=120, pitch=300, equal=True)


def test_an_event_recorded_queried_and_waited_for_through_the_runtime_answers_as_torchs():
    event, twin = cudart.Event(), torch.cuda.Event()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of the device busy
    event.record(), twin.record()
    busy = (event.query(), twin.query())
    event.synchronize()
    after = (event.query(), twin.query())
    assert busy == (False, False) and after == (True, True)
    RESULTS.record("event", busy_then=busy, after_synchronize=after)
