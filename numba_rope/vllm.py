"""vLLM's rotary-embedding forms on numba_rope's kernels: one ``cos_sin_cache``, tokens
flattened over the batch, 1-D positions.

* :func:`rotary_embedding`: vLLM's custom op ``rotary_embedding(positions, query, key,
  head_size, cos_sin_cache, is_neox)``, in place, returns None.
* :func:`forward_native`: the same arguments, returning new arrays ``(query, key)``
  and leaving the inputs untouched, as ``RotaryEmbedding.forward_native`` does.
* :class:`RotaryEmbedding`: vLLM's module (``head_size, rotary_dim,
  max_position_embeddings, base, is_neox_style, dtype``) with ``forward_native`` and an
  in-place ``forward``.
* :func:`make_cos_sin_cache`: a ``cos_sin_cache`` from :func:`numba_rope.rope_cache`.

The forms, as vLLM's op takes them:

* ``cos_sin_cache``: ``[max_position, rotary_dim]``, the cos half then the sin half:
  row ``p`` is ``cos(p * inv_freq)`` followed by ``sin(p * inv_freq)``. The dtype of the
  query, or float32.
* ``positions``: ``[num_tokens]`` (or ``[batch_size, seq_len]``), integers.
* ``query``: ``[num_tokens, num_heads * head_size]`` or ``[num_tokens, num_heads,
  head_size]`` (with 2-D positions ``[batch_size, seq_len, ...]`` likewise); any
  strides, e.g. the q columns of a fused qkv projection.
* ``key``: the same forms with ``num_kv_heads`` heads, or None.
* ``is_neox``: True rotates halves ``(x[i], x[i + rotary_dim/2])`` (GPT-NeoX), False
  even/odd pairs ``(x[2i], x[2i+1])`` (GPT-J); the first ``rotary_dim`` channels of each
  head rotate, the others are copied.

Everything goes through views of the caller's arrays (no copy of query, key or the
cache), on the CPU for NumPy arrays and on the GPU for GPU arrays. The arithmetic is
numba_rope's contract (float32, one rounding per operation, 16-bit results rounded
once); vLLM's ``forward_native`` rounds a 16-bit result after every operation, and its
CUDA op after the last, so 16-bit results may differ from vLLM's by a unit in the last
place. Positions outside the cache raise ``IndexError`` (vLLM's CUDA op reads outside
it).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from numba_rope._autograd import check_unrecorded, forward_ad_active
from numba_rope._interop import add_leading_axis, is_torch, read_only_error, to_host
from numba_rope._validation import check_positive_int
from numba_rope.cache import rope_cache
from numba_rope.rotary import rotary_embedding as _operator
from numba_rope.rotary import rotary_embedding_qk

__all__ = ["RotaryEmbedding", "forward_native", "make_cos_sin_cache", "rotary_embedding"]


def rotary_embedding(
    positions: Any,
    query: Any,
    key: Any,
    head_size: int,
    cos_sin_cache: Any,
    is_neox: bool,
) -> None:
    """vLLM's custom op ``rotary_embedding``: rotate ``query`` and ``key`` in place.

    Parameters
    ----------
    positions : integer array
        ``[num_tokens]``, or ``[batch_size, seq_len]``: the cache row of each token.
    query : array
        ``[num_tokens, num_heads * head_size]`` or ``[num_tokens, num_heads,
        head_size]`` (``[batch_size, seq_len, ...]`` with 2-D positions). Written in
        place.
    key : array or None
        As ``query``, with its own number of heads; None rotates ``query`` alone.
    head_size : int
        Channels per head.
    cos_sin_cache : array
        ``[max_position, rotary_dim]``: cos in the first ``rotary_dim / 2`` columns, sin
        in the rest; ``rotary_dim`` even and at most ``head_size``.
    is_neox : bool
        True: halves (GPT-NeoX); False: interleaved pairs (GPT-J).

    Returns
    -------
    None
        As vLLM's op: ``query`` and ``key`` hold the result.

    Raises
    ------
    ValueError
        Shapes that do not fit together (the message names the rule and the value).
    IndexError
        A position outside the cache's rows.

    Examples
    --------
    >>> import numpy as np
    >>> from numba_rope import vllm
    >>> cache = vllm.make_cos_sin_cache(32, 8)  # [32, 8]: 4 cos columns, 4 sin columns
    >>> qkv = np.ones((3, (4 + 2 * 2) * 8), np.float32)  # 3 tokens, 4 q heads, 2 kv heads
    >>> q, k = qkv[:, : 4 * 8], qkv[:, 4 * 8 : 6 * 8]  # views: rotated where they lie
    >>> vllm.rotary_embedding(np.array([5, 6, 20]), q, k, 8, cache, True)
    >>> bool((qkv[:, 6 * 8 :] == 1).all()), bool((qkv[:, : 6 * 8] != 1).any())  # v untouched
    (True, True)
    """
    _rotate(positions, query, key, head_size, cos_sin_cache, is_neox, inplace=True)


def forward_native(
    positions: Any,
    query: Any,
    key: Any,
    head_size: int,
    cos_sin_cache: Any,
    is_neox_style: bool,
) -> tuple[Any, Any]:
    """:func:`rotary_embedding`'s arguments; returns new ``(query, key)`` (``key`` None
    when None was given) of the inputs' shapes and kinds, leaving the inputs untouched,
    as vLLM's ``RotaryEmbedding.forward_native`` does. As there, the positions may list
    the tokens in the other form than ``query`` does: ``[batch_size, seq_len]`` for a
    ``[num_tokens, ...]`` query, or ``[num_tokens]`` for a ``[batch_size, seq_len, ...]``
    one, the tokens in the same order (``key`` in ``query``'s form).

    Examples
    --------
    >>> import numpy as np
    >>> from numba_rope import vllm
    >>> cache = vllm.make_cos_sin_cache(16, 4)  # partial rotary: 4 of 8 channels
    >>> query = np.ones((2, 3, 8), np.float32)  # [num_tokens, num_heads, head_size]
    >>> q, k = vllm.forward_native(np.array([0, 9]), query, None, 8, cache, False)
    >>> k is None, q.shape, bool((q[:, :, 4:] == 1).all()), bool((query == 1).all())
    (True, (2, 3, 8), True, True)
    """
    return _rotate(positions, query, key, head_size, cos_sin_cache, is_neox_style, inplace=False)


class RotaryEmbedding:
    """vLLM's ``RotaryEmbedding`` module (plain RoPE), without torch: its
    ``cos_sin_cache`` ``[max_position_embeddings, rotary_dim]`` built by
    :func:`make_cos_sin_cache` (a NumPy array; assign a GPU copy, e.g.
    ``torch.as_tensor(rope.cos_sin_cache, device="cuda")``, to rotate GPU arrays).

    ``dtype``: the cache's, a NumPy dtype or (as vLLM takes it) a ``torch.dtype``.
    ``forward_native(positions, query, key=None)`` returns new arrays;
    ``forward(positions, query, key=None)`` rotates in place and returns ``(query, key)``,
    as vLLM's ``forward_cuda``.

    Examples
    --------
    >>> import numpy as np
    >>> from numba_rope.vllm import RotaryEmbedding
    >>> rope = RotaryEmbedding(64, 32, 2048, 10000.0, True, np.float32)
    >>> rope.cos_sin_cache.shape
    (2048, 32)
    >>> query = np.ones((5, 4 * 64), np.float32)
    >>> q, _ = rope.forward_native(np.arange(5), query)
    >>> q2, _ = rope.forward(np.arange(5), query.copy())
    >>> bool(np.array_equal(q, q2))
    True
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: Any = np.float32,
    ) -> None:
        self.head_size = operator.index(head_size)
        self.rotary_dim = operator.index(rotary_dim)
        self.max_position_embeddings = operator.index(max_position_embeddings)
        self.base = float(base)
        self.is_neox_style = bool(is_neox_style)
        _check_rotary_dim(self.rotary_dim, self.head_size)
        self.cos_sin_cache: Any = make_cos_sin_cache(
            self.max_position_embeddings, self.rotary_dim, base=self.base, dtype=dtype
        )

    def forward_native(self, positions: Any, query: Any, key: Any = None) -> tuple[Any, Any]:
        """New ``(query, key)``; see :func:`forward_native`."""
        return forward_native(
            positions, query, key, self.head_size, self.cos_sin_cache, self.is_neox_style
        )

    def forward(self, positions: Any, query: Any, key: Any = None) -> tuple[Any, Any]:
        """Rotate in place; returns ``(query, key)``; see :func:`rotary_embedding`."""
        rotary_embedding(
            positions, query, key, self.head_size, self.cos_sin_cache, self.is_neox_style
        )
        return query, key

    __call__ = forward

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position_embeddings={self.max_position_embeddings}, base={self.base}, "
            f"is_neox_style={self.is_neox_style}"
        )

    def __repr__(self) -> str:
        return f"RotaryEmbedding({self.extra_repr()})"


def make_cos_sin_cache(
    max_position: int,
    rotary_dim: int,
    *,
    base: float = 10000.0,
    scaling: dict | None = None,
    dtype: Any = np.float32,
) -> np.ndarray:
    """vLLM's ``cos_sin_cache`` ``[max_position, rotary_dim]``: the caches of
    :func:`numba_rope.rope_cache` (same arguments, Hugging Face's scaling schemes
    included), cos then sin along the last axis.

    >>> from numba_rope.vllm import make_cos_sin_cache
    >>> cache = make_cos_sin_cache(4, 2)
    >>> cache[:, 0].round(4), cache[:, 1].round(4)  # cos(p) and sin(p): inv_freq = 1
    (array([ 1.    ,  0.5403, -0.4161, -0.99  ], dtype=float32), array([0.    , 0.8415, 0.9093, 0.1411], dtype=float32))
    """
    cos, sin = rope_cache(
        max_position, rotary_dim, base=base, scaling=scaling, dtype=_numpy_dtype(dtype)
    )
    return np.concatenate([cos, sin], axis=-1)


def _numpy_dtype(dtype: Any) -> Any:
    """vLLM passes a ``torch.dtype`` (the model's): the NumPy dtype of its name
    (``torch.bfloat16`` as ``ml_dtypes.bfloat16``); anything else as it is."""
    module = type(dtype).__module__ or ""
    if module != "torch" and not module.startswith("torch."):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return name if name in ("float32", "float16", "float64") else dtype


# -- from vLLM's forms to the operator's --------------------------------------------------


def _check_rotary_dim(rotary_dim: int, head_size: int) -> None:
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(
            f"rotary_dim must be even and lie in [2, head_size = {head_size}], got {rotary_dim}"
        )


def _split_cache(cos_sin_cache: Any, head_size: int) -> tuple[Any, Any, int]:
    """Views of the cos half and the sin half, and ``rotary_dim``."""
    shape = tuple(cos_sin_cache.shape)
    if len(shape) != 2:
        raise ValueError(
            f"cos_sin_cache must be 2-D [max_position, rotary_dim] (cos half, then sin half), "
            f"got shape {shape}"
        )
    rotary_dim = shape[1]
    if rotary_dim % 2 or rotary_dim == 0:
        raise ValueError(
            f"cos_sin_cache's width rotary_dim = {rotary_dim} must be even and positive: it "
            f"holds rotary_dim / 2 cos columns, then as many sin columns (got shape {shape}); "
            f"build it with numba_rope.vllm.make_cos_sin_cache(max_position, rotary_dim)"
        )
    if rotary_dim > head_size:
        raise ValueError(
            f"cos_sin_cache's width rotary_dim = {rotary_dim} exceeds head_size = {head_size}: "
            f"a head cannot rotate more channels than it has"
        )
    half = rotary_dim // 2
    return cos_sin_cache[:, :half], cos_sin_cache[:, half:], rotary_dim


