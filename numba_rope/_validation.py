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


def check_call(*arguments: Any) -> tuple[bool, int]:
    """Check one call of ``rotary_embedding`` (see :func:`_check_call`).

    A call is described by shapes, dtypes and two scalars, so the verdict is
    remembered: repeated calls of the same signature skip the checks. Arguments that
    cannot be hashed go to the plain check, which explains what is wrong with them.
    """
    try:
        return _check_call_remembered(*arguments)
    except TypeError:
        return _check_call(*arguments)


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
) -> tuple[bool, int]:
    """Check one call of ``rotary_embedding``; return ``(interleaved, rotary_dim)``.

    Shapes are tuples and dtypes NumPy dtypes; ``ids_*`` and ``out_*`` are None when
    the argument is absent.
    """
    dtype_name = check_dtype(input_dtype)
    if len(input_shape) != 4:
        raise ValueError(
            f"input must be 4-D [batch, num_heads, seq_len, head_size], got shape "
            f"{tuple(input_shape)} ({len(input_shape)}-D)"
        )
    batch, _, seq_len, head_size = input_shape
    interleaved = check_interleaved(interleaved)
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

    if ids_shape is None:
        if len(cos_shape) != 3:
            raise ValueError(
                f"without position_ids the caches must be 3-D [batch, seq_len, "
                f"rotary_dim/2] = {(batch, seq_len, half)}, got shape {tuple(cos_shape)}"
            )
    else:
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
                f"with position_ids the caches must be 2-D [max_position_id + 1, "
                f"rotary_dim/2], got shape {tuple(cos_shape)}"
            )
    if cos_shape[-1] != half:
        raise ValueError(
            f"the caches' last dimension must be rotary_dim/2 = {half}, got "
            f"{cos_shape[-1]} (cache shape {tuple(cos_shape)}, rotary_dim {rotary_dim})"
        )
    if ids_shape is None and tuple(cos_shape[:2]) != (batch, seq_len):
        raise ValueError(
            f"without position_ids the caches must have shape [batch, seq_len, "
            f"rotary_dim/2] = {(batch, seq_len, half)}, got {tuple(cos_shape)}"
        )

    if out_dtype is not None:
        if out_dtype != input_dtype:
            raise TypeError(f"out must have the input's dtype {dtype_name}, got {out_dtype.name}")
        if tuple(out_shape or ()) != tuple(input_shape):
            raise ValueError(
                f"out must have the input's shape {tuple(input_shape)}, got {tuple(out_shape or ())}"
            )
    return interleaved, rotary_dim


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
