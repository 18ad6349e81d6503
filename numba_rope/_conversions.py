"""float16 and bfloat16 inside Numba CPU kernels.

Numba's CPU target has no float16 type and knows nothing of bfloat16, so the kernels
receive these arrays as 16-bit integer views. The integer type tells the format:

==============  ==================  ===============================================
storage dtype   numerical format    widening / narrowing
==============  ==================  ===============================================
``uint16``      IEEE float16        LLVM ``half``: ``fpext`` / ``fptrunc`` (F16C,
                                    Arm's ``fcvt``); integer code on x86 without
                                    F16C and other machines
``int16``       bfloat16            shift by 16 / round to nearest even in integers
``float32``     float32             none
``float64``     float64             none
==============  ==================  ===============================================

:func:`widen` turns a stored element into its compute type (float64 stays float64,
everything else becomes float32) and :func:`narrow_like` rounds a computed value once,
to nearest even, into the element type of a given array. Both are resolved at compile
time from the argument types, so a kernel is written once for all formats.

Where the CPU has AVX512_BF16, the kernels' vector loops narrow bfloat16 with its
instructions (:func:`bfloat16_pair_vector_code` for the words of rows with bfloat16
caches, :func:`bfloat16_vector_code` for the elements of rows with float32 caches),
the same bits.

NaN stays NaN and infinities stay infinite. The payload of a NaN is not preserved
bit for bit: bfloat16 NaNs become the canonical quiet NaN of their sign, as
``ml_dtypes`` does, and float16 NaNs are quieted by the hardware conversion.
"""

from __future__ import annotations

import platform
from typing import NamedTuple

import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.extending import intrinsic

#: The storage dtype that stands for each 16-bit format inside the CPU kernels.
FLOAT16_STORAGE = np.dtype(np.uint16)
BFLOAT16_STORAGE = np.dtype(np.int16)

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)

# The conversions below take scalars or LLVM vectors alike (the streaming kernels of
# numba_rope._cpu convert eight elements at a time): a type or constant is made in the
# shape of the value it goes with.


def _shaped(value, scalar_type):
    """``scalar_type``, or a vector of it as long as ``value`` if that is a vector."""
    if isinstance(value.type, ir.VectorType):
        return ir.VectorType(scalar_type, value.type.count)
    return scalar_type


def _constant(value, number):
    """The 32-bit integer ``number`` in the shape of ``value``."""
    shaped = _shaped(value, _I32)
    if isinstance(shaped, ir.VectorType):
        return ir.Constant(shaped, [number] * shaped.count)
    return ir.Constant(shaped, number)


def _float16_to_float32(builder, bits):
    half = builder.bitcast(bits, _shaped(bits, ir.HalfType()))
    return builder.fpext(half, _shaped(bits, ir.FloatType()))


def _float32_to_float16(builder, value):
    half = builder.fptrunc(value, _shaped(value, ir.HalfType()))
    return builder.bitcast(half, _shaped(value, _I16))


# float16 without F16C. LLVM lowers ``fpext`` / ``fptrunc`` of ``half`` on such a target
# (an x86-64 CPU before Ivy Bridge or Piledriver, an Atom or a Pentium without AVX, a
# virtual CPU such as QEMU's default, ``NUMBA_CPU_NAME=generic``) to calls of
# compiler-rt's ``__extendhfsf2`` / ``__truncsfhf2``, which numba's JIT cannot resolve:
# "LLVM ERROR: Symbol not found", and the process aborts. These two take integer and
# float32 operations only, scalars or vectors, and give F16C's bits: widening exact,
# a NaN quieted, its payload kept; narrowing to nearest even (the float32 addition
# below rounds in MXCSR's mode, to nearest even, never changed by the package), with
# overflow to infinity and a NaN quieted, its payload's upper ten bits kept.