def _tokens(
    name: str, array: Any, positions_shape: tuple[int, ...], head_size: int, given: str = ""
) -> tuple[Any, int]:
    """``(view, num_heads)``: ``array`` as the operator's 3-D form ``[batch, seq_len,
    num_heads * head_size]`` or its 4-D ``bshd`` form, 1-D positions' tokens as a batch
    of one sequence. The heads are always named (q and k may come in different forms).
    ``given``: said after the positions' shape where that is not the caller's."""
    shape = tuple(array.shape)
    lead = len(positions_shape)
    forms = (
        "[num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size]"
        if lead == 1
        else "[batch_size, seq_len, num_heads * head_size] or [batch_size, seq_len, "
        "num_heads, head_size]"
    )
    if shape[:lead] != positions_shape or len(shape) not in (lead + 1, lead + 2):
        raise ValueError(
            f"{name} must be {forms} for positions of shape {positions_shape}{given}, got "
            f"shape {shape}"
        )
    if len(shape) == lead + 1:
        hidden = shape[-1]
        if hidden % head_size or hidden == 0:
            raise ValueError(
                f"{name}'s last axis ({hidden}) must be num_heads * head_size, a positive "
                f"multiple of head_size = {head_size}; got shape {shape}"
            )
        num_heads = hidden // head_size
    elif shape[-1] != head_size:
        raise ValueError(
            f"{name}'s last axis must be head_size = {head_size}, got shape {shape} (for a "
            f"flattened last axis num_heads * head_size pass {lead + 1}-D {name})"
        )
    else:
        num_heads = shape[-2]
    return (add_leading_axis(array) if lead == 1 else array), num_heads


def _as_query_tokens(positions: Any, query_shape: tuple[int, ...], head_size: int) -> Any:
    """``positions`` reshaped to ``query``'s token axes where those hold as many tokens
    in another form: ``[batch_size, seq_len]`` positions for a ``[num_tokens, ...]``
    query, ``[num_tokens]`` positions for a ``[batch_size, seq_len, ...]`` query. vLLM's
    ``forward_native`` takes these (it flattens the positions and views the query as
    ``[num_tokens, -1, head_size]``); its CUDA op, and :func:`rotary_embedding`, do not.
    Otherwise ``positions`` as they are (:func:`_tokens` names what does not fit)."""
    lead = len(positions.shape)
    if lead not in (1, 2):
        return positions
    tokens = int(np.prod(positions.shape))

    def fits(token_axes: int) -> bool:
        """The query's first ``token_axes`` axes hold the tokens, and after them come
        the channels as [num_heads * head_size] or [num_heads, head_size]."""
        shape, channels = query_shape[:token_axes], query_shape[token_axes:]
        return (
            len(shape) == token_axes
            and int(np.prod(shape)) == tokens
            and (
                (len(channels) == 1 and channels[0] % head_size == 0)
                or (len(channels) == 2 and channels[1] == head_size)
            )
        )

    if tuple(query_shape[:lead]) == tuple(positions.shape) and fits(lead):
        return positions
    # The other form: [num_tokens] positions of a [batch_size, seq_len, ...] query (a
    # decode step's seq_len of 1 too, whose first axis has as many entries as the
    # positions), or [batch_size, seq_len] positions of a [num_tokens, ...] one.
    other = 3 - lead
    return positions.reshape(tuple(query_shape[:other])) if fits(other) else positions


def _check_positions(positions: np.ndarray, rows: int) -> None:
    """Every position a row of the cache, named as the caller indexes ``positions``."""
    if positions.dtype.kind not in "iu" or positions.size == 0:
        return  # the operator refuses non-integer positions with its own TypeError
    flat = positions.reshape(-1)
    bad = np.flatnonzero((flat < 0) | (flat >= rows))
    if bad.size:
        where = ", ".join(str(int(i)) for i in np.unravel_index(int(bad[0]), positions.shape))
        # A cache of no rows: say so rather than name the empty range [0, -1].
        rule = f"positions must lie in [0, {rows - 1}]" if rows else "no position is valid"
        raise IndexError(
            f"positions[{where}] = {flat[bad[0]]} is outside cos_sin_cache, which has {rows} "
            f"rows: {rule}; build a longer cache "
            f"(numba_rope.vllm.make_cos_sin_cache(max_position, rotary_dim))"
        )


def _read_only_named(query: Any, key: Any) -> ValueError | None:
    """The error for a read-only query or key of :func:`rotary_embedding` (in place), in
    vLLM's names, or None (see :func:`_grad_error_named`)."""
    for name, array in (("query", query), ("key", key)):
        error = read_only_error(
            array,
            name,
            "rotary_embedding rotates it in place, as vLLM's op does",
            "call forward_native, which returns new arrays",
        )
        if error is not None:
            return error
    return None


