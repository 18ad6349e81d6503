"""CUDA kernels: the twin of :mod:`numba_rope._cpu.kernels` for arrays on an NVIDIA GPU.

Imported only when a call's arrays are on the GPU (importing ``numba.cuda`` costs time),
by :mod:`numba_rope._cuda.backend`, which launches them.
Under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the same kernels run on the
CPU, one Python thread per simulated CUDA thread.

Work split
    Each thread rotates one pair (or copies one pass-through channel) of one token for
    ``config.CUDA_HEADS_PER_THREAD`` consecutive heads, so the position id, the cache
    reads and the index arithmetic are shared by those heads, and all their loads are
    issued before the first store. A block is ``slot_threads x token_threads``: along x
    the pairs of a row (contiguous in memory), along y consecutive tokens. The grid is
    ``tokens x head groups``; both loops are grid-stride loops, so any shape fits in
    ``config.CUDA_MAX_BLOCKS`` blocks per dimension. Element addresses come from the
    arrays' own strides: views are read in place, never copied.

Numerics
    The rotation is :func:`numba_rope._rotation.rotate_pair`'s, one rounding per
    operation, with each product rounded explicitly (``fmul_rn``) so that NVVM and
    ptxas cannot contract it into an FMA: the same bits as the CPU. float16 is
    converted by the hardware (``cvt``, round to nearest even); bfloat16 arrives as a
    ``uint16`` view and is widened by a shift and narrowed to nearest even in integer
    arithmetic, as on the CPU.

Position ids
    A kernel never reads outside the caches: a token whose id is out of range gets a
    row of NaN. By default :func:`first_bad_position_cuda` runs first (one small kernel and
    one read-back), so that an ``IndexError`` is raised before anything is written.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from numba import cuda, types
from numba.core import config as numba_config

from numba_rope._rotation import rotate_pair

#: True when numba runs CUDA kernels in its simulator rather than on a GPU.
SIMULATOR = bool(getattr(numba_config, "ENABLE_CUDASIM", False))

# -- element conversions: stored element <-> compute type -----------------------------
# Written once for the GPU and the simulator: NumPy scalar semantics in the simulator,
# the same operations compiled by numba-cuda on a GPU.


@cuda.jit(device=True, inline="always")
def _unchanged(value):
    return value


@cuda.jit(device=True, inline="always")
def _to_float32(value):
    return np.float32(value)


@cuda.jit(device=True, inline="always")
def _to_float64(value):
    return np.float64(value)


@cuda.jit(device=True, inline="always")
def _to_float16(value):
    return np.float16(value)


if SIMULATOR:  # NumPy warns when a value rounds to infinity, the defined result here
    _to_float16_warning = _to_float16

    def _to_float16(value):
        with np.errstate(over="ignore"):
            return _to_float16_warning(value)


@cuda.jit(device=True, inline="always")
def _bfloat16_bits_to_float32(bits):
    return np.uint32(np.uint32(bits) << 16).view(np.float32)


@cuda.jit(device=True, inline="always")
def _float32_to_bfloat16_bits(value):
    bits = np.float32(value).view(np.uint32)
    high = bits >> 16
    if value != value:
        # NaN: the canonical quiet NaN of its sign (rounding could turn it into inf).
        return np.uint16((high & 0x8000) | 0x7FC0)
    # Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit. No NaN
    # is left, so the sum stays below 2**32.
    return np.uint16((bits + 0x7FFF + (high & 1)) >> 16)


# Per storage dtype: widening to the compute type, and rounding back.
_WIDEN = {
    "float32": _unchanged,
    "float64": _unchanged,
    "float16": _to_float32,
    "bfloat16": _bfloat16_bits_to_float32,
}
_NARROW = {
    "float32": _to_float32,
    "float64": _to_float64,
    "float16": _to_float16,
    "bfloat16": _float32_to_bfloat16_bits,
}


# -- the cache row of a token: by position id, by offset, or (b, s) -----------------------


@cuda.jit(device=True, inline="always")
def _valid_row(row, n_rows):
    return row if row >= 0 and row < n_rows else np.int64(-1)


@cuda.jit(device=True, inline="always")
def _row_by_position_id(positions, b, s, n_rows):
    """Cache row of token (b, s), or -1 if its id is outside the caches."""
    return _valid_row(np.int64(positions[b, s]), n_rows)  # uint64 > 2**63 wraps below 0


@cuda.jit(device=True, inline="always")
def _row_by_offsets(positions, b, s, n_rows):
    # Token s of entry b takes row offset + s, as with position ids offset + arange:
    # unchecked, only the tokens whose row is outside the caches get NaN rows. An int64
    # offset near 2**63 is compared with the rows left, never added to s (no overflow).
    # A uint64 offset above 2**63 is negative in int64 but no negative number: invalid
    # for every token (a wrapped offset plus s could land on a valid row). ``value <
    # value - value`` tells the two apart: a comparison in the offsets' own type (numba
    # compares a uint64 with 0 through float64), always false for unsigned ones.
    value = positions[b]
    offset = np.int64(value)
    if offset >= 0:
        return offset + s if offset < n_rows - s else np.int64(-1)
    if value < value - value:  # a negative offset: rows from offset + s >= 0 on
        return _valid_row(offset + s, n_rows)
    return np.int64(-1)


@cuda.jit(device=True, inline="always")
def _row_by_offset(positions, b, s, n_rows):
    return _valid_row(positions + s, n_rows)  # positions: one int64 offset for all


@cuda.jit(device=True, inline="always")
def _row_by_token(positions, b, s, n_rows):
    return np.int64(0)  # unused: the caches are indexed by (b, s); positions is a stand-in


@cuda.jit(device=True, inline="always")
def _entry_by_row(cache, row, b, s, i):
    return cache[row, i]


@cuda.jit(device=True, inline="always")
def _entry_by_token(cache, row, b, s, i):
    return cache[b, s, i]


#: How a kernel finds a token's cache row, by the kind of positions it is given.
_CACHE_ROW = {
    "ids": _row_by_position_id,
    "offsets": _row_by_offsets,
    "offset": _row_by_offset,
    "token": _row_by_token,
}


# -- the rotation, one rounding per operation ------------------------------------------
# The CPU's rotate_pair, with each product rounded on its own: NVVM and ptxas contract a
# multiplication and an addition into one FMA (one rounding fewer, a different result in
# the last place), unless the multiplication carries an explicit rounding mode
# (``mul.rn``, libdevice's ``fmul_rn``), which the PTX ISA leaves uncontracted. The
# simulator runs the CPU's own rotate_pair (compiled by numba: inf * 0 is NaN without a
# NumPy warning), and multiplies by the sign in NumPy scalars (a float32 stays one).

if SIMULATOR:

    @cuda.jit(device=True, inline="always")
    def _mul32(a, b):
        with np.errstate(invalid="ignore"):  # a signaling NaN times the sign: NaN
            return a * b

    _mul64 = _mul32
    _rotate_exact32 = _rotate_exact64 = rotate_pair
else:  # pragma: no cover - compiled for a GPU (tests/compile_for_gpu.py checks the PTX)
    from numba.cuda import libdevice

    _mul32, _mul64 = libdevice.fmul_rn, libdevice.dmul_rn

    @cuda.jit(device=True, inline="always")
    def _rotate_exact32(x1, x2, cos, sin):
        return _mul32(x1, cos) - _mul32(x2, sin), _mul32(x2, cos) + _mul32(x1, sin)

    @cuda.jit(device=True, inline="always")
    def _rotate_exact64(x1, x2, cos, sin):
        return _mul64(x1, cos) - _mul64(x2, sin), _mul64(x2, cos) + _mul64(x1, sin)


def _make_rope_kernel(input_dtype: str, cache_dtype: str, positions: str, heads_per_thread: int):
    """Compile-time specialisation of the kernel for one dtype pair and one kind of
    positions (see ``_CACHE_ROW``); closure variables are constants to numba: each
    choice is made once, not per element. One function for that reason: the device
    function and the kernel close over the same constants."""
    cache_row = _CACHE_ROW[positions]
    rotate, mul = (
        (_rotate_exact64, _mul64) if input_dtype == "float64" else (_rotate_exact32, _mul32)
    )
    cache_entry = _entry_by_token if positions == "token" else _entry_by_row
    widen_input = _WIDEN[input_dtype]
    narrow = _NARROW[input_dtype]
    compute = types.float64 if input_dtype == "float64" else types.float32
    widen_cache = _to_float64 if compute == types.float64 else _WIDEN[cache_dtype]
    nan = np.float64(np.nan) if compute == types.float64 else np.float32(np.nan)

    @cuda.jit(device=True)
    def _rotate_token(
        x, cos, sin, positions, out, interleaved, rotary_dim, n_slots, sign, first_head, token
    ):
        """This thread's slots of one token for heads ``first_head ..`` (up to
        ``heads_per_thread``). Slot ``j < rotary_dim/2`` rotates pair ``j``; slot
        ``j >= rotary_dim/2`` copies channel ``rotary_dim + j - rotary_dim/2`` (only
        when ``out`` is not ``x``)."""
        num_heads = x.shape[1]
        seq_len = x.shape[2]
        half = rotary_dim // 2
        x1s = cuda.local.array(heads_per_thread, compute)
        x2s = cuda.local.array(heads_per_thread, compute)
        b = token // seq_len
        s = token - b * seq_len
        row = cache_row(positions, b, s, cos.shape[0])
        valid = row >= 0
        slot = cuda.threadIdx.x
        while slot < n_slots:
            if slot < half:
                c = nan
                sn = nan
                if valid:
                    c = widen_cache(cache_entry(cos, row, b, s, slot))
                    sn = mul(widen_cache(cache_entry(sin, row, b, s, slot)), sign)
                i1 = 2 * slot if interleaved else slot
                i2 = i1 + 1 if interleaved else slot + half
                for k in range(heads_per_thread):
                    h = first_head + k
                    if h < num_heads:
                        x1s[k] = widen_input(x[b, h, s, i1])
                        x2s[k] = widen_input(x[b, h, s, i2])
                for k in range(heads_per_thread):
                    h = first_head + k
                    if h < num_heads:
                        y1, y2 = rotate(x1s[k], x2s[k], c, sn)
                        out[b, h, s, i1] = narrow(y1)
                        out[b, h, s, i2] = narrow(y2)
            else:
                channel = rotary_dim + slot - half
                for k in range(heads_per_thread):
                    h = first_head + k
                    if h < num_heads:
                        if valid:
                            out[b, h, s, channel] = x[b, h, s, channel]
                        else:
                            out[b, h, s, channel] = narrow(nan)
            slot += cuda.blockDim.x

    @cuda.jit
    def _rope_cuda(
        q,
        k,
        cos,
        sin,
        positions,
        out_q,
        out_k,
        interleaved,
        rotary_dim,
        slots_q,
        slots_k,
        n_groups,
        sign,
    ):
        """Head groups of q, then of k (which may have fewer heads), in one launch. One
        tensor is the case of ``n_groups`` = q's groups: k (then q itself) is never read."""
        n_tokens = q.shape[0] * q.shape[2]
        groups_q = (q.shape[1] + heads_per_thread - 1) // heads_per_thread
        # while loops, not range(start, stop, step): range divides to count its trips.
        group = cuda.blockIdx.y
        while group < n_groups:
            token = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
            while token < n_tokens:
                if group < groups_q:
                    _rotate_token(
                        q, cos, sin, positions, out_q, interleaved, rotary_dim, slots_q,
                        sign, group * heads_per_thread, token,
                    )  # fmt: skip
                else:
                    _rotate_token(
                        k, cos, sin, positions, out_k, interleaved, rotary_dim, slots_k,
                        sign, (group - groups_q) * heads_per_thread, token,
                    )  # fmt: skip
                token += cuda.gridDim.x * cuda.blockDim.y
            group += cuda.gridDim.y

    return _rope_cuda