def _float16_to_float32_without_f16c(builder, bits):
    """:func:`_float16_to_float32` without F16C."""
    wide = builder.zext(bits, _shaped(bits, _I32))

    def constant(number):
        return _constant(wide, number)

    magnitude = builder.shl(builder.and_(wide, constant(0x7FFF)), constant(13))
    exponent = builder.and_(magnitude, constant(0x0F800000))
    rebiased = builder.add(magnitude, constant(112 << 23))  # float16's bias 15, float32's 127
    # Infinity and NaN: the largest exponent, 255, the payload as it is, a NaN quieted.
    nan = builder.icmp_unsigned(">", magnitude, constant(0x0F800000))
    quiet = builder.select(nan, constant(0x00400000), constant(0))
    special = builder.or_(builder.add(rebiased, constant(112 << 23)), quiet)
    # Zero and subnormal: m * 2**-24, as (1 + m/1024) * 2**-14 - 2**-14, exact.
    float32 = _shaped(bits, ir.FloatType())
    offset = builder.bitcast(builder.add(rebiased, constant(1 << 23)), float32)
    smallest_normal = builder.bitcast(constant(113 << 23), float32)
    small = builder.bitcast(builder.fsub(offset, smallest_normal), _shaped(bits, _I32))
    result = builder.select(
        builder.icmp_unsigned("==", exponent, constant(0x0F800000)),
        special,
        builder.select(builder.icmp_unsigned("==", exponent, constant(0)), small, rebiased),
    )
    sign = builder.shl(builder.and_(wide, constant(0x8000)), constant(16))
    return builder.bitcast(builder.or_(result, sign), float32)


def _float32_to_float16_without_f16c(builder, value):
    """:func:`_float32_to_float16` without F16C."""
    bits = builder.bitcast(value, _shaped(value, _I32))

    def constant(number):
        return _constant(bits, number)

    sign = builder.and_(bits, constant(0x80000000))
    magnitude = builder.xor(bits, sign)
    # Normal results (2**-14 <= |value| < 65536): rebias the exponent, round the 13
    # bits dropped to nearest even (0xFFF plus the lowest kept bit; a carry goes into
    # the exponent, up to infinity).
    lowest_kept = builder.and_(builder.lshr(magnitude, constant(13)), constant(1))
    rebiased = builder.add(magnitude, constant((-112 << 23) & 0xFFFFFFFF))
    normal = builder.lshr(
        builder.add(rebiased, builder.add(constant(0xFFF), lowest_kept)), constant(13)
    )
    # Subnormal results and zero (|value| < 2**-14): |value| + 0.5 rounds to a multiple
    # of 2**-24, float16's subnormal step, in the float32 unit; its bits past 0.5's are
    # the result (0x400, the smallest normal, where it rounds up).
    float32 = _shaped(value, ir.FloatType())
    half = builder.bitcast(constant(0x3F000000), float32)
    shifted = builder.fadd(builder.bitcast(magnitude, float32), half)
    small = builder.sub(builder.bitcast(shifted, _shaped(value, _I32)), constant(0x3F000000))
    # |value| >= 65536 and infinity: infinity; NaN: quiet, the payload's upper bits.
    payload = builder.and_(builder.lshr(magnitude, constant(13)), constant(0x3FF))
    large = builder.select(
        builder.icmp_unsigned(">", magnitude, constant(0x7F800000)),
        builder.or_(payload, constant(0x7E00)),
        constant(0x7C00),
    )
    result = builder.select(
        builder.icmp_unsigned(">=", magnitude, constant(0x47800000)),
        large,
        builder.select(builder.icmp_unsigned("<", magnitude, constant(113 << 23)), small, normal),
    )
    merged = builder.or_(result, builder.lshr(sign, constant(16)))
    return builder.trunc(merged, _shaped(value, _I16))


def _bfloat16_to_float32(builder, bits):
    wide = builder.zext(bits, _shaped(bits, _I32))
    return builder.bitcast(builder.shl(wide, _constant(bits, 16)), _shaped(bits, ir.FloatType()))


