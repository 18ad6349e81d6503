"""float64 cos and sin of the cache angles, and the few scalar transcendentals of the
frequency formulas, computed the same way, to the same bits, on every machine.

NumPy's float64 ``sin``/``cos``/``power`` and Python's ``math`` call the platform's libm
or NumPy's SIMD code, chosen at run time by CPU (``np.power`` takes SVML's code on
AVX-512 machines, glibc has FMA and non-FMA variants, macOS and Windows have their own
libm): last-bit differences between machines are allowed by all of them. Here:

* the cos/sin kernel uses only float64 ``+ - * /`` (correctly rounded by IEEE 754 on
  every CPU) in a fixed order; numba compiles it without fast-math, so LLVM neither
  reorders the operations nor fuses them into FMAs. Each result is a double-double
  (about 2**-67 relative error, see :func:`_reduced_cos_sin`) rounded once: within
  0.5 + 2**-13 ulp of the exact value, so correctly rounded unless the exact value lies
  that close to a midpoint;
* angles of 2**26 and more (beyond any realistic cache) are reduced modulo pi/2 in exact
  rational arithmetic, in Python;
* ``pow`` and ``log`` go through the ``decimal`` module (software arithmetic, the same
  everywhere) at 40 digits, then one rounding to float64.

Constants come from pi computed here by Machin's formula in integer arithmetic.
"""

from __future__ import annotations

import decimal
import math

import numpy as np
from numba import prange

from numba_rope._jit import cached_njit, parallel_regions_usable

# ------------------------------------------------------------------ exact constants

_GUARD = 1300  # bits of pi/2 kept: reduces any finite double (up to 2**1024) exactly enough


def _arctan_of_inverse(x: int, one: int) -> int:
    """``atan(1/x) * one`` in fixed point (x > 1), by its Taylor series."""
    total, power, n, x2 = 0, one // x, 1, x * x
    while power:
        term = power // n
        total += term if n % 4 == 1 else -term
        power //= x2
        n += 2
    return total


def _half_pi_fixed() -> int:
    """``floor(pi/2 * 2**_GUARD)``, give or take a few units (Machin's formula)."""
    extra = 64  # the truncation of each series term costs at most one unit
    one = 1 << (_GUARD + extra)
    pi = 16 * _arctan_of_inverse(5, one) - 4 * _arctan_of_inverse(239, one)
    return pi >> (extra + 1)


_HALF_PI = _half_pi_fixed()  # pi/2 = _HALF_PI * 2**-_GUARD


def _half_pi_pieces(count: int, bits: int) -> tuple[float, ...]:
    """pi/2 as a sum of ``count`` doubles of ``bits`` significant bits each (the leading
    bits of pi/2, then the next ones, ...): ``k * piece`` is exact for ``k < 2**(53 - bits)``."""
    length = _HALF_PI.bit_length()
    pieces = []
    for n in range(1, count + 1):
        shift = length - bits * n
        chunk = (_HALF_PI >> shift) & ((1 << bits) - 1)
        pieces.append(math.ldexp(float(chunk), shift - _GUARD))
    return tuple(pieces)


_C1, _C2, _C3, _C4, _C5 = _half_pi_pieces(5, 27)
_TWO_OVER_PI = (1 << _GUARD) / _HALF_PI  # 2/pi; it only picks the quadrant
#: Angles below this are reduced in the kernel (k < 2**26, so k * _C1.._C3 are exact).
_KERNEL_LIMIT = 2.0**26

_TABLE_STEP = 64  # r = j/64 + t, |t| <= 1/128
_TABLE_HALF = 52  # |j| <= round(64 * (pi/4 + tiny)) = 50


def _to_double_double(numerator: int, denominator: int) -> tuple[float, float]:
    """The rational ``numerator/denominator`` as ``hi + lo``, each rounded to nearest."""
    hi = numerator / denominator  # int / int is correctly rounded in Python
    hi_num, hi_den = hi.as_integer_ratio()
    lo = (numerator * hi_den - hi_num * denominator) / (denominator * hi_den)
    return hi, lo


def _sin_cos_table() -> np.ndarray:
    """``[j + 52] -> (sin hi, sin lo, cos hi, cos lo)`` of ``j/64``, by Taylor series in
    fixed point with 200 bits."""
    scale_bits = 200
    one = 1 << scale_bits
    table = np.zeros((2 * _TABLE_HALF + 1, 4))
    for j in range(-_TABLE_HALF, _TABLE_HALF + 1):
        x = (j << scale_bits) // _TABLE_STEP  # exact: 64 is a power of two
        sin_sum, cos_sum, term, n = 0, 0, one, 0  # term = x**n / n!
        while term:
            if n % 2:
                sin_sum += term if n % 4 == 1 else -term
            else:
                cos_sum += term if n % 4 == 0 else -term
            n += 1
            term = term * x // one // n
        table[j + _TABLE_HALF, :2] = _to_double_double(sin_sum, one)
        table[j + _TABLE_HALF, 2:] = _to_double_double(cos_sum, one)
    return table


