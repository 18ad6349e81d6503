"""The float16/bfloat16 conversions used inside the CPU kernels, checked exhaustively
against NumPy's float16 casts and ml_dtypes' bfloat16 casts.

Narrowing takes results of arithmetic, whose NaNs are quiet (IEEE 754 arithmetic never
returns a signaling NaN): the float32 values fed to it here are quieted the same way."""

from __future__ import annotations

import numpy as np
import pytest
from llvmlite import ir
from numba import njit, types
from numba.core.registry import cpu_target
from numba.extending import intrinsic
from oracles import BFLOAT16, bits

from numba_rope import _conversions as conversions
from numba_rope._conversions import (
    _HALF_FORMATS,
    AVX512_CPUS,
    BFLOAT16_STORAGE,
    F16C_CPUS,
    FLOAT16_STORAGE,
    _float16_to_float32,
    _float16_to_float32_without_f16c,
    _float32_to_float16,
    _float32_to_float16_without_f16c,
    _half_formats,
    _target_has,
    bfloat16_high,
    bfloat16_low,
    bfloat16_pair,
    bfloat16_pair_vector_code,
    bfloat16_vector_code,
    float16_integer_code,
    has_avx,
    has_avx512,
    has_bfloat16_instructions,
    has_f16c,
    narrow_like,
    pair_constants,
    widen,
)


@njit
def _widen_all(stored, out):
    for i in range(stored.size):
        out[i] = widen(stored[i])


@njit
def _narrow_all(values, out):
    for i in range(values.size):
        out[i] = narrow_like(values[i], out)


ALL_PATTERNS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


@pytest.mark.parametrize(
    ("fmt", "storage"),
    [(np.dtype(np.float16), FLOAT16_STORAGE), (BFLOAT16, BFLOAT16_STORAGE)],
    ids=["float16", "bfloat16"],
)
def test_widening_every_pattern(fmt, storage):
    values = ALL_PATTERNS.view(fmt)
    got = np.empty(values.size, np.float32)
    _widen_all(values.view(storage), got)
    np.testing.assert_array_equal(bits(got), bits(values.astype(np.float32)))


def _quiet(bits):
    """float32 bit patterns with every signaling NaN made quiet, as arithmetic would."""
    bits = np.asarray(bits, np.uint32).copy()
    signaling = ((bits & 0x7F800000) == 0x7F800000) & ((bits & 0x007FFFFF) != 0)
    bits[signaling] |= 0x00400000
    return bits


def _interesting_float32(rng):
    special = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            -np.nan,
            65504.0,
            65519.99,
            65520.0,
            6e-8,
            3e-8,
            2.9802322e-08,
            1e-45,
            3.4028235e38,
            -3.4028235e38,
            1.0 + 2**-8,
            1.0 + 3 * 2**-8,
        ],
        np.float32,
    )
    random_bits = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    # Halfway cases: exactly between two neighbouring bfloat16 / float16 values.
    halfway = (rng.integers(0, 2**16, size=4096, dtype=np.uint32) << 16) | 0x8000
    halfway16 = (rng.integers(0x3000, 0x4C00, size=4096, dtype=np.uint32) << 13) | 0x1000
    return np.concatenate(
        [
            special,
            _quiet(random_bits).view(np.float32),
            _quiet(halfway).view(np.float32),
            halfway16.astype(np.uint32).view(np.float32),
            rng.standard_normal(1 << 16).astype(np.float32),
        ]
    )


@pytest.mark.parametrize(
    ("fmt", "storage"),
    [(np.dtype(np.float16), FLOAT16_STORAGE), (BFLOAT16, BFLOAT16_STORAGE)],
    ids=["float16", "bfloat16"],
)
def test_narrowing_rounds_to_nearest_even(rng, fmt, storage):
    values = _interesting_float32(rng)
    got = np.empty(values.size, storage)
    _narrow_all(values, got)
    with np.errstate(all="ignore"):
        want = values.astype(fmt)
    np.testing.assert_array_equal(bits(got.view(fmt)), bits(want))
    # NaN stays NaN (payloads are not promised).
    assert np.array_equal(np.isnan(got.view(fmt).astype(np.float32)), np.isnan(values))


