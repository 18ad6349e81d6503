"""Oracles for the rope_cache tests: each scaling scheme's inverse frequencies, one
frequency at a time, and cos/sin of each angle, one position at a time. None of them
calls numba_rope.

The frequency formulas follow Hugging Face transformers' RoPE initialisers
(``transformers/modeling_rope_utils.py``), in the same order of float64 operations as
the module docstring gives them. Their transcendental functions (``pow``, ``log``,
``cos``, ``sin``) are evaluated here in decimal arithmetic with 45 significant digits,
not with ``math``: libm's last bit depends on the platform and on the CPU (glibc picks
FMA or SSE2 variants at run time), NumPy's on its SIMD dispatch, while Python's
``decimal`` is software arithmetic, the same on every machine. So the oracle gives the
exact value of each formula step to about 40 digits, everywhere.
"""

from __future__ import annotations

import decimal
import functools
import math
from decimal import Decimal

import numpy as np
from oracles import DTYPES

import numba_rope

EPS64 = 2.0**-52
DTYPE_IDS = [d.name for d in DTYPES]
DIGITS = 45

# ---------------------------------------------------------------- decimal primitives


def _context(extra_digits: int = 0) -> decimal.Context:
    return decimal.Context(prec=DIGITS + extra_digits, rounding=decimal.ROUND_HALF_EVEN)


@functools.cache
def _pi(digits: int) -> Decimal:
    """pi to ``digits`` digits, by the Gauss-Legendre (AGM) iteration."""
    with decimal.localcontext(decimal.Context(prec=digits + 10)):
        a, b, t, p = Decimal(1), Decimal(1) / Decimal(2).sqrt(), Decimal(1) / 4, Decimal(1)
        for _ in range(int(math.log2(digits)) + 3):
            a, b, t, p = (a + b) / 2, (a * b).sqrt(), t - p * ((a - b) / 2) ** 2, 2 * p
        return +((a + b) ** 2 / (4 * t))


def exact_pow(base: float, exponent: float) -> float:
    """``base ** exponent`` correctly rounded to float64 (from 45 digits)."""
    with decimal.localcontext(_context()):
        return float(Decimal(base) ** Decimal(exponent))


def exact_log(x: float) -> float:
    """``ln(x)`` correctly rounded to float64 (from 45 digits)."""
    with decimal.localcontext(_context()):
        return float(Decimal(x).ln())


@functools.cache
def exact_cos_sin(angle: float) -> tuple[Decimal, Decimal]:
    """cos and sin of the float64 ``angle``, to 45 digits: reduced modulo 2*pi with pi
    to as many more digits as the angle has before its decimal point, then Taylor."""
    x = Decimal(angle)
    integer_digits = max(0, x.adjusted() + 1)
    with decimal.localcontext(_context(integer_digits + 5)):
        two_pi = 2 * _pi(DIGITS + integer_digits + 10)
        x -= (x / two_pi).to_integral_value(rounding=decimal.ROUND_FLOOR) * two_pi
    with decimal.localcontext(_context(5)):  # |x| < 7: the terms stay below 7**7/7! ~ 163
        cos, sin, term, n = Decimal(0), Decimal(0), Decimal(1), 0
        smallest = Decimal(10) ** -(DIGITS + 5)
        while n < 20 or abs(term) > smallest:
            if n % 2:
                sin += term if n % 4 == 1 else -term
            else:
                cos += term if n % 4 == 0 else -term
            n += 1
            term = term * x / n
        return +cos, +sin


# ------------------------------------------------------------- frequency formulas