_TABLE = _sin_cos_table()

# ------------------------------------------------------------- double-double kernel


@cached_njit(inline="always")
def _two_sum(a: float, b: float) -> tuple[float, float]:
    """``a + b == s + e`` exactly (Knuth)."""
    s = a + b
    v = s - a
    return s, (a - (s - v)) + (b - v)


@cached_njit(inline="always")
def _split(a: float) -> tuple[float, float]:
    """``a == hi + lo`` with 26-bit halves (Veltkamp)."""
    t = 134217729.0 * a  # 2**27 + 1
    hi = t - (t - a)
    return hi, a - hi


@cached_njit(inline="always")
def _two_product(a: float, b: float) -> tuple[float, float]:
    """``a * b == p + e`` exactly (Dekker; no FMA, so the same on every CPU)."""
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


@cached_njit(inline="always")
def _reduced_cos_sin(quadrant, rh, rl, table):
    """cos and sin of ``quadrant * pi/2 + (rh + rl)``, ``|rh + rl| <= pi/4 + tiny``.

    ``r = j/64 + t``; ``sin r = S_j cos t + C_j sin t`` and ``cos r = C_j cos t - S_j
    sin t`` with the double-double table ``S_j, C_j`` and Taylor series of ``t``
    (``|t| <= 1/128``). The leading terms (``t`` and ``1 - t*t/2``) are double-doubles
    and the rest is evaluated in float64: its rounding, relative ``2**-53`` of a term at
    most ``t**2/6 <= 2**-16.5`` of the sum, bounds the error near ``2**-67``.
    """
    j = math.floor(rh * 64.0 + 0.5)
    th = rh - j * (1.0 / 64.0)  # exact (Sterbenz: rh is within a factor 2 of j/64)
    th, tl = _two_sum(th, rl)
    z = th * th
    # sin t = th + sin_lo
    sin_lo = tl * (1.0 - 0.5 * z) + th * z * (
        -1.0 / 6.0
        + z * (1.0 / 120.0 + z * (-1.0 / 5040.0 + z * (1.0 / 362880.0 + z * (-1.0 / 39916800.0))))
    )
    # cos t = cos_hi + cos_lo
    zh, zl = _two_product(th, th)
    cos_hi, cos_lo = _two_sum(1.0, -0.5 * zh)
    cos_lo += (
        -0.5 * zl
        - th * tl
        + zh
        * zh
        * (1.0 / 24.0 + zh * (-1.0 / 720.0 + zh * (1.0 / 40320.0 + zh * (-1.0 / 3628800.0))))
    )
    row = int(j) + 52
    s_hi, s_lo, c_hi, c_lo = table[row, 0], table[row, 1], table[row, 2], table[row, 3]
    # sin r = S cos t + C sin t
    p1, e1 = _two_product(s_hi, cos_hi)
    p2, e2 = _two_product(c_hi, th)
    sin_hi, e3 = _two_sum(p1, p2)
    sin_r = sin_hi + (e3 + e1 + e2 + (s_hi * cos_lo + s_lo * cos_hi + c_hi * sin_lo + c_lo * th))
    # cos r = C cos t - S sin t
    p1, e1 = _two_product(c_hi, cos_hi)
    p2, e2 = _two_product(s_hi, th)
    cos_hi2, e3 = _two_sum(p1, -p2)
    cos_r = cos_hi2 + (e3 + e1 - e2 + (c_hi * cos_lo + c_lo * cos_hi - s_hi * sin_lo - s_lo * th))
    if quadrant == 0:
        return cos_r, sin_r
    if quadrant == 1:
        return -sin_r, cos_r
    if quadrant == 2:
        return -cos_r, -sin_r
    return sin_r, -cos_r


@cached_njit(inline="always")
def _reduce(x):
    """``x = k*pi/2 + rh + rl`` for ``0 <= x < 2**26``: ``(k mod 4, rh, rl)``."""
    k = math.floor(x * _TWO_OVER_PI + 0.5)
    h, low = _two_sum(x, -(k * _C1))  # k * _C1, k * _C2, k * _C3 are exact
    h, e = _two_sum(h, -(k * _C2))
    low += e
    h, e = _two_sum(h, -(k * _C3))
    low += e
    low -= k * _C4
    low -= k * _C5
    rh, rl = _two_sum(h, low)
    return int(k) & 3, rh, rl


