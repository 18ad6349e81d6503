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
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.extending import intrinsic, overload

from numba_rope import config
from numba_rope._conversions import narrow_like, widen
from numba_rope._rotation import rotate_pair


def _cache_row_index(cache, positions, b, s):  # pragma: no cover - see overload
    """Index tuple of the cache row of token (b, s)."""
    raise NotImplementedError


@overload(_cache_row_index, inline="always")
def _cache_row_index_overload(cache, positions, b, s):
    # Chosen at compile time from the type of ``positions``: None (caches indexed by
    # token), 2-D position ids, or 1-D per-batch offsets (positions offset + s).
    if isinstance(positions, types.NoneType):
        return lambda cache, positions, b, s: (b, s)
    if positions.ndim == 2:
        return lambda cache, positions, b, s: (positions[b, s],)
    return lambda cache, positions, b, s: (positions[b] + s,)


def _cache_row_offset(cache, positions, b, s):  # pragma: no cover - see overload
    """Byte offset of the cache row of token (b, s)."""
    raise NotImplementedError


@overload(_cache_row_offset, inline="always")
def _cache_row_offset_overload(cache, positions, b, s):
    if isinstance(positions, types.NoneType):
        return lambda cache, positions, b, s: b * cache.strides[0] + s * cache.strides[1]
    if positions.ndim == 2:
        return lambda cache, positions, b, s: positions[b, s] * cache.strides[0]
    return lambda cache, positions, b, s: (positions[b] + s) * cache.strides[0]


