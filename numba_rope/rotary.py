"""The public operator, for one tensor or q and k: both go one internal path
(:func:`_rotate`), after the remembered plan of a small NumPy call (see
:mod:`numba_rope._cpu.backend`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from numba_rope._autograd import compiling, outside_graphs
from numba_rope._cpu import backend as cpu_backend
from numba_rope._cpu import torch_host
from numba_rope._dispatch import backend_for, is_scalar, library
from numba_rope._validation import QK_NAMES, SINGLE_NAMES, check_call, check_flag
from numba_rope.typing import Array, ArrayT, PositionIds, PositionOffset

#: ``numpy.ndarray``, one global lookup on the small call's path rather than two.
_ndarray = np.ndarray
_INT64 = np.dtype(np.int64)


def _as_int64(offsets: np.ndarray) -> np.ndarray:
    """An array of offsets of another integer dtype, in this machine's byte order, as
    int64, exactly (signed integers, unsigned ones of fewer than 64 bits); else as it
    is: uint64 offsets keep the general path's check of values past int64, and arrays
    in the other byte order its refusal. The small calls' compiled plans take int64
    offsets: int32 ones (flash-attn's ``cache_seqlens``) ran the Python plan, 2-3 µs
    more a call (docs/performance.md, "Thirty-third session")."""
    dtype = offsets.dtype
    if dtype.isnative and (dtype.kind == "i" or (dtype.kind == "u" and dtype.itemsize < 8)):
        return offsets.astype(_INT64)
    return offsets


def rotary_embedding(
    input: ArrayT,
    cos_cache: Array,
    sin_cache: Array,
    position_ids: PositionIds | None = None,
    *,
    interleaved: bool = False,
    rotary_embedding_dim: int = 0,
    out: ArrayT | None = None,
    layout: str = "bhsd",
    num_heads: int | None = None,
    position_offset: PositionOffset | None = None,
    inverse: bool = False,
    stream: Any = None,
    check_position_ids: bool = True,
) -> ArrayT:
    """Rotary position embedding, as TensorRT's ``RotaryEmbedding`` layer and ONNX
    ``RotaryEmbedding`` (opset 23) define it.

    Each pair of channels ``(x1, x2)`` of a token is rotated by the angle of its
    position: ``x1*cos - x2*sin`` and ``x2*cos + x1*sin``, with pair ``i`` taking
    ``cos_cache[..., i]`` and ``sin_cache[..., i]``.

    Parameters
    ----------
    input : array
        ``[batch, num_heads, seq_len, head_size]`` (``layout="bhsd"``), ``[batch,
        seq_len, num_heads, head_size]`` (``layout="bshd"``), or 3-D ``[batch, seq_len,
        num_heads * head_size]`` with ``num_heads=``. float32, float16, bfloat16
        (``ml_dtypes.bfloat16``) or float64. Any strides, including views such as
        ``qkv[..., :128]`` and negative strides.
    cos_cache, sin_cache : array
        Without ``position_ids``: shape ``[batch, seq_len, rotary_dim/2]``.
        With ``position_ids``: shape ``[max_position_id + 1, rotary_dim/2]``.
        Same dtype as ``input``, or float32 (more precise caches for 16-bit input).
    position_ids : integer array, shape ``[batch, seq_len]``, optional
        Row of the caches used by each token (int64; int32 and other integer types are
        accepted). Every id must lie in ``[0, cache rows)``, else ``IndexError``.
        Caches with position ids (or an offset) are 2-D.
    interleaved : bool, default False
        True: pairs are ``(x[2i], x[2i+1])``. False: pairs are ``(x[i], x[i + rotary_dim/2])``.
    rotary_embedding_dim : int, default 0
        Number of leading channels that rotate; 0 means the whole head. The remaining
        channels are copied through unchanged. Must be even.
    out : array, optional
        Where to write the result: same shape and dtype as ``input``. May be ``input``
        itself (in place). It is left untouched when the call raises.
    layout : {"bhsd", "bshd"}, default "bhsd"
        Axis order of 4-D ``input`` and ``out``: TensorRT/ONNX's, or Hugging Face /
        flash-attn / vLLM's ``[batch, seq_len, num_heads, head_size]``.
    num_heads : int, optional
        Required for 3-D input (ONNX's 3-D form), whose last axis holds the heads.
    position_offset : int or integer array of shape ``[batch]``, optional
        Token ``s`` of sequence ``b`` uses cache row ``offset[b] + s`` (decoding with a
        KV cache), as if ``position_ids = offset[:, None] + arange(seq_len)``, without
        building them. Not together with ``position_ids``.
    inverse : bool, default False
        Rotate by the negative angle: the exact inverse of the rotation, and its
        gradient with respect to ``input`` (``inverse=True`` equals passing
        ``-sin_cache``, bit for bit).
    stream : optional
        GPU arrays only (ignored for NumPy arrays): the CUDA stream to run on, as a numba
        stream, a ``torch.cuda.Stream``, a ``cupy.cuda.Stream`` or a raw handle. Default:
        torch's current stream for torch tensors, CuPy's for CuPy arrays, else Numba's
        default stream.
    check_position_ids : bool, default True
        GPU arrays only: False skips the range check of ``position_ids`` or of an
        offset array (a small kernel and one synchronization); tokens whose position is
        out of range then get a row of NaN instead of an ``IndexError``. On the CPU
        positions are always checked.

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
        Arguments that are not arrays (ndarray subclasses other than ``numpy.memmap``
        included), arrays on different devices, unsupported dtypes, arrays in
        non-native byte order, cache dtypes that differ or do not fit the input,
        non-integer ``position_ids``, ``out`` of another dtype, option flags that are
        not bools.
    ValueError
        Input not 4-D, odd or out-of-range ``rotary_embedding_dim``, caches,
        ``position_ids`` or ``out`` of the wrong shape, a read-only ``out`` or one whose
        elements share memory.
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
    key = None
    if type(input) is _ndarray and (check_position_ids is True or check_position_ids is False):
        if type(position_offset) is _ndarray and position_offset.dtype is not _INT64:
            position_offset = _as_int64(position_offset)
        if (
            type(cos_cache) is _ndarray
            and (position_ids is None or type(position_ids) is _ndarray)
            and (interleaved is False or interleaved is True)
            and (inverse is False or inverse is True)
            and type(rotary_embedding_dim) is int
            and type(layout) is str
            and (num_heads is None or type(num_heads) is int)
        ):
            # A small call repeated: its compiled plan, found by cpu_backend.fast_key.
            host: Any = input  # a NumPy array (ArrayT does not narrow)
            fast_key = (
                host.shape, host.dtype, cos_cache.dtype,
                None if position_ids is None else position_ids.dtype,
                interleaved, rotary_embedding_dim, layout, inverse, out is input, num_heads,
                None if position_offset is None
                else position_offset.dtype if type(position_offset) is _ndarray
                else type(position_offset),
            )  # fmt: skip
            fast = cpu_backend.FAST.get(fast_key)
            if fast is not None:
                result = fast[0](input, cos_cache, sin_cache, position_ids, out, position_offset)
                if result is not None:
                    return result
        # A NumPy call whose signature was validated before runs its plan directly.
        key = cpu_backend.plan_key(
            input,
            None,
            cos_cache,
            sin_cache,
            position_ids,
            out,
            None,
            interleaved,
            rotary_embedding_dim,
            layout,
            num_heads,
            None,
            inverse,
            position_offset,
        )
        if key is not None:
            plan = cpu_backend.PLANS.get(key)
            if plan is not None:
                result = plan(
                    input, None, cos_cache, sin_cache, position_ids, out, None, position_offset
                )
                if result is not None:
                    return result
    elif type(input).__module__ == "torch" and compiling():
        return outside_graphs(rotary_embedding)(  # type: ignore[no-any-return]
            input, cos_cache, sin_cache, position_ids, interleaved=interleaved,
            rotary_embedding_dim=rotary_embedding_dim, out=out, layout=layout,
            num_heads=num_heads, position_offset=position_offset, inverse=inverse,
            stream=stream, check_position_ids=check_position_ids,
        )  # fmt: skip
    elif type(input).__module__ == "torch" and (
        position_offset is None or type(position_offset) is int
    ):
        # Plain torch CPU tensors: the NumPy call on their views, its plans included
        # (what _rotate does for any torch CPU call, with less work on the way).
        views = torch_host.plain_views((input, cos_cache, sin_cache, position_ids, out), 1)
        if views is not None:
            result = rotary_embedding(
                views[0], views[1], views[2], views[3], interleaved=interleaved,
                rotary_embedding_dim=rotary_embedding_dim, out=views[4], layout=layout,
                num_heads=num_heads, position_offset=position_offset, inverse=inverse,
                stream=stream, check_position_ids=check_position_ids,
            )  # fmt: skip
            return torch_host.result_of(input, out, result)
    options = (interleaved, rotary_embedding_dim, layout, num_heads, None, inverse)
    return _rotate(
        SINGLE_NAMES,
        (input,),
        (out,),
        cos_cache,
        sin_cache,
        position_ids,
        position_offset,
        options,
        stream,
        check_position_ids,
        key,
    )[0]


def _torch_host_views(arguments: tuple, names: tuple[str, ...]) -> tuple | None:
    """The arguments of a call with torch CPU tensors among host arrays, each tensor as
    a NumPy view of its memory (one view per tensor object, so that ``out=x`` stays in
    place); None when there is no torch CPU tensor, or when an argument is neither
    that, a NumPy array nor a scalar (GPU arrays, ndarray subclasses, lists: the
    general path names them)."""
    views: dict[int, Any] = {}
    converted = []
    for argument, name in zip(arguments, names, strict=True):
        if argument is None or type(argument) is np.ndarray:
            converted.append(argument)
            continue
        kind = library(argument)  # (before is_scalar: tensors are the common case here)
        if kind == "numpy" or (kind is None and is_scalar(argument)):  # numpy.memmap
            converted.append(argument)
            continue
        if kind != "torch_cpu":
            return None
        view = views.get(id(argument))
        if view is None:
            view = views[id(argument)] = torch_host.host_view(argument, name)
        elif name in torch_host.OUTPUT_NAMES:  # in place: viewed first as an input
            torch_host.check_written(argument, name)
        converted.append(view)
    return tuple(converted) if views else None


def _call_on_views(
    views: tuple, n_inputs: int, options: tuple, stream: Any, check_position_ids: Any
) -> tuple:
    """The public function of ``n_inputs`` tensors called on host arrays only: ``views``
    as :func:`_rotate` orders the arguments (inputs, caches, ids, outputs, offset)."""
    interleaved, rotary_dim, layout, num_heads, num_kv_heads, inverse = options
    cos, sin, ids = views[n_inputs : n_inputs + 3]
    outs = views[n_inputs + 3 : 2 * n_inputs + 3]
    keywords: dict[str, Any] = {
        "interleaved": interleaved,
        "rotary_embedding_dim": rotary_dim,
        "layout": layout,
        "num_heads": num_heads,
        "position_offset": views[-1],
        "inverse": inverse,
        "stream": stream,
        "check_position_ids": check_position_ids,
    }
    if n_inputs == 1:
        return (rotary_embedding(views[0], cos, sin, ids, out=outs[0], **keywords),)
    q, k = views[:2]
    return rotary_embedding_qk(
        q, k, cos, sin, ids, num_kv_heads=num_kv_heads, out_q=outs[0], out_k=outs[1], **keywords
    )


def _rotate(
    names: tuple[tuple[str, ...], tuple[str, ...]],
    inputs: tuple,
    outs: tuple,
    cos_cache: Any,
    sin_cache: Any,
    position_ids: Any,
    position_offset: Any,
    options: tuple,
    stream: Any,
    check_position_ids: Any,
    key: tuple | None,
) -> tuple:
    """The one path of every call, for one tensor or several: pick the backend from the
    array types, validate into a :class:`~numba_rope._validation.Call`, run it, and
    remember a plan for the next NumPy call of the same signature (``key``)."""
    input_names, out_names = names
    offset_array = None if is_scalar(position_offset) else position_offset
    arrays = (*inputs, cos_cache, sin_cache, position_ids, *outs, offset_array)
    argument_names = (
        *input_names,
        "cos_cache",
        "sin_cache",
        "position_ids",
        *out_names,
        "position_offset",
    )
    if key is None:  # (a key means NumPy arrays alone)
        views = _torch_host_views((*arrays[:-1], position_offset), argument_names)
        if views is not None:
            # torch CPU tensors: the NumPy call on their memory, whose next calls of this
            # signature take its remembered plan; results as the caller's kinds.
            results = _call_on_views(views, len(inputs), options, stream, check_position_ids)
            return torch_host.as_results(inputs, outs, results)
    backend = backend_for(arrays, argument_names, stream)
    describe = backend.describe
    if type(position_offset) is int:
        # Any Python int is an integer offset, even one beyond int64 (whose value is
        # then reported out of range, not its NumPy dtype "object").
        offset = ((), np.dtype(np.int64))
    elif position_offset is not None and is_scalar(position_offset):
        offset = ((), np.asarray(position_offset).dtype)
    else:
        offset = describe(position_offset)
    call = check_call(
        names,
        tuple(describe(x) for x in inputs),
        tuple(backend.describe_out(out) for out in outs),
        describe(cos_cache),
        describe(sin_cache),
        describe(position_ids),
        offset,
        *options,
    )
    check = check_flag(check_position_ids, "check_position_ids")
    results = backend.run(
        call, inputs, outs, cos_cache, sin_cache, position_ids, position_offset, check
    )
    if key is not None and backend is cpu_backend and key not in cpu_backend.PLANS:
        interleaved, rotary_dim, layout, num_heads, num_kv_heads, inverse = options
        plan = cpu_backend.make_plan(
            call,
            inputs,
            cos_cache,
            position_ids,
            (interleaved, rotary_dim, layout, inverse, num_heads, num_kv_heads),
            position_offset,
        )
        cpu_backend.remember_plan(key, plan)
    return results


def rotary_embedding_qk(
    q: ArrayT,
    k: ArrayT,
    cos_cache: Array,
    sin_cache: Array,
    position_ids: PositionIds | None = None,
    *,
    interleaved: bool = False,
    rotary_embedding_dim: int = 0,
    layout: str = "bhsd",
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    position_offset: PositionOffset | None = None,
    inverse: bool = False,
    out_q: ArrayT | None = None,
    out_k: ArrayT | None = None,
    stream: Any = None,
    check_position_ids: bool = True,
) -> tuple[ArrayT, ArrayT]:
    """Rotate queries and keys in one pass (one launch on the GPU).

    Equal to ``(rotary_embedding(q, ...), rotary_embedding(k, ...))`` with the same
    caches and keywords, bit for bit. ``k`` may have fewer heads than ``q``
    (grouped-query attention); batch, sequence length, head size and dtype must match.

    Parameters
    ----------
    q, k : array
        As ``input`` of :func:`rotary_embedding`, in the same ``layout``. For 3-D
        input, ``num_heads`` splits q and ``num_kv_heads`` (default: ``num_heads``)
        splits k.
    out_q, out_k : array, optional
        Destinations (may be ``q`` and ``k`` themselves, e.g. views of one fused qkv
        buffer rotated in place). They must not share memory with each other
        (``ValueError``, on the CPU and the GPU).
    cos_cache, sin_cache, position_ids, interleaved, rotary_embedding_dim, layout, \
position_offset, inverse, stream, check_position_ids
        As for :func:`rotary_embedding`.

    Returns
    -------
    (q_out, k_out)
        ``out_q``/``out_k`` if given, else new arrays of the inputs' type.

    Examples
    --------
    >>> import numpy as np
    >>> import numba_rope
    >>> cos, sin = numba_rope.rope_cache(16, 8)
    >>> qkv = np.random.default_rng(0).standard_normal((1, 3, 4, 8 + 8 + 8), np.float32)
    >>> q, k = qkv[..., :8], qkv[..., 8:16]
    >>> expected_q = numba_rope.rotary_embedding(q, cos, sin, position_offset=5, layout="bshd")
    >>> _ = numba_rope.rotary_embedding_qk(
    ...     q, k, cos, sin, position_offset=5, layout="bshd", out_q=q, out_k=k
    ... )
    >>> bool(np.array_equal(qkv[..., :8], expected_q))
    True
    """
    key = None
    if (
        type(q) is _ndarray
        and type(k) is _ndarray
        and (check_position_ids is True or check_position_ids is False)
    ):
        if type(position_offset) is _ndarray and position_offset.dtype is not _INT64:
            position_offset = _as_int64(position_offset)
        if (
            type(cos_cache) is _ndarray
            and (position_ids is None or type(position_ids) is _ndarray)
            and (interleaved is False or interleaved is True)
            and (inverse is False or inverse is True)
            and type(rotary_embedding_dim) is int
            and type(layout) is str
            and (num_heads is None or type(num_heads) is int)
            and (num_kv_heads is None or type(num_kv_heads) is int)
        ):
            # A small call repeated: its compiled plan, found by cpu_backend.fast_key.
            host_q: Any = q  # NumPy arrays (ArrayT does not narrow)
            host_k: Any = k
            fast_key = (
                host_q.shape, host_q.dtype, cos_cache.dtype,
                None if position_ids is None else position_ids.dtype,
                interleaved, rotary_embedding_dim, layout, inverse, out_q is q, num_heads,
                None if position_offset is None
                else position_offset.dtype if type(position_offset) is _ndarray
                else type(position_offset),
                host_k.shape, out_k is k, num_kv_heads,
            )  # fmt: skip
            fast = cpu_backend.FAST.get(fast_key)
            if fast is not None:
                results = fast[0](
                    q, k, cos_cache, sin_cache, position_ids, out_q, out_k, position_offset
                )
                if results is not None:
                    return results
        key = cpu_backend.plan_key(
            q,
            k,
            cos_cache,
            sin_cache,
            position_ids,
            out_q,
            out_k,
            interleaved,
            rotary_embedding_dim,
            layout,
            num_heads,
            num_kv_heads,
            inverse,
            position_offset,
        )
        if key is not None:
            plan = cpu_backend.PLANS.get(key)
            if plan is not None:
                results = plan(
                    q, k, cos_cache, sin_cache, position_ids, out_q, out_k, position_offset
                )
                if results is not None:
                    return results
    elif type(q).__module__ == "torch" and compiling():
        return outside_graphs(rotary_embedding_qk)(  # type: ignore[no-any-return]
            q, k, cos_cache, sin_cache, position_ids, interleaved=interleaved,
            rotary_embedding_dim=rotary_embedding_dim, out_q=out_q, out_k=out_k,
            layout=layout, num_heads=num_heads, num_kv_heads=num_kv_heads,
            position_offset=position_offset, inverse=inverse, stream=stream,
            check_position_ids=check_position_ids,
        )  # fmt: skip
    elif type(q).__module__ == "torch" and (
        position_offset is None or type(position_offset) is int
    ):
        # Plain torch CPU tensors: as in rotary_embedding.
        views = torch_host.plain_views((q, k, cos_cache, sin_cache, position_ids, out_q, out_k), 2)
        if views is not None:
            results = rotary_embedding_qk(
                views[0], views[1], views[2], views[3], views[4], interleaved=interleaved,
                rotary_embedding_dim=rotary_embedding_dim, out_q=views[5], out_k=views[6],
                layout=layout, num_heads=num_heads, num_kv_heads=num_kv_heads,
                position_offset=position_offset, inverse=inverse, stream=stream,
                check_position_ids=check_position_ids,
            )  # fmt: skip
            return torch_host.as_results((q, k), (out_q, out_k), results)
    options = (interleaved, rotary_embedding_dim, layout, num_heads, num_kv_heads, inverse)
    return _rotate(
        QK_NAMES,
        (q, k),
        (out_q, out_k),
        cos_cache,
        sin_cache,
        position_ids,
        position_offset,
        options,
        stream,
        check_position_ids,
        key,
    )