QUIET_NANS = [0x7FC00000, 0x7FC00001, 0x7FC08000, 0x7FFF8000, 0x7FFFFFFF]
QUIET_NANS += [pattern | 0x80000000 for pattern in QUIET_NANS]


def test_bfloat16_nan_is_canonical_quiet_nan_of_its_sign():
    # Payloads whose rounding would carry into the exponent or the sign included.
    values = np.array(QUIET_NANS, np.uint32).view(np.float32)
    got = np.empty(values.size, BFLOAT16_STORAGE)
    _narrow_all(values, got)
    np.testing.assert_array_equal(got.view(np.uint16), [0x7FC0] * 5 + [0xFFC0] * 5)


def test_quiet_is_what_arithmetic_does():
    # The premise of the narrowing: arithmetic quiets a signaling NaN as _quiet does
    # (here NumPy's float32 multiply; the kernels' loops are compiled the same way).
    signaling = np.array([0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FA00000], np.uint32)
    with np.errstate(invalid="ignore"):
        product = signaling.view(np.float32) * np.float32(1.5)
    assert np.isnan(product).all()
    np.testing.assert_array_equal(product.view(np.uint32) & 0x7FC00000, 0x7FC00000)
    np.testing.assert_array_equal(_quiet(signaling) & 0x7FC00000, 0x7FC00000)


@njit
def _split_words(words, low, high):
    for i in range(words.size):
        low[i] = bfloat16_low(words[i])
        high[i] = bfloat16_high(words[i])


@njit
def _join_words(low, high, words):
    for i in range(words.size):
        words[i] = bfloat16_pair(low[i], high[i])


def test_bfloat16_words_widen_every_pattern():
    # Each half of a word takes all 65,536 patterns, against the other half's.
    patterns = ALL_PATTERNS.astype(np.uint32)
    words = patterns | (patterns[::-1] << 16)
    low = np.empty(words.size, np.float32)
    high = np.empty(words.size, np.float32)
    _split_words(words, low, high)
    pairs = words.view(np.uint16).reshape(-1, 2).view(BFLOAT16)
    np.testing.assert_array_equal(bits(low), bits(pairs[:, 0].astype(np.float32)))
    np.testing.assert_array_equal(bits(high), bits(pairs[:, 1].astype(np.float32)))


def test_bfloat16_words_round_like_one_element(rng):
    # Two values into one word: each rounded as narrow_like rounds it, low one first.
    values = np.concatenate(
        [_interesting_float32(rng), np.array(QUIET_NANS, np.uint32).view(np.float32)]
    )
    low, high = values, rng.permutation(values)
    words = np.empty(values.size, np.uint32)
    _join_words(low, high, words)
    with np.errstate(all="ignore"):
        want = np.stack([low.astype(BFLOAT16), high.astype(BFLOAT16)], axis=1)
    got = words.view(np.uint16).reshape(-1, 2).view(BFLOAT16)
    np.testing.assert_array_equal(bits(got), bits(want))
    # NaNs (which bits() does not tell apart): the canonical quiet NaN of their sign.
    for column, source in enumerate((low, high)):
        nan = np.isnan(source)
        assert nan.sum() > 10
        stored = got.view(np.uint16)[:, column][nan]
        sign = (source[nan].view(np.uint32) >> 31).astype(np.uint16)
        np.testing.assert_array_equal(stored, 0x7FC0 | (sign << 15))


