"""CPU kernels: parallel ``@njit`` loops over the rows of the input.

A *row* is the ``head_size`` elements of one (batch, head, token). Rows are numbered
in the input's logical order ``(batch, head, seq)``; the parallel kernel splits that
range into contiguous chunks so each thread streams through memory, and small inputs
run the same row loop on the calling thread.

The kernels trust their arguments: :mod:`numba_rope._validation` has checked shapes,
dtypes and position ids before any of them runs. float16 and bfloat16 arrays arrive as
16-bit integer views (see :mod:`numba_rope._conversions`).
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from numba_rope import config
from numba_rope._conversions import narrow_like, widen
from numba_rope._rotation import rotate_pair


@njit(cache=True)
def _rotate_row(x_row, cos_row, sin_row, out_row, interleaved, rotary_dim):
    # Each iteration reads both elements of a pair before writing either, so the row
    # may be rotated in place (out_row is x_row).
    half = rotary_dim // 2
    if interleaved:
        for i in range(half):
            x1 = widen(x_row[2 * i])
            x2 = widen(x_row[2 * i + 1])
            y1, y2 = rotate_pair(x1, x2, widen(cos_row[i]), widen(sin_row[i]))
            out_row[2 * i] = narrow_like(y1, out_row)
            out_row[2 * i + 1] = narrow_like(y2, out_row)
    else:
        for i in range(half):
            x1 = widen(x_row[i])
            x2 = widen(x_row[i + half])
            y1, y2 = rotate_pair(x1, x2, widen(cos_row[i]), widen(sin_row[i]))
            out_row[i] = narrow_like(y1, out_row)
            out_row[i + half] = narrow_like(y2, out_row)
    for i in range(rotary_dim, x_row.shape[0]):
        out_row[i] = x_row[i]


def _cache_row_index(cache, position_ids, b, s):  # pragma: no cover - see overload
    """Index of the cache row of token (b, s): ``(b, s)`` or ``position_ids[b, s]``."""
    raise NotImplementedError


@overload(_cache_row_index, inline="always")
def _cache_row_index_overload(cache, position_ids, b, s):
    # Chosen at compile time from the type of position_ids.
    if position_ids is None or isinstance(position_ids, types.NoneType):
        return lambda cache, position_ids, b, s: (b, s)
    return lambda cache, position_ids, b, s: position_ids[b, s]


@njit(cache=True)
def _rope_rows(x, cos, sin, position_ids, out, interleaved, rotary_dim, first_row, end_row):
    """Rotate rows ``first_row <= r < end_row`` of ``x`` (numbered as (b, h, s))."""
    num_heads = x.shape[1]
    seq_len = x.shape[2]
    for row in range(first_row, end_row):
        s = row % seq_len
        bh = row // seq_len
        h = bh % num_heads
        b = bh // num_heads
        cache_row = _cache_row_index(cos, position_ids, b, s)
        _rotate_row(
            x[b, h, s], cos[cache_row], sin[cache_row], out[b, h, s], interleaved, rotary_dim
        )


@njit(cache=True)
def _rope_cpu_serial(x, cos, sin, position_ids, out, interleaved, rotary_dim):
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    _rope_rows(x, cos, sin, position_ids, out, interleaved, rotary_dim, 0, n_rows)


@njit(parallel=True, cache=True)
def _rope_cpu_parallel(x, cos, sin, position_ids, out, interleaved, rotary_dim, n_chunks):
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    for chunk in prange(n_chunks):
        first_row = chunk * n_rows // n_chunks
        end_row = (chunk + 1) * n_rows // n_chunks
        _rope_rows(x, cos, sin, position_ids, out, interleaved, rotary_dim, first_row, end_row)


@njit(cache=True)
def _first_bad_position(position_ids, n_positions):
    """Flat index of the first id outside ``[0, n_positions)``, or -1 if all are valid."""
    flat = 0
    for b in range(position_ids.shape[0]):
        for s in range(position_ids.shape[1]):
            p = position_ids[b, s]
            if p < 0 or p >= n_positions:
                return flat
            flat += 1
    return -1


def first_bad_position(position_ids: np.ndarray, n_positions: int) -> int:
    """Host-side range check of position ids (see :func:`_first_bad_position`)."""
    return int(_first_bad_position(position_ids, n_positions))


# numba's "workqueue" threading layer (the fallback when neither OpenMP nor TBB is
# available) aborts the process when two Python threads enter a parallel region at
# once. Until the layer in use is known to be thread-safe, parallel calls take a lock.
_parallel_lock = threading.Lock()
_threading_layer_is_safe = False


def _run_parallel(x, cos, sin, position_ids, out, interleaved, rotary_dim):
    global _threading_layer_is_safe
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    n_chunks = max(1, min(n_rows, numba.get_num_threads() * config.CHUNKS_PER_THREAD))
    if _threading_layer_is_safe:
        _rope_cpu_parallel(x, cos, sin, position_ids, out, interleaved, rotary_dim, n_chunks)
        return
    with _parallel_lock:
        _rope_cpu_parallel(x, cos, sin, position_ids, out, interleaved, rotary_dim, n_chunks)
        _threading_layer_is_safe = numba.threading_layer() in ("omp", "tbb")


def _launch_cpu(x, cos, sin, position_ids, out, interleaved: bool, rotary_dim: int) -> None:
    """Run the CPU kernel on validated NumPy arrays (16-bit formats as integer views)."""
    if x.size < config.PARALLEL_MIN_ELEMENTS or numba.get_num_threads() == 1:
        _rope_cpu_serial(x, cos, sin, position_ids, out, interleaved, rotary_dim)
    else:
        _run_parallel(x, cos, sin, position_ids, out, interleaved, rotary_dim)