@intrinsic
def _element_pointer(typingctx, array, byte_offset):
    """Pointer to the byte ``byte_offset`` past the start of ``array``'s data."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        address = builder.add(builder.ptrtoint(data, ir.IntType(64)), args[1])
        return builder.inttoptr(address, data.type)

    return types.CPointer(array.dtype)(array, byte_offset), codegen


@njit(cache=True, inline="always")
def _row(array, byte_offset, length):
    """A C-contiguous 1-D array over ``length`` elements of ``array`` starting at
    ``byte_offset``: no copy and, unlike a slice, no reference count to update."""
    return carray(_element_pointer(array, byte_offset), (length,))


@njit(cache=True, inline="always")
def _rotate_row(x_row, cos_row, sin_row, out_row, interleaved, rotary_dim, sign):
    """Rotate one row. The indices are unsigned: numba then emits no negative-index
    wrap-around, which would keep these loops from vectorizing. Each pair is read before
    either of its elements is written, so ``out_row`` may be ``x_row``."""
    half = rotary_dim // 2
    if interleaved:
        for pair in range(half):
            i = np.uint64(pair)
            i1 = np.uint64(2 * pair)
            i2 = np.uint64(2 * pair + 1)
            y1, y2 = rotate_pair(
                widen(x_row[i1]), widen(x_row[i2]), widen(cos_row[i]), widen(sin_row[i]) * sign
            )
            out_row[i1] = narrow_like(y1, out_row)
            out_row[i2] = narrow_like(y2, out_row)
    else:
        for pair in range(half):
            i = np.uint64(pair)
            i2 = np.uint64(pair + half)
            y1, y2 = rotate_pair(
                widen(x_row[i]), widen(x_row[i2]), widen(cos_row[i]), widen(sin_row[i]) * sign
            )
            out_row[i] = narrow_like(y1, out_row)
            out_row[i2] = narrow_like(y2, out_row)
    for channel in range(rotary_dim, x_row.shape[0]):
        i = np.uint64(channel)
        out_row[i] = x_row[i]


@njit(cache=True)
def _rope_rows(x, cos, sin, positions, out, interleaved, rotary_dim, sign, first_row, end_row):
    """Rotate rows ``first_row <= r < end_row`` of ``x`` (numbered as (b, h, s)).

    When every row is contiguous in memory (unit stride along the last axis of the
    input, the output and the caches: contiguous arrays, but also views such as
    ``qkv[..., :128]`` or transposed layouts), rows are taken as C-contiguous arrays
    over raw pointers, which LLVM vectorizes fully (F16C conversions for float16).
    Otherwise rows are slices (slower: each slice updates a shared reference count).
    ``sign`` is +1 or -1 (the inverse rotation): it multiplies the sines, exactly.
    """
    sign = np.float32(sign)  # +-1: exact in every compute type, keeps float32 float32
    num_heads = x.shape[1]
    seq_len = x.shape[2]
    head_size = x.shape[3]
    half = rotary_dim // 2
    contiguous_rows = (
        x.strides[3] == x.itemsize
        and out.strides[3] == out.itemsize
        and cos.strides[cos.ndim - 1] == cos.itemsize
        and sin.strides[sin.ndim - 1] == sin.itemsize
    )
    # Three integer divisions per row cost as much as moving a row, so the (b, h, s)
    # of the first row is computed once and then counted forward.
    s = first_row % seq_len
    h = (first_row // seq_len) % num_heads
    b = first_row // (seq_len * num_heads)
    for _ in range(end_row - first_row):
        if contiguous_rows:
            x_offset = b * x.strides[0] + h * x.strides[1] + s * x.strides[2]
            out_offset = b * out.strides[0] + h * out.strides[1] + s * out.strides[2]
            cos_row = _row(cos, _cache_row_offset(cos, positions, b, s), half)
            sin_row = _row(sin, _cache_row_offset(sin, positions, b, s), half)
            _rotate_row(
                _row(x, x_offset, head_size),
                cos_row,
                sin_row,
                _row(out, out_offset, head_size),
                interleaved,
                rotary_dim,
                sign,
            )
        else:
            row_index = _cache_row_index(cos, positions, b, s)
            _rotate_row(
                x[b, h, s],
                cos[row_index],
                sin[row_index],
                out[b, h, s],
                interleaved,
                rotary_dim,
                sign,
            )
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


@njit(cache=True)
def _first_bad_offset(offsets, n_positions, seq_len):
    """First batch entry whose positions ``offset .. offset + seq_len - 1`` leave
    ``[0, n_positions)``, or -1."""
    if seq_len == 0:
        return -1
    for b in range(offsets.shape[0]):
        if offsets[b] < 0 or offsets[b] > n_positions - seq_len:
            return b
    return -1


def _check_positions(positions, n_positions, seq_len):  # pragma: no cover - see overload
    raise NotImplementedError


@overload(_check_positions, inline="always")
def _check_positions_overload(positions, n_positions, seq_len):
    if isinstance(positions, types.NoneType):
        return lambda positions, n_positions, seq_len: -1
    if positions.ndim == 2:
        return lambda positions, n_positions, seq_len: _first_bad_position(positions, n_positions)
    return lambda positions, n_positions, seq_len: _first_bad_offset(
        positions, n_positions, seq_len
    )


#: Kernel return codes besides the index of a bad position id or offset (>= 0).
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
    """Whether the byte ranges of ``a`` and ``out`` intersect (a cheap, conservative
    test: interleaved views of one buffer, such as q and k of a fused qkv, do too)."""
    a_first, a_end = _byte_range(a)
    out_first, out_end = _byte_range(out)
    return a_first < out_end and out_first < a_end


def _positions_overlap(positions, out):  # pragma: no cover - see overload
    raise NotImplementedError


@overload(_positions_overlap, inline="always")
def _positions_overlap_overload(positions, out):
    if isinstance(positions, types.NoneType):
        return lambda positions, out: False
    return lambda positions, out: _overlaps(positions, out)


@njit(cache=True)
def _inputs_overlap(x, cos, sin, positions, out):
    """An input shares memory with ``out`` other than as the very same elements
    (rotating in place is safe)."""
    same_elements = x.ctypes.data == out.ctypes.data and x.strides == out.strides
    return (
        (_overlaps(x, out) and not same_elements)
        or _overlaps(cos, out)
        or _overlaps(sin, out)
        or _positions_overlap(positions, out)
    )


@njit(cache=True)
def _preflight(x, cos, sin, positions, out, check_overlap):
    """What must stop a launch before anything is written: OVERLAP, or the index of
    the first bad position; else DONE."""
    if check_overlap and _inputs_overlap(x, cos, sin, positions, out):
        return OVERLAP
    bad = _check_positions(positions, cos.shape[0], x.shape[2])
    return DONE if bad < 0 else bad


@njit(cache=True)
def _rope_cpu_serial(x, cos, sin, positions, out, interleaved, rotary_dim, sign, check_overlap):
    """Check, then rotate every row. Returns OVERLAP (``check_overlap`` and an input
    overlaps ``out``), the index of the first bad position id (flat) or offset (batch
    entry), or DONE; nothing is written unless it returns DONE."""
    status = _preflight(x, cos, sin, positions, out, check_overlap)
    if status != DONE:
        return status
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    _rope_rows(x, cos, sin, positions, out, interleaved, rotary_dim, sign, 0, n_rows)
    return DONE


@njit(parallel=True, cache=True)
def _rope_cpu_parallel(
    x, cos, sin, positions, out, interleaved, rotary_dim, sign, check_overlap, n_chunks
):
    """As :func:`_rope_cpu_serial`, with the rows split into ``n_chunks`` contiguous
    chunks run in parallel (each element's arithmetic is the same, so the result does
    not depend on the split)."""
    status = _preflight(x, cos, sin, positions, out, check_overlap)
    if status != DONE:
        return status
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    for chunk in prange(n_chunks):
        first_row = chunk * n_rows // n_chunks
        end_row = (chunk + 1) * n_rows // n_chunks
        _rope_rows(x, cos, sin, positions, out, interleaved, rotary_dim, sign, first_row, end_row)
    return DONE


@njit(cache=True)
def _qk_overlap(q, k, cos, sin, positions, out_q, out_k):
    return (
        _inputs_overlap(q, cos, sin, positions, out_q)
        or _inputs_overlap(k, cos, sin, positions, out_k)
        or _overlaps(k, out_q)
        or _overlaps(q, out_k)
        or _overlaps(out_q, out_k)
    )


@njit(cache=True)
def _preflight_qk(q, k, cos, sin, positions, out_q, out_k, check_overlap):
    """:func:`_preflight` for q and k together (cross overlaps included)."""
    if check_overlap and _qk_overlap(q, k, cos, sin, positions, out_q, out_k):
        return OVERLAP
    bad = _check_positions(positions, cos.shape[0], q.shape[2])
    return DONE if bad < 0 else bad


@njit(cache=True)
def _rope_rows_qk(
    q, k, cos, sin, positions, out_q, out_k, interleaved, rotary_dim, sign, first, end
):
    """Rows ``first <= r < end`` of q followed by k (rows of k numbered after q's)."""
    q_rows = q.shape[0] * q.shape[1] * q.shape[2]
    if first < q_rows:
        _rope_rows(
            q, cos, sin, positions, out_q, interleaved, rotary_dim, sign, first, min(end, q_rows)
        )
    if end > q_rows:
        _rope_rows(
            k,
            cos,
            sin,
            positions,
            out_k,
            interleaved,
            rotary_dim,
            sign,
            max(first, q_rows) - q_rows,
            end - q_rows,
        )


@njit(cache=True)
def _rope_cpu_qk_serial(
    q, k, cos, sin, positions, out_q, out_k, interleaved, rotary_dim, sign, check_overlap
):
    """q and k in one call (see :func:`_rope_cpu_serial` for the return codes)."""
    status = _preflight_qk(q, k, cos, sin, positions, out_q, out_k, check_overlap)
    if status != DONE:
        return status
    n_rows = q.shape[0] * q.shape[1] * q.shape[2] + k.shape[0] * k.shape[1] * k.shape[2]
    _rope_rows_qk(q, k, cos, sin, positions, out_q, out_k, interleaved, rotary_dim, sign, 0, n_rows)
    return DONE


@njit(parallel=True, cache=True)
def _rope_cpu_qk_parallel(
    q, k, cos, sin, positions, out_q, out_k, interleaved, rotary_dim, sign, check_overlap, n_chunks
):
    """q and k in one parallel region, their rows split into ``n_chunks`` chunks."""
    status = _preflight_qk(q, k, cos, sin, positions, out_q, out_k, check_overlap)
    if status != DONE:
        return status
    n_rows = q.shape[0] * q.shape[1] * q.shape[2] + k.shape[0] * k.shape[1] * k.shape[2]
    for chunk in prange(n_chunks):
        first = chunk * n_rows // n_chunks
        end = (chunk + 1) * n_rows // n_chunks
        _rope_rows_qk(
            q, k, cos, sin, positions, out_q, out_k, interleaved, rotary_dim, sign, first, end
        )
    return DONE


def first_bad_position(position_ids: np.ndarray, n_positions: int) -> int:
    """Range check of position ids of any integer dtype (see :func:`_first_bad_position`)."""
    return int(_first_bad_position(position_ids, n_positions))


# numba's "workqueue" threading layer (the fallback when neither OpenMP nor TBB is
# available) aborts the process when two Python threads enter a parallel region at
# once. Until the layer in use is known to be thread-safe, parallel calls take a lock.
_parallel_lock = threading.Lock()
_threading_layer_is_safe = False


def _run_parallel(kernel, args: tuple, n_rows: int, n_threads: int) -> int:
    global _threading_layer_is_safe
    n_chunks = max(1, min(n_rows, n_threads * config.CHUNKS_PER_THREAD))
    if _threading_layer_is_safe:
        return kernel(*args, n_chunks)
    with _parallel_lock:
        status = kernel(*args, n_chunks)
        _threading_layer_is_safe = numba.threading_layer() in ("omp", "tbb")
    return status


def _launch_cpu(
    x,
    cos,
    sin,
    positions,
    out,
    interleaved: bool,
    rotary_dim: int,
    sign: float,
    check_overlap: bool = True,
) -> int:
    """Run the CPU kernel on validated NumPy arrays (16-bit formats as integer views,
    BHSD views of any layout).

    ``positions`` is None, int32/int64 position ids ``[batch, seq_len]``, or int64
    offsets ``[batch]``. Returns DONE, OVERLAP or the index of the first bad position
    (see :func:`_rope_cpu_serial`).
    """
    args = (x, cos, sin, positions, out, interleaved, rotary_dim, sign, check_overlap)
    if x.size >= config.PARALLEL_MIN_ELEMENTS:
        n_threads = numba.get_num_threads()
        if n_threads > 1:
            n_rows = x.shape[0] * x.shape[1] * x.shape[2]
            return _run_parallel(_rope_cpu_parallel, args, n_rows, n_threads)
    return _rope_cpu_serial(*args)


def _launch_cpu_qk(
    q,
    k,
    cos,
    sin,
    positions,
    out_q,
    out_k,
    interleaved: bool,
    rotary_dim: int,
    sign: float,
    check_overlap: bool = True,
) -> int:
    """As :func:`_launch_cpu`, for q and k in one pass."""
    args = (q, k, cos, sin, positions, out_q, out_k, interleaved, rotary_dim, sign, check_overlap)
    if q.size + k.size >= config.PARALLEL_MIN_ELEMENTS:
        n_threads = numba.get_num_threads()
        if n_threads > 1:
            n_rows = q.shape[0] * q.shape[2] * (q.shape[1] + k.shape[1])
            return _run_parallel(_rope_cpu_qk_parallel, args, n_rows, n_threads)
    return _rope_cpu_qk_serial(*args)
