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
    either of its elements is written, so ``out_row`` may be ``x_row``. Inlined into
    kernels where ``interleaved`` and ``sign`` are constants, so that only the loop in
    use is compiled and a ``sign`` of +1 costs nothing."""
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


def _rows_contiguous(x, cos, sin, out):  # pragma: no cover - see overload
    """Whether every row of the four arrays is contiguous (unit last-axis stride)."""
    raise NotImplementedError


@overload(_rows_contiguous, inline="always")
def _rows_contiguous_overload(x, cos, sin, out):
    # C-contiguous array types answer at compile time, so the general (slice) path is
    # not compiled at all for them; other layouts are asked at run time.
    if all(a.layout == "C" for a in (x, cos, sin, out)):
        return lambda x, cos, sin, out: True

    def impl(x, cos, sin, out):
        return (
            x.strides[3] == x.itemsize
            and out.strides[3] == out.itemsize
            and cos.strides[cos.ndim - 1] == cos.itemsize
            and sin.strides[sin.ndim - 1] == sin.itemsize
        )

    return impl


@njit(cache=True)
def _n_units(x, tile, n_groups):
    """Number of work units of ``x``: (batch, tile of ``tile`` tokens, head group)."""
    return x.shape[0] * ((x.shape[2] + tile - 1) // tile) * n_groups


def _make_kernels(interleaved: bool, inverse: bool):
    """The CPU kernels for one (interleaved, inverse) pair, both compiled in as
    constants: each call compiles only the rotation loop it runs.

    Work is split into *units*: one batch entry, a tile of ``tile`` consecutive tokens
    and a group of heads. A unit rotates its heads token tile by token tile, so the
    tile's cos/sin rows are read from memory once and then reused by every head from
    L1, while each head's rows stream through memory contiguously. Units are numbered
    (batch, tile, group); the parallel kernels give each thread contiguous chunks of
    them. The result does not depend on the split: every element is computed by the
    same arithmetic.
    """
    sign = np.float32(-1.0 if inverse else 1.0)  # exact in every compute type

    @njit(cache=True)
    def rope_units(x, cos, sin, positions, out, rotary_dim, first, end, tile, n_groups):
        num_heads = x.shape[1]
        seq_len = x.shape[2]
        head_size = x.shape[3]
        half = rotary_dim // 2
        n_tiles = (seq_len + tile - 1) // tile
        contiguous = _rows_contiguous(x, cos, sin, out)
        for unit in range(first, end):
            group = unit % n_groups
            b = unit // (n_tiles * n_groups)
            s0 = (unit // n_groups - b * n_tiles) * tile
            s1 = min(s0 + tile, seq_len)
            for h in range(group * num_heads // n_groups, (group + 1) * num_heads // n_groups):
                for s in range(s0, s1):
                    if contiguous:
                        x_offset = b * x.strides[0] + h * x.strides[1] + s * x.strides[2]
                        out_offset = b * out.strides[0] + h * out.strides[1] + s * out.strides[2]
                        _rotate_row(
                            _row(x, x_offset, head_size),
                            _row(cos, _cache_row_offset(cos, positions, b, s), half),
                            _row(sin, _cache_row_offset(sin, positions, b, s), half),
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

    @njit(cache=True)
    def serial(x, cos, sin, positions, out, rotary_dim, check_overlap, tile, n_groups):
        status = _preflight(x, cos, sin, positions, out, check_overlap)
        if status != DONE:
            return status
        n_units = _n_units(x, tile, n_groups)
        rope_units(x, cos, sin, positions, out, rotary_dim, 0, n_units, tile, n_groups)
        return DONE

    @njit(parallel=True, cache=True)
    def parallel(x, cos, sin, positions, out, rotary_dim, check_overlap, tile, n_groups, n_chunks):
        status = _preflight(x, cos, sin, positions, out, check_overlap)
        if status != DONE:
            return status
        n_units = _n_units(x, tile, n_groups)
        for chunk in prange(n_chunks):
            first = chunk * n_units // n_chunks
            end = (chunk + 1) * n_units // n_chunks
            rope_units(x, cos, sin, positions, out, rotary_dim, first, end, tile, n_groups)
        return DONE

    @njit(cache=True)
    def qk_units(q, k, cos, sin, positions, out_q, out_k, rotary_dim, first, end, tile, n_groups):
        # Unit by unit, q's heads then k's: both use the tile's cos/sin rows from L1.
        for unit in range(first, end):
            rope_units(q, cos, sin, positions, out_q, rotary_dim, unit, unit + 1, tile, n_groups)
            rope_units(k, cos, sin, positions, out_k, rotary_dim, unit, unit + 1, tile, n_groups)

    @njit(cache=True)
    def qk_serial(
        q, k, cos, sin, positions, out_q, out_k, rotary_dim, check_overlap, tile, n_groups
    ):
        status = _preflight_qk(q, k, cos, sin, positions, out_q, out_k, check_overlap)
        if status != DONE:
            return status
        n_units = _n_units(q, tile, n_groups)
        qk_units(q, k, cos, sin, positions, out_q, out_k, rotary_dim, 0, n_units, tile, n_groups)
        return DONE

    @njit(parallel=True, cache=True)
    def qk_parallel(
        q, k, cos, sin, positions, out_q, out_k, rotary_dim, check_overlap, tile, n_groups, n_chunks
    ):
        status = _preflight_qk(q, k, cos, sin, positions, out_q, out_k, check_overlap)
        if status != DONE:
            return status
        n_units = _n_units(q, tile, n_groups)
        for chunk in prange(n_chunks):
            first = chunk * n_units // n_chunks
            end = (chunk + 1) * n_units // n_chunks
            qk_units(
                q, k, cos, sin, positions, out_q, out_k, rotary_dim, first, end, tile, n_groups
            )
        return DONE

    return serial, parallel, qk_serial, qk_parallel


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


def first_bad_position(position_ids: np.ndarray, n_positions: int) -> int:
    """Range check of position ids of any integer dtype (see :func:`_first_bad_position`)."""
    return int(_first_bad_position(position_ids, n_positions))


# numba's "workqueue" threading layer (the fallback when neither OpenMP nor TBB is
# available) aborts the process when two Python threads enter a parallel region at
# once. Until the layer in use is known to be thread-safe, parallel calls take a lock.
_parallel_lock = threading.Lock()
_threading_layer_is_safe = False


#: Kernels by (interleaved, inverse), made on first use.
_kernel_sets: dict[tuple[bool, bool], tuple] = {}


def kernels(interleaved: bool, inverse: bool) -> tuple:
    """``(serial, parallel, qk_serial, qk_parallel)`` for these options."""
    key = (interleaved, inverse)
    found = _kernel_sets.get(key)
    if found is None:
        found = _kernel_sets[key] = _make_kernels(interleaved, inverse)
    return found


def work_split(batch: int, num_heads: int, seq_len: int, parallel: bool) -> tuple[int, int, int]:
    """``(tile, n_groups, n_chunks)`` for an input of this logical shape.

    Tiles of ``config.TOKENS_PER_TILE`` tokens; on one thread one group of all heads.
    In parallel, ``n_chunks`` = threads x ``config.CHUNKS_PER_THREAD`` chunks of units,
    and heads are split into groups only when there are fewer (batch, tile) units than
    chunks (e.g. one long decode step with many heads).
    """
    tile = max(1, config.TOKENS_PER_TILE)
    if not parallel:
        return tile, 1, 1
    n_chunks = max(1, numba.get_num_threads() * config.CHUNKS_PER_THREAD)
    units = batch * -(-seq_len // tile)
    n_groups = 1
    if units < n_chunks:
        n_groups = max(1, min(num_heads, -(-n_chunks // max(units, 1))))
    return tile, n_groups, max(1, min(n_chunks, units * n_groups))


def _run_parallel(kernel, args: tuple) -> int:
    global _threading_layer_is_safe
    if _threading_layer_is_safe:
        return kernel(*args)
    with _parallel_lock:
        status = kernel(*args)
        _threading_layer_is_safe = numba.threading_layer() in ("omp", "tbb")
    return status


def _parallel(size: int) -> bool:
    return size >= config.PARALLEL_MIN_ELEMENTS and numba.get_num_threads() > 1


def _launch_cpu(
    x,
    cos,
    sin,
    positions,
    out,
    interleaved: bool,
    rotary_dim: int,
    inverse: bool,
    check_overlap: bool = True,
) -> int:
    """Run the CPU kernel on validated NumPy arrays (16-bit formats as integer views,
    BHSD views of any layout).

    ``positions`` is None, int32/int64 position ids ``[batch, seq_len]``, or int64
    offsets ``[batch]``. Returns DONE, OVERLAP (``check_overlap`` and an input overlaps
    ``out``) or the index of the first bad position id (flat) or offset (batch entry);
    nothing is written unless it returns DONE.
    """
    serial, parallel, _, _ = kernels(interleaved, inverse)
    batch, num_heads, seq_len, _ = x.shape
    in_parallel = _parallel(x.size)
    tile, n_groups, n_chunks = work_split(batch, num_heads, seq_len, in_parallel)
    args = (x, cos, sin, positions, out, rotary_dim, check_overlap, tile, n_groups)
    if in_parallel:
        return _run_parallel(parallel, (*args, n_chunks))
    return serial(*args)


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
    inverse: bool,
    check_overlap: bool = True,
) -> int:
    """As :func:`_launch_cpu`, for q and k in one pass."""
    _, _, serial, parallel = kernels(interleaved, inverse)
    batch, _, seq_len, _ = q.shape
    in_parallel = _parallel(q.size + k.size)
    heads = max(q.shape[1], k.shape[1])
    tile, n_groups, n_chunks = work_split(batch, heads, seq_len, in_parallel)
    args = (q, k, cos, sin, positions, out_q, out_k, rotary_dim, check_overlap, tile, n_groups)
    if in_parallel:
        return _run_parallel(parallel, (*args, n_chunks))
    return serial(*args)
