"""The CPU kernels' hand-written LLVM vector steps.

Each function here is a numba ``intrinsic``: its typing picks the code from the
argument types and literal options, and its code generator emits LLVM IR straight into
the kernel that calls it, so nothing here is compiled on its own. They exist where
LLVM's loop vectorizer cannot be asked for what is needed: non-temporal stores
(streaming large outputs past the cache), bfloat16 rows taken two elements per 32-bit
word, rows without the overlap and length tests the vectorizer puts before every row
(short rows: a decode step's), the row views over raw pointers that the loops of
:mod:`numba_rope._cpu.kernels` rotate, and software prefetches (:func:`prefetch_span`,
:func:`prefetch_rows`).

The arithmetic is :func:`numba_rope._rotation.rotate_pair`'s, one rounding per
operation and no contraction: a vector step gives the bits of the element loop.
"""

from __future__ import annotations

import functools

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array

from numba_rope._conversions import (
    BFLOAT16_STORAGE,
    X86,
    bfloat16_high_code,
    bfloat16_low_code,
    bfloat16_pair_vector_code,
    bfloat16_vector_code,
    float16_integer_code,
    has_avx,
    has_avx512,
    has_bfloat16_instructions,
    has_f16c,
    has_float16_arithmetic,
    narrow_code,
    pair_constants,
    widen_code,
)

#: The numba type of bfloat16 storage.
BFLOAT16_TYPE = numba.from_dtype(BFLOAT16_STORAGE)


def _view_code(view_type, pairs):
    """Code of :func:`row` (``pairs`` False) and :func:`pair_rows` (True): a view of
    ``view_type`` over an array's memory from a byte offset, no reference count."""

    def codegen(context, builder, signature, args):
        source = context.make_array(signature.args[0])(context, builder, args[0])
        offset = context.cast(builder, args[1], signature.args[1], types.intp)
        address = builder.add(builder.ptrtoint(source.data, ir.IntType(64)), offset)
        length = context.cast(builder, args[2], signature.args[2], types.intp)
        itemsize = context.get_constant(
            types.intp, context.get_abi_sizeof(source.data.type.pointee)
        )
        shape = [length, context.get_constant(types.intp, 2)] if pairs else [length]
        strides = [builder.add(itemsize, itemsize), itemsize] if pairs else [itemsize]
        view = context.make_array(view_type)(context, builder)
        populate_array(
            view,
            data=builder.inttoptr(address, source.data.type),
            shape=cgutils.pack_array(builder, shape),
            strides=cgutils.pack_array(builder, strides),
            itemsize=itemsize,
            meminfo=None,
        )
        return view._getvalue()

    return codegen


@intrinsic
def row(typingctx, array, byte_offset, length):
    """A C-contiguous 1-D array over ``length`` elements of ``array`` starting at
    ``byte_offset``: no copy and, unlike a slice, no reference count to update. An
    intrinsic (emitted directly, nothing to inline) to keep compile times short."""
    if not isinstance(array, types.Array):
        return None
    row_type = types.Array(array.dtype, 1, "C")
    return row_type(array, byte_offset, length), _view_code(row_type, pairs=False)


#: The types of :func:`float16_values` and :func:`float16_value_pairs`: read-only float32
#: rows, which no other view is.
FLOAT16_VALUES = types.Array(types.float32, 1, "C", readonly=True)
FLOAT16_VALUE_PAIRS = types.Array(types.float32, 2, "C", readonly=True)


def _float16_view_typing(array, byte_offset, length, pairs):
    """Typing and code of :func:`float16_values` (``pairs`` False) and
    :func:`float16_value_pairs`: views over a contiguous float32 array."""
    if array != types.Array(types.float32, array.ndim, "C"):
        return None
    view_type = FLOAT16_VALUE_PAIRS if pairs else FLOAT16_VALUES
    return view_type(array, byte_offset, length), _view_code(view_type, pairs)


@intrinsic
def float16_values(typingctx, array, byte_offset, length):
    """:func:`row` of a float32 array whose elements are widened float16 values, typed
    :data:`FLOAT16_VALUES` to say so: the vector steps then fuse the products of such
    cache rows with float16 rows (:func:`_exact_products`). Read-only, as the rows
    rotated by are."""
    return _float16_view_typing(array, byte_offset, length, pairs=False)


@intrinsic
def float16_value_pairs(typingctx, array, byte_offset, length):
    """:func:`pair_rows` of widened float16 values, typed :data:`FLOAT16_VALUE_PAIRS`
    (see :func:`float16_values`)."""
    return _float16_view_typing(array, byte_offset, length, pairs=True)


def _exact_products(x_row, cos_row) -> bool:
    """Whether the products of elements of ``x_row`` and of cache rows ``cos_row`` (numba
    types) are exact in float32: both hold float16 values (11 significant bits and
    magnitudes of 2**-24 to 65504 each, so a product has 22 bits and lies far inside
    float32's range), as float16 storage or as :data:`FLOAT16_VALUES` or
    :data:`FLOAT16_VALUE_PAIRS`. Then a product plus the other rounds the same exact
    sum once, fused (:meth:`_Stream.rotate`) or not: the same bits."""
    return x_row.dtype == types.uint16 and (
        cos_row.dtype == types.uint16 or cos_row in (FLOAT16_VALUES, FLOAT16_VALUE_PAIRS)
    )


@intrinsic
def pair_rows(typingctx, array, byte_offset, length):
    """A C-contiguous ``(length, 2)`` array over ``2 * length`` elements of ``array``
    starting at ``byte_offset`` (see :func:`row`): a cache row whose values stand
    twice, once for each element of an interleaved pair."""
    if not isinstance(array, types.Array):
        return None
    rows_type = types.Array(array.dtype, 2, "C")
    return rows_type(array, byte_offset, length), _view_code(rows_type, pairs=True)


