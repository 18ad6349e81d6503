"""From the caller's arrays to a kernel launch: device choice and dtype policy.

The device is read from the array types alone, once per call, without asking any
device about itself:

* ``numpy.ndarray`` -> the CPU kernels of :mod:`numba_rope._cpu`;
* anything else is refused with a ``TypeError`` naming what is accepted.

Each backend knows how to read an argument's shape and dtype, how to allocate the
result in the caller's array type, how to check position ids, and how to hand the
arrays to its kernels in their storage format (float16/bfloat16 as 16-bit integer
views on the CPU, see :mod:`numba_rope._conversions`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from numba_rope import _cpu
from numba_rope._conversions import BFLOAT16_STORAGE, FLOAT16_STORAGE

_STORAGE = {"float16": FLOAT16_STORAGE, "bfloat16": BFLOAT16_STORAGE}

ARGUMENT_NAMES = ("input", "cos_cache", "sin_cache", "position_ids", "out")


def _describe(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def device_of(arrays: tuple[Any, ...]) -> str:
    """Return ``"cpu"`` when every given argument is a NumPy array, else raise."""
    for name, array in zip(ARGUMENT_NAMES, arrays, strict=True):
        if array is None:
            continue
        if not isinstance(array, np.ndarray):
            raise TypeError(
                f"{name} is a {_describe(array)}; rotary_embedding accepts NumPy arrays "
                f"(convert with numpy.asarray)"
            )
    return "cpu"


class CpuBackend:
    """NumPy arrays in, NumPy arrays out, computed by the parallel CPU kernels."""

    name = "cpu"

    @staticmethod
    def empty_like(x: np.ndarray) -> np.ndarray:
        return np.empty(x.shape, dtype=x.dtype)

    @staticmethod
    def storage(array: np.ndarray) -> np.ndarray:
        view_as = _STORAGE.get(array.dtype.name)
        return array if view_as is None else array.view(view_as)

    @staticmethod
    def check_writable(out: np.ndarray) -> None:
        if not out.flags.writeable:
            raise ValueError(
                "out is a read-only array; pass a writeable array (e.g. np.empty_like(input)) "
                "or omit out"
            )

    @staticmethod
    def first_bad_position(position_ids: np.ndarray, n_positions: int) -> tuple[int, int] | None:
        """``(flat index, value)`` of the first id outside ``[0, n_positions)``, if any."""
        flat = _cpu.first_bad_position(position_ids, n_positions)
        if flat < 0:
            return None
        return flat, int(position_ids.reshape(-1)[flat])

    @staticmethod
    def kernel_position_ids(position_ids: np.ndarray) -> np.ndarray:
        """Position ids as int64 or int32; called after the range check, so exact."""
        if position_ids.dtype in (np.int64, np.int32):
            return position_ids
        return position_ids.astype(np.int64)

    @staticmethod
    def separate(x, cos, sin, position_ids, out):
        """Copy any input that overlaps ``out`` without being ``out`` itself.

        Rotating in place (``out`` is the input, element for element) is safe; any other
        overlap would let the kernel read values it has already overwritten.
        """
        if out is None:
            return x, cos, sin, position_ids
        same_layout = (
            x.__array_interface__["data"][0] == out.__array_interface__["data"][0]
            and x.strides == out.strides
        )
        if not same_layout and np.may_share_memory(x, out):
            x = x.copy()
        if np.may_share_memory(cos, out):
            cos = cos.copy()
        if np.may_share_memory(sin, out):
            sin = sin.copy()
        if position_ids is not None and np.may_share_memory(position_ids, out):
            position_ids = position_ids.copy()
        return x, cos, sin, position_ids

    @classmethod
    def launch(cls, x, cos, sin, position_ids, out, interleaved: bool, rotary_dim: int) -> None:
        _cpu._launch_cpu(
            cls.storage(x),
            cls.storage(cos),
            cls.storage(sin),
            position_ids,
            cls.storage(out),
            interleaved,
            rotary_dim,
        )


BACKENDS = {"cpu": CpuBackend}