def _bfloat16_rounded_bits(builder, value, nan_free=False, constants=None):
    """The bits of float32 ``value`` rounded to bfloat16 in their upper 16 bits (the
    lower 16 are garbage). ``value`` must be the result of arithmetic, so that a NaN
    is a quiet one (IEEE 754 arithmetic never returns a signaling NaN). With
    ``nan_free`` the caller knows that no lane is a NaN, and the NaN code is left out.
    ``constants``: see :func:`pair_constants`."""
    bits = builder.bitcast(value, _shaped(value, _I32))
    if nan_free:
        return _rounded_to_nearest_even(builder, value, bits, constants)
    # A quiet NaN becomes the canonical quiet NaN of its sign before rounding (rounding
    # a NaN's bits could carry into the sign). Quiet NaNs are the largest patterns of
    # each sign: as signed integers the positive ones lie above 0x7FC00000, as unsigned
    # integers the negative ones lie above 0xFFC00000, and every other value lies below
    # both bounds. Two minimums (vpminsd, vpminud) canonicalize them, where a test and a
    # blend take four instructions.
    positive_nan = _constant(value, 0x7FC00000)
    negative_nan = _constant(value, 0xFFC00000)
    bits = builder.select(builder.icmp_signed(">", bits, positive_nan), positive_nan, bits)
    bits = builder.select(builder.icmp_unsigned(">", bits, negative_nan), negative_nan, bits)
    return _rounded_to_nearest_even(builder, value, bits, constants)


def _rounded_to_nearest_even(builder, value, bits, constants=None):
    # Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit (bit 16).
    if constants is None:
        lowest_kept = builder.and_(builder.lshr(bits, _constant(value, 16)), _constant(value, 1))
        return builder.add(bits, builder.add(_constant(value, 0x7FFF), lowest_kept))
    # 0x8000 where the lowest kept bit is set, else 0x7FFF: one bit test into a mask
    # register and a blend (see pair_constants).
    odd = builder.icmp_unsigned(
        "!=", builder.and_(bits, _constant(value, 0x10000)), _constant(value, 0)
    )
    return builder.add(bits, builder.select(odd, _constant(value, 0x8000), constants.bias))


def _float32_to_bfloat16(builder, value):
    # Everything stays 32 bits wide until the final truncation, so the vectorized loop
    # packs to 16 bits only once.
    rounded = builder.lshr(_bfloat16_rounded_bits(builder, value), _constant(value, 16))
    return builder.trunc(rounded, _shaped(value, _I16))


#: Per storage type: (widening, narrowing) of a 16-bit format, on targets with F16C.
_HALF_FORMATS = {
    types.uint16: (_float16_to_float32, _float32_to_float16),
    types.int16: (_bfloat16_to_float32, _float32_to_bfloat16),
}
#: The same on targets without it (see :func:`_float16_to_float32_without_f16c`).
_HALF_FORMATS_WITHOUT_F16C = {
    **_HALF_FORMATS,
    types.uint16: (_float16_to_float32_without_f16c, _float32_to_float16_without_f16c),
}


#: Whether numba compiles for x86 here (its JIT compiles for the machine it runs on),
#: or for 64-bit Arm, whose every CPU converts float16 in hardware (``fcvt``).
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
ARM64 = platform.machine().lower() in ("aarch64", "arm64")


def _half_formats(context):
    """:data:`_HALF_FORMATS` for the CPU target of ``context``: LLVM's ``half``
    conversions on x86 with F16C and on 64-bit Arm, the integer code elsewhere (x86
    without F16C; other machines, where LLVM may call compiler-rt too)."""
    hardware = has_f16c(context) if X86 else ARM64
    return _HALF_FORMATS if hardware else _HALF_FORMATS_WITHOUT_F16C


