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
:mod:`numba_rope._conversions`; bfloat16 as ``uint16`` views on the GPU). CuPy and torch
are never imported here: they are recognised by the module of the array's type, and used
only through the arrays the caller passed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from numba_rope import _cpu, config
from numba_rope._conversions import BFLOAT16_STORAGE, FLOAT16_STORAGE
from numba_rope._validation import offset_error, position_error

#: On the GPU float16 is native; bfloat16 travels as its bits.
_GPU_STORAGE = {"bfloat16": np.dtype(np.uint16)}

#: Names of the array arguments of each public function, in the order they are passed
#: to :func:`backend_for` (for error messages).
ARGUMENT_NAMES = ("input", "cos_cache", "sin_cache", "position_ids", "out", "position_offset")
QK_ARGUMENT_NAMES = (
    "q",
    "k",
    "cos_cache",
    "sin_cache",
    "position_ids",
    "out_q",
    "out_k",
    "position_offset",
)
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


def device_of(arrays: tuple[Any, ...], names: tuple[str, ...] = ARGUMENT_NAMES) -> str:
    """``"cpu"`` when every given argument is a NumPy array, ``"cuda"`` when every given
    argument is a GPU array; otherwise ``TypeError``."""
    on_gpu = []
    for name, array in zip(names, arrays, strict=True):
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
        name for name, array in zip(names, arrays, strict=True) if isinstance(array, np.ndarray)
    ]
    if on_host:
        named = dict(zip(names, arrays, strict=True))
        raise TypeError(
            "all arrays of a call must be on one device, but "
            + "; ".join(f"{name} is {_where(named[name])}" for name in on_gpu + on_host)
            + f". Move {', '.join(on_host)} to the GPU (numba.cuda.to_device, cupy.asarray, "
            f"torch.as_tensor(..., device='cuda')) or {', '.join(on_gpu)} to the host"
        )
    return "cuda"


def backend_for(arrays: tuple[Any, ...], names: tuple[str, ...], stream: Any = None) -> Any:
    """The backend that runs a call on these arrays (see :func:`device_of`)."""
    for array in arrays:
        if array is not None and type(array) is not np.ndarray:
            break
    else:
        return CpuBackend  # the common case, decided by type identity alone
    if device_of(arrays, names) == "cpu":
        return CpuBackend
    return CudaBackend(arrays, names, stream)


def is_scalar(value: Any) -> bool:
    """A Python or NumPy scalar (a position offset given as one number)."""
    return isinstance(value, (int, float, complex, np.generic))


def _storage(array: np.ndarray) -> np.ndarray:
    """The array as the kernels take it (see :func:`_storage_dtype`)."""
    storage = _storage_dtype(array.dtype)
    return array if storage is None else array.view(storage)


