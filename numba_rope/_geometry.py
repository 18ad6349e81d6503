"""Where an array's elements lie, for both devices: the BHSD view of any accepted form,
the bytes an array spans (to tell whether two arrays may share memory), and the finer
tests where spans cannot tell (an array's own elements apart, two tensors' rows apart).

Plain functions on shapes, strides and addresses: the CPU backend applies them to
NumPy arrays, the CUDA backend to the shapes and strides of device memory, and the CPU
kernels use compiled copies (:data:`byte_span_jit`, :data:`spans_meet_jit`,
:data:`token_rows_apart_jit`; :func:`elements_distinct` is callable from compiled code
as it is) in their overlap tests.
"""

from __future__ import annotations

from numba.extending import register_jitable

from numba_rope._jit import cached_njit

#: The axes of a ``[batch, seq_len, num_heads, head_size]`` array in BHSD order.
SWAP_HEADS_AND_TOKENS = (0, 2, 1, 3)


def bhsd_steps(
    ndim: int, layout: str, logical_shape: tuple[int, ...]
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """How an input or output of a validated call becomes a ``[batch, num_heads,
    seq_len, head_size]`` view, never a copy: ``(split, axes)``, a reshape to ``split``
    (3-D input: the last axis split into heads) and a transpose by ``axes``, each None
    when not needed."""
    if ndim == 3:
        batch, heads, seq_len, head_size = logical_shape
        return (batch, seq_len, heads, head_size), SWAP_HEADS_AND_TOKENS
    if layout == "bshd":
        return None, SWAP_HEADS_AND_TOKENS
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


@register_jitable  # a Python function, callable from compiled code too
def elements_distinct(shape, strides, itemsize) -> bool:
    """Whether no two elements of an array with this shape and these strides share a
    byte (a sufficient test: axes taken by increasing stride, each stride must step
    past everything the smaller ones reach). An array that fails may still be free of
    overlap in some exotic interleaving; such an output is refused all the same.
    Integers and tuples only: compiled code calls it too (``register_jitable``)."""
    for extent in shape:
        if extent == 0:
            return True
    reach = itemsize  # bytes covered by the axes taken so far, from one element on
    taken = 0  # bit i: axis i taken
    for _ in range(len(shape)):
        axis = -1  # the axis of least stride not taken yet, among those of extent > 1
        for i in range(len(shape)):
            if not (taken >> i) & 1 and shape[i] > 1:
                if axis < 0 or abs(strides[i]) < abs(strides[axis]):
                    axis = i
        if axis < 0:
            break
        taken |= 1 << axis
        if abs(strides[axis]) < reach:
            return False
        reach = abs(strides[axis]) * (shape[axis] - 1) + reach
    return True


def token_rows_apart(a_data, a_shape, a_strides, b_data, b_shape, b_strides, itemsize) -> bool:
    """Whether two BHSD arrays of one item size share no byte, proven by their rows,
    where :func:`spans_meet` cannot tell (q and k views of one fused qkv buffer: their
    spans interleave). Both arrays need contiguous rows of one head size, and the same
    batch and token axes (shapes and strides); then either each holds a token's heads
    as one run of bytes (heads one after the other: ``bshd`` and 3-D tensors), or both
    have the same heads axis too and a run is one head's row. The two arrays' runs at
    one index lie in one block, from the first run's start to the last run's end; when
    the blocks of different indices share no byte, the arrays meet exactly where the
    runs at one index do. False when it cannot tell."""
    row = a_shape[3] * itemsize
    if (
        a_shape[3] != b_shape[3]
        or (a_shape[3] > 1 and (a_strides[3] != itemsize or b_strides[3] != itemsize))
        or a_shape[0] != b_shape[0]
        or a_shape[2] != b_shape[2]
        or (a_shape[0] > 1 and a_strides[0] != b_strides[0])
        or (a_shape[2] > 1 and a_strides[2] != b_strides[2])
    ):
        return False
    if (a_shape[1] == 1 or a_strides[1] == row) and (b_shape[1] == 1 or b_strides[1] == row):
        a_run, b_run, heads, head_step = a_shape[1] * row, b_shape[1] * row, 1, 0
    elif a_shape[1] == b_shape[1] and a_strides[1] == b_strides[1]:
        a_run, b_run, heads, head_step = row, row, a_shape[1], a_strides[1]
    else:
        return False
    if a_data < b_data + b_run and b_data < a_data + a_run:
        return False  # the runs at one index meet
    block = max(a_data + a_run, b_data + b_run) - min(a_data, b_data)
    return elements_distinct(
        (a_shape[0], heads, a_shape[2]), (a_strides[0], head_step, a_strides[2]), block
    )


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


#: The same functions compiled for the CPU kernels (integers and tuples only: each is
#: compiled once per number of axes, whatever the dtypes of a call).
byte_span_jit = cached_njit()(byte_span)
spans_meet_jit = cached_njit()(spans_meet)
token_rows_apart_jit = cached_njit()(token_rows_apart)
