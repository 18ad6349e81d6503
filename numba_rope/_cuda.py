"""CUDA kernels: the twin of :mod:`numba_rope._cpu` for arrays that live on an NVIDIA GPU.

Imported only when a call's arrays are on the GPU (importing ``numba.cuda`` costs time).
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
    The rotation is :func:`numba_rope._rotation.rotate_pair`, shared with the CPU.
    float16 is converted by the hardware (``cvt``, round to nearest even); bfloat16
    arrives as a ``uint16`` view and is widened by a shift and narrowed to nearest even
    in integer arithmetic, as on the CPU. On a real GPU, ptxas may contract a product
    and a sum into one FMA: results may then differ from the CPU's in the last place.

Position ids
    A kernel never reads outside the caches: a token whose id is out of range gets a
    row of NaN. By default :func:`first_bad_position` runs first (one small kernel and
    one read-back), so that an ``IndexError`` is raised before anything is written.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from numba import cuda, types
from numba.core import config as numba_config

from numba_rope import config
from numba_rope._rotation import rotate_pair

#: True when numba runs CUDA kernels in its simulator rather than on a GPU.
SIMULATOR = bool(getattr(numba_config, "ENABLE_CUDASIM", False))

#: Most blocks per grid dimension the launch uses on y (a hardware limit) and its
#: default limit on x; ``config.CUDA_MAX_BLOCKS`` may lower both.
_HARDWARE_MAX_BLOCKS = 65535


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
    return _valid_row(np.int64(positions[b]) + s, n_rows)


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


def _make_rope_kernel(
    input_dtype: str, cache_dtype: str, positions: str, heads_per_thread: int, fused: bool
):
    """Compile-time specialisation of the kernel for one dtype pair, one kind of
    positions (see ``_CACHE_ROW``) and one or two tensors (closure variables are
    constants to numba: each choice is made once, not per element)."""
    cache_row = _CACHE_ROW[positions]
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
                    sn = widen_cache(cache_entry(sin, row, b, s, slot)) * sign
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
                        y1, y2 = rotate_pair(x1s[k], x2s[k], c, sn)
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

    if not fused:

        @cuda.jit
        def _rope_cuda(x, cos, sin, positions, out, interleaved, rotary_dim, n_slots, sign):
            n_tokens = x.shape[0] * x.shape[2]
            n_groups = (x.shape[1] + heads_per_thread - 1) // heads_per_thread
            # while loops, not range(start, stop, step): range divides to count its trips.
            group = cuda.blockIdx.y
            while group < n_groups:
                token = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
                while token < n_tokens:
                    _rotate_token(
                        x,
                        cos,
                        sin,
                        positions,
                        out,
                        interleaved,
                        rotary_dim,
                        n_slots,
                        sign,
                        group * heads_per_thread,
                        token,
                    )
                    token += cuda.gridDim.x * cuda.blockDim.y
                group += cuda.gridDim.y

        return _rope_cuda

    @cuda.jit
    def _rope_cuda_qk(
        q, k, cos, sin, positions, out_q, out_k, interleaved, rotary_dim, slots_q, slots_k, sign
    ):
        """Head groups of q, then of k (which may have fewer heads), in one launch."""
        n_tokens = q.shape[0] * q.shape[2]
        groups_q = (q.shape[1] + heads_per_thread - 1) // heads_per_thread
        n_groups = groups_q + (k.shape[1] + heads_per_thread - 1) // heads_per_thread
        group = cuda.blockIdx.y
        while group < n_groups:
            token = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
            while token < n_tokens:
                if group < groups_q:
                    _rotate_token(
                        q,
                        cos,
                        sin,
                        positions,
                        out_q,
                        interleaved,
                        rotary_dim,
                        slots_q,
                        sign,
                        group * heads_per_thread,
                        token,
                    )
                else:
                    _rotate_token(
                        k,
                        cos,
                        sin,
                        positions,
                        out_k,
                        interleaved,
                        rotary_dim,
                        slots_k,
                        sign,
                        (group - groups_q) * heads_per_thread,
                        token,
                    )
                token += cuda.gridDim.x * cuda.blockDim.y
            group += cuda.gridDim.y

    return _rope_cuda_qk


_kernels: dict[tuple[str, str, str, int, bool], Any] = {}
_kernels_lock = threading.Lock()


def _rope_kernel(
    input_dtype: str, cache_dtype: str, positions: str, heads_per_thread: int, fused: bool = False
):
    key = (input_dtype, cache_dtype, positions, heads_per_thread, fused)
    kernel = _kernels.get(key)
    if kernel is None:
        with _kernels_lock:
            kernel = _kernels.setdefault(key, _make_rope_kernel(*key))
    return kernel


@cuda.jit
def _first_bad_position_cuda(position_ids, n_positions, first_bad):
    """One block: ``first_bad[0]`` = flat index of the first id outside
    ``[0, n_positions)``, or the number of ids if there is none."""
    seq_len = position_ids.shape[1]
    n_ids = position_ids.shape[0] * seq_len
    if cuda.threadIdx.x == 0:
        first_bad[0] = n_ids
    cuda.syncthreads()  # the reset is seen by every thread of the (only) block
    for flat in range(cuda.threadIdx.x, n_ids, cuda.blockDim.x):
        b = flat // seq_len
        position = np.int64(position_ids[b, flat - b * seq_len])  # uint64 > 2**63 wraps < 0
        if position < 0 or position >= n_positions:
            cuda.atomic.min(first_bad, 0, flat)
            break  # this thread's later ids have larger flat indices


@cuda.jit
def _copy_cuda(source, destination):
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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def positions_kind(positions) -> str:
    """``"token"`` (None), ``"offset"`` (one integer), ``"offsets"`` (1-D), ``"ids"`` (2-D)."""
    if positions is None:
        return "token"
    if isinstance(positions, (int, np.integer)):
        return "offset"
    return "offsets" if len(positions.shape) == 1 else "ids"


def _geometry(x, rotary_dim: int, in_place: bool, heads_per_thread: int):
    """``(n_slots, n_groups)`` of one tensor: slots per token row, head groups."""
    half = rotary_dim // 2
    n_slots = half if in_place else half + x.shape[3] - rotary_dim
    return n_slots, _cdiv(x.shape[1], heads_per_thread)


def _grid(n_tokens: int, n_slots: int, n_groups: int):
    threads = max(1, int(config.CUDA_THREADS_PER_BLOCK))
    max_blocks = max(1, min(int(config.CUDA_MAX_BLOCKS), _HARDWARE_MAX_BLOCKS))
    slot_threads = min(threads, max(1, n_slots))
    token_threads = max(1, threads // slot_threads)
    grid = (min(_cdiv(n_tokens, token_threads), max_blocks), min(n_groups, max_blocks))
    return grid, (slot_threads, token_threads)


def _kernel_arguments(cos, positions, sign: float, input_dtype: str):
    kind = positions_kind(positions)
    if kind == "offset":
        positions = np.int64(positions)
    elif kind == "token":
        positions = cos  # a real launch cannot marshal None: the kernel never reads it
    typed_sign = np.float64(sign) if input_dtype == "float64" else np.float32(sign)
    return kind, positions, typed_sign


def _launch_cuda(
    x,
    cos,
    sin,
    positions,
    out,
    interleaved: bool,
    rotary_dim: int,
    *,
    input_dtype: str,
    cache_dtype: str,
    in_place: bool,
    stream,
    sign: float = 1.0,
) -> None:
    """Launch the kernel on validated device arrays (BHSD views; bfloat16 as ``uint16``).

    ``positions``: None, 2-D ids, 1-D offsets or one integer offset. ``in_place``:
    ``out`` is ``x`` element for element, so pass-through channels are left alone
    instead of copied onto themselves.
    """
    heads_per_thread = max(1, int(config.CUDA_HEADS_PER_THREAD))
    n_slots, n_groups = _geometry(x, rotary_dim, in_place, heads_per_thread)
    if n_slots == 0:
        return
    kind, positions, sign = _kernel_arguments(cos, positions, sign, input_dtype)
    kernel = _rope_kernel(input_dtype, cache_dtype, kind, heads_per_thread)
    grid, block = _grid(x.shape[0] * x.shape[2], n_slots, n_groups)
    kernel[grid, block, stream](x, cos, sin, positions, out, interleaved, rotary_dim, n_slots, sign)


def _launch_cuda_qk(
    q,
    k,
    cos,
    sin,
    positions,
    out_q,
    out_k,
    interleaved: bool,
    rotary_dim: int,
    *,
    input_dtype: str,
    cache_dtype: str,
    q_in_place: bool,
    k_in_place: bool,
    stream,
    sign: float = 1.0,
) -> None:
    """q and k in one launch (see :func:`_launch_cuda`)."""
    heads_per_thread = max(1, int(config.CUDA_HEADS_PER_THREAD))
    slots_q, groups_q = _geometry(q, rotary_dim, q_in_place, heads_per_thread)
    slots_k, groups_k = _geometry(k, rotary_dim, k_in_place, heads_per_thread)
    if max(slots_q, slots_k) == 0:
        return
    kind, positions, sign = _kernel_arguments(cos, positions, sign, input_dtype)
    kernel = _rope_kernel(input_dtype, cache_dtype, kind, heads_per_thread, fused=True)
    grid, block = _grid(q.shape[0] * q.shape[2], max(slots_q, slots_k), groups_q + groups_k)
    kernel[grid, block, stream](
        q, k, cos, sin, positions, out_q, out_k, interleaved, rotary_dim, slots_q, slots_k, sign
    )


def copy(source, destination, stream) -> None:
    """Strided device-to-device copy of 4-D arrays (used when ``out`` overlaps an input)."""
    n = source.size
    threads = max(1, int(config.CUDA_THREADS_PER_BLOCK))
    blocks = max(1, min(_cdiv(n, threads), int(config.CUDA_MAX_BLOCKS), _HARDWARE_MAX_BLOCKS))
    _copy_cuda[blocks, threads, stream](source, destination)


# -- position-id check: one tiny kernel, one read-back ---------------------------------

_flags = threading.local()


def _flag_buffers(ordinal):
    """This thread's device flag and pinned host copy, per device. A call reads the
    flag back before returning, so reusing them across calls of one thread is safe."""
    buffers = getattr(_flags, "by_device", None)
    if buffers is None:
        buffers = _flags.by_device = {}
    pair = buffers.get(ordinal)
    if pair is None:
        pair = buffers[ordinal] = (cuda.device_array(1, np.int64), cuda.pinned_array(1, np.int64))
    return pair


def first_bad_position(position_ids, n_positions: int, stream, ordinal=None) -> int:
    """Flat index of the first out-of-range id in a device array of ids, or -1.

    Synchronizes ``stream`` (the one read-back of a checked call).
    """
    n_ids = position_ids.shape[0] * position_ids.shape[1]
    if n_ids == 0:
        return -1
    flag, host = _flag_buffers(ordinal)
    threads = max(1, min(int(config.CUDA_THREADS_PER_BLOCK), 1024, n_ids))
    _first_bad_position_cuda[1, threads, stream](position_ids, n_positions, flag)
    flag.copy_to_host(host, stream=stream)
    stream.synchronize()
    flat = int(host[0])
    return -1 if flat >= n_ids else flat


def read_element(array, index: tuple[int, ...]):
    """One element of a device array, copied to the host (error messages only)."""
    return array[index]


# -- streams -----------------------------------------------------------------------------

_streams: dict[tuple[Any, int], Any] = {}


def numba_stream(handle: int | None, ordinal=None):
    """A numba stream for a raw ``cudaStream_t`` handle (``None``/0: the default stream).

    External streams are cached by handle; in the simulator every stream is the default.
    """
    key = (ordinal, int(handle or 0))
    stream = _streams.get(key)
    if stream is None:
        if SIMULATOR or not key[1]:
            stream = cuda.default_stream()
        else:
            stream = cuda.external_stream(key[1])
        _streams[key] = stream
    return stream


def as_numba_stream(stream: Any, ordinal=None):
    """Accept a numba stream, a torch or CuPy stream, or a raw handle (int)."""
    if stream is None:
        return numba_stream(0, ordinal)
    if isinstance(stream, int):
        return numba_stream(stream, ordinal)
    for attribute in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        handle = getattr(stream, attribute, None)
        if isinstance(handle, int):
            return numba_stream(handle, ordinal)
    if hasattr(stream, "synchronize") and (SIMULATOR or hasattr(stream, "handle")):
        return stream  # already a numba stream
    raise TypeError(
        f"stream is a {type(stream).__module__}.{type(stream).__qualname__}; pass a numba "
        f"stream (numba.cuda.stream()), a torch.cuda.Stream, a cupy.cuda.Stream or a raw "
        f"cudaStream_t handle (int)"
    )


# -- device arrays: numba views of any array library, results of the caller's type --------


def bhsd_geometry(layout: str, logical_shape: tuple[int, ...]):
    """A geometry transform: the ``[batch, num_heads, seq_len, head_size]`` shape and
    strides of an input or output of any accepted form (see :func:`numba_view`)."""

    def transform(shape, strides):
        if len(shape) == 3:
            _, heads, _, head_size = logical_shape
            (batch, seq_len, _), (step_b, step_s, step_c) = shape, strides
            return (batch, heads, seq_len, head_size), (step_b, head_size * step_c, step_s, step_c)
        if layout == "bshd":
            return (shape[0], shape[2], shape[1], shape[3]), (
                strides[0],
                strides[2],
                strides[1],
                strides[3],
            )
        return shape, strides

    return transform


def column_geometry(shape, strides):
    """``[n]`` as ``[n, 1]`` (per-batch offsets checked by the position-id kernel)."""
    return (shape[0], 1), (strides[0], strides[0])


def _c_strides(shape, itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def numba_view(array: Any, library: str, storage: np.dtype, transform=None):
    """A numba device array over the same memory, with element type ``storage`` and,
    if given, the shape and strides ``transform(shape, strides)`` (strides in bytes).

    Never copies, never synchronizes: the kernels run on the caller's stream, which
    orders them after the work that produced the arrays.
    """
    if library == "numba" and (SIMULATOR or transform is None):
        if SIMULATOR and transform is not None:
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            host = array._ary  # the simulator's device array wraps a NumPy array
            shape, strides = transform(host.shape, host.strides)
            host = np.lib.stride_tricks.as_strided(host, shape=shape, strides=strides)
            array = FakeCUDAArray(host)
        return array if array.dtype == storage else array.view(storage)
    if library == "torch":
        itemsize = storage.itemsize
        shape = tuple(array.shape)
        strides = tuple(step * itemsize for step in array.stride())
        pointer = array.data_ptr()
    elif library == "cupy":
        shape, strides, pointer = tuple(array.shape), tuple(array.strides), array.data.ptr
    else:
        interface = array.__cuda_array_interface__
        shape, pointer = tuple(interface["shape"]), interface["data"][0]
        strides = interface.get("strides") or _c_strides(shape, storage.itemsize)
    if transform is not None:
        shape, strides = transform(shape, tuple(strides))
    description = {
        "shape": tuple(shape),
        "strides": tuple(strides),
        "data": (pointer, False),
        "typestr": storage.str,
        "version": 3,
    }
    return cuda.from_cuda_array_interface(description, owner=array, sync=False)


def byte_extent(view) -> tuple[int, int]:
    """``[first, last)`` bytes of device memory a numba view can touch."""
    if SIMULATOR:
        pointer = view._ary.__array_interface__["data"][0]
    else:
        pointer = view.device_ctypes_pointer.value or 0
    low = high = pointer
    for extent, stride in zip(view.shape, view.strides, strict=True):
        if extent == 0:
            return pointer, pointer
        reach = (extent - 1) * stride
        if reach < 0:
            low += reach
        else:
            high += reach
    return low, high + view.dtype.itemsize


def device_array(shape: tuple[int, ...], dtype: np.dtype, stream):
    return cuda.device_array(shape, dtype=dtype, stream=stream)
