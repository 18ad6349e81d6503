"""flash-attn's rotary functions, with its signatures and forms, on numba_rope's kernels.

The functions of ``flash_attn.layers.rotary`` (and ``flash_attn.ops.triton.rotary``'s
``apply_rotary``), for every kind of array numba_rope accepts (NumPy, and on the GPU
Numba device arrays, CuPy arrays and torch tensors):

* :func:`apply_rotary_emb`: ``x`` ``[batch, seqlen, nheads, headdim]``, or packed
  variable-length sequences ``[total_seqlen, nheads, headdim]`` with ``cu_seqlens``;
  ``cos``/``sin`` ``[seqlen_ro, rotary_dim / 2]``; ``seqlen_offsets`` an int or one
  per sequence; in place or not;
* :func:`apply_rotary_emb_qkv_`, :func:`apply_rotary_emb_kv_`: q and k (or k) of a
  packed qkv (or kv) buffer, in place;
* :func:`apply_rotary`: all of them, with ``conjugate`` (the inverse rotation, which is
  the gradient).

Token ``t`` of sequence ``b`` rotates by row ``seqlen_offsets[b] + t`` of ``cos`` and
``sin``: its first ``rotary_dim = 2 * cos.shape[-1]`` channels, in halves
(``interleaved=False``, GPT-NeoX) or in even/odd pairs (``interleaved=True``, GPT-J); the
other channels are copied. The arithmetic is numba_rope's contract (float32, one
rounding per operation, 16-bit results rounded once), not flash-attn's Triton kernel's.

Where flash-attn's kernel would do something silent, these raise instead: a position at
or beyond ``seqlen_ro`` (flash-attn leaves such a token unrotated when the offsets are a
tensor), ``cu_seqlens`` that decrease, do not start at 0 or do not end at
``total_seqlen`` (flash-attn leaves tokens past ``cu_seqlens[-1]`` unwritten), and a
sequence longer than ``max_seqlen`` (flash-attn skips its tokens past ``max_seqlen``).
flash-attn's ``headdim <= 256`` and "same dtype for x and cos" limits do not apply
(float32 caches for 16-bit ``x`` are accepted, as everywhere in numba_rope).

Variable-length batches read ``cu_seqlens`` (and array offsets) on the host: for GPU
arrays that is one small copy to the host, which waits for the GPU's work on them
(numba_rope's own position check on the GPU costs the same one wait, and is skipped
here since the positions were checked on the host); the per-token positions are then
built on the host and copied to the device (8 bytes a token) in the library of ``x``.
Array offsets without ``cu_seqlens`` are read on the host the same way.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from numba_rope._autograd import (
    compiling,
    forward_ad_active,
    outside_graphs,
    tangent,
    transformed,
)
from numba_rope._interop import (
    add_leading_axis,
    host_integers,
    host_tensor,
    is_torch,
    like,
    read_only_error,
    to_host,
)
from numba_rope.rotary import rotary_embedding, rotary_embedding_qk

__all__ = [
    "apply_rotary",
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "apply_rotary_emb_kv_",
    "apply_rotary_emb_qkv_",
]


_F = TypeVar("_F", bound=Callable[..., Any])


def _outside_compiled_graphs(function: _F) -> _F:
    """``function``, run outside torch.compile's graph where it traces a call on a
    torch tensor (:func:`~numba_rope._autograd.outside_graphs`: the graph breaks
    there): its checks and NumPy views are not Dynamo's to trace. Where a traced graph
    matters, ``numba_rope.torch`` has the operator as torch custom ops."""

    @functools.wraps(function)
    def run(x: Any, *arguments: Any, **options: Any) -> Any:
        if is_torch(x) and compiling():
            return outside_graphs(function)(x, *arguments, **options)
        return function(x, *arguments, **options)

    return run  # type: ignore[return-value]


@_outside_compiled_graphs
def apply_rotary_emb(
    x: Any,
    cos: Any,
    sin: Any,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: Any = 0,
    cu_seqlens: Any = None,
    max_seqlen: int | None = None,
) -> Any:
    """flash-attn's ``apply_rotary_emb``: rotate the first ``rotary_dim`` channels of
    every head of ``x``.

    Parameters
    ----------
    x : array
        ``[batch, seqlen, nheads, headdim]``, or ``[total_seqlen, nheads, headdim]``
        with ``cu_seqlens`` (the sequences packed one after another). Any strides (a
        slice of a fused qkv buffer is read and, in place, written where it lies).
    cos, sin : array
        ``[seqlen_ro, rotary_dim / 2]``: row ``p`` holds the angles of position ``p``.
        ``rotary_dim = 2 * cos.shape[-1]`` must not exceed ``headdim``. The dtype of
        ``x``, or float32.
    interleaved : bool, default False
        True: pairs ``(x[2i], x[2i+1])`` (GPT-J). False: ``(x[i], x[i + rotary_dim/2])``
        (GPT-NeoX).
    inplace : bool, default False
        Write the result into ``x`` and return ``x``.
    seqlen_offsets : int or integer array of shape ``[batch]``, default 0
        Token ``t`` of sequence ``b`` uses row ``seqlen_offsets[b] + t`` (decoding with
        a KV cache). Every such row must exist, else ``IndexError``.
    cu_seqlens : integer array of shape ``[batch + 1]``, optional
        Cumulative sequence lengths ``[0, n0, n0 + n1, ..., total_seqlen]`` of a packed
        ``x``: token ``i`` with ``cu_seqlens[b] <= i < cu_seqlens[b + 1]`` is token
        ``i - cu_seqlens[b]`` of sequence ``b``.
    max_seqlen : int, optional
        The longest sequence (flash-attn needs it with ``cu_seqlens``; here it is only
        checked: a longer sequence raises ``ValueError``).

    Returns
    -------
    array
        ``x`` if ``inplace``, else a new array of the kind and shape of ``x``.

    Examples
    --------
    Two sequences of 3 and 1 tokens packed in one array, the second decoding at
    position 7 (its KV cache holds 7 tokens):

    >>> import numpy as np
    >>> import numba_rope
    >>> from numba_rope.flash_attn import apply_rotary_emb
    >>> cos, sin = numba_rope.rope_cache(16, 8)  # [16, 4]
    >>> x = np.random.default_rng(0).standard_normal((4, 2, 8), np.float32)
    >>> y = apply_rotary_emb(
    ...     x, cos, sin, seqlen_offsets=np.array([0, 7]), cu_seqlens=np.array([0, 3, 4])
    ... )
    >>> second = x[None, 3:]  # [batch 1, seqlen 1, nheads, headdim]
    >>> expected = numba_rope.rotary_embedding(second, cos, sin, position_offset=7, layout="bshd")
    >>> bool(np.array_equal(y[3:], expected[0]))
    True
    """
    return apply_rotary(
        x,
        cos,
        sin,
        seqlen_offsets=seqlen_offsets,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        interleaved=interleaved,
        inplace=inplace,
    )


#: flash-attn's older name of :func:`apply_rotary_emb`.
apply_rotary_emb_func = apply_rotary_emb


@_outside_compiled_graphs
def apply_rotary(
    x: Any,
    cos: Any,
    sin: Any,
    seqlen_offsets: Any = 0,
    cu_seqlens: Any = None,
    max_seqlen: int | None = None,
    interleaved: bool = False,
    inplace: bool = False,
    conjugate: bool = False,
) -> Any:
    """flash-attn's ``apply_rotary`` (``flash_attn.ops.triton.rotary``): as
    :func:`apply_rotary_emb`, in that function's argument order, and ``conjugate=True``
    rotates by the negative angle (the inverse rotation, and its gradient).

    >>> import numpy as np
    >>> import numba_rope
    >>> from numba_rope.flash_attn import apply_rotary
    >>> cos, sin = numba_rope.rope_cache(8, 4)
    >>> x = np.random.default_rng(1).standard_normal((2, 3, 1, 4))
    >>> y = apply_rotary(x, cos.astype(np.float64), sin.astype(np.float64), seqlen_offsets=2)
    >>> back = apply_rotary(y, cos.astype(np.float64), sin.astype(np.float64), 2, conjugate=True)
    >>> bool(np.allclose(back, x))
    True
    """
    try:
        if cu_seqlens is not None:
            return _varlen(
                x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace, conjugate
            )
        _require_dims(x, 4, "x", "[batch, seqlen, nheads, headdim]", varlen_hint=True)
        rotary_dim = _rotary_dim(x, cos, sin)
        batch, seqlen = tuple(x.shape)[:2]
        options = {
            "interleaved": interleaved,
            "rotary_embedding_dim": rotary_dim,
            "layout": "bshd",
            "inverse": conjugate,
        }
        if _operator_checks(x, seqlen_offsets):
            try:
                result = _rotate(
                    x, cos, sin, None, out=x if inplace else None, position_offset=seqlen_offsets,
                    **options,
                )  # fmt: skip
            except (TypeError, ValueError, IndexError):
                named = _offsets_error(seqlen_offsets, batch, seqlen, _rows(cos))
                if named is None:
                    raise
                raise named from None
            return x if inplace else result
        offset = _checked_offsets(seqlen_offsets, batch, np.full(batch, seqlen), _rows(cos))
        result = _rotate(
            x, cos, sin, None, out=x if inplace else None, position_offset=offset, **options
        )
        return x if inplace else result
    except ValueError:
        # A read-only x in place (the operator has written nothing): named as flash-attn
        # names it, not as the operator's out; checked only on this path.
        named = (
            read_only_error(x, "x", "inplace=True rotates it in place", "pass inplace=False")
            if inplace
            else None
        )
        if named is None:
            raise
        raise named from None


def _operator_checks(x: Any, seqlen_offsets: Any) -> bool:
    """Whether one call of the operator can check ``seqlen_offsets`` in place of
    :func:`_checked_offsets`: host memory (NumPy arrays and plain torch CPU tensors:
    the CPU operator checks every position before it writes) and an ``int`` or an
    integer NumPy array or torch CPU tensor of offsets (the forms the operator takes as
    they are, see :func:`~numba_rope._interop.host_integers`). :func:`_checked_offsets`
    then runs only to word an error the operator raised, as flash-attn's names it.
    Its loop over the batch had cost a torch decode step of 64 sequences about 17 µs
    (docs/performance.md, "Thirty-third session")."""
    if type(x) is not np.ndarray and not host_tensor(x):
        return False
    return type(seqlen_offsets) is int or host_integers(seqlen_offsets)


def _records_autograd(x: Any) -> bool:
    """Whether ``x`` needs :mod:`numba_rope.torch`: a torch tensor that requires grad
    under grad mode, carries a forward-mode tangent, or is a ``torch.func``
    transform's wrapper."""
    if not hasattr(x, "requires_grad"):
        return False
    import torch

    if x.requires_grad and torch.is_grad_enabled():
        return True
    return (forward_ad_active() and tangent(x) is not None) or transformed(x)


