"""From the caller's arrays to a kernel launch: device choice and dtype policy.

The device is read from the array types alone, once per call, without asking any
device about itself:

* ``numpy.ndarray`` -> the CPU kernels of :mod:`numba_rope._cpu`;
* Numba device arrays (the simulator's too), CuPy arrays, torch CUDA tensors and any
  other object exporting ``__cuda_array_interface__`` -> the CUDA kernels of
  :mod:`numba_rope._cuda`, on the caller's stream;
* anything else, or host and GPU arrays in one call, is refused with a ``TypeError``
  naming what was given and what is accepted.

A backend has two methods: ``describe(array)`` gives an argument's shape and dtype (a
NumPy dtype, whatever the array library) for validation, and ``run(...)`` turns
validated arguments into a result of the caller's array type: it allocates or checks
``out``, checks position ids, and hands the arrays to its kernels in their storage
format (float16/bfloat16 as 16-bit integer views on the CPU, see
:mod:`numba_rope._conversions`; bfloat16 as ``uint16`` views on the GPU). CuPy and torch are never imported here: they
are recognised by the module of the array's type, and used only through the arrays the
caller passed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from numba_rope import _cpu
from numba_rope._conversions import BFLOAT16_STORAGE, FLOAT16_STORAGE
from numba_rope._validation import position_error

#: On the GPU float16 is native; bfloat16 travels as its bits.
_GPU_STORAGE = {"bfloat16": np.dtype(np.uint16)}

ARGUMENT_NAMES = ("input", "cos_cache", "sin_cache", "position_ids", "out")
_KERNEL_ID_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))


def _describe(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _library(array: Any) -> str | None:
    """Which library an argument comes from: ``numpy``, ``numba``, ``torch``, ``cupy``,
    ``cuda`` (another ``__cuda_array_interface__`` exporter), or None if unsupported
    (torch CPU tensors included). Read from the type alone: nothing is imported."""
    if isinstance(array, np.ndarray):
        return "numpy"
    kind = type(array)
    module = kind.__module__ or ""
    if module == "torch" or module.startswith("torch."):
        return "torch" if getattr(array, "is_cuda", False) else None
    if getattr(kind, "__cuda_ndarray__", False):
        return "numba"  # numba device arrays, real or simulated
    if hasattr(kind, "__cuda_array_interface__"):
        return "cupy" if module.startswith("cupy") else "cuda"
    return None


def _where(array: Any) -> str:
    library = _library(array)
    if library == "numpy":
        return "a NumPy array on the host"
    return f"on the GPU ({_describe(array)})"


def device_of(arrays: tuple[Any, ...]) -> str:
    """``"cpu"`` when every given argument is a NumPy array, ``"cuda"`` when every given
    argument is a GPU array; otherwise ``TypeError``."""
    on_gpu = []
    for name, array in zip(ARGUMENT_NAMES, arrays, strict=True):
        if array is None or isinstance(array, np.ndarray):
            continue
        if _library(array) is None:
            where = " on the CPU" if _describe(array).startswith("torch.") else ""
            raise TypeError(
                f"{name} is a {_describe(array)}{where}; rotary_embedding accepts NumPy "
                f"arrays (convert with numpy.asarray), or arrays on an NVIDIA GPU: CuPy "
                f"arrays, Numba device arrays and torch CUDA tensors"
            )
        on_gpu.append(name)
    if not on_gpu:
        return "cpu"
    on_host = [
        name
        for name, array in zip(ARGUMENT_NAMES, arrays, strict=True)
        if isinstance(array, np.ndarray)
    ]
    if on_host:
        named = dict(zip(ARGUMENT_NAMES, arrays, strict=True))
        raise TypeError(
            "all arrays of a call must be on one device, but "
            + "; ".join(f"{name} is {_where(named[name])}" for name in on_gpu + on_host)
            + f". Move {', '.join(on_host)} to the GPU (numba.cuda.to_device, cupy.asarray, "
            f"torch.as_tensor(..., device='cuda')) or {', '.join(on_gpu)} to the host"
        )
    return "cuda"


def backend_for(
    input: Any, cos_cache: Any, sin_cache: Any, position_ids: Any, out: Any, stream: Any = None
) -> Any:
    """The backend that runs a call on these arrays (see :func:`device_of`)."""
    ndarray = np.ndarray
    if (
        type(input) is ndarray
        and type(cos_cache) is ndarray
        and type(sin_cache) is ndarray
        and (position_ids is None or type(position_ids) is ndarray)
        and (out is None or type(out) is ndarray)
    ):
        return CpuBackend  # the common case, decided without a loop
    arrays = (input, cos_cache, sin_cache, position_ids, out)
    if device_of(arrays) == "cpu":
        return CpuBackend
    return CudaBackend(arrays, stream)


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
    def run(
        x, cos, sin, position_ids, out, interleaved: bool, rotary_dim: int, check_position_ids=True
    ):
        """Rotate validated NumPy arrays into ``out`` (allocated when None).

        Position ids are always checked on the CPU (it costs a pass over ``[batch,
        seq_len]`` integers): ``check_position_ids`` is accepted and ignored.
        """
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


_torch_dtypes: dict[Any, np.dtype] = {}


def _torch_dtype(dtype: Any) -> np.dtype:
    """The NumPy dtype of a torch dtype (bfloat16 as ``ml_dtypes.bfloat16``)."""
    found = _torch_dtypes.get(dtype)
    if found is not None:
        return found
    name = str(dtype).removeprefix("torch.")
    try:
        if name == "bfloat16":
            import ml_dtypes  # not at import time: it costs more than the rest of numba_rope

            found = np.dtype(ml_dtypes.bfloat16)
        else:
            found = np.dtype(name)
    except TypeError:
        raise TypeError(
            f"torch dtype {dtype} has no NumPy equivalent; rotary_embedding accepts "
            f"float32, float16, bfloat16 and float64 tensors"
        ) from None
    _torch_dtypes[dtype] = found
    return found


def _device_ordinal(array: Any, library: str | None) -> int | None:
    """The GPU an array lives on, where its library says so without a device query."""
    if library == "torch":
        return array.device.index
    if library == "cupy":
        return array.device.id
    return None


class CudaBackend:
    """GPU arrays in, the input's array type out, computed by :mod:`numba_rope._cuda`.

    One instance per call: it holds the call's stream and GPU. The stream is, unless
    ``stream=`` overrides it, torch's current stream for torch input, CuPy's current
    stream for CuPy input, else Numba's default stream. Nothing here synchronizes,
    except :meth:`first_bad_position` (one read-back).
    """

    name = "cuda"

    def __init__(self, arrays: tuple[Any, ...], stream: Any = None) -> None:
        from numba_rope import _cuda

        self._cuda = _cuda
        self._library: dict[int, str | None] = {id(a): _library(a) for a in arrays if a is not None}
        self._views: dict[int, Any] = {}
        ordinals: dict[int, str] = {}
        for name, array in zip(ARGUMENT_NAMES, arrays, strict=True):
            if array is not None:
                ordinal = _device_ordinal(array, self._library[id(array)])
                if ordinal is not None:
                    ordinals.setdefault(ordinal, name)
        if len(ordinals) > 1:
            raise TypeError(
                "all arrays of a call must be on one GPU, but "
                + ", ".join(f"{name} is on GPU {ordinal}" for ordinal, name in ordinals.items())
                + "; copy them to one device first"
            )
        self.ordinal = next(iter(ordinals), None)
        first = arrays[0]
        if stream is not None:
            self.stream = _cuda.as_numba_stream(stream, self.ordinal)
        else:
            self.stream = _cuda.numba_stream(self._default_stream_handle(first), self.ordinal)

    def _default_stream_handle(self, array: Any) -> int:
        library = self._library.get(id(array))
        if library == "torch":
            import torch  # already imported: the caller passed a tensor

            return torch.cuda.current_stream(array.device).cuda_stream
        if library == "cupy":
            import cupy  # already imported: the caller passed a CuPy array

            return cupy.cuda.get_current_stream().ptr
        return 0

    def _on_device(self) -> Any:
        """Numba's work (views, launches) in the context of the arrays' GPU."""
        if self.ordinal is None:
            return contextlib.nullcontext()
        return self._cuda.cuda.gpus[self.ordinal]

    def describe(self, array: Any) -> tuple[Any, Any]:
        """``(shape, dtype)`` of an argument, ``(None, None)`` for an absent one."""
        if array is None:
            return None, None
        return tuple(array.shape), self.dtype_of(array)

    def run(
        self,
        x,
        cos,
        sin,
        position_ids,
        out,
        interleaved: bool,
        rotary_dim: int,
        check_position_ids: bool = True,
    ):
        """Rotate validated GPU arrays into ``out`` (allocated when None)."""
        if out is not None:
            self.check_writable(out)
        if position_ids is not None and check_position_ids:
            bad = self.first_bad_position(position_ids, cos.shape[0])
            if bad is not None:
                shape = tuple(position_ids.shape)
                raise position_error(bad[0], shape, bad[1], cos.shape[0])
        result = self.empty_like(x) if out is None else out
        if 0 not in tuple(x.shape):
            self.launch(x, cos, sin, position_ids, result, interleaved, rotary_dim)
        return result

    def dtype_of(self, array: Any) -> np.dtype:
        if self._library.get(id(array)) == "torch":
            return _torch_dtype(array.dtype)
        dtype = getattr(array, "dtype", None)
        if isinstance(dtype, np.dtype):
            return dtype
        return np.dtype(array.__cuda_array_interface__["typestr"])

    def _storage(self, array: Any) -> np.dtype:
        dtype = self.dtype_of(array)
        return _GPU_STORAGE.get(dtype.name, dtype)

    def view(self, array: Any) -> Any:
        """A numba device array over ``array``'s memory in its kernel storage dtype."""
        view = self._views.get(id(array))
        if view is None:
            library = self._library[id(array)] or "cuda"
            view = self._cuda.numba_view(array, library, self._storage(array))
            self._views[id(array)] = view
        return view

    def empty_like(self, x: Any) -> Any:
        """A new C-contiguous array of ``x``'s library, shape and dtype, on its GPU."""
        library = self._library[id(x)]
        shape = tuple(x.shape)
        if library == "torch":
            import torch

            result = torch.empty(shape, dtype=x.dtype, device=x.device)
        elif library == "cupy":
            import cupy

            with x.device:
                result = cupy.empty(shape, dtype=x.dtype)
        else:
            library = "numba"
            with self._on_device():
                result = self._cuda.device_array(shape, self.dtype_of(x), self.stream)
        self._library[id(result)] = library
        return result

    def check_writable(self, out: Any) -> None:
        if self._library[id(out)] == "cuda" and out.__cuda_array_interface__["data"][1]:
            raise ValueError(
                "out is a read-only GPU array (its __cuda_array_interface__ says so); pass "
                "a writeable array or omit out"
            )

    def first_bad_position(self, position_ids: Any, n_positions: int) -> tuple[int, int] | None:
        """``(flat index, value)`` of the first id outside ``[0, n_positions)``, if any.

        One small kernel on the call's stream, then one read-back (a synchronization).
        """
        with self._on_device():
            view = self.view(position_ids)
            flat = self._cuda.first_bad_position(view, n_positions, self.stream, self.ordinal)
            if flat < 0:
                return None
            seq_len = view.shape[1]
            value = self._cuda.read_element(view, (flat // seq_len, flat % seq_len))
        return flat, int(value)

    def launch(self, x, cos, sin, position_ids, out, interleaved: bool, rotary_dim: int) -> None:
        cuda_ = self._cuda
        with self._on_device():
            views = [self.view(a) for a in (x, cos, sin)]
            ids = None if position_ids is None else self.view(position_ids)
            result = self.view(out)
            x_extent, out_extent = cuda_.byte_extent(views[0]), cuda_.byte_extent(result)
            in_place = x_extent[0] == out_extent[0] and views[0].strides == result.strides
            others = views[1:] + ([] if ids is None else [ids])
            others += [] if in_place else [views[0]]
            overlaps = any(_intersect(cuda_.byte_extent(v), out_extent) for v in others)
            # Rotating in place is safe (each thread reads its elements before writing
            # them); any other overlap of out with an input goes through a fresh buffer.
            target = (
                cuda_.device_array(result.shape, result.dtype, self.stream) if overlaps else result
            )
            cuda_._launch_cuda(
                views[0],
                views[1],
                views[2],
                ids,
                target,
                interleaved,
                rotary_dim,
                input_dtype=self.dtype_of(x).name,
                cache_dtype=self.dtype_of(cos).name,
                in_place=in_place and not overlaps,
                stream=self.stream,
            )
            if overlaps:
                cuda_.copy(target, result, self.stream)


def _intersect(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


BACKENDS: dict[str, Any] = {"cpu": CpuBackend, "cuda": CudaBackend}
