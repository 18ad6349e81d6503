"""The NumPy reference: the operator written as plainly as possible, in float64.

This module is the oracle of the test suite. It follows the specification's own
reference step by step, but multiplies the pairs out in real arithmetic
(``x1*cos - x2*sin``, ``x2*cos + x1*sin``) rather than as complex numbers, so that
infinities propagate as the formula says (``1j * inf`` is ``nan + inf*j`` in NumPy). It
evaluates in float64 whatever the input dtype and rounds once to the input's dtype
(for bfloat16 through float32 rounded to odd: ``ml_dtypes`` 0.6 alone rounds twice). It
checks position ids (NumPy would silently wrap negative ones) and nothing else.
``precision="contract"`` evaluates the kernels' numerical contract instead (float32,
one rounding per operation, rounded once), for checking 16-bit results bit for bit.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from numba_rope._rounding import round_once
from numba_rope.typing import NumpyArray

_Scalar = TypeVar("_Scalar", bound=np.generic)


#: What :func:`rotary_embedding` can evaluate: the exact value rounded once, or the
#: numerical contract of the kernels.
PRECISIONS = ("float64", "contract")


def rotary_embedding(
    input: npt.NDArray[_Scalar],
    cos_cache: NumpyArray,
    sin_cache: NumpyArray,
    position_ids: npt.NDArray[np.integer[Any]] | None = None,
    *,
    interleaved: bool = False,
    rotary_embedding_dim: int = 0,
    layout: str = "bhsd",
    num_heads: int | None = None,
    position_offset: Any = None,
    inverse: bool = False,
    precision: str = "float64",
) -> npt.NDArray[_Scalar]:
    """Reference rotary embedding, in plain NumPy, with every keyword of the operator
    that chooses the result.

    Same arguments and semantics as :func:`numba_rope.rotary_embedding` for NumPy arrays
    (``layout``, ``num_heads`` for 3-D input, ``position_offset``, ``inverse``), checked
    only as far as a reference must: position ids and offsets inside the caches. The
    operator's keywords of where and how it runs (``out``, ``stream``,
    ``check_position_ids``) are not taken (it returns a new array), and caches of any
    float dtype are (float64 caches for float32 input too, which the operator refuses).

    Parameters
    ----------
    precision : {"float64", "contract"}, default "float64"
        ``"float64"``: the formula evaluated in float64 and rounded once to the input's
        dtype (the exact result, to within float64's rounding). ``"contract"``: what the
        kernels promise bit for bit on the CPU: inputs and caches widened to float32
        (float64 for float64 input), ``x1*cos - x2*sin`` and ``x2*cos + x1*sin`` with
        one rounding per operation, the result rounded once to the input's dtype. Use
        it to check a 16-bit result with ``np.array_equal``: it and the float64 value
        may differ by one unit in the last place.

    Examples
    --------
    >>> import numpy as np
    >>> from numba_rope import reference
    >>> x = np.array([[[[1.0, 0.0]]]], dtype=np.float32)
    >>> reference.rotary_embedding(x, np.zeros((1, 1, 1)), np.ones((1, 1, 1)))
    array([[[[0., 1.]]]], dtype=float32)
    >>> cos, sin = np.zeros((4, 1)), np.ones((4, 1))
    >>> reference.rotary_embedding(x, cos, sin, position_offset=2, inverse=True)
    array([[[[ 0., -1.]]]], dtype=float32)
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    x = np.asarray(input)
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if x.ndim == 3:  # [batch, seq_len, num_heads * head_size]
        if num_heads is None:
            raise ValueError("3-D input needs num_heads=")
        batch, seq_len, hidden = x.shape
        bhsd = x.reshape(batch, seq_len, num_heads, hidden // num_heads).transpose(0, 2, 1, 3)
    else:
        bhsd = x.transpose(0, 2, 1, 3) if layout == "bshd" else x
    if position_offset is not None:
        if position_ids is not None:
            raise ValueError("pass position_ids or position_offset, not both")
        offsets = np.asarray(position_offset, dtype=object).reshape(-1, 1)  # exact ints
        position_ids = offsets + np.arange(bhsd.shape[2], dtype=object)
        position_ids = np.broadcast_to(position_ids, (bhsd.shape[0], bhsd.shape[2]))
    if inverse:
        sin_cache = -np.asarray(sin_cache)
    with np.errstate(all="ignore"):  # inf and NaN propagate as the formula says
        result = _rotary_embedding(
            bhsd, cos_cache, sin_cache, position_ids, interleaved, rotary_embedding_dim, precision
        )
    if x.ndim == 3:
        return result.transpose(0, 2, 1, 3).reshape(x.shape)
    return result.transpose(0, 2, 1, 3) if layout == "bshd" else result


def _rotary_embedding(
    x, cos_cache, sin_cache, position_ids, interleaved, rotary_embedding_dim, precision
):
    head_size = x.shape[3]
    rotary_dim = head_size if rotary_embedding_dim == 0 else rotary_embedding_dim
    compute = np.float64
    if precision == "contract" and x.dtype != np.float64:
        compute = np.float32
    xc = x.astype(compute)
    x_rotate, x_pass = xc[..., :rotary_dim], xc[..., rotary_dim:]

    cos = np.asarray(cos_cache).astype(compute)
    sin = np.asarray(sin_cache).astype(compute)
    if position_ids is not None:
        ids = np.asarray(position_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= cos.shape[0]):
            raise IndexError(f"position ids must lie in [0, {cos.shape[0] - 1}]")
        ids = ids.astype(np.int64)
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
    if precision == "contract":  # rounded once; the other channels copied bit for bit
        return np.concatenate([rotated.astype(x.dtype), x[..., rotary_dim:]], axis=-1)
    return round_once(np.concatenate([rotated, x_pass], axis=-1), x.dtype)
