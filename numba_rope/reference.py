"""The NumPy reference: the operator written as plainly as possible, in float64.

This module is the oracle of the test suite. It follows the specification's own
reference step by step, but multiplies the pairs out in real arithmetic
(``x1*cos - x2*sin``, ``x2*cos + x1*sin``) rather than as complex numbers, so that
infinities propagate as the formula says (``1j * inf`` is ``nan + inf*j`` in NumPy). It
evaluates in float64 whatever the input dtype and rounds once to the input's dtype
(for bfloat16 through float32 rounded to odd: ``ml_dtypes`` alone would round twice). It
checks position ids (NumPy would silently wrap negative ones) and nothing else.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from numba_rope._rounding import round_once
from numba_rope.typing import NumpyArray

_Scalar = TypeVar("_Scalar", bound=np.generic)


def rotary_embedding(
    input: npt.NDArray[_Scalar],
    cos_cache: NumpyArray,
    sin_cache: NumpyArray,
    position_ids: npt.NDArray[np.integer[Any]] | None = None,
    *,
    interleaved: bool = False,
    rotary_embedding_dim: int = 0,
) -> npt.NDArray[_Scalar]:
    """Reference rotary embedding: computed in float64, rounded once to ``input.dtype``.

    Same arguments and semantics as :func:`numba_rope.rotary_embedding` (NumPy arrays).

    Examples
    --------
    >>> import numpy as np
    >>> from numba_rope import reference
    >>> x = np.array([[[[1.0, 0.0]]]], dtype=np.float32)
    >>> reference.rotary_embedding(x, np.zeros((1, 1, 1)), np.ones((1, 1, 1)))
    array([[[[0., 1.]]]], dtype=float32)
    """
    with np.errstate(all="ignore"):  # inf and NaN propagate as the formula says
        return _rotary_embedding(
            np.asarray(input),
            cos_cache,
            sin_cache,
            position_ids,
            interleaved,
            rotary_embedding_dim,
        )


def _rotary_embedding(x, cos_cache, sin_cache, position_ids, interleaved, rotary_embedding_dim):
    head_size = x.shape[3]
    rotary_dim = head_size if rotary_embedding_dim == 0 else rotary_embedding_dim
    x64 = x.astype(np.float64)
    x_rotate, x_pass = x64[..., :rotary_dim], x64[..., rotary_dim:]

    cos = np.asarray(cos_cache).astype(np.float64)
    sin = np.asarray(sin_cache).astype(np.float64)
    if position_ids is not None:
        ids = np.asarray(position_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= cos.shape[0]):
            raise IndexError(f"position ids must lie in [0, {cos.shape[0] - 1}]")
        cos, sin = cos[ids], sin[ids]  # [batch, seq_len, rotary_dim/2]
    cos, sin = cos[:, np.newaxis], sin[:, np.newaxis]  # [batch, 1, seq_len, rotary_dim/2]

    if interleaved:
        x1, x2 = x_rotate[..., 0::2], x_rotate[..., 1::2]
    else:
        x1, x2 = x_rotate[..., : rotary_dim // 2], x_rotate[..., rotary_dim // 2 :]
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin

    if interleaved:
        rotated = np.stack([y1, y2], axis=-1).reshape(x_rotate.shape)
    else:
        rotated = np.concatenate([y1, y2], axis=-1)
    return round_once(np.concatenate([rotated, x_pass], axis=-1), x.dtype)
