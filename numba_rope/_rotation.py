"""The rotation of one pair, written once for every kernel, CPU and CUDA alike."""

from __future__ import annotations

from numba_rope._jit import cached_njit


@cached_njit()
def rotate_pair(x1, x2, cos, sin):
    """Rotate the 2-D vector ``(x1, x2)`` by the angle whose cosine and sine are given.

    Evaluated exactly as written, one rounding per operation: ``x1*cos - x2*sin`` and
    ``x2*cos + x1*sin``. A negative ``sin`` gives the inverse rotation.

    Not inlined by numba (its IR inlining is slow to compile); LLVM inlines the call.
    """
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin
