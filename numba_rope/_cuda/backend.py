"""The CUDA backend: GPU arrays in, the caller's array type out, computed by the
kernels of :mod:`numba_rope._cuda.kernels`.

Imported only when a call's arrays are on the GPU (importing ``numba.cuda`` costs
time). A :class:`CudaBackend` lives for one call: it holds the call's stream and GPU,
makes numba views of the caller's arrays (CuPy, torch, Numba device arrays, any
``__cuda_array_interface__`` exporter; bfloat16 as ``uint16``) without copying them,
allocates results of the caller's library, checks positions (one small kernel and one
read-back, unless the caller skips it), and launches one kernel for one tensor or
several. CuPy and torch are never imported here unless the caller passed their arrays.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any

import numpy as np
from numba import cuda

from numba_rope import config
from numba_rope._autograd import check_unrecorded, forward_ad_active
from numba_rope._cuda.kernels import (
    SIMULATOR,
    copy_cuda,
    first_bad_position_cuda,
    rope_kernel,
)
from numba_rope._geometry import (
    bhsd_geometry,
    byte_span,
    elements_distinct,
    spans_meet,
    token_rows_apart,
)
from numba_rope._validation import (
    Call,
    check_one_gpu,
    check_stream,
    check_torch_dtype,
    kernel_offset,
    offset_error,
    position_error,
    shared_outputs_error,
)

name = "cuda"

#: Most blocks per grid dimension the launch uses on y (a hardware limit) and its
#: default limit on x; ``config.CUDA_MAX_BLOCKS`` may lower both.
_HARDWARE_MAX_BLOCKS = 65535

#: Fewest blocks a launch gets on a GPU (where ``config.CUDA_MAX_BLOCKS`` allows): numba-cuda
#: warns of low occupancy (``NumbaPerformanceWarning``) for any grid of fewer, and a
#: caller running with warnings as errors would have small calls raise. Blocks past the
#: work find none in their grid-stride loops and exit. In the simulator (no such
#: warning; a Python thread per simulated thread) launches take only what they need.
MIN_GRID_BLOCKS = 1 if SIMULATOR else 128

#: On the GPU float16 is native; bfloat16 travels as its bits.
_GPU_STORAGE = {"bfloat16": np.dtype(np.uint16)}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_torch_dtypes: dict[Any, np.dtype] = {}


def _torch_dtype(dtype: Any) -> np.dtype:
    """The NumPy dtype of a torch dtype (bfloat16 as ``ml_dtypes.bfloat16``)."""
    found = _torch_dtypes.get(dtype)
    if found is not None:
        return found
    name = str(dtype).removeprefix("torch.")
    numpy_dtype = None
    try:
        if name == "bfloat16":
            import ml_dtypes  # not at import time: it costs more than the rest of numba_rope

            numpy_dtype = np.dtype(ml_dtypes.bfloat16)
        else:
            numpy_dtype = np.dtype(name)
    except TypeError:
        pass
    found = _torch_dtypes[dtype] = check_torch_dtype(dtype, numpy_dtype)
    return found


def _device_ordinal(array: Any, library: str | None) -> int | None:
    """The GPU an array lives on, where its library says so without a device query."""
    if library == "torch":
        return array.device.index
    if library == "cupy":
        return array.device.id
    return None


class CudaBackend:
    """One call's GPU work: its stream, its GPU, numba views of its arrays.

    The stream is, unless ``stream=`` overrides it, torch's current stream for torch
    input, CuPy's current stream for CuPy input, else Numba's default stream. Nothing
    here synchronizes, except the position check in :meth:`_positions` (one read-back).
    """

    name = "cuda"

    def __init__(
        self,
        arrays: tuple[Any, ...],
        names: tuple[str, ...],
        libraries: tuple[str | None, ...],
        stream: Any = None,
    ) -> None:
        self._library: dict[int, str | None] = {
            id(a): library for a, library in zip(arrays, libraries, strict=True) if a is not None
        }
        self._views: dict[tuple[int, Any], Any] = {}
        ordinals: dict[int, str] = {}
        forward_mode = None
        for argument_name, array in zip(names, arrays, strict=True):
            if array is not None and self._library[id(array)] == "torch":
                # What records autograd is refused, as on the CPU (torch_host).
                if forward_mode is None:
                    forward_mode = forward_ad_active()
                check_unrecorded(array, argument_name, forward_mode)
            if array is not None:
                ordinal = _device_ordinal(array, self._library[id(array)])
                if ordinal is not None:
                    ordinals.setdefault(ordinal, argument_name)
        check_one_gpu(ordinals)
        self.ordinal = next(iter(ordinals), None)
        if stream is not None:
            self.stream = as_numba_stream(stream, self.ordinal)
        else:
            self.stream = numba_stream(self._default_stream_handle(arrays[0]), self.ordinal)
        self._wait_for_exporters(arrays, libraries)

    def _wait_for_exporters(
        self, arrays: tuple[Any, ...], libraries: tuple[str | None, ...]
    ) -> None:
        """Synchronize the streams that generic ``__cuda_array_interface__`` exporters
        name (version 3's ``stream``: the stream on which their data may be used),
        other than the call's own, as the interface asks of a consumer: the kernels then
        read what the exporter's work wrote. Each stream once; none for exporters that
        name none (``None``, or an interface before version 3). Numba device arrays,
        CuPy arrays and torch tensors are read through their own attributes, on the
        call's stream (their library's current stream, see :meth:`_default_stream_handle`),
        as before."""
        handles = {
            exported_stream(array)
            for array, library in zip(arrays, libraries, strict=True)
            if library == "cuda"
        }
        for handle in sorted(handle for handle in handles if handle is not None):
            stream = numba_stream(handle, self.ordinal)
            if stream is not self.stream:
                stream.synchronize()

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
        return cuda.gpus[self.ordinal]

    def describe(self, array: Any) -> tuple[Any, ...] | None:
        """``(shape, dtype)`` of an argument for validation, None for an absent one."""
        if array is None:
            return None
        return self.shape_of(array), self.dtype_of(array)

    def shape_of(self, array: Any) -> tuple[int, ...]:
        """An argument's shape: its ``shape``, or for a generic exporter the one its
        ``__cuda_array_interface__`` gives (the interface needs no ``shape`` attribute)."""
        if self._library.get(id(array)) == "cuda":
            return tuple(array.__cuda_array_interface__["shape"])
        return tuple(array.shape)

    def describe_out(self, array: Any) -> tuple[Any, ...] | None:
        """``(shape, dtype, writeable, distinct)`` of an output, None for an absent
        one: only a generic ``__cuda_array_interface__`` exporter can say it is
        read-only."""
        if array is None:
            return None
        read_only = self._library[id(array)] == "cuda" and array.__cuda_array_interface__["data"][1]
        view = self.view(array)
        distinct = elements_distinct(view.shape, view.strides, view.dtype.itemsize)
        return self.shape_of(array), self.dtype_of(array), not read_only, distinct

    def run(
        self,
        call: Call,
        inputs: tuple,
        outs: tuple,
        cos: Any,
        sin: Any,
        position_ids: Any,
        position_offset: Any,
        check_position_ids: bool = True,
    ) -> tuple:
        """Rotate the validated GPU tensors ``inputs`` into ``outs`` (allocated where
        None) and return the outputs.

        Several tensors (q and k) go in one launch. When an output's memory range meets
        an input other than its own in place, the tensors are rotated one after the
        other instead, an output that meets its own input or the caches through a
        fresh buffer, and a later input that an earlier output could overwrite copied
        first.
        """
        with self._on_device():
            positions = self._positions(call, position_ids, position_offset, check_position_ids)
            results = tuple(
                self.empty_like(x) if out is None else out
                for x, out in zip(inputs, outs, strict=True)
            )
            if all(0 in shape for shape in call.shapes):
                return results
            pairs = [
                (self.view(x, (call.layout, shape)), self.view(result, (call.layout, shape)))
                for x, result, shape in zip(inputs, results, call.shapes, strict=True)
            ]
            caches = (self.view(cos), self.view(sin))
            others = [*caches]
            if positions is not None and not isinstance(positions, (int, np.integer)):
                others.append(positions)
            in_place = [_same_view(x, out) for x, out in pairs]
            if len(pairs) == 2 and _views_share(pairs[0][1], pairs[1][1]):
                raise shared_outputs_error()
            # Rotating in place leaves the pass-through channels alone, except when
            # unchecked positions may be bad: their rows come out NaN, every channel.
            leaves = [own and (check_position_ids or call.positions == "token") for own in in_place]
            if not _clash(pairs, others, in_place):
                self._launch(pairs, caches, positions, call, leaves)
                return results
            for i, (x, out) in enumerate(pairs):
                for j in range(i + 1, len(pairs)):
                    later = pairs[j][0]
                    if _views_intersect(later, out):
                        copied = device_array(later.shape, later.dtype, self.stream)
                        copy(later, copied, self.stream)
                        pairs[j] = (copied, pairs[j][1])
                self._launch_through_buffer(x, out, caches, positions, call, others, leaves[i])
        return results

    def _launch_through_buffer(
        self, x, out, caches, positions, call: Call, others, leave_pass_through: bool
    ) -> None:
        """One tensor; when ``out`` meets an input other than as the very same elements
        (rotating in place is safe: each thread reads its elements before writing them),
        the kernel writes a fresh buffer that is then copied into ``out``."""
        in_place = _same_view(x, out)
        overlaps = any(_views_intersect(v, out) for v in [*others, *([] if in_place else [x])])
        target = device_array(out.shape, out.dtype, self.stream) if overlaps else out
        self._launch([(x, target)], caches, positions, call, [leave_pass_through and not overlaps])
        if overlaps:
            copy(target, out, self.stream)

    def _launch(self, pairs, caches, positions, call: Call, leave_pass_through) -> None:
        """One launch over ``(input, output)`` view pairs of one or two tensors;
        ``leave_pass_through``: per pair, whether the channels past ``rotary_dim`` are
        left alone (rotating in place with checked positions) rather than copied."""
        heads_per_thread = max(1, int(config.CUDA_HEADS_PER_THREAD))
        half = call.rotary_dim // 2
        slots, groups = [], []
        for (x, _), leave in zip(pairs, leave_pass_through, strict=True):
            # A slot per pair, and per pass-through channel unless they are left alone.
            slots.append(half if leave else half + x.shape[3] - call.rotary_dim)
            groups.append(_cdiv(x.shape[1], heads_per_thread))
        if max(slots) == 0:
            return
        kind = call.positions
        if kind == "offset":
            positions = np.int64(positions)
        elif kind == "token":
            positions = caches[0]  # a real launch cannot marshal None: never read
        compute = np.float64 if call.dtype.name == "float64" else np.float32
        sign = compute(-1.0 if call.inverse else 1.0)
        kernel = rope_kernel(call.dtype.name, call.cache_dtype.name, kind, heads_per_thread)
        (q, out_q), (k, out_k) = pairs[0], pairs[-1]
        slots_k = slots[1] if len(pairs) > 1 else 0
        x = pairs[0][0]
        grid, block = _grid(x.shape[0] * x.shape[2], max(slots), sum(groups))
        kernel[grid, block, self.stream](
            q, k, *caches, positions, out_q, out_k, call.interleaved, call.rotary_dim,
            slots[0], slots_k, sum(groups), sign,
        )  # fmt: skip

    def _positions(self, call: Call, position_ids, position_offset, check: bool):
        """What the kernel takes for positions (a view, an int, or None), checked first
        unless ``check`` is False (then tokens with bad positions get NaN rows)."""
        seq_len, n_positions = call.seq_len, call.n_positions
        if call.positions == "ids":
            view = self.view(position_ids)
            if check:
                flat = first_bad_position(view, n_positions, self.stream, self.ordinal)
                if flat >= 0:
                    value = int(view[flat // seq_len, flat % seq_len])
                    raise position_error(flat, self.shape_of(position_ids), value, n_positions)
            return view
        if call.positions == "offset":
            offset = position_offset  # an int, or a 0-d array (CuPy, torch: int() reads it)
            if hasattr(offset, "copy_to_host"):  # a 0-d Numba device array has no int()
                offset = offset.copy_to_host()
            # An empty batch has no position to check, as an empty sequence has none.
            return kernel_offset(int(offset), seq_len if call.batch else 0, n_positions, check)
        if call.positions == "offsets":
            view = self.view(position_offset)
            if check and seq_len:
                column = self.view(position_offset, "column")
                bad = first_bad_position(
                    column, n_positions - seq_len + 1, self.stream, self.ordinal
                )
                if bad >= 0:
                    raise offset_error(bad, int(view[bad]), seq_len, n_positions)
            return view
        return None

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

    def view(self, array: Any, geometry: Any = None) -> Any:
        """A numba device array over ``array``'s memory in its kernel storage dtype:
        as it is, as a BHSD view (``geometry`` = ``(layout, logical shape)``), or
        ``"column"``: ``[n]`` as ``[n, 1]`` (per-batch offsets checked by the
        position-id kernel)."""
        key = (id(array), geometry)
        view = self._views.get(key)
        if view is None:
            transform = None
            if geometry == "column":
                transform = _column_geometry
            elif geometry is not None:
                layout, logical_shape = geometry

                def transform(shape, strides):
                    return bhsd_geometry(shape, strides, layout, logical_shape)

            library = self._library[id(array)] or "cuda"
            view = numba_view(array, library, self._storage(array), transform)
            self._views[key] = view
        return view

    def empty_like(self, x: Any) -> Any:
        """A new C-contiguous array of ``x``'s library, shape and dtype, on its GPU."""
        library = self._library[id(x)]
        shape = self.shape_of(x)
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
                result = device_array(shape, self.dtype_of(x), self.stream)
        self._library[id(result)] = library
        return result


