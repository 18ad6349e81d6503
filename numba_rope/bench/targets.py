"""Where the benchmarks run: the host (NumPy arrays) or a CUDA GPU (numba-cuda device
arrays), and the copy of the input that is the bandwidth floor on each.

``numba.cuda`` is imported only when a :class:`CudaTarget` is made.
"""

from __future__ import annotations

import importlib.util

import numba
import numpy as np
from numba import prange

from numba_rope._aligned import empty_on_line
from numba_rope._jit import cached_njit
from numba_rope.bench.checks import UNSIGNED
from numba_rope.bench.workloads import DEVICES


class Unavailable(Exception):
    """An implementation or device that cannot run here; the message says why.

    ``everywhere`` marks reasons that hold for every case (a package not installed).
    """

    def __init__(self, reason: str, everywhere: bool = False):
        super().__init__(reason)
        self.everywhere = everywhere


@cached_njit(parallel=True)
def _copy_parallel(source, destination):
    # One flat loop: numba gives each thread one contiguous block of it.
    for i in prange(source.shape[0]):
        destination[i] = source[i]


def parallel_copy(source: np.ndarray, destination: np.ndarray) -> None:
    """Copy C-contiguous ``source`` into ``destination`` on numba's threads.

    Both are viewed as flat unsigned integers of their item size (numba has no
    float16 or bfloat16 type), so every dtype copies the same way.
    """
    unsigned = UNSIGNED[source.dtype.itemsize]
    _copy_parallel(source.reshape(-1).view(unsigned), destination.reshape(-1).view(unsigned))


class CpuTarget:
    """NumPy arrays on the host."""

    name = "cpu"

    def put(self, array):
        return array

    def empty_like(self, array):
        return empty_on_line(array.shape, array.dtype)

    def to_host(self, array) -> np.ndarray:
        return np.asarray(array)

    def synchronize(self) -> None:
        pass

    def copy(self, source, destination) -> None:
        parallel_copy(source, destination)

    def restore(self, source, destination) -> None:
        """Copy ``source`` into ``destination`` on the calling thread alone (untimed
        work between samples): numba's worker threads, woken by a parallel copy, spin
        on the other core for milliseconds after it, where the helper thread of the
        calls timed next would have to share that core with them (measured: the float16
        decode step in place ran alone for about 200 calls after each such reset, 29
        against 20 us a call)."""
        np.copyto(destination, source)


class CudaTarget:
    """numba-cuda device arrays; every timed call ends with ``cuda.synchronize()``."""

    name = "cuda"

    def __init__(self):
        if numba.config.ENABLE_CUDASIM:
            raise Unavailable(
                "NUMBA_ENABLE_CUDASIM=1: the CUDA simulator runs on the CPU, its times mean "
                "nothing; unset it to benchmark a GPU",
                everywhere=True,
            )
        if importlib.util.find_spec("numba.cuda") is None:  # pragma: no cover
            raise Unavailable("numba-cuda is not installed", everywhere=True)
        from numba import cuda

        if not cuda.is_available():
            raise Unavailable("no CUDA GPU: numba.cuda.is_available() is False", everywhere=True)
        self.cuda = cuda

    def put(self, array):
        if array is None:
            return None
        try:
            return self.cuda.to_device(np.ascontiguousarray(array))
        except Exception as error:  # e.g. a dtype numba-cuda cannot hold
            raise Unavailable(
                f"numba-cuda cannot copy a {array.dtype.name} array to the GPU: {error}"
            ) from None

    def empty_like(self, array):
        return self.cuda.device_array(array.shape, dtype=array.dtype)

    def to_host(self, array) -> np.ndarray:
        return array.copy_to_host()

    def synchronize(self) -> None:
        self.cuda.synchronize()

    def copy(self, source, destination) -> None:
        destination.copy_to_device(source)  # device to device

    def restore(self, source, destination) -> None:
        """:meth:`copy` (untimed work between samples)."""
        self.copy(source, destination)


def target(device: str) -> CpuTarget | CudaTarget:
    """The arrays and synchronisation of a device; ``Unavailable`` if it is absent."""
    if device == "cpu":
        return CpuTarget()
    if device == "cuda":
        return CudaTarget()
    raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
