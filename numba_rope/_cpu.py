"""CPU kernels: parallel ``@njit`` loops over the rows of the input.

A *row* is the ``head_size`` elements of one (batch, head, token). The kernels walk
units of rows (a sequence's tile of tokens over its heads, see :func:`_make_kernels`);
the parallel kernels split the units into contiguous chunks so each thread streams
through memory, and small inputs run the same loop on the calling thread.

The kernels trust their arguments: :mod:`numba_rope._validation` has checked shapes,
dtypes and position ids before any of them runs. float16 and bfloat16 arrays arrive as
16-bit integer views (see :mod:`numba_rope._conversions`).
"""

from __future__ import annotations

import functools
import platform
import threading

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.arrayobj import populate_array

from numba_rope import config
from numba_rope._conversions import (
    BFLOAT16_STORAGE,
    bfloat16_high_code,
    bfloat16_low_code,
    bfloat16_pair_code,
    narrow_code,
    narrow_like,
    widen,
    widen_code,
)
from numba_rope._rotation import rotate_pair

#: The numba type of bfloat16 storage.
BFLOAT16_TYPE = numba.from_dtype(BFLOAT16_STORAGE)


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


@intrinsic
def _row(typingctx, array, byte_offset, length):
    """A C-contiguous 1-D array over ``length`` elements of ``array`` starting at
    ``byte_offset``: no copy and, unlike a slice, no reference count to update. An
    intrinsic (emitted directly, nothing to inline) to keep compile times short."""
    if not isinstance(array, types.Array):
        return None
    row_type = types.Array(array.dtype, 1, "C")

    def codegen(context, builder, signature, args):
        source = context.make_array(signature.args[0])(context, builder, args[0])
        offset = context.cast(builder, args[1], signature.args[1], types.intp)
        address = builder.add(builder.ptrtoint(source.data, ir.IntType(64)), offset)
        row = context.make_array(row_type)(context, builder)
        populate_array(
            row,
            data=builder.inttoptr(address, source.data.type),
            shape=cgutils.pack_array(
                builder, [context.cast(builder, args[2], signature.args[2], types.intp)]
            ),
            strides=cgutils.pack_array(builder, [source.itemsize]),
            itemsize=source.itemsize,
            meminfo=None,
        )
        return row._getvalue()

    return row_type(array, byte_offset, length), codegen


#: Pairs per step of the streaming loops; their stores need 16-byte alignment.
STREAM_WIDTH = 8
STREAM_ALIGNMENT = 16

#: Storage types the streaming loops take (float32 and the 16-bit formats).
_STREAM_TYPES = (types.float32, types.uint16, types.int16)

_LANE = ir.IntType(32)


class _Stream:
    """LLVM code shared by the vector intrinsics (streaming and bfloat16 words): vectors
    of :data:`STREAM_WIDTH` (or twice that) elements or words loaded from rows, and
    stores into them, non-temporal ones for streaming."""

    def __init__(self, context, builder):
        self.builder = builder
        self.intp = context.get_value_type(types.intp)
        self.nontemporal = builder.module.add_metadata([ir.Constant(_LANE, 1)])

    def pointer(self, array, index, lanes):
        element = array.data.type.pointee
        pointer = self.builder.gep(array.data, [index])
        return self.builder.bitcast(pointer, ir.VectorType(element, lanes).as_pointer())

    def load(self, array, index, numba_type, lanes=STREAM_WIDTH):
        loaded = self.builder.load(
            self.pointer(array, index, lanes), align=numba_type.bitwidth // 8
        )
        return widen_code(self.builder, numba_type, loaded)

    def nontemporal_store(self, value, pointer):
        """A non-temporal store, on :data:`STREAM_ALIGNMENT` bytes (which the caller
        guarantees)."""
        stored = self.builder.store(value, pointer)
        stored.align = STREAM_ALIGNMENT
        stored.set_metadata("nontemporal", self.nontemporal)

    def store(self, value, array, index, numba_type, lanes=STREAM_WIDTH):
        """``value`` narrowed to ``numba_type``, stored non-temporally at ``index``."""
        narrowed = narrow_code(self.builder, numba_type, value)
        self.nontemporal_store(narrowed, self.pointer(array, index, lanes))

    def word_pointer(self, array, index):
        """:data:`STREAM_WIDTH` 32-bit words of 16-bit storage from element ``index``."""
        pointer = self.builder.gep(array.data, [index])
        return self.builder.bitcast(pointer, ir.VectorType(_LANE, STREAM_WIDTH).as_pointer())

    def load_words(self, array, index):
        return self.builder.load(self.word_pointer(array, index), align=2)

    def store_words(self, words, array, index, nontemporal):
        """An ordinary store, or a non-temporal one (:meth:`nontemporal_store`)."""
        if nontemporal:
            self.nontemporal_store(words, self.word_pointer(array, index))
        else:
            self.builder.store(words, self.word_pointer(array, index)).align = 2

    def splat(self, value):
        vector = ir.Constant(ir.VectorType(value.type, STREAM_WIDTH), ir.Undefined)
        for lane in range(STREAM_WIDTH):
            vector = self.builder.insert_element(vector, value, ir.Constant(_LANE, lane))
        return vector

    def shuffle(self, first, second, lanes):
        mask = ir.Constant(ir.VectorType(_LANE, len(lanes)), lanes)
        return self.builder.shuffle_vector(first, second, mask)

    def loop(self, start, count, step):
        """``for_range_slice`` over ``[start, start + count)`` by ``step``."""
        end = self.builder.add(start, count)
        return cgutils.for_range_slice(
            self.builder, start, end, ir.Constant(self.intp, step), self.intp
        )

    def steps(self, length):
        """``length`` rounded down to a multiple of :data:`STREAM_WIDTH`."""
        return self.builder.and_(length, ir.Constant(self.intp, -STREAM_WIDTH))

    def rotate(self, x1, x2, cos, sin, sign):
        """``rotate_pair`` on vectors: one rounding per operation, no contraction."""
        builder = self.builder
        sin = builder.fmul(sin, self.splat(sign))
        return (
            builder.fsub(builder.fmul(x1, cos), builder.fmul(x2, sin)),
            builder.fadd(builder.fmul(x2, cos), builder.fmul(x1, sin)),
        )