def _rotate(x: Any, cos: Any, sin: Any, position_ids: Any, out: Any, **options: Any) -> Any:
    """The operator, checks of positions already made: through :mod:`numba_rope.torch`
    (differentiable with respect to ``x``, as flash-attn's function is) for a torch
    tensor that records autograd (reverse mode, a forward-mode tangent, a torch.func
    transform), through :func:`numba_rope.rotary_embedding` otherwise. In place on a
    tensor that records autograd is refused there, with the way out."""
    if out is None and type(x) is not np.ndarray and _records_autograd(x):
        from numba_rope import torch as differentiable

        return differentiable.rotary_embedding(x, cos, sin, position_ids, **options)
    return rotary_embedding(x, cos, sin, position_ids, out=out, check_position_ids=False, **options)


@_outside_compiled_graphs
def apply_rotary_emb_qkv_(
    qkv: Any,
    cos: Any,
    sin: Any,
    cos_k: Any = None,
    sin_k: Any = None,
    interleaved: bool = False,
    seqlen_offsets: Any = 0,
    num_heads_q: int | None = None,
) -> Any:
    """flash-attn's ``apply_rotary_emb_qkv_``: rotate q and k of a packed qkv buffer in
    place, v untouched; returns ``qkv``.

    Parameters
    ----------
    qkv : array
        ``[batch, seqlen, 3, nheads, headdim]``, or ``[batch, seqlen, num_heads_q + 2 *
        num_heads_k, headdim]`` with ``num_heads_q`` (grouped-query attention: q's
        heads, then k's, then v's).
    cos, sin : array
        ``[seqlen_ro, rotary_dim / 2]``, for q, and for k unless ``cos_k``/``sin_k``
        are given (each defaults to its q twin).
    interleaved, seqlen_offsets
        As for :func:`apply_rotary_emb`.

    Raises
    ------
    TypeError
        A torch ``qkv`` that autograd records (one that requires grad, or carries a
        forward-mode tangent): flash-attn's function is differentiable, this in-place
        one is not, and refuses rather than drop the gradient; rotate such q and k with
        :func:`apply_rotary_emb` (not in place), which is.

    Examples
    --------
    >>> import numpy as np
    >>> import numba_rope
    >>> from numba_rope.flash_attn import apply_rotary_emb_qkv_
    >>> cos, sin = numba_rope.rope_cache(8, 4)
    >>> qkv = np.ones((1, 2, 4 + 2 * 1, 4), np.float32)  # 4 q heads, 1 k and 1 v head
    >>> _ = apply_rotary_emb_qkv_(qkv, cos, sin, num_heads_q=4)
    >>> bool((qkv[:, :, 5] == 1).all()), bool((qkv[:, 1, :5] != 1).any())  # v untouched
    (True, True)
    """
    read_only = read_only_error(qkv, "qkv", "apply_rotary_emb_qkv_ rotates it in place")
    if read_only is not None:
        raise read_only
    shape = tuple(qkv.shape)
    if len(shape) == 5:
        if shape[2] != 3:
            raise ValueError(
                f"5-D qkv must be [batch, seqlen, 3, nheads, headdim], got shape {shape} "
                f"(axis 2 has {shape[2]} entries, not 3)"
            )
        q, k = qkv[:, :, 0], qkv[:, :, 1]
    elif len(shape) == 4:
        q_heads, k_heads = _grouped_heads(shape, num_heads_q)
        q, k = qkv[:, :, :q_heads], qkv[:, :, q_heads : q_heads + k_heads]
    else:
        raise ValueError(
            f"qkv must be [batch, seqlen, 3, nheads, headdim] or [batch, seqlen, "
            f"num_heads_q + 2 * num_heads_k, headdim] with num_heads_q=, got shape {shape} "
            f"({len(shape)}-D)"
        )
    rotary_dim = _rotary_dim(q, cos, sin)
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    rotary_dim_k = _rotary_dim(k, cos_k, sin_k, "cos_k", "sin_k")
    batch, seqlen = shape[0], shape[1]
    one_pass = cos_k is cos and sin_k is sin  # q and k at once (one launch on the GPU)
    if one_pass and _operator_checks(qkv, seqlen_offsets):
        try:
            rotary_embedding_qk(
                q, k, cos, sin, rotary_embedding_dim=rotary_dim, out_q=q, out_k=k,
                position_offset=seqlen_offsets, interleaved=interleaved, layout="bshd",
            )  # fmt: skip
        except (TypeError, ValueError, IndexError):
            named = _offsets_error(seqlen_offsets, batch, seqlen, _rows(cos))
            if named is None:
                raise
            raise named from None
        return qkv
    offset = _checked_offsets(
        seqlen_offsets, batch, np.full(batch, seqlen), min(_rows(cos), _rows(cos_k))
    )
    options = {
        "position_offset": offset,
        "interleaved": interleaved,
        "layout": "bshd",
        "check_position_ids": False,  # checked above, on the host
    }
    if one_pass:
        rotary_embedding_qk(
            q, k, cos, sin, rotary_embedding_dim=rotary_dim, out_q=q, out_k=k, **options
        )
    else:
        rotary_embedding(q, cos, sin, rotary_embedding_dim=rotary_dim, out=q, **options)
        rotary_embedding(k, cos_k, sin_k, rotary_embedding_dim=rotary_dim_k, out=k, **options)
    return qkv