def widen_code(context, builder, numba_type, value):
    """LLVM code of :func:`widen` for a stored value (scalar or vector) of ``numba_type``
    (a 16-bit storage type, float32 or float64), for the CPU target of ``context``."""
    if numba_type in _HALF_FORMATS:
        return _half_formats(context)[numba_type][0](builder, value)
    return value


def narrow_code(context, builder, numba_type, value):
    """LLVM code of :func:`narrow_like` for a float32 (or float64 into float64) value,
    scalar or vector, into elements of ``numba_type``, for the CPU target of
    ``context``."""
    if numba_type in _HALF_FORMATS:
        return _half_formats(context)[numba_type][1](builder, value)
    return value


@intrinsic
def widen(typingctx, value):
    """Return a stored element in its compute type (see the module docstring).

    Intrinsics, not inlined overloads, emit these conversions: they cost nothing to
    compile (inlining numba IR is most of the compile time of these kernels).
    """
    if value in _HALF_FORMATS:
        return types.float32(value), lambda context, builder, sig, args: widen_code(
            context, builder, value, args[0]
        )
    if value in (types.float32, types.float64):
        return value(value), lambda context, builder, sig, args: args[0]
    return None


@intrinsic
def narrow_like(typingctx, value, like):
    """Round ``value`` once to the element type of the array ``like``.

    ``value`` must come from arithmetic, so that a NaN is a quiet one (IEEE 754
    arithmetic never returns a signaling NaN): the bfloat16 rounding relies on it, see
    :func:`_bfloat16_rounded_bits`.
    """
    if not isinstance(like, types.Array) or not isinstance(value, types.Float):
        return None
    target = like.dtype
    if target in _HALF_FORMATS:

        def narrow(context, builder, sig, args):
            single = context.cast(builder, args[0], sig.args[0], types.float32)
            return narrow_code(context, builder, target, single)

        return target(value, like), narrow
    if target in (types.float32, types.float64):

        def cast(context, builder, sig, args):
            return context.cast(builder, args[0], sig.args[0], target)

        return target(value, like), cast
    return None


# bfloat16 two at a time. A 32-bit word of bfloat16 storage holds two elements, the
# first in its low half (little-endian): each widens with one instruction (a shift or a
# mask) where a single element takes two (a zero extension and a shift), and two
# rounded results merge back into a word without packing and permuting lanes. The
# arithmetic per element is unchanged, so are the results, bit for bit.

_HIGH_HALF = 0xFFFF0000


def bfloat16_low_code(builder, words):
    """The first bfloat16 of 32-bit storage words (scalar or vector), as float32."""
    return builder.bitcast(builder.shl(words, _constant(words, 16)), _shaped(words, ir.FloatType()))


def bfloat16_high_code(builder, words):
    """The second bfloat16 of 32-bit storage words, as float32."""
    masked = builder.and_(words, _constant(words, _HIGH_HALF))
    return builder.bitcast(masked, _shaped(words, ir.FloatType()))


def bfloat16_pair_code(builder, low, high, nan_free=False, constants=None):
    """32-bit storage words of two float32 arithmetic results (scalars or vectors),
    each rounded once to nearest even (see :func:`narrow_like`): ``low`` first.
    ``nan_free``: see :func:`_bfloat16_rounded_bits`. ``constants``: the vector
    constants of :func:`pair_constants` (default: LLVM constants)."""
    first = builder.lshr(
        _bfloat16_rounded_bits(builder, low, nan_free, constants), _constant(low, 16)
    )
    mask = _constant(high, _HIGH_HALF) if constants is None else constants.high_half
    second = builder.and_(_bfloat16_rounded_bits(builder, high, nan_free, constants), mask)
    return builder.or_(first, second)


class PairConstants(NamedTuple):
    """Vector constants of :func:`bfloat16_pair_code` that LLVM cannot see through
    (see :func:`pair_constants`)."""

    #: 0xFFFF0000: the mask of the words' upper halves.
    high_half: ir.Value
    #: 0x7FFF: the rounding bias where the lowest kept bit is clear.
    bias: ir.Value