def _vector_joiner(lanes, instructions):
    """A function that joins ``low`` and ``high`` into ``words`` ``lanes`` at a time with
    :func:`bfloat16_pair_vector_code`, as the kernels' word loops do."""
    vector = ir.VectorType(ir.FloatType(), lanes)
    word_vector = ir.VectorType(ir.IntType(32), lanes)

    @intrinsic
    def join(typingctx, low, high, words, start):
        def codegen(context, builder, signature, args):
            def pointer(index, vector_type):
                array = context.make_array(signature.args[index])(context, builder, args[index])
                element = builder.gep(array.data, [args[3]])
                return builder.bitcast(element, vector_type.as_pointer())

            first = builder.load(pointer(0, vector), align=4)
            second = builder.load(pointer(1, vector), align=4)
            # The kernels' constants for this target (pair_constants).
            constants = pair_constants(builder, lanes, has_avx512(context))
            joined = bfloat16_pair_vector_code(builder, first, second, instructions, constants)
            builder.store(joined, pointer(2, word_vector), align=4)
            return context.get_dummy_value()

        return types.none(low, high, words, start), codegen

    @njit
    def run(low, high, words):
        for start in range(0, low.size - lanes + 1, lanes):
            join(low, high, words, start)

    return run


_HOST_HAS_BFLOAT16_INSTRUCTIONS = has_bfloat16_instructions(cpu_target.target_context)

#: With and without AVX512_BF16's conversions (with: where this CPU has them).
WITH_AND_WITHOUT_BFLOAT16_INSTRUCTIONS = pytest.mark.parametrize(
    "instructions",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not _HOST_HAS_BFLOAT16_INSTRUCTIONS, reason="this CPU has no AVX512_BF16"
            ),
        ),
    ],
    ids=["integers", "avx512-bf16"],
)


def _ordinary_and_rare(rng):
    """Interesting float32 values and quiet NaNs: all of them, those that are neither
    NaN nor subnormal, and the others (shuffled), which AVX512_BF16's conversion leaves
    to the integer code."""
    values = np.concatenate(
        [_interesting_float32(rng), np.array(QUIET_NANS, np.uint32).view(np.float32)]
    )
    magnitude = values.view(np.uint32) & 0x7FFFFFFF
    special = np.isnan(values) | ((magnitude > 0) & (magnitude < 0x00800000))
    return values, values[~special], rng.permutation(values[special])


@pytest.mark.parametrize("lanes", [16, 8])
@WITH_AND_WITHOUT_BFLOAT16_INSTRUCTIONS
def test_bfloat16_vector_words_round_like_one_element(rng, lanes, instructions):
    # The word loops' vectors of pairs, with AVX512_BF16's conversion where the CPU has
    # it: vectors of normal numbers, zeros and infinities take it; a vector with one NaN
    # or subnormal lane (anywhere, in either half) the integer code. Without it, the
    # integer code leaves its NaN handling to vectors with a NaN lane. Every path gives
    # the oracle's bits, ties, overflow to infinity and NaN included.
    values, ordinary, rare = _ordinary_and_rare(rng)
    assert rare.size > 1000 and ordinary.size > 100000
    vectors = ordinary.size // lanes
    with_one_special = ordinary[: vectors * lanes].reshape(vectors, lanes).copy()
    with_one_special[np.arange(vectors), np.arange(vectors) % lanes] = np.resize(rare, vectors)
    cases = {
        "mixed": (values, rng.permutation(values)),
        "ordinary": (ordinary, rng.permutation(ordinary)),
        "one special lane in the first half": (with_one_special.ravel(), ordinary[::-1]),
        "one special lane in the second half": (ordinary[::-1], with_one_special.ravel()),
    }
    run = _vector_joiner(lanes, instructions)
    for case, (low, high) in cases.items():
        size = min(low.size, high.size) // lanes * lanes
        low, high = np.ascontiguousarray(low[:size]), np.ascontiguousarray(high[:size])
        words = np.empty(size, np.uint32)
        run(low, high, words)
        with np.errstate(all="ignore"):
            want = np.stack([low.astype(BFLOAT16), high.astype(BFLOAT16)], axis=1)
        got = words.view(np.uint16).reshape(-1, 2)
        np.testing.assert_array_equal(bits(got.view(BFLOAT16)), bits(want), err_msg=case)
        for column, source in enumerate((low, high)):
            nan = np.isnan(source)
            sign = (source[nan].view(np.uint32) >> 31).astype(np.uint16)
            np.testing.assert_array_equal(got[:, column][nan], 0x7FC0 | (sign << 15), case)
    asm = run.inspect_asm(run.signatures[0])
    assert ("vcvtne2ps2bf16" in asm) == instructions