@_outside_compiled_graphs
def apply_rotary_emb_kv_(
    kv: Any, cos: Any, sin: Any, interleaved: bool = False, seqlen_offsets: Any = 0
) -> Any:
    """flash-attn's ``apply_rotary_emb_kv_``: rotate k of a packed kv buffer
    ``[batch, seqlen, 2, nheads, headdim]`` in place (v untouched); returns ``kv``.
    A torch ``kv`` that autograd records raises ``TypeError``, as for
    :func:`apply_rotary_emb_qkv_`.

    >>> import numpy as np
    >>> import numba_rope
    >>> from numba_rope.flash_attn import apply_rotary_emb_kv_
    >>> cos, sin = numba_rope.rope_cache(8, 4)
    >>> kv = np.ones((1, 2, 2, 3, 4), np.float32)
    >>> _ = apply_rotary_emb_kv_(kv, cos, sin, seqlen_offsets=3)
    >>> bool((kv[:, :, 1] == 1).all()), bool((kv[:, :, 0] != 1).any())
    (True, True)
    """
    read_only = read_only_error(kv, "kv", "apply_rotary_emb_kv_ rotates it in place")
    if read_only is not None:
        raise read_only
    shape = tuple(kv.shape)
    if len(shape) != 5 or shape[2] != 2:
        raise ValueError(f"kv must be [batch, seqlen, 2, nheads, headdim], got shape {shape}")
    apply_rotary(
        kv[:, :, 0], cos, sin, seqlen_offsets=seqlen_offsets, interleaved=interleaved, inplace=True
    )
    return kv