@cached_njit(inline="always")
def _cos_sin_row(p, frequencies, cos, sin, table):
    """Row ``p``: cos and sin of ``p * frequencies`` (float64 products). Angles the kernel
    does not reduce (``>= 2**26``, or not finite) are left as NaN for the caller."""
    position = float(p)
    for i in range(cos.shape[1]):
        angle = position * frequencies[i]
        negative = angle < 0.0
        x = -angle if negative else angle
        if x < _KERNEL_LIMIT:
            quadrant, rh, rl = _reduce(x)
            c, s = _reduced_cos_sin(quadrant, rh, rl, table)
            cos[p, i] = c
            sin[p, i] = -s if negative else s
        else:
            cos[p, i] = np.nan
            sin[p, i] = np.nan


@cached_njit(parallel=True)
def _cos_sin_kernel(frequencies, cos, sin, table):
    for p in prange(cos.shape[0]):
        _cos_sin_row(p, frequencies, cos, sin, table)


@cached_njit()
def _cos_sin_serial(frequencies, cos, sin, table):
    """:func:`_cos_sin_kernel` on the calling thread (the same bits), for a process that
    may not run parallel regions (see :mod:`numba_rope._jit`)."""
    for p in range(cos.shape[0]):
        _cos_sin_row(p, frequencies, cos, sin, table)


@cached_njit()
def _reduced_kernel(quadrants, his, los, cos, sin, table):
    for n in range(quadrants.size):
        cos[n], sin[n] = _reduced_cos_sin(quadrants[n], his[n], los[n], table)


def _reduce_exactly(x: float) -> tuple[int, float, float]:
    """``x = k*pi/2 + rh + rl`` for any finite ``x >= 0``, in rational arithmetic."""
    numerator, denominator = x.as_integer_ratio()
    # k = round(x / (pi/2)) = round(numerator * 2**G / (denominator * H))
    scaled, divisor = numerator << _GUARD, denominator * _HALF_PI
    k = (2 * scaled + divisor) // (2 * divisor)
    rh, rl = _to_double_double(scaled - k * divisor, denominator << _GUARD)
    return k & 3, rh, rl


def cos_sin(max_position: int, frequencies: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``cos`` and ``sin`` of ``p * frequencies[i]`` (the float64 product) for
    ``p`` in ``[0, max_position)``, each within 0.5 + 2**-13 ulp of the exact value, the
    same bits on every machine."""
    frequencies = np.ascontiguousarray(frequencies, dtype=np.float64)
    cos = np.empty((max_position, frequencies.size))
    sin = np.empty_like(cos)
    if cos.size == 0:
        return cos, sin
    kernel = _cos_sin_kernel if parallel_regions_usable() else _cos_sin_serial
    kernel(frequencies, cos, sin, _TABLE)
    rows, columns = np.nonzero(np.isnan(cos))  # angles the kernel left to us
    if rows.size:
        with np.errstate(over="ignore"):  # an infinite angle gives NaN, as in NumPy
            angles = rows.astype(np.float64) * frequencies[columns]
        finite = np.isfinite(angles)
        reduced = [_reduce_exactly(abs(float(a))) for a in angles[finite]]
        quadrants = np.array([q for q, _, _ in reduced], dtype=np.int64)
        his = np.array([h for _, h, _ in reduced], dtype=np.float64)
        los = np.array([lo for _, _, lo in reduced], dtype=np.float64)
        c, s = np.empty(his.size), np.empty(his.size)
        _reduced_kernel(quadrants, his, los, c, s, _TABLE)
        s = np.where(angles[finite] < 0, -s, s)
        cos[rows[finite], columns[finite]] = c
        sin[rows[finite], columns[finite]] = s
    return cos, sin


# ------------------------------------------------------------- scalar transcendentals

_CONTEXT = decimal.Context(prec=40, rounding=decimal.ROUND_HALF_EVEN)


def power(base: float, exponent: float) -> float:
    """``base ** exponent`` (``base > 0``), rounded to float64 from 40 digits."""
    if exponent == 0.0:
        return 1.0
    return float(_CONTEXT.power(decimal.Decimal(base), decimal.Decimal(exponent)))


def log(x: float) -> float:
    """Natural logarithm (``x > 0``), rounded to float64 from 40 digits."""
    if x == 1.0:
        return 0.0
    return float(_CONTEXT.ln(decimal.Decimal(x)))