def _stream_typing(x_row, cos_row, sin_row, out_row):
    rows = (x_row, cos_row, sin_row, out_row)
    return (
        all(isinstance(row, types.Array) and row.dtype in _STREAM_TYPES for row in rows)
        and x_row.dtype == out_row.dtype
        and cos_row.dtype == sin_row.dtype
    )


def _word_typing(x_row, cos_row, sin_row, out_row):
    rows = (x_row, cos_row, sin_row, out_row)
    return all(isinstance(row, types.Array) and row.dtype == BFLOAT16_TYPE for row in rows)


def _stream_arguments(context, builder, signature, args):
    rows = [
        context.make_array(kind)(context, builder, value)
        for kind, value in zip(signature.args[:4], args[:4], strict=True)
    ]
    half = context.cast(builder, args[4], signature.args[4], types.intp)
    sign = context.cast(builder, args[5], signature.args[5], types.float32)
    return rows, signature.args[0].dtype, signature.args[1].dtype, half, sign


def _stream_pairs(x_row, cos_row, sin_row, out_row, half, sign):
    """Typing of a :func:`_vector_pairs` step: rotate the first ``n`` pairs of a row of
    ``half`` non-interleaved pairs, ``n`` = ``half`` rounded down to a multiple of
    :data:`STREAM_WIDTH`, and return ``n``.

    Written in LLVM vectors so that the stores can be non-temporal: the output goes to
    memory without first being read into the cache (a third of the memory traffic of
    a large RoPE), which LLVM's loop vectorizer does not do for stores of unknown
    alignment. The caller guarantees that the output row and its second half start
    on :data:`STREAM_ALIGNMENT` bytes (see :func:`streaming`); loads need no
    alignment. The arithmetic is :func:`numba_rope._rotation.rotate_pair`'s, one
    rounding per operation, no contraction: the bits of the element loop.
    """
    if not _stream_typing(x_row, cos_row, sin_row, out_row):
        return None

    def codegen(context, builder, signature, args):
        (x, cos, sin, out), x_type, cache_type, half, sign = _stream_arguments(
            context, builder, signature, args
        )
        stream = _Stream(context, builder)
        count = stream.steps(half)
        with stream.loop(ir.Constant(stream.intp, 0), count, STREAM_WIDTH) as (first, _):
            second = builder.add(first, half)
            y1, y2 = stream.rotate(
                stream.load(x, first, x_type),
                stream.load(x, second, x_type),
                stream.load(cos, first, cache_type),
                stream.load(sin, first, cache_type),
                sign,
            )
            stream.store(y1, out, first, x_type)
            stream.store(y2, out, second, x_type)
        return count

    return types.intp(x_row, cos_row, sin_row, out_row, half, sign), codegen


#: Lanes of a vector of 2 x STREAM_WIDTH interleaved elements: the first and the
#: second of each pair, and back.
_FIRSTS = list(range(0, 2 * STREAM_WIDTH, 2))
_SECONDS = list(range(1, 2 * STREAM_WIDTH, 2))
_INTERLEAVED = [lane for pair in range(STREAM_WIDTH) for lane in (pair, pair + STREAM_WIDTH)]


