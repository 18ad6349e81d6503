"""From the caller's arrays to a backend: the device is read from the array types alone,
once per call, without asking any device about itself.

One table, :data:`DEVICE_OF_LIBRARY`, says which device runs each kind of array:

* ``numpy.ndarray`` -> the CPU backend, :mod:`numba_rope._cpu.backend`;
* torch CPU tensors (alone or with NumPy arrays: both are host memory) -> the same
  backend, on NumPy views of the tensors' memory made before dispatch
  (:mod:`numba_rope._cpu.torch_host`, used by ``rotary._rotate``);
* Numba device arrays (the simulator's too), CuPy arrays, torch CUDA tensors and any
  other object exporting ``__cuda_array_interface__`` -> the CUDA backend,
  :mod:`numba_rope._cuda.backend` (imported on first use), on the caller's stream;
* anything else, or host and GPU arrays in one call, is refused by
  :func:`numba_rope._validation.check_devices`.

A backend describes the arguments for validation (``describe``, ``describe_out``) and
turns a validated :class:`numba_rope._validation.Call` into results of the caller's
array type (``run``). CuPy and torch are never imported here: they are recognised by
the module of the array's type, and used only through the arrays the caller passed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from numba_rope._cpu import backend as cpu_backend
from numba_rope._jit import require_jit
from numba_rope._validation import check_devices

#: The device of each kind of array (see :func:`library`).
DEVICE_OF_LIBRARY = {
    "numpy": "cpu",
    "torch_cpu": "cpu",
    "numba": "cuda",
    "torch": "cuda",
    "cupy": "cuda",
    "cuda": "cuda",
}


def type_name(obj: Any) -> str:
    """The type of an argument for messages; a torch tensor on a device the operator
    does not run on (``meta``, ``mps``, ...) says which."""
    kind = type(obj)
    name = f"{kind.__module__}.{kind.__qualname__}"
    device = getattr(obj, "device", None)
    if name.startswith("torch.") and getattr(device, "type", "cpu") not in ("cpu", "cuda"):
        name += f" on device {str(device)!r}"
    return name


def library(array: Any) -> str | None:
    """Which library an argument comes from: ``numpy`` (``numpy.ndarray`` and
    ``numpy.memmap``), ``torch_cpu`` (a torch tensor on the CPU), ``numba``, ``torch``
    (a torch CUDA tensor), ``cupy``, ``cuda`` (another ``__cuda_array_interface__``
    exporter), or None if unsupported: torch tensors on other devices, and ndarray
    subclasses such as ``numpy.ma.MaskedArray``, whose mask the kernels would ignore.
    Read from the type (and a torch tensor's device attribute) alone: nothing is
    imported."""
    kind = type(array)
    if kind is np.ndarray or kind is np.memmap:
        return "numpy"
    if isinstance(array, np.ndarray):
        return None  # a subclass that may change meaning (a mask, a matrix): refused
    module = kind.__module__ or ""
    torch_type = _TORCH_TYPES.get(kind)
    if torch_type is None:  # first sight of this type: look through its bases
        torch_type = _TORCH_TYPES[kind] = any(
            _is_torch_module(base.__module__) for base in kind.__mro__
        )
    if torch_type:
        if array.is_cuda:
            return "torch"
        return "torch_cpu" if array.is_cpu else None  # not meta, mps, ...
    if getattr(kind, "__cuda_ndarray__", False):
        return "numba"  # numba device arrays, real or simulated
    if hasattr(kind, "__cuda_array_interface__"):
        return "cupy" if module.startswith("cupy") else "cuda"
    return None


#: Whether a type is torch's (or a subclass of a torch type), by type: a type's bases
#: are looked through once (it was 1.3 µs an argument, a tenth of a small call).
_TORCH_TYPES: dict[type, bool] = {}


def _is_torch_module(module: str | None) -> bool:
    """Whether a type comes from torch (``torch.Tensor``, ``torch.nn.Parameter``; a
    user's subclass of them has one among its bases)."""
    return module is not None and (module == "torch" or module.startswith("torch."))


def backend_for(arrays: tuple[Any, ...], names: tuple[str, ...], stream: Any = None) -> Any:
    """The backend that runs a call on these arrays (None entries are absent
    arguments): the CPU backend module, or a CUDA backend for this call."""
    for array in arrays:
        if array is not None and type(array) is not np.ndarray:
            break
    else:
        return cpu_backend  # the common case, decided by type identity alone
    libraries = tuple(None if a is None else library(a) for a in arrays)
    given = [
        (n, a, lib) for n, a, lib in zip(names, arrays, libraries, strict=True) if a is not None
    ]
    device = check_devices(
        [n for n, _, _ in given],
        [type_name(a) for _, a, _ in given],
        [None if lib is None else DEVICE_OF_LIBRARY[lib] for _, _, lib in given],
    )
    if device == "cpu":  # NumPy arrays (torch CPU tensors are seen through before)
        return cpu_backend
    require_jit()  # without the JIT, the kernels' device functions are Python: none compiles
    from numba_rope._cuda.backend import CudaBackend

    return CudaBackend(arrays, names, libraries, stream)


def is_scalar(value: Any) -> bool:
    """A Python or NumPy scalar (a position offset given as one number)."""
    return isinstance(value, (int, float, complex, np.generic))