def _converter(convert, source, target, lanes):
    """A function that converts ``values`` (``source`` elements) into ``out`` (``target``
    elements) ``lanes`` at a time (1: scalars) with ``convert(context, builder,
    value)``, the LLVM code under test."""
    source_ir, target_ir = (cpu_target.target_context.get_value_type(t) for t in (source, target))
    if lanes > 1:
        source_ir, target_ir = ir.VectorType(source_ir, lanes), ir.VectorType(target_ir, lanes)

    @intrinsic
    def step(typingctx, values, out, start):
        def codegen(context, builder, signature, args):
            def pointer(index, element):
                array = context.make_array(signature.args[index])(context, builder, args[index])
                return builder.bitcast(builder.gep(array.data, [args[2]]), element.as_pointer())

            # (aligned as the elements: a vector's own alignment would be assumed)
            loaded = builder.load(pointer(0, source_ir), align=source.bitwidth // 8)
            stored = builder.store(convert(context, builder, loaded), pointer(1, target_ir))
            stored.align = target.bitwidth // 8
            return context.get_dummy_value()

        return types.none(values, out, start), codegen

    @njit
    def run(values, out):
        for start in range(0, values.size - lanes + 1, lanes):
            step(values, out, start)

    return run


def _narrower(lanes, convert):
    """A function that narrows float32 ``values`` into float16 storage ``lanes`` at a
    time with ``convert(context, builder, vector)``, the LLVM code under test."""
    return _converter(convert, types.float32, types.uint16, lanes)


def _float16_integer_narrower(lanes):
    """:func:`_narrower` by :func:`float16_integer_code` (the streaming stores'
    conversion on AVX512-FP16 targets)."""
    return _narrower(lanes, lambda context, builder, vector: float16_integer_code(builder, vector))


@pytest.mark.parametrize("lanes", [8, 16, 32])
def test_float16_integer_conversion_rounds_like_numpy(rng, lanes):
    # The F16C / AVX-512 intrinsics behind float16's non-temporal stores on AVX512-FP16
    # targets: round to nearest even (MXCSR's mode, never changed by the package), as
    # NumPy's float16 cast; 32 lanes as two conversions joined, in order. Runs where
    # the host has the instructions (F16C for 8 lanes, AVX-512F for 16 and 32).
    needed, named = (("+f16c",), F16C_CPUS) if lanes == 8 else (("+avx512f",), AVX512_CPUS)
    if not _target_has(cpu_target.target_context, needed, named):
        pytest.skip(f"this CPU has no {needed[0][1:]}")
    values = _interesting_float32(rng)
    values = values[: values.size // lanes * lanes]
    got = np.empty(values.size, FLOAT16_STORAGE)
    _float16_integer_narrower(lanes)(values, got)
    with np.errstate(all="ignore"):
        want = values.astype(np.float16)
    np.testing.assert_array_equal(bits(got.view(np.float16)), bits(want))
    assert np.array_equal(np.isnan(got.view(np.float16)), np.isnan(values))


@pytest.mark.parametrize("lanes", [8, 16, 32])
@WITH_AND_WITHOUT_BFLOAT16_INSTRUCTIONS
def test_bfloat16_element_vectors_round_like_one_element(rng, lanes, instructions):
    # The element rows' vectors (bfloat16 with float32 caches), with AVX512_BF16's
    # conversion where the CPU has it: vectors of normal numbers, zeros and infinities
    # take it; a vector with one NaN or subnormal lane, anywhere (either 16-lane half
    # of 32 lanes), the integer code. Every path gives the oracle's bits, ties,
    # overflow to infinity and the canonical quiet NaN of each sign included.
    values, ordinary, rare = _ordinary_and_rare(rng)
    vectors = ordinary.size // lanes
    with_one_special = ordinary[: vectors * lanes].reshape(vectors, lanes).copy()
    with_one_special[np.arange(vectors), rng.integers(0, lanes, vectors)] = np.resize(rare, vectors)
    run = _narrower(
        lanes, lambda context, builder, vector: bfloat16_vector_code(builder, vector, instructions)
    )
    cases = {
        "mixed": rng.permutation(values),
        "ordinary": ordinary,
        "one special lane": with_one_special.ravel(),
    }
    for case, source in cases.items():
        source = np.ascontiguousarray(source[: source.size // lanes * lanes])
        got = np.empty(source.size, BFLOAT16_STORAGE)
        run(source, got)
        with np.errstate(all="ignore"):
            want = source.astype(BFLOAT16)
        np.testing.assert_array_equal(bits(got.view(BFLOAT16)), bits(want), err_msg=case)
        nan = np.isnan(source)
        sign = (source[nan].view(np.uint32) >> 31).astype(np.uint16)
        np.testing.assert_array_equal(got.view(np.uint16)[nan], 0x7FC0 | (sign << 15), case)
    asm = run.inspect_asm(run.signatures[0])
    converts = "vcvtne2ps2bf16" if lanes == 32 else "vcvtneps2bf16"
    assert (converts in asm) == instructions
    assert ("vfpclassps" in asm) == instructions


def _stream_narrower(lanes):
    """:func:`_narrower` as the kernels' vector steps narrow for an ordinary store
    (:meth:`numba_rope._cpu.vector._Stream.narrow`: into registers, on F16C targets)."""
    from numba_rope._cpu.vector import _Stream

    return _narrower(
        lanes,
        lambda context, builder, vector: _Stream(context, builder).narrow(
            vector, types.uint16, False
        ),
    )


@pytest.mark.parametrize("lanes", [4, 8, 16, 32, 64, 12])
def test_float16_narrowed_in_registers_rounds_like_numpy(rng, lanes):
    # Every width compiles (a vector wider than a register is kept in registers a
    # register's worth at a time: as one operand LLVM aborted; narrower than 128 bits
    # or of lanes not a power of two, it is left to LLVM) and rounds to nearest even.
    values = _interesting_float32(rng)
    values = values[: values.size // lanes * lanes]
    got = np.empty(values.size, FLOAT16_STORAGE)
    run = _stream_narrower(lanes)
    run(values, got)
    with np.errstate(all="ignore"):
        want = values.astype(np.float16)
    np.testing.assert_array_equal(bits(got.view(np.float16)), bits(want))
    assert np.array_equal(np.isnan(got.view(np.float16)), np.isnan(values))
    # On this host with F16C (and without AVX512-FP16), the statement is there: for
    # powers of two from 8 lanes, and for 4 lanes, converted as 8 (``_Stream.narrow``).
    kept = has_f16c(cpu_target.target_context) and not _target_has(
        cpu_target.target_context, ("+avx512fp16",), ()
    )
    ir_text = run.inspect_llvm(run.signatures[0])
    assert ('asm sideeffect "", "=v,0"' in ir_text or 'asm "", "=v,0"' in ir_text) == (
        kept and lanes in (4, 8, 16, 32, 64)
    )


class _Codegen:
    def __init__(self, features, name):
        self._tm_features, self._name = features, name

    def _get_host_cpu_name(self):
        return self._name


class _Context:
    """A stand-in for numba's target context: the features numba compiles for
    (``NUMBA_CPU_FEATURES`` or the host's), else a CPU ``name`` alone."""

    def __init__(self, features, name=""):
        self._codegen = _Codegen(features, name)

    def codegen(self):
        return self._codegen


def test_bfloat16_instructions_follow_the_target():
    # Named by its features (the host, or NUMBA_CPU_FEATURES), else by its CPU name.
    assert has_bfloat16_instructions(_Context("+avx512f,+avx512bf16,+avx512dq,+avx512vl"))
    assert not has_bfloat16_instructions(_Context("+avx512f,-avx512bf16,+avx512dq,+avx512vl"))
    assert not has_bfloat16_instructions(_Context("+avx512f,+avx512bf16,-avx512dq,+avx512vl"))
    assert not has_bfloat16_instructions(_Context("+avx2,+f16c", "znver4"))
    assert has_bfloat16_instructions(_Context("", "znver4"))
    assert has_bfloat16_instructions(_Context("", "sapphirerapids"))
    assert not has_bfloat16_instructions(_Context("", "skylake-avx512"))
    assert not has_bfloat16_instructions(_Context("", "haswell"))


def test_avx512_follows_the_target():
    # As test_bfloat16_instructions_follow_the_target: AVX512F and AVX512VL.
    assert has_avx512(_Context("+avx512f,+avx512vl,+avx512bw"))
    assert not has_avx512(_Context("+avx512f,-avx512vl"))
    assert not has_avx512(_Context("+avx2,+f16c", "skylake-avx512"))
    for name in ("skylake-avx512", "icelake-server", "znver4", "sapphirerapids", "x86-64-v4"):
        assert has_avx512(_Context("", name)), name
    for name in ("haswell", "znver3", "x86-64-v3"):
        assert not has_avx512(_Context("", name)), name


def test_f16c_follows_the_target():
    # As test_bfloat16_instructions_follow_the_target: F16C.
    assert has_f16c(_Context("+avx,+avx2,+f16c"))
    assert has_f16c(_Context("+avx512f,+avx512vl,+f16c"))
    assert not has_f16c(_Context("+avx,-f16c"))
    for name in ("haswell", "znver3", "skylake-avx512", "znver4", "sapphirerapids"):
        assert has_f16c(_Context("", name)), name
    for name in ("ivybridge", "btver2", "x86-64-v3", "x86-64-v4"):
        assert has_f16c(_Context("", name)), name
    for name in ("x86-64", "x86-64-v2", "generic", "sandybridge", "nehalem", "goldmont"):
        assert not has_f16c(_Context("", name)), name


def test_avx_follows_the_target():
    # As test_bfloat16_instructions_follow_the_target: AVX (the vector register width
    # of the kernels' inline assembly, numba_rope._cpu.vector._Stream.in_registers).
    assert has_avx(_Context("+sse2,+avx,-avx2"))
    assert not has_avx(_Context("+sse2,+sse4.2,-avx"))
    for name in ("sandybridge", "ivybridge", "haswell", "znver3", "znver4", "x86-64-v3"):
        assert has_avx(_Context("", name)), name
    for name in ("x86-64", "x86-64-v2", "generic", "nehalem", "goldmont"):
        assert not has_avx(_Context("", name)), name


def test_float_storage_passes_through():
    values = np.array([1.5, np.pi], np.float64)
    out64 = np.empty(2, np.float64)
    _widen_all(values, out64)
    np.testing.assert_array_equal(out64, values)
    out32 = np.empty(2, np.float32)
    _narrow_all(values, out32)
    np.testing.assert_array_equal(out32, values.astype(np.float32))


def _without_context(code):
    """``code(builder, value)`` as :func:`_converter` calls it."""
    return lambda context, builder, value: code(builder, value)


def _float16_widened(patterns):
    """float16 bit patterns widened to float32 bit patterns, as F16C's ``vcvtph2ps``
    does, written from the formats' definitions: exact, a NaN quieted (its payload
    kept)."""
    h = patterns.astype(np.int64)
    sign, exponent, fraction = (h >> 15) << 31, (h >> 10) & 0x1F, h & 0x3FF
    with np.errstate(all="ignore"):
        magnitude = np.ldexp(fraction.astype(np.float64), -24)  # subnormal
        magnitude = np.where(exponent > 0, np.ldexp(1 + fraction / 1024, exponent - 15), magnitude)
    wide = magnitude.astype(np.float32).view(np.uint32)
    special = exponent == 0x1F
    wide = np.where(special, 0x7F800000 | (fraction << 13), wide)
    wide = np.where(special & (fraction != 0), wide | 0x00400000, wide)
    return (wide | sign).astype(np.uint32)


def _float16_nans(values):
    """float32 NaNs narrowed to float16 as F16C's ``vcvtps2ph`` does: quiet, of the same
    sign, the payload's upper ten bits kept."""
    b = values.view(np.uint32)
    return ((b >> 16) & 0x8000 | 0x7E00 | (b >> 13) & 0x3FF).astype(np.uint16)


@pytest.mark.parametrize("lanes", [1, 8, 16])
def test_float16_without_f16c_widens_every_pattern(lanes):
    # CPUs without F16C (x86-64 before Ivy Bridge or Piledriver, Atoms and Pentiums
    # without AVX, QEMU's default virtual CPU, NUMBA_CPU_NAME=generic) widen float16 by
    # integer code, where LLVM's fpext called a function numba cannot link (the process
    # aborted): every pattern against the formats' definitions, signaling NaNs
    # quieted; and, where this CPU has F16C, against its instruction, bit for bit.
    patterns = ALL_PATTERNS.copy()
    got = np.empty(patterns.size, np.float32)
    _converter(
        _without_context(_float16_to_float32_without_f16c), types.uint16, types.float32, lanes
    )(patterns, got)
    np.testing.assert_array_equal(got.view(np.uint32), _float16_widened(patterns))
    if has_f16c(cpu_target.target_context):
        hardware = np.empty(patterns.size, np.float32)
        _widen_all(patterns, hardware)
        np.testing.assert_array_equal(got.view(np.uint32), hardware.view(np.uint32))


@pytest.mark.parametrize("lanes", [1, 8, 16])
def test_float16_without_f16c_rounds_like_numpy(rng, lanes):
    # Narrowing by integer code (see test_float16_without_f16c_widens_every_pattern):
    # to nearest even, ties, float16's subnormals and overflow to infinity included,
    # as NumPy's cast; NaNs (signaling ones included: F16C quiets them) as F16C
    # narrows them; and, where this CPU has F16C, as its instruction, bit for bit.
    boundaries = np.array([0x38800000, 0x33000000, 0x477FE000, 0x477FF000, 0x47800000])
    near = (boundaries[:, None] + np.arange(-4096, 4096)).ravel().astype(np.uint32)
    signaling = np.array([0x7F800001, 0xFF800001, 0x7FA00000, 0x7F801FFF], np.uint32)
    values = np.concatenate(
        [_interesting_float32(rng), near.view(np.float32), signaling.view(np.float32)]
    )
    values = values[: values.size // lanes * lanes]
    got = np.empty(values.size, np.uint16)
    _narrower(lanes, _without_context(_float32_to_float16_without_f16c))(values, got)
    nan = np.isnan(values)
    with np.errstate(all="ignore"):
        want = values.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    np.testing.assert_array_equal(got[nan], _float16_nans(values[nan]))
    if has_f16c(cpu_target.target_context):
        hardware = np.empty(values.size, np.uint16)
        _narrower(lanes, _without_context(_float32_to_float16))(values, hardware)
        np.testing.assert_array_equal(got, hardware)


def test_float16_code_follows_the_target(monkeypatch):
    # fpext / fptrunc of LLVM's half on x86 targets with F16C and on 64-bit Arm (fcvt);
    # the integer code on x86 without F16C and on other machines.
    cases = [
        (True, False, _Context("+avx,+f16c"), True),
        (True, False, _Context("+sse2,-f16c"), False),
        (True, False, _Context("", "x86-64"), False),
        (True, False, _Context("", "haswell"), True),
        (False, True, _Context("+neon,+fp-armv8"), True),
        (False, False, _Context("+altivec"), False),
    ]
    for x86, arm64, context, hardware in cases:
        monkeypatch.setattr(conversions, "X86", x86)
        monkeypatch.setattr(conversions, "ARM64", arm64)
        widening, narrowing = _half_formats(context)[types.uint16]
        assert (widening is _float16_to_float32) == hardware
        assert (narrowing is _float32_to_float16) == hardware
        assert (widening is _float16_to_float32_without_f16c) != hardware
        assert (narrowing is _float32_to_float16_without_f16c) != hardware
        assert _half_formats(context)[types.int16] == _HALF_FORMATS[types.int16]