def pair_constants(builder, lanes, opaque) -> PairConstants | None:
    """For :func:`bfloat16_pair_code` on vectors of ``lanes`` words: with ``opaque``
    (AVX-512 targets, see :func:`has_avx512`), its constants passed once through an
    empty inline assembly statement at the top of the function, which LLVM cannot see
    through; else None (LLVM constants, best without AVX-512: LLVM merges two rounded
    vectors with one ``vpblendw``). The same bits either way. On AVX-512 with
    constants LLVM sees, it

    - folds the shift, mask and merge of two rounded vectors into one word
      permutation (``vpermt2w``, three micro-ops on Intel's cores), where the opaque
      mask keeps a shift and one ``vpternlogd``;
    - rounds with a shift, a mask and two additions (``0x7FFF`` plus the lowest kept
      bit), where a bias of ``0x8000`` or the opaque ``0x7FFF`` chosen by that bit
      takes a bit test into a mask register, a blend and one addition (with a
      constant ``0x7FFF`` LLVM turns the choice back into the shift and mask).

    The bfloat16 kernel alone on the Emerald Rapids VM without AVX512_BF16 (one
    core, rows in the L1 cache, process pairs; docs/performance.md, "Seventeenth
    session"): the merge 0.95-0.96x the time, the rounding after it 0.87-0.94x."""
    if not opaque:
        return None
    vector = ir.VectorType(_I32, lanes)
    barrier = ir.InlineAsm(ir.FunctionType(vector, [vector]), "", "=v,0")
    with builder.goto_entry_block():
        return PairConstants(
            *(builder.call(barrier, [ir.Constant(vector, value)]) for value in (_HIGH_HALF, 0x7FFF))
        )


def _usual_unless_any(builder, flags, usual, rare):
    """The value ``usual()`` builds, or ``rare()`` where any lane of the vector of
    flags is true: one reduction and one branch, the rare side laid out of line."""
    lanes = flags.type.count
    reduce = builder.module.declare_intrinsic(
        f"llvm.vector.reduce.or.v{lanes}i1", fnty=ir.FunctionType(ir.IntType(1), [flags.type])
    )
    with builder.if_else(builder.call(reduce, [flags]), likely=False) as (then, otherwise):
        with then:
            rare_value = rare()
            rare_block = builder.block
        with otherwise:
            usual_value = usual()
            usual_block = builder.block
    value = builder.phi(usual_value.type)
    value.add_incoming(usual_value, usual_block)
    value.add_incoming(rare_value, rare_block)
    return value


def _bfloat16_pair_integer_vector_code(builder, low, high, constants):
    """:func:`bfloat16_pair_code` of two float32 vectors, the NaN code only for the
    rare pair of vectors with a NaN lane: one unordered compare of ``low`` with
    ``high`` (true in a lane where either is a NaN) and one test of its mask, where
    the NaN code takes two minimums per vector."""
    return _usual_unless_any(
        builder,
        builder.fcmp_unordered("uno", low, high),
        lambda: bfloat16_pair_code(builder, low, high, nan_free=True, constants=constants),
        lambda: bfloat16_pair_code(builder, low, high, constants=constants),
    )


# AVX512_BF16 narrows 32 float32 lanes to bfloat16 in one instruction (``vcvtne2ps2bf16``),
# rounding to nearest even as the integer code above does, but with subnormal inputs
# treated as zero and NaN payloads kept: it gives the contract's bits for every lane
# that is neither subnormal nor NaN. A vector with such a lane (one class test per
# vector, rarely true) takes the integer code instead, so the bits do not depend on
# the CPU.