# -- checks and the variable-length path -----------------------------------------------


def _require_dims(array: Any, ndim: int, name: str, form: str, varlen_hint: bool) -> None:
    shape = tuple(array.shape)
    if len(shape) == ndim:
        return
    if varlen_hint and ndim == 4 and len(shape) == 3:
        hint = "; for packed sequences [total_seqlen, nheads, headdim] pass cu_seqlens="
    elif varlen_hint and ndim == 3 and len(shape) == 4:
        hint = "; without packing ([batch, seqlen, nheads, headdim]) leave cu_seqlens=None"
    else:
        hint = ""
    raise ValueError(f"{name} must be {form}, got shape {shape} ({len(shape)}-D){hint}")


def _rows(cos: Any) -> int:
    """``seqlen_ro``: the rows of a cache."""
    return int(cos.shape[0])


def _rotary_dim(x: Any, cos: Any, sin: Any, cos_name: str = "cos", sin_name: str = "sin") -> int:
    """``2 * cos.shape[-1]``, checked against ``sin`` and the head size of ``x``."""
    cos_shape, sin_shape = tuple(cos.shape), tuple(sin.shape)
    if len(cos_shape) != 2:
        raise ValueError(
            f"{cos_name} must be [seqlen_ro, rotary_dim / 2], got shape {cos_shape}; for "
            f"per-token caches [batch, seqlen, rotary_dim / 2] use "
            f"numba_rope.rotary_embedding(x, cos, sin, layout='bshd')"
        )
    if sin_shape != cos_shape:
        raise ValueError(
            f"{sin_name} must have the shape of {cos_name}, {cos_shape}; got {sin_shape}"
        )
    # A tuple: the CUDA simulator's shapes do not index from the end.
    head_size = tuple(x.shape)[-1]
    rotary_dim = 2 * cos_shape[1]
    if rotary_dim == 0 or rotary_dim > head_size:
        raise ValueError(
            f"rotary_dim = 2 * {cos_name}.shape[-1] = {rotary_dim} must lie in [2, headdim = "
            f"{head_size}]: {cos_name} and {sin_name} hold one column per rotated pair"
        )
    return rotary_dim


