"""What a type checker says about calls of numba_rope (checked by ``mypy``: this file is
in pyproject's mypy files, with ``warn_unused_ignores``, so each ``# type: ignore`` below
must stand on a real error, and by tests/test_packaging.py, which also runs the good
calls).

The good calls type-check and keep the kind of array they were given; the bad ones
(a list for ``input``, float position ids, a string offset) are errors for mypy as they
are for numba_rope at run time.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import numpy.typing as npt

import numba_rope
from numba_rope.typing import Array, ArrayT, CudaArray, PositionOffset

if sys.version_info >= (3, 11):
    from typing import assert_type
else:  # pragma: no cover
    from typing_extensions import assert_type


def good_calls() -> None:
    """NumPy in, NumPy out, with the dtype kept; caches from rope_cache."""
    cos, sin = numba_rope.rope_cache(16, 8)
    assert_type(cos, npt.NDArray[Any])
    x: npt.NDArray[np.float32] = np.ones((1, 2, 3, 8), dtype=np.float32)
    ids = np.array([[0, 4, 9]])
    y = numba_rope.rotary_embedding(x, cos, sin, ids)
    assert_type(y, npt.NDArray[np.float32])
    numba_rope.rotary_embedding(x, cos, sin, position_offset=np.int64(2), out=x)
    numba_rope.rotary_embedding(x, cos, sin, position_offset=np.array([5]), layout="bshd")
    q, k = numba_rope.rotary_embedding_qk(x, x[:, :1], cos, sin, position_offset=3)
    assert_type(q, npt.NDArray[np.float32])
    assert_type(k, npt.NDArray[np.float32])
    expected = numba_rope.reference.rotary_embedding(x, cos, sin, ids)
    assert_type(expected, npt.NDArray[np.float32])


def gpu_arrays_keep_their_type(x: ArrayT, cos: Array, sin: Array, offset: PositionOffset) -> ArrayT:
    """Generic code: whatever kind ``x`` is, the result is typed the same."""
    return numba_rope.rotary_embedding(x, cos, sin, position_offset=offset)


class DeviceBuffer:
    """Stands for a GPU array type (CuPy, torch, Numba): it exports the interface."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {}


def gpu_call(x: DeviceBuffer, cos: CudaArray, sin: CudaArray) -> None:
    y = numba_rope.rotary_embedding(x, cos, sin, position_offset=0)
    assert_type(y, DeviceBuffer)


def bad_calls(
    x: npt.NDArray[np.float32], cos: npt.NDArray[np.float32], ids: npt.NDArray[np.float64]
) -> None:
    """Never run: errors for mypy, as they are at run time (the first four raise
    TypeError; the oracle takes NumPy arrays only)."""
    numba_rope.rotary_embedding([1.0, 2.0, 3.0, 4.0], cos, cos)  # type: ignore[type-var]
    numba_rope.rotary_embedding(x, [[1.0]], cos)  # type: ignore[arg-type]
    numba_rope.rotary_embedding(x, cos, cos, ids)  # type: ignore[arg-type]
    numba_rope.rotary_embedding(x, cos, cos, position_offset="3")  # type: ignore[arg-type]
    numba_rope.reference.rotary_embedding([1.0, 2.0], cos, cos)  # type: ignore[arg-type]
