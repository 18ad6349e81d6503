"""The float16/bfloat16 conversions used inside the CPU kernels, checked exhaustively
against NumPy's float16 casts and ml_dtypes' bfloat16 casts."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit
from oracles import BFLOAT16, bits

from numba_rope._conversions import (
    BFLOAT16_STORAGE,
    FLOAT16_STORAGE,
    narrow_like,
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
            random_bits.view(np.float32),
            halfway.astype(np.uint32).view(np.float32),
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


def test_bfloat16_nan_is_canonical_quiet_nan_of_its_sign():
    values = np.array([0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFC00000], np.uint32).view(np.float32)
    got = np.empty(values.size, BFLOAT16_STORAGE)
    _narrow_all(values, got)
    np.testing.assert_array_equal(got.view(np.uint16), [0x7FC0, 0xFFC0, 0x7FC0, 0xFFC0])


def test_float_storage_passes_through():
    values = np.array([1.5, np.pi], np.float64)
    out64 = np.empty(2, np.float64)
    _widen_all(values, out64)
    np.testing.assert_array_equal(out64, values)
    out32 = np.empty(2, np.float32)
    _narrow_all(values, out32)
    np.testing.assert_array_equal(out32, values.astype(np.float32))