def _grouped_heads(shape: tuple[int, ...], num_heads_q: Any) -> tuple[int, int]:
    if num_heads_q is None:
        raise ValueError(
            f"4-D qkv [batch, seqlen, num_heads_q + 2 * num_heads_k, headdim] (shape {shape}) "
            f"needs num_heads_q= to split its heads"
        )
    q_heads = operator.index(num_heads_q)
    rest = shape[2] - q_heads
    if q_heads <= 0 or rest <= 0 or rest % 2:
        raise ValueError(
            f"qkv's {shape[2]} heads are not num_heads_q + 2 * num_heads_k with "
            f"num_heads_q={q_heads} and num_heads_k >= 1"
        )
    return q_heads, rest // 2


def _checked_offsets(seqlen_offsets: Any, batch: int, lengths: np.ndarray, rows: int) -> Any:
    """``seqlen_offsets`` as numba_rope's ``position_offset`` (the int, or the caller's
    array), after checking on the host that every row its sequences use exists."""
    if isinstance(seqlen_offsets, (int, np.integer)) and not isinstance(seqlen_offsets, bool):
        offsets = np.full(batch, int(seqlen_offsets), dtype=object)  # exact, any size
        given = int(seqlen_offsets)
        name = "seqlen_offsets"
    elif isinstance(seqlen_offsets, (bool, float, np.bool_, np.floating)):
        raise TypeError(
            f"seqlen_offsets must be an int or an integer array of shape [batch], got "
            f"{seqlen_offsets!r}"
        )
    else:
        host = to_host(seqlen_offsets)
        if host.dtype.kind not in "iu":
            raise TypeError(
                f"seqlen_offsets must hold integers (int32 or int64), got dtype {host.dtype}"
            )
        if host.shape != (batch,):
            raise ValueError(
                f"seqlen_offsets must be an int or an array of shape [batch] = ({batch},), "
                f"got shape {host.shape}"
            )
        offsets = host.astype(object)
        given = seqlen_offsets
        name = None
    for b in range(batch):  # object arithmetic: no overflow, whatever the offsets
        length, offset = int(lengths[b]), offsets[b]
        if length > rows:
            raise IndexError(
                f"sequence {b} (length {length}) is longer than cos and sin, which have "
                f"{rows} rows (seqlen_ro): seqlen_ro >= seqlen is needed, as in flash-attn, "
                f"whatever the offset; build longer caches "
                f"(numba_rope.rope_cache(max_position, rotary_dim))"
            )
        if length and not 0 <= offset <= rows - length:
            where = name or f"seqlen_offsets[{b}]"
            raise IndexError(
                f"{where} = {offset} puts positions {offset}..{offset + length - 1} of "
                f"sequence {b} (length {length}) outside cos and sin, which have {rows} rows "
                f"(seqlen_ro): offsets must lie in [0, {rows - length}] for this sequence; "
                f"build longer caches (numba_rope.rope_cache(max_position, rotary_dim))"
            )
    return given