def bhsd(array: Any, layout: str, shape: tuple[int, ...]) -> Any:
    """A ``[batch, num_heads, seq_len, head_size]`` view of an input or output of any
    accepted form (validated): the kernels read and write through it, never a copy.

    Works for any array with NumPy's ``transpose``/``reshape`` (NumPy, CuPy); splitting
    the last axis of a 3-D array is always possible without a copy.
    """
    if array.ndim == 3:
        batch, heads, seq_len, head_size = shape
        return array.reshape(batch, seq_len, heads, head_size).transpose(0, 2, 1, 3)
    if layout == "bshd":
        return array.transpose(0, 2, 1, 3)
    return array


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
    def run(x, cos, sin, position_ids, position_offset, out, call, check_position_ids=True):
        """Rotate validated NumPy arrays into ``out`` (allocated when None).

        ``call`` is ``(interleaved, rotary_dim, inverse, shape, layout)`` as validated.
        Positions are always checked on the CPU (a pass over ``[batch, seq_len]``
        integers): ``check_position_ids`` is accepted and ignored.
        """
        interleaved, rotary_dim, inverse, shape, layout = call
        result = _output(x, out)
        positions = _kernel_positions(position_ids, position_offset, cos.shape[0], shape)
        if x.size == 0:
            _check_positions_on_host(positions, position_ids, position_offset, cos.shape[0], shape)
            return result
        views = (_storage(bhsd(x, layout, shape)), _storage(bhsd(result, layout, shape)))
        args = (_storage(cos), _storage(sin), positions)
        status = _launch(views, args, interleaved, rotary_dim, inverse, in_place=out is x)
        if status == _cpu.OVERLAP:
            # Rare: the byte ranges of out and an input intersect. Copy the inputs that
            # really share memory with out, then launch without the range test.
            views, args = _separate_from_out(views, args)
            status = _launch(views, args, interleaved, rotary_dim, inverse, check_overlap=False)
        if status >= 0:
            _raise_position_error(status, position_ids, position_offset, cos.shape[0], shape)
        return result

    @staticmethod
    def run_qk(
        q,
        k,
        cos,
        sin,
        position_ids,
        position_offset,
        out_q,
        out_k,
        call,
        q_shape,
        k_shape,
        check_position_ids=True,
    ):
        """q and k in one pass (see :meth:`run`); ``q_shape``/``k_shape`` are logical."""
        interleaved, rotary_dim, inverse, _, layout = call
        result_q, result_k = _output(q, out_q), _output(k, out_k)
        positions = _kernel_positions(position_ids, position_offset, cos.shape[0], q_shape)
        if q.size + k.size == 0:
            _check_positions_on_host(
                positions, position_ids, position_offset, cos.shape[0], q_shape
            )
            return result_q, result_k
        qs = (_storage(bhsd(q, layout, q_shape)), _storage(bhsd(result_q, layout, q_shape)))
        ks = (_storage(bhsd(k, layout, k_shape)), _storage(bhsd(result_k, layout, k_shape)))
        args = (_storage(cos), _storage(sin), positions)
        in_place = _qk_in_place(q, k, out_q, out_k)
        status = _launch_qk(qs, ks, args, interleaved, rotary_dim, inverse, in_place=in_place)
        if status == _cpu.OVERLAP:
            if np.shares_memory(qs[1], ks[1]):
                raise ValueError("out_q and out_k share memory; give them separate buffers")
            qs, ks, args = _separate_qk_from_out(qs, ks, args)
            status = _launch_qk(qs, ks, args, interleaved, rotary_dim, inverse, check_overlap=False)
        if status >= 0:
            _raise_position_error(status, position_ids, position_offset, cos.shape[0], q_shape)
        return result_q, result_k


#: Plans of NumPy calls already validated, by :func:`plan_key`; see :func:`cpu_plan`.
CPU_PLANS: dict[tuple, Any] = {}

_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)

#: Most plans kept; past it the table starts again (a program uses a few shapes).
MAX_PLANS = 512


def plan_key(
    x, cos, sin, position_ids, out, interleaved, rotary_dim, layout, num_heads, inverse, offset=None
):
    """What a call's validation depends on (shapes, dtypes, options), or None if the
    call is not one a plan can run: every array a NumPy array, the options of exact
    types (``1`` and ``True`` hash alike but only ``True`` is valid), no offset or a
    Python ``int`` offset (its value is checked by the kernel)."""
    if (
        not (offset is None or type(offset) is int)
        or type(cos) is not np.ndarray
        or type(sin) is not np.ndarray
        or not (position_ids is None or type(position_ids) is np.ndarray)
        or not (out is None or type(out) is np.ndarray)
        or not (interleaved is False or interleaved is True)
        or not (inverse is False or inverse is True)
        or type(rotary_dim) is not int
        or type(layout) is not str
        or not (num_heads is None or type(num_heads) is int)
    ):
        return None
    return (
        x.shape,
        x.dtype,
        cos.shape,
        cos.dtype,
        sin.shape,
        sin.dtype,
        None if position_ids is None else position_ids.shape,
        None if position_ids is None else position_ids.dtype,
        None if out is None else out.shape,
        None if out is None else out.dtype,
        interleaved,
        rotary_dim,
        layout,
        num_heads,
        inverse,
        offset is None,
    )


def _storage_dtype(dtype: np.dtype) -> np.dtype | None:
    """The integer dtype a 16-bit format travels as, else None. Validation has admitted
    only float32/float64 and the two 16-bit formats, of which float16 has kind "f" and
    ml_dtypes' bfloat16 kind "V"."""
    if dtype.itemsize != 2:
        return None
    return np.dtype(FLOAT16_STORAGE if dtype.kind == "f" else BFLOAT16_STORAGE)


def cpu_plan(call, x, cos, position_ids) -> Any:
    """A function that runs further calls of this validated signature on one thread
    with the least Python work, or None where the general path is needed anyway.

    The plan takes the call's arrays and its ``int`` position offset (or None), and
    returns the result, or None when the general path must take over: an input too
    large for one thread or large enough to stream (``config.STREAMING_MIN_BYTES``), a
    read-only ``out``, an offset beyond int64, or a kernel
    status other than DONE (an overlap of ``out`` with an input, a bad position).
    Nothing has been written then, so the general path runs the call again from the
    start and raises or handles it.
    """
    interleaved, rotary_dim, inverse, shape, layout = call
    if x.size == 0 or (position_ids is not None and position_ids.dtype not in _KERNEL_ID_DTYPES):
        return None
    size = x.size
    x_item, cache_item = x.dtype.itemsize, cos.dtype.itemsize
    x_shape, x_dtype = x.shape, x.dtype
    x_storage, cache_storage = _storage_dtype(x.dtype), _storage_dtype(cos.dtype)
    words = _cpu.takes_words(x_storage, cache_storage)
    nbytes = x.nbytes
    to_bhsd = x.ndim == 3 or layout == "bshd"
    done = _cpu.DONE
    serials: dict[tuple[bool, int], Any] = {}  # by (contiguous, in_place)

    def plan(x, cos, sin, position_ids, out, offset=None):
        if size >= config.PARALLEL_MIN_ELEMENTS or nbytes >= config.STREAMING_MIN_BYTES:
            return None
        in_place = out is x
        if offset is not None:
            if not _INT64_MIN <= offset <= _INT64_MAX:
                return None
            position_ids = offset  # the kernels take one offset as is
        if out is None:
            out = np.empty(x_shape, x_dtype)
        elif not out.flags.writeable:
            return None
        x_view, out_view = x, out
        if to_bhsd:
            x_view, out_view = bhsd(x, layout, shape), bhsd(out, layout, shape)
        if x_storage is not None:
            x_view, out_view = x_view.view(x_storage), out_view.view(x_storage)
        if cache_storage is not None:
            cos, sin = cos.view(cache_storage), sin.view(cache_storage)
        contiguous = (  # C-contiguous arrays first: a flag is cheaper than the strides
            x.flags.c_contiguous
            and out.flags.c_contiguous
            and cos.flags.c_contiguous
            and sin.flags.c_contiguous
        ) or (
            x.strides[-1] == x_item
            and out.strides[-1] == x_item
            and cos.strides[-1] == cache_item
            and sin.strides[-1] == cache_item
        )
        serial = serials.get((contiguous, in_place))
        if serial is None:
            serial = _cpu.kernels(interleaved, inverse, contiguous, in_place, words)[0]
            serials[contiguous, in_place] = serial
        status = serial(
            x_view, cos, sin, position_ids, out_view, rotary_dim, True, config.TOKENS_PER_TILE, 1
        )
        return out if status == done else None

    return plan


def plan_key_qk(
    q, k, cos, sin, position_ids, out_q, out_k, options: tuple, offset=None
) -> tuple | None:
    """:func:`plan_key` for ``rotary_embedding_qk``; ``options`` are ``(interleaved,
    rotary_dim, layout, num_heads, num_kv_heads, inverse)``."""
    interleaved, rotary_dim, layout, num_heads, num_kv_heads, inverse = options
    key = plan_key(
        q,
        cos,
        sin,
        position_ids,
        out_q,
        interleaved,
        rotary_dim,
        layout,
        num_heads,
        inverse,
        offset,
    )
    if (
        key is None
        or type(k) is not np.ndarray
        or not (out_k is None or type(out_k) is np.ndarray)
        or not (num_kv_heads is None or type(num_kv_heads) is int)
    ):
        return None
    return (
        *key,
        k.shape,
        k.dtype,
        None if out_k is None else (out_k.shape, out_k.dtype),
        num_kv_heads,
    )


