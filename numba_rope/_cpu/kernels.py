"""CPU kernels: the loops of the ``@njit`` kernels over the rows of one or two tensors.

A *row* is the ``head_size`` elements of one (batch, head, token). The kernels check a
call and hand its units of rows (a sequence's tile of tokens over its heads) to the
compiled runner of its options (:func:`make_runner`), in contiguous chunks: on the
calling thread, on numba's threads, or shared with the helper thread. A call with two
tensors (q and k) is the same kernel with a second tensor: unit by unit, q's heads
then k's, so that k reuses the tile's cos/sin rows.

The kernels trust their arguments: :mod:`numba_rope._validation` has checked shapes,
dtypes and options; positions are checked here, before anything is written, and
reported by a status code that :mod:`numba_rope._cpu.backend` decodes. float16 and
bfloat16 arrays arrive as 16-bit integer views (see :mod:`numba_rope._conversions`), or,
through a compiled plan's entry point, as the caller's arrays unboxed as such
(:func:`numba_rope._cpu.backend.entry_types`).
"""

from __future__ import annotations

import numpy as np
from numba import prange, types
from numba.extending import overload

from numba_rope._conversions import narrow_like, widen
from numba_rope._cpu import relay
from numba_rope._cpu.vector import (
    BFLOAT16_TYPE,
    STREAM_ALIGNMENT,
    float16_value_pairs,
    float16_values,
    pair_rows,
    prefetch_rows,
    prefetch_span,
    row,
    store_fence,
    stream_copy,
    vector_pairs,
    widen_pairs,
    widen_span,
    widen_word_halves,
)
from numba_rope._geometry import (
    byte_span_jit,
    elements_distinct,
    spans_meet_jit,
    token_rows_apart_jit,
)
from numba_rope._jit import cached_cfunc, cached_njit
from numba_rope._rotation import rotate_pair

#: How many rows ahead :func:`_contiguous_units` prefetches (for writing) the rotated
#: channels of rows it rotates in place when they have channels past ``rotary_dim``
#: (not written in place) and start off a 64-byte line. Such rows touch a line more
#: than rows on a line boundary (3 of 8 lines for GPT-J's 256 channels, 64 rotated,
#: float16, 16 bytes off) and the hardware's prefetchers fell behind: (4, 16, 2048,
#: 256), rotary_dim 64, float16, in place, 16 bytes off a line, took 3.8-4.3 ms against
#: 1.1-1.8 on a line boundary (2 threads, Zen 4 VM). With the prefetch 0.75-0.79x the
#: time, interleaved or not, over two one-process A/B runs of 31 alternating calls;
#: rows on a line boundary and (4, 16, 2048, 128) within 0.9-1.06 (the noise). Out of
#: place every channel is read and written, and the same prefetch made it 1.15-1.31x
#: slower: in place only.
PREFETCH_ROWS = 16

#: How many rows ahead (heads in :func:`_token_units`, tokens in
#: :func:`_contiguous_units`) the row loops prefetch the input row (for reading) and
#: the output row (for writing) of float32 rows rotated into another array, and the
#: least input (bytes) of such calls that does: see :func:`_prefetches_ahead`.
AHEAD_ROWS = 2
AHEAD_MIN_BYTES = 512 << 10

#: Kernel return codes besides the index of a bad position id or offset (>= 0).
DONE = -1
OVERLAP = -2

#: ``in_place`` flags of the kernels: the first tensor's output is the tensor itself;
#: the second's is.
FIRST_IN_PLACE = 1
SECOND_IN_PLACE = 2


def _cache_row_index(cache, positions, b, s):  # pragma: no cover - see overload
    """Index tuple of the cache row of token (b, s)."""
    raise NotImplementedError


@overload(_cache_row_index, inline="always")
def _cache_row_index_overload(cache, positions, b, s):
    # Chosen at compile time from the type of ``positions``: None (caches indexed by
    # token), 2-D position ids, 1-D per-batch offsets or one offset for the whole batch
    # (positions offset + s).
    if isinstance(positions, types.NoneType):
        return lambda cache, positions, b, s: (b, s)
    if isinstance(positions, types.Integer):
        return lambda cache, positions, b, s: (positions + s,)
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
    if isinstance(positions, types.Integer):
        return lambda cache, positions, b, s: (positions + s) * cache.strides[0]
    if positions.ndim == 2:
        return lambda cache, positions, b, s: positions[b, s] * cache.strides[0]
    return lambda cache, positions, b, s: (positions[b] + s) * cache.strides[0]


@cached_njit(inline="always")
def rotate_row(x_row, cos_row, sin_row, out_row, interleaved, rotary_dim, sign, words, streaming):
    """Rotate one row. Each pair is read before either of its elements is written, so
    ``out_row`` may be ``x_row``.

    The element loops below do any row, and LLVM vectorizes them. Contiguous rows of
    float32 and the 16-bit types hand most pairs to loops written in LLVM vectors first
    (:func:`~numba_rope._cpu.vector.vector_pairs`), leaving the element loops what is
    left over: with ordinary stores, or by the options ``words`` (rows of bfloat16,
    caches included: two elements per 32-bit word, see :mod:`numba_rope._cpu.vector`)
    and ``streaming`` (non-temporal stores: see :mod:`numba_rope._cpu.vector`, and
    :func:`~numba_rope._cpu.vector.stream_copy` for the channels past ``rotary_dim``).

    Inlined into the runners (:func:`make_runner`), where the options are constants: :func:`~numba_rope._cpu.vector.vector_pairs` and
    :func:`~numba_rope._cpu.vector.stream_copy` emit only the code they choose, LLVM drops the element loop
    not in use, and a ``sign`` of +1 costs nothing. The indices are unsigned:
    numba then emits no negative-index wrap-around, which would keep these loops from
    vectorizing.
    """
    half = rotary_dim // 2
    first = vector_pairs(
        x_row, cos_row, sin_row, out_row, half, sign, interleaved, words, streaming
    )
    if interleaved:
        for pair in range(first, half):
            i = np.uint64(pair)
            i1 = np.uint64(2 * pair)
            i2 = np.uint64(2 * pair + 1)
            y1, y2 = rotate_pair(
                widen(x_row[i1]),
                widen(x_row[i2]),
                widen(_pair_cache(cos_row, i)),
                widen(_pair_cache(sin_row, i)) * sign,
            )
            out_row[i1] = narrow_like(y1, out_row)
            out_row[i2] = narrow_like(y2, out_row)
    else:
        for pair in range(first, half):
            i = np.uint64(pair)
            i2 = np.uint64(pair + half)
            y1, y2 = rotate_pair(
                widen(x_row[i]),
                widen(x_row[i2]),
                widen(_pair_cache(cos_row, i)),
                widen(_pair_cache(sin_row, i)) * sign,
            )
            out_row[i] = narrow_like(y1, out_row)
            out_row[i2] = narrow_like(y2, out_row)
    copied = stream_copy(x_row, out_row, rotary_dim, x_row.shape[0], streaming)
    for channel in range(copied, x_row.shape[0]):
        i = np.uint64(channel)
        out_row[i] = x_row[i]


def _pair_cache(cache_row, i):  # pragma: no cover - see overload
    """The cache value of pair ``i``: ``cache_row[i]``, or ``cache_row[i, 1]`` of a row
    of duplicated values (:func:`_token_cache_rows`; the sin rows hold ``-sin`` in
    column 0)."""
    raise NotImplementedError


@overload(_pair_cache, inline="always")
def _pair_cache_overload(cache_row, i):
    if cache_row.ndim == 2:
        return lambda cache_row, i: cache_row[i, np.uint64(1)]
    return lambda cache_row, i: cache_row[i]


