"""The public operator: validate once, pick the device from the arrays, launch."""

from __future__ import annotations

from typing import Any

from numba_rope import _dispatch
from numba_rope._validation import check_call


def rotary_embedding(
    input: Any,
    cos_cache: Any,
    sin_cache: Any,
    position_ids: Any = None,
    *,
    interleaved: bool = False,
    rotary_embedding_dim: int = 0,
    out: Any = None,
    stream: Any = None,
    check_position_ids: bool = True,
) -> Any:
    """Rotary position embedding, as TensorRT's ``RotaryEmbedding`` layer and ONNX
    ``RotaryEmbedding`` (opset 23) define it.

    Each pair of channels ``(x1, x2)`` of a token is rotated by the angle of its
    position: ``x1*cos - x2*sin`` and ``x2*cos + x1*sin``, with pair ``i`` taking
    ``cos_cache[..., i]`` and ``sin_cache[..., i]``.

    Parameters
    ----------
    input : array, shape ``[batch, num_heads, seq_len, head_size]``
        float32, float16, bfloat16 (``ml_dtypes.bfloat16``) or float64. Any strides,
        including views such as ``qkv[..., :128]`` and negative strides.
    cos_cache, sin_cache : array
        Without ``position_ids``: shape ``[batch, seq_len, rotary_dim/2]``.
        With ``position_ids``: shape ``[max_position_id + 1, rotary_dim/2]``.
        Same dtype as ``input``, or float32 (more precise caches for 16-bit input).
    position_ids : integer array, shape ``[batch, seq_len]``, optional
        Row of the caches used by each token (int64; int32 and other integer types are
        accepted). Every id must lie in ``[0, cache rows)``, else ``IndexError``.
    interleaved : bool, default False
        True: pairs are ``(x[2i], x[2i+1])``. False: pairs are ``(x[i], x[i + rotary_dim/2])``.
    rotary_embedding_dim : int, default 0
        Number of leading channels that rotate; 0 means the whole head. The remaining
        channels are copied through unchanged. Must be even.
    out : array, optional
        Where to write the result: same shape and dtype as ``input``. May be ``input``
        itself (in place). It is left untouched when the call raises.
    stream : optional
        GPU arrays only (ignored for NumPy arrays): the CUDA stream to run on, as a numba
        stream, a ``torch.cuda.Stream``, a ``cupy.cuda.Stream`` or a raw handle. Default:
        torch's current stream for torch tensors, CuPy's for CuPy arrays, else Numba's
        default stream.
    check_position_ids : bool, default True
        GPU arrays only: False skips the range check of ``position_ids`` (a small kernel
        and one synchronization); tokens with an out-of-range id then get a row of NaN
        instead of an ``IndexError``. On the CPU ids are always checked.

    Returns
    -------
    array
        ``out`` if given, else a new C-contiguous array of the input's type (NumPy, CuPy,
        Numba device array or torch tensor), shape and dtype, on the input's device. On
        the GPU the call returns without waiting for the kernel.

    Notes
    -----
    float32 and float64 are computed in their own precision. float16 and bfloat16
    inputs and caches are converted to float32, the formula is evaluated in float32 and
    the result is rounded once to the input's dtype (to nearest, ties to even). No FMA
    contraction and no fast-math: CPU results are reproducible bit for bit whatever the
    number of threads.

    Raises
    ------
    TypeError
        Arguments that are not arrays, arrays on different devices, unsupported dtypes,
        cache dtypes that differ or do not fit the input, non-integer ``position_ids``,
        ``out`` of another dtype.
    ValueError
        Input not 4-D, odd or out-of-range ``rotary_embedding_dim``, caches,
        ``position_ids`` or ``out`` of the wrong shape.
    IndexError
        A position id outside the caches; the message names its value and place.

    Examples
    --------
    >>> import numpy as np
    >>> import numba_rope
    >>> x = np.ones((1, 1, 2, 4), dtype=np.float32)        # batch, heads, seq, head
    >>> angle = np.array([[0.0, 0.0], [np.pi / 2, 0.0]])    # position 1 turns pair 0
    >>> cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    >>> y = numba_rope.rotary_embedding(x, cos, sin, np.array([[0, 1]]))
    >>> y[0, 0].round(6)
    array([[ 1.,  1.,  1.,  1.],
           [-1.,  1.,  1.,  1.]], dtype=float32)
    """
    backend = _dispatch.backend_for(input, cos_cache, sin_cache, position_ids, out, stream)
    describe = backend.describe
    interleaved, rotary_dim = check_call(
        *describe(input),
        *describe(cos_cache),
        *describe(sin_cache),
        *describe(position_ids),
        *describe(out),
        interleaved,
        rotary_embedding_dim,
    )
    return backend.run(
        input, cos_cache, sin_cache, position_ids, out, interleaved, rotary_dim, check_position_ids
    )
