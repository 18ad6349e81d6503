"""Static types of numba_rope's array arguments, for IDEs and type checkers.

* :data:`NumpyArray`: a NumPy array (runs on the CPU).
* :class:`CudaArray`: any object exporting ``__cuda_array_interface__``: Numba device
  arrays, CuPy arrays, torch CUDA tensors (runs on the GPU).
* :data:`Array`: either; what :func:`numba_rope.rotary_embedding` accepts as input,
  caches and ``out``. Python lists and other sequences are not arrays (the call raises
  ``TypeError``, and a type checker reports it). torch tensors on the CPU are accepted
  too (typed as torch CUDA tensors are: the class has the property). Some refusals are
  for the call alone to see: torch tensors on other devices and ndarray subclasses
  other than ``numpy.memmap``.
* :data:`ArrayT`: a type variable bound to :data:`Array`. ``rotary_embedding`` takes an
  ``ArrayT`` and returns that type: NumPy in, NumPy out; CuPy, torch and Numba device
  arrays likewise. (An exporter of another library gets a Numba device array back.)
* :data:`PositionIds`: an integer array, NumPy or GPU.
* :data:`PositionOffset`: a Python or NumPy integer, or an integer array.

Nothing here imports CuPy, torch or ``numba.cuda``: GPU arrays are described by the
protocol they export.

Examples
--------
>>> import numpy as np
>>> import numba_rope
>>> from numba_rope.typing import ArrayT, PositionOffset
>>> def rotate_in_place(x: ArrayT, cos: numba_rope.typing.Array,
...                     sin: numba_rope.typing.Array, offset: PositionOffset) -> ArrayT:
...     return numba_rope.rotary_embedding(x, cos, sin, position_offset=offset, out=x)
>>> cos, sin = numba_rope.rope_cache(8, 4)
>>> rotate_in_place(np.ones((1, 1, 2, 4), np.float32), cos, sin, 3).shape
(1, 1, 2, 4)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = [
    "Array",
    "ArrayT",
    "CudaArray",
    "NumpyArray",
    "PositionIds",
    "PositionOffset",
]


class CudaArray(Protocol):
    """A GPU array: an object with the ``__cuda_array_interface__`` property (Numba
    device arrays, CuPy arrays, torch tensors)."""

    @property
    def __cuda_array_interface__(self) -> Mapping[str, Any]: ...


NumpyArray: TypeAlias = npt.NDArray[Any]
"""A NumPy array of any dtype (float32, float16, ``ml_dtypes.bfloat16``, float64 for
inputs and caches)."""

Array: TypeAlias = NumpyArray | CudaArray
"""An array numba_rope accepts: NumPy (CPU) or ``__cuda_array_interface__`` (GPU)."""

ArrayT = TypeVar("ArrayT", bound=Array)
"""The kind of the input, which is the kind of the result."""

PositionIds: TypeAlias = npt.NDArray[np.integer[Any]] | CudaArray
"""Integer position ids ``[batch, seq_len]``, NumPy or GPU."""

PositionOffset: TypeAlias = int | np.integer[Any] | npt.NDArray[np.integer[Any]] | CudaArray
"""One integer offset for the batch, or an integer array ``[batch]``."""