# LLVM's x86-64 CPU names by the extensions their models imply, for a target named
# without features (``NUMBA_CPU_NAME`` with ``NUMBA_CPU_FEATURES=""``), whose feature
# string shows none: the names of LLVM 14 to 22. A name in none of them gets the code
# that is right on every CPU (integer conversions, narrower vectors).
# tests/test_bench_report.py holds each set to the code LLVM emits for each name; the
# bench's header (``bench.report.vector_extensions``) reads them too.

#: Names with AVX512-FP16.
FP16_CPUS = frozenset(
    {"sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d", "diamondrapids"}
)
#: Names with AVX512_BF16 (and AVX512DQ, AVX512VL).
BF16_CPUS = FP16_CPUS | {"cooperlake", "znver4", "znver5"}
#: Names with AVX512F, AVX512BW and AVX512VL.
AVX512_CPUS = BF16_CPUS | {
    "skylake-avx512", "skx", "cascadelake", "cannonlake", "icelake-client",
    "icelake-server", "tigerlake", "rocketlake", "x86-64-v4",
}  # fmt: skip
#: Names with AVX2.
AVX2_CPUS = AVX512_CPUS | {
    "haswell", "core-avx2", "broadwell", "skylake", "alderlake", "raptorlake",
    "meteorlake", "arrowlake", "arrowlake-s", "lunarlake", "pantherlake", "gracemont",
    "sierraforest", "grandridge", "clearwaterforest", "znver1", "znver2", "znver3",
    "bdver4", "x86-64-v3",
}  # fmt: skip
#: Names with FMA3.
FMA_CPUS = AVX2_CPUS | {"bdver2", "bdver3"}
#: Names with F16C (which implies AVX).
F16C_CPUS = FMA_CPUS | {"ivybridge", "core-avx-i", "btver2"}
#: Names with AVX.
AVX_CPUS = F16C_CPUS | {"sandybridge", "corei7-avx", "bdver1"}

#: ``vfpclassps`` classes: quiet NaN, subnormal, signaling NaN.
_NAN_OR_SUBNORMAL = 0x01 | 0x20 | 0x80


#: Whether AVX512_BF16's conversion intrinsics return ``bfloat`` vectors, as they do since
#: LLVM 17; before (LLVM 14 and 15: numba 0.60 and 0.61), vectors of ``i16`` holding the
#: same bits, and LLVM refuses the other type ("Intrinsic has incorrect return type!").
_BFLOAT_RESULTS = binding.llvm_version_info >= (17,)


class _BFloatType(ir.types._BaseFloatType):  # llvmlite has no bfloat type
    null = "0.0"
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"


_BFloatType._create_instance()


def _target_has(context, features, named_cpus) -> bool:
    """Whether the CPU target of ``context`` (a numba target context) has every one of
    ``features`` (LLVM's names, ``+`` first): from the features numba compiles for, or
    where those are empty (a CPU named alone), whether its name is in ``named_cpus``."""
    codegen = context.codegen()
    # numba's private names (numba 0.68's CPUCodegen); without them, neither choice.
    compiled_for = getattr(codegen, "_tm_features", "")
    if compiled_for:
        return set(features) <= set(compiled_for.split(","))
    return getattr(codegen, "_get_host_cpu_name", lambda: "")() in named_cpus


def has_bfloat16_instructions(context) -> bool:
    """Whether the CPU target of ``context`` has AVX512_BF16, AVX512DQ and AVX512VL
    (see :func:`bfloat16_pair_vector_code`)."""
    return _target_has(context, ("+avx512bf16", "+avx512dq", "+avx512vl"), BF16_CPUS)


def has_avx512(context) -> bool:
    """Whether the CPU target of ``context`` has AVX512F and AVX512VL (see
    :func:`pair_constants`)."""
    return _target_has(context, ("+avx512f", "+avx512vl"), AVX512_CPUS)


def has_f16c(context) -> bool:
    """Whether the CPU target of ``context`` has F16C (which implies AVX)."""
    return _target_has(context, ("+f16c",), F16C_CPUS)