def cpu_plan_qk(call, q_shape, k_shape, q, k, cos, position_ids) -> Any:
    """:func:`cpu_plan` for ``rotary_embedding_qk`` (``q_shape``/``k_shape`` logical)."""
    interleaved, rotary_dim, inverse, _, layout = call
    if q.size + k.size == 0 or (
        position_ids is not None and position_ids.dtype not in _KERNEL_ID_DTYPES
    ):
        return None
    size = q.size + k.size
    item, cache_item = q.dtype.itemsize, cos.dtype.itemsize
    dtype, q_raw, k_raw = q.dtype, q.shape, k.shape
    storage, cache_storage = _storage_dtype(q.dtype), _storage_dtype(cos.dtype)
    words = _cpu.takes_words(storage, cache_storage)
    nbytes = q.nbytes + k.nbytes
    to_bhsd = q.ndim == 3 or layout == "bshd"
    done = _cpu.DONE
    serials: dict[tuple[bool, int], Any] = {}  # by (contiguous, in_place)

    def plan(q, k, cos, sin, position_ids, out_q, out_k, offset=None):
        if size >= config.PARALLEL_MIN_ELEMENTS or nbytes >= config.STREAMING_MIN_BYTES:
            return None
        if offset is not None:
            if not _INT64_MIN <= offset <= _INT64_MAX:
                return None
            position_ids = offset  # the kernels take one offset as is
        in_place = _qk_in_place(q, k, out_q, out_k)
        if out_q is None:
            out_q = np.empty(q_raw, dtype)
        elif not out_q.flags.writeable:
            return None
        if out_k is None:
            out_k = np.empty(k_raw, dtype)
        elif not out_k.flags.writeable:
            return None
        views = [q, out_q, k, out_k]
        if to_bhsd:
            views = [bhsd(v, layout, q_shape if i < 2 else k_shape) for i, v in enumerate(views)]
        if storage is not None:
            views = [v.view(storage) for v in views]
        if cache_storage is not None:
            cos, sin = cos.view(cache_storage), sin.view(cache_storage)
        contiguous = (  # C-contiguous arrays first: a flag is cheaper than the strides
            q.flags.c_contiguous
            and k.flags.c_contiguous
            and out_q.flags.c_contiguous
            and out_k.flags.c_contiguous
            and cos.flags.c_contiguous
            and sin.flags.c_contiguous
        ) or (
            q.strides[-1] == item
            and k.strides[-1] == item
            and out_q.strides[-1] == item
            and out_k.strides[-1] == item
            and cos.strides[-1] == cache_item
            and sin.strides[-1] == cache_item
        )
        serial = serials.get((contiguous, in_place))
        if serial is None:
            serial = _cpu.kernels(interleaved, inverse, contiguous, in_place, words)[2]
            serials[contiguous, in_place] = serial
        status = serial(
            views[0],
            views[2],
            cos,
            sin,
            position_ids,
            views[1],
            views[3],
            rotary_dim,
            True,
            config.TOKENS_PER_TILE,
            1,
        )
        return (out_q, out_k) if status == done else None

    return plan


def remember_plan(key: tuple, plan: Any) -> None:
    if len(CPU_PLANS) >= MAX_PLANS:
        CPU_PLANS.clear()
    CPU_PLANS[key] = plan


