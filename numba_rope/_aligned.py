"""Uninitialized NumPy arrays whose data start on a cache line.

NumPy's allocator puts an array wherever glibc's heap has room, often 16, 32 or 48
bytes past a 64-byte line; then each 64-byte vector store of a kernel spans two lines.
torch's tensors and onnxruntime's arena buffers start on lines. The CPU backend places
large float32 outputs of allocating calls with this (``numba_rope._cpu.pool``), and the
bench every output it preallocates, for every implementation alike (see
``docs/performance.md``, "Thirteenth session" and "Fourteenth session").
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

_BYTE, _address, _ndarray = ctypes.c_char, ctypes.addressof, np.ndarray


def empty_on_line(
    shape: tuple[int, ...], dtype: np.typing.DTypeLike, boundary: int = 64, offset: int = 0
) -> np.ndarray:
    """An uninitialized C-contiguous array of ``shape`` and ``dtype`` whose data start
    ``offset`` bytes (``0 <= offset < boundary``) past a multiple of ``boundary``
    bytes: a view of a NumPy byte array ``boundary`` bytes longer (its ``base``, which
    the view keeps alive). An ``offset`` places an array where NumPy's allocator
    might (16 bytes past a line is usual), to measure or test that placement.

    >>> a = empty_on_line((3, 5), np.float32)
    >>> a.shape, a.dtype, a.flags.c_contiguous, a.__array_interface__["data"][0] % 64
    ((3, 5), dtype('float32'), True, 0)
    >>> empty_on_line((4,), np.float16, boundary=4096).__array_interface__["data"][0] % 4096
    0
    >>> empty_on_line((7,), np.float32, offset=16).__array_interface__["data"][0] % 64
    16
    >>> empty_on_line((7,), np.float32, offset=64)
    Traceback (most recent call last):
    ...
    ValueError: offset must lie in [0, boundary) = [0, 64), got 64
    """
    if not 0 <= offset < boundary:
        raise ValueError(f"offset must lie in [0, boundary) = [0, {boundary}), got {offset}")
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    return placed_in(np.empty(nbytes + boundary, np.uint8), shape, dtype, boundary, offset)


def placed_in(
    raw: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, boundary: int = 64, offset: int = 0
) -> np.ndarray:
    """A C-contiguous array of ``shape`` and ``dtype`` on the memory of the byte array
    ``raw`` (at least ``boundary`` bytes longer than it, see :func:`empty_on_line`),
    starting ``offset`` bytes past a multiple of ``boundary``; its ``base`` is ``raw``.

    >>> raw = np.empty(64 + 16, np.uint8)
    >>> placed_in(raw, (4,), np.dtype(np.float32)).__array_interface__["data"][0] % 64
    0
    """
    # The address through ctypes (0.4 us), not ``__array_interface__`` (1.5 us: a dict
    # of every field); the array made on ``raw``'s memory in one constructor call (0.3
    # us), not sliced, viewed and reshaped (0.7 us). (NumPy's stubs do not declare the
    # buffer protocol that ctypes takes.)
    start = (offset - _address(_BYTE.from_buffer(raw))) % boundary  # type: ignore[arg-type]
    return _ndarray(shape, dtype, raw, start)
