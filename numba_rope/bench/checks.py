"""The one epsilon table and the checks built on it: outputs against the reference
(``bench``), GPU results against the CPU (the GPU check). The tests read their ulp sizes
here too.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from numba_rope.bench.workloads import Case, as_dtype

#: Unit in the last place at 1.0 of each format.
EPSILON = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7, "float64": 2.0**-52}

#: Allowed error, in units of ``EPSILON * max|x| * max(|cos| + |sin|)``: the formula's
#: rounding error scales with its terms, not with a (possibly cancelling) result.
TOLERANCE_EPS = 4.0

#: Unsigned integer of each item size: the bits of a float array, whatever its dtype.
UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def epsilon(dtype: Any) -> float:
    """:data:`EPSILON` of a dtype or dtype name (one unit in the last place at 1.0).

    >>> epsilon("bfloat16"), epsilon(np.float16)
    (0.0078125, 0.0009765625)
    """
    return EPSILON[as_dtype(dtype).name]


def check_output(case: Case, kind: str, got: Any, expected: np.ndarray) -> tuple[bool, float, str]:
    """``(ok, error in eps units, reason)`` of an output against what it should be.

    ``kind`` "copy" or "allocating copy": the input bit for bit. ``kind`` "rope": the float64 reference
    within :data:`TOLERANCE_EPS`.
    """
    got = np.asarray(got)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return (
            False,
            math.inf,
            f"got {got.dtype} {got.shape}, want {expected.dtype} {expected.shape}",
        )
    if kind in ("copy", "allocating copy"):
        unsigned = UNSIGNED[got.dtype.itemsize]
        same = np.array_equal(got.view(unsigned), expected.view(unsigned))
        return same, 0.0 if same else math.inf, "" if same else "not a bitwise copy"
    eps = EPSILON[case.dtype.name]
    x_scale = float(np.abs(case.input.astype(np.float32)).max(initial=0.0))
    cache_scale = float(
        (np.abs(case.cos_cache.astype(np.float32)) + np.abs(case.sin_cache.astype(np.float32))).max(
            initial=0.0
        )
    )
    scale = max(x_scale * cache_scale, float(np.finfo(np.float32).tiny))
    with np.errstate(invalid="ignore"):
        difference = np.abs(got.astype(np.float32) - expected.astype(np.float32))
        error = float(difference.max(initial=0.0)) / (eps * scale)
    if math.isnan(error):
        return False, math.nan, "NaN in the output"
    ok = error <= TOLERANCE_EPS
    return ok, error, "" if ok else f"max error {error:.3g} eps > {TOLERANCE_EPS:g}"


def compare(got: np.ndarray, want: np.ndarray, x, cos, sin, dtype_name: str) -> tuple[float, float]:
    """(worst |got - want| in units of eps * scale, fraction of bitwise-equal elements);
    inf if NaNs disagree.

    The GPU check's measure of a GPU result against the CPU's: the scale is
    ``max|x| * max(|cos| + |sin|)`` as in :func:`check_output`, computed in float64.
    """
    g, w = got.astype(np.float64), want.astype(np.float64)
    if got.shape != want.shape or not np.array_equal(np.isnan(g), np.isnan(w)):
        return float("inf"), 0.0
    scale = float(np.abs(x.astype(np.float64)).max(initial=0)) * float(
        (np.abs(cos.astype(np.float64)) + np.abs(sin.astype(np.float64))).max(initial=0)
    )
    finite = np.isfinite(w)
    if not np.array_equal(g[~finite & ~np.isnan(w)], w[~finite & ~np.isnan(w)]):
        return float("inf"), 0.0
    error = float(np.abs(g[finite] - w[finite]).max(initial=0)) / (EPSILON[dtype_name] * scale or 1)
    same = np.ascontiguousarray(got).view(np.uint8) == np.ascontiguousarray(want).view(np.uint8)
    return error, float(same.mean()) if same.size else 1.0