def _clash(pairs, others, in_place) -> bool:
    """Whether one launch over all pairs could read what it has already written: an
    output meets the caches or positions, an input of another tensor, or its own input
    other than in place. Tensors that are all rotated in place (views of one fused qkv
    buffer, whose byte ranges interleave) only ever write the elements they read."""
    for i, (x, out) in enumerate(pairs):
        if any(_views_intersect(v, out) for v in others):
            return True
        if not in_place[i] and _views_intersect(x, out):
            return True
        if not all(in_place) and any(
            _views_intersect(pairs[j][0], out) for j in range(len(pairs)) if j != i
        ):
            return True
    return False


def _same_view(a: Any, b: Any) -> bool:
    """Two numba views of exactly the same elements (rotating in place)."""
    return _pointer(a) == _pointer(b) and a.strides == b.strides and a.shape == b.shape


def _views_intersect(a: Any, b: Any) -> bool:
    return spans_meet(byte_extent(a), byte_extent(b))


def _views_share(a: Any, b: Any) -> bool:
    """Whether two BHSD numba views share a byte, exactly, as the CPU backend tells its
    outputs apart: their byte ranges; where those meet, their rows (views of one fused
    qkv buffer, :func:`token_rows_apart`); where that cannot tell, NumPy's exact test on
    host arrays of the same geometry at the same addresses (:class:`_Geometry`:
    ``np.shares_memory`` only computes with the addresses)."""
    if not _views_intersect(a, b):
        return False
    itemsize = a.dtype.itemsize
    if b.dtype.itemsize == itemsize and token_rows_apart(
        _pointer(a), a.shape, a.strides, _pointer(b), b.shape, b.strides, itemsize
    ):
        return False
    return bool(np.shares_memory(np.asarray(_Geometry(a)), np.asarray(_Geometry(b))))