def default_frequencies(rotary_dim, base):
    return [1.0 / exact_pow(base, (2 * i) / rotary_dim) for i in range(rotary_dim // 2)]


def linear_frequencies(rotary_dim, base, factor):
    return [frequency / factor for frequency in default_frequencies(rotary_dim, base)]


def dynamic_frequencies(rotary_dim, base, factor, original, seq_len):
    if seq_len > original:
        stretch = factor * seq_len / original - (factor - 1)
        base = base * exact_pow(stretch, rotary_dim / (rotary_dim - 2))
    return default_frequencies(rotary_dim, base)


def yarn_dimension(rotary_dim, base, original, rotations):
    return rotary_dim * exact_log(original / (rotations * 2 * math.pi)) / (2 * exact_log(base))


def yarn_range(rotary_dim, base, original, beta_fast, beta_slow, truncate=True):
    low = yarn_dimension(rotary_dim, base, original, beta_fast)
    high = yarn_dimension(rotary_dim, base, original, beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rotary_dim - 1)


def yarn_frequencies(rotary_dim, base, factor, original, beta_fast=32, beta_slow=1, truncate=True):
    low, high = yarn_range(rotary_dim, base, original, beta_fast, beta_slow, truncate)
    if low == high:
        high += 0.001
    frequencies = []
    for i in range(rotary_dim // 2):
        theta = exact_pow(base, (2 * i) / rotary_dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        keep = 1 - ramp  # weight of the extrapolated (unscaled) frequency
        frequencies.append(1.0 / (factor * theta) * (1 - keep) + 1.0 / theta * keep)
    return frequencies


def yarn_attention(factor, attention_factor=None, mscale=None, mscale_all_dim=None):
    if attention_factor is not None:
        return attention_factor

    def m(scale, coefficient=1.0):
        return 1.0 if scale <= 1 else 0.1 * coefficient * exact_log(scale) + 1.0

    if mscale and mscale_all_dim:
        return m(factor, mscale) / m(factor, mscale_all_dim)
    return m(factor)


def llama3_frequencies(rotary_dim, base, factor, low_freq_factor, high_freq_factor, original):
    frequencies = []
    for frequency in default_frequencies(rotary_dim, base):
        wavelength = 2 * math.pi / frequency
        if wavelength < original / high_freq_factor:
            frequencies.append(frequency)
        elif wavelength > original / low_freq_factor:
            frequencies.append(frequency / factor)
        else:
            s = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
            frequencies.append((1 - s) * frequency / factor + s * frequency)
    return frequencies


# ------------------------------------------------------------------------ caches


class OracleCaches:
    """float64 ``a*cos`` and ``a*sin`` of each angle ``p * frequency`` (a float64
    product, as in the caches): ``cos``/``sin`` hold cos and sin correctly rounded to
    float64, then multiplied by ``a`` in float64 (the caches' one operation after
    them); ``cos_margin``/``sin_margin`` how far, in ulps, the exact cos/sin lies from
    the midpoint between two doubles (0.5 when it is a double); ``angles`` the angles."""

    def __init__(self, frequencies, max_position, attention_factor=1.0):
        shape = (max_position, len(frequencies))
        self.angles = np.empty(shape)
        self.cos, self.sin = np.empty(shape), np.empty(shape)
        self.cos_margin, self.sin_margin = np.empty(shape), np.empty(shape)
        for p in range(max_position):
            for i, frequency in enumerate(frequencies):
                angle = p * frequency
                self.angles[p, i] = angle
                for value, rounded, margin in zip(
                    exact_cos_sin(angle),
                    (self.cos, self.sin),
                    (self.cos_margin, self.sin_margin),
                    strict=True,
                ):
                    nearest = float(value)
                    with decimal.localcontext(_context()):
                        error = abs(value - Decimal(nearest)) / Decimal(math.ulp(nearest))
                    rounded[p, i] = nearest * attention_factor
                    margin[p, i] = 0.5 - float(error)

    # The former (cos, sin, angles) triple.
    def __iter__(self):
        return iter((self.cos, self.sin, self.angles))


def oracle_caches(frequencies, max_position, attention_factor=1.0):
    return OracleCaches(frequencies, max_position, attention_factor)


SIGNIFICAND_BITS = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}
MIN_EXPONENT = {"float16": -13, "bfloat16": -125, "float32": -125, "float64": -1021}  # frexp's


def round_once(values, dtype):
    """float64 values rounded to nearest even on the grid of ``dtype`` (subnormals
    included), then stored in ``dtype`` (exactly)."""
    name = np.dtype(dtype).name
    _, exponent = np.frexp(values)
    quantum = np.ldexp(1.0, np.maximum(exponent, MIN_EXPONENT[name]) - SIGNIFICAND_BITS[name])
    return (np.rint(values / quantum) * quantum).astype(dtype)


def one_ulp(values, dtype):
    name = np.dtype(dtype).name
    _, exponent = np.frexp(np.abs(values.astype(np.float64)))
    return np.ldexp(1.0, np.maximum(exponent, MIN_EXPONENT[name]) - SIGNIFICAND_BITS[name])


#: rope_cache's float64 cos/sin lie within 0.5 + KERNEL_EXCESS ulp of the exact values
#: (numba_rope/_sincos.py: a double-double evaluation with relative error about 2**-67,
#: rounded once; measured on 400 000 values, the largest error was 0.4999998 ulp). It
#: is a property of float64 + - * / alone, so it holds on every CPU.
KERNEL_EXCESS = 2.0**-13


def assert_matches_oracle(scaling, max_position, rotary_dim, base, oracle):
    """float64 caches: the correctly rounded cos and sin of the same angles, times the
    attention factor; every dtype: that value rounded once."""
    want_cos, want_sin, angles = oracle
    got_cos, got_sin = numba_rope.rope_cache(
        max_position, rotary_dim, base=base, scaling=scaling, dtype=np.float64
    )
    # The former bound, kept: within a few float64 ulps of the oracle.
    scale = np.abs(want_cos).max(initial=1.0)
    tolerance = 8 * EPS64 * (1 + np.abs(angles)) * scale
    assert np.all(np.abs(got_cos - want_cos) <= tolerance)
    assert np.all(np.abs(got_sin - want_sin) <= tolerance)
    # Bit for bit, except where the exact value lies within KERNEL_EXCESS ulp of a
    # midpoint: there the kernel may round either way (one ulp, times the factor).
    for got, want, margin in (
        (got_cos, want_cos, oracle.cos_margin),
        (got_sin, want_sin, oracle.sin_margin),
    ):
        close_call = margin <= KERNEL_EXCESS
        assert np.array_equal(got[~close_call], want[~close_call])
        assert np.all(np.abs(got - want)[close_call] <= 2 * one_ulp(want[close_call], np.float64))
    for dtype in DTYPES:
        cos, sin = numba_rope.rope_cache(
            max_position, rotary_dim, base=base, scaling=scaling, dtype=dtype
        )
        for got, want, exact in ((cos, want_cos, got_cos), (sin, want_sin, got_sin)):
            expected = round_once(want, dtype).astype(np.float64)
            difference = np.abs(got.astype(np.float64) - expected)
            assert np.all(difference <= one_ulp(expected, dtype)), dtype
            # Where the float64 cache is the oracle's value, its rounding is too.
            same = exact == want
            assert np.array_equal(got.astype(np.float64)[same], expected[same]), dtype


# ------------------------------------------------------------------ shared schemes

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

SCHEMES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 50},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 50},
    "llama3": {**LLAMA3, "original_max_position_embeddings": 50},
}
