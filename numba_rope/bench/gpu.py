"""Array adapters (host <-> Numba device arrays, CuPy arrays, torch tensors) and GPU timing.

Nothing is imported from ``numba.cuda``, CuPy or torch until an adapter is made or a
function here runs, so that the module imports on a machine without a GPU.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from numba.core import config as numba_config

from numba_rope.bench.workloads import as_dtype

BFLOAT16 = as_dtype("bfloat16")


def installed(name: str) -> bool:
    """Whether a module can be imported, without importing it."""
    return importlib.util.find_spec(name) is not None


def simulator() -> bool:
    """Whether numba runs CUDA in its simulator (``NUMBA_ENABLE_CUDASIM=1``): on the CPU,
    where times mean nothing."""
    return bool(getattr(numba_config, "ENABLE_CUDASIM", False))


def cuda() -> Any:
    """``numba.cuda``, imported on first use."""
    from numba import cuda as numba_cuda

    return numba_cuda


class NumbaArrays:
    """numba-cuda device arrays (in the simulator too). On a GPU numba-cuda copies
    through the buffer protocol, which NumPy refuses for ml_dtypes' bfloat16 ("cannot
    include dtype 'E' in a buffer"): bfloat16 travels as its ``uint16`` bits, viewed
    back on either side (the README's recipe)."""

    name = "numba"

    def to_device(self, a):
        """``a`` on the GPU (None as it is), C- or Fortran-ordered as it lies, else
        made C-contiguous; bfloat16 of either byte order through its bits."""
        if a is None:
            return None
        if not (a.flags.c_contiguous or a.flags.f_contiguous):
            a = np.ascontiguousarray(a)
        if a.dtype.type is BFLOAT16.type:
            bits = np.dtype(np.uint16).newbyteorder(a.dtype.byteorder)
            return cuda().to_device(a.view(bits)).view(a.dtype)
        return cuda().to_device(a)

    def to_host(self, d) -> np.ndarray:
        if d.dtype.type is BFLOAT16.type:
            bits = np.dtype(np.uint16).newbyteorder(d.dtype.byteorder)
            return d.view(bits).copy_to_host().view(d.dtype)
        return d.copy_to_host()


class CupyArrays:
    """CuPy has no bfloat16: bfloat16 goes through Numba views of uint16 CuPy arrays
    (the recipe in the README)."""

    name = "cupy"

    def __init__(self):
        import cupy

        self.cupy = cupy

    def to_device(self, a):
        if a is None:
            return None
        if a.dtype == BFLOAT16:
            return cuda().as_cuda_array(self.cupy.asarray(a.view(np.uint16))).view(BFLOAT16)
        return self.cupy.asarray(a)

    def to_host(self, d) -> np.ndarray:
        if isinstance(d, self.cupy.ndarray):
            return self.cupy.asnumpy(d)
        return d.copy_to_host()


class TorchArrays:
    """torch tensors on ``device`` ("cuda" or "cpu"); bfloat16 travels as int16 bits,
    as NumPy has no bfloat16 torch understands."""

    name = "torch"

    def __init__(self, device: str = "cuda"):
        import torch

        self.torch = torch
        self.device = device

    def to_device(self, a):
        if a is None:
            return None
        a = np.ascontiguousarray(a)
        if not a.flags.writeable:  # torch warns on read-only arrays (the cases' are)
            a = a.copy()
        if a.dtype == BFLOAT16:
            return self.torch.from_numpy(a.view(np.int16)).view(self.torch.bfloat16).to(self.device)
        return self.torch.from_numpy(a).to(self.device)

    def to_host(self, t) -> np.ndarray:
        t = t.detach().to("cpu").contiguous()
        if t.dtype == self.torch.bfloat16:
            return t.view(self.torch.int16).numpy().view(BFLOAT16)
        return t.numpy()


def torch_on_gpu() -> Any:
    """The torch module if it is installed and sees a GPU (never in the simulator), else None."""
    if simulator() or not installed("torch"):
        return None
    import torch

    return torch if torch.cuda.is_available() else None


def libraries() -> list:
    """The adapters usable here: Numba always; CuPy and torch on a real GPU when installed."""
    found: list = [NumbaArrays()]
    if not simulator() and installed("cupy"):
        found.append(CupyArrays())
    if torch_on_gpu() is not None:
        found.append(TorchArrays())
    return found


def kernel_milliseconds(call: Callable[[], object], calls: int = 10) -> float | None:
    """Mean GPU time of the kernels and copies that one ``call`` runs, traced by CUPTI
    through ``torch.profiler`` (every kernel of the process, numba's too): the device's
    own time, without the host's. None where torch sees no GPU (the simulator)."""
    torch = torch_on_gpu()
    if torch is None:
        return None
    from torch.profiler import ProfilerActivity, profile

    numba_cuda = cuda()
    for _ in range(3):
        call()
    numba_cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as traced:
        for _ in range(calls):
            call()
        numba_cuda.synchronize()
    total_us = 0.0
    for event in traced.key_averages():
        value = getattr(event, "device_time_total", None)  # torch >= 2.4
        total_us += value if value is not None else getattr(event, "cuda_time_total", 0)
    return total_us / calls / 1e3


def gpu_milliseconds(
    call: Callable[[], object], repeats: int, warmup: int = 3, batch: int = 1
) -> float:
    """Median over ``repeats`` timings of ``batch`` back-to-back calls, each timing a pair of
    CUDA events on the default stream around the batch, divided by ``batch`` (wall clock
    in the simulator, where events do not time). A batch lets the host queue launches
    ahead of the GPU, so that a large kernel's time is not its host dispatch's; a call
    whose host work outlasts its kernel is timed as what a loop of such calls costs."""
    numba_cuda = cuda()
    for _ in range(warmup):
        call()
    numba_cuda.synchronize()
    times = []
    for _ in range(repeats):
        if simulator():
            start_s = time.perf_counter()
            for _ in range(batch):
                call()
            times.append((time.perf_counter() - start_s) * 1e3 / batch)
            continue
        start, end = numba_cuda.event(), numba_cuda.event()
        start.record()
        for _ in range(batch):
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return statistics.median(times)