def _output(x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return np.empty(x.shape, dtype=x.dtype)
    if not out.flags.writeable:
        raise ValueError(
            "out is a read-only array; pass a writeable array (e.g. np.empty_like(input)) "
            "or omit out"
        )
    return out


def _kernel_positions(position_ids, position_offset, n_positions: int, shape) -> Any:
    """What the kernels take for positions: None, int32/int64 ids, int64 offsets, or
    one ``np.int64`` offset for the whole batch.

    Ids of other integer dtypes are range-checked as given (a uint64 id may not fit
    int64) before conversion; a scalar offset is checked here. Everything else is
    checked by the kernel before it writes.
    """
    seq_len = shape[2]
    if position_ids is not None:
        if position_ids.dtype in _KERNEL_ID_DTYPES:
            return position_ids
        bad = _cpu.first_bad_position(position_ids, n_positions)
        if bad >= 0:
            _raise_position_error(bad, position_ids, None, n_positions, shape)
        return position_ids.astype(np.int64)
    if position_offset is None:
        return None
    if is_scalar(position_offset) or np.ndim(position_offset) == 0:
        offset = int(position_offset)
        if seq_len and not 0 <= offset <= n_positions - seq_len:
            raise offset_error(None, offset, seq_len, n_positions)
        return np.int64(offset)
    offsets = np.asarray(position_offset)
    if offsets.dtype == np.uint64 and offsets.size and offsets.max() > np.iinfo(np.int64).max:
        b = int(np.argmax(offsets > np.iinfo(np.int64).max))
        raise offset_error(b, int(offsets[b]), seq_len, n_positions)
    return offsets.astype(np.int64)


def _check_positions_on_host(positions, position_ids, position_offset, n_positions, shape):
    """The kernels check positions before they write; with nothing to rotate (an empty
    input) no kernel runs, and bad positions are still an error."""
    if positions is None or isinstance(positions, np.integer):
        return  # none, or one offset: checked by _kernel_positions
    if positions.ndim == 2:
        bad = _cpu.first_bad_position(positions, n_positions)
    else:
        bad = int(_cpu._first_bad_offset(positions, n_positions, shape[2]))
    if bad >= 0:
        _raise_position_error(bad, position_ids, position_offset, n_positions, shape)


def _raise_position_error(index, position_ids, position_offset, n_positions, shape):
    if position_ids is not None:
        value = int(position_ids.reshape(-1)[index])
        raise position_error(index, tuple(position_ids.shape), value, n_positions)
    raise offset_error(index, int(np.asarray(position_offset)[index]), shape[2], n_positions)


def _launch(
    views, args, interleaved, rotary_dim, inverse, check_overlap=True, in_place=False
) -> int:
    x, out = views
    cos, sin, positions = args
    return _cpu._launch_cpu(
        x, cos, sin, positions, out, interleaved, rotary_dim, inverse, check_overlap, in_place
    )


def _qk_in_place(q, k, out_q, out_k) -> int:
    """The kernels' ``in_place`` flags: which of q and k are their own output."""
    return (out_q is q) * _cpu.X_IN_PLACE + (out_k is k) * _cpu.K_IN_PLACE


def _launch_qk(
    qs, ks, args, interleaved, rotary_dim, inverse, check_overlap=True, in_place=0
) -> int:
    cos, sin, positions = args
    return _cpu._launch_cpu_qk(
        qs[0],
        ks[0],
        cos,
        sin,
        positions,
        qs[1],
        ks[1],
        interleaved,
        rotary_dim,
        inverse,
        check_overlap,
        in_place,
    )


def _same_elements(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.strides == b.strides
    )


def _unshared(array, out):
    """``array``, or a copy of it if it really shares memory with ``out``."""
    if isinstance(array, np.ndarray) and np.shares_memory(array, out):
        return array.copy()
    return array


def _separate_from_out(views, args):
    """Copy the inputs that share memory with ``out`` (exactly tested), except an input
    that *is* ``out`` element for element: rotating in place is safe."""
    x, out = views
    if not _same_elements(x, out):
        x = _unshared(x, out)
    return (x, out), tuple(_unshared(a, out) for a in args)


def _separate_qk_from_out(qs, ks, args):
    (q, out_q), (k, out_k) = qs, ks
    if not _same_elements(q, out_q):
        q = _unshared(q, out_q)
    if not _same_elements(k, out_k):
        k = _unshared(k, out_k)
    q, k = _unshared(q, out_k), _unshared(k, out_q)
    args = tuple(_unshared(_unshared(a, out_q), out_k) for a in args)
    return (q, out_q), (k, out_k), args


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
    except the position check in :meth:`_positions` (one read-back).
    """

    name = "cuda"

    def __init__(
        self, arrays: tuple[Any, ...], names: tuple[str, ...] = ARGUMENT_NAMES, stream: Any = None
    ) -> None:
        from numba_rope import _cuda

        self._cuda = _cuda
        self._library: dict[int, str | None] = {id(a): _library(a) for a in arrays if a is not None}
        self._views: dict[tuple[int, int], Any] = {}
        ordinals: dict[int, str] = {}
        for name, array in zip(names, arrays, strict=True):
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

    def run(self, x, cos, sin, position_ids, position_offset, out, call, check_position_ids=True):
        """Rotate validated GPU arrays into ``out`` (allocated when None); see
        :meth:`CpuBackend.run`."""
        interleaved, rotary_dim, inverse, shape, layout = call
        if out is not None:
            self.check_writable(out)
        with self._on_device():
            positions = self._positions(
                position_ids, position_offset, cos.shape[0], shape, check_position_ids
            )
            result = self.empty_like(x) if out is None else out
            if 0 not in shape:
                geometry = self._cuda.bhsd_geometry(layout, shape)
                views = (self.view(x, geometry), self.view(result, geometry))
                self._launch(
                    views,
                    cos,
                    sin,
                    positions,
                    interleaved,
                    rotary_dim,
                    inverse,
                    self.dtype_of(x).name,
                )
        return result

    def run_qk(
        self,
        q,
        k,
        cos,
        sin,
        position_ids,
        position_offset,
        out_q,
        out_k,
        call,
        q_shape,
        k_shape,
        check_position_ids=True,
    ):
        """q and k in one launch; see :meth:`run`.

        When ``out_q``/``out_k`` are not the inputs themselves and their memory ranges
        meet another input's, the two tensors are rotated one after the other through
        :meth:`_launch`'s overlap handling instead (k copied first if out_q could
        overwrite it).
        """
        interleaved, rotary_dim, inverse, _, layout = call
        for out in (out_q, out_k):
            if out is not None:
                self.check_writable(out)
        cuda_ = self._cuda
        with self._on_device():
            positions = self._positions(
                position_ids, position_offset, cos.shape[0], q_shape, check_position_ids
            )
            result_q = self.empty_like(q) if out_q is None else out_q
            result_k = self.empty_like(k) if out_k is None else out_k
            if 0 in q_shape and 0 in k_shape:
                return result_q, result_k
            q_geometry = cuda_.bhsd_geometry(layout, q_shape)
            k_geometry = cuda_.bhsd_geometry(layout, k_shape)
            qs = (self.view(q, q_geometry), self.view(result_q, q_geometry))
            ks = (self.view(k, k_geometry), self.view(result_k, k_geometry))
            cos_view, sin_view = self.view(cos), self.view(sin)
            q_in_place = _same_view(*qs)
            k_in_place = _same_view(*ks)
            inputs = [cos_view, sin_view]
            if positions is not None and not _is_host_int(positions):
                inputs.append(positions)
            clash = (
                any(_views_intersect(v, qs[1]) for v in [*inputs, ks[0]])
                or any(_views_intersect(v, ks[1]) for v in [*inputs, qs[0]])
                or (not q_in_place and _views_intersect(qs[0], qs[1]))
                or (not k_in_place and _views_intersect(ks[0], ks[1]))
            )
            # q and k rotated in place (out_q is q, out_k is k) only ever write the
            # elements they read: views of one fused qkv buffer need no copy.
            if (
                q_in_place
                and k_in_place
                and not any(_views_intersect(v, o) for v in inputs for o in (qs[1], ks[1]))
            ):
                clash = False
            if not clash:
                cuda_._launch_cuda_qk(
                    qs[0],
                    ks[0],
                    cos_view,
                    sin_view,
                    positions,
                    qs[1],
                    ks[1],
                    interleaved,
                    rotary_dim,
                    input_dtype=self.dtype_of(q).name,
                    cache_dtype=self.dtype_of(cos).name,
                    q_in_place=q_in_place,
                    k_in_place=k_in_place,
                    stream=self.stream,
                    sign=-1.0 if inverse else 1.0,
                )
                return result_q, result_k
            k_input = ks[0]
            if _views_intersect(k_input, qs[1]):
                k_input = cuda_.device_array(k_input.shape, k_input.dtype, self.stream)
                cuda_.copy(ks[0], k_input, self.stream)
            name = self.dtype_of(q).name
            self._launch(qs, cos, sin, positions, interleaved, rotary_dim, inverse, name)
            self._launch(
                (k_input, ks[1]), cos, sin, positions, interleaved, rotary_dim, inverse, name
            )
        return result_q, result_k

    def _positions(self, position_ids, position_offset, n_positions, shape, check):
        """What the kernel takes for positions (a view, an int, or None), checked first
        unless ``check`` is False (then tokens with bad positions get NaN rows)."""
        seq_len = shape[2]
        if position_ids is not None:
            view = self.view(position_ids)
            if check:
                flat = self._cuda.first_bad_position(view, n_positions, self.stream, self.ordinal)
                if flat >= 0:
                    where = (flat // seq_len, flat % seq_len)
                    value = int(self._cuda.read_element(view, where))
                    raise position_error(flat, tuple(position_ids.shape), value, n_positions)
            return view
        if position_offset is None:
            return None
        if is_scalar(position_offset):
            offset = int(position_offset)
            out_of_range = seq_len and not 0 <= offset <= n_positions - seq_len
            # Unchecked offsets still have to fit the kernel's int64.
            if out_of_range and (check or not _INT64_MIN <= offset <= _INT64_MAX):
                raise offset_error(None, offset, seq_len, n_positions)
            return offset
        view = self.view(position_offset)
        if check and seq_len:
            column = self.view(position_offset, self._cuda.column_geometry)
            bad = self._cuda.first_bad_position(
                column, n_positions - seq_len + 1, self.stream, self.ordinal
            )
            if bad >= 0:
                value = int(self._cuda.read_element(view, (bad,)))
                raise offset_error(bad, value, seq_len, n_positions)
        return view

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

    def view(self, array: Any, transform: Any = None) -> Any:
        """A numba device array over ``array``'s memory in its kernel storage dtype (and
        the geometry ``transform`` gives, see :func:`numba_rope._cuda.numba_view`)."""
        key = (id(array), id(transform))
        view = self._views.get(key)
        if view is None:
            library = self._library[id(array)] or "cuda"
            view = self._cuda.numba_view(array, library, self._storage(array), transform)
            self._views[key] = view
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

    def _launch(
        self,
        views,
        cos,
        sin,
        positions,
        interleaved: bool,
        rotary_dim: int,
        inverse: bool,
        input_dtype: str,
    ) -> None:
        """One tensor: ``views`` are the BHSD input and output views."""
        cuda_ = self._cuda
        x, result = views
        cos_view, sin_view = self.view(cos), self.view(sin)
        in_place = _same_view(x, result)
        others = [cos_view, sin_view] + (
            [] if _is_host_int(positions) or positions is None else [positions]
        )
        others += [] if in_place else [x]
        overlaps = any(_views_intersect(v, result) for v in others)
        # Rotating in place is safe (each thread reads its elements before writing
        # them); any other overlap of out with an input goes through a fresh buffer.
        target = cuda_.device_array(result.shape, result.dtype, self.stream) if overlaps else result
        cuda_._launch_cuda(
            x,
            cos_view,
            sin_view,
            positions,
            target,
            interleaved,
            rotary_dim,
            input_dtype=input_dtype,
            cache_dtype=self.dtype_of(cos).name,
            in_place=in_place and not overlaps,
            stream=self.stream,
            sign=-1.0 if inverse else 1.0,
        )
        if overlaps:
            cuda_.copy(target, result, self.stream)


def _is_host_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer))


def _same_view(a: Any, b: Any) -> bool:
    """Two numba views of exactly the same elements (rotating in place)."""
    from numba_rope import _cuda

    return _cuda.byte_extent(a)[0] == _cuda.byte_extent(b)[0] and a.strides == b.strides


def _views_intersect(a: Any, b: Any) -> bool:
    from numba_rope import _cuda

    return _intersect(_cuda.byte_extent(a), _cuda.byte_extent(b))


def _intersect(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]