def _grad_error_named(query: Any, key: Any) -> TypeError | None:
    """The error :func:`check_unrecorded` raises for query or key, named as vLLM names
    them, or None. Returned, not raised: the caller raises it ``from None`` (raised in
    its ``except`` clause, it would carry the operator's error for the same fault as its
    context, which a traceback prints as a second error, "During handling of the above
    exception, another exception occurred")."""
    for name, tensor in (("query", query), ("key", key)):
        if is_torch(tensor):  # (torch is imported then: forward_ad_active reads it)
            try:
                check_unrecorded(tensor, name, forward_ad_active())
            except TypeError as error:
                return error
    return None


def _position_error_named(positions: Any, rows: int) -> IndexError | None:
    """:func:`_check_positions`' error for ``positions`` (NumPy, or copied to the host
    from a tensor or a GPU array: only on this error path), or None (see
    :func:`_grad_error_named`)."""
    try:
        _check_positions(to_host(positions), rows)
    except IndexError as error:
        return error
    except Exception:  # not readable on the host here: the operator's error stands
        return None
    return None


def _rotate(
    positions: Any,
    query: Any,
    key: Any,
    head_size: Any,
    cos_sin_cache: Any,
    is_neox: Any,
    inplace: bool,
) -> tuple[Any, Any]:
    head_size = check_positive_int(head_size, "head_size")
    if not isinstance(is_neox, (bool, np.bool_)):
        raise TypeError(
            f"is_neox must be a bool (True: halves, GPT-NeoX; False: pairs, GPT-J), got {is_neox!r}"
        )
    cos, sin, rotary_dim = _split_cache(cos_sin_cache, head_size)
    positions_shape = tuple(positions.shape)
    if len(positions_shape) not in (1, 2):
        raise ValueError(
            f"positions must be [num_tokens] or [batch_size, seq_len], got shape {positions_shape}"
        )
    given, caller_positions = "", positions
    if not inplace:
        positions = _as_query_tokens(positions, tuple(query.shape), head_size)
        if tuple(positions.shape) != positions_shape:
            given = f" (positions of shape {positions_shape} taken as query's tokens)"
            positions_shape = tuple(positions.shape)
    lead = len(positions_shape)
    q, num_heads = _tokens("query", query, positions_shape, head_size)
    ids = add_leading_axis(positions) if lead == 1 else positions
    options: dict[str, Any] = {
        "interleaved": not is_neox,
        "rotary_embedding_dim": rotary_dim,
        "layout": "bshd",
    }
    k, num_kv_heads = (
        (None, None) if key is None else _tokens("key", key, positions_shape, head_size, given)
    )
    try:
        if key is None:
            result = _operator(
                q, cos, sin, ids, num_heads=num_heads, out=q if inplace else None, **options
            )
            return (query, None) if inplace else (result[0] if lead == 1 else result, None)
        result_q, result_k = rotary_embedding_qk(
            q,
            k,
            cos,
            sin,
            ids,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            out_q=q if inplace else None,
            out_k=k if inplace else None,
            **options,
        )
    except TypeError:
        # A tensor autograd follows (the operator has written nothing): named as vLLM
        # names it, not as the operator does ("input"); checked only on this path.
        named = _grad_error_named(query, key)
        if named is None:
            raise
        raise named from None
    except ValueError:
        # A read-only query or key of the in-place op (the operator has written nothing):
        # named as vLLM names it, not as the operator's out_q; checked only on this path.
        named_array = _read_only_named(query, key) if inplace else None
        if named_array is None:
            raise
        raise named_array from None
    except IndexError:
        # A position outside the cache (the operator has written nothing): named as the
        # caller indexes ``positions``, not as the operator's ids[0, t].
        named_position = _position_error_named(caller_positions, int(cos_sin_cache.shape[0]))
        if named_position is None:
            raise
        raise named_position from None
    if inplace:
        return query, key
    if lead == 1:
        return result_q[0], result_k[0]
    return result_q, result_k