def has_avx(context) -> bool:
    """Whether the CPU target of ``context`` has AVX (256-bit vector registers)."""
    return _target_has(context, ("+avx",), AVX_CPUS)


def has_float16_arithmetic(context) -> bool:
    """Whether the CPU target of ``context`` has AVX512-FP16, whose vectors of LLVM
    ``half`` are legal types (see :func:`float16_integer_code`)."""
    return _target_has(context, ("+avx512fp16",), FP16_CPUS)


def float16_integer_code(builder, value):
    """:func:`narrow_code` of a vector of 8, 16 or 32 float32 into float16 storage,
    through the F16C / AVX-512 conversion intrinsics, whose results are integer
    vectors: the same instructions and bits as LLVM's ``fptrunc``, but no vector of
    ``half`` for LLVM's instruction selection, which on AVX512-FP16 targets made
    non-temporal stores of such vectors ordinary ones."""
    lanes = value.type.count
    if lanes != 32:
        return _float16_integer_piece(builder, value)
    low, high = (
        _float16_integer_piece(builder, _lanes_of(builder, value, list(range(first, first + 16))))
        for first in (0, 16)
    )
    return _lanes_of(builder, low, list(range(32)), high)


def _lanes_of(builder, first, lanes, second=None):
    """The ``lanes`` of ``first`` followed by ``second`` (a shuffle)."""
    mask = ir.Constant(ir.VectorType(_I32, len(lanes)), lanes)
    return builder.shuffle_vector(first, first if second is None else second, mask)


def _float16_integer_piece(builder, value):
    """:func:`float16_integer_code` of 8 or 16 lanes: one conversion."""
    lanes = value.type.count
    assert lanes in (8, 16), lanes
    storage = ir.VectorType(_I16, lanes)
    current_rounding = ir.Constant(_I32, 4)  # MXCSR's: to nearest even
    if lanes == 16:
        convert = builder.module.declare_intrinsic(
            "llvm.x86.avx512.mask.vcvtps2ph.512",
            fnty=ir.FunctionType(storage, [value.type, _I32, storage, ir.IntType(16)]),
        )
        every_lane = ir.Constant(ir.IntType(16), -1)
        return builder.call(
            convert, [value, current_rounding, ir.Constant(storage, None), every_lane]
        )
    convert = builder.module.declare_intrinsic(
        "llvm.x86.vcvtps2ph.256", fnty=ir.FunctionType(storage, [value.type, _I32])
    )
    return builder.call(convert, [value, current_rounding])


def bfloat16_pair_vector_code(builder, low, high, instructions, constants=None):
    """:func:`bfloat16_pair_code` of two float32 vectors of 8 or 16 lanes; with
    ``instructions`` (see :func:`has_bfloat16_instructions`), one ``vcvtne2ps2bf16``
    and a permutation for vectors without NaN or subnormal lanes, the same bits;
    without, the integer code with its NaN handling out of line
    (:func:`_bfloat16_pair_integer_vector_code`), with ``constants`` (see
    :func:`pair_constants`)."""
    lanes = low.type.count
    if not instructions or lanes not in (8, 16):
        return _bfloat16_pair_integer_vector_code(builder, low, high, constants)
    module = builder.module
    flags = ir.VectorType(ir.IntType(1), lanes)
    classify = module.declare_intrinsic(
        f"llvm.x86.avx512.fpclass.ps.{32 * lanes}", fnty=ir.FunctionType(flags, [low.type, _I32])
    )
    test = ir.Constant(_I32, _NAN_OR_SUBNORMAL)
    special = builder.or_(builder.call(classify, [low, test]), builder.call(classify, [high, test]))

    def converted():
        narrowed = ir.VectorType(_BFloatType() if _BFLOAT_RESULTS else _I16, 2 * lanes)
        convert = module.declare_intrinsic(
            f"llvm.x86.avx512bf16.cvtne2ps2bf16.{32 * lanes}",
            fnty=ir.FunctionType(narrowed, [low.type, high.type]),
        )
        halves = builder.bitcast(builder.call(convert, [high, low]), ir.VectorType(_I16, 2 * lanes))
        order = [lane + half * lanes for lane in range(lanes) for half in (0, 1)]
        mask = ir.Constant(ir.VectorType(_I32, 2 * lanes), order)
        pairs = builder.shuffle_vector(halves, halves, mask)
        return builder.bitcast(pairs, ir.VectorType(_I32, lanes))

    return _usual_unless_any(
        builder,
        special,
        converted,
        lambda: bfloat16_pair_code(builder, low, high, constants=constants),
    )


