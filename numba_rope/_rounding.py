"""Rounding float64 values once to an output dtype, in plain NumPy.

Used by the reference and by the cache builder, whose results are defined as float64
values rounded once, to nearest even.
"""

from __future__ import annotations

import numpy as np


def _round_to_bfloat16(values: np.ndarray, bfloat16: np.dtype) -> np.ndarray:
    """float64 -> bfloat16, rounded once to nearest even.

    Converting float64 through float32 rounds twice (1 + 2**-8 + 2**-30 becomes 1, not
    1 + 2**-7), and ``ml_dtypes`` 0.6 converts float64 that way (0.7 rounds once).
    Rounding to float32 *to odd* first (truncate, then set the last bit when anything
    was dropped) keeps the information the second rounding needs, so the result is the
    correctly rounded one whichever ``ml_dtypes`` is installed.
    """
    narrowed = np.asarray(values, dtype=np.float64).astype(np.float32)
    values = np.asarray(values, dtype=np.float64)
    widened = narrowed.astype(np.float64)
    bits = narrowed.view(np.uint32)
    bits[np.abs(widened) > np.abs(values)] -= 1  # one step toward zero: truncation
    bits[widened != values] |= 1
    return narrowed.astype(bfloat16)


def round_once(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float64 ``values`` rounded once, to nearest even, to ``dtype``.

    >>> import ml_dtypes
    >>> float(round_once(np.array([1 + 2**-8 + 2**-30]), np.dtype(ml_dtypes.bfloat16))[0])
    1.0078125
    """
    if dtype.name == "bfloat16":
        return _round_to_bfloat16(values, dtype)
    return values.astype(dtype)  # float64 -> float32 / float16 rounds once in NumPy
