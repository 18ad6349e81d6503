"""Every check of a call's arguments, in one place, before any kernel runs.

The checks see only descriptions of the arrays (shape, dtype as a NumPy dtype, and for
outputs whether they are writeable), whatever the device, so the same rules and the
same messages hold on the CPU and on the GPU. Each error says what is wrong, the value
received and what would be accepted. A call that passes is described by one
:class:`Call` record, which the backends read by name.

Errors that depend on the values in the arrays (a position id outside the caches) are
found by the kernels; their messages are built here too (:func:`position_error`,
:func:`offset_error`) and raised by the backend that launched the kernel.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
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

#: Memory layouts of 4-D input: TensorRT/ONNX's, and Hugging Face / flash-attn / vLLM's.
LAYOUTS = ("bhsd", "bshd")

#: What the kernels take for positions, by what the caller passed: caches indexed by
#: token (no positions), 2-D position ids, one offset for the batch, an offset per entry.
POSITION_KINDS = ("token", "ids", "offset", "offsets")

#: Argument names of the two public functions, in the order of their descriptions.
SINGLE_NAMES = (("input",), ("out",))
QK_NAMES = (("q", "k"), ("out_q", "out_k"))


@dataclass(frozen=True, slots=True)
class Call:
    """A validated call, for one tensor (``rotary_embedding``) or several
    (``rotary_embedding_qk``: q and k), read by name.

    ``shapes`` holds each tensor's logical ``[batch, num_heads, seq_len, head_size]``;
    the tensors share batch, sequence length, head size and dtype, and may differ in
    heads. ``positions`` is one of :data:`POSITION_KINDS`; ``n_positions`` is the
    number of cache rows that position ids and offsets index (the caches' first axis).
    """

    dtype: np.dtype
    cache_dtype: np.dtype
    shapes: tuple[tuple[int, int, int, int], ...]
    layout: str
    interleaved: bool
    rotary_dim: int
    inverse: bool
    positions: str
    n_positions: int

    @property
    def batch(self) -> int:
        return self.shapes[0][0]

    @property
    def seq_len(self) -> int:
        return self.shapes[0][2]


#: ``(shape, dtype)`` of an argument, or None when it is absent; outputs carry two more
#: items: whether they are writeable, and whether their elements are distinct in memory
#: (:func:`numba_rope._geometry.elements_distinct`).
Description = tuple[Any, ...] | None


def check_devices(names: list[str], type_names: list[str], devices: list[str | None]) -> str:
    """The one device of a call's given arguments (``"cpu"`` or ``"cuda"``), from each
    argument's device as the dispatch table reads it (None: not an array the operator
    takes); else ``TypeError`` naming the argument and where it is."""
    for name, type_name, device in zip(names, type_names, devices, strict=True):
        if device is None:
            raise TypeError(
                f"{name} is a {type_name}; rotary_embedding accepts NumPy arrays "
                f"(numpy.ndarray or numpy.memmap: convert with numpy.asarray, which also "
                f"drops a subclass's meaning such as a mask), torch tensors on the CPU, or "
                f"arrays on an NVIDIA GPU: CuPy arrays, Numba device arrays and torch CUDA "
                f"tensors"
            )
    on_gpu = [name for name, device in zip(names, devices, strict=True) if device == "cuda"]
    if not on_gpu:
        return "cpu"
    on_host = [name for name, device in zip(names, devices, strict=True) if device == "cpu"]
    if on_host:
        places = {
            name: f"on the GPU ({type_name})"
            if device == "cuda"
            else "a torch.Tensor on the CPU"
            if type_name.startswith("torch.")
            else "a NumPy array on the host"
            for name, type_name, device in zip(names, type_names, devices, strict=True)
        }
        raise TypeError(
            "all arrays of a call must be on one device, but "
            + "; ".join(f"{name} is {places[name]}" for name in on_gpu + on_host)
            + f". Move {', '.join(on_host)} to the GPU (numba.cuda.to_device, cupy.asarray, "
            f"torch.as_tensor(..., device='cuda')) or {', '.join(on_gpu)} to the host"
        )
    return "cuda"


def check_dtype(dtype: np.dtype, name: str = "input") -> str:
    """Return the name of a supported input dtype, or raise ``TypeError``."""
    if dtype.name not in INPUT_DTYPES:
        raise TypeError(
            f"{name} has dtype {dtype.name}; rotary_embedding accepts "
            f"{', '.join(INPUT_DTYPES)} (bfloat16 as ml_dtypes.bfloat16); convert it with "
            f".astype(np.float32) (NumPy) or .float() (torch)"
        )
    return dtype.name


def _check_byte_order(name: str, dtype: np.dtype) -> None:
    """Arrays in the machine's byte order only: the kernels read memory as native
    numbers (a big-endian float16 read natively is another number)."""
    if not dtype.isnative:
        raise TypeError(
            f"{name} has dtype {dtype.str} ({dtype.name}) in non-native byte order; "
            f"rotary_embedding takes arrays in the machine's byte order: convert it with "
            f".astype({dtype.name!r}) (a copy in native order)"
        )


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


def kernel_offset(offset: int, seq_len: int, n_positions: int, checked: bool = True) -> int:
    """One offset for the whole batch as the kernels take it (an int64): checked to put
    every position of the sequence in ``[0, n_positions)`` unless ``checked`` is False
    (the GPU's unchecked mode: out-of-range rows come out NaN), and in int64 whatever
    it is. With ``seq_len == 0`` there is no position: any integer is accepted (the
    backends pass 0 for an empty batch too)."""
    if not seq_len:
        return 0
    in_range = 0 <= offset <= n_positions - seq_len
    if not in_range and (checked or not INT64_MIN <= offset <= INT64_MAX - seq_len):
        raise offset_error(None, offset, seq_len, n_positions)
    return offset


#: The integers the kernels take positions in.
INT64_MIN, INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)


def check_flag(value: Any, name: str) -> bool:
    """An option that must be a bool (NumPy's included), or ``TypeError``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_positive_int(value: Any, name: str) -> int:
    """A count (``num_heads``, a head size): an integer (not a bool) above 0, or
    ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a positive integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a positive integer, got {value!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return value


def _check_num_heads(num_heads: Any, name: str) -> int | None:
    return None if num_heads is None else check_positive_int(num_heads, name)


def logical_shape(
    input_shape: tuple[int, ...], layout: Any, num_heads: Any, heads_name: str = "num_heads"
) -> tuple[int, int, int, int]:
    """The input's ``[batch, num_heads, seq_len, head_size]`` for any accepted form."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    num_heads = _check_num_heads(num_heads, heads_name)
    if len(input_shape) == 4:
        batch, second, third, head_size = input_shape
        heads, seq_len = (second, third) if layout == "bhsd" else (third, second)
        if num_heads is not None and num_heads != heads:
            raise ValueError(
                f"{heads_name}={num_heads} contradicts the {layout} input of shape "
                f"{tuple(input_shape)}, which has {heads} heads; omit {heads_name} for 4-D input"
            )
        return (batch, heads, seq_len, head_size)
    if len(input_shape) == 3:
        batch, seq_len, hidden = input_shape
        if num_heads is None:
            raise ValueError(
                f"3-D input [batch, seq_len, num_heads * head_size] (shape "
                f"{tuple(input_shape)}) needs {heads_name}= to split its last dimension"
            )
        if hidden % num_heads:
            raise ValueError(
                f"the last dimension {hidden} of 3-D input is not a multiple of "
                f"{heads_name}={num_heads}"
            )
        return (batch, num_heads, seq_len, hidden // num_heads)
    raise ValueError(
        f"input must be 4-D [batch, num_heads, seq_len, head_size] (or [batch, seq_len, "
        f"num_heads, head_size] with layout='bshd'), or 3-D [batch, seq_len, num_heads * "
        f"head_size] with num_heads=; got shape {tuple(input_shape)} ({len(input_shape)}-D)"
    )


def _check_same_tensor_form(names, shapes, dtypes) -> None:
    """Several tensors of one call (q and k): one dtype; the same batch, sequence
    length and head size. Checked before anything is compared with the second."""
    first, *others = range(len(names))
    for other in others:
        if dtypes[other] != dtypes[first]:
            raise TypeError(
                f"{names[first]} and {names[other]} must have one dtype, got "
                f"{dtypes[first].name} and {dtypes[other].name}"
            )
        for axis, what in ((0, "batch"), (2, "seq_len"), (3, "head_size")):
            if shapes[first][axis] != shapes[other][axis]:
                raise ValueError(
                    f"{names[first]} and {names[other]} must have the same {what}, got "
                    f"{shapes[first][axis]} and {shapes[other][axis]} (as [batch, num_heads, "
                    f"seq_len, head_size]: {shapes[first]} and {shapes[other]}); only the "
                    f"number of heads may differ"
                    + (
                        f"; for 3-D {names[other]} with fewer heads pass num_kv_heads= to "
                        f"split its last dimension"
                        if what == "head_size"
                        else ""
                    )
                )


def _check_caches(cos, sin, dtype_name: str):
    (cos_shape, cos_dtype), (sin_shape, sin_dtype) = cos, sin
    if cos_dtype != sin_dtype:
        raise TypeError(
            f"cos_cache and sin_cache must have the same dtype, got {cos_dtype.name} and "
            f"{sin_dtype.name}"
        )
    allowed = CACHE_DTYPES[dtype_name]
    if cos_dtype.name not in allowed:
        raise TypeError(
            f"caches of dtype {cos_dtype.name} cannot be used with {dtype_name} input; "
            f"accepted cache dtypes: {' or '.join(allowed)}; convert them to the "
            f"input's dtype (NumPy: cos_cache.astype(input.dtype); torch: "
            f"cos_cache.to(input.dtype))"
        )
    if tuple(cos_shape) != tuple(sin_shape):
        raise ValueError(
            f"cos_cache and sin_cache must have the same shape, got {tuple(cos_shape)} and "
            f"{tuple(sin_shape)}"
        )


def _layout_hint(shape_seen: tuple, fits_other_layout: bool, layout: str) -> str:
    """The hint for a shape that would fit if the input's axes were read the other way."""
    if not fits_other_layout:
        return ""
    other = "bshd" if layout == "bhsd" else "bhsd"
    order = {
        "bhsd": "[batch, num_heads, seq_len, head_size]",
        "bshd": "[batch, seq_len, num_heads, head_size]",
    }
    return (
        f"; {shape_seen} would fit an input in {order[other]} order: if that is its order, "
        f"pass layout={other!r}"
    )


def _check_positions(
    ids, offset, cos_shape, batch: int, seq_len: int, half: int, other_seq_len=None, layout="bhsd"
) -> str:
    """Position ids or offsets against the caches; returns the kind of positions."""
    if ids is not None and offset is not None:
        raise ValueError(
            "pass position_ids or position_offset, not both: an offset stands for the ids "
            "offset + arange(seq_len)"
        )
    kind = "token"
    if offset is not None:
        offset_shape, offset_dtype = offset
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
        kind = "offset" if tuple(offset_shape) == () else "offsets"
    if ids is not None:
        ids_shape, ids_dtype = ids
        if ids_dtype.kind not in "iu":
            raise TypeError(
                f"position_ids must be an integer array (any signed or unsigned integer "
                f"dtype, e.g. int64 or int32), got dtype {ids_dtype.name}"
            )
        if tuple(ids_shape) != (batch, seq_len):
            hint = _layout_hint(
                tuple(ids_shape), tuple(ids_shape) == (batch, other_seq_len), layout
            )
            if len(ids_shape) == 1 and ids_shape[0] == seq_len:
                hint = (
                    f"; for 1-D ids of one sequence pass position_ids[None, :] (batch 1) or "
                    f"np.broadcast_to(position_ids, {(batch, seq_len)}) (every sequence)"
                )
            raise ValueError(
                f"position_ids must have shape [batch, seq_len] = {(batch, seq_len)}, got "
                f"{tuple(ids_shape)}{hint}"
            )
        kind = "ids"
    if kind == "token":
        if len(cos_shape) != 3:
            raise ValueError(
                f"without position_ids the caches must be 3-D [batch, seq_len, "
                f"rotary_dim/2] = {(batch, seq_len, half)}, got shape {tuple(cos_shape)}"
            )
    elif len(cos_shape) != 2:
        raise ValueError(
            f"with position_ids or position_offset the caches must be 2-D "
            f"[max_position_id + 1, rotary_dim/2], got shape {tuple(cos_shape)}"
        )
    return kind


def _check_out(out: Description, out_name: str, input_name: str, input_shape, dtype) -> None:
    if out is None:
        return
    out_shape, out_dtype, writeable, distinct = out
    owner = "the input's" if input_name == "input" else f"{input_name}'s"
    if out_dtype != dtype:
        raise TypeError(f"{out_name} must have {owner} dtype {dtype.name}, got {out_dtype.name}")
    if tuple(out_shape) != tuple(input_shape):
        raise ValueError(
            f"{out_name} must have {owner} shape {tuple(input_shape)}, got {tuple(out_shape)}"
        )
    if not writeable:
        raise ValueError(
            f"{out_name} is a read-only array; pass a writeable array (e.g. "
            f"np.empty_like({input_name})) or omit {out_name}"
        )
    if not distinct:
        raise ValueError(
            f"{out_name} has elements that share memory (a zero or overlapping stride, e.g. "
            f"from broadcast_to or as_strided), so a result has nowhere to go; pass an "
            f"array whose elements are distinct (e.g. np.empty_like({input_name})) or omit "
            f"{out_name}"
        )


def _check_present_and_native(names, inputs, outs, cos, sin, ids, offset) -> None:
    """Required arrays given, and every array in the machine's byte order."""
    input_names, out_names = names
    for name, description in (
        *zip(input_names, inputs, strict=True),
        ("cos_cache", cos),
        ("sin_cache", sin),
    ):
        if description is None:
            raise TypeError(f"{name} is None; pass an array (NumPy, CuPy, Numba or torch CUDA)")
    named = (
        *zip(input_names, inputs, strict=True),
        *zip(out_names, outs, strict=True),
        ("cos_cache", cos),
        ("sin_cache", sin),
        ("position_ids", ids),
        ("position_offset", offset),
    )
    for name, description in named:
        if description is not None:
            _check_byte_order(name, description[1])


def _check_tensors(input_names, inputs, layout, num_heads, num_kv_heads):
    """``(dtypes, logical shapes)`` of the tensors, checked alone and against the first
    (q and k: one dtype, the same batch, sequence and head size)."""
    dtypes = [description[1] for description in inputs]
    for name, dtype in zip(input_names, dtypes, strict=True):
        check_dtype(dtype, name)
    heads_options = (num_heads, num_heads if num_kv_heads is None else num_kv_heads)
    heads_names = ("num_heads", "num_heads" if num_kv_heads is None else "num_kv_heads")
    shapes = []
    for i, description in enumerate(inputs):
        try:
            shapes.append(logical_shape(description[0], layout, heads_options[i], heads_names[i]))
        except ValueError as error:
            if i == 0 or num_kv_heads is not None:
                raise
            raise ValueError(
                f"{input_names[i]}: {error}; {input_names[i]} may have fewer heads than "
                f"{input_names[0]}: pass num_kv_heads="
            ) from None
    _check_same_tensor_form(input_names, shapes, dtypes)
    return dtypes, shapes


def _check_call(
    names: tuple[tuple[str, ...], tuple[str, ...]],
    inputs: tuple[Description, ...],
    outs: tuple[Description, ...],
    cos: Description,
    sin: Description,
    ids: Description,
    offset: Description,
    interleaved: Any,
    rotary_embedding_dim: Any,
    layout: Any,
    num_heads: Any,
    num_kv_heads: Any,
    inverse: Any,
) -> Call:
    """Check one call; see :func:`check_call`."""
    input_names, out_names = names
    _check_present_and_native(names, inputs, outs, cos, sin, ids, offset)
    dtypes, shapes = _check_tensors(input_names, inputs, layout, num_heads, num_kv_heads)
    dtype_name = dtypes[0].name
    batch, _, seq_len, head_size = shapes[0]
    interleaved = check_flag(interleaved, "interleaved")
    inverse = check_flag(inverse, "inverse")
    rotary_dim = check_rotary_dim(rotary_embedding_dim, head_size)
    half = rotary_dim // 2
    assert cos is not None and sin is not None  # checked above
    _check_caches(cos, sin, dtype_name)
    cos_shape = tuple(cos[0])
    # For 4-D input: the sequence length if its axes were read in the other layout.
    raw_shape = tuple(inputs[0][0])  # type: ignore[index]
    other_seq_len = shapes[0][1] if len(raw_shape) == 4 else None
    kind = _check_positions(ids, offset, cos_shape, batch, seq_len, half, other_seq_len, layout)
    if cos_shape[-1] != half:
        hint = ""
        if cos_shape[-1] == rotary_dim:
            hint = (
                f"; these look like caches of full width [..., rotary_dim]: if their two "
                f"halves are equal (Hugging Face's cat(freqs, freqs)), pass "
                f"cos[..., :{half}] and sin[..., :{half}]"
            )
        raise ValueError(
            f"the caches' last dimension must be rotary_dim/2 = {half}, got "
            f"{cos_shape[-1]} (cache shape {cos_shape}, rotary_dim {rotary_dim}){hint}"
        )
    if kind == "token" and cos_shape[:2] != (batch, seq_len):
        hint = _layout_hint(cos_shape, cos_shape[:2] == (batch, other_seq_len), layout)
        raise ValueError(
            f"without position_ids the caches must have shape [batch, seq_len, "
            f"rotary_dim/2] = {(batch, seq_len, half)}, got {cos_shape}{hint}"
        )
    for i, out in enumerate(outs):
        _check_out(out, out_names[i], input_names[i], inputs[i][0], dtypes[i])  # type: ignore[index]
    return Call(
        dtype=dtypes[0],
        cache_dtype=cos[1],
        shapes=tuple(shapes),
        layout=layout,
        interleaved=interleaved,
        rotary_dim=rotary_dim,
        inverse=inverse,
        positions=kind,
        n_positions=0 if kind == "token" else cos_shape[0],
    )


# typed=True: 1 and True (or 2 and 2.0) must not share a verdict. (Only the options are
# scalars; descriptions are tuples of shapes, dtypes and flags, compared exactly.)
_check_call_remembered = functools.lru_cache(maxsize=1024, typed=True)(_check_call)


def check_call(*arguments: Any) -> Call:
    """Check one call of ``rotary_embedding`` (one input) or ``rotary_embedding_qk``
    (q and k), described by shapes, dtypes and options, and return its :class:`Call`;
    the arguments are :func:`_check_call`'s.

    ``names`` are the input and output argument names (:data:`SINGLE_NAMES`,
    :data:`QK_NAMES`); ``inputs`` and ``outs`` describe the tensors and their outputs
    (None where absent), ``offset`` a scalar offset as shape ``()``. The verdict is
    remembered: repeated calls of the same signature skip the checks. Arguments that
    cannot be hashed go to the plain check, which explains what is wrong with them.
    """
    try:
        return _check_call_remembered(*arguments)
    except TypeError:
        pass  # unhashable (or refused): checked again below, outside this clause
    # Outside the ``except`` clause, so that the plain check's error does not carry
    # "unhashable type" as its context (a traceback would print both).
    return _check_call(*arguments)


def check_one_gpu(ordinals: dict[int, str]) -> None:
    """The GPUs of a call's arguments (ordinal -> first argument there): one, or
    ``TypeError``."""
    if len(ordinals) > 1:
        raise TypeError(
            "all arrays of a call must be on one GPU, but "
            + ", ".join(f"{name} is on GPU {ordinal}" for ordinal, name in ordinals.items())
            + "; copy them to one device first"
        )


def check_stream(recognised: bool, type_name: str) -> None:
    """``stream=`` must be something the CUDA backend can run on."""
    if not recognised:
        raise TypeError(
            f"stream is a {type_name}; pass a numba stream (numba.cuda.stream()), a "
            f"torch.cuda.Stream, a cupy.cuda.Stream or a raw cudaStream_t handle (int)"
        )


def check_torch_dtype(dtype: Any, numpy_dtype: np.dtype | None) -> np.dtype:
    """The NumPy dtype of a torch tensor's dtype, or ``TypeError`` when there is none."""
    if numpy_dtype is None:
        raise TypeError(
            f"torch dtype {dtype} has no NumPy equivalent; rotary_embedding accepts "
            f"float32, float16, bfloat16 and float64 tensors"
        )
    return numpy_dtype


def shared_outputs_error() -> ValueError:
    """The outputs of one call (out_q, out_k) must not share memory."""
    return ValueError("out_q and out_k share memory; give them separate buffers")


def offset_error(batch_index: int | None, value: int, seq_len: int, n_positions: int) -> IndexError:
    """The ``IndexError`` for an offset whose positions leave the caches."""
    where = "position_offset" if batch_index is None else f"position_offset[{batch_index}]"
    if n_positions < seq_len:  # no offset fits: say so rather than name an empty range
        rule = (
            f"no offset fits seq_len {seq_len} in {n_positions} rows; this offset needs "
            f"caches of at least {max(value, 0) + seq_len} rows"
        )
    else:
        rule = f"offsets must lie in [0, {n_positions - seq_len}] for seq_len {seq_len}"
    return IndexError(
        f"{where} = {value} puts positions {value}..{value + seq_len - 1} of the sequence "
        f"outside the caches, which have {n_positions} rows: {rule}"
    )


def position_error(
    flat_index: int, position_ids_shape: tuple[int, ...], value: int, n_positions: int
) -> IndexError:
    """The ``IndexError`` for an out-of-range position id at a flat index."""
    where = tuple(int(i) for i in np.unravel_index(flat_index, position_ids_shape))
    if n_positions == 0:  # no id is valid: say so rather than name an empty range
        rule = "no position id is valid; give caches with a row for each position"
    else:
        rule = f"position ids must lie in [0, {n_positions - 1}]"
    return IndexError(
        f"position_ids{list(where)} = {value} is outside the caches, which have "
        f"{n_positions} rows: {rule}"
    )