@cached_njit()
def _n_units(batch, seq_len, tile, n_groups):
    """Number of work units: (batch entry, tile of ``tile`` tokens, head group)."""
    return batch * ((seq_len + tile - 1) // tile) * n_groups


@cached_njit()
def _unit_bounds(unit, seq_len, num_heads, tile, n_groups):
    """``(b, first token, end token, first head, end head)`` of a work unit."""
    n_tiles = (seq_len + tile - 1) // tile
    group = unit % n_groups
    b = unit // (n_tiles * n_groups)
    s0 = (unit // n_groups - b * n_tiles) * tile
    return (
        b,
        s0,
        min(s0 + tile, seq_len),
        group * num_heads // n_groups,
        (group + 1) * num_heads // n_groups,
    )


@cached_njit(inline="always")
def _contiguous_units(
    x,
    cos,
    sin,
    positions,
    out,
    rotary_dim,
    first,
    end,
    tile,
    n_groups,
    interleaved,
    sign,
    words,
    streaming,
    scratch,
):
    """Rotate units ``first <= u < end`` (see :func:`make_runner`) whose rows are all
    contiguous: as C-contiguous arrays over raw pointers, which LLVM vectorizes fully
    (F16C conversions for float16). A range, not one unit: a kernel that calls this
    once per unit ran float32 decode 8-13% slower (A/B of the kernel alone).
    ``scratch`` is taken for the signature of :func:`_token_units` and not used.
    In place (``out`` is ``x``), rows with channels past ``rotary_dim`` that start off
    a 64-byte line prefetch the row :data:`PREFETCH_ROWS` ahead; large float32 calls
    into another array, the rows :data:`AHEAD_ROWS` tokens ahead
    (:func:`_prefetches_ahead`)."""
    head_size = x.shape[3]
    half = rotary_dim // 2
    # In place, rows with channels past rotary_dim (which are not written) that start
    # off a 64-byte line: see PREFETCH_ROWS.
    address = x.ctypes.data
    in_place_gap = rotary_dim < head_size and address == out.ctypes.data
    rotary_bytes = rotary_dim * x.itemsize
    ahead = _prefetches_ahead(x, out, streaming)
    row_bytes = head_size * x.itemsize
    for unit in range(first, end):
        b, s0, s1, h0, h1 = _unit_bounds(unit, x.shape[2], x.shape[1], tile, n_groups)
        for h in range(h0, h1):
            for s in range(s0, s1):
                x_offset = b * x.strides[0] + h * x.strides[1] + s * x.strides[2]
                out_offset = b * out.strides[0] + h * out.strides[1] + s * out.strides[2]
                if in_place_gap and (address + x_offset) & 63 and s + PREFETCH_ROWS < s1:
                    prefetch_span(x, x_offset + PREFETCH_ROWS * x.strides[2], rotary_bytes)
                elif ahead:
                    prefetch_rows(
                        x, x_offset + AHEAD_ROWS * x.strides[2],
                        out, out_offset + AHEAD_ROWS * out.strides[2], row_bytes,
                    )  # fmt: skip
                rotate_row(
                    row(x, x_offset, head_size),
                    row(cos, _cache_row_offset(cos, positions, b, s), half),
                    row(sin, _cache_row_offset(sin, positions, b, s), half),
                    row(out, out_offset, head_size),
                    interleaved,
                    rotary_dim,
                    sign,
                    words,
                    streaming,
                )


def _cache_scratch(x, cache, half, interleaved, words):  # pragma: no cover - see overload
    """Room for one token's cos and sin rows in float32, made once per range of units
    (:func:`units`), not per token, which :func:`_token_units` then fills once for all
    the token's heads (:func:`_token_cache_rows`); else None.

    * Interleaved pairs of float32, float16 or bfloat16 element rows (not the
      bfloat16 words, whose word holds a pair), caches of those types: ``(2, half,
      2)``, each value twice (:func:`duplicates_pairs`);
    * else float16 or bfloat16 caches: ``(2, half)``, the rows widened."""
    raise NotImplementedError


def duplicates_pairs(x, cache, interleaved, words) -> bool:
    """Whether :func:`_token_units` rotates the rows of these numba types through cache
    rows with each value twice (``(half, 2)``, :func:`_token_cache_rows`): interleaved
    pairs of float32 or 16-bit element rows, caches of float32 or a 16-bit type
    (widened exactly), not the bfloat16 words.

    The vector step of such rows (:func:`numba_rope._cpu.vector.vector_pairs`) then
    multiplies the pairs as they lie by the cos row, and the pairs swapped within
    themselves (one in-lane shuffle) by the sin row, whose even lanes hold ``-sin``,
    and adds the two: where it split each vector of pairs into firsts and seconds and
    merged them back (eight shuffles per 16 elements on AVX2, two of them across
    128-bit lanes). The same operations on the same operands, so the same bits (see
    :meth:`numba_rope._cpu.vector._Stream.rotate_in_pairs`)."""
    return (
        interleaved
        and not words
        and x.dtype in (types.float32, types.uint16, BFLOAT16_TYPE)
        and cache.dtype in (types.float32, types.uint16, BFLOAT16_TYPE)
    )


@overload(_cache_scratch, inline="always")
def _cache_scratch_overload(x, cache, half, interleaved, words):
    # The 16-bit storage types: F16C's conversions bound the float16 row loops (six
    # per vector step, two of them the cache's); bfloat16's word loops are bound by
    # their arithmetic, of which widening the cache words is a tenth (four of about
    # forty-four instructions a step).
    flags = (interleaved, words)
    if not all(isinstance(flag, types.BooleanLiteral) for flag in flags):
        return None  # numba asks again with the constants as literals
    if duplicates_pairs(x, cache, *(flag.literal_value for flag in flags)):
        return lambda x, cache, half, interleaved, words: np.empty((2, half, 2), np.float32)
    if cache.dtype in (types.uint16, BFLOAT16_TYPE):
        return lambda x, cache, half, interleaved, words: np.empty((2, half), np.float32)
    return lambda x, cache, half, interleaved, words: None


@cached_njit(inline="always")
def _no_scratch(x, cache, half, interleaved, words):
    """No scratch: the row loops other than :func:`_token_units` take none."""
    return None


def _token_cache_rows(cos_row, sin_row, scratch, interleaved, words):  # pragma: no cover
    """The cache rows a token's heads rotate by: ``cos_row`` and ``sin_row`` as they
    are, or in ``scratch`` (see :func:`_cache_scratch`): each value twice, widened
    (``(half, 2)`` rows, the sin row's first of each two negated), or widened, in the
    order the non-interleaved bfloat16 word loop reads them (:func:`widen_word_halves`)
    for those, else in their own order, and past the vector steps in their own order.
    Widening and negation are exact, so the bits are those of the rows themselves.
    Rows widened from float16 are typed :data:`~numba_rope._cpu.vector.FLOAT16_VALUES`
    (or ``FLOAT16_VALUE_PAIRS``): their products with float16 rows are exact."""
    raise NotImplementedError


@overload(_token_cache_rows, inline="always")
def _token_cache_rows_overload(cos_row, sin_row, scratch, interleaved, words):
    if isinstance(scratch, types.NoneType):
        return lambda cos_row, sin_row, scratch, interleaved, words: (cos_row, sin_row)
    float16 = cos_row.dtype == types.uint16  # (see FLOAT16_VALUES above)
    if scratch.ndim == 3:
        typed_pairs = float16_value_pairs if float16 else pair_rows

        def duplicated(cos_row, sin_row, scratch, interleaved, words):
            half = cos_row.shape[0]
            cos_pairs = pair_rows(scratch, 0, half)
            sin_pairs = pair_rows(scratch, 8 * half, half)
            first, second = np.uint64(0), np.uint64(1)
            widen_pairs(cos_row, cos_pairs, half, False)
            for pair in range(widen_pairs(sin_row, sin_pairs, half, True), half):
                i = np.uint64(pair)
                cos_value, sin_value = widen(cos_row[i]), widen(sin_row[i])
                cos_pairs[i, first] = cos_value
                cos_pairs[i, second] = cos_value
                sin_pairs[i, first] = -sin_value
                sin_pairs[i, second] = sin_value
            return typed_pairs(scratch, 0, half), typed_pairs(scratch, 8 * half, half)

        return duplicated
    flags = (interleaved, words)
    if not all(isinstance(flag, types.BooleanLiteral) for flag in flags):
        return None  # numba asks again with the constants as literals
    halves = words.literal_value and not interleaved.literal_value
    widen_row = widen_word_halves if halves else widen_span
    typed = float16_values if float16 else row

    def impl(cos_row, sin_row, scratch, interleaved, words):
        half = cos_row.shape[0]
        cos_wide = row(scratch, 0, half)
        sin_wide = row(scratch, 4 * half, half)
        first = widen_row(cos_row, cos_wide, half)
        widen_row(sin_row, sin_wide, half)
        for pair in range(first, half):
            i = np.uint64(pair)
            cos_wide[i] = widen(cos_row[i])
            sin_wide[i] = widen(sin_row[i])
        return typed(scratch, 0, half), typed(scratch, 4 * half, half)

    return impl


@cached_njit(inline="always")
def _token_units(
    x,
    cos,
    sin,
    positions,
    out,
    rotary_dim,
    first,
    end,
    tile,
    n_groups,
    interleaved,
    sign,
    words,
    streaming,
    scratch,
):
    """:func:`_contiguous_units` token by token, and inside a token head by head: the
    order of a decode step's units (one token, every head), whose loop over heads then
    shares one cos/sin row, so that LLVM hoists the row and its overlap tests out of
    it (float32 decode 12-15% faster than head-major in A/B runs), and of inputs
    whose heads lie inside tokens (``bshd``), which it reads front to back (a bshd
    prefill 0.34-0.59x the time of head-major in one process). The other order is
    kept for inputs whose heads lie outside tokens, whose rows it streams head by
    head.

    float16 cache rows are widened to float32 once per token, into ``scratch`` (see
    :func:`_cache_scratch`), instead of in every head's vector steps: F16C's
    conversions bound those steps, six per step with float16 caches and four without
    (float16 decode 0.84-0.95x the time, a bshd (4, 512, 8, 128) 0.88x, one-process
    A/B). Widening is exact: the bits do not change. Interleaved rows of float32 and
    16-bit elements take rows holding each value twice instead (any cache dtype but
    float64, see :func:`duplicates_pairs`), and rotate their pairs as they lie: on the
    Zen 3 VM, one thread, float16 decode and bshd calls 0.61-0.75x the time, float32
    0.89-0.98x (one-process A/B, docs/performance.md, "Twenty-fourth session").
    Large float32 calls into another array prefetch the rows :data:`AHEAD_ROWS` heads
    ahead (:func:`_prefetches_ahead`)."""
    head_size = x.shape[3]
    half = rotary_dim // 2
    ahead = _prefetches_ahead(x, out, streaming)
    row_bytes = head_size * x.itemsize
    for unit in range(first, end):
        b, s0, s1, h0, h1 = _unit_bounds(unit, x.shape[2], x.shape[1], tile, n_groups)
        for s in range(s0, s1):
            cos_row, sin_row = _token_cache_rows(
                row(cos, _cache_row_offset(cos, positions, b, s), half),
                row(sin, _cache_row_offset(sin, positions, b, s), half),
                scratch,
                interleaved,
                words,
            )
            for h in range(h0, h1):
                x_offset = b * x.strides[0] + h * x.strides[1] + s * x.strides[2]
                out_offset = b * out.strides[0] + h * out.strides[1] + s * out.strides[2]
                if ahead:
                    prefetch_rows(
                        x, x_offset + AHEAD_ROWS * x.strides[1],
                        out, out_offset + AHEAD_ROWS * out.strides[1], row_bytes,
                    )  # fmt: skip
                rotate_row(
                    row(x, x_offset, head_size),
                    cos_row,
                    sin_row,
                    row(out, out_offset, head_size),
                    interleaved,
                    rotary_dim,
                    sign,
                    words,
                    streaming,
                )


def _prefetches_ahead(x, out, streaming):  # pragma: no cover - see overload
    """Whether the row loops prefetch rows :data:`AHEAD_ROWS` ahead (heads in
    :func:`_token_units`, tokens in :func:`_contiguous_units`;
    :func:`~numba_rope._cpu.vector.prefetch_rows`): float32 rows rotated into another
    array with ordinary stores, the input more than :data:`AHEAD_MIN_BYTES`.

    Each store of such a call waits for its line to be read for ownership, and the
    hardware's prefetchers do not fetch output lines early enough: a float32 decode
    step (64, 32, 1, 128) on one thread (input and output 1 MiB each, 2 MiB of L2)
    took 45 us against 33-36 for ``np.copyto`` and 20-24 in place; with the prefetch
    0.84-0.85x the time, on one thread and with the other core busy (Intel AVX-512
    VM, one-process A/B, docs/performance.md, "Twenty-eighth session"); rows taken
    head by head (bhsd prefills of 1-8 MiB) 0.88-0.97x on one thread, 0.93-1.01x on
    two. Not for 16-bit rows, bound by their conversions (float16 decode 1.02-1.05x
    the time with it, bfloat16 1.06-1.13x, on the Emerald Rapids VM: "Twentieth
    session"), nor for inputs that stay in L2 (512 KiB and less: 0.99-1.05x there),
    nor for non-temporal stores, which read no line."""
    raise NotImplementedError


@overload(_prefetches_ahead)
def _prefetches_ahead_overload(x, out, streaming):
    # Decided when compiling for the dtype: 16-bit kernels carry none of the code once
    # LLVM has folded the constant. Not inlined by numba (LLVM inlines it): numba's
    # inlining of such helpers cost the float32 kernels 3-7% more compile time
    # ("Twentieth session").
    if x.dtype != types.float32:
        return lambda x, out, streaming: False

    def impl(x, out, streaming):  # no short circuits: numba inlines them badly
        into_another = x.ctypes.data != out.ctypes.data
        return (not streaming) & into_another & (x.nbytes > AHEAD_MIN_BYTES)

    return impl


#: Loop orders of :func:`_strided_units`: each row's channels innermost, or each
#: channel pair over the unit's heads (:data:`HEADS_INSIDE`) or over its tokens
#: (:data:`TOKENS_INSIDE`). See :func:`strided_order`.
ROWS_INSIDE = 0
HEADS_INSIDE = 1
TOKENS_INSIDE = 2

#: The least step (bytes) between a row's channels, in the input or the output, from
#: which :func:`strided_order` takes heads or tokens inside. Below it consecutive rows
#: share the lines and pages of their channels, which stay in the caches from one row
#: to the next. Tokens innermost in memory (``x.transpose(0, 1, 3, 2)`` of a C-ordered
#: array), float32, tokens inside against row by row on the AMD Zen 4 VM (one
#: process, ``/tmp/s46/ablayout.py``): channels 256 bytes apart, (2, 8, 64, 64), 87
#: against 43 us; 512 bytes, (2, 8, 128, 64) 0.81-1.01x but (8, 32, 128, 128)
#: 1.21-1.32x; 1 KiB, (8, 32, 256, 128) and (2, 8, 256, 64) 0.54-0.82x.
INSIDE_MIN_STEP = 1024


@cached_njit(inline="always")
def strided_order(x, out):
    """The loop order of :func:`_strided_units` for ``x`` rotated into ``out``.

    Rows whose channels lie far apart in memory (Fortran order, views of a tensor
    transposed in its last axis) take innermost the axis, heads or tokens, whose steps
    (bytes, summed over both arrays) are the smallest, and smaller than the channels'
    steps; other rows are rotated row by row. A row's channels 8 KiB apart (a Fortran-ordered
    decode step of 64 sequences) fall into one set of the L1 cache and onto as many
    pages as there are channels: rotated row by row, such calls took up to 25 times
    as long as in this order on the Zen 4 VM (docs/performance.md, "Forty-sixth
    session"). An order only: every element is computed by the same arithmetic.

    >>> x = np.zeros((2, 8, 256, 64), np.float32)
    >>> f, t = np.asfortranarray(x), x.transpose(0, 1, 3, 2).copy().transpose(0, 1, 3, 2)
    >>> [int(strided_order(a, a)) for a in (x, f, t, x[..., ::2])]
    [0, 1, 2, 0]
    """
    if max(abs(x.strides[3]), abs(out.strides[3])) < INSIDE_MIN_STEP:
        return ROWS_INSIDE
    channel = abs(x.strides[3]) + abs(out.strides[3])
    head = abs(x.strides[1]) + abs(out.strides[1])
    token = abs(x.strides[2]) + abs(out.strides[2])
    if x.shape[1] > 1 and head < channel and (head <= token or x.shape[2] == 1):
        return HEADS_INSIDE
    if x.shape[2] > 1 and token < channel:
        return TOKENS_INSIDE
    return ROWS_INSIDE


@cached_njit(inline="always")
def _pair_indices(pair, half, interleaved):
    """The channels of pair ``pair`` (unsigned: see :func:`rotate_row`)."""
    if interleaved:
        return np.uint64(2 * pair), np.uint64(2 * pair + 1)
    return np.uint64(pair), np.uint64(pair + half)


@cached_njit(inline="always")
def _pair_cache_values(cos, sin, positions, b, s, pair, sign):
    """``(cos, sin * sign)`` of pair ``pair`` of token (b, s), in the compute type."""
    at = _cache_row_index(cos, positions, b, s) + (pair,)  # noqa: RUF005 (numba: no *)
    return widen(cos[at]), widen(sin[at]) * sign


@cached_njit(inline="always")
def _rotate_pair_at(x, out, b, h, s, i1, i2, cos_value, sin_value):
    """Rotate channels ``i1`` and ``i2`` of row (b, h, s) of ``x`` into ``out``: both
    read before either is written (``out`` may be ``x``)."""
    y1, y2 = rotate_pair(widen(x[b, h, s, i1]), widen(x[b, h, s, i2]), cos_value, sin_value)
    out[b, h, s, i1] = narrow_like(y1, out)
    out[b, h, s, i2] = narrow_like(y2, out)


@cached_njit(inline="always")
def _strided_units(
    x,
    cos,
    sin,
    positions,
    out,
    rotary_dim,
    first,
    end,
    tile,
    n_groups,
    interleaved,
    sign,
    words,
    streaming,
    scratch,
):
    """:func:`_contiguous_units` for any strides: row by row, rows being slices
    (slower: each slice updates a shared reference count), or element by element in
    the order of :func:`strided_order`. Every element is computed by the same
    arithmetic in every order. ``words``, ``streaming`` and ``scratch`` are taken and
    not used (they need contiguous rows)."""
    order = strided_order(x, out)
    if order == ROWS_INSIDE:
        for unit in range(first, end):
            b, s0, s1, h0, h1 = _unit_bounds(unit, x.shape[2], x.shape[1], tile, n_groups)
            for h in range(h0, h1):
                for s in range(s0, s1):
                    row_index = _cache_row_index(cos, positions, b, s)
                    rotate_row(
                        x[b, h, s],
                        cos[row_index],
                        sin[row_index],
                        out[b, h, s],
                        interleaved,
                        rotary_dim,
                        sign,
                        False,
                        False,
                    )
        return
    half = rotary_dim // 2
    for unit in range(first, end):
        b, s0, s1, h0, h1 = _unit_bounds(unit, x.shape[2], x.shape[1], tile, n_groups)
        ub = np.uint64(b)
        if order == HEADS_INSIDE:  # pair by pair, each token's heads innermost
            for pair in range(half):
                i1, i2 = _pair_indices(pair, half, interleaved)
                for s in range(s0, s1):
                    c, n = _pair_cache_values(cos, sin, positions, b, s, pair, sign)
                    us = np.uint64(s)
                    for h in range(h0, h1):
                        _rotate_pair_at(x, out, ub, np.uint64(h), us, i1, i2, c, n)
            for channel in range(rotary_dim, x.shape[3]):
                uc = np.uint64(channel)
                for s in range(s0, s1):
                    us = np.uint64(s)
                    for h in range(h0, h1):
                        out[ub, np.uint64(h), us, uc] = x[ub, np.uint64(h), us, uc]
        else:  # TOKENS_INSIDE  # pair by pair, each head's tokens innermost
            for pair in range(half):
                i1, i2 = _pair_indices(pair, half, interleaved)
                for h in range(h0, h1):
                    uh = np.uint64(h)
                    for s in range(s0, s1):
                        c, n = _pair_cache_values(cos, sin, positions, b, s, pair, sign)
                        _rotate_pair_at(x, out, ub, uh, np.uint64(s), i1, i2, c, n)
            for channel in range(rotary_dim, x.shape[3]):
                uc = np.uint64(channel)
                for h in range(h0, h1):
                    uh = np.uint64(h)
                    for s in range(s0, s1):
                        out[ub, uh, np.uint64(s), uc] = x[ub, uh, np.uint64(s), uc]


@cached_njit()
def first_bad_position(position_ids, n_positions):
    """Flat index of the first id outside ``[0, n_positions)``, or -1 if all are valid."""
    flat = 0
    for b in range(position_ids.shape[0]):
        for s in range(position_ids.shape[1]):
            p = position_ids[b, s]
            if p < 0 or p >= n_positions:
                return flat
            flat += 1
    return -1


@cached_njit()
def first_bad_offset(offsets, n_positions, seq_len):
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
    if isinstance(positions, types.Integer):  # one offset: 0 (batch entry 0) if bad
        return lambda positions, n_positions, seq_len: (
            0 if seq_len and not 0 <= positions <= n_positions - seq_len else -1
        )
    if positions.ndim == 2:
        return lambda positions, n_positions, seq_len: first_bad_position(positions, n_positions)
    return lambda positions, n_positions, seq_len: first_bad_offset(positions, n_positions, seq_len)


def _positions_span(positions):  # pragma: no cover - see overload
    """:func:`~numba_rope._geometry.byte_span` of the position ids or offsets, or an
    empty range for None or one offset."""
    raise NotImplementedError


@overload(_positions_span, inline="always")
def _positions_span_overload(positions):
    if isinstance(positions, (types.NoneType, types.Integer)):
        return lambda positions: (0, 0)
    return lambda positions: byte_span_jit(
        positions.ctypes.data, positions.shape, positions.strides, positions.itemsize
    )


@cached_njit()  # not inlined: see below
def _tensors_meet(a, a_span, b, b_span):
    """Whether two BHSD tensors (inputs or outputs) of one item size, with these byte
    spans, may share memory: their spans meet, and their token rows do not prove them
    apart (:func:`~numba_rope._geometry.token_rows_apart`: views of one fused buffer).

    A function of its own, compiled once per pair of array types and called by every
    kernel of those types: inlined into each kernel, its call of
    ``token_rows_apart_jit`` added 0.3-0.5 s to every kernel's compilation (12 kernels
    of one dtype, cold, one process: 24-29 s against 20-23 s, and 17-20 s as a call)."""
    return spans_meet_jit(a_span, b_span) and not token_rows_apart_jit(
        a.ctypes.data, a.shape, a.strides, b.ctypes.data, b.shape, b.strides, a.itemsize
    )


@cached_njit(inline="always")
def _overlaps_own_output(x, cos, sin, positions, out):
    """Whether one tensor's output shares memory with its input (other than as the
    very same elements: rotating in place reads each element before writing it), the
    caches or the positions. The spans are written out here, not in a helper taking
    arrays, so that a new dtype compiles no helper: byte_span_jit takes integers (only
    two tensors whose spans meet are looked at closer, by :func:`_tensors_meet`)."""
    out_span = byte_span_jit(out.ctypes.data, out.shape, out.strides, out.itemsize)
    same_elements = (x.ctypes.data == out.ctypes.data) & (x.strides == out.strides)
    if not same_elements:
        x_span = byte_span_jit(x.ctypes.data, x.shape, x.strides, x.itemsize)
        if _tensors_meet(x, x_span, out, out_span):
            return True
    cos_span = byte_span_jit(cos.ctypes.data, cos.shape, cos.strides, cos.itemsize)
    if spans_meet_jit(cos_span, out_span):
        return True
    sin_span = byte_span_jit(sin.ctypes.data, sin.shape, sin.strides, sin.itemsize)
    if spans_meet_jit(sin_span, out_span):
        return True
    return spans_meet_jit(_positions_span(positions), out_span)


@cached_njit(inline="always")
def _second_tensor_overlaps(x, k, cos, sin, positions, out, out_k):
    """OVERLAP when the second tensor's output meets its input, the caches, the
    positions or the first tensor's input, or the first output meets the second input,
    or the two outputs meet; else DONE."""
    if _overlaps_own_output(k, cos, sin, positions, out_k):
        return OVERLAP
    x_span = byte_span_jit(x.ctypes.data, x.shape, x.strides, x.itemsize)
    k_span = byte_span_jit(k.ctypes.data, k.shape, k.strides, k.itemsize)
    out_span = byte_span_jit(out.ctypes.data, out.shape, out.strides, out.itemsize)
    out_k_span = byte_span_jit(out_k.ctypes.data, out_k.shape, out_k.strides, out_k.itemsize)
    if _tensors_meet(k, k_span, out, out_span) or _tensors_meet(x, x_span, out_k, out_k_span):
        return OVERLAP
    return OVERLAP if _tensors_meet(out, out_span, out_k, out_k_span) else DONE


@cached_njit(inline="always")
def _preflight(x, cos, sin, positions, out, check_overlap):
    """What must stop a launch before anything is written: OVERLAP (``check_overlap``
    and :func:`_overlaps_own_output`), or the index of the first bad position; else
    DONE. The kernels add :func:`_second_tensor_overlaps` for a second tensor."""
    if check_overlap:
        if _overlaps_own_output(x, cos, sin, positions, out):
            return OVERLAP
    # An empty batch has no position to check, as an empty sequence has none.
    bad = _check_positions(positions, cos.shape[0], x.shape[2] if x.shape[0] else 0)
    return DONE if bad < 0 else bad


def units(
    x, k, cos, sin, positions, out, out_k, rotary_dim, first, end, tile, n_groups,
    interleaved, inverse, words, streaming, contiguous, token_major, first_in_place,
    second_in_place,
):  # pragma: no cover - see overload  # fmt: skip
    """Rotate units ``first <= u < end`` (see :func:`make_runner`): one tensor as one
    range, two unit by unit, q's heads then k's (k reuses the tile's cos/sin rows).
    Every runner (:func:`make_runner`) does its work through this function. The
    options are constants (literals): the overload compiles only the row loop they
    choose (:func:`_contiguous_units`, :func:`_token_units` or :func:`_strided_units`).
    ``first_in_place``/``second_in_place``: the output is the input itself, passed as
    the very same array so that LLVM sees the same pointers (see :func:`make_runner`).
    ``inverse``: rotate by the negative angle (sin times -1, a constant of the loops).
    """
    raise NotImplementedError


@overload(units)
def _units_overload(
    x, k, cos, sin, positions, out, out_k, rotary_dim, first, end, tile, n_groups,
    interleaved, inverse, words, streaming, contiguous, token_major, first_in_place,
    second_in_place,
):  # fmt: skip
    flags = (contiguous, token_major, first_in_place, second_in_place, streaming, inverse)
    if not all(isinstance(flag, types.BooleanLiteral) for flag in flags):
        return None  # numba asks again with the constants as literals
    contiguous, token_major, first_in_place, second_in_place, fence, backwards = (
        flag.literal_value for flag in flags
    )
    # The sign of sin as a constant of the row loops: LLVM folds the product by +1
    # away and turns -1 into a negation (exact), where a sign passed as a value cost
    # every vector step two multiplications.
    sign = np.float32(-1.0 if backwards else 1.0)
    loop, scratch_for = _strided_units, _no_scratch
    if contiguous:
        loop = _token_units if token_major else _contiguous_units
        if token_major:
            scratch_for = _cache_scratch  # one scratch for all the units of this range

    # Closure constants, which numba prunes: each loop call below compiles only if its
    # branch is taken (a wrapper function per tensor cost 40-70% more cold compile).
    first_own, second_own = first_in_place, second_in_place
    same_kinds = k == x and out_k == out and first_own == second_own

    def impl(
        x, k, cos, sin, positions, out, out_k, rotary_dim, first, end, tile, n_groups,
        interleaved, inverse, words, streaming, contiguous, token_major, first_in_place,
        second_in_place,
    ):  # fmt: skip
        scratch = scratch_for(x, cos, rotary_dim // 2, interleaved, words)
        if k is None:
            if first_own:
                loop(x, cos, sin, positions, x, rotary_dim, first, end, tile, n_groups,
                     interleaved, sign, words, streaming, scratch)  # fmt: skip
            else:
                loop(x, cos, sin, positions, out, rotary_dim, first, end, tile, n_groups,
                     interleaved, sign, words, streaming, scratch)  # fmt: skip
        elif same_kinds:
            # q and k of one type, both in place or neither: one copy of the loop,
            # given each tensor in turn (half the code to compile of two copies).
            for unit in range(first, end):
                for which in range(2):
                    a = x if which == 0 else k
                    if first_own:
                        loop(a, cos, sin, positions, a, rotary_dim, unit, unit + 1, tile,
                             n_groups, interleaved, sign, words, streaming, scratch)  # fmt: skip
                    else:
                        b = out if which == 0 else out_k
                        loop(a, cos, sin, positions, b, rotary_dim, unit, unit + 1, tile,
                             n_groups, interleaved, sign, words, streaming, scratch)  # fmt: skip
        else:
            for unit in range(first, end):
                if first_own:
                    loop(x, cos, sin, positions, x, rotary_dim, unit, unit + 1, tile,
                         n_groups, interleaved, sign, words, streaming, scratch)  # fmt: skip
                else:
                    loop(x, cos, sin, positions, out, rotary_dim, unit, unit + 1, tile,
                         n_groups, interleaved, sign, words, streaming, scratch)  # fmt: skip
                if second_own:
                    loop(k, cos, sin, positions, k, rotary_dim, unit, unit + 1, tile,
                         n_groups, interleaved, sign, words, streaming, scratch)  # fmt: skip
                else:
                    loop(k, cos, sin, positions, out_k, rotary_dim, unit, unit + 1, tile,
                         n_groups, interleaved, sign, words, streaming, scratch)  # fmt: skip
        if fence:
            store_fence()

    return impl


@cached_njit(any_layout=True)
def _checked(x, k, cos, sin, positions, out, out_k, check_overlap):
    """:func:`_preflight` of one tensor, and of the second when there is one. A
    function of its own, not inlined: compiled once per argument types (of any layout)
    and called by every kernel of those types, instead of compiled into each kernel
    (a call costs nanoseconds; the checks are the same code whatever the options)."""
    status = _preflight(x, cos, sin, positions, out, check_overlap)
    if k is not None and status == DONE and check_overlap:
        status = _second_tensor_overlaps(x, k, cos, sin, positions, out, out_k)
    return status


# -- the kernels: checks, then the rows by the runner of the call's options -------------
#
# Every kernel checks its call (_checked) and then has its units rotated by a runner
# (make_runner): the compiled C function, one per choice of options and kinds of
# arrays, that rotates a chunk of a job written into a control block (relay). The
# kernels themselves hold no row code and do not depend on the options: one
# compilation per kind of arrays serves every option set, and the row loops of an
# option set compile once, in its runner, for the calling thread, numba's parallel
# region, the helper thread and the compiled plans alike.


@cached_njit(inline="always")
def run_job(x, k, cos, sin, positions, out, out_k, rotary_dim, tile, n_groups, n_chunks,
            runner, block, shared):  # fmt: skip
    """Rotate a checked call by the runner at ``runner``: its arguments written into
    ``block``, all units as one chunk on the calling thread; or, where ``shared`` is
    the helper thread's control block (:mod:`numba_rope._cpu.relay`), shared with the
    helper by :func:`_shared_job` when this caller may publish it there."""
    n_units = _n_units(x.shape[0], x.shape[2], tile, n_groups)
    if shared is not None:
        if _shared_job(x, k, cos, sin, positions, out, out_k, rotary_dim, tile, n_groups,
                       n_units, n_chunks, runner, shared):  # fmt: skip
            return
    relay.store_job(block, x, out, cos, sin, positions, rotary_dim, tile, n_groups, n_units)
    if k is not None:
        relay.store_array(block, relay.K_AT, k)
        relay.store_array(block, relay.OUT_K_AT, out_k)
    block[relay.CHUNKS] = 1
    relay.call_runner(runner, block, 0)


@cached_njit()
def _shared_job(x, k, cos, sin, positions, out, out_k, rotary_dim, tile, n_groups, n_units,
                n_chunks, runner, shared):  # fmt: skip
    """Run a checked call's ``n_units`` units with the helper thread whose control
    block is ``shared``, where this caller owns the block and the helper has had a core
    of late (``relay.worth_sharing``): the job published there in ``n_chunks`` chunks,
    which the caller takes from the front and the helper from the back. True when so
    run; False, none of it run, when the caller must run it alone (another caller's
    job running, a helper without a core of late, or one asleep: woken then for the
    calls after, see ``relay.rouse``).

    A function of its own, not inlined into :func:`run_job`: numba copies an inlined
    function's IR with every branch before it drops the dead ones, so the kernels that
    never share (:func:`serial`, the plans of calls on the calling thread) copied this
    code and the helper's protocol under it at each compilation (1.4-1.7 s of a plan's
    3.1-3.4 s in numba's inlining pass on the Zen 4 VM; 0.5 s of 2.0 s since). LLVM
    inlines it back into the kernels that share: their machine code calls no function
    for it."""
    if not relay.take_ownership(shared):
        return False
    if not relay.worth_sharing(shared):
        relay.release(shared)
        return False
    if relay.asleep(shared):  # woken now it would come late: woken for the next call
        relay.rouse(shared)
        return False
    relay.store_job(shared, x, out, cos, sin, positions, rotary_dim, tile, n_groups, n_units)
    if k is not None:
        relay.store_array(shared, relay.K_AT, k)
        relay.store_array(shared, relay.OUT_K_AT, out_k)
    relay.publish(shared, runner, n_chunks)
    own = 0
    chunk = 0  # taken as the job opened
    while chunk < n_chunks:
        relay.call_runner(runner, shared, chunk)
        own += 1
        chunk = relay.claim_own(shared)
    relay.finish(shared, n_chunks, own)
    return True


@cached_njit(any_layout=True)
def serial(x, k, cos, sin, positions, out, out_k, rotary_dim, check_overlap, tile, n_groups,
           runner):  # fmt: skip
    """Check a call and rotate it on the calling thread by the runner at ``runner``
    (:func:`make_runner` of the call's options and kinds of arrays): DONE, OVERLAP
    (``check_overlap`` and an output meets an input) or the index of the first bad
    position, nothing written unless DONE. ``k = out_k = None`` for one tensor (numba
    then compiles no code for a second). Work is split into units of ``tile`` tokens
    and ``n_groups`` groups of heads (see :func:`make_runner`)."""
    status = _checked(x, k, cos, sin, positions, out, out_k, check_overlap)
    if status == DONE:
        block = np.empty(relay.BLOCK_SLOTS, np.int64)
        run_job(x, k, cos, sin, positions, out, out_k, rotary_dim, tile, n_groups, 1,
                runner, block, None)  # fmt: skip
    return status


@cached_njit(any_layout=True, parallel=True)
def parallel(x, k, cos, sin, positions, out, out_k, rotary_dim, check_overlap, tile, n_groups,
             n_chunks, runner):  # fmt: skip
    """:func:`serial` in numba's parallel region: the units in ``n_chunks`` contiguous
    chunks, each run by the runner on one of numba's threads (:func:`run_in_parallel`)."""
    status = _checked(x, k, cos, sin, positions, out, out_k, check_overlap)
    if status != DONE:
        return status
    run_in_parallel(x, k, cos, sin, positions, out, out_k, rotary_dim, tile, n_groups, n_chunks,
                    runner)  # fmt: skip
    return DONE


@cached_njit(inline="always")
def run_in_parallel(x, k, cos, sin, positions, out, out_k, rotary_dim, tile, n_groups, n_chunks,
                    runner):  # fmt: skip
    """Rotate a checked call in the parallel region of the kernel it is inlined into
    (:func:`parallel`, :func:`planned_parallel`): its arguments written into a control
    block of its own, its units in ``n_chunks`` contiguous chunks, each run by the
    runner on one of numba's threads."""
    block = np.empty(relay.BLOCK_SLOTS, np.int64)
    n_units = _n_units(x.shape[0], x.shape[2], tile, n_groups)
    relay.store_job(block, x, out, cos, sin, positions, rotary_dim, tile, n_groups, n_units)
    if k is not None:
        relay.store_array(block, relay.K_AT, k)
        relay.store_array(block, relay.OUT_K_AT, out_k)
    block[relay.CHUNKS] = n_chunks
    for chunk in prange(n_chunks):
        relay.call_runner(runner, block, chunk)


@cached_njit(any_layout=True)
def relayed(x, k, cos, sin, positions, out, out_k, rotary_dim, check_overlap, tile, n_groups,
            n_chunks, block, runner):  # fmt: skip
    """:func:`serial` whose ``n_chunks`` chunks the helper thread may share (see
    :mod:`numba_rope._cpu.relay`): a job in the helper's control block ``block``, whose
    chunks the helper runs by the same runner (see :func:`run_job`)."""
    status = _checked(x, k, cos, sin, positions, out, out_k, check_overlap)
    if status == DONE:
        own = np.empty(relay.BLOCK_SLOTS, np.int64)
        run_job(x, k, cos, sin, positions, out, out_k, rotary_dim, tile, n_groups, n_chunks,
                runner, own, block)  # fmt: skip
    return status


def make_runner(options: tuple, likes: tuple):
    """The function that rotates one chunk of a job of a kernel (:func:`serial`,
    :func:`parallel`, :func:`relayed`, the compiled plans) for one choice of
    ``options``, with arguments like ``likes`` (x, k, cos, sin, positions: tiny arrays
    of their dtypes and dimensions, None, or an integer for one position offset): a C
    function ``void run(int64 block_address, int64 chunk)`` that reads the arrays from
    the control block (:mod:`numba_rope._cpu.relay`) and rotates the chunk's units by
    :func:`units`. The options are compiled in as constants, so that each runner
    compiles only the code it runs; every thread that rotates a job's chunks (the
    caller, numba's, the helper) runs them by it.

    ``options`` is ``(interleaved, inverse, contiguous, in_place, words, streaming,
    token_major)``:

    ``contiguous``: every row of the input, the output and the caches is contiguous
    (:func:`numba_rope._cpu.backend.rows_contiguous`; contiguous arrays, but also views such as ``qkv[...,
    :128]`` or transposed layouts). Rows are then C-contiguous arrays over raw
    pointers, which LLVM vectorizes fully (F16C conversions for float16); otherwise
    they are slices (slower: each slice updates a shared reference count).
    ``words``: the rows are contiguous bfloat16 rows, caches included, rotated two
    elements per 32-bit word (see :func:`rotate_row`).
    ``streaming``: contiguous rows whose output is written with non-temporal stores
    (see :mod:`numba_rope._cpu.vector` and :func:`numba_rope._cpu.backend.streaming`).
    ``token_major``: contiguous rows taken token by token, each token's heads one after
    the other (:func:`_token_units`: a decode step's one-token tiles, and inputs
    whose heads lie inside tokens in memory, see
    :func:`numba_rope._cpu.backend.token_major`) instead of head by head.
    ``in_place``: which outputs are their inputs themselves, a sum of
    :data:`FIRST_IN_PLACE` (the first tensor) and :data:`SECOND_IN_PLACE`.
    The runner then reads and writes through the very same array, so that LLVM sees
    the same pointers and vectorizes; given two pointers it can only test at run time
    that they do not overlap, a test that fails when they are equal and falls back to
    a scalar loop (in place measured 4-15x slower that way).

    Work is split into *units*: one batch entry, a tile of ``tile`` consecutive tokens
    and a group of heads. A unit rotates its heads one after the other, each over the
    tile's tokens: the tile's cos/sin rows are reused by every head from the caches
    while each head's rows stream through memory (``config.TOKENS_PER_TILE`` trades the
    two). Units are numbered (batch, tile, group); a job's chunks are contiguous runs
    of them (chunk ``c`` of ``n``: units ``c * units // n`` to ``(c + 1) * units //
    n``), and heads are split into groups when there are few units. The result does not
    depend on the split: every element is computed by the same arithmetic.

    Only constants live in this closure: numba keys its on-disk cache of a closure by
    its cells, and a cell holding a dispatcher (pickled with a per-process id) would
    miss the cache every time."""
    interleaved, inverse, contiguous, in_place, words, streaming, token_major = options
    first_in_place = bool(in_place & FIRST_IN_PLACE)
    second_in_place = bool(in_place & SECOND_IN_PLACE)
    x_like, k_like, cos_like, sin_like, positions_like = likes
    two = k_like is not None
    if not two:
        k_like = x_like  # not read: ``two`` is a constant

    @cached_cfunc(types.void(types.int64, types.int64))
    def run(address, chunk):
        block = relay.block_at(address)
        x = relay.array_at(block, relay.X_AT, x_like)
        out = relay.array_at(block, relay.OUT_AT, x_like)
        cos = relay.array_at(block, relay.COS_AT, cos_like)
        sin = relay.array_at(block, relay.SIN_AT, sin_like)
        positions = relay.positions_at(block, relay.POSITIONS_AT, positions_like)
        rotary_dim = block[relay.ROTARY_DIM_AT]
        tile = block[relay.TILE_AT]
        n_groups = block[relay.GROUPS_AT]
        n_units = block[relay.UNITS_AT]
        n_chunks = block[relay.CHUNKS]
        first = chunk * n_units // n_chunks
        end = (chunk + 1) * n_units // n_chunks
        if two:
            k = relay.array_at(block, relay.K_AT, k_like)
            out_k = relay.array_at(block, relay.OUT_K_AT, k_like)
            units(x, k, cos, sin, positions, out, out_k, rotary_dim, first, end, tile, n_groups,
                  interleaved, inverse, words, streaming,
                  contiguous, token_major, first_in_place, second_in_place)  # fmt: skip
        else:
            units(x, None, cos, sin, positions, out, None, rotary_dim, first, end, tile,
                  n_groups, interleaved, inverse, words, streaming,
                  contiguous, token_major, first_in_place, second_in_place)  # fmt: skip

    return run


# -- compiled plans: a call of a signature seen before, checked and run in one hop -------

#: Status of :func:`planned` when the call is not the one its plan was made for (or
#: would not run as a plan): the caller takes the general path, which re-validates.
NOT_PLANNED = -3

#: Slots of a compiled plan (an int64 array, see :func:`planned`): the address of the
#: runner (:func:`make_runner`) for the plan's kernel options, the rotary dimension, the
#: tokens per tile, then for each array its ndim and shape (``PLAN_SHAPE_SLOTS``
#: slots; ndim 0 for an absent one or one offset), then the head groups and the chunks
#: of the work split (1 and 1 but for calls shared with the helper thread or run in
#: numba's parallel region).
PLAN_RUNNER = 0
PLAN_ROTARY_DIM = 1
PLAN_TILE = 2
PLAN_SHAPE_SLOTS = 5
PLAN_X = 3
PLAN_K = PLAN_X + PLAN_SHAPE_SLOTS
PLAN_COS = PLAN_K + PLAN_SHAPE_SLOTS
PLAN_SIN = PLAN_COS + PLAN_SHAPE_SLOTS
PLAN_POSITIONS = PLAN_SIN + PLAN_SHAPE_SLOTS
PLAN_OUT = PLAN_POSITIONS + PLAN_SHAPE_SLOTS
PLAN_OUT_K = PLAN_OUT + PLAN_SHAPE_SLOTS
PLAN_GROUPS = PLAN_OUT_K + PLAN_SHAPE_SLOTS
PLAN_CHUNKS = PLAN_GROUPS + 1
#: Of the plans of large calls (:func:`planned_parallel`; 0 in the others): numba's
#: thread count for this thread when the plan was made (the split is made for it),
#: whether the outputs are streamed (:data:`STREAM_ALIGNED`, :data:`STREAM_UNALIGNED`,
#: or 0 where no call of the plan's shapes and options streams), the bytes their first
#: elements start on to stream (``backend.stream_start``) and the caches' step
#: between rows its tiles were made for (``backend.cache_step``: 0 for rows next to each
#: other); a call whose caches' step differs is left to the general path.
PLAN_THREADS = PLAN_CHUNKS + 1
PLAN_STREAM = PLAN_THREADS + 1
PLAN_STREAM_START = PLAN_STREAM + 1
PLAN_CACHES = PLAN_STREAM_START + 1
#: The control block a plan's call hands its runner (``relay.BLOCK_SLOTS`` slots),
#: written afresh by each call: part of the plan rather than allocated per call (an
#: allocation and a free, against a 5 us call). The calls of one plan never overlap:
#: :func:`planned` and the other entries hold the GIL (none is ``nogil``), and
#: nothing in them calls back. A call shared with the helper publishes its job in the
#: helper's block instead; the helper never reads a plan's own block. The entries of
#: large calls (:func:`planned_parallel`) do not use it: numba's parallel region lets
#: other Python threads run, and one plan's calls from two of them ran together (a
#: block shared, wrong results in 3 of 12 runs of
#: ``test_concurrent_calls_from_python_threads``).
PLAN_BLOCK = PLAN_CACHES + 1
PLAN_SLOTS = PLAN_BLOCK + relay.BLOCK_SLOTS

#: :data:`PLAN_STREAM` of a plan whose runner streams its outputs: every call of the
#: plan's shapes and options whose outputs start on :data:`PLAN_STREAM_START` bytes
#: and have their rows on ``STREAM_ALIGNMENT`` bytes streams (``backend.streaming``); a
#: call whose outputs do not is left to the general path. :data:`STREAM_UNALIGNED`:
#: the other way round.
STREAM_ALIGNED = 1
STREAM_UNALIGNED = 2


def _shape_is(array, plan, slot):  # pragma: no cover - see overload
    """Whether ``array`` has the ndim and shape written in ``plan`` from ``slot`` on
    (ndim 0 for None)."""
    raise NotImplementedError


@overload(_shape_is)  # not inlined: numba's inliner loses loop variables' scope
def _shape_is_overload(array, plan, slot):
    if isinstance(array, (types.NoneType, types.Integer)):  # None, or one offset
        return lambda array, plan, slot: plan[slot] == 0

    def impl(array, plan, slot):
        same = plan[slot] == array.ndim
        for i in range(array.ndim):
            same = same and plan[slot + 1 + i] == array.shape[i]
        return same

    return impl


def _rows_apart(array):  # pragma: no cover - see overload
    """Whether ``array`` (or None) has contiguous rows (unit stride on its last axis)."""
    raise NotImplementedError


@overload(_rows_apart, inline="always")
def _rows_apart_overload(array):
    if isinstance(array, types.NoneType):
        return lambda array: True
    return lambda array: array.strides[array.ndim - 1] == array.itemsize


def _distinct_output(out):  # pragma: no cover - see overload
    """Whether ``out`` (or None) is writable, with no two elements on one byte
    (:func:`~numba_rope._geometry.elements_distinct`)."""
    raise NotImplementedError


@overload(_distinct_output)  # not inlined, as _shape_is
def _distinct_output_overload(out):
    if isinstance(out, types.NoneType):
        return lambda out: True
    if not out.mutable:  # a read-only output: the general path names it
        return lambda out: False

    def impl(out):
        # C-contiguous (the usual output, tested first: a few comparisons), or not and
        # its strides are looked at closer.
        step = out.itemsize
        for i in range(out.ndim - 1, -1, -1):
            if out.shape[i] != 1 and out.strides[i] != step:
                return elements_distinct(out.shape, out.strides, out.itemsize)
            step *= out.shape[i]
        return True

    return impl


def _stream_aligned(out, start):  # pragma: no cover - see overload
    """Whether ``out`` (or None) starts on ``start`` bytes (``backend.stream_start``)
    and has its rows on ``STREAM_ALIGNMENT`` bytes: the part of ``backend.streaming``
    that depends on where an output lies rather than on the call's shapes, dtypes and
    options."""
    raise NotImplementedError


@overload(_stream_aligned)  # not inlined, as _shape_is
def _stream_aligned_overload(out, start):
    if isinstance(out, types.NoneType):
        return lambda out, start: True

    def impl(out, start):
        if out.ctypes.data % start:
            return False
        for i in range(out.ndim - 1):
            if out.strides[i] % STREAM_ALIGNMENT:
                return False
        return True

    return impl


def _cache_step(cos, sin):  # pragma: no cover - see overload
    """``backend.cache_step`` in compiled code, for caches of equal shapes."""
    raise NotImplementedError


@overload(_cache_step)  # not inlined, as _shape_is
def _cache_step_overload(cos, sin):
    def impl(cos, sin):
        last = cos.ndim - 1
        if cos.shape[last - 1] < 2:
            return 0
        step = max(abs(cos.strides[last - 1]), abs(sin.strides[last - 1]))
        if step <= cos.shape[last] * cos.itemsize or _rows_dense(cos, sin):
            return 0
        return step

    return impl


def _rows_dense(cos, sin):  # pragma: no cover - see overload
    """``backend.rows_dense`` in compiled code, for caches of equal shapes."""
    raise NotImplementedError


@overload(_rows_dense)  # not inlined, as _shape_is
def _rows_dense_overload(cos, sin):
    def impl(cos, sin):
        last = cos.ndim - 1
        row = cos.shape[last] * cos.itemsize
        for i in range(cos.ndim):
            if cos.strides[i] != sin.strides[i]:
                return False
        if cos.shape[last] > 1 and cos.strides[last] != cos.itemsize:
            return False
        step = row
        if cos.shape[last - 1] > 1:
            step = cos.strides[last - 1]
            gap = abs(sin.ctypes.data - cos.ctypes.data)
            if step != row and not (step == 2 * row and gap == row):
                return False
        return (
            cos.ndim == 2
            or cos.shape[0] == 1
            or cos.strides[0] == 0
            or cos.strides[0] == cos.shape[1] * step
        )

    return impl


@cached_njit(any_layout=True)
def planned(x, k, cos, sin, positions, out, out_k, plan):
    """Run a small call of q and k by its compiled plan: see :func:`run_planned`."""
    return run_planned(x, k, cos, sin, positions, out, out_k, plan, None)


@cached_njit(any_layout=True)
def planned_one(x, cos, sin, positions, out, plan):
    """Run a small call of one tensor by its compiled plan: see :func:`run_planned`.
    An entry of its own, not :func:`planned` with two Nones: each argument costs a
    numba dispatch from Python about 0.05-0.08 us, against a 5 us call."""
    return run_planned(x, None, cos, sin, positions, out, None, plan, None)


@cached_njit(any_layout=True)
def planned_shared(x, k, cos, sin, positions, out, out_k, plan, shared):
    """Run a call of q and k by its compiled plan, sharing its chunks with the helper
    thread whose control block is ``shared``: see :func:`run_planned`."""
    return run_planned(x, k, cos, sin, positions, out, out_k, plan, shared)


@cached_njit(any_layout=True)
def planned_shared_one(x, cos, sin, positions, out, plan, shared):
    """Run a call of one tensor by its compiled plan, sharing its chunks with the
    helper thread whose control block is ``shared``: see :func:`run_planned`."""
    return run_planned(x, None, cos, sin, positions, out, None, plan, shared)


@cached_njit(inline="always")
def run_planned(x, k, cos, sin, positions, out, out_k, plan, shared):
    """Run a small call by its compiled plan: DONE, or NOT_PLANNED (nothing written)
    when the call is not the plan's (:func:`_fits_plan`): the general path then
    validates and runs it, raising what it must.

    ``plan`` (see ``PLAN_*``) was written when a call of these dtypes and options was
    validated (the caller compares the dtypes: this function is compiled for any).
    The rotation is done by the plan's runner (:func:`make_runner` of the call's
    options), as the kernels do it (:func:`run_job`), through the control block held
    in the plan (``PLAN_BLOCK``): one compiled function for every option set, whose
    own compilation is small, and a call to it costs one numba dispatch.

    ``shared``: None, or the control block of the helper thread (see
    :mod:`numba_rope._cpu.relay`) for a plan of a call that the general path shares
    with it (:func:`relayed`, the same split into chunks): the job is published there
    and the caller runs its own chunks by the runner too. Alone, as in
    :func:`relayed` (another caller's job running, or a helper without a core of
    late), the call runs as one chunk through the plan's own block.
    """
    if not _fits_plan(x, k, cos, sin, positions, out, out_k, plan, False):
        return NOT_PLANNED
    run_job(x, k, cos, sin, positions, out, out_k, plan[PLAN_ROTARY_DIM], plan[PLAN_TILE],
            plan[PLAN_GROUPS], plan[PLAN_CHUNKS], plan[PLAN_RUNNER], plan[PLAN_BLOCK:],
            shared)  # fmt: skip
    return DONE


@cached_njit(inline="always")
def _fits_plan(x, k, cos, sin, positions, out, out_k, plan, large):
    """Whether a call is its compiled plan's, and would run: the arrays of the plan's
    shapes with contiguous rows, outputs writable with no two elements on one byte,
    no output overlapping an input and every position in range (:func:`_checked`);
    for a plan of a large call (``large``, a constant: the small calls' entries
    compile none of it) also the outputs streamed as the plan's runner streams
    (:data:`PLAN_STREAM`) and caches of the step between rows that its tiles were
    made for (:data:`PLAN_CACHES`)."""
    if not (
        _shape_is(x, plan, PLAN_X)
        and _shape_is(k, plan, PLAN_K)
        and _shape_is(cos, plan, PLAN_COS)
        and _shape_is(sin, plan, PLAN_SIN)
        and _shape_is(positions, plan, PLAN_POSITIONS)
        and _shape_is(out, plan, PLAN_OUT)
        and _shape_is(out_k, plan, PLAN_OUT_K)
    ):
        return False
    if not (
        _rows_apart(x)
        and _rows_apart(k)
        and _rows_apart(cos)
        and _rows_apart(sin)
        and _rows_apart(out)
        and _rows_apart(out_k)
        and _distinct_output(out)
        and _distinct_output(out_k)
    ):
        return False
    if large:
        stream, start = plan[PLAN_STREAM], plan[PLAN_STREAM_START]
        if stream != 0 and (_stream_aligned(out, start) and _stream_aligned(out_k, start)) != (
            stream == STREAM_ALIGNED
        ):
            return False
        if _cache_step(cos, sin) != plan[PLAN_CACHES]:
            return False
    return _checked(x, k, cos, sin, positions, out, out_k, True) == DONE


@cached_njit(any_layout=True, parallel=True)
def planned_parallel(x, k, cos, sin, positions, out, out_k, plan):
    """Run a large call of q and k by its compiled plan in numba's parallel region: see
    :func:`run_planned_parallel`."""
    return run_planned_parallel(x, k, cos, sin, positions, out, out_k, plan)


@cached_njit(any_layout=True, parallel=True)
def planned_parallel_one(x, cos, sin, positions, out, plan):
    """Run a large call of one tensor by its compiled plan in numba's parallel region:
    see :func:`run_planned_parallel`."""
    return run_planned_parallel(x, None, cos, sin, positions, out, None, plan)


@cached_njit(inline="always")
def run_planned_parallel(x, k, cos, sin, positions, out, out_k, plan):
    """:func:`run_planned` of a call that :func:`parallel` runs: DONE, or NOT_PLANNED
    (nothing written) when the call is not the plan's (:func:`_fits_plan`). The caller
    checks that the process may run parallel regions, with the thread count that the
    plan's split was made for (``PLAN_THREADS``; numba's ``get_num_threads`` in
    compiled code would keep the function out of numba's cache). The units in
    ``plan[PLAN_CHUNKS]`` chunks, as :func:`parallel` runs them (:func:`run_in_parallel`),
    through a control block of the call's own: not the plan's, as Python threads may
    run one plan at once (numba's parallel region lets go of the GIL)."""
    if not _fits_plan(x, k, cos, sin, positions, out, out_k, plan, True):
        return NOT_PLANNED
    run_in_parallel(x, k, cos, sin, positions, out, out_k, plan[PLAN_ROTARY_DIM], plan[PLAN_TILE],
                    plan[PLAN_GROUPS], plan[PLAN_CHUNKS], plan[PLAN_RUNNER])  # fmt: skip
    return DONE
