"""Every check of a call, in one place, before any kernel runs.

The checks see only shapes and dtypes (NumPy dtype objects, whatever the device), so
the same rules and the same messages hold on the CPU and on the GPU. Each error says
what is wrong, the value received and what would be accepted.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import numpy as np

#: Input dtypes the operator accepts, by name (bfloat16 is ``ml_dtypes.bfloat16``).
INPUT_DTYPES = ("float32", "float16", "bfloat16", "float64")

#: Cache dtypes accepted for each input dtype: the input's own, or more precise float32.
CACHE_DTYPES = {
    "float32": ("float32",),
    "float16": ("float16", "float32"),
    "bfloat16": ("bfloat16", "float32"),
    "float64": ("float64", "float32"),
}


def check_dtype(dtype: np.dtype) -> str:
    """Return the name of a supported input dtype, or raise ``TypeError``."""
    name = dtype.name
    if name not in INPUT_DTYPES:
        raise TypeError(
            f"input has dtype {name}; rotary_embedding accepts {', '.join(INPUT_DTYPES)} "
            f"(bfloat16 as ml_dtypes.bfloat16); convert it with .astype(np.float32)"
        )
    return name


def check_rotary_dim(rotary_embedding_dim: Any, head_size: int) -> int:
    """Return the number of rotated channels, or raise ``TypeError``/``ValueError``."""
    if isinstance(rotary_embedding_dim, (bool, np.bool_)):
        raise TypeError(
            f"rotary_embedding_dim must be an integer, got {rotary_embedding_dim!r}; "
            f"pass 0 for the whole head or an even number of channels"
        )
    try:
        rotary_dim = operator.index(rotary_embedding_dim)
    except TypeError:
        raise TypeError(
            f"rotary_embedding_dim must be an integer, got {rotary_embedding_dim!r} "
            f"of type {type(rotary_embedding_dim).__name__}"
        ) from None
    if rotary_dim < 0 or rotary_dim > head_size:
        raise ValueError(
            f"rotary_embedding_dim must be 0 (the whole head) or between 2 and the head "
            f"size {head_size}, got {rotary_dim}"
        )
    if rotary_dim == 0:
        if head_size % 2:
            raise ValueError(
                f"head size {head_size} is odd, so the whole head cannot be split into "
                f"pairs; pass an even rotary_embedding_dim smaller than {head_size}"
            )
        return head_size
    if rotary_dim % 2:
        raise ValueError(
            f"rotary_embedding_dim must be even (channels rotate in pairs), got {rotary_dim}"
        )
    return rotary_dim


def check_interleaved(interleaved: Any) -> bool:
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"interleaved must be True or False, got {interleaved!r}")
    return bool(interleaved)


def check_call(*arguments: Any) -> tuple[bool, int, bool, tuple[int, ...]]:
    """Check one call of ``rotary_embedding`` (see :func:`_check_call`).

    A call is described by shapes, dtypes and two scalars, so the verdict is
    remembered: repeated calls of the same signature skip the checks. Arguments that
    cannot be hashed go to the plain check, which explains what is wrong with them.
    """
    try:
        return _check_call_remembered(*arguments)
    except TypeError:
        return _check_call(*arguments)


#: Memory layouts of 4-D input: TensorRT/ONNX's, and Hugging Face / flash-attn / vLLM's.
LAYOUTS = ("bhsd", "bshd")


def logical_shape(input_shape: tuple[int, ...], layout: Any, num_heads: Any) -> tuple[int, ...]:
    """The input's ``[batch, num_heads, seq_len, head_size]`` for any accepted form."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if num_heads is not None:
        if isinstance(num_heads, (bool, np.bool_)):
            raise TypeError(f"num_heads must be a positive integer, got {num_heads!r}")
        try:
            num_heads = operator.index(num_heads)
        except TypeError:
            raise TypeError(f"num_heads must be a positive integer, got {num_heads!r}") from None
        if num_heads <= 0:
            raise ValueError(f"num_heads must be a positive integer, got {num_heads}")
    if len(input_shape) == 4:
        if layout == "bhsd":
            shape = tuple(input_shape)
        else:
            batch, seq_len, heads, head_size = input_shape
            shape = (batch, heads, seq_len, head_size)
        if num_heads is not None and num_heads != shape[1]:
            raise ValueError(
                f"num_heads={num_heads} contradicts the {layout} input of shape "
                f"{tuple(input_shape)}, which has {shape[1]} heads; omit num_heads for 4-D input"
            )
        return shape
    if len(input_shape) == 3:
        batch, seq_len, hidden = input_shape
        if num_heads is None:
            raise ValueError(
                f"3-D input [batch, seq_len, num_heads * head_size] (shape "
                f"{tuple(input_shape)}) needs num_heads= to split its last dimension"
            )
        if hidden % num_heads:
            raise ValueError(
                f"the last dimension {hidden} of 3-D input is not a multiple of "
                f"num_heads={num_heads}"
            )
        return (batch, num_heads, seq_len, hidden // num_heads)
    raise ValueError(
        f"input must be 4-D [batch, num_heads, seq_len, head_size] (or [batch, seq_len, "
        f"num_heads, head_size] with layout='bshd'), or 3-D [batch, seq_len, num_heads * "
        f"head_size] with num_heads=; got shape {tuple(input_shape)} ({len(input_shape)}-D)"
    )


def check_qk(q_shape, q_dtype, k_shape, k_dtype) -> None:
    """q and k of one fused call: same batch, sequence, head size and dtype."""
    if q_dtype != k_dtype:
        raise TypeError(f"q and k must have one dtype, got {q_dtype.name} and {k_dtype.name}")
    for axis, name in ((0, "batch"), (2, "seq_len"), (3, "head_size")):
        if q_shape[axis] != k_shape[axis]:
            raise ValueError(
                f"q and k must have the same {name}, got {q_shape[axis]} and {k_shape[axis]} "
                f"(as [batch, num_heads, seq_len, head_size]: {tuple(q_shape)} and "
                f"{tuple(k_shape)}); only the number of heads may differ"
            )


def offset_error(batch_index: int | None, value: int, seq_len: int, n_positions: int) -> IndexError:
    """The ``IndexError`` for an offset whose positions leave the caches."""
    where = "position_offset" if batch_index is None else f"position_offset[{batch_index}]"
    return IndexError(
        f"{where} = {value} puts positions {value}..{value + seq_len - 1} of the sequence "
        f"outside the caches, which have {n_positions} rows: offsets must lie in [0, "
        f"{n_positions - seq_len}] for seq_len {seq_len}"
    )


def _check_call(
    input_shape: tuple[int, ...],
    input_dtype: np.dtype,
    cos_shape: tuple[int, ...],
    cos_dtype: np.dtype,
    sin_shape: tuple[int, ...],
    sin_dtype: np.dtype,
    ids_shape: tuple[int, ...] | None,
    ids_dtype: np.dtype | None,
    out_shape: tuple[int, ...] | None,
    out_dtype: np.dtype | None,
    interleaved: Any,
    rotary_embedding_dim: Any,
    layout: Any = "bhsd",
    num_heads: Any = None,
    offset_shape: tuple[int, ...] | None = None,
    offset_dtype: np.dtype | None = None,
    inverse: Any = False,
) -> tuple[bool, int, bool, tuple[int, ...]]:
    """Check one call of ``rotary_embedding``.

    Returns ``(interleaved, rotary_dim, inverse, shape)``, where ``shape`` is the input's
    logical ``[batch, num_heads, seq_len, head_size]``. Shapes are tuples and dtypes
    NumPy dtypes; ``ids_*``, ``out_*`` and ``offset_*`` are None when the argument is
    absent (a scalar offset has shape ``()``).
    """
    dtype_name = check_dtype(input_dtype)
    shape = logical_shape(input_shape, layout, num_heads)
    batch, _, seq_len, head_size = shape
    interleaved = check_interleaved(interleaved)
    if not isinstance(inverse, (bool, np.bool_)):
        raise TypeError(f"inverse must be True or False, got {inverse!r}")
    rotary_dim = check_rotary_dim(rotary_embedding_dim, head_size)
    half = rotary_dim // 2

    if cos_dtype != sin_dtype:
        raise TypeError(
            f"cos_cache and sin_cache must have the same dtype, got {cos_dtype.name} and "
            f"{sin_dtype.name}"
        )
    allowed = CACHE_DTYPES[dtype_name]
    if cos_dtype.name not in allowed:
        raise TypeError(
            f"caches of dtype {cos_dtype.name} cannot be used with {dtype_name} input; "
            f"accepted cache dtypes: {' or '.join(allowed)}"
        )
    if tuple(cos_shape) != tuple(sin_shape):
        raise ValueError(
            f"cos_cache and sin_cache must have the same shape, got {tuple(cos_shape)} and "
            f"{tuple(sin_shape)}"
        )

    if ids_shape is not None and offset_shape is not None:
        raise ValueError(
            "pass position_ids or position_offset, not both: an offset stands for the ids "
            "offset + arange(seq_len)"
        )
    if offset_shape is not None:
        assert offset_dtype is not None
        if offset_dtype.kind not in "iu":
            raise TypeError(
                f"position_offset must be an integer or an integer array of shape [batch], "
                f"got dtype {offset_dtype.name}"
            )
        if tuple(offset_shape) not in ((), (batch,)):
            raise ValueError(
                f"position_offset must be an integer or have shape [batch] = ({batch},), got "
                f"shape {tuple(offset_shape)}"
            )
    if ids_shape is None and offset_shape is None:
        if len(cos_shape) != 3:
            raise ValueError(
                f"without position_ids the caches must be 3-D [batch, seq_len, "
                f"rotary_dim/2] = {(batch, seq_len, half)}, got shape {tuple(cos_shape)}"
            )
    else:
        if ids_shape is not None:
            assert ids_dtype is not None
            if ids_dtype.kind not in "iu":
                raise TypeError(
                    f"position_ids must be an integer array (int64 or int32), got dtype "
                    f"{ids_dtype.name}"
                )
            if tuple(ids_shape) != (batch, seq_len):
                raise ValueError(
                    f"position_ids must have shape [batch, seq_len] = {(batch, seq_len)}, got "
                    f"{tuple(ids_shape)}"
                )
        if len(cos_shape) != 2:
            raise ValueError(
                f"with position_ids or position_offset the caches must be 2-D "
                f"[max_position_id + 1, rotary_dim/2], got shape {tuple(cos_shape)}"
            )
    if cos_shape[-1] != half:
        raise ValueError(
            f"the caches' last dimension must be rotary_dim/2 = {half}, got "
            f"{cos_shape[-1]} (cache shape {tuple(cos_shape)}, rotary_dim {rotary_dim})"
        )
    if len(cos_shape) == 3 and tuple(cos_shape[:2]) != (batch, seq_len):
        raise ValueError(
            f"without position_ids the caches must have shape [batch, seq_len, "
            f"rotary_dim/2] = {(batch, seq_len, half)}, got {tuple(cos_shape)}"
        )

    if out_dtype is not None:
        if out_dtype != input_dtype:
            raise TypeError(f"out must have the input's dtype {dtype_name}, got {out_dtype.name}")
        if tuple(out_shape or ()) != tuple(input_shape):
            raise ValueError(
                f"out must have the input's shape {tuple(input_shape)}, got "
                f"{tuple(out_shape or ())}"
            )
    return interleaved, rotary_dim, bool(inverse), shape


# typed=True: 1 and True (or 2 and 2.0) must not share a verdict.
_check_call_remembered = functools.lru_cache(maxsize=1024, typed=True)(_check_call)


def position_error(
    flat_index: int, position_ids_shape: tuple[int, ...], value: int, n_positions: int
) -> IndexError:
    """The ``IndexError`` for an out-of-range position id at a flat index."""
    where = tuple(int(i) for i in np.unravel_index(flat_index, position_ids_shape))
    return IndexError(
        f"position_ids{list(where)} = {value} is outside the caches, which have "
        f"{n_positions} rows: position ids must lie in [0, {n_positions - 1}]"
    )