def _stream_interleaved_pairs(x_row, cos_row, sin_row, out_row, half, sign):
    """:func:`_stream_pairs` for interleaved pairs (the output row must start on
    :data:`STREAM_ALIGNMENT` bytes): :data:`STREAM_WIDTH` pairs are loaded as one
    vector, split into firsts and seconds, and merged back after the rotation."""
    if not _stream_typing(x_row, cos_row, sin_row, out_row):
        return None

    def codegen(context, builder, signature, args):
        (x, cos, sin, out), x_type, cache_type, half, sign = _stream_arguments(
            context, builder, signature, args
        )
        stream = _Stream(context, builder)
        count = stream.steps(half)
        lanes = 2 * STREAM_WIDTH
        with stream.loop(ir.Constant(stream.intp, 0), count, STREAM_WIDTH) as (pair, _):
            element = builder.add(pair, pair)
            pairs = stream.load(x, element, x_type, lanes)
            y1, y2 = stream.rotate(
                stream.shuffle(pairs, pairs, _FIRSTS),
                stream.shuffle(pairs, pairs, _SECONDS),
                stream.load(cos, pair, cache_type),
                stream.load(sin, pair, cache_type),
                sign,
            )
            stream.store(stream.shuffle(y1, y2, _INTERLEAVED), out, element, x_type, lanes)
        return count

    return types.intp(x_row, cos_row, sin_row, out_row, half, sign), codegen


def _word_pairs_typing(nontemporal, x_row, cos_row, sin_row, out_row, half, sign):
    """Rotate the first ``n`` pairs of a row of bfloat16 (caches included), ``half``
    non-interleaved pairs, two elements per 32-bit word (see
    :mod:`numba_rope._conversions`), and return ``n``: ``2 * STREAM_WIDTH`` pairs a
    step, ordinary stores. The same arithmetic per element as the element loop, a
    quarter fewer instructions. Written in LLVM vectors rather than as a numba loop:
    numba inlines every branch of :func:`_rotate_row` before dropping the dead ones,
    and this code would cost every kernel's compilation, bfloat16 or not."""
    if not _word_typing(x_row, cos_row, sin_row, out_row):
        return None

    def codegen(context, builder, signature, args):
        (x, cos, sin, out), _, _, half, sign = _stream_arguments(context, builder, signature, args)
        stream = _Stream(context, builder)
        words = stream.steps(builder.sdiv(half, ir.Constant(stream.intp, 2)))
        count = builder.add(words, words)  # pairs, 2 per word
        step = 2 * STREAM_WIDTH
        with stream.loop(ir.Constant(stream.intp, 0), count, step) as (first, _):
            second = builder.add(first, half)
            a, b = stream.load_words(x, first), stream.load_words(x, second)
            c, s = stream.load_words(cos, first), stream.load_words(sin, first)
            y1_low, y2_low = stream.rotate(
                *(bfloat16_low_code(builder, w) for w in (a, b, c, s)), sign
            )
            y1_high, y2_high = stream.rotate(
                *(bfloat16_high_code(builder, w) for w in (a, b, c, s)), sign
            )
            y1 = bfloat16_pair_code(builder, y1_low, y1_high)
            stream.store_words(y1, out, first, nontemporal)
            y2 = bfloat16_pair_code(builder, y2_low, y2_high)
            stream.store_words(y2, out, second, nontemporal)
        return count

    return types.intp(x_row, cos_row, sin_row, out_row, half, sign), codegen


def _word_interleaved_pairs_typing(nontemporal, x_row, cos_row, sin_row, out_row, half, sign):
    """:func:`_word_pairs_typing` for interleaved pairs: word ``i`` of a row holds pair ``i``
    (``x1`` low, ``x2`` high), in and out; :data:`STREAM_WIDTH` pairs a step."""
    if not _word_typing(x_row, cos_row, sin_row, out_row):
        return None

    def codegen(context, builder, signature, args):
        (x, cos, sin, out), _, cache_type, half, sign = _stream_arguments(
            context, builder, signature, args
        )
        stream = _Stream(context, builder)
        count = stream.steps(half)
        with stream.loop(ir.Constant(stream.intp, 0), count, STREAM_WIDTH) as (pair, _):
            element = builder.add(pair, pair)
            pairs = stream.load_words(x, element)
            y1, y2 = stream.rotate(
                bfloat16_low_code(builder, pairs),
                bfloat16_high_code(builder, pairs),
                stream.load(cos, pair, cache_type),
                stream.load(sin, pair, cache_type),
                sign,
            )
            stream.store_words(bfloat16_pair_code(builder, y1, y2), out, element, nontemporal)
        return count

    return types.intp(x_row, cos_row, sin_row, out_row, half, sign), codegen


#: The vector step of a row (typing functions) by (interleaved, words, streaming): the
#: word loops (ordinary stores), their streaming forms (non-temporal stores) and the
#: streaming element vectors; see :func:`_vector_pairs`.
_VECTOR_PAIRS = {
    (False, True, False): functools.partial(_word_pairs_typing, False),
    (True, True, False): functools.partial(_word_interleaved_pairs_typing, False),
    (False, True, True): functools.partial(_word_pairs_typing, True),
    (True, True, True): functools.partial(_word_interleaved_pairs_typing, True),
    (False, False, True): _stream_pairs,
    (True, False, True): _stream_interleaved_pairs,
}