_kernels: dict[tuple[str, str, str, int], Any] = {}
_kernels_lock = threading.Lock()


def rope_kernel(input_dtype: str, cache_dtype: str, positions: str, heads_per_thread: int):
    """The kernel for this dtype pair, kind of positions and heads per thread, compiled
    on first use (see :func:`_make_rope_kernel`)."""
    key = (input_dtype, cache_dtype, positions, heads_per_thread)
    kernel = _kernels.get(key)
    if kernel is None:
        with _kernels_lock:
            kernel = _kernels.setdefault(key, _make_rope_kernel(*key))
    return kernel


@cuda.jit
def first_bad_position_cuda(position_ids, n_positions, first_bad):
    """``first_bad[0]`` = the smaller of itself (a value above any index before the
    launch) and the flat index of the first id outside ``[0, n_positions)``; any grid."""
    seq_len = position_ids.shape[1]
    n_ids = position_ids.shape[0] * seq_len
    for flat in range(cuda.grid(1), n_ids, cuda.gridsize(1)):
        b = flat // seq_len
        position = np.int64(position_ids[b, flat - b * seq_len])  # uint64 > 2**63 wraps < 0
        if position < 0 or position >= n_positions:
            cuda.atomic.min(first_bad, 0, flat)
            break  # this thread's later ids have larger flat indices


@cuda.jit
def copy_cuda(source, destination):
    """``destination[...] = source`` for two 4-D arrays of one shape and dtype."""
    head_size = source.shape[3]
    n_rows = source.shape[0] * source.shape[1] * source.shape[2]
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for flat in range(start, n_rows * head_size, stride):
        row = flat // head_size
        d = flat - row * head_size
        s = row % source.shape[2]
        bh = row // source.shape[2]
        h = bh % source.shape[1]
        b = bh // source.shape[1]
        destination[b, h, s, d] = source[b, h, s, d]