def bfloat16_vector_code(builder, value, instructions):
    """:func:`narrow_code` of a vector of 8, 16 or 32 float32 lanes into bfloat16
    elements (``int16`` storage, the lanes in their order); with ``instructions`` (see
    :func:`has_bfloat16_instructions`) by AVX512_BF16's conversion for vectors without
    NaN or subnormal lanes (``vcvtneps2bf16``; ``vcvtne2ps2bf16`` for 32 lanes), the
    same bits as the integer code, which the other vectors take, out of line: the
    element rows of bfloat16 with float32 caches (the words, for bfloat16 caches, have
    :func:`bfloat16_pair_vector_code`)."""
    lanes = value.type.count
    if not instructions or lanes not in (8, 16, 32):
        return _float32_to_bfloat16(builder, value)
    module = builder.module
    piece = min(lanes, 16)
    pieces = [
        _lanes_of(builder, value, list(range(first, first + piece)))
        for first in range(0, lanes, piece)
    ]  # (a 16-lane vector is its own piece: the shuffle of every lane folds away)
    classify = module.declare_intrinsic(
        f"llvm.x86.avx512.fpclass.ps.{32 * piece}",
        fnty=ir.FunctionType(ir.VectorType(ir.IntType(1), piece), [pieces[0].type, _I32]),
    )
    test = ir.Constant(_I32, _NAN_OR_SUBNORMAL)
    flags = [builder.call(classify, [p, test]) for p in pieces]
    special = flags[0] if len(flags) == 1 else builder.or_(flags[0], flags[1])

    def converted():
        narrowed = ir.VectorType(_BFloatType() if _BFLOAT_RESULTS else _I16, lanes)
        if lanes == 32:  # the second operand's lanes come first
            name, operands = "cvtne2ps2bf16.512", [pieces[1], pieces[0]]
        else:
            name, operands = f"cvtneps2bf16.{32 * lanes}", [value]
        convert = module.declare_intrinsic(
            f"llvm.x86.avx512bf16.{name}",
            fnty=ir.FunctionType(narrowed, [operand.type for operand in operands]),
        )
        return builder.bitcast(builder.call(convert, operands), ir.VectorType(_I16, lanes))

    return _usual_unless_any(
        builder, special, converted, lambda: _float32_to_bfloat16(builder, value)
    )


@intrinsic
def bfloat16_low(typingctx, word):
    """:func:`bfloat16_low_code` of one word."""
    if word != types.uint32:
        return None
    return types.float32(word), lambda context, builder, sig, args: bfloat16_low_code(
        builder, args[0]
    )


@intrinsic
def bfloat16_high(typingctx, word):
    """:func:`bfloat16_high_code` of one word."""
    if word != types.uint32:
        return None
    return types.float32(word), lambda context, builder, sig, args: bfloat16_high_code(
        builder, args[0]
    )


@intrinsic
def bfloat16_pair(typingctx, low, high):
    """:func:`bfloat16_pair_code` of two values."""
    if low != types.float32 or high != types.float32:
        return None
    return types.uint32(low, high), lambda context, builder, sig, args: bfloat16_pair_code(
        builder, *args
    )
