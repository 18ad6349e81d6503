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


def _cache_row_index(cache, position_ids, b, s):  # pragma: no cover - see overload
    """Index tuple of the cache row of token (b, s): ``(b, s)`` or ``(position_ids[b, s],)``."""
    raise NotImplementedError


@overload(_cache_row_index, inline="always")
def _cache_row_index_overload(cache, position_ids, b, s):
    # Chosen at compile time from the type of position_ids.
    if position_ids is None or isinstance(position_ids, types.NoneType):
        return lambda cache, position_ids, b, s: (b, s)
    return lambda cache, position_ids, b, s: (position_ids[b, s],)


@njit(cache=True)
def _rope_rows(x, cos, sin, position_ids, out, interleaved, rotary_dim, first_row, end_row):
    """Rotate rows ``first_row <= r < end_row`` of ``x`` (numbered as (b, h, s)).

    The arrays are indexed element by element rather than through per-row views: a
    view costs an atomic reference-count update, and two threads updating the same
    count took 70% longer than a copy of the data (float16, prefill shape). Written
    this way LLVM vectorizes the inner loops (with F16C conversions for float16).
    Each pair is read before either of its elements is written, so ``out`` may be
    ``x`` itself.
    """
    num_heads = x.shape[1]
    seq_len = x.shape[2]
    head_size = x.shape[3]
    half = rotary_dim // 2
    # Three integer divisions per row cost as much as moving a row, so the (b, h, s)
    # of the first row is computed once and then counted forward.
    s = first_row % seq_len
    h = (first_row // seq_len) % num_heads
    b = first_row // (seq_len * num_heads)
    for _ in range(end_row - first_row):
        row_index = _cache_row_index(cos, position_ids, b, s)
        if interleaved:
            for pair in range(half):
                # Unsigned indices: numba then emits no negative-index wrap-around,
                # which would otherwise keep these loops from vectorizing.
                i = np.uint64(pair)
                i1 = np.uint64(2 * pair)
                i2 = np.uint64(2 * pair + 1)
                x1 = widen(x[b, h, s, i1])
                x2 = widen(x[b, h, s, i2])
                y1, y2 = rotate_pair(
                    x1, x2, widen(cos[row_index + (i,)]), widen(sin[row_index + (i,)])
                )
                out[b, h, s, i1] = narrow_like(y1, out)
                out[b, h, s, i2] = narrow_like(y2, out)
        else:
            for pair in range(half):
                i = np.uint64(pair)
                i2 = np.uint64(pair + half)
                x1 = widen(x[b, h, s, i])
                x2 = widen(x[b, h, s, i2])
                y1, y2 = rotate_pair(
                    x1, x2, widen(cos[row_index + (i,)]), widen(sin[row_index + (i,)])
                )
                out[b, h, s, i] = narrow_like(y1, out)
                out[b, h, s, i2] = narrow_like(y2, out)
        for channel in range(rotary_dim, head_size):
            i = np.uint64(channel)
            out[b, h, s, i] = x[b, h, s, i]
        s += 1
        if s == seq_len:
            s = 0
            h += 1
            if h == num_heads:
                h = 0
                b += 1


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


def _check_positions(position_ids, n_positions):  # pragma: no cover - see overload
    raise NotImplementedError


@overload(_check_positions, inline="always")
def _check_positions_overload(position_ids, n_positions):
    if isinstance(position_ids, types.NoneType):
        return lambda position_ids, n_positions: -1
    return lambda position_ids, n_positions: _first_bad_position(position_ids, n_positions)


#: Kernel return codes besides a flat position-id index (>= 0).
DONE = -1
OVERLAP = -2


@njit(cache=True)
def _byte_range(a):
    """``[first, end)`` bytes that array ``a`` spans (empty for an empty array)."""
    first = np.int64(a.ctypes.data)
    end = first
    for axis in range(a.ndim):
        if a.shape[axis] == 0:
            return np.int64(0), np.int64(0)
        span = np.int64(a.shape[axis] - 1) * np.int64(a.strides[axis])
        if span < 0:
            first += span
        else:
            end += span
    return first, end + np.int64(a.itemsize)


@njit(cache=True)
def _overlaps(a, out):
    a_first, a_end = _byte_range(a)
    out_first, out_end = _byte_range(out)
    return a_first < out_end and out_first < a_end


def _ids_overlap(position_ids, out):  # pragma: no cover - see overload
    raise NotImplementedError


@overload(_ids_overlap, inline="always")
def _ids_overlap_overload(position_ids, out):
    if isinstance(position_ids, types.NoneType):
        return lambda position_ids, out: False
    return lambda position_ids, out: _overlaps(position_ids, out)


@njit(cache=True)
def _preflight(x, cos, sin, position_ids, out):
    """What must stop a launch before anything is written: OVERLAP when an input
    shares memory with ``out`` other than as the very same elements (rotating in
    place is safe), else the flat index of the first bad position id, else DONE."""
    same_elements = x.ctypes.data == out.ctypes.data and x.strides == out.strides
    if (
        (_overlaps(x, out) and not same_elements)
        or _overlaps(cos, out)
        or _overlaps(sin, out)
        or _ids_overlap(position_ids, out)
    ):
        return OVERLAP
    bad = _check_positions(position_ids, cos.shape[0])
    return DONE if bad < 0 else bad


@njit(cache=True)
def _rope_cpu_serial(x, cos, sin, position_ids, out, interleaved, rotary_dim):
    """Check (see :func:`_preflight`), then rotate every row. Returns DONE, OVERLAP or
    the flat index of the first bad position id; in the last two cases nothing has
    been written."""
    status = _preflight(x, cos, sin, position_ids, out)
    if status != DONE:
        return status
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    _rope_rows(x, cos, sin, position_ids, out, interleaved, rotary_dim, 0, n_rows)
    return DONE


@njit(parallel=True, cache=True)
def _rope_cpu_parallel(x, cos, sin, position_ids, out, interleaved, rotary_dim, n_chunks):
    """As :func:`_rope_cpu_serial`, with the rows split into ``n_chunks`` contiguous
    chunks run in parallel (each element's arithmetic is the same, so the result does
    not depend on the split)."""
    status = _preflight(x, cos, sin, position_ids, out)
    if status != DONE:
        return status
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    for chunk in prange(n_chunks):
        first_row = chunk * n_rows // n_chunks
        end_row = (chunk + 1) * n_rows // n_chunks
        _rope_rows(x, cos, sin, position_ids, out, interleaved, rotary_dim, first_row, end_row)
    return DONE


def first_bad_position(position_ids: np.ndarray, n_positions: int) -> int:
    """Range check of position ids of any integer dtype (see :func:`_first_bad_position`)."""
    return int(_first_bad_position(position_ids, n_positions))


# numba's "workqueue" threading layer (the fallback when neither OpenMP nor TBB is
# available) aborts the process when two Python threads enter a parallel region at
# once. Until the layer in use is known to be thread-safe, parallel calls take a lock.
_parallel_lock = threading.Lock()
_threading_layer_is_safe = False


def _run_parallel(x, cos, sin, position_ids, out, interleaved, rotary_dim, n_threads):
    global _threading_layer_is_safe
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    n_chunks = max(1, min(n_rows, n_threads * config.CHUNKS_PER_THREAD))
    if _threading_layer_is_safe:
        return _rope_cpu_parallel(x, cos, sin, position_ids, out, interleaved, rotary_dim, n_chunks)
    with _parallel_lock:
        bad = _rope_cpu_parallel(x, cos, sin, position_ids, out, interleaved, rotary_dim, n_chunks)
        _threading_layer_is_safe = numba.threading_layer() in ("omp", "tbb")
    return bad


def _launch_cpu(x, cos, sin, position_ids, out, interleaved: bool, rotary_dim: int) -> int:
    """Run the CPU kernel on validated NumPy arrays (16-bit formats as integer views).

    ``position_ids`` is None or an int32/int64 array. Returns DONE, OVERLAP or the
    flat index of the first out-of-range position id (see :func:`_rope_cpu_serial`).
    """
    if x.size >= config.PARALLEL_MIN_ELEMENTS:
        n_threads = numba.get_num_threads()
        if n_threads > 1:
            return _run_parallel(x, cos, sin, position_ids, out, interleaved, rotary_dim, n_threads)
    return _rope_cpu_serial(x, cos, sin, position_ids, out, interleaved, rotary_dim)
