"""The CPU backend: NumPy arrays in, NumPy arrays out, computed by the kernels of
:mod:`numba_rope._cpu.kernels`.

For a validated call (:class:`numba_rope._validation.Call`) of one tensor or several
(q and k), :func:`run` allocates the outputs, puts positions in the kernels' form,
hands BHSD views of the arrays in their storage format (float16/bfloat16 as 16-bit
integer views, see :mod:`numba_rope._conversions`) to a kernel chosen by the launch
policy below, and decodes the kernel's status: an output that overlaps an input (the
inputs concerned are copied and the kernel runs again) or a bad position (raised with
the message of :mod:`numba_rope._validation`). Nothing is written before the kernel
has checked every position.

Small calls of a signature validated before skip all of this: :func:`plan_key` and
:func:`make_plan` build a *plan*, a closure that runs the serial kernel with the least
Python work, and falls back to the full path whenever it cannot decide alone.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numba
import numpy as np

from numba_rope import config
from numba_rope._conversions import BFLOAT16_STORAGE, FLOAT16_STORAGE
from numba_rope._cpu import helper, pool
from numba_rope._cpu.kernels import (
    DONE,
    FIRST_IN_PLACE,
    OVERLAP,
    PLAN_CACHES,
    PLAN_CHUNKS,
    PLAN_COS,
    PLAN_GROUPS,
    PLAN_K,
    PLAN_OUT,
    PLAN_OUT_K,
    PLAN_POSITIONS,
    PLAN_ROTARY_DIM,
    PLAN_RUNNER,
    PLAN_SIN,
    PLAN_SLOTS,
    PLAN_STREAM,
    PLAN_STREAM_START,
    PLAN_THREADS,
    PLAN_TILE,
    PLAN_X,
    SECOND_IN_PLACE,
    STREAM_ALIGNED,
    STREAM_UNALIGNED,
    first_bad_position,
    parallel,
    planned,
    planned_one,
    planned_parallel,
    planned_parallel_one,
    planned_shared,
    planned_shared_one,
    relayed,
    serial,
)
from numba_rope._cpu.relay import MAX_CHUNKS
from numba_rope._cpu.vector import (
    STREAM_ALIGNMENT,
    STREAM_COPY_ELEMENTS,
    STREAM_PAIRS,
    STREAM_START_ALIGNMENT,
    words_fill_lines,
)
from numba_rope._geometry import (
    SWAP_HEADS_AND_TOKENS,
    bhsd_array,
    bhsd_steps,
    elements_distinct,
)
from numba_rope._jit import parallel_regions_usable, require_jit, thread_count
from numba_rope._validation import (
    INT64_MAX,
    INT64_MIN,
    Call,
    kernel_offset,
    offset_error,
    position_error,
    shared_outputs_error,
)

name = "cpu"

#: Position-id dtypes the kernels take as they are; others are range-checked and
#: converted to int64 first.
_KERNEL_ID_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))


#: ``in_place`` flag of each tensor of a call, by its place.
_IN_PLACE_FLAGS = (FIRST_IN_PLACE, SECOND_IN_PLACE)


def describe(array: Any) -> tuple[Any, ...] | None:
    """``(shape, dtype)`` of an argument for validation, None for an absent one."""
    if array is None:
        return None
    return array.shape, array.dtype


def describe_out(array: Any) -> tuple[Any, ...] | None:
    """``(shape, dtype, writeable, distinct)`` of an output argument (see
    :data:`numba_rope._validation.Description`), None for an absent one."""
    if array is None:
        return None
    flags = array.flags
    distinct = flags.c_contiguous or elements_distinct(array.shape, array.strides, array.itemsize)
    return array.shape, array.dtype, bool(flags.writeable), distinct


def storage_dtype(dtype: np.dtype) -> np.dtype | None:
    """The integer dtype a 16-bit format travels as, else None. Validation has admitted
    only float32/float64 and the two 16-bit formats, of which float16 has kind "f" and
    ml_dtypes' bfloat16 kind "V"."""
    if dtype.itemsize != 2:
        return None
    return np.dtype(FLOAT16_STORAGE if dtype.kind == "f" else BFLOAT16_STORAGE)


def _storage(array: np.ndarray) -> np.ndarray:
    """The array as the kernels take it (see :func:`storage_dtype`)."""
    storage = storage_dtype(array.dtype)
    return array if storage is None else array.view(storage)


def run(
    call: Call,
    inputs: tuple,
    outs: tuple,
    cos: np.ndarray,
    sin: np.ndarray,
    position_ids: Any,
    position_offset: Any,
    check_position_ids: bool = True,
) -> tuple:
    """Rotate the validated NumPy tensors ``inputs`` into ``outs`` (allocated where
    None) and return the outputs.

    Positions are always checked on the CPU (a pass over ``[batch, seq_len]``
    integers): ``check_position_ids`` is accepted and ignored.
    """
    results = tuple(
        pool.empty(x.shape, x.dtype) if out is None else out
        for x, out in zip(inputs, outs, strict=True)
    )
    positions = _kernel_positions(call, position_ids, position_offset)
    # Empty tensors go to the kernel too: it checks the positions and rotates nothing.
    views = tuple(
        _in_place_pair(
            _storage(bhsd_array(x, call.layout, shape)),
            _storage(bhsd_array(out, call.layout, shape)),
            out is x,
        )
        for x, out, shape in zip(inputs, results, call.shapes, strict=True)
    )
    args = (_storage(cos), _storage(sin), positions)
    status = launch(views, args, call)
    if status == OVERLAP:
        # Rare: the byte ranges of an output and an input intersect. Copy the inputs
        # that really share memory with an output, then launch without the range test.
        if len(views) == 2 and np.shares_memory(views[0][1], views[1][1]):
            raise shared_outputs_error()
        views, args = _separate_from_outs(views, args)
        status = launch(views, args, call, check_overlap=False)
    if status >= 0:
        _raise_position_error(status, call, position_ids, position_offset)
    return results


def _kernel_positions(call: Call, position_ids: Any, position_offset: Any) -> Any:
    """What the kernels take for positions: None, int32/int64 ids, int64 offsets, or
    one ``np.int64`` offset for the whole batch.

    Ids of other integer dtypes are range-checked as given (a uint64 id may not fit
    int64) before conversion; a scalar offset is checked here. Everything else is
    checked by the kernel before it writes.
    """
    kind = call.positions
    if kind == "ids":
        if position_ids.dtype in _KERNEL_ID_DTYPES:
            return position_ids
        bad = int(first_bad_position(position_ids, call.n_positions))
        if bad >= 0:
            _raise_position_error(bad, call, position_ids, None)
        return position_ids.astype(np.int64)
    if kind == "offset":
        # An empty batch has no position to check, as an empty sequence has none.
        positions = call.seq_len if call.batch else 0
        return np.int64(kernel_offset(int(position_offset), positions, call.n_positions))
    if kind == "offsets":
        offsets = np.asarray(position_offset)
        if offsets.dtype == np.uint64 and offsets.size and offsets.max() > INT64_MAX:
            b = int(np.argmax(offsets > INT64_MAX))
            raise offset_error(b, int(offsets[b]), call.seq_len, call.n_positions)
        return offsets.astype(np.int64)
    return None


def _raise_position_error(index: int, call: Call, position_ids, position_offset):
    """Decode a kernel's bad-position status: the flat index of an id, or the batch
    entry of an offset."""
    if position_ids is not None:
        value = int(position_ids.reshape(-1)[index])
        raise position_error(index, tuple(position_ids.shape), value, call.n_positions)
    value = int(np.asarray(position_offset).reshape(-1)[index])
    raise offset_error(index, value, call.seq_len, call.n_positions)


