"""Outputs of large allocating CPU calls, kept for reuse once the caller has dropped
them (at most ``numba_rope.config.OUTPUT_POOL_BYTES``; 0 turns the pool off).

A fresh NumPy array of tens of megabytes is memory the operating system has never
given this process: the first write to each page faults, and the kernel zeroes it (on
the 2-core Zen 4 VM, 3.7-3.9 ms for 64 MiB from two threads), which is most of what an
allocating call costs beyond its ``out=`` form. onnxruntime's ``run()`` keeps freed
tensors in an arena and skips that; this pool does the same for our outputs, and so
keeps memory that the caller has released (at most ``config.OUTPUT_POOL_BYTES``, 256
MiB unless set).

An output handed out is a view of a pooled byte buffer; every view of it, however
derived, holds the buffer (NumPy points each view's ``base`` at the array that owns
the memory). A buffer is reused only when nothing but the pool refers to it. Its
reference count says so: in CPython with the GIL that count is exact, so the pool is
off in free-threaded builds. Code that keeps only a raw address of an output (ctypes,
``__array_interface__``) without the array must keep the array too, as it must for any
NumPy array that it lets go.
"""

from __future__ import annotations

import math
import os
import sys
import threading

import numpy as np

from numba_rope import config
from numba_rope._aligned import empty_on_line, placed_in

#: Outputs smaller than this are left to NumPy's allocator: glibc reuses freed blocks
#: below its mmap threshold (which rises up to 32 MiB as large blocks are freed)
#: without new page faults. A fresh array written once on the Zen 4 VM, against the
#: same write into an array kept: 1-8 MiB 1.01-1.09x, 16 MiB 1.5x, 33 MiB 2.2x, 64
#: MiB 1.5x (``np.copyto`` of ones, medians of 41).
MIN_BYTES = 16 << 20

#: float32 outputs of at least this many bytes that are not pooled start on a 64-byte
#: line (:func:`numba_rope._aligned.empty_on_line`), as torch's tensors and
#: onnxruntime's arena buffers do; NumPy's allocator puts them wherever glibc's heap
#: has room, often 16, 32 or 48 bytes past one, where each of the kernels' 64-byte
#: float32 stores spans two lines (docs/performance.md, "Fourteenth session").
LINE_MIN_BYTES = 256 << 10

#: Pooled outputs start on a 64-byte line: a buffer is this much longer than they are.
#: NumPy's large arrays start 16 bytes past one (glibc's chunk header), and there
#: the kernels' stores span two lines: a float32 prefill_3d into such an output took
#: 2.95 ms against 1.94 on a line, float16 prefill 1.63 against 1.10, on the Emerald
#: Rapids VM (docs/performance.md, "Fortieth session").
_LINE = 64

_lock = threading.Lock()
_buffers: list[np.ndarray] = []  # uint8 owners, least recently handed out first


def _references(buffers: list[np.ndarray], index: int) -> int:
    return sys.getrefcount(buffers[index])


def _free_references() -> int:
    # What _references reports for a buffer held by the list alone, on this interpreter.
    probe = [np.empty(1, np.uint8)]
    return _references(probe, 0)


_FREE = _free_references()
_USABLE = getattr(sys, "_is_gil_enabled", lambda: True)()


def empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized C-contiguous array of ``shape`` and ``dtype``: on a pooled
    buffer that nothing refers to any more when the pool is on and the array large
    enough, starting on a 64-byte line; else a new array, on a line for float32 from
    :data:`LINE_MIN_BYTES` up."""
    limit = config.OUTPUT_POOL_BYTES
    nbytes = math.prod(shape) * dtype.itemsize
    if not limit or nbytes < MIN_BYTES or nbytes > limit or not _USABLE:
        if nbytes >= LINE_MIN_BYTES and dtype == np.float32:
            return empty_on_line(shape, dtype)
        return np.empty(shape, dtype)
    with _lock:
        buffer = None
        for index in range(len(_buffers)):
            if _size(_buffers[index]) == nbytes and _references(_buffers, index) == _FREE:
                buffer = _buffers.pop(index)
                break
        if buffer is None:
            buffer = np.empty(nbytes + _LINE, np.uint8)
            _trim(limit - nbytes)
        _buffers.append(buffer)  # the most recently handed out last
        # On a line, with the buffer as its base (every view of it holds the buffer).
        return placed_in(buffer, shape, dtype, _LINE)


def _size(buffer: np.ndarray) -> int:
    """The bytes of the outputs a pooled buffer holds."""
    return buffer.nbytes - _LINE


def _trim(limit: int) -> None:
    """Drop pooled buffers, least recently handed out first, until those kept hold at
    most ``limit`` bytes. A buffer still in use is dropped from the pool too (its user
    keeps it; NumPy frees it after them)."""
    held = sum(_size(buffer) for buffer in _buffers)
    while _buffers and held > limit:
        held -= _size(_buffers.pop(0))


def clear() -> None:
    """Release every pooled buffer (those still in use stay with their users)."""
    with _lock:
        _buffers.clear()


def held_bytes() -> int:
    """Bytes of the outputs the pool's buffers hold, in use or free."""
    with _lock:
        return sum(_size(buffer) for buffer in _buffers)


def _on_config_change() -> None:
    with _lock:
        _trim(config.OUTPUT_POOL_BYTES)


config.on_change(_on_config_change)


def _reset_after_fork() -> None:
    # Another thread of the parent may have held the lock at the fork. The child keeps
    # the buffers: the arrays that refer to them were copied with the process.
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX only: Windows has no fork
    os.register_at_fork(after_in_child=_reset_after_fork)
