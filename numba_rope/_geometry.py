"""Where an array's elements lie, for both devices: the BHSD view of any accepted form,
and the bytes an array spans (to tell whether two arrays may share memory).

Plain functions on shapes, strides and addresses: the CPU backend applies them to
NumPy arrays, the CUDA backend to the shapes and strides of device memory, and the CPU
kernels use compiled copies of the span functions (:data:`byte_span_jit`,
:data:`spans_meet_jit`) in their overlap test.
"""

from __future__ import annotations

from numba_rope._jit import cached_njit

#: The axes of a ``[batch, seq_len, num_heads, head_size]`` array in BHSD order.
_SWAP_HEADS_AND_TOKENS = (0, 2, 1, 3)


def bhsd_steps(
    ndim: int, layout: str, logical_shape: tuple[int, ...]
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """How an input or output of a validated call becomes a ``[batch, num_heads,
    seq_len, head_size]`` view, never a copy: ``(split, axes)``, a reshape to ``split``
    (3-D input: the last axis split into heads) and a transpose by ``axes``, each None
    when not needed."""
    if ndim == 3:
        batch, heads, seq_len, head_size = logical_shape
        return (batch, seq_len, heads, head_size), _SWAP_HEADS_AND_TOKENS
    if layout == "bshd":
        return None, _SWAP_HEADS_AND_TOKENS
    return None, None


def bhsd_array(array, layout: str, logical_shape: tuple[int, ...]):
    """The BHSD view of an array with NumPy's ``reshape``/``transpose`` (NumPy, CuPy)."""
    split, axes = bhsd_steps(array.ndim, layout, logical_shape)
    if split is not None:
        array = array.reshape(split)  # splits the last axis: always a view
    if axes is not None:
        array = array.transpose(axes)
    return array


def bhsd_geometry(
    shape: tuple[int, ...], strides: tuple[int, ...], layout: str, logical_shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:func:`bhsd_array` on a shape and its strides (in bytes), for memory that has no
    NumPy-like array object (numba device arrays cannot transpose 4-D views)."""
    split, axes = bhsd_steps(len(shape), layout, logical_shape)
    if split is not None:
        *outer, channel_step = strides
        head_size = split[-1]
        shape, strides = split, (*outer, head_size * channel_step, channel_step)
    if axes is not None:
        shape = tuple(shape[axis] for axis in axes)
        strides = tuple(strides[axis] for axis in axes)
    return tuple(shape), tuple(strides)


def elements_distinct(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether no two elements of an array with this shape and these strides share a
    byte (a sufficient test: axes sorted by stride, each stride must step past
    everything the smaller ones reach). An array that fails may still be free of
    overlap in some exotic interleaving; such an output is refused all the same."""
    if 0 in shape:
        return True
    reach = itemsize  # bytes covered by the axes taken so far, from one element on
    for extent, stride in sorted(
        ((n, abs(step)) for n, step in zip(shape, strides, strict=True) if n > 1),
        key=lambda axis: axis[1],
    ):
        if stride < reach:
            return False
        reach = stride * (extent - 1) + reach
    return True


def byte_span(data, shape, strides, itemsize):
    """``[first, end)`` bytes spanned by the array at address ``data`` with this shape,
    these strides and item size; ``(0, 0)`` for an empty array, which meets nothing.
    Integers only, so that its compiled copy is compiled once per number of axes,
    whatever the dtypes of a call."""
    first = data
    end = data
    for axis in range(len(shape)):
        if shape[axis] == 0:
            return 0, 0
        span = (shape[axis] - 1) * strides[axis]
        if span < 0:
            first += span
        else:
            end += span
    return first, end + itemsize


def spans_meet(a, b):
    """Whether byte ranges ``a`` and ``b`` intersect (a cheap, conservative test:
    interleaved views of one buffer, such as q and k of a fused qkv, do too)."""
    return a[0] < b[1] and b[0] < a[1]


#: The same functions compiled for the CPU kernels.
byte_span_jit = cached_njit()(byte_span)
spans_meet_jit = cached_njit()(spans_meet)
