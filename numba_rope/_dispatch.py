"""From the caller's arrays to a kernel launch: device choice and dtype policy.

The device is read from the array types alone, once per call, without asking any
device about itself:

* ``numpy.ndarray`` -> the CPU kernels of :mod:`numba_rope._cpu`;
* anything else is refused with a ``TypeError`` naming what is accepted.

A backend turns validated arguments into a result of the caller's array type: it
allocates or checks ``out``, hands the arrays to its kernels in their storage format
(float16/bfloat16 as 16-bit integer views on the CPU, see
:mod:`numba_rope._conversions`) and turns a bad position id into ``IndexError``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from numba_rope import _cpu
from numba_rope._conversions import BFLOAT16_STORAGE, FLOAT16_STORAGE
from numba_rope._validation import position_error

ARGUMENT_NAMES = ("input", "cos_cache", "sin_cache", "position_ids", "out")
_KERNEL_ID_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))


def _describe(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def backend_for(input: Any, cos_cache: Any, sin_cache: Any, position_ids: Any, out: Any):
    """The backend that serves these arguments; ``TypeError`` if there is none."""
    ndarray = np.ndarray
    if (
        type(input) is ndarray
        and type(cos_cache) is ndarray
        and type(sin_cache) is ndarray
        and (position_ids is None or type(position_ids) is ndarray)
        and (out is None or type(out) is ndarray)
    ):
        return CpuBackend
    arrays = (input, cos_cache, sin_cache, position_ids, out)
    for name, array in zip(ARGUMENT_NAMES, arrays, strict=True):
        if array is not None and not isinstance(array, ndarray):
            raise TypeError(
                f"{name} is a {_describe(array)}; rotary_embedding accepts NumPy arrays "
                f"(convert with numpy.asarray)"
            )
    return CpuBackend


def _storage(array: np.ndarray) -> np.ndarray:
    # Validation has admitted only float32/float64 and the two 16-bit formats, of which
    # float16 has kind "f" and ml_dtypes' bfloat16 kind "V".
    if array.dtype.itemsize != 2:
        return array
    return array.view(FLOAT16_STORAGE if array.dtype.kind == "f" else BFLOAT16_STORAGE)


def _same_elements(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.strides == b.strides
    )


class CpuBackend:
    """NumPy arrays in, NumPy arrays out, computed by the parallel CPU kernels."""

    name = "cpu"

    @staticmethod
    def describe(array: Any) -> tuple[Any, Any]:
        """``(shape, dtype)`` of an argument, ``(None, None)`` for an absent one."""
        if array is None:
            return None, None
        return array.shape, array.dtype

    @staticmethod
    def run(x, cos, sin, position_ids, out, interleaved: bool, rotary_dim: int):
        """Rotate validated NumPy arrays into ``out`` (allocated when None)."""
        if out is None:
            result = np.empty(x.shape, dtype=x.dtype)
        else:
            if not out.flags.writeable:
                raise ValueError(
                    "out is a read-only array; pass a writeable array (e.g. "
                    "np.empty_like(input)) or omit out"
                )
            result = out
        kernel_ids = position_ids
        if position_ids is not None and position_ids.dtype not in _KERNEL_ID_DTYPES:
            # Checked on the ids as given (a uint64 id may not fit int64), then converted.
            _raise_if_bad_position(position_ids, cos.shape[0])
            kernel_ids = position_ids.astype(np.int64)
        if x.size == 0:
            if position_ids is not None:
                _raise_if_bad_position(position_ids, cos.shape[0])
            return result
        status = _launch(x, cos, sin, kernel_ids, result, interleaved, rotary_dim)
        if status == _cpu.OVERLAP:
            # Rare: out overlaps an input. Copy what overlaps and launch again.
            x, cos, sin, kernel_ids = _separate_from_out(x, cos, sin, kernel_ids, result)
            status = _launch(x, cos, sin, kernel_ids, result, interleaved, rotary_dim)
        if status >= 0:
            value = int(position_ids.reshape(-1)[status])
            raise position_error(status, position_ids.shape, value, cos.shape[0])
        return result


def _launch(x, cos, sin, position_ids, out, interleaved: bool, rotary_dim: int) -> int:
    return _cpu._launch_cpu(
        _storage(x),
        _storage(cos),
        _storage(sin),
        position_ids,
        _storage(out),
        interleaved,
        rotary_dim,
    )


def _raise_if_bad_position(position_ids: np.ndarray, n_positions: int) -> None:
    bad = _cpu.first_bad_position(position_ids, n_positions)
    if bad >= 0:
        value = int(position_ids.reshape(-1)[bad])
        raise position_error(bad, position_ids.shape, value, n_positions)


def _separate_from_out(x, cos, sin, position_ids, out):
    """Copy any input that overlaps ``out`` without being ``out`` itself.

    Rotating in place (``out`` holds exactly the input's elements) is safe; any other
    overlap would let the kernel read values it has already overwritten.
    """
    if np.may_share_memory(x, out) and not _same_elements(x, out):
        x = x.copy()
    if np.may_share_memory(cos, out):
        cos = cos.copy()
    if np.may_share_memory(sin, out):
        sin = sin.copy()
    if position_ids is not None and np.may_share_memory(position_ids, out):
        position_ids = position_ids.copy()
    return x, cos, sin, position_ids