def _offsets_error(seqlen_offsets: Any, batch: int, seqlen: int, rows: int) -> Exception | None:
    """The error :func:`_checked_offsets` raises for a batch of ``seqlen`` tokens (the
    operator's error for the same fault, named as flash-attn names it), or None.
    Returned, not raised: the caller raises it ``from None``, as raised inside its
    ``except`` clause it would carry the operator's error as its context, which a
    traceback prints first, as a second error."""
    try:
        _checked_offsets(seqlen_offsets, batch, np.full(batch, seqlen), rows)
    except (TypeError, ValueError, IndexError) as error:
        return error
    return None


def _checked_cu_seqlens(cu_seqlens: Any, total: int, max_seqlen: Any) -> np.ndarray:
    """The host copy of ``cu_seqlens`` as int64, checked: 1-D, from 0, never
    decreasing, ending at ``total``, no sequence longer than ``max_seqlen``."""
    cu = to_host(cu_seqlens)
    if cu.dtype.kind not in "iu":
        raise TypeError(f"cu_seqlens must hold integers (int32 or int64), got dtype {cu.dtype}")
    if cu.ndim != 1 or cu.size == 0:
        raise ValueError(
            f"cu_seqlens must be 1-D [batch + 1] (cumulative sequence lengths [0, n0, n0 + "
            f"n1, ...]), got shape {cu.shape}"
        )
    cu = cu.astype(np.int64)
    if cu[0] != 0:
        raise ValueError(
            f"cu_seqlens must start at 0, got cu_seqlens[0] = {cu[0]}; it is the cumulative "
            f"sum of the sequence lengths with a 0 in front"
        )
    lengths = np.diff(cu)
    decreasing = np.flatnonzero(lengths < 0)
    if decreasing.size:
        b = int(decreasing[0])
        raise ValueError(
            f"cu_seqlens must not decrease (sequence {b} would have length {lengths[b]}): "
            f"cu_seqlens[{b + 1}] = {cu[b + 1]} < cu_seqlens[{b}] = {cu[b]}; it is the "
            f"cumulative sum of the sequence lengths with a 0 in front"
        )
    if cu[-1] != total:
        raise ValueError(
            f"cu_seqlens[-1] = {cu[-1]} must equal the number of packed tokens, "
            f"x.shape[0] = {total}"
            + (
                f"; to rotate the first {cu[-1]} tokens only, pass x[:{cu[-1]}] (a view, "
                f"in place too)"
                if cu[-1] < total
                else "; x holds fewer tokens than cu_seqlens describes"
            )
        )
    if max_seqlen is not None:
        longest = int(lengths.max(initial=0))
        if operator.index(max_seqlen) < longest:
            b = int(np.argmax(lengths))
            raise ValueError(
                f"max_seqlen = {max_seqlen} is less than the length {longest} of sequence "
                f"{b}; pass max_seqlen >= {longest} (or leave it None: it is not needed here)"
            )
    return cu