def _same_elements(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the very same elements: the same array, or two views
    of one memory with the same address, shape and strides. ``np.may_share_memory``
    (bounds only, 0.4 us) first: the address costs 3 us (``__array_interface__``)."""
    return a is b or (
        a.shape == b.shape
        and a.strides == b.strides
        and np.may_share_memory(a, b)
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    )


def _in_place_pair(
    x: np.ndarray, out: np.ndarray, same: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The views ``(x, out)`` of one tensor for :func:`launch`, or ``(out, out)`` when
    the output is the input's very elements: the caller passed the same array
    (``same``), or another view of its memory laid out alike (``out=x[...]``,
    ``out=buffer[i]`` for the input ``buffer[i]``). The in-place kernels then run,
    given the output, which is writable, as the input. The two-pointer kernels give
    the same bits on such a call, but LLVM's vector loops test their pointers for
    overlap and fall back to scalar code: a partial (4, 16, 2048, 128) float16 call in
    place through another view took 1.9x the time of ``out=x`` (3.18 against 1.66 ms,
    one process)."""
    if same or _same_elements(x, out):
        return out, out
    return x, out


def _unshared(array, out):
    """``array``, or a copy of it if it really shares memory with ``out``."""
    if isinstance(array, np.ndarray) and np.shares_memory(array, out):
        return array.copy()
    return array


def _separate_from_outs(views: tuple, args: tuple) -> tuple[tuple, tuple]:
    """Copy the inputs that share memory with an output (exactly tested), except an
    input that *is* its own output element for element: rotating in place is safe."""
    outs = [out for _, out in views]
    separated = []
    for i, (x, own_out) in enumerate(views):
        for j, out in enumerate(outs):
            if not (i == j and _same_elements(x, out)):
                x = _unshared(x, out)
        separated.append((x, own_out))
    for out in outs:
        args = tuple(_unshared(a, out) for a in args)
    return tuple(separated), args


# -- launch policy: which kernel, how many threads, which row code ------------------------

# numba's "workqueue" threading layer (the fallback when neither OpenMP nor TBB is
# available) aborts the process when two Python threads enter a parallel region at
# once. Until the layer in use is known to be thread-safe, parallel calls take a lock.
_parallel_lock = threading.Lock()
_threading_layer_is_safe = False


def _reset_after_fork() -> None:
    # A thread of the parent may have held the lock at the fork: in the child it would
    # be held forever, by a thread that does not exist there.
    global _parallel_lock
    _parallel_lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX only: Windows has no fork
    os.register_at_fork(after_in_child=_reset_after_fork)


class Kernels(NamedTuple):
    """The CPU kernels (:func:`numba_rope._cpu.kernels.serial`, ``parallel``,
    ``relayed``: the same functions for every option set) with the options of the
    runner they are given (see :func:`kernels`)."""

    options: tuple[bool, bool, bool, int, bool, bool, bool]
    serial: Any
    parallel: Any
    relayed: Any

    def runner(self, x, k, cos, sin, positions) -> int:
        """Address of the runner (:func:`numba_rope._cpu.kernels.make_runner`) of these
        options for arguments of the kinds of these (compiled, or loaded from numba's
        cache, the first time in the process)."""
        return helper.runner(self.options, (x, k, cos, sin, positions)).address


#: Kernels by (interleaved, inverse, contiguous, in_place, words, streaming,
#: token_major), made on first use.
_kernel_sets: dict[tuple[bool, bool, bool, int, bool, bool, bool], Kernels] = {}


def kernels(
    interleaved: bool,
    inverse: bool,
    contiguous: bool,
    in_place: int = 0,
    words: bool = False,
    streaming: bool = False,
    token_major: bool = False,
) -> Kernels:
    """The kernels for these options (see
    :func:`numba_rope._cpu.kernels.make_runner`; ``words``, ``streaming`` and
    ``token_major`` only with ``contiguous``)."""
    streaming = streaming and contiguous
    words = words and contiguous
    token_major = token_major and contiguous
    key = (interleaved, inverse, contiguous, int(in_place), words, streaming, token_major)
    found = _kernel_sets.get(key)
    if found is None:
        require_jit()
        found = _kernel_sets[key] = Kernels(key, serial, parallel, relayed)
    return found


def streaming(rotary_dim: int, interleaved: bool, *outs, inputs: tuple = ()) -> bool:
    """Whether the kernels write these outputs (storage views, BHSD) with non-temporal
    stores: outputs of at least ``config.STREAMING_MIN_BYTES`` together, none of them
    the very elements of its input (``inputs``, in the order of ``outs``; in place,
    whether through the same array or another view of its memory), float32 or 16-bit
    elements, and every row starting on ``STREAM_ALIGNMENT`` bytes, so do its channels
    past ``rotary_dim`` and, for non-interleaved pairs, its second half (which the
    streaming intrinsics of :mod:`numba_rope._cpu.vector` need).

    And rows whose every element the vector steps store: the rotated pairs a multiple
    of :data:`STREAM_PAIRS`, the channels past ``rotary_dim`` a multiple of
    :data:`STREAM_COPY_ELEMENTS`. What the steps leave, the element loops write with
    ordinary stores, into the lines the steps stream: on the Intel AVX-512 VM such rows
    took 20-40x the time of ordinary stores alone (float32 heads of 40 channels, 24
    rotated, 77 ms against 1.9; bfloat16 heads of 80, 48 rotated, 72 against 4;
    docs/performance.md, "Thirty-third session").

    Not in place: a non-temporal store is for a line the cache does not hold, and in
    place every line was just read. A (1, 4096, 4096) prefill rotated in place took
    2.8x (float32) and 5.2x (float16) the time with non-temporal stores on the Zen 4
    VM (one process; docs/performance.md, "Seventh session"): the form of vLLM's op
    and of flash-attn's ``inplace`` calls."""
    return (
        streamable_shapes(rotary_dim, interleaved, *outs)
        and not any(_same_elements(x, out) for x, out in zip(inputs, outs, strict=False))
        and all(
            stream_aligned(out, stream_start(out.dtype, rotary_dim, interleaved)) for out in outs
        )
    )


def streamable_shapes(rotary_dim: int, interleaved: bool, *outs) -> bool:
    """The part of :func:`streaming` that the outputs' shapes and dtypes and the
    options decide (the same for every call of a compiled plan): enough bytes, rows
    whose every element the vector steps store, and elements of at most 4 bytes whose
    last aligned part starts on ``STREAM_ALIGNMENT`` bytes of the row."""
    if sum(out.nbytes for out in outs) < config.STREAMING_MIN_BYTES:
        return False
    if (rotary_dim // 2) % STREAM_PAIRS:
        return False
    offset = rotary_dim if interleaved else rotary_dim // 2  # of the last aligned part
    for out in outs:
        if (out.shape[-1] - rotary_dim) % STREAM_COPY_ELEMENTS:
            return False
        if out.itemsize > 4 or (offset * out.itemsize) % STREAM_ALIGNMENT:
            return False
    return True


def stream_start(dtype: np.dtype, rotary_dim: int, interleaved: bool) -> int:
    """The bytes on which an output of this storage dtype must start to stream (see
    :func:`stream_aligned`): ``STREAM_ALIGNMENT`` for float32, float16 and interleaved
    bfloat16 rows, and for bfloat16 rows of non-interleaved pairs whose halves are
    whole 64-byte lines on targets whose word steps fill a line
    (:func:`~numba_rope._cpu.vector.words_fill_lines`): the steps of such rows off a
    line start on it (:meth:`numba_rope._cpu.vector._Stream.off_line`,
    :meth:`~numba_rope._cpu.vector._Stream.shifted_lines`). Other bfloat16 rows, whose
    steps off a line would store across lines, ``STREAM_START_ALIGNMENT`` (a line; see
    :data:`numba_rope._cpu.vector.STREAM_START_ALIGNMENT`).

    >>> stream_start(BFLOAT16_STORAGE, 96, False), stream_start(BFLOAT16_STORAGE, 96, True)
    (64, 16)
    """
    if dtype != BFLOAT16_STORAGE or interleaved:
        return STREAM_ALIGNMENT
    if (rotary_dim // 2 * dtype.itemsize) % 64 == 0 and words_fill_lines():
        return STREAM_ALIGNMENT
    return STREAM_START_ALIGNMENT


def stream_aligned(out: np.ndarray, start: int) -> bool:
    """The part of :func:`streaming` that depends on where an output lies: its first
    element on ``start`` bytes (:func:`stream_start`) and its rows on
    ``STREAM_ALIGNMENT`` bytes (``kernels`` checks the same for the calls of a
    compiled plan)."""
    if out.ctypes.data % start:
        return False
    return not any(stride % STREAM_ALIGNMENT for stride in out.strides[:-1])


def rows_contiguous(*arrays) -> bool:
    """Whether every row of these arrays is contiguous (unit stride along the last axis):
    the kernels then take rows as C-contiguous arrays over raw pointers."""
    for array in arrays:
        if array.strides[-1] != array.itemsize:
            return False
    return True


def row_format(*arrays) -> tuple[bool, bool]:
    """``(contiguous, words)`` of the kernels for these storage arrays: whether all
    rows are contiguous (:func:`rows_contiguous`), and whether they are also all
    bfloat16, to be taken two elements per 32-bit word."""
    contiguous = rows_contiguous(*arrays)
    return contiguous, contiguous and takes_words(*(a.dtype for a in arrays))


def takes_words(*storage_dtypes) -> bool:
    """Whether arrays of these storage dtypes are all bfloat16 (``words`` kernels)."""
    return all(dtype == BFLOAT16_STORAGE for dtype in storage_dtypes)


def work_split(
    batch: int,
    num_heads: int,
    seq_len: int,
    parallel: bool,
    threads: int | None = None,
    token_major: bool = False,
    cache_step: int = 0,
) -> tuple[int, int, int]:
    """``(tile, n_groups, n_chunks)`` for an input of this logical shape.

    Tiles of ``config.TOKENS_PER_TILE`` tokens; on one thread one group of all heads.
    In parallel, ``n_chunks`` = numba's threads x ``config.CHUNKS_PER_THREAD`` chunks
    of units, or where ``threads`` is given (2 for the caller and the helper thread)
    ``threads`` x ``config.HELPER_CHUNKS_PER_THREAD``, at most ``relay.MAX_CHUNKS``;
    heads are split into groups only when there are fewer (batch, tile) units than
    chunks (e.g. one long decode step with many heads). ``token_major`` (the kernels
    that take a unit token by token, see :func:`token_major`): tiles short enough that
    each chunk gets whole tokens (consecutive memory) rather than a group of heads.
    ``cache_step`` (:func:`cache_step`, in parallel and not ``token_major``): tiles
    whose cache rows span at most ``config.CACHE_SPAN_BYTES`` of each cache.

    >>> work_split(1, 32, 4096, False), work_split(1, 32, 4096, True, 2, cache_step=2048)[0]
    ((8192, 1, 1), 128)
    """
    tile = max(1, config.TOKENS_PER_TILE)
    if not parallel:
        return tile, 1, 1
    if cache_step and not token_major:
        tile = max(1, min(tile, config.CACHE_SPAN_BYTES // cache_step))
    if threads is None:
        n_chunks = max(1, numba.get_num_threads() * config.CHUNKS_PER_THREAD)
    else:  # shared with the helper thread: at most what its claims can count
        n_chunks = max(1, min(threads * config.HELPER_CHUNKS_PER_THREAD, MAX_CHUNKS))
    if token_major and seq_len > 1:
        tiles_per_sequence = -(-n_chunks // max(batch, 1))
        tile = max(1, min(tile, -(-seq_len // tiles_per_sequence)))
    units = batch * -(-seq_len // tile)
    n_groups = 1
    if units < n_chunks:
        n_groups = max(1, min(num_heads, -(-n_chunks // max(units, 1))))
    return tile, n_groups, max(1, min(n_chunks, units * n_groups))


#: Bytes of a cache line (x86).
LINE_BYTES = 64


def sequences_apart(*outputs: np.ndarray) -> bool:
    """Whether the sequences (batch entries) of these BHSD outputs lie at least a cache
    line apart, or there is one: else, as in Fortran order (the batch axis innermost in
    memory), they share lines and the call runs on one thread. The work is split by
    sequence first (:func:`work_split`), and two threads writing into the same lines
    take each line from the other at every store: (2, 8, 64, 64) float32 in Fortran
    order took 530 us on two threads of the Zen 4 VM, 51 on one (10 in C order)."""
    return all(o.shape[0] == 1 or abs(o.strides[0]) >= LINE_BYTES for o in outputs)


def token_major(x: np.ndarray) -> bool:
    """Whether the kernels take this BHSD view's units token by token (each token's
    heads one after another) rather than head by head: one token (a decode step, whose
    heads share its cos/sin row), or heads that lie inside tokens in memory (the
    ``bshd`` layout and ONNX's 3-D input), whose token-major order reads memory
    front to back. A choice of order only: the bits are the same."""
    return x.shape[2] == 1 or (x.shape[1] > 1 and abs(x.strides[1]) < abs(x.strides[2]))


def cache_step(cos, sin) -> int:
    """0 where a sequence's consecutive cache rows lie next to each other
    (:func:`rows_dense`) or a sequence has one row; else the distance in bytes between
    consecutive rows, the larger of the two caches': a large call then takes tiles that
    span at most ``config.CACHE_SPAN_BYTES`` of each (:func:`work_split`). Such rows
    come from positions broadcast over the batch (``np.cos(positions[..., None] *
    frequencies)`` gives strides ``(half, batch * half, 1)`` elements: a row every
    ``batch`` rows) and from transformers' ``cat(freqs, freqs)`` cut in half.

    Until 2026-12-05 such caches were copied, at each large call, into one buffer of
    rows next to each other (a copy of up to a quarter of the input's bytes, and no
    compiled plan for these calls); shorter tiles read them where they lie, mostly in
    less time (``config.CACHE_SPAN_BYTES``).

    >>> cos = np.zeros((4, 2, 8), np.float32).transpose(1, 0, 2)  # 2 sequences, rows 2 apart
    >>> cache_step(cos, cos), cache_step(np.ascontiguousarray(cos), cos.copy())
    (64, 0)
    """
    if cos.shape[-2] < 2:
        return 0
    step = max(abs(cos.strides[-2]), abs(sin.strides[-2]))
    if step <= cos.shape[-1] * cos.itemsize or rows_dense(cos, sin):
        return 0
    return step


def rows_dense(cos, sin) -> bool:
    """Whether a sequence's consecutive cache rows lie next to each other in memory:
    each cache C-contiguous, or both in one buffer whose row ``p`` holds cos row ``p``
    and sin row ``p`` (in either order), and per-token caches' sequences one after the
    other or all the same rows (a batch axis of stride 0). Rows a power of two apart,
    or with holes (transformers' ``cat(cos, cos)`` rows cut in half), are not.

    >>> both = np.zeros((16, 2, 4), np.float32)   # rows of cos then sin
    >>> rows_dense(both[:, 0], both[:, 1]), rows_dense(both[::2, 0], both[::2, 1])
    (True, False)
    """
    itemsize = cos.itemsize
    row = cos.shape[-1] * itemsize
    if cos.shape != sin.shape or cos.strides != sin.strides:
        return False
    if cos.shape[-1] > 1 and cos.strides[-1] != itemsize:
        return False
    step = row
    if cos.shape[-2] > 1:
        step = cos.strides[-2]
        gap = abs(sin.__array_interface__["data"][0] - cos.__array_interface__["data"][0])
        if step != row and not (step == 2 * row and gap == row):
            return False
    return cos.ndim == 2 or cos.shape[0] == 1 or cos.strides[0] in (0, cos.shape[1] * step)


def _run_parallel(kernel, args: tuple) -> int:
    global _threading_layer_is_safe
    if _threading_layer_is_safe:
        return kernel(*args)
    with _parallel_lock:
        status = kernel(*args)
        _threading_layer_is_safe = numba.threading_layer() in ("omp", "tbb")
    return status


def _parallel(size: int) -> bool:
    """Whether a call of ``size`` elements runs the parallel kernel: a large call, in a
    process that may run parallel regions (not a fork child of a process that started
    GNU OpenMP's threads, see :func:`numba_rope._jit.parallel_regions_usable`; numba's
    thread count is not even asked there), with more than one thread."""
    return (
        size >= config.PARALLEL_MIN_ELEMENTS
        and parallel_regions_usable()
        and numba.get_num_threads() > 1
    )


def launch(
    views: tuple, args: tuple, call: Call, check_overlap=True, report: dict | None = None
) -> int:
    """Run a kernel on validated storage views: ``views`` holds ``(input, output)``
    BHSD views of one or two tensors, ``args`` the caches and the kernel positions.
    A pair whose output is its input, the same array object, runs the in-place
    kernels (:data:`FIRST_IN_PLACE`, :data:`SECOND_IN_PLACE`; see
    :func:`_in_place_pair`).

    Returns DONE, OVERLAP (``check_overlap`` and an input overlaps an output) or the
    index of the first bad position id (flat) or offset (batch entry); nothing is
    written unless it returns DONE.

    ``report``: a dict given by a plan (:func:`make_plan`), into which what was
    chosen is written for a compiled plan of a large call (:func:`remember_fast`):
    ``options`` (the runner's), ``split`` (``(tile, n_groups, n_chunks)``),
    ``parallel`` (numba's parallel region), ``caches`` (:func:`cache_step`),
    ``contiguous`` and ``stream``.
    """
    x, out = views[0]
    k, out_k = views[1] if len(views) > 1 else (None, None)
    in_place = sum(flag for flag, (i, o) in zip(_IN_PLACE_FLAGS, views, strict=False) if i is o)
    cos, sin, positions = args
    size = sum(v.size for v, _ in views)
    contiguous, words = row_format(*(a for pair in views for a in pair), cos, sin)
    stream = streaming(
        call.rotary_dim, call.interleaved, *(o for _, o in views), inputs=tuple(x for x, _ in views)
    )
    batch, _, seq_len, _ = x.shape
    by_token = token_major(x)  # strided rows too: see kernels.strided_order
    chosen = kernels(call.interleaved, call.inverse, contiguous, in_place, words, stream, by_token)
    runner = chosen.runner(x, k, cos, sin, positions)
    apart = sequences_apart(*(o for _, o in views))
    in_parallel = apart and _parallel(size)
    relay = apart and not in_parallel and helper.usable(size)
    heads = max(v.shape[1] for v, _ in views)
    step = cache_step(cos, sin) if in_parallel else 0
    tile, n_groups, n_chunks = work_split(
        batch, heads, seq_len, in_parallel or relay, 2 if relay else None, by_token, step
    )
    arguments = (x, k, cos, sin, positions, out, out_k, call.rotary_dim, check_overlap)
    if report is not None:
        report.update(
            options=chosen.options, split=(tile, n_groups, n_chunks), parallel=in_parallel,
            caches=step, contiguous=contiguous, stream=stream,
        )  # fmt: skip
    if in_parallel:
        return _run_parallel(chosen.parallel, (*arguments, tile, n_groups, n_chunks, runner))
    if relay:
        the_helper = helper.helper()
        the_helper.start()
        return chosen.relayed(*arguments, tile, n_groups, n_chunks, the_helper.block, runner)
    return chosen.serial(*arguments, tile, n_groups, runner)


# -- plans: small calls of a signature validated before -----------------------------------

#: Plans of NumPy calls already validated, by :func:`plan_key`; see :func:`make_plan`.
PLANS: dict[tuple, Any] = {}

#: Most plans kept; past it the table starts again (a program uses a few shapes).
MAX_PLANS = 512


def plan_key(
    x,
    k,
    cos,
    sin,
    position_ids,
    out,
    out_k,
    interleaved,
    rotary_dim,
    layout,
    num_heads,
    num_kv_heads,
    inverse,
    offset=None,
):
    """What a call's validation depends on (shapes, dtypes, options), or None if the
    call is not one a plan can run: every array a NumPy array, the options of exact
    types (``1`` and ``True`` hash alike but only ``True`` is valid), no offset, a
    Python ``int`` offset or a NumPy array of offsets (their values are checked by the
    kernel). ``k`` and ``out_k`` are None for one tensor (``x`` is a NumPy array: the
    caller has checked)."""
    if (
        not (offset is None or type(offset) is int or type(offset) is np.ndarray)
        or type(cos) is not np.ndarray
        or type(sin) is not np.ndarray
        or not (position_ids is None or type(position_ids) is np.ndarray)
        or not (out is None or type(out) is np.ndarray)
        or not (interleaved is False or interleaved is True)
        or not (inverse is False or inverse is True)
        or type(rotary_dim) is not int
        or type(layout) is not str
        or not (num_heads is None or type(num_heads) is int)
    ):
        return None
    key = (
        x.shape,
        x.dtype,
        cos.shape,
        cos.dtype,
        sin.shape,
        sin.dtype,
        None if position_ids is None else position_ids.shape,
        None if position_ids is None else position_ids.dtype,
        None if out is None else out.shape,
        None if out is None else out.dtype,
        interleaved,
        rotary_dim,
        layout,
        num_heads,
        inverse,
        # None, int, or an array's shape and dtype
        offset if offset is None else int if type(offset) is int else (offset.shape, offset.dtype),
    )
    if k is None:
        return key
    if (
        type(k) is not np.ndarray
        or not (out_k is None or type(out_k) is np.ndarray)
        or not (num_kv_heads is None or type(num_kv_heads) is int)
    ):
        return None
    return (
        *key,
        k.shape,
        k.dtype,
        None if out_k is None else (out_k.shape, out_k.dtype),
        num_kv_heads,
    )


def remember_plan(key: tuple, plan: Any) -> None:
    if len(PLANS) >= MAX_PLANS:
        PLANS.clear()
    PLANS[key] = plan


def make_plan(
    call: Call,
    inputs: tuple,
    cos: np.ndarray,
    position_ids: Any,
    key_options: tuple = (),
    position_offset: Any = None,
) -> Any:
    """A function that runs further calls of this validated signature with the least
    Python work, or None where the general path is needed anyway.

    The plan takes the call's arrays (``k`` and ``out_k`` None for one tensor) and its
    position offset (None, an ``int``, or an integer array of offsets of the dtype of
    ``position_offset``, which the kernels take as int64), and returns the output (a
    tuple of both for two tensors), or None when the general path must take over: a
    large call (numba's parallel kernel or streaming stores, ``config``'s thresholds)
    whose signature cannot have a compiled plan, a read-only output, an offset beyond
    int64, or a kernel status other than DONE (an output overlapping an input, a bad
    position). Nothing has been written then, so the general path runs the call again
    from the start and raises or handles it. A large call is launched as the general
    path launches it (:func:`launch`).

    ``key_options``: the call's options as given (``interleaved``,
    ``rotary_embedding_dim``, ``layout``, ``inverse``, ``num_heads``, ``num_kv_heads``),
    for :func:`fast_key`. A plan of a signature that :func:`_fast_candidate` admits
    gives it a compiled plan (:func:`remember_fast`) after ``FAST_AFTER`` calls with
    contiguous rows, counted apart for calls in place and out of place (compiled
    plans of their own): calls on the calling thread or shared with the helper, and
    large calls that ran in numba's parallel region. The general path's Python work
    took 60-100 us per large call on the Intel VM, as the call before had pushed
    Python's own data out of the CPU's caches (docs/performance.md, "Thirty-sixth
    session"); the compiled plan's is one hop.
    """
    # One function with a closure, not helpers: everything the plan can decide once is
    # decided here, and each helper call on its path would cost the small call a
    # Python hop (about 0.1 us each, against 8 us for the seed).
    if not all(x.size for x in inputs) or (
        position_ids is not None and position_ids.dtype not in _KERNEL_ID_DTYPES
    ):
        return None
    if call.positions == "offset" and type(position_offset) is not int:
        return None  # one offset as a 0-d array: the general path makes it an int64
    offsets_given = call.positions == "offsets"
    if offsets_given and not (
        type(position_offset) is np.ndarray
        and (position_offset.dtype.kind == "i" or position_offset.dtype.itemsize < 8)
    ):
        return None  # uint64 offsets (beyond int64?): the general path checks them
    # Offsets the kernels can read as they are: int64 in this machine's byte order
    # (others are converted, exactly, as the general path does).
    offsets_as_given = offsets_given and position_offset.dtype == np.dtype(np.int64)
    two = len(inputs) == 2
    size = sum(x.size for x in inputs)
    nbytes = sum(x.nbytes for x in inputs)
    item, cache_item = inputs[0].dtype.itemsize, cos.dtype.itemsize
    dtype, x_shape, k_shape = call.dtype, inputs[0].shape, inputs[-1].shape
    storage, cache_storage = storage_dtype(call.dtype), storage_dtype(cos.dtype)
    words = takes_words(storage, cache_storage)
    layout, rotary_dim = call.layout, call.rotary_dim
    x_logical, k_logical = call.shapes[0], call.shapes[-1]
    x_split, x_axes = bhsd_steps(inputs[0].ndim, layout, x_logical)
    to_bhsd = (x_split, x_axes) != (None, None)
    # For compiled plans: the reshape of a 3-D k too (None for 4-D), its heads as given.
    k_split = bhsd_steps(inputs[-1].ndim, layout, k_logical)[0]
    # token_major()'s choice, from the layout (bshd and 3-D inputs hold heads inside
    # tokens) rather than from each call's strides: an order only, never the bits.
    by_token = x_logical[2] == 1 or (to_bhsd and x_logical[1] > 1)
    batch, heads, seq_len = x_logical[0], max(x_logical[1], k_logical[1]), x_logical[2]
    # Outputs that pool.empty places: pooled (reached here only with the constants
    # raised) or float32 on lines.
    placed = pool.LINE_MIN_BYTES if call.dtype == np.float32 else pool.MIN_BYTES
    empty_x = pool.empty if inputs[0].nbytes >= placed else np.empty
    empty_k = pool.empty if inputs[-1].nbytes >= placed else np.empty
    chosen: dict[tuple[bool, int], tuple] = {}  # kernels and runner by (contiguous, in_place)
    splits: dict[tuple[int, int], tuple[int, int, int]] = {}  # by the tuning constants

    def relay_split() -> tuple[int, int, int]:
        # work_split for the caller and the helper, remembered for the constants it reads.
        constants = (config.TOKENS_PER_TILE, config.HELPER_CHUNKS_PER_THREAD)
        found = splits.get(constants)
        if found is None:
            found = splits[constants] = work_split(batch, heads, seq_len, True, 2, by_token)
        return found

    distinct_strides: dict[tuple[int, ...], bool] = {}  # outputs that are not C-contiguous
    # Calls left to run before remember_fast, by in_place (whether out is x, out_k is
    # k): calls in place and out of place share this plan but not a compiled one.
    candidate = _fast_candidate(call, key_options, position_offset)
    countdowns: dict[int, int] = {}

    def distinct(out) -> bool:
        found = distinct_strides.get(out.strides)
        if found is None:
            found = distinct_strides[out.strides] = elements_distinct(
                out.shape, out.strides, out.itemsize
            )
        return found

    def plan(x, k, cos, sin, position_ids, out, out_k, offset=None):
        cache = cos  # as the caller passed it (cos becomes the kernels' view below)
        large = size >= config.PARALLEL_MIN_ELEMENTS or nbytes >= config.STREAMING_MIN_BYTES
        if large and not candidate:
            return None
        positions = position_ids  # as the kernels take them
        if offsets_given:
            # C-contiguous and writable as well: the type of the general path's copy.
            positions = (
                offset
                if offsets_as_given and offset.flags.c_contiguous and offset.flags.writeable
                else offset.astype(np.int64)
            )
        elif offset is not None:
            if not INT64_MIN <= offset <= INT64_MAX:
                return None
            positions = offset  # the kernels take one offset as is
        in_place = out is x
        if out is None:
            out = (pool.empty if large else empty_x)(x_shape, dtype)  # large: as run does
        elif not out.flags.writeable or not (out.flags.c_contiguous or distinct(out)):
            return None
        x_view, out_view = x, out
        k_view = out_k_view = None
        if two:
            in_place += (out_k is k) * SECOND_IN_PLACE
            if out_k is None:
                out_k = (pool.empty if large else empty_k)(k_shape, dtype)
            elif not out_k.flags.writeable or not (out_k.flags.c_contiguous or distinct(out_k)):
                return None
            k_view, out_k_view = k, out_k
        if to_bhsd:
            x_view = bhsd_array(x, layout, x_logical)
            out_view = bhsd_array(out, layout, x_logical)
            if two:
                k_view = bhsd_array(k, layout, k_logical)
                out_k_view = bhsd_array(out_k, layout, k_logical)
        if storage is not None:
            x_view, out_view = x_view.view(storage), out_view.view(storage)
            if two:
                k_view, out_k_view = k_view.view(storage), out_k_view.view(storage)
        if cache_storage is not None:
            cos, sin = cos.view(cache_storage), sin.view(cache_storage)
        contiguous = (  # C-contiguous arrays first: a flag is cheaper than the strides
            x.flags.c_contiguous
            and out.flags.c_contiguous
            and cos.flags.c_contiguous
            and sin.flags.c_contiguous
        ) or (
            x.strides[-1] == item
            and out.strides[-1] == item
            and cos.strides[-1] == cache_item
            and sin.strides[-1] == cache_item
        )
        if two and contiguous:  # rows of k and out_k contiguous too
            contiguous = (k.flags.c_contiguous and out_k.flags.c_contiguous) or (
                k.strides[-1] == item and out_k.strides[-1] == item
            )
        if large:
            return run_large(
                x, k, cos, sin, cache, position_ids, positions, out, out_k, offset,
                (x_view, k_view, out_view, out_k_view), in_place,
            )  # fmt: skip
        found = chosen.get((contiguous, in_place))
        if found is None:
            chosen_kernels = kernels(
                call.interleaved, call.inverse, contiguous, in_place, words, False, by_token
            )
            runner = chosen_kernels.runner(x_view, k_view, cos, sin, positions)
            found = chosen[contiguous, in_place] = (chosen_kernels, runner)
        chosen_kernels, runner = found
        options = chosen_kernels.options
        # The threshold first: a call below it (most small calls) skips calling usable().
        shareable = size >= config.HELPER_MIN_ELEMENTS and sequences_apart(
            out_view, *((out_k_view,) if two else ())
        )
        if shareable and helper.usable(size):
            the_helper = helper.helper()
            the_helper.start()
            status = chosen_kernels.relayed(
                x_view, k_view, cos, sin, positions, out_view, out_k_view, rotary_dim,
                True, *relay_split(), the_helper.block, runner,
            )  # fmt: skip
        else:
            status = chosen_kernels.serial(
                x_view, k_view, cos, sin, positions, out_view, out_k_view, rotary_dim,
                True, config.TOKENS_PER_TILE, 1, runner,
            )  # fmt: skip
        left = countdowns.get(in_place, FAST_AFTER) if candidate else 0
        if left and status == DONE and contiguous:
            countdowns[in_place] = left - 1
            if left == 1:
                remember_fast(
                    fast_key(x, k, cache, position_ids, out, out_k, *key_options, offset),
                    options, rotary_dim, positions,
                    (x_view, k_view, cos, sin, out_view, out_k_view),
                    (to_bhsd, x_split, k_split), relay_split() if shareable else None,
                )  # fmt: skip
        if status != DONE:
            return None
        return (out, out_k) if two else out  # one tensor: no tuple to build and index

    def run_large(x, k, cos, sin, cache, position_ids, positions, out, out_k, offset, views,
                  in_place):  # fmt: skip
        # A large call: launched as the general path launches it (parallel region,
        # streaming stores, tiles for the caches' rows), its choices then giving the
        # signature a compiled plan when it ran in numba's parallel region.
        x_view, k_view, out_view, out_k_view = views
        pairs = ((out_view, out_view) if in_place & FIRST_IN_PLACE else (x_view, out_view),)
        if two:
            second_in_place = in_place & SECOND_IN_PLACE
            pairs += ((out_k_view, out_k_view) if second_in_place else (k_view, out_k_view),)
        report: dict[str, Any] = {}
        if launch(pairs, (cos, sin, positions), call, report=report) != DONE:
            return None
        left = countdowns.get(in_place, FAST_AFTER)
        if left and report["contiguous"] and report["parallel"]:
            countdowns[in_place] = left - 1
            if left == 1:
                outs = tuple(o for _, o in pairs)
                stream = 0  # no call of these shapes streams, or in place (never)
                start = max(stream_start(o.dtype, rotary_dim, call.interleaved) for o in outs)
                if not in_place and streamable_shapes(rotary_dim, call.interleaved, *outs):
                    stream = STREAM_ALIGNED if report["stream"] else STREAM_UNALIGNED
                remember_fast(
                    fast_key(x, k, cache, position_ids, out, out_k, *key_options, offset),
                    report["options"], rotary_dim, positions,
                    (x_view, k_view, cos, sin, out_view, out_k_view),
                    (to_bhsd, x_split, k_split), report["split"],
                    (thread_count(), stream, start, report["caches"]),
                )  # fmt: skip
        return (out, out_k) if two else out

    return plan


# -- compiled plans: the small calls that a program makes again and again ----------------

#: Compiled plans by :func:`fast_key`: ``(run, plan, runner, kept)``, the function that
#: runs a call by the plan (:func:`fast_call`), the plan (an int64 array, see
#: :func:`~numba_rope._cpu.kernels.planned`), the runner whose address the plan holds
#: (kept alive with it) and ``kept``, the ``(run, plan, runner)`` of each plan under
#: the key, newest first (at most :data:`PLANS_PER_KEY`); where there are several,
#: ``run`` tries each in turn (:func:`first_that_runs`). See :func:`remember_fast`.
#: Emptied, with ``PLANS``, when a tuning constant of ``numba_rope.config`` changes (a
#: plan holds the thresholds' choice and the work split of that moment) and when full.
FAST: dict[tuple, tuple] = {}

#: Most compiled plans kept under one :func:`fast_key`. The key holds what a call can
#: be told by cheaply, not the caches' shape: calls whose caches have other numbers of
#: rows (two caches in one program) share it, and each such signature gets a plan of
#: its own (one per Python plan, see :func:`make_plan`). With one plan per key the
#: newer took the place of the other, whose calls went to the general path for good:
#: alternating two such signatures cost the seed's calls 1.46x their time and the large
#: call (2, 16, 512, 128) 1.17x (docs/performance.md, "Thirty-seventh session"). A
#: call that the plan tried first refuses costs about 0.6-1 us more.
PLANS_PER_KEY = 4

#: Calls a Python plan runs (see :func:`make_plan`) before its signature gets a compiled
#: plan: making one compiles, the first time on a machine, a runner for the kernel
#: options (if no helper job has) and ``kernels.planned`` for the arrays' types, about
#: 2 s each on a 2-core VM, which a signature called a few times (as most of the tests
#: do) would not repay.
FAST_AFTER = 8


def fast_key(
    x: np.ndarray,
    k: np.ndarray | None,
    cos: np.ndarray,
    position_ids: np.ndarray | None,
    out: Any,
    out_k: Any,
    interleaved: bool,
    rotary_embedding_dim: int,
    layout: str,
    inverse: bool,
    num_heads: int | None,
    num_kv_heads: int | None,
    position_offset: Any,
) -> tuple:
    """What a compiled plan is found by, read before any validation: the input's
    shape and dtype, the dtypes of the caches and the ids (None for none), the options
    as given, whether the output is the input (a kernel of its own), and the offset's
    kind (None for none, ``int`` for a Python int, an array's dtype); for two tensors
    (q and k) also k's shape, whether ``out_k`` is k and ``num_kv_heads``.
    ``rotary_embedding`` and ``rotary_embedding_qk`` build the same tuples inline (a
    function call is a tenth of the call it saves)."""
    key = (
        x.shape, x.dtype, cos.dtype, None if position_ids is None else position_ids.dtype,
        interleaved, rotary_embedding_dim, layout, inverse, out is x, num_heads,
        None if position_offset is None
        else position_offset.dtype if type(position_offset) is np.ndarray
        else type(position_offset),
    )  # fmt: skip
    return key if k is None else (*key, k.shape, out_k is k, num_kv_heads)


def _fast_candidate(call: Call, key_options: tuple, position_offset: Any) -> bool:
    """Whether calls of this validated signature may get a compiled plan: options that
    :func:`fast_key` can hold and positions that the compiled plan passes on as they
    are (ids, none, a Python ``int`` offset or a 1-D array of int64 offsets). Which
    plan, :func:`make_plan` decides by the size: on the calling thread or shared with
    the helper thread, or for a large call as the general path launched it."""
    return len(key_options) == 6 and (
        call.positions in ("ids", "token")
        or (call.positions == "offset" and type(position_offset) is int)
        or (
            call.positions == "offsets"
            and type(position_offset) is np.ndarray
            and position_offset.dtype == np.dtype(np.int64)
        )
    )


def remember_fast(
    key: tuple,
    options: tuple,
    rotary_dim: int,
    positions: Any,
    views: tuple,
    forms: tuple,
    split: tuple[int, int, int] | None = None,
    large: tuple[int, int, int, int] | None = None,
) -> None:
    """Give the signature of a call that its Python plan has just run (rows
    contiguous) a compiled plan under ``key`` (:func:`fast_key`, which
    holds the dtypes of the input, the caches, the ids and the offsets; plans already
    under it stay, tried after this one, up to :data:`PLANS_PER_KEY`). ``options``:
    its kernel options; ``positions``: as the kernels took them (ids, None, an int
    offset or int64 offsets); ``views``: the input, k (or None), the caches and the
    outputs (out_k None for one tensor) as the kernels take them (BHSD views, 16-bit
    formats as integers); ``forms``: ``(to_bhsd, x_split, k_split)``, whether the
    caller's tensors need views to be BHSD (heads inside tokens) and the reshapes of
    3-D ones (None for 4-D, see :func:`~numba_rope._geometry.bhsd_steps`); ``split``:
    None for a call below the helper's threshold (run on the calling thread), else
    the tokens per tile, head groups and chunks of the helper's split (``relay_split``),
    shared with the helper at each call where it is usable (see :func:`fast_call`).

    ``large``: for a call that ran in numba's parallel region (``split`` is then the
    general path's), ``(threads, stream, start, caches)``: numba's thread count then,
    and the plan's ``PLAN_STREAM``, ``PLAN_STREAM_START`` and ``PLAN_CACHES`` (see
    ``kernels``); its calls run by
    ``kernels.planned_parallel``."""
    x_view, k_view, cos_view, sin_view, out_view, out_k_view = views
    to_bhsd, x_split, k_split = forms
    function = helper.runner(options, (x_view, k_view, cos_view, sin_view, positions))
    plan = np.zeros(PLAN_SLOTS, np.int64)
    plan[PLAN_RUNNER] = function.address
    plan[PLAN_ROTARY_DIM] = rotary_dim
    plan[PLAN_TILE], plan[PLAN_GROUPS], plan[PLAN_CHUNKS] = split or (config.TOKENS_PER_TILE, 1, 1)
    if large is not None:
        (plan[PLAN_THREADS], plan[PLAN_STREAM], plan[PLAN_STREAM_START],
         plan[PLAN_CACHES]) = large  # fmt: skip
    for slot, array in (
        (PLAN_X, x_view), (PLAN_K, k_view), (PLAN_COS, cos_view), (PLAN_SIN, sin_view),
        (PLAN_POSITIONS, positions), (PLAN_OUT, out_view), (PLAN_OUT_K, out_k_view),
    ):  # fmt: skip
        if isinstance(array, np.ndarray):  # an int offset has no shape (ndim 0)
            plan[slot] = array.ndim
            plan[slot + 1 : slot + 1 + array.ndim] = array.shape
    if len(FAST) >= MAX_PLANS:
        _forget_fast()
    dtype, cache_dtype = key[1], key[2]  # fast_key holds (shape, dtype, cache dtype, ...)
    # A plan of the helper's size is shared with it (when usable) by the elements.
    shared_size = 0
    if split is not None and large is None:
        shared_size = x_view.size + (0 if k_view is None else k_view.size)
    two = k_view is not None
    arrays = (
        (x_view, k_view, cos_view, sin_view, positions, out_view, out_k_view, plan)
        if two
        else (x_view, cos_view, sin_view, positions, out_view, plan)
    )
    if large is not None:
        entry = (planned_parallel if two else planned_parallel_one).compile(entry_types(arrays))
    else:
        entry = (planned if two else planned_one).compile(entry_types(arrays))
    shared_entry = None  # compiled at its first use: a process of one thread never shares
    if shared_size:
        block = np.zeros(1, np.int64)  # the type of a helper's control block
        shared = planned_shared if two else planned_shared_one
        shared_entry = functools.partial(shared.compile, entry_types((*arrays, block)))
    ndims = (cos_view.ndim, None if positions is None or type(positions) is int else positions.ndim)
    run = fast_call(
        plan, dtype, cache_dtype, to_bhsd, x_split, k_split, two, shared_size,
        (entry, shared_entry), ndims, large is not None,
    )  # fmt: skip
    made = (run, plan, function)  # the runner kept alive with the plan that holds its address
    before = FAST.get(key)
    kept = (made,) if before is None else (made, *before[3][: PLANS_PER_KEY - 1])
    FAST[key] = (
        run if len(kept) == 1 else first_that_runs(tuple(m[0] for m in kept)),
        *made[1:],
        kept,
    )


def first_that_runs(runs: tuple[Callable[..., Any], ...]) -> Callable[..., Any]:
    """A function that runs a call by the first of ``runs`` (functions of compiled
    plans under one :func:`fast_key`, see :func:`fast_call`) that takes it, or returns
    None, having written nothing, when none does."""

    def run(*args: Any) -> Any:
        for one in runs:
            result = one(*args)
            if result is not None:
                return result
        return None

    return run


def entry_types(arrays: tuple) -> tuple:
    """The types of arguments like ``arrays`` for a compiled plan's entry point: as
    numba types them, every array taken as writable and of any layout (numba "A").

    A compiled plan (:func:`fast_call`) calls the entry point of these types of a
    ``kernels.planned*`` function (``dispatcher.compile(types)``, compiled or loaded
    from the cache) directly, without numba's dispatch (which types each argument and
    looks the types up) and with the caller's float16 and bfloat16 arrays as they are
    (no 16-bit integer views, which numba needs to type them). The entry point unboxes
    each array as one of the compiled type without looking at its dtype or number of
    axes (numba checks the item size only): its caller must pass arrays of the dtype
    (or of one of the same item size: a 16-bit format for its integer storage) and of
    the number of axes of ``arrays``, and writable outputs; ``kernels.run_planned``
    checks shapes and strides."""
    return tuple(
        kind.copy(layout="A", readonly=False) if isinstance(kind, numba.types.Array) else kind
        for kind in map(numba.typeof, arrays)
    )


def fast_call(
    plan: np.ndarray,
    dtype: np.dtype,
    cache_dtype: np.dtype,
    to_bhsd: bool,
    x_split: tuple[int, ...] | None,
    k_split: tuple[int, ...] | None,
    two: bool,
    shared_size: int,
    entries: tuple[Callable[..., Any], Callable[[], Callable[..., Any]] | None],
    ndims: tuple[int, int | None],
    large: bool = False,
) -> Callable[..., Any]:
    """The function that runs a call by the compiled plan ``plan`` (found by
    :func:`fast_key`: the input, caches, ids and offsets are of its dtypes) and returns
    its output (a tuple of both for q and k), or returns None, having written nothing,
    when it is not that plan's call: k, ``sin_cache`` or an output of another type,
    dtype or number of axes, caches or ids of another number of axes, a read-only
    output, an offset beyond int64 or offsets of another number of axes, or whatever
    :func:`~numba_rope._cpu.kernels.planned` refuses (shapes, strides, positions). The
    general path then takes the call.

    One tensor: ``run(x, cos, sin, position_ids, out, offset)``; q and k (``two``):
    ``run(x, k, cos, sin, position_ids, out, out_k, offset)``. Made once per plan, with
    what the plan decides (BHSD views of heads inside tokens) settled here: a float32
    seed call then checks only its arguments (about 0.3 us less of Python than one
    function for every plan). Dtypes are compared by identity first (NumPy's native
    dtypes are one object each), then by equality (an equal dtype can be another
    object: ``newbyteorder("=")``, unpickled arrays), written out inline: a helper
    function would be a Python call per comparison.

    ``entries``: the compiled entry point of ``kernels.planned_one`` (or ``planned``),
    and a function that compiles that of its shared twin at its first use (None for a
    plan of a call below the helper's size), both of :func:`entry_types`, called
    directly: the arrays go as they are, 16-bit ones included, and what numba's
    dispatch would have checked by their types is checked here first (dtypes, numbers
    of axes: ``ndims`` holds the caches' and the ids', None for no ids; writable
    outputs). 16-bit seed calls took 0.82-0.87x the time of four
    integer views and numba's dispatch, about 0.9 us less (one-process A/B on the Intel
    AVX-512 VM, docs/performance.md, "Twenty-ninth session").

    ``shared_size``: 0, or for the plan of a call of the helper's size its elements (x
    and k): the call is then shared with the helper thread when ``helper.usable``
    says so at the time of the call (more than one numba thread for this thread), as
    the general path decides, else run on this thread. The helper is looked up at each
    call: a forked child has its own.

    ``large``: a plan of a call that ran in numba's parallel region
    (``kernels.planned_parallel``), run only where such a region may run now (a
    thread-safe threading layer known, not a fork child of OpenMP's threads, see
    :func:`_run_parallel` and ``parallel_regions_usable``) with the numba thread count
    for this thread that the plan's split was made for."""
    entry, compile_shared = entries
    shared: list[Callable[..., Any]] = []  # the shared twin's, once compiled
    threads = int(plan[PLAN_THREADS])
    cache_ndim, ids_ndim = ndims

    ndarray, empty, placing = np.ndarray, np.empty, pool.empty
    # Outputs that pool.empty places (see make_plan), the others NumPy's.
    placed = pool.LINE_MIN_BYTES if dtype == np.float32 else pool.MIN_BYTES
    if large:  # pool.empty for every output, as the general path allocates them
        placed = 0

    def bhsd(array: np.ndarray, split: tuple[int, ...] | None) -> np.ndarray:
        # bhsd_array with its steps made once (the plan checks the shapes).
        if split is not None:
            array = array.reshape(split)
        return array.transpose(SWAP_HEADS_AND_TOKENS)

    if not two:

        def run(x: Any, cos: Any, sin: Any, position_ids: Any, out: Any, offset: Any) -> Any:
            if (
                type(sin) is not ndarray
                or (sin.dtype is not cache_dtype and sin.dtype != cache_dtype)
                or cos.ndim != cache_ndim
                or sin.ndim != cache_ndim
            ):
                return None
            if offset is not None:
                position_ids = _fast_positions(offset)  # offsets stand in for the ids
                if position_ids is None:
                    return None
            elif position_ids is not None and position_ids.ndim != ids_ndim:
                return None
            if out is None:
                out = (empty if x.nbytes < placed else placing)(x.shape, dtype)
            elif (
                type(out) is not ndarray
                or (out.dtype is not dtype and out.dtype != dtype)
                or out.ndim != x.ndim
                or not out.flags.writeable
            ):
                return None
            x_view, out_view = x, out
            if to_bhsd:
                if out.shape != x.shape:
                    return None  # (3-D outputs must have the input's shape to be reshaped)
                x_view, out_view = bhsd(x, x_split), bhsd(out, x_split)
            if large and not (
                _threading_layer_is_safe and parallel_regions_usable() and thread_count() == threads
            ):
                return None
            if shared_size and helper.usable(shared_size):
                if not shared:  # compiled before the helper starts to spin
                    shared.append(compile_shared())  # type: ignore[misc]
                the_helper = helper.helper()
                the_helper.start()
                status = shared[0](x_view, cos, sin, position_ids, out_view, plan, the_helper.block)
            else:
                status = entry(x_view, cos, sin, position_ids, out_view, plan)
            return out if status == DONE else None

        return run

    def run_qk(
        x: Any, k: Any, cos: Any, sin: Any, position_ids: Any, out: Any, out_k: Any, offset: Any
    ) -> Any:
        if (
            type(sin) is not ndarray
            or (sin.dtype is not cache_dtype and sin.dtype != cache_dtype)
            or cos.ndim != cache_ndim
            or sin.ndim != cache_ndim
        ):
            return None
        if type(k) is not ndarray or (k.dtype is not dtype and k.dtype != dtype):
            return None
        if offset is not None:
            position_ids = _fast_positions(offset)
            if position_ids is None:
                return None
        elif position_ids is not None and position_ids.ndim != ids_ndim:
            return None
        if out is None:
            out = (empty if x.nbytes < placed else placing)(x.shape, dtype)
        elif (
            type(out) is not ndarray
            or (out.dtype is not dtype and out.dtype != dtype)
            or out.ndim != x.ndim
            or not out.flags.writeable
        ):
            return None
        if out_k is None:
            out_k = (empty if k.nbytes < placed else placing)(k.shape, dtype)
        elif (
            type(out_k) is not ndarray
            or (out_k.dtype is not dtype and out_k.dtype != dtype)
            or out_k.ndim != k.ndim
            or not out_k.flags.writeable
        ):
            return None
        x_view, k_view, out_view, out_k_view = x, k, out, out_k
        if to_bhsd:
            if out.shape != x.shape or out_k.shape != k.shape:
                return None
            x_view, k_view = bhsd(x, x_split), bhsd(k, k_split)
            out_view, out_k_view = bhsd(out, x_split), bhsd(out_k, k_split)
        if large and not (
            _threading_layer_is_safe and parallel_regions_usable() and thread_count() == threads
        ):
            return None
        if shared_size and helper.usable(shared_size):
            if not shared:  # compiled before the helper starts to spin
                shared.append(compile_shared())  # type: ignore[misc]
            the_helper = helper.helper()
            the_helper.start()
            status = shared[0](
                x_view, k_view, cos, sin, position_ids, out_view, out_k_view, plan,
                the_helper.block,
            )  # fmt: skip
        else:
            status = entry(x_view, k_view, cos, sin, position_ids, out_view, out_k_view, plan)
        return (out, out_k) if status == DONE else None

    return run_qk


def _fast_positions(offset: Any) -> Any:
    """A compiled plan's position offset as the kernels take it (a Python ``int`` as
    is, a 1-D array of int64 offsets C-contiguous and writable, as :func:`make_plan`
    passes them), or None where the plan cannot take it: an ``int`` beyond int64,
    offsets of another number of axes."""
    if type(offset) is int:
        return offset if INT64_MIN <= offset <= INT64_MAX else None
    if offset.ndim != 1:  # an array of offsets (the key holds its dtype: int64)
        return None
    if not (offset.flags.c_contiguous and offset.flags.writeable):
        return offset.astype(np.int64)  # the arrays' type of the plan, as make_plan
    return offset


def _forget_fast() -> None:
    """Forget the compiled plans, and the Python plans with them: a Python plan makes
    its signature's compiled plan once (:func:`make_plan`'s countdowns), so one left in
    ``PLANS`` would run every later call of a forgotten signature itself."""
    FAST.clear()
    PLANS.clear()


config.on_change(_forget_fast)