class _Geometry:
    """The NumPy array interface of a numba view's shape, strides and address, for
    :func:`_views_share`: an array over it is never read (it is device memory)."""

    def __init__(self, view: Any) -> None:
        self.__array_interface__ = {
            "shape": tuple(view.shape),
            "strides": tuple(view.strides),
            "typestr": f"|V{view.dtype.itemsize}",
            "data": (_pointer(view), True),
            "version": 3,
        }


def _max_blocks() -> int:
    return max(1, min(int(config.CUDA_MAX_BLOCKS), _HARDWARE_MAX_BLOCKS))


def _blocks(needed: int, other: int = 1) -> int:
    """Blocks on x for ``needed`` blocks of work, when the other dimension has ``other``:
    at least enough for :data:`MIN_GRID_BLOCKS` in all, at most the configured limit."""
    return min(max(needed, _cdiv(MIN_GRID_BLOCKS, other)), _max_blocks())


def _grid(n_tokens: int, n_slots: int, n_groups: int):
    threads = max(1, int(config.CUDA_THREADS_PER_BLOCK))
    slot_threads = min(threads, max(1, n_slots))
    token_threads = max(1, threads // slot_threads)
    groups = min(n_groups, _max_blocks())
    grid = (_blocks(_cdiv(n_tokens, token_threads), groups), groups)
    return grid, (slot_threads, token_threads)


def copy(source, destination, stream) -> None:
    """Strided device-to-device copy of 4-D arrays (used when an output overlaps an input)."""
    threads = max(1, int(config.CUDA_THREADS_PER_BLOCK))
    copy_cuda[_blocks(_cdiv(source.size, threads)), threads, stream](source, destination)


# -- position-id check: one tiny kernel, one read-back ---------------------------------

_flags = threading.local()

#: The device flag's value when no bad id was found: the kernel only lowers it.
NONE_FOUND = np.iinfo(np.int64).max


class _Flag:
    """A thread's device flag and pinned host copy on one device. The flag holds
    :data:`NONE_FOUND` between calls, so a call launches the check and reads the flag
    back, with no copy to the device first; ``clean`` is False from the launch until
    the read-back found nothing. A call that found a bad id, or that raised between the
    two (an interrupt), leaves it False, and the next call takes a fresh flag: the
    lowered one may still be read by a kernel in flight on another stream."""

    def __init__(self) -> None:
        self.device = cuda.to_device(np.full(1, NONE_FOUND, np.int64))
        self.host = cuda.pinned_array(1, np.int64)
        self.clean = True


def _flag(ordinal) -> _Flag:
    """This thread's clean :class:`_Flag` for a device (a fresh one if the last call
    left it lowered)."""
    flags = getattr(_flags, "by_device", None)
    if flags is None:
        flags = _flags.by_device = {}
    flag = flags.get(ordinal)
    if flag is None or not flag.clean:
        flag = flags[ordinal] = _Flag()
    return flag


def first_bad_position(position_ids, n_positions: int, stream, ordinal=None) -> int:
    """Flat index of the first out-of-range id in a device array of ids, or -1.

    Synchronizes ``stream`` (the one read-back of a checked call). The grid is padded
    like the rotation's (:data:`MIN_GRID_BLOCKS`), and the flag is not reset from the
    host before each call (:class:`_Flag`): one numba-cuda copy between device arrays
    took 111 µs of host time on the H200's machine (a copy from the host was not timed
    apart; docs/performance.md, "GPU").
    """
    n_ids = position_ids.shape[0] * position_ids.shape[1]
    if n_ids == 0:
        return -1
    flag = _flag(ordinal)
    flag.clean = False
    threads = max(1, min(int(config.CUDA_THREADS_PER_BLOCK), 1024, n_ids))
    blocks = _blocks(_cdiv(n_ids, threads))
    first_bad_position_cuda[blocks, threads, stream](position_ids, n_positions, flag.device)
    flag.device.copy_to_host(flag.host, stream=stream)
    stream.synchronize()
    flat = int(flag.host[0])
    if flat == NONE_FOUND:
        flag.clean = True
        return -1
    return flat


# -- streams -----------------------------------------------------------------------------

_streams: dict[tuple[Any, int], Any] = {}
_default_streams: set[int] = set()  # ids of the default streams of _streams (kept alive)


def numba_stream(handle: int | None, ordinal=None):
    """A numba stream for a raw ``cudaStream_t`` handle (``None``/0: the default stream).

    External streams are cached by handle; in the simulator every stream is the default.
    """
    key = (ordinal, int(handle or 0))
    stream = _streams.get(key)
    if stream is None:
        default = SIMULATOR or not key[1]
        made = cuda.default_stream() if default else cuda.external_stream(key[1])
        stream = _streams.setdefault(key, made)  # one stream per key, even in a race
        if default:
            _default_streams.add(id(stream))  # _streams keeps it alive: the id stays its own
    return stream


def as_numba_stream(stream: Any, ordinal=None):
    """Accept a numba stream, a torch or CuPy stream, or a raw handle (int)."""
    if stream is None:
        return numba_stream(0, ordinal)
    if isinstance(stream, int):
        return numba_stream(stream, ordinal)
    for attribute in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        handle = getattr(stream, attribute, None)
        if isinstance(handle, int):
            return numba_stream(handle, ordinal)
    numba_stream_given = hasattr(stream, "synchronize") and (SIMULATOR or hasattr(stream, "handle"))
    check_stream(numba_stream_given, f"{type(stream).__module__}.{type(stream).__qualname__}")
    return stream  # already a numba stream


# -- device arrays: numba views of any array library, results of the caller's type --------


def _column_geometry(shape, strides):
    """``[n]`` as ``[n, 1]`` (per-batch offsets checked by the position-id kernel)."""
    return (shape[0], 1), (strides[0], strides[0])


def _c_strides(shape, itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def numba_view(array: Any, library: str, storage: np.dtype, transform=None):
    """A numba device array over the same memory, with element type ``storage`` and,
    if given, the shape and strides ``transform(shape, strides)`` (strides in bytes).

    Never copies, never synchronizes: the kernels run on the caller's stream, which
    orders them after the work that produced the arrays.
    """
    if library == "numba" and transform is not None:
        here = tuple(array.shape), tuple(array.strides)
        if transform(*here) == here:  # the array itself: no new numba array (its
            transform = None  # making costs 9.5 us of host time on an H200 machine)
    if library == "numba" and (SIMULATOR or transform is None):
        if SIMULATOR and transform is not None:
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            host = array._ary  # the simulator's device array wraps a NumPy array
            shape, strides = transform(host.shape, host.strides)
            host = np.lib.stride_tricks.as_strided(host, shape=shape, strides=strides)
            array = FakeCUDAArray(host)
        return array if array.dtype == storage else array.view(storage)
    if library == "torch":
        itemsize = storage.itemsize
        shape = tuple(array.shape)
        strides = tuple(step * itemsize for step in array.stride())
        pointer = array.data_ptr()
    elif library == "cupy":
        shape, strides, pointer = tuple(array.shape), tuple(array.strides), array.data.ptr
    elif library == "numba":
        # Its own attributes: its __cuda_array_interface__ builds a dict, and in
        # numba-cuda 0.30 on Python 3.12 warns (DeprecationWarning) for an array
        # allocated on a stream.
        shape, strides, pointer = tuple(array.shape), tuple(array.strides), _pointer(array)
    else:
        interface = array.__cuda_array_interface__
        shape, pointer = tuple(interface["shape"]), interface["data"][0]
        strides = interface.get("strides") or _c_strides(shape, storage.itemsize)
    if transform is not None:
        shape, strides = transform(shape, tuple(strides))
    if SIMULATOR:  # a generic exporter (the others returned above): no device memory
        return _simulated_view(pointer, tuple(shape), tuple(strides), storage)
    description = {
        "shape": tuple(shape),
        "strides": tuple(strides),
        "data": (pointer, False),
        "typestr": storage.str,
        "version": 3,
    }
    return cuda.from_cuda_array_interface(description, owner=array, sync=False)


def exported_stream(array: Any) -> int | None:
    """The stream a ``__cuda_array_interface__`` exporter names for its data (version
    3's optional ``stream``: 1 the legacy default stream, 2 the per-thread one, else a
    ``cudaStream_t``), or None where it names none."""
    stream = array.__cuda_array_interface__.get("stream")
    return None if stream is None else int(stream)


def _simulated_view(pointer: int, shape: tuple, strides: tuple, storage: np.dtype) -> Any:
    """In the CUDA simulator, whose device memory is host memory: a simulated device
    array over the bytes an exporter's interface describes (the simulator has no
    ``from_cuda_array_interface``). The exporter keeps the memory alive for the call."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    first, end = byte_span(pointer, shape, strides, storage.itemsize)
    if end == first:  # no elements: nothing to point at
        return FakeCUDAArray(np.empty(shape, storage))
    memory = (ctypes.c_char * (end - first)).from_address(first)
    host = np.ndarray(shape, storage, buffer=memory, offset=pointer - first, strides=strides)
    return FakeCUDAArray(host)


def _pointer(view) -> int:
    if SIMULATOR:
        return view._ary.__array_interface__["data"][0]
    return view.device_ctypes_pointer.value or 0


def byte_extent(view) -> tuple[int, int]:
    """``[first, end)`` bytes of device memory a numba view can touch (empty: (0, 0))."""
    return byte_span(_pointer(view), view.shape, view.strides, view.dtype.itemsize)


def device_array(shape: tuple[int, ...], dtype: np.dtype, stream):
    # On the default stream, the array is made without one, as cuda.device_array(shape)
    # makes it: numba-cuda 0.30's __cuda_array_interface__ of an array holding numba's
    # default stream object warns (DeprecationWarning: int() of a CUstream_flags), and
    # CuPy and torch read that interface.
    on = 0 if id(stream) in _default_streams else stream
    return cuda.device_array(shape, dtype=dtype, stream=on)