#: Elements (or 32-bit words) per step of the vector loops, widest first: 16 float32
#: lanes, AVX-512's width and one 64-byte cache line, then at most one step of 8 for
#: what is left. The width is not the host's: LLVM splits each vector into the registers
#: of the target it compiles for (one zmm, two ymm, four xmm or NEON registers), so
#: every x86 target gets its full width from the same code, and the bits do not depend
#: on the split (each lane is computed alone). ``tests/test_targets.py`` checks what
#: haswell, skylake-avx512 and znver4 get.
VECTOR_WIDTHS = (16, 8)
#: Words per step of the non-interleaved bfloat16 word loop (:func:`_word_pairs_typing`,
#: two pairs a word) and of :func:`widen_word_halves`, which lays its cache rows out by
#: the same steps: :data:`VECTOR_WIDTHS` and a step of 4 words (8 pairs), so that rows
#: of 8 pairs more than a multiple of 16 (``rotary_dim`` 16, 48, 80: Pythia's and
#: StableLM's partial rotations) leave none to the element loop, whose bfloat16
#: rounding is scalar: such rows took 2-4x the time of rows of 16 pairs more
#: (docs/performance.md, "Thirty-third session").
WORD_WIDTHS = (*VECTOR_WIDTHS, VECTOR_WIDTHS[-1] // 2)
#: Narrower steps after the word steps where the stores are ordinary ones (and in
#: :func:`widen_word_halves`, which lays the cache rows out by the same steps): 2 words
#: (4 pairs) and 1 (2 pairs), so that a row of an even number of pairs leaves none to
#: the element loop, whose bfloat16 rounding is scalar. Rows of 4 pairs more than a
#: multiple of 8 (``rotary_dim`` 24, 40, 56: GPT-NeoX-20B rotates 24 of 96 channels)
#: took 1.6-2x the time of rows of 16 or 32 pairs; with these steps a decode step of
#: (64, 64, 1, 96) rotating 24 took 0.66-0.67x its time (interleaved 0.58), a (1, 32,
#: 2048, 96) prefill rotating 40 0.73x (one-process A/B, docs/performance.md,
#: "Fortieth session").
#: Streaming rows need none: only rows of a multiple of :data:`STREAM_PAIRS` stream.
WORD_TAIL_WIDTHS = (2, 1)
#: The same, in pairs, after :data:`VECTOR_WIDTHS`: for the interleaved bfloat16 words (a
#: pair a word), for float16 rows, whose element loop converts one element at a time (a
#: decode step of (64, 32, 1, 80) rotating 24, one thread, 0.74-0.81x the time,
#: rotating 20, 8 pairs and 2, 0.87-1.02x), and for interleaved float32 rows (0.73-0.78x
#: and 0.82-0.84x): a row leaves no pair to the element loop. Not float32 halves: with a
#: step of 4 pairs after their steps a decode step rotating 24 took 0.78-0.88x the time
#: on one thread, but one rotating 20 (the step not taken) 1.06-1.11x, and with steps
#: of 2 and 1 too 1.11-1.16x (one-process A/B, docs/performance.md, "Fortieth session").
PAIR_TAIL_WIDTHS = (4, 2, 1)
#: :data:`WORD_WIDTHS` for targets without AVX-512 (16 vector registers): a 16-word step
#: holds 16 ymm registers of inputs alone (the words' low and high elements of both
#: halves, their cos and sin), and LLVM spilled a third of them to the stack in every
#: step; 8-word steps spill none (``tests/test_targets.py`` counts the spills).
NARROW_WORD_WIDTHS = WORD_WIDTHS[1:]
#: Pairs per row (``rotary_dim // 2``) for which :func:`vector_pairs` emits its steps a
#: second time with the row length as a constant: 64 (heads of 128 channels: Llama,
#: Mistral, Qwen and most models since) and 32 (heads of 64, and half of 128 rotated).
#: See :func:`_by_half`.
CONSTANT_HALVES = (64, 32)
#: Non-temporal stores need their output rows on this many bytes (NumPy's allocation
#: guarantees 16); LLVM splits a wider vector's non-temporal store into aligned 16-byte
#: ones.
STREAM_ALIGNMENT = 16

#: Some bfloat16 outputs stream only when their first element starts a 64-byte line
#: (their rows then on :data:`STREAM_ALIGNMENT` bytes, as every output's): rows of
#: non-interleaved pairs whose halves are not whole lines, and on targets without
#: AVX-512 all rows of non-interleaved pairs (:func:`words_fill_lines`); see
#: :func:`numba_rope._cpu.backend.stream_start`. NumPy's large arrays start 16 bytes
#: past a line (``np.empty_like(x)`` for ``out=``), and into such bfloat16 outputs
#: ordinary stores took 0.67-0.82x the time of the word steps made for rows on a line
#: (prefill, prefill_3d, batch prefill, the interleaved partial prefill; one-process
#: A/B, docs/performance.md, "Forty-first session"). Interleaved words start their
#: loops on the line since (:meth:`_Stream.off_line`), and words whose halves are
#: whole lines shift the steps of a row on a line into the output's lines
#: (:meth:`_Stream.shifted_lines`): 0.43-0.84x the time of ordinary stores, but
#: 0.87-1.19x while a 300 MiB last-level cache held the calls' data (one-process A/B,
#: "Forty-fifth session"). float32 and float16 stream from :data:`STREAM_ALIGNMENT`
#: bytes.
STREAM_START_ALIGNMENT = 64

#: Every vector step stores a row's rotated pairs in multiples of this many (element
#: rows and the interleaved bfloat16 words: the narrowest of :data:`VECTOR_WIDTHS`; the
#: non-interleaved words: twice the narrowest of :data:`WORD_WIDTHS`, two pairs a word),
#: and :func:`stream_copy` the channels past ``rotary_dim`` in multiples of
#: :data:`STREAM_COPY_ELEMENTS`: the element loops do the rest, with ordinary stores.
#: Rows streamed only where nothing is left (:func:`numba_rope._cpu.backend.streaming`).
STREAM_PAIRS = max(VECTOR_WIDTHS[-1], 2 * WORD_WIDTHS[-1])
STREAM_COPY_ELEMENTS = VECTOR_WIDTHS[-1]


@functools.cache
def words_fill_lines() -> bool:
    """Whether the widest bfloat16 word step of the target numba compiles for is 16
    words, a 64-byte line of output (AVX-512, :attr:`_Stream.word_widths`): streaming
    rows of non-interleaved words whose halves are whole lines then shift their steps
    into the lines of an output off a line (:meth:`_Stream.shifted_lines`). Not on
    AVX2 targets, whose line of two 8-word steps, held across the loop with its
    neighbour's, spilled vectors to the stack in every step (haswell,
    ``tests/test_targets.py``): there such outputs stream from a line only
    (:func:`numba_rope._cpu.backend.stream_start`)."""
    from numba.core.registry import cpu_target

    return has_avx512(cpu_target.target_context)


#: Storage types the streaming loops take (float32 and the 16-bit formats).
_STREAM_TYPES = (types.float32, types.uint16, types.int16)

_LANE = ir.IntType(32)


class _Stream:
    """LLVM code shared by the vector intrinsics (streaming and bfloat16 words): vectors
    of ``lanes`` elements or words loaded from rows, and stores into them,
    non-temporal ones for streaming, in loops of :data:`VECTOR_WIDTHS`."""

    def __init__(self, context, builder):
        self.context = context
        self.builder = builder
        self.intp = context.get_value_type(types.intp)
        self.nontemporal = builder.module.add_metadata([ir.Constant(_LANE, 1)])
        self.float16_arithmetic = has_float16_arithmetic(context)
        self.avx512 = has_avx512(context)
        self.bfloat16_instructions = has_bfloat16_instructions(context)
        self.float16_in_register = has_f16c(context) and not self.float16_arithmetic
        #: The widest vector register: AVX-512's, AVX's, SSE's.
        self.register_bits = 512 if self.avx512 else 256 if has_avx(context) else 128
        self.pair_constants = {}
        #: The steps of the bfloat16 word loops and of their widened cache rows.
        self.word_widths = WORD_WIDTHS if self.avx512 else NARROW_WORD_WIDTHS

    def pointer(self, array, index, lanes, element=None):
        element = array.data.type.pointee if element is None else element
        pointer = self.builder.gep(array.data, [index])
        return self.builder.bitcast(pointer, ir.VectorType(element, lanes).as_pointer())

    def load(self, array, index, numba_type, lanes):
        loaded = self.builder.load(
            self.pointer(array, index, lanes), align=numba_type.bitwidth // 8
        )
        return widen_code(self.context, self.builder, numba_type, loaded)

    def nontemporal_store(self, value, pointer, align=STREAM_ALIGNMENT):
        """A non-temporal store, on ``align`` bytes (which the caller guarantees;
        LLVM splits a wider store into stores of that alignment)."""
        stored = self.builder.store(value, pointer)
        stored.align = align
        stored.set_metadata("nontemporal", self.nontemporal)

    def store(self, value, array, index, numba_type, lanes, nontemporal=True):
        """``value`` narrowed to ``numba_type``, stored at ``index``: non-temporally
        (:meth:`nontemporal_store`), or an ordinary store."""
        narrowed = self.narrow(value, numba_type, nontemporal)
        self.put(narrowed, array, index, lanes, numba_type, nontemporal)

    def narrow(self, value, numba_type, nontemporal):
        """:func:`narrow_code` of a vector for a store; for a non-temporal one of float16 on
        AVX512-FP16 targets, :func:`float16_integer_code` (the same bits), without which
        LLVM made the stores ordinary ones: a float16 partial rotation (rows part
        cached, part streamed) ran 16x slower on an Intel VM (docs/performance.md,
        "Thirteenth session").

        float16 for an ordinary store on targets with F16C but not AVX512-FP16 passes
        through an empty inline assembly statement, which keeps the converted vector
        in a register (a vector of fewer than 8 lanes, too narrow for the statement,
        is converted as 8, its last lane repeated, and its lanes taken after it): LLVM
        otherwise folds the store into the conversion (``vcvtps2ph`` to memory), also
        where :meth:`store_joined` joined two of them, and on Zen 3 that form took 2.0
        cycles per 8 lanes against 1.0 into a register and a store of its own
        (``/tmp/s23/cvt.c``, not kept). A float16 decode step 0.80-0.83x the time on
        one thread, 0.82-0.85x on two (one-process A/B, docs/performance.md,
        "Twenty-third session"). On Intel's cores, by the
        published instruction tables, the memory form is the register form and a
        store (not measured). The same bits.

        bfloat16 elements (rows with float32 caches) are narrowed by
        :func:`~numba_rope._conversions.bfloat16_vector_code`: AVX512_BF16's conversion
        where the target has it (a bfloat16 decode step with float32 caches 0.75x the
        time, "Thirty-third session")."""
        if nontemporal and numba_type == types.uint16 and self.float16_arithmetic:
            return float16_integer_code(self.builder, value)
        if numba_type == types.uint16 and not nontemporal and self.float16_in_register:
            lanes = value.type.count
            if lanes >= 8:
                return self.in_registers(narrow_code(self.context, self.builder, numba_type, value))
            wide = self.shuffle(value, value, [min(lane, lanes - 1) for lane in range(8)])
            narrowed = self.in_registers(narrow_code(self.context, self.builder, numba_type, wide))
            return self.shuffle(narrowed, narrowed, list(range(lanes)))
        if numba_type == types.int16:  # bfloat16 elements
            narrowed = bfloat16_vector_code(self.builder, value, self.bfloat16_instructions)
        else:
            narrowed = narrow_code(self.context, self.builder, numba_type, value)
        if nontemporal and numba_type == types.int16:
            # bfloat16 elements (rows with float32 caches; the words have their own
            # code): on AVX-512 LLVM folds the final truncation into a truncating store
            # (vpmovdw to memory), an ordinary store, in the 16-byte steps at a row's
            # edges off a 64-byte line. Ordinary and non-temporal stores into the same
            # lines took a bfloat16 prefill (1, 32, 4096, 128) with float32 caches, its
            # output 16 bytes past a line, 83 ms against 5 on a line, one thread
            # (docs/performance.md, "Thirty-third session"). Kept in registers, the
            # same bits.
            return self.in_registers(narrowed)
        return narrowed

    def in_registers(self, vector):
        """``vector`` passed through an empty inline assembly statement, a register's
        worth at a time (:attr:`register_bits`: a wider operand cannot be allocated,
        and LLVM ends the process, "couldn't allocate output register for constraint
        'v'"), so that LLVM keeps it in registers there.
        Vectors narrower than 128 bits, or of lanes not a power of two, are returned
        as they are (the vector steps make none); so is every vector on other
        machines than x86, whose folds into memory the statement is for (its ``v``
        constraint names no register of 64-bit Arm: LLVM ended the process there)."""
        lanes, width = vector.type.count, vector.type.element.width
        piece = self.register_bits // width
        if not X86 or lanes * width < 128 or lanes & (lanes - 1):
            return vector
        if lanes <= piece:
            barrier = ir.InlineAsm(ir.FunctionType(vector.type, [vector.type]), "", "=v,0")
            return self.builder.call(barrier, [vector])
        pieces = [
            self.in_registers(self.shuffle(vector, vector, list(range(first, first + piece))))
            for first in range(0, lanes, piece)
        ]
        while len(pieces) > 1:
            pieces = [
                self.shuffle(a, b, list(range(2 * a.type.count)))
                for a, b in zip(pieces[::2], pieces[1::2], strict=True)
            ]
        return pieces[0]

    def narrow_joined(self, first, second, lanes, numba_type, nontemporal):
        """Two vectors narrowed to ``numba_type`` each (:meth:`narrow`), joined by the
        shuffle ``lanes``."""
        return self.shuffle(
            self.narrow(first, numba_type, nontemporal),
            self.narrow(second, numba_type, nontemporal),
            lanes,
        )

    def store_joined(self, first, second, lanes, array, index, numba_type, nontemporal):
        """Two vectors narrowed to ``numba_type`` each, joined by the shuffle ``lanes``
        and stored as one at ``index`` (see :meth:`store`). For float16, whose
        conversion into memory (``vcvtps2ph`` to a memory operand) ran 2.6 cycles per 16
        lanes on the Zen 4 VM, and into a register joined to its neighbour and stored
        2.0 (``/tmp/s10/cvt.py``, not kept; eight lanes into memory: 4.1). The join
        alone did not keep the conversions in registers: on AVX2 targets LLVM split
        the joined store and folded each half back into a conversion to memory, which
        :meth:`narrow`'s statement now prevents."""
        joined = self.narrow_joined(first, second, lanes, numba_type, nontemporal)
        self.put(joined, array, index, len(lanes), numba_type, nontemporal)

    def put(self, vector, array, index, lanes, numba_type, nontemporal):
        """``vector`` (``lanes`` elements of ``numba_type``) stored at ``index``:
        non-temporally (:meth:`nontemporal_store`), or an ordinary store."""
        pointer = self.pointer(array, index, lanes)
        if nontemporal:
            self.nontemporal_store(vector, pointer)
        else:
            self.builder.store(vector, pointer).align = numba_type.bitwidth // 8

    def load_words(self, array, index, lanes):
        """``lanes`` 32-bit words of 16-bit storage from element ``index``."""
        return self.builder.load(self.pointer(array, index, lanes, _LANE), align=2)

    def store_words(self, words, array, index, lanes, nontemporal):
        """An ordinary store, or a non-temporal one (:meth:`nontemporal_store`)."""
        pointer = self.pointer(array, index, lanes, _LANE)
        if nontemporal:
            self.nontemporal_store(words, pointer)
        else:
            self.builder.store(words, pointer).align = 2

    def pair_words(self, low, high, instructions):
        """:func:`bfloat16_pair_vector_code` of two vectors, with the constants this
        target rounds and merges best with (:func:`pair_constants`), made once per
        width and function; LLVM's for vectors narrower than an xmm register (the
        steps of 2 and 1 words: see :meth:`in_registers`)."""
        lanes = low.type.count
        if lanes not in self.pair_constants:
            opaque = self.avx512 and lanes >= 4
            self.pair_constants[lanes] = pair_constants(self.builder, lanes, opaque)
        return bfloat16_pair_vector_code(
            self.builder, low, high, instructions, self.pair_constants[lanes]
        )

    def splat(self, value, lanes):
        vector = ir.Constant(ir.VectorType(value.type, lanes), ir.Undefined)
        for lane in range(lanes):
            vector = self.builder.insert_element(vector, value, ir.Constant(_LANE, lane))
        return vector

    def shuffle(self, first, second, lanes):
        mask = ir.Constant(ir.VectorType(_LANE, len(lanes)), lanes)
        return self.builder.shuffle_vector(first, second, mask)

    def steps(self, start, length, body, scale=1, widths=VECTOR_WIDTHS):
        """Loops over ``[start, start + n)``, ``n`` = ``length`` rounded down to a
        multiple of ``scale * widths[-1]``: ``body(index, lanes)`` for each step of
        ``scale * lanes`` units, ``lanes`` from ``widths`` widest first (the narrower
        loops run at most once). Returns ``start + n``.

        Loops, not tests, for the narrower steps: with each narrower step behind a test
        of the units left, float32 rows of 10 and 12 pairs (8 and the element loop) took
        1.10-1.13x the time on one thread, and LLVM vectorized the element loop after
        the steps, no longer knowing how few pairs it has (one-process A/B,
        docs/performance.md, "Fortieth session")."""
        builder = self.builder
        done = start
        for lanes in widths:
            step = scale * lanes
            stop = builder.add(start, builder.and_(length, ir.Constant(self.intp, -step)))
            with cgutils.for_range_slice(
                builder, done, stop, ir.Constant(self.intp, step), self.intp
            ) as (index, _):
                body(index, lanes)
            done = stop
        return done

    def double_steps(self, start, length, body):
        """A loop over ``[start, start + n)``, ``n`` = ``length`` rounded down to a
        multiple of twice the widest of :data:`VECTOR_WIDTHS`: ``body(index, lanes)`` for
        two steps of ``lanes`` units at once. Returns ``start + n``, where :meth:`steps`
        takes over."""
        lanes = VECTOR_WIDTHS[0]
        step = ir.Constant(self.intp, 2 * lanes)
        stop = self.builder.add(
            start, self.builder.and_(length, ir.Constant(self.intp, -2 * lanes))
        )
        with cgutils.for_range_slice(self.builder, start, stop, step, self.intp) as (index, _):
            body(index, lanes)
        return stop

    def bytes_before_line(self, data):
        """The bytes from the pointer ``data`` to the next 64-byte line (0 on one)."""
        address = self.builder.ptrtoint(data, self.intp)
        return self.builder.and_(self.builder.neg(address), ir.Constant(self.intp, 63))

    def off_line_by_sixteens(self, lead_bytes):
        """Whether ``lead_bytes`` (:meth:`bytes_before_line`) is 16, 32 or 48: an output
        off a line that its steps of 16 bytes or more can reach it from."""
        builder = self.builder
        zero = ir.Constant(self.intp, 0)
        return builder.and_(
            builder.icmp_unsigned("!=", lead_bytes, zero),
            builder.icmp_unsigned("==", builder.and_(lead_bytes, ir.Constant(self.intp, 15)), zero),
        )

    def off_line(self, data, half, pair_bytes, steps, step, halves=None):
        """``steps(start, length)`` (the vector loops over ``length`` pairs from ``start``,
        returning where they stop) over a row of ``half`` pairs whose output (from the
        pointer ``data``) starts off a 64-byte line by a multiple of 16 bytes: from the
        first pair on a line, with narrower steps (``step(pair, lanes)``, 16 or 32 bytes of
        output each) over the pairs before it and over those the loops leave, none of whose
        stores spans two lines. Returns the pairs done: ``half`` rounded down to 16 bytes of
        output; or, for an output on a line (or off it by other than 16 bytes, or rows
        shorter than a line or a step), ``steps(0, half)``.

        A row whose output starts off a line has each of its 64-byte stores span two
        lines; NumPy's large arrays start 16 bytes past one. Float32 rows with
        ordinary stores (a decode step): 0.60-0.83x the time with the loops started on
        the line and one 64-byte step over each edge (docs/performance.md,
        "Eighteenth session"); these narrower edge steps, which no store of a step
        spans, 0.86-1.05x that again. Streaming rows (non-temporal stores, large
        calls), float32 and float16, whose stores LLVM splits into aligned 16 bytes
        but which still took 1.3-1.5x the time off a line: 0.75-0.92x (float32
        prefill, batch prefill, prefill_3d) and 0.80-0.96x (float16), one process,
        old and new code on the same outputs ("Nineteenth session"). Every step
        reads its pairs before it stores them and no two steps share a pair: in
        place too, but with ``halves`` (below). Streaming interleaved bfloat16 words
        too (:func:`_word_interleaved_pairs_typing`: the partial prefill (4, 16,
        2048, 128) into an output 16 or 48 bytes past a line 0.48-0.67x the time of
        its ordinary stores, "Forty-fifth session"), but not the words with ordinary
        stores (:func:`_word_pairs_typing`: 1.2-1.5x in a decode step, which also
        loses the constant row lengths of :func:`_by_half`) nor float16 rows with
        ordinary stores (bound by F16C's conversions: 1.0-1.1x).

        ``halves``: for streaming rows of non-interleaved pairs, two steps that store
        only the pairs' first elements and only their second ones. The line where the
        first half of the row ends is also where its second half starts, and the
        line where the second half ends is where the next row (or the channels past
        ``rotary_dim``) starts. The pairs after the last whole line of the first half
        are then rotated twice: before the loops, their first elements stored, so that
        the first line's two parts are written one right after the other; after the
        loops, their second elements, just before the next row's first part. A line
        whose non-temporal parts are stored apart from each other is written to memory
        part by part: a float32 prefill (1, 32, 4096, 128) into an output 16 bytes past
        a line took 3.1-3.2 ms against 2.1 on a line, 2.2-2.3 with the halves apart,
        float16 1.5-1.7 against 1.4 (one process, docs/performance.md, "Forty-fourth
        session"). The second step reads its pairs again: an output that is not its
        input, as streaming ones are (see :func:`numba_rope._cpu.backend.streaming`).
        """
        builder = self.builder
        zero = ir.Constant(self.intp, 0)
        lead_bytes = self.bytes_before_line(data)
        # A line's pairs at least (the pairs before the first line fit in the row).
        shortest = max(VECTOR_WIDTHS[0], 64 // pair_bytes)
        off = builder.and_(
            self.off_line_by_sixteens(lead_bytes),
            builder.icmp_unsigned(">=", half, ir.Constant(self.intp, shortest)),
        )
        # Steps of 32 and 16 bytes of output: within a line from an offset of 16.
        narrow = tuple(lanes for lanes in (16, 8, 4, 2) if 16 <= lanes * pair_bytes <= 32)
        with builder.if_else(off, likely=False) as (off_line, on_line):
            with off_line:
                lead = builder.udiv(lead_bytes, ir.Constant(self.intp, pair_bytes))
                self.steps(zero, lead, step, widths=narrow)
                if halves is not None:
                    line = ir.Constant(self.intp, -(64 // pair_bytes))
                    lines_end = builder.add(lead, builder.and_(builder.sub(half, lead), line))
                    rest = builder.sub(half, lines_end)
                    self.steps(lines_end, rest, halves[0], widths=narrow)
                    steps(lead, builder.sub(lines_end, lead))
                    edges = self.steps(lines_end, rest, halves[1], widths=narrow)
                else:
                    loops = steps(lead, builder.sub(half, lead))
                    edges = self.steps(loops, builder.sub(half, loops), step, widths=narrow)
                off_block = builder.block
            with on_line:
                done = steps(zero, half)
                on_block = builder.block
        pairs = builder.phi(self.intp)
        pairs.add_incoming(edges, off_block)
        pairs.add_incoming(done, on_block)
        return pairs

    def shifted_lines(self, data, half, pair_bytes, line, otherwise):
        """The vector steps of a streaming row of ``half`` non-interleaved pairs whose
        output (from the pointer ``data``) starts off a 64-byte line by 16, 32 or 48 bytes
        and whose halves are whole lines (``half`` a multiple of a line's pairs):
        ``line(j)`` rotates the ``j``-th line's worth of pairs of the row as it lies in the
        input (as on a line) and returns its two halves' output, 64 bytes each (``<16 x
        i32>``); each is shifted into the output's lines by one shuffle with its neighbour
        (``valignq`` on AVX-512), and every line the row covers alone is written by one
        store: the first half's last line with the second half's first, held from the row's
        first step. Only the lines shared with the rows before and after take two stores,
        one at the start of the row and one at its end, next to the neighbour's. Returns
        ``half``; other rows take ``otherwise()`` (returning the pairs done),
        :meth:`off_line`.

        The pairs then take the same steps as on a line: float16 rows with steps of 16
        and 32 bytes over the edges (:meth:`off_line`) took 1.3-1.4x the time of a row
        on a line, bound by the conversions of their narrower steps; so 1.07-1.27x
        (large calls, one process, docs/performance.md, "Forty-fourth session"), the
        shuffles taking the port that those conversions bound. float32 1.02-1.10x.
        bfloat16 words (:func:`_word_pairs_typing`, 16-word steps on AVX-512: see
        :func:`words_fill_lines`), which took ordinary stores off a line before,
        0.43-0.84x the time of those (large calls, "Forty-fifth session"). The same
        arithmetic per pair: the same bits."""
        builder = self.builder
        intp = self.intp
        zero = ir.Constant(intp, 0)
        line_pairs = 64 // pair_bytes
        lead_bytes = self.bytes_before_line(data)
        whole_lines = builder.icmp_unsigned(
            "==", builder.and_(half, ir.Constant(intp, line_pairs - 1)), zero
        )
        taken = builder.and_(
            builder.and_(whole_lines, builder.icmp_unsigned("!=", half, zero)),
            self.off_line_by_sixteens(lead_bytes),
        )
        done = []
        with builder.if_else(taken, likely=False) as (shifted, other):
            with shifted:
                switch_end = builder.append_basic_block("shifted.end")
                default = builder.append_basic_block("shifted.default")
                switch = builder.switch(lead_bytes, default)
                for lead in (16, 32, 48):
                    block = builder.append_basic_block(f"shifted.{lead}")
                    switch.add_case(ir.Constant(intp, lead), block)
                    builder.position_at_end(block)
                    self._shifted_row(data, half, line_pairs, line, lead)
                    builder.branch(switch_end)
                builder.position_at_end(default)
                builder.unreachable()
                builder.position_at_end(switch_end)
                done.append((half, builder.block))
            with other:
                done.append((otherwise(), builder.block))
        pairs = builder.phi(intp)
        for value, block in done:
            pairs.add_incoming(value, block)
        return pairs

    def _shifted_row(self, data, half, line_pairs, line, lead):
        """:meth:`shifted_lines` for an output ``lead`` bytes before its first line."""
        builder = self.builder
        intp = self.intp
        words = ir.VectorType(_LANE, 16)
        k = lead // 4  # words of the first step in the row's first (shared) line
        shift = list(range(k, k + 16))
        base = builder.bitcast(data, ir.IntType(8).as_pointer())
        half_bytes = builder.mul(half, ir.Constant(intp, 64 // line_pairs))

        def store(vector, byte_offset, align=STREAM_ALIGNMENT):
            pointer = builder.gep(base, [byte_offset])
            pointer = builder.bitcast(pointer, vector.type.as_pointer())
            self.nontemporal_store(vector, pointer, align)

        def pieces(vector, first, last, byte_offset):
            # words [first, last) of a vector, stored 4 words (16 bytes) at a time, each
            # taken out in registers: LLVM otherwise made the extraction and a wider
            # store ordinary stores (vextracti128 to memory on skylake-avx512,
            # tests/test_targets.py)
            for word in range(first, last, 4):
                piece = self.shuffle(vector, vector, list(range(word, word + 4)))
                offset = builder.add(byte_offset, ir.Constant(intp, 4 * (word - first)))
                store(self.in_registers(piece), offset)

        def line_at(j):  # byte offset of the first half's j-th whole line
            return builder.add(ir.Constant(intp, lead), builder.mul(j, ir.Constant(intp, 64)))

        lines = builder.udiv(half, ir.Constant(intp, line_pairs))
        # The first step's index through an empty statement: LLVM otherwise hoisted that
        # step above the branch, where the other path's first step is the same
        # arithmetic, and on skylake-avx512 split that path's float16 stores of it into
        # ordinary ones (tests/test_targets.py).
        opaque = ir.InlineAsm(ir.FunctionType(intp, [intp]), "", "=r,0")
        first_v, first_w = line(builder.call(opaque, [ir.Constant(intp, 0)]))
        pieces(first_v, 0, k, ir.Constant(intp, 0))
        held_v = cgutils.alloca_once(builder, words)
        held_w = cgutils.alloca_once(builder, words)
        builder.store(first_v, held_v)
        builder.store(first_w, held_w)
        one = ir.Constant(intp, 1)
        with cgutils.for_range_slice(builder, one, lines, one, intp) as (j, _):
            v, w = line(j)
            before = builder.sub(j, one)
            store(self.shuffle(builder.load(held_v), v, shift), line_at(before), 64)
            store(
                self.shuffle(builder.load(held_w), w, shift),
                builder.add(half_bytes, line_at(before)),
                64,
            )
            builder.store(v, held_v)
            builder.store(w, held_w)
        last = builder.sub(lines, one)
        store(self.shuffle(builder.load(held_v), first_w, shift), line_at(last), 64)
        pieces(builder.load(held_w), k, 16, builder.add(half_bytes, line_at(last)))

    def rotate_in_pairs(self, pairs, cos, sin, sign, exact_products=False):
        """``rotate_pair`` on a vector of interleaved pairs as they lie, ``cos``
        holding each pair's value twice and ``sin`` its value negated then as it is
        (:func:`widen_pairs` with ``negated``): ``pairs * cos`` plus ``swapped * sin``,
        ``swapped`` the pairs with their elements exchanged. Lane ``2i``: ``x1*cos +
        x2*(-sin)``, which is ``x1*cos - x2*sin`` (IEEE 754 defines ``a - b`` as ``a +
        (-b)``, and a product's sign is its factors'), lane ``2i + 1``: ``x2*cos +
        x1*sin``: the operations and operands of :meth:`rotate`, so its bits, in two
        products and one sum per vector (a difference, a sum and a merge had stood
        there: ``vaddsubps`` on AVX2; on AVX-512, which has no 512-bit ``vaddsubps``,
        a subtraction, an addition and a blend). With
        ``exact_products`` (see :meth:`rotate`) the product of the pairs is fused with
        the sum: an interleaved float16 decode step (64, 32, 1, 128) 0.90-0.96x the
        time of the difference, sum and blend, a bshd (4, 256, 8, 128) 0.92-0.94x;
        float32 0.99-1.01x; 16-bit elements with float32 caches (not fused) 0.90-0.96x
        (the Emerald Rapids VM, one-process A/B; docs/performance.md, "Forty-third
        session")."""
        builder = self.builder
        lanes = pairs.type.count
        sin = builder.fmul(sin, self.splat(sign, lanes))
        swapped = self.shuffle(pairs, pairs, [lane ^ 1 for lane in range(lanes)])
        crossed = builder.fmul(swapped, sin)
        if exact_products:
            return builder.call(self.fused(pairs.type), [pairs, cos, crossed])
        return builder.fadd(builder.fmul(pairs, cos), crossed)

    def fused(self, vector_type):
        """``llvm.fmuladd`` of float32 vectors of ``vector_type``: ``a * b + c``, fused
        into one FMA where the target has it (for exact products only: :meth:`rotate`)."""
        return self.builder.module.declare_intrinsic(
            f"llvm.fmuladd.v{vector_type.count}f32",
            fnty=ir.FunctionType(vector_type, [vector_type] * 3),
        )

    def rotate(self, x1, x2, cos, sin, sign, exact_products=False):
        """``rotate_pair`` on vectors: one rounding per operation, no contraction.

        With ``exact_products`` (:func:`_exact_products`: float16 elements and
        caches) each output is one product plus the other by ``llvm.fmuladd``, which
        targets with FMA fuse into one instruction, others not: the products are exact,
        so both round the same exact sum once, to the same bits, and the fused step
        takes one operation fewer per output (a float16 decode step (64, 32, 1, 128)
        0.92-0.94x the time, the seed 0.94-0.96x, on the Emerald Rapids VM,
        one-process A/B; docs/performance.md, "Forty-third session")."""
        builder = self.builder
        sin = builder.fmul(sin, self.splat(sign, x1.type.count))
        if exact_products:
            fused = self.fused(x1.type)
            return (
                builder.call(fused, [x1, cos, builder.fneg(builder.fmul(x2, sin))]),
                builder.call(fused, [x2, cos, builder.fmul(x1, sin)]),
            )
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
    """Rows of bfloat16; cache rows of bfloat16 too, or of float32 widened by
    :func:`widen_span` (interleaved) or :func:`widen_word_halves` (non-interleaved)."""
    rows = (x_row, cos_row, sin_row, out_row)
    return (
        all(isinstance(row, types.Array) for row in rows)
        and x_row.dtype == out_row.dtype == BFLOAT16_TYPE
        and cos_row.dtype == sin_row.dtype
        and cos_row.dtype in (BFLOAT16_TYPE, types.float32)
    )


def _stream_arguments(context, builder, signature, args):
    rows = [
        context.make_array(kind)(context, builder, value)
        for kind, value in zip(signature.args[:4], args[:4], strict=True)
    ]
    half = context.cast(builder, args[4], signature.args[4], types.intp)
    sign = context.cast(builder, args[5], signature.args[5], types.float32)
    return rows, signature.args[0].dtype, signature.args[1].dtype, half, sign


def _stream_pairs(nontemporal, x_row, cos_row, sin_row, out_row, half, sign):
    """Typing of a :func:`vector_pairs` step: rotate the first ``n`` pairs of a row of
    ``half`` non-interleaved pairs, ``n`` = ``half`` rounded down to a multiple of
    8 (to 16 bytes of output for float32 rows, and streaming ones, whose output starts
    off a 64-byte line: :meth:`_Stream.off_line`, or streaming rows whose halves are
    whole lines, :meth:`_Stream.shifted_lines`; ``half`` itself for float16 rows with
    ordinary stores), and return ``n``; steps of :data:`VECTOR_WIDTHS` pairs, then
    for float16 rows with ordinary stores :data:`PAIR_TAIL_WIDTHS`. float16 rows go two
    of the widest steps at a time first, each half of the row narrowed for both steps
    and stored as one vector (:meth:`_Stream.store_joined`): F16C's conversion bounds
    these loops, and into a register it is cheaper than into memory (with the vector
    widening of :func:`widen_span`, a float16 decode step 0.86-0.90x the time shared
    with the helper thread and 0.975x the kernel alone, one-process A/B; see
    docs/performance.md, "Tenth session"). Not with ordinary stores on AVX-512 targets
    without AVX512-FP16 (Zen 4, Intel before Sapphire Rapids), where :meth:`_Stream.narrow`
    keeps each conversion in a register and each step stores its own 32 bytes: without
    the shuffle that joined two, float16 rows on one thread took 0.957-0.978x the time
    on the Zen 4 VM (the seed, a bshd (4, 256, 8, 128), (1, 32, 256, 128); a decode
    step 0.955-1.022x; one-process A/B, docs/performance.md, "Forty-seventh
    session"). AVX2 code, run there, took 0.99-1.05x the time without it and keeps it.

    With ordinary stores (``nontemporal`` False) it is what LLVM's loop vectorizer
    makes of the element loop, without the tests it adds to every row (do the rows
    overlap, are there enough pairs) and its scalar remainder: a decode step's rows
    are 64 pairs, and those tests cost about as much as the pairs. The kernels never
    give it an output that partly overlaps an input (see
    :func:`numba_rope._cpu.kernels.make_runner`); in place, each step reads its pairs
    before it writes them.

    Written in LLVM vectors so that the stores can be non-temporal: the output goes to
    memory without first being read into the cache (a third of the memory traffic of
    a large RoPE), which LLVM's loop vectorizer does not do for stores of unknown
    alignment. With those stores the caller guarantees that the output row and its second half start
    on :data:`STREAM_ALIGNMENT` bytes (see :func:`numba_rope._cpu.backend.streaming`); loads need no
    alignment. The arithmetic is :func:`numba_rope._rotation.rotate_pair`'s, one
    rounding per operation, no contraction: the bits of the element loop.
    """
    if not _stream_typing(x_row, cos_row, sin_row, out_row):
        return None

    def codegen(context, builder, signature, args, off_line=False):
        (x, cos, sin, out), x_type, cache_type, half, sign = _stream_arguments(
            context, builder, signature, args
        )
        stream = _Stream(context, builder)
        tails = not nontemporal and x_type == types.uint16  # float16 (see its widths)
        widths = VECTOR_WIDTHS + PAIR_TAIL_WIDTHS if tails else VECTOR_WIDTHS
        # float16 steps with ordinary stores each stored as it is (see above)
        separate = not nontemporal and stream.float16_in_register and stream.avx512

        def rotated(first, lanes):
            second = builder.add(first, half)
            return second, stream.rotate(
                stream.load(x, first, x_type, lanes),
                stream.load(x, second, x_type, lanes),
                stream.load(cos, first, cache_type, lanes),
                stream.load(sin, first, cache_type, lanes),
                sign,
                exact_products=_exact_products(*signature.args[:2]),
            )

        def put(first, values, lanes):
            second, (y1, y2) = values
            stream.store(y1, out, first, x_type, lanes, nontemporal)
            stream.store(y2, out, second, x_type, lanes, nontemporal)

        def step(first, lanes):
            put(first, rotated(first, lanes), lanes)

        def two_steps(first, lanes):
            # float16: both steps' halves narrowed, joined and stored as one vector,
            # so that F16C's conversion writes a register, not memory (see above).
            second, (y1, y2) = rotated(first, lanes)
            _, (z1, z2) = rotated(builder.add(first, ir.Constant(stream.intp, lanes)), lanes)
            joined = list(range(2 * lanes))
            stream.store_joined(y1, z1, joined, out, first, x_type, nontemporal)
            stream.store_joined(y2, z2, joined, out, second, x_type, nontemporal)

        def line(j):
            # the pairs of the j-th line's worth of the row (a 64-byte step of its
            # output): both halves' output as <16 x i32> (see shifted_lines); 16-bit
            # elements as two_steps narrows and joins them
            pairs = 64 // (x_type.bitwidth // 8)
            first = builder.mul(j, ir.Constant(stream.intp, pairs))
            if x_type.bitwidth == 32:
                _, outputs = rotated(first, pairs)
            else:
                _, (y1, y2) = rotated(first, 16)
                _, (z1, z2) = rotated(builder.add(first, ir.Constant(stream.intp, 16)), 16)
                outputs = [
                    stream.narrow_joined(a, b, list(range(32)), x_type, nontemporal)
                    for a, b in ((y1, z1), (y2, z2))
                ]
            return [builder.bitcast(o, ir.VectorType(_LANE, 16)) for o in outputs]

        def steps(start, length):
            if x_type == types.uint16 and not separate:
                end = builder.add(start, length)
                start = stream.double_steps(start, length, two_steps)
                length = builder.sub(end, start)
            return stream.steps(start, length, step, widths=widths)

        def first_half_step(first, lanes):
            _, (y1, _) = rotated(first, lanes)
            stream.store(y1, out, first, x_type, lanes, nontemporal)

        def second_half_step(first, lanes):
            second, (_, y2) = rotated(first, lanes)
            stream.store(y2, out, second, x_type, lanes, nontemporal)

        if off_line:
            pair_bytes = x_type.bitwidth // 8
            halves = (first_half_step, second_half_step) if nontemporal else None

            def otherwise():
                return stream.off_line(out.data, half, pair_bytes, steps, step, halves)

            if not nontemporal:
                return otherwise()
            return stream.shifted_lines(out.data, half, pair_bytes, line, otherwise)
        return steps(ir.Constant(stream.intp, 0), half)

    return types.intp(x_row, cos_row, sin_row, out_row, half, sign), codegen


def _firsts(pairs):
    """Lanes of a vector of ``pairs`` interleaved pairs that hold their first elements."""
    return list(range(0, 2 * pairs, 2))


def _seconds(pairs):
    return list(range(1, 2 * pairs, 2))


def _interleaved(pairs):
    """Lanes of firsts then seconds (two vectors of ``pairs``) merged back into pairs."""
    return [lane for pair in range(pairs) for lane in (pair, pair + pairs)]


def _stream_interleaved_pairs(nontemporal, x_row, cos_row, sin_row, out_row, half, sign):
    """:func:`_stream_pairs` for interleaved pairs (with non-temporal stores the output
    row must start on :data:`STREAM_ALIGNMENT` bytes; ordinary stores take any element
    offset; float32 and streaming rows off a 64-byte line as in
    :meth:`_Stream.off_line`): the pairs of a step are loaded as one vector, split into
    firsts and seconds, and merged back after the rotation. With ordinary stores, of
    float32 as of float16, :data:`PAIR_TAIL_WIDTHS` after the widest steps: every
    pair of the row.

    Steps of the widest width go two at a time, both loaded before either is stored.
    One step after another (load a vector of pairs, store it, load the next), a row
    rotated in place whose pairs fill whole cache lines, followed by channels past
    ``rotary_dim`` (which in place are not written), ran 2.7x slower on the Zen 4 VM:
    the partial workload (4, 16, 2048, 128), float16, 64 of 128 channels, in place,
    rows on 64-byte boundaries (as torch's tensors are, and NumPy's arrays may be) took
    4.5-4.8 ms, and 1.3-1.9 ms with rows 16 bytes off them. Loaded two at a time, 1.1
    ms (one process, ``/tmp/s8/align2.py``, not kept)."""
    if not _stream_typing(x_row, cos_row, sin_row, out_row):
        return None
    duplicated = cos_row.ndim == 2  # (half, 2) rows, each value twice (see below)

    def codegen(context, builder, signature, args, off_line=False):
        (x, cos, sin, out), x_type, cache_type, half, sign = _stream_arguments(
            context, builder, signature, args
        )
        stream = _Stream(context, builder)
        tails = not nontemporal  # float16 and float32 (see PAIR_TAIL_WIDTHS)
        widths = VECTOR_WIDTHS + PAIR_TAIL_WIDTHS if tails else VECTOR_WIDTHS

        def load(pair, lanes):
            element = builder.add(pair, pair)
            index = element if duplicated else pair
            cache_lanes = 2 * lanes if duplicated else lanes
            return (
                element,
                stream.load(x, element, x_type, 2 * lanes),
                stream.load(cos, index, cache_type, cache_lanes),
                stream.load(sin, index, cache_type, cache_lanes),
            )

        def rotated(element, pairs, cos_lanes, sin_lanes, lanes):
            if duplicated:
                return stream.rotate_in_pairs(
                    pairs, cos_lanes, sin_lanes, sign, _exact_products(*signature.args[:2])
                )
            y1, y2 = stream.rotate(
                stream.shuffle(pairs, pairs, _firsts(lanes)),
                stream.shuffle(pairs, pairs, _seconds(lanes)),
                cos_lanes,
                sin_lanes,
                sign,
                exact_products=_exact_products(*signature.args[:2]),
            )
            return stream.shuffle(y1, y2, _interleaved(lanes))

        def put(pair, merged, lanes):
            element = builder.add(pair, pair)
            stream.store(merged, out, element, x_type, 2 * lanes, nontemporal)

        def two_steps(pair, lanes):
            loaded = [
                load(pair, lanes),
                load(builder.add(pair, ir.Constant(stream.intp, lanes)), lanes),
            ]
            for values in loaded:
                stream.store(rotated(*values, lanes), out, values[0], x_type, 2 * lanes,
                             nontemporal)  # fmt: skip

        def step(pair, lanes):
            put(pair, rotated(*load(pair, lanes), lanes), lanes)

        def steps(start, length):
            start = stream.double_steps(start, length, two_steps)
            return stream.steps(start, builder.sub(half, start), step, widths=widths)

        if off_line:
            return stream.off_line(out.data, half, x_type.bitwidth // 4, steps, step)
        return steps(ir.Constant(stream.intp, 0), half)

    return types.intp(x_row, cos_row, sin_row, out_row, half, sign), codegen


def _word_pairs_typing(nontemporal, x_row, cos_row, sin_row, out_row, half, sign):
    """Rotate the first ``n`` pairs of a row of bfloat16 (caches included), ``half``
    non-interleaved pairs, two elements per 32-bit word (see
    :mod:`numba_rope._conversions`), and return ``n``, ``half`` rounded down to a
    multiple of 8 with non-temporal stores (twice :data:`WORD_WIDTHS` pairs a step),
    of 2 with ordinary ones (then :data:`WORD_TAIL_WIDTHS`). Streaming rows whose
    output starts off a 64-byte line and whose halves are whole lines take
    :meth:`_Stream.shifted_lines` on AVX-512 targets (:func:`words_fill_lines`). The
    same arithmetic per element as the element loop, a quarter fewer instructions.
    Written in LLVM vectors rather than as a numba loop: numba inlines every branch
    of :func:`numba_rope._cpu.kernels.rotate_row` before dropping the dead ones, and
    this code would cost every kernel's compilation, bfloat16 or not."""
    if not _word_typing(x_row, cos_row, sin_row, out_row):
        return None

    def codegen(context, builder, signature, args, off_line=False):
        (x, cos, sin, out), _, cache_type, half, sign = _stream_arguments(
            context, builder, signature, args
        )
        stream = _Stream(context, builder)
        instructions = has_bfloat16_instructions(context)

        def cache_halves(first, lanes):
            """(cos, sin) of the step's low elements, then of its high ones."""
            if cache_type == types.float32:  # widened: see widen_word_halves
                high = builder.add(first, ir.Constant(stream.intp, lanes))
                return [
                    [stream.load(row, index, cache_type, lanes) for row in (cos, sin)]
                    for index in (first, high)
                ]
            c, s = stream.load_words(cos, first, lanes), stream.load_words(sin, first, lanes)
            return [
                [half_code(builder, w) for w in (c, s)]
                for half_code in (bfloat16_low_code, bfloat16_high_code)
            ]

        def rotated(first, lanes):  # lanes words, 2 * lanes pairs: both halves' words
            second = builder.add(first, half)
            a, b = stream.load_words(x, first, lanes), stream.load_words(x, second, lanes)
            (c_low, s_low), (c_high, s_high) = cache_halves(first, lanes)
            y1_low, y2_low = stream.rotate(
                bfloat16_low_code(builder, a), bfloat16_low_code(builder, b), c_low, s_low, sign
            )
            y1_high, y2_high = stream.rotate(
                bfloat16_high_code(builder, a), bfloat16_high_code(builder, b), c_high, s_high, sign
            )
            return second, [
                stream.pair_words(low, high, instructions)
                for low, high in ((y1_low, y1_high), (y2_low, y2_high))
            ]

        def step(first, lanes):
            second, (y1, y2) = rotated(first, lanes)
            stream.store_words(y1, out, first, lanes, nontemporal)
            stream.store_words(y2, out, second, lanes, nontemporal)

        def line(j):
            # the j-th line's worth of pairs of the row (32 pairs): both halves' 16
            # words (see shifted_lines), one step of AVX-512's widest
            return rotated(builder.mul(j, ir.Constant(stream.intp, 32)), 16)[1]

        widths = stream.word_widths if nontemporal else stream.word_widths + WORD_TAIL_WIDTHS

        def steps():
            return stream.steps(ir.Constant(stream.intp, 0), half, step, scale=2, widths=widths)

        if off_line and nontemporal and stream.avx512:  # see words_fill_lines
            return stream.shifted_lines(out.data, half, 2, line, steps)
        return steps()

    return types.intp(x_row, cos_row, sin_row, out_row, half, sign), codegen


def _word_interleaved_pairs_typing(nontemporal, x_row, cos_row, sin_row, out_row, half, sign):
    """:func:`_word_pairs_typing` for interleaved pairs: word ``i`` of a row holds pair ``i``
    (``x1`` low, ``x2`` high), in and out; :data:`VECTOR_WIDTHS` pairs a step, then with
    ordinary stores :data:`PAIR_TAIL_WIDTHS` (every pair of the row). Streaming rows
    whose output starts off a 64-byte line start their loops on the line
    (:meth:`_Stream.off_line`)."""
    if not _word_typing(x_row, cos_row, sin_row, out_row):
        return None

    def codegen(context, builder, signature, args, off_line=False):
        (x, cos, sin, out), _, cache_type, half, sign = _stream_arguments(
            context, builder, signature, args
        )
        stream = _Stream(context, builder)
        instructions = has_bfloat16_instructions(context)

        def step(pair, lanes):
            element = builder.add(pair, pair)
            pairs = stream.load_words(x, element, lanes)
            y1, y2 = stream.rotate(
                bfloat16_low_code(builder, pairs),
                bfloat16_high_code(builder, pairs),
                stream.load(cos, pair, cache_type, lanes),
                stream.load(sin, pair, cache_type, lanes),
                sign,
            )
            merged = stream.pair_words(y1, y2, instructions)
            stream.store_words(merged, out, element, lanes, nontemporal)

        widths = VECTOR_WIDTHS if nontemporal else VECTOR_WIDTHS + PAIR_TAIL_WIDTHS

        def steps(start, length):
            return stream.steps(start, length, step, widths=widths)

        if off_line and nontemporal:
            return stream.off_line(out.data, half, 4, steps, step)
        return steps(ir.Constant(stream.intp, 0), half)

    return types.intp(x_row, cos_row, sin_row, out_row, half, sign), codegen


#: The vector step of a row (typing functions) by (interleaved, words, streaming): the
#: word loops and the element vectors, each with ordinary stores and in a streaming form
#: (non-temporal stores); see :func:`vector_pairs`.
_VECTOR_PAIRS = {
    (False, True, False): functools.partial(_word_pairs_typing, False),
    (True, True, False): functools.partial(_word_interleaved_pairs_typing, False),
    (False, True, True): functools.partial(_word_pairs_typing, True),
    (True, True, True): functools.partial(_word_interleaved_pairs_typing, True),
    (False, False, True): functools.partial(_stream_pairs, True),
    (True, False, True): functools.partial(_stream_interleaved_pairs, True),
    (False, False, False): functools.partial(_stream_pairs, False),
    (True, False, False): functools.partial(_stream_interleaved_pairs, False),
}


def _by_half(builder, half, emit, on_line=None):
    """``emit(half, constant)``, the code of a row's vector steps, behind a test of
    ``half`` against each of :data:`CONSTANT_HALVES`: emitted once per constant, with
    the constant as the row length (``constant`` True), and once for any other length;
    returns the pairs done. With ``on_line`` (a flag: the output starts on a 64-byte
    line) the constant lengths take only rows on a line, and their code leaves out
    :meth:`_Stream.off_line`'s second path: rows off a line take the code for any
    length, which has it (the float32 and streaming element steps emitted four
    times, not six: the suite's compile time).
    With the length known LLVM unrolls the steps and drops their loop bounds, tail
    tests and the spills of a loop over an unknown length: a cost paid once per row,
    2,048 rows a decode step of (64, 32, 1, 128). The serial decode kernel called from
    Python, one thread, eight process pairs on a noisy VM: float32 0.69-0.92x the time
    without, bfloat16 0.80-1.02x, float16 unchanged (F16C's conversions bound it); the
    bfloat16 batch prefill 0.86-0.90x (docs/performance.md, "Eighteenth session"). The
    same arithmetic either way, so the same bits. A test per row rather than a kernel
    per head size: 18 kernels compiled in 29.5-29.7 s against 28.6-29.4 without."""
    done = []
    merge = builder.append_basic_block("rows.done")
    for value in CONSTANT_HALVES:
        constant = ir.Constant(half.type, value)
        special = builder.append_basic_block(f"rows.of.{value}")
        other = builder.append_basic_block(f"rows.not.{value}")
        taken = builder.icmp_unsigned("==", half, constant)
        if on_line is not None:
            taken = builder.and_(taken, on_line)
        builder.cbranch(taken, special, other)
        builder.position_at_end(special)
        done.append((emit(constant, True), builder.block))
        builder.branch(merge)
        builder.position_at_end(other)
    done.append((emit(half, False), builder.block))
    builder.branch(merge)
    builder.position_at_end(merge)
    pairs = builder.phi(done[0][0].type)
    for value, block in done:
        pairs.add_incoming(value, block)
    return pairs


def _flag(value) -> bool | None:
    """The value of a compile-time boolean option (its literal type), else None."""
    return value.literal_value if isinstance(value, types.BooleanLiteral) else None


@intrinsic(prefer_literal=True)
def vector_pairs(
    typingctx, x_row, cos_row, sin_row, out_row, half, sign, interleaved, words, streaming
):
    """The vector step of a row: rotate its first ``n`` pairs and return ``n``, by the
    loop that the constant options choose, or none (``n`` = 0), leaving the rest to
    the element loops of :func:`numba_rope._cpu.kernels.rotate_row`. One intrinsic whose typing picks the
    code: numba inlines a function with every branch before it drops the dead ones, so
    a chain of branches to six intrinsics cost every kernel's compilation."""
    options = (_flag(interleaved), _flag(words), _flag(streaming))
    if None in options:
        return None  # the options must be compile-time constants
    rows = (x_row, cos_row, sin_row, out_row, half, sign)
    typing = _VECTOR_PAIRS.get(options)
    if typing is not None and not options[1] and not options[2]:
        # Ordinary element steps: only for contiguous rows of the float32 and 16-bit
        # storage types; the element loops do the rest (float64, strided rows).
        contiguous = all(getattr(r, "layout", None) == "C" for r in rows[:4])
        if not contiguous or not _stream_typing(*rows[:4]):
            typing = None
    if typing is None:

        def codegen(context, builder, signature, args):
            return context.get_constant(types.intp, 0)

    else:
        typed = typing(*rows)
        if typed is None:
            return None
        inner_signature, inner_codegen = typed

        # Element steps of float32, and streaming steps, whose output starts off a
        # 64-byte line start their loops on the line (_Stream.off_line, or
        # _Stream.shifted_lines, in the code for any length: see _by_half); word steps
        # and float16 ones with ordinary stores were not faster so (measured). The one
        # place that decides it.
        lines_matter = options[2] or (not options[1] and x_row.dtype == types.float32)

        def codegen(context, builder, signature, args):
            on_line = None
            if lines_matter:
                out = context.make_array(signature.args[3])(context, builder, args[3])
                address = builder.ptrtoint(out.data, ir.IntType(64))
                on_line = builder.icmp_unsigned(
                    "==",
                    builder.and_(address, ir.Constant(ir.IntType(64), 63)),
                    ir.Constant(ir.IntType(64), 0),
                )

            def emit(half, constant):
                arguments = [*args[:4], half, args[5]]
                if not lines_matter:
                    return inner_codegen(context, builder, inner_signature, arguments)
                return inner_codegen(
                    context, builder, inner_signature, arguments, off_line=not constant
                )

            return _by_half(builder, args[4], emit, on_line)

    return types.intp(*rows, interleaved, words, streaming), codegen


def _widening(source, wide, length, sources, halves, doubled=False, negated=False):
    """Typing and code of :func:`widen_span` (``halves`` False), :func:`widen_word_halves`
    (True) and :func:`widen_pairs` (``doubled``: ``wide`` of ``(length, 2)``): contiguous
    rows, ``source`` of a storage type in ``sources``, ``wide`` of float32."""
    rows = (source, wide)
    if not (
        all(isinstance(r, types.Array) and r.layout == "C" for r in rows)
        and source.ndim == 1
        and wide.ndim == (2 if doubled else 1)
        and source.dtype in sources
        and wide.dtype == types.float32
    ):
        return None

    def codegen(context, builder, signature, args):
        source_row = context.make_array(signature.args[0])(context, builder, args[0])
        wide_row = context.make_array(signature.args[1])(context, builder, args[1])
        length = context.cast(builder, args[2], signature.args[2], types.intp)
        stream = _Stream(context, builder)
        source_type = signature.args[0].dtype

        def store(value, index, lanes):
            builder.store(value, stream.pointer(wide_row, index, lanes)).align = 4

        def step(index, lanes):
            store(stream.load(source_row, index, source_type, lanes), index, lanes)

        def halves_step(first, lanes):  # the steps of _word_pairs_typing
            words = stream.load_words(source_row, first, lanes)
            store(bfloat16_low_code(builder, words), first, lanes)
            high = builder.add(first, ir.Constant(stream.intp, lanes))
            store(bfloat16_high_code(builder, words), high, lanes)

        def doubled_step(index, lanes):
            value = stream.load(source_row, index, source_type, lanes)
            doubled = stream.shuffle(value, value, [lane // 2 for lane in range(2 * lanes)])
            if negated:  # -value in the even lanes: a sign flip, exact
                even = [lane + (2 * lanes if lane % 2 else 0) for lane in range(2 * lanes)]
                doubled = stream.shuffle(builder.fneg(doubled), doubled, even)
            store(doubled, builder.add(index, index), 2 * lanes)

        if halves:
            # The tail steps too, for rows streamed or not: a streamed row has no pairs
            # past the word steps (STREAM_PAIRS), so both lay its cache row out alike.
            widths = stream.word_widths + WORD_TAIL_WIDTHS
            return stream.steps(ir.Constant(stream.intp, 0), length, halves_step, 2, widths)
        return stream.steps(ir.Constant(stream.intp, 0), length, doubled_step if doubled else step)

    return types.intp(source, wide, length), codegen


@intrinsic
def widen_span(typingctx, source, wide, length):
    """Widen elements ``[0, n)`` of a contiguous row of float16 or bfloat16 storage
    (uint16, int16) into the float32 row ``wide`` and return ``n``, ``length`` rounded
    down to a multiple of 8: steps of :data:`VECTOR_WIDTHS` elements (F16C's packed
    conversion for float16; the interleaved bfloat16 word loop's cache rows). LLVM's
    loop vectorizer left the element loop scalar (one ``vpinsrw`` and one scalar
    conversion per element; a float16 decode step's kernel alone took 0.96-0.98x the
    time with this, one-process A/B on the Zen 4 VM). Widening is exact: the bits of
    :func:`~numba_rope._conversions.widen`."""
    return _widening(source, wide, length, (types.uint16, BFLOAT16_TYPE), halves=False)


@intrinsic
def widen_word_halves(typingctx, source, wide, length):
    """Widen the first ``n`` elements of a contiguous bfloat16 cache row (``n`` =
    ``length`` rounded down to a multiple of 2) into the float32 row ``wide`` in the
    order in which :func:`_word_pairs_typing` uses them, and return ``n``: for each of
    its steps (``lanes`` words from element ``first``), the low elements of the words
    at ``wide[first:first + lanes]``, the high ones after them. The word loop then
    loads its cache vectors, where it widened them (two shifts and two masks a step)
    for every head. Widening is exact: the bits of
    :func:`~numba_rope._conversions.widen`."""
    return _widening(source, wide, length, (BFLOAT16_TYPE,), halves=True)


@intrinsic
def widen_pairs(typingctx, source, pairs, length, negated):
    """Widen elements ``[0, n)`` of a contiguous cache row of float32, float16 or
    bfloat16 storage into the ``(length, 2)`` float32 rows ``pairs``, each value twice
    (``pairs[i, 0] == pairs[i, 1]``, see :func:`pair_rows`; with the constant
    ``negated``, ``pairs[i, 0] == -pairs[i, 1]``: the sin rows of
    :meth:`_Stream.rotate_in_pairs`), and return ``n``, ``length`` rounded down to a
    multiple of 8: steps of :data:`VECTOR_WIDTHS` elements, each vector widened and
    its lanes doubled by one shuffle. Widening and negation are exact: the bits of
    :func:`~numba_rope._conversions.widen`."""
    if _flag(negated) is None:
        return None
    typed = _widening(
        source,
        pairs,
        length,
        _STREAM_TYPES,
        halves=False,
        doubled=True,
        negated=negated.literal_value,
    )
    if typed is None:
        return None
    return types.intp(source, pairs, length, negated), typed[1]


def _emit_prefetch(
    context, builder, array_type, array, byte_offset, offset_type, nbytes, nbytes_type, writing
):
    """Emit ``llvm.prefetch`` of every cache line of ``nbytes`` bytes of ``array`` from
    ``byte_offset`` on, for writing (``prefetchw`` where the CPU has it) or reading.
    Addresses are computed as integers: no ``inbounds`` pointer arithmetic past the
    array (a prefetch is a hint, which never faults)."""
    source = context.make_array(array_type)(context, builder, array)
    i64 = ir.IntType(64)
    start = builder.add(
        builder.ptrtoint(source.data, i64),
        context.cast(builder, byte_offset, offset_type, types.intp),
    )
    length = context.cast(builder, nbytes, nbytes_type, types.intp)
    byte_pointer = ir.IntType(8).as_pointer()
    prefetch = builder.module.declare_intrinsic(
        "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [byte_pointer, _LANE, _LANE, _LANE])
    )
    hint = [ir.Constant(_LANE, int(writing)), ir.Constant(_LANE, 3), ir.Constant(_LANE, 1)]
    end = builder.add(start, length)
    with cgutils.for_range_slice(builder, start, end, ir.Constant(i64, 64), i64) as (address, _):
        builder.call(prefetch, [builder.inttoptr(address, byte_pointer), *hint])
    # the line of the last byte, which a span off the lines' boundaries reaches
    last = builder.sub(end, ir.Constant(i64, 1))
    builder.call(prefetch, [builder.inttoptr(last, byte_pointer), *hint])


@intrinsic
def prefetch_span(typingctx, array, byte_offset, nbytes):
    """Prefetch, for writing, the cache lines of ``nbytes`` bytes of ``array`` from
    ``byte_offset`` on (``llvm.prefetch``: a hint, which never faults, so the span may
    lie past the array's end). Addresses are computed as integers: no ``inbounds``
    pointer arithmetic past the array."""
    if not isinstance(array, types.Array):
        return None

    def codegen(context, builder, signature, args):
        array_type, offset_type, nbytes_type = signature.args
        _emit_prefetch(
            context, builder, array_type, args[0], args[1], offset_type, args[2], nbytes_type, True
        )
        return context.get_dummy_value()

    return types.void(array, byte_offset, nbytes), codegen


@intrinsic
def prefetch_rows(typingctx, x, x_offset, out, out_offset, nbytes):
    """Prefetch ``nbytes`` bytes of ``x`` from ``x_offset`` on for reading and of
    ``out`` from ``out_offset`` on for writing (see :func:`prefetch_span`): an input
    row and the output row it is rotated into. Two spans in one intrinsic rather than
    a hint passed as a constant, which numba would type every call of twice."""
    if not (isinstance(x, types.Array) and isinstance(out, types.Array)):
        return None

    def codegen(context, builder, signature, args):
        x_type, x_offset_type, out_type, out_offset_type, nbytes_type = signature.args
        _emit_prefetch(
            context, builder, x_type, args[0], args[1], x_offset_type, args[4], nbytes_type, False
        )
        _emit_prefetch(
            context, builder, out_type, args[2], args[3], out_offset_type, args[4], nbytes_type,
            True,
        )  # fmt: skip
        return context.get_dummy_value()

    return types.void(x, x_offset, out, out_offset, nbytes), codegen


@intrinsic
def store_fence(typingctx):
    """A store fence: non-temporal stores are weakly ordered, so each thread that made
    some fences them before it reports its work done, whatever the threading layer's
    own barrier guarantees. ``sfence`` on x86, the instruction documented for ordering
    non-temporal stores (LLVM would turn a plain fence into a locked ``or``), a full
    fence elsewhere."""

    def codegen(context, builder, signature, args):
        if X86:
            sfence = builder.module.declare_intrinsic(
                "llvm.x86.sse.sfence", fnty=ir.FunctionType(ir.VoidType(), [])
            )
            builder.call(sfence, [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic(prefer_literal=True)
def stream_copy(typingctx, x_row, out_row, start, end, streaming):
    """With ``streaming`` (a constant): copy elements ``[start, m)`` of a row with
    non-temporal stores, ``m - start`` the largest multiple of 8 up to ``end`` (of 16
    bytes where element ``start`` of the output is off a 64-byte line and a line's
    elements or more are copied), and return ``m`` (the channels past ``rotary_dim``;
    element ``start`` of the output must be on :data:`STREAM_ALIGNMENT` bytes).
    Without: return ``start``, copying nothing.

    From the first element on a line, as the rotated pairs (:meth:`_Stream.off_line`):
    each 64-byte store off a line was split into four of 16 bytes, and the float32
    ``partial`` workload (1, 32, 4096, 128) with rotary_dim 64 into an output 16 bytes
    past a line took 2.3-2.4 ms against 1.9 on a line; 1.9 so (one process,
    docs/performance.md, "Forty-fourth session")."""
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

        def step(index, lanes):  # index from start
            index = builder.add(start, index)
            loaded = builder.load(stream.pointer(x, index, lanes), align=1)
            stream.nontemporal_store(loaded, stream.pointer(out, index, lanes))

        def steps(first, length):
            return stream.steps(first, length, step)

        item_bytes = signature.args[1].dtype.bitwidth // 8
        copied = stream.off_line(
            builder.gep(out.data, [start]), builder.sub(end, start), item_bytes, steps, step
        )
        return builder.add(start, copied)

    return signature, codegen