def _flag(value) -> bool | None:
    """The value of a compile-time boolean option (its literal type), else None."""
    return value.literal_value if isinstance(value, types.BooleanLiteral) else None


@intrinsic(prefer_literal=True)
def _vector_pairs(
    typingctx, x_row, cos_row, sin_row, out_row, half, sign, interleaved, words, streaming
):
    """The vector step of a row: rotate its first ``n`` pairs and return ``n``, by the
    loop that the constant options choose, or none (``n`` = 0), leaving the rest to
    the element loops of :func:`_rotate_row`. One intrinsic whose typing picks the
    code: numba inlines a function with every branch before it drops the dead ones, so
    a chain of branches to six intrinsics cost every kernel's compilation."""
    options = (_flag(interleaved), _flag(words), _flag(streaming))
    if None in options:
        return None  # the options must be compile-time constants
    rows = (x_row, cos_row, sin_row, out_row, half, sign)
    typing = _VECTOR_PAIRS.get(options)
    if typing is None:

        def codegen(context, builder, signature, args):
            return context.get_constant(types.intp, 0)

    else:
        typed = typing(*rows)
        if typed is None:
            return None
        inner_signature, inner_codegen = typed

        def codegen(context, builder, signature, args):
            return inner_codegen(context, builder, inner_signature, args[:6])

    return types.intp(*rows, interleaved, words, streaming), codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def _store_fence(typingctx):
    """A store fence: non-temporal stores are weakly ordered, so each thread that made
    some fences them before it reports its work done, whatever the threading layer's
    own barrier guarantees. ``sfence`` on x86, the instruction documented for ordering
    non-temporal stores (LLVM would turn a plain fence into a locked ``or``), a full
    fence elsewhere."""

    def codegen(context, builder, signature, args):
        if _X86:
            sfence = builder.module.declare_intrinsic(
                "llvm.x86.sse.sfence", fnty=ir.FunctionType(ir.VoidType(), [])
            )
            builder.call(sfence, [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic(prefer_literal=True)
def _stream_copy(typingctx, x_row, out_row, start, end, streaming):
    """With ``streaming`` (a constant): copy elements ``[start, m)`` of a row with
    non-temporal stores, ``m - start`` the largest multiple of :data:`STREAM_WIDTH` up
    to ``end``, and return ``m`` (the channels past ``rotary_dim``; element ``start``
    of the output must be on :data:`STREAM_ALIGNMENT` bytes). Without: return
    ``start``, copying nothing."""
    if not (isinstance(x_row, types.Array) and x_row.dtype == getattr(out_row, "dtype", None)):
        return None
    if _flag(streaming) is None:
        return None
    signature = types.intp(x_row, out_row, start, end, streaming)
    if not _flag(streaming):
        return signature, lambda context, builder, signature, args: context.cast(
            builder, args[2], signature.args[2], types.intp
        )

    def codegen(context, builder, signature, args):
        x = context.make_array(signature.args[0])(context, builder, args[0])
        out = context.make_array(signature.args[1])(context, builder, args[1])
        start = context.cast(builder, args[2], signature.args[2], types.intp)
        end = context.cast(builder, args[3], signature.args[3], types.intp)
        stream = _Stream(context, builder)
        count = stream.steps(builder.sub(end, start))
        with stream.loop(start, count, STREAM_WIDTH) as (index, _):
            loaded = builder.load(stream.pointer(x, index, STREAM_WIDTH), align=1)
            stream.nontemporal_store(loaded, stream.pointer(out, index, STREAM_WIDTH))
        return builder.add(start, count)

    return signature, codegen


@njit(cache=True, inline="always")
def _rotate_row(x_row, cos_row, sin_row, out_row, interleaved, rotary_dim, sign, words, streaming):
    """Rotate one row. Each pair is read before either of its elements is written, so
    ``out_row`` may be ``x_row``.

    The element loops below do any row, and LLVM vectorizes them. Two options hand
    most pairs to loops written in LLVM vectors first (:func:`_vector_pairs`), leaving
    the element loops what is left over: ``words`` (rows of bfloat16, caches included:
    two elements per 32-bit word, :func:`_word_pairs_typing`,
    :func:`_word_interleaved_pairs_typing`) and ``streaming`` (non-temporal stores:
    :func:`_stream_pairs`, :func:`_stream_interleaved_pairs`, and :func:`_stream_copy`
    for the channels past ``rotary_dim``).

    Inlined into kernels where the options are constants: :func:`_vector_pairs` and
    :func:`_stream_copy` emit only the code they choose, LLVM drops the element loop
    not in use, and a ``sign`` of +1 costs nothing. The indices are unsigned:
    numba then emits no negative-index wrap-around, which would keep these loops from
    vectorizing.
    """
    half = rotary_dim // 2
    first = _vector_pairs(
        x_row, cos_row, sin_row, out_row, half, sign, interleaved, words, streaming
    )
    if interleaved:
        for pair in range(first, half):
            i = np.uint64(pair)
            i1 = np.uint64(2 * pair)
            i2 = np.uint64(2 * pair + 1)
            y1, y2 = rotate_pair(
                widen(x_row[i1]), widen(x_row[i2]), widen(cos_row[i]), widen(sin_row[i]) * sign
            )
            out_row[i1] = narrow_like(y1, out_row)
            out_row[i2] = narrow_like(y2, out_row)
    else:
        for pair in range(first, half):
            i = np.uint64(pair)
            i2 = np.uint64(pair + half)
            y1, y2 = rotate_pair(
                widen(x_row[i]), widen(x_row[i2]), widen(cos_row[i]), widen(sin_row[i]) * sign
            )
            out_row[i] = narrow_like(y1, out_row)
            out_row[i2] = narrow_like(y2, out_row)
    copied = _stream_copy(x_row, out_row, rotary_dim, x_row.shape[0], streaming)
    for channel in range(copied, x_row.shape[0]):
        i = np.uint64(channel)
        out_row[i] = x_row[i]


def rows_contiguous(*arrays) -> bool:
    """Whether every row of these arrays is contiguous (unit stride along the last axis):
    the kernels then take rows as C-contiguous arrays over raw pointers."""
    for array in arrays:
        if array.strides[-1] != array.itemsize:
            return False
    return True


@njit(cache=True)
def _n_units(batch, seq_len, tile, n_groups):
    """Number of work units: (batch entry, tile of ``tile`` tokens, head group)."""
    return batch * ((seq_len + tile - 1) // tile) * n_groups


@njit(cache=True)
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


@njit(cache=True, inline="always")
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
):
    """Rotate units ``first <= u < end`` (see :func:`_make_kernels`) whose rows are all
    contiguous: as C-contiguous arrays over raw pointers, which LLVM vectorizes fully
    (F16C conversions for float16). Inlined into each kernel, where ``interleaved`` and
    ``sign`` are constants."""
    head_size = x.shape[3]
    half = rotary_dim // 2
    for unit in range(first, end):
        b, s0, s1, h0, h1 = _unit_bounds(unit, x.shape[2], x.shape[1], tile, n_groups)
        for h in range(h0, h1):
            for s in range(s0, s1):
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
                    words,
                    streaming,
                )
    if streaming:
        _store_fence()


@njit(cache=True, inline="always")
def _strided_units(
    x, cos, sin, positions, out, rotary_dim, first, end, tile, n_groups, interleaved, sign
):
    """:func:`_contiguous_units` for any strides: rows are slices (slower: each slice
    updates a shared reference count)."""
    for unit in range(first, end):
        b, s0, s1, h0, h1 = _unit_bounds(unit, x.shape[2], x.shape[1], tile, n_groups)
        for h in range(h0, h1):
            for s in range(s0, s1):
                row_index = _cache_row_index(cos, positions, b, s)
                _rotate_row(
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


def _make_kernels(
    interleaved: bool,
    inverse: bool,
    contiguous: bool,
    in_place: int,
    words: bool,
    streaming: bool,
):
    """The CPU kernels for one choice of options, compiled in as constants: each call
    compiles only the code it runs.

    ``contiguous``: every row of the input, the output and the caches is contiguous
    (:func:`rows_contiguous`; contiguous arrays, but also views such as ``qkv[...,
    :128]`` or transposed layouts). Rows are then C-contiguous arrays over raw
    pointers, which LLVM vectorizes fully (F16C conversions for float16); otherwise
    they are slices (slower: each slice updates a shared reference count).
    ``words``: the rows are contiguous bfloat16 rows, caches included, rotated two
    elements per 32-bit word (see :func:`_rotate_row`).
    ``streaming``: contiguous rows whose output is written with non-temporal stores
    (see :func:`_vector_pairs`, :func:`_stream_copy` and :func:`streaming`).
    ``in_place``: which outputs are their inputs themselves, a sum of
    :data:`X_IN_PLACE` (the input, or q for the q+k kernels) and :data:`K_IN_PLACE`.
    The kernel then reads and writes through the very same array, so that LLVM sees
    the same pointers and vectorizes; given two pointers it can only test at run time
    that they do not overlap, a test that fails when they are equal and falls back to
    a scalar loop (in place measured 4-15x slower that way).

    Work is split into *units*: one batch entry, a tile of ``tile`` consecutive tokens
    and a group of heads. A unit rotates its heads one after the other, each over the
    tile's tokens: the tile's cos/sin rows are reused by every head from the caches
    while each head's rows stream through memory (``config.TOKENS_PER_TILE`` trades the
    two). Units are numbered (batch, tile, group); the parallel kernels give each thread
    contiguous chunks of them, and split heads into groups when there are few units.
    The result does not depend on the split: every element is computed by the same
    arithmetic.
    """
    sign = np.float32(-1.0 if inverse else 1.0)  # exact in every compute type
    x_in_place = bool(in_place & X_IN_PLACE)
    k_in_place = bool(in_place & K_IN_PLACE)

    # Each kernel picks its row path by the constant ``contiguous``: numba drops the
    # other branch before inlining it, so it costs no compile time.

    @njit(cache=True)
    def serial(x, cos, sin, positions, out, rotary_dim, check_overlap, tile, n_groups):
        if x_in_place:
            out = x  # the same array, so that LLVM sees the same pointers (see above)
        status = _preflight(x, cos, sin, positions, out, check_overlap)
        if status != DONE:
            return status
        n_units = _n_units(x.shape[0], x.shape[2], tile, n_groups)
        if contiguous:
            _contiguous_units(
                x,
                cos,
                sin,
                positions,
                out,
                rotary_dim,
                0,
                n_units,
                tile,
                n_groups,
                interleaved,
                sign,
                words,
                streaming,
            )
        else:
            _strided_units(
                x,
                cos,
                sin,
                positions,
                out,
                rotary_dim,
                0,
                n_units,
                tile,
                n_groups,
                interleaved,
                sign,
            )
        return DONE

    @njit(parallel=True, cache=True)
    def parallel(x, cos, sin, positions, out, rotary_dim, check_overlap, tile, n_groups, n_chunks):
        if x_in_place:
            out = x  # the same array, so that LLVM sees the same pointers (see above)
        status = _preflight(x, cos, sin, positions, out, check_overlap)
        if status != DONE:
            return status
        n_units = _n_units(x.shape[0], x.shape[2], tile, n_groups)
        for chunk in prange(n_chunks):
            first = chunk * n_units // n_chunks
            end = (chunk + 1) * n_units // n_chunks
            if contiguous:
                _contiguous_units(
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
                )
            else:
                _strided_units(
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
                )
        return DONE

    @njit(cache=True)
    def qk_serial(
        q, k, cos, sin, positions, out_q, out_k, rotary_dim, check_overlap, tile, n_groups
    ):
        if x_in_place:
            out_q = q  # the same array (see above)
        if k_in_place:
            out_k = k
        status = _preflight_qk(q, k, cos, sin, positions, out_q, out_k, check_overlap)
        if status != DONE:
            return status
        # Unit by unit, q's heads then k's: k reuses the tile's cos/sin rows.
        for unit in range(_n_units(q.shape[0], q.shape[2], tile, n_groups)):
            if contiguous:
                _contiguous_units(
                    q,
                    cos,
                    sin,
                    positions,
                    out_q,
                    rotary_dim,
                    unit,
                    unit + 1,
                    tile,
                    n_groups,
                    interleaved,
                    sign,
                    words,
                    streaming,
                )
                _contiguous_units(
                    k,
                    cos,
                    sin,
                    positions,
                    out_k,
                    rotary_dim,
                    unit,
                    unit + 1,
                    tile,
                    n_groups,
                    interleaved,
                    sign,
                    words,
                    streaming,
                )
            else:
                _strided_units(
                    q,
                    cos,
                    sin,
                    positions,
                    out_q,
                    rotary_dim,
                    unit,
                    unit + 1,
                    tile,
                    n_groups,
                    interleaved,
                    sign,
                )
                _strided_units(
                    k,
                    cos,
                    sin,
                    positions,
                    out_k,
                    rotary_dim,
                    unit,
                    unit + 1,
                    tile,
                    n_groups,
                    interleaved,
                    sign,
                )
        return DONE

    @njit(parallel=True, cache=True)
    def qk_parallel(
        q, k, cos, sin, positions, out_q, out_k, rotary_dim, check_overlap, tile, n_groups, n_chunks
    ):
        if x_in_place:
            out_q = q  # the same array (see above)
        if k_in_place:
            out_k = k
        status = _preflight_qk(q, k, cos, sin, positions, out_q, out_k, check_overlap)
        if status != DONE:
            return status
        n_units = _n_units(q.shape[0], q.shape[2], tile, n_groups)
        for chunk in prange(n_chunks):
            for unit in range(chunk * n_units // n_chunks, (chunk + 1) * n_units // n_chunks):
                if contiguous:
                    _contiguous_units(
                        q,
                        cos,
                        sin,
                        positions,
                        out_q,
                        rotary_dim,
                        unit,
                        unit + 1,
                        tile,
                        n_groups,
                        interleaved,
                        sign,
                        words,
                        streaming,
                    )
                    _contiguous_units(
                        k,
                        cos,
                        sin,
                        positions,
                        out_k,
                        rotary_dim,
                        unit,
                        unit + 1,
                        tile,
                        n_groups,
                        interleaved,
                        sign,
                        words,
                        streaming,
                    )
                else:
                    _strided_units(
                        q,
                        cos,
                        sin,
                        positions,
                        out_q,
                        rotary_dim,
                        unit,
                        unit + 1,
                        tile,
                        n_groups,
                        interleaved,
                        sign,
                    )
                    _strided_units(
                        k,
                        cos,
                        sin,
                        positions,
                        out_k,
                        rotary_dim,
                        unit,
                        unit + 1,
                        tile,
                        n_groups,
                        interleaved,
                        sign,
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
    if isinstance(positions, types.Integer):  # one offset: 0 (batch entry 0) if bad
        return lambda positions, n_positions, seq_len: (
            0 if seq_len and not 0 <= positions <= n_positions - seq_len else -1
        )
    if positions.ndim == 2:
        return lambda positions, n_positions, seq_len: _first_bad_position(positions, n_positions)
    return lambda positions, n_positions, seq_len: _first_bad_offset(
        positions, n_positions, seq_len
    )


#: Kernel return codes besides the index of a bad position id or offset (>= 0).
DONE = -1
OVERLAP = -2


@njit(cache=True)
def _span(data, shape, strides, itemsize):
    """``[first, end)`` bytes spanned by the array at address ``data`` with this shape,
    these strides and item size (empty for an empty array). Integer arguments only:
    compiled once per number of dimensions, whatever the dtypes of a call."""
    first = data
    end = data
    for axis in range(len(shape)):
        if shape[axis] == 0:
            return 0, 0
        span = (shape[axis] - 1) * strides[axis]
        if span < 0:
            first += span
        else:
            end += span
    return first, end + itemsize


def _positions_span(positions):  # pragma: no cover - see overload
    """:func:`_span` of the position ids or offsets, or an empty range for None."""
    raise NotImplementedError


@overload(_positions_span, inline="always")
def _positions_span_overload(positions):
    if isinstance(positions, (types.NoneType, types.Integer)):
        return lambda positions: (0, 0)
    return lambda positions: _span(
        positions.ctypes.data, positions.shape, positions.strides, positions.itemsize
    )


@njit(cache=True)
def _meet(a, b):
    """Whether byte ranges ``a`` and ``b`` intersect (a cheap, conservative test:
    interleaved views of one buffer, such as q and k of a fused qkv, do too)."""
    return a[0] < b[1] and b[0] < a[1]


@njit(cache=True, inline="always")
def _preflight(x, cos, sin, positions, out, check_overlap):
    """What must stop a launch before anything is written: OVERLAP (``check_overlap``
    and an input shares memory with ``out`` other than as the very same elements,
    which is rotating in place), or the index of the first bad position; else DONE."""
    # The spans are written out here, not in a helper taking arrays, so that a new
    # dtype compiles no helper: _span takes integers only.
    if check_overlap:
        out_span = _span(out.ctypes.data, out.shape, out.strides, out.itemsize)
        in_place = x.ctypes.data == out.ctypes.data and x.strides == out.strides
        if (
            (_meet(_span(x.ctypes.data, x.shape, x.strides, x.itemsize), out_span) and not in_place)
            or _meet(_span(cos.ctypes.data, cos.shape, cos.strides, cos.itemsize), out_span)
            or _meet(_span(sin.ctypes.data, sin.shape, sin.strides, sin.itemsize), out_span)
            or _meet(_positions_span(positions), out_span)
        ):
            return OVERLAP
    bad = _check_positions(positions, cos.shape[0], x.shape[2])
    return DONE if bad < 0 else bad


@njit(cache=True)
def _preflight_qk(q, k, cos, sin, positions, out_q, out_k, check_overlap):
    """:func:`_preflight` for q and k together (cross overlaps included)."""
    if check_overlap:
        q_span = _span(q.ctypes.data, q.shape, q.strides, q.itemsize)
        k_span = _span(k.ctypes.data, k.shape, k.strides, k.itemsize)
        out_q_span = _span(out_q.ctypes.data, out_q.shape, out_q.strides, out_q.itemsize)
        out_k_span = _span(out_k.ctypes.data, out_k.shape, out_k.strides, out_k.itemsize)
        cos_span = _span(cos.ctypes.data, cos.shape, cos.strides, cos.itemsize)
        sin_span = _span(sin.ctypes.data, sin.shape, sin.strides, sin.itemsize)
        positions_span = _positions_span(positions)
        for out_span in (out_q_span, out_k_span):
            if (
                _meet(cos_span, out_span)
                or _meet(sin_span, out_span)
                or _meet(positions_span, out_span)
            ):
                return OVERLAP
        q_in_place = q.ctypes.data == out_q.ctypes.data and q.strides == out_q.strides
        k_in_place = k.ctypes.data == out_k.ctypes.data and k.strides == out_k.strides
        if (
            (_meet(q_span, out_q_span) and not q_in_place)
            or (_meet(k_span, out_k_span) and not k_in_place)
            or _meet(k_span, out_q_span)
            or _meet(q_span, out_k_span)
            or _meet(out_q_span, out_k_span)
        ):
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


#: ``in_place`` flags of the kernels: the output is the input (or q) itself; k's is.
X_IN_PLACE = 1
K_IN_PLACE = 2

#: Kernels by (interleaved, inverse, contiguous, in_place, words, streaming), made on
#: first use.
_kernel_sets: dict[tuple[bool, bool, bool, int, bool, bool], tuple] = {}


def kernels(
    interleaved: bool,
    inverse: bool,
    contiguous: bool,
    in_place: int = 0,
    words: bool = False,
    streaming: bool = False,
) -> tuple:
    """``(serial, parallel, qk_serial, qk_parallel)`` for these options (see
    :func:`_make_kernels`; ``words`` and ``streaming`` only with ``contiguous``)."""
    streaming = streaming and contiguous
    words = words and contiguous
    key = (interleaved, inverse, contiguous, int(in_place), words, streaming)
    found = _kernel_sets.get(key)
    if found is None:
        found = _kernel_sets[key] = _make_kernels(*key)
    return found


def streaming(rotary_dim: int, interleaved: bool, *outs) -> bool:
    """Whether the kernels write these outputs (storage views, BHSD) with non-temporal
    stores: outputs of at least ``config.STREAMING_MIN_BYTES`` together, float32 or
    16-bit elements, and every row starting on :data:`STREAM_ALIGNMENT` bytes, so do
    its channels past ``rotary_dim`` and, for non-interleaved pairs, its second half
    (which the streaming intrinsics need)."""
    if sum(out.nbytes for out in outs) < config.STREAMING_MIN_BYTES:
        return False
    offset = rotary_dim if interleaved else rotary_dim // 2  # of the last aligned part
    for out in outs:
        if out.itemsize > 4 or (offset * out.itemsize) % STREAM_ALIGNMENT:
            return False
        if out.ctypes.data % STREAM_ALIGNMENT:
            return False
        if any(stride % STREAM_ALIGNMENT for stride in out.strides[:-1]):
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


def packed_caches(cos, sin, size: int, nbytes: int) -> tuple:
    """The caches of a call with ``size`` input elements of ``nbytes`` bytes, as
    C-contiguous copies when they are not and the call is large
    (``config.PARALLEL_MIN_ELEMENTS``) and they are small beside it (together at most
    a quarter of the input's bytes, so each row serves several heads).

    A unit of work reuses its tile's cos/sin rows for every head. Caches computed from
    broadcast positions (``np.cos(positions[..., None] * frequencies)`` with positions
    broadcast over the batch) come out with strides ``(half, batch * half, 1)``
    elements: a tile's rows lie a power of two apart, fall into a few cache sets and
    are read again from L3 for every head. Packed, the batch prefill (8, 32, 1024,
    128) with such caches took 7.6 instead of 15.0 ms in float16 and 15.0 instead of
    18.4 ms in float32 (one process; with C-contiguous caches 6.1-7.4 and 12.9-14.5
    ms). Copying the caches costs at most a quarter of a copy of the input, and
    changes no result.
    """
    if size < config.PARALLEL_MIN_ELEMENTS or 4 * (cos.nbytes + sin.nbytes) > nbytes:
        return cos, sin
    return np.ascontiguousarray(cos), np.ascontiguousarray(sin)


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
    in_place: bool = False,
) -> int:
    """Run the CPU kernel on validated NumPy arrays (16-bit formats as integer views,
    BHSD views of any layout). ``in_place``: ``out`` is ``x`` (the same view).

    ``positions`` is None, int32/int64 position ids ``[batch, seq_len]``, or int64
    offsets ``[batch]``. Returns DONE, OVERLAP (``check_overlap`` and an input overlaps
    ``out``) or the index of the first bad position id (flat) or offset (batch entry);
    nothing is written unless it returns DONE.
    """
    cos, sin = packed_caches(cos, sin, x.size, x.nbytes)
    contiguous, words = row_format(x, out, cos, sin)
    stream = streaming(rotary_dim, interleaved, out)
    serial, parallel, _, _ = kernels(interleaved, inverse, contiguous, in_place, words, stream)
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
    in_place: int = 0,
) -> int:
    """As :func:`_launch_cpu`, for q and k in one pass. ``in_place``: ``out_q`` is ``q``
    (:data:`X_IN_PLACE`) and/or ``out_k`` is ``k`` (:data:`K_IN_PLACE`), summed."""
    cos, sin = packed_caches(cos, sin, q.size + k.size, q.nbytes + k.nbytes)
    contiguous, words = row_format(q, k, out_q, out_k, cos, sin)
    stream = streaming(rotary_dim, interleaved, out_q, out_k)
    _, _, serial, parallel = kernels(interleaved, inverse, contiguous, in_place, words, stream)
    batch, _, seq_len, _ = q.shape
    in_parallel = _parallel(q.size + k.size)
    heads = max(q.shape[1], k.shape[1])
    tile, n_groups, n_chunks = work_split(batch, heads, seq_len, in_parallel)
    args = (q, k, cos, sin, positions, out_q, out_k, rotary_dim, check_overlap, tile, n_groups)
    if in_parallel:
        return _run_parallel(parallel, (*args, n_chunks))
    return serial(*args)
