"""Hugging Face transformers' ``apply_rotary_pos_emb``, with its signature and its
cos/sin form, computed by numba_rope.

transformers' rotary modules (``LlamaRotaryEmbedding`` and its kin) return ``cos``
and ``sin`` of shape ``[batch, seq_len, rotary_dim]`` whose two halves repeat each
other (``cat(freqs, freqs)``), and ``apply_rotary_pos_emb`` computes
``q * cos + rotate_half(q) * sin``: the non-interleaved rotation of the pairs
``(x[i], x[i + rotary_dim/2])``, which is the operator's. :func:`apply_rotary_pos_emb`
checks that the halves are equal, takes their first half (a view) and calls
:func:`numba_rope.rotary_embedding_qk`, or for torch tensors the differentiable
:func:`numba_rope.torch.rotary_embedding_qk` (torch is imported only then).

Nothing here imports transformers or torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from numba_rope._halves import first_half
from numba_rope._interop import is_torch, like, over_batch
from numba_rope.rotary import rotary_embedding_qk

__all__ = ["apply_rotary_pos_emb"]

#: ``unsqueeze_dim`` -> the layout of q and k it implies for 3-D cos/sin.
_LAYOUT_OF_UNSQUEEZE_DIM = {1: "bhsd", -3: "bhsd", 2: "bshd", -2: "bshd"}


def apply_rotary_pos_emb(
    q: Any,
    k: Any,
    cos: Any,
    sin: Any,
    position_ids: Any = None,
    unsqueeze_dim: int = 1,
) -> tuple[Any, Any]:
    """Rotate ``q`` and ``k`` as transformers' ``apply_rotary_pos_emb`` does, with its
    arguments; torch tensors (differentiable with respect to q and k) or NumPy arrays.

    Parameters
    ----------
    q, k : tensor or array
        ``[batch, heads, seq_len, head_dim]`` with ``unsqueeze_dim=1`` (the default),
        ``[batch, seq_len, heads, head_dim]`` with ``unsqueeze_dim=2``; ``k`` may have
        fewer heads (grouped-query attention). float32, float16, bfloat16 or float64.
    cos, sin : tensor or array
        ``[batch, seq_len, rotary_dim]`` (or ``[1, seq_len, rotary_dim]``, broadcast over
        the batch), as transformers' rotary modules return them: full width, the two
        halves equal. ``rotary_dim`` smaller than ``head_dim`` is partial rotary (GPT-NeoX,
        Phi): the first ``rotary_dim`` channels rotate, the rest pass through. Same dtype
        as q, or float32 for 16-bit q. NumPy caches serve torch q and k too (taken as
        tensors over their memory).
    position_ids : optional
        Ignored with 3-D cos/sin, as transformers 4.x ignores it (transformers 5 dropped
        it); with 2-D caches ``[max_position, rotary_dim]`` (the form of transformers
        before 4.38, ``cos[position_ids]``), the ``[batch, seq_len]`` row of each token
        (``[1, seq_len]``: the same rows for every sequence, broadcast as there).
    unsqueeze_dim : {1, 2}
        The axis of q and k that holds the heads (-3 and -2 are accepted as 1 and 2).

    Returns
    -------
    (q_embed, k_embed)
        New tensors (arrays) of q's type, shape and dtype (transformers promotes 16-bit
        q with float32 cos to float32; here the result keeps q's dtype, computed in
        float32 and rounded once).

    Raises
    ------
    ValueError
        The halves of cos or sin differ (the operator rotates each pair by one angle: a
        cache whose halves differ cannot be represented; the message names the first
        place), an ``unsqueeze_dim`` other than 1 or 2, caches of another rank; and the
        errors of :func:`numba_rope.rotary_embedding_qk`.
    TypeError
        ``position_ids`` that is not an array (an ``unsqueeze_dim`` passed as the fifth
        positional argument, as transformers 5 takes it).

    Notes
    -----
    In float32 the result equals transformers' bit for bit: ``q * cos +
    rotate_half(q) * sin`` rounds the same two products and one sum (or difference) per
    element as the operator. In 16-bit transformers rounds after every operation;
    numba_rope computes in float32 and rounds once.

    Examples
    --------
    >>> import numpy as np
    >>> import numba_rope
    >>> from numba_rope.huggingface import apply_rotary_pos_emb
    >>> head_dim, seq_len = 8, 5
    >>> inv_freq = 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)
    >>> freqs = np.arange(seq_len)[:, None] * inv_freq          # [seq, head_dim/2]
    >>> emb = np.concatenate([freqs, freqs], axis=-1)[None]     # [1, seq, head_dim]
    >>> cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    >>> q = np.ones((2, 4, seq_len, head_dim), np.float32)      # [batch, heads, seq, dim]
    >>> k = np.ones((2, 1, seq_len, head_dim), np.float32)
    >>> q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin)
    >>> q_embed.shape, k_embed.shape
    ((2, 4, 5, 8), (2, 1, 5, 8))
    >>> bad = cos.copy(); bad[0, 3, 6] = 0.0
    >>> apply_rotary_pos_emb(q, k, bad, sin)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: the halves of cos differ: cos[0, 3, 2] = 0.9995... but cos[0, 3, 6] = 0.0. ...
    """
    layout = _LAYOUT_OF_UNSQUEEZE_DIM.get(unsqueeze_dim) if type(unsqueeze_dim) is int else None
    if layout is None:
        raise ValueError(
            f"unsqueeze_dim must be 1 (q and k of shape [batch, heads, seq_len, head_dim]) "
            f"or 2 ([batch, seq_len, heads, head_dim]), got {unsqueeze_dim!r}"
        )
    if position_ids is not None and not hasattr(position_ids, "shape"):
        raise TypeError(
            f"position_ids is {position_ids!r}, not an array; transformers 5 takes "
            f"unsqueeze_dim as the fifth positional argument, this function (transformers "
            f"4's signature) takes position_ids there: pass unsqueeze_dim={position_ids!r} "
            f"by keyword"
        )
    if len(cos.shape) != len(sin.shape) or len(cos.shape) not in (2, 3):
        raise ValueError(
            f"cos and sin have shapes {tuple(cos.shape)} and {tuple(sin.shape)}; "
            f"apply_rotary_pos_emb takes transformers' [batch, seq_len, rotary_dim] (or "
            f"[1, seq_len, rotary_dim]), or [max_position, rotary_dim] with position_ids"
        )
    ids = None
    if len(cos.shape) == 2:
        if position_ids is None:
            raise ValueError(
                f"cos and sin of shape {tuple(cos.shape)} are per position: pass "
                f"position_ids [batch, seq_len], or cos[position_ids] (transformers' "
                f"[batch, seq_len, rotary_dim])"
            )
        ids = position_ids
        if len(ids.shape) == 2 and ids.shape[0] == 1 and q.shape[0] != 1:
            # One row for the batch (transformers' arange(...).unsqueeze(0)), broadcast
            # as cos[position_ids] was there: a view.
            rows = (q.shape[0], ids.shape[1])
            ids = ids.expand(rows) if is_torch(ids) else np.broadcast_to(ids, rows)
    rotary_dim = int(cos.shape[-1])
    # One table for the batch ([1, seq_len, rotary_dim]) is broadcast over it as a view,
    # after its halves are checked and halved: the check reads the table once, not once
    # per sequence.
    batch = q.shape[0] if ids is None and cos.shape[0] == 1 and q.shape[0] != 1 else None
    try:
        if is_torch(q):
            import numba_rope.torch  # registers the ops

            if not (is_torch(cos) and is_torch(sin)):
                # NumPy caches (rope_cache's, written twice): halved here, on the host, and
                # taken by numba_rope.torch as tensors over their memory.
                return numba_rope.torch.rotary_embedding_qk(
                    q,
                    k,
                    *over_batch(first_half(cos, "cos"), first_half(sin, "sin"), batch),
                    ids,
                    rotary_embedding_dim=rotary_dim,
                    layout=layout,
                )
            numba_rope.torch.check_caches(cos, sin)  # (gradients for q and k only)
            if ids is not None and not is_torch(ids):
                ids = like(ids, q)  # (a read-only broadcast row too, without torch's warning)
            # The op checks the halves, halves the caches and broadcasts a one-row table over
            # the batch where the data are real (under torch.compile too); it is
            # differentiable with respect to q and k (recorded_qk_op records either mode).
            return numba_rope.torch.recorded_qk_op(
                q, k, cos, sin, ids, None, None, False, rotary_dim, layout, None, None, False, True
            )
        return rotary_embedding_qk(
            q,
            k,
            *over_batch(first_half(cos, "cos"), first_half(sin, "sin"), batch),
            ids,
            rotary_embedding_dim=rotary_dim,
            layout=layout,
        )
    except ValueError:
        # Caches that do not fit q (the operator has written nothing): said in this
        # function's terms and the caller's shapes, not the operator's (layout=,
        # rotary_embedding_dim, the halved caches); looked for only on this path.
        named = _shape_error(q, ids if ids is not None else cos, cos, unsqueeze_dim, layout)
        if named is None:
            raise
        raise named from None


def _shape_error(
    q: Any, positions: Any, cos: Any, unsqueeze_dim: int, layout: str
) -> ValueError | None:
    """The error of :func:`_check_sequence_axis`, or of cos wider than q's head (an odd
    width is refused where the halves are taken), or None."""
    try:
        _check_sequence_axis(q, positions, unsqueeze_dim, layout)
    except ValueError as error:
        return error
    rotary_dim, head_dim = int(cos.shape[-1]), int(q.shape[-1])
    if rotary_dim > head_dim:
        return ValueError(
            f"cos and sin have {rotary_dim} columns (the rotated channels, rotary_dim), "
            f"more than q's head_dim = {head_dim} (q has shape {tuple(q.shape)}): pass the "
            f"rotary module's cos and sin for this head size"
        )
    return None


def _check_sequence_axis(q: Any, positions: Any, unsqueeze_dim: int, layout: str) -> None:
    """``ValueError`` where q's sequence axis under ``unsqueeze_dim`` does not match the
    positions (``position_ids``, or cos of ``[batch, seq_len, rotary_dim]``) but its other
    middle axis does: the other ``unsqueeze_dim`` was meant. (The operator would say so in
    its own terms, ``layout=``, which this function does not take.)"""
    if len(q.shape) != 4 or len(positions.shape) < 2:
        return  # the operator words the other errors
    seq_len = int(positions.shape[1])
    axis, other_axis, other_dim = (2, 1, 2) if layout == "bhsd" else (1, 2, 1)
    if int(q.shape[axis]) == seq_len:
        return
    order = {1: "[batch, heads, seq_len, head_dim]", 2: "[batch, seq_len, heads, head_dim]"}
    what = "position_ids" if len(positions.shape) == 2 else "cos"
    read = (
        f"q has shape {tuple(q.shape)}: with unsqueeze_dim={unsqueeze_dim} it is read as "
        f"{order[3 - other_dim]}, whose seq_len {int(q.shape[axis])} is not the {seq_len} "
        f"positions of {what} (shape {tuple(positions.shape)})"
    )
    if int(q.shape[other_axis]) == seq_len:
        raise ValueError(
            f"{read}; its axis {other_axis} has {seq_len}: if q is {order[other_dim]}, pass "
            f"unsqueeze_dim={other_dim}"
        )
    # (Said here in the caller's shapes: the operator would give the halved caches'.)
    form = "[batch, seq_len]" if what == "position_ids" else "[batch, seq_len, rotary_dim]"
    raise ValueError(f"{read}; {what} must be {form} with seq_len = {int(q.shape[axis])}")