def _varlen(
    x: Any,
    cos: Any,
    sin: Any,
    seqlen_offsets: Any,
    cu_seqlens: Any,
    max_seqlen: Any,
    interleaved: bool,
    inplace: bool,
    conjugate: bool,
) -> Any:
    """Packed sequences: one call over ``x[None]`` (``[1, total, nheads, headdim]``)
    with per-token positions ``seqlen_offsets[b] + i - cu_seqlens[b]``, built on the
    host and moved to where ``x`` lives."""
    _require_dims(x, 3, "x with cu_seqlens", "[total_seqlen, nheads, headdim]", True)
    rotary_dim = _rotary_dim(x, cos, sin)
    total = int(x.shape[0])
    cu = _checked_cu_seqlens(cu_seqlens, total, max_seqlen)
    lengths = np.diff(cu)
    batch = lengths.size
    _checked_offsets(seqlen_offsets, batch, lengths, _rows(cos))
    if isinstance(seqlen_offsets, (int, np.integer)):
        offsets = np.full(batch, int(seqlen_offsets), dtype=np.int64)
    else:
        offsets = to_host(seqlen_offsets).astype(np.int64)
    # Checked above: every position lies in [0, rows), so no int64 overflow here.
    positions = np.repeat(offsets - cu[:-1], lengths) + np.arange(total, dtype=np.int64)
    tokens = add_leading_axis(x)
    result = _rotate(
        tokens,
        cos,
        sin,
        like(positions.reshape(1, total), x),
        interleaved=interleaved,
        rotary_embedding_dim=rotary_dim,
        out=tokens if inplace else None,
        layout="bshd",
        inverse=conjugate,
    )
    return x if inplace else result[0]
