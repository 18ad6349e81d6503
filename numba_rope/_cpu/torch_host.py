"""torch tensors on the CPU, through the CPU backend: NumPy views of the tensors'
memory in, torch tensors out, nothing copied.

For a call whose arrays are all in host memory and include a torch CPU tensor (NumPy
arrays may come with them), ``rotary._rotate`` makes one NumPy view per tensor with
:func:`host_view` (float32/float16/float64 and integer tensors as they are; bfloat16
through an ``int16`` view reinterpreted as ``ml_dtypes.bfloat16``), makes the NumPy
call on the views (remembered plans included), and returns each result as its input's
kind with :func:`as_results`: ``out`` itself when given, else a torch tensor over the
memory the kernel wrote (``torch.from_numpy``) for a torch input, a NumPy array for a
NumPy input.

What a NumPy view cannot carry is refused or resolved here, before anything is
written: a tensor that records autograd, reverse or forward mode, or one inside a
``torch.func`` transform (:mod:`numba_rope._autograd`; use :mod:`numba_rope.torch`),
an ``out`` with torch's negative or conjugate bit (an input with one is resolved, a
copy), a nested tensor or a layout other than strided, a dtype NumPy cannot hold.
A dead ``torch.func`` wrapper (a tensor saved under a transform that has returned, as
``torch.func.vjp``'s function reads them) is read as the tensor it stands for. An
``out`` tensor written through its view has its autograd version counter bumped, as an
in-place torch operation would, so a graph that saved it refuses to run backward on
stale values.

torch is imported by these functions only, which run for a caller who passed a
tensor: it is already imported then.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from numba_rope._autograd import (
    check_unrecorded,
    forward_ad_active,
    numpy_view,
    tangent,
    unwrapped_if_dead,
)

#: Output arguments, by name (written through their views).
OUTPUT_NAMES = ("out", "out_q", "out_k")


def host_view(tensor: Any, argument: str) -> np.ndarray:
    """A NumPy array over ``tensor``'s memory (same shape, strides and dtype; bfloat16
    as ``ml_dtypes.bfloat16``), or ``TypeError``/``ValueError`` for what a view cannot
    carry. ``argument`` names the tensor in messages; outputs (``out``, ``out_q``,
    ``out_k``) are never copied, inputs with torch's negative or conjugate bit are
    (the view must hold the values the tensor means)."""
    import torch

    output = argument in OUTPUT_NAMES
    if tensor.is_nested:
        raise TypeError(
            f"{argument} is a nested torch tensor; rotary_embedding takes strided (dense) "
            f"tensors: pad it (torch.nested.to_padded_tensor), or pack its sequences "
            f"and use numba_rope.flash_attn.apply_rotary_emb with cu_seqlens"
        )
    if tensor.layout is not torch.strided:
        raise TypeError(
            f"{argument} is a torch tensor of layout {tensor.layout}; rotary_embedding "
            f"takes strided (dense) tensors: convert it with .to_dense()"
        )
    tensor = unwrapped_if_dead(tensor)  # (a torch.func.vjp function's saved tensors)
    check_unrecorded(tensor, argument, forward_ad_active())
    if output:
        check_written(tensor, argument)
    if tensor.is_neg() or tensor.is_conj():
        bit = "negative" if tensor.is_neg() else "conjugate"
        if output:
            raise ValueError(
                f"{argument} is a torch view with the {bit} bit set (its memory holds "
                f"the {'negated' if bit == 'negative' else 'conjugated'} values), which "
                f"numba_rope cannot write through; write into a plain tensor (e.g. "
                f"{argument}.resolve_neg().resolve_conj(), a copy) and copy it back"
            )
        tensor = tensor.resolve_neg().resolve_conj()  # a copy of the values it means
    if tensor.requires_grad:  # (here only under torch.no_grad(), where numpy() takes it)
        tensor = tensor.detach()  # not for the others: a new tensor object, 0.3 us
    try:
        return numpy_view(tensor)
    except TypeError:  # a dtype NumPy has no type for (float8, complex32, ...)
        raise TypeError(
            f"{argument} is a torch tensor of dtype {tensor.dtype}, which has no NumPy "
            f"equivalent; rotary_embedding accepts torch.float32, float16, bfloat16 and "
            f"float64 tensors (integer tensors for positions): convert it with .float()"
        ) from None


def check_written(tensor: Any, argument: str) -> None:
    """Refuse (``RuntimeError``) to write ``tensor``, the output ``argument``, where
    torch would refuse to update it in place: an inference tensor outside inference
    mode."""
    if tensor.is_inference():
        import torch

        if not torch.is_inference_mode_enabled():
            raise RuntimeError(
                f"{argument} is an inference tensor (made under torch.inference_mode()), "
                f"which torch does not let be written in place outside inference mode; "
                f"call under torch.inference_mode(), or write into a normal tensor (e.g. "
                f"{argument}.clone())"
            )


def plain_views(arrays: tuple, outputs: int) -> list | None:
    """NumPy views of ``arrays`` (tensors, NumPy arrays, None) when each tensor among
    them is a plain one: a ``torch.Tensor`` itself (no subclass) on the CPU, strided,
    recording no autograd (no forward-mode tangent either), without torch's negative or
    conjugate bit, of a dtype NumPy holds (bfloat16 as ``ml_dtypes.bfloat16``); NumPy
    arrays and None as they are, one view per tensor object (``out=x`` stays in
    place). None otherwise: the general path (:func:`host_view`) then views, resolves
    or refuses what is there, naming the argument.

    The views of a small call's tensors with the least work (about 0.75 us a float32
    or float16 tensor, ``Tensor.numpy()`` 0.55 of it): the public functions' path
    for torch CPU tensors, which then make the NumPy call on them (its plans
    included). ``Tensor.numpy()`` refuses the layouts other than strided and the
    negative and conjugate bits itself (as ``Tensor.view`` to ``int16`` does for
    bfloat16, :func:`~numba_rope._autograd.numpy_view`), so they are not tested first
    (0.2 us a tensor); a tensor that requires grad is, since ``Tensor.numpy()`` takes
    it under ``torch.no_grad()``. The last ``outputs`` of ``arrays`` are written: an
    inference tensor among them, outside inference mode, is for :func:`host_view` to
    refuse, as torch refuses to write one in place."""
    import torch

    tensor_type, bfloat16 = torch.Tensor, torch.bfloat16
    for array in arrays[len(arrays) - outputs :]:
        if type(array) is tensor_type and array.is_inference():
            if not torch.is_inference_mode_enabled():
                return None
    forward_mode = forward_ad_active()
    views: list = []
    seen: dict[int, np.ndarray] = {}
    for array in arrays:
        if array is None or type(array) is np.ndarray:
            views.append(array)
            continue
        view = seen.get(id(array))
        if view is None:
            if (
                type(array) is not tensor_type
                or not array.is_cpu
                or array.requires_grad
                or (forward_mode and tangent(array) is not None)
            ):
                return None
            try:
                view = numpy_view(array) if array.dtype is bfloat16 else array.numpy()
            except (TypeError, RuntimeError):  # no NumPy dtype, not strided, a negative
                return None  # or conjugate bit, a torch.func wrapper (host_view names them)
            seen[id(array)] = view
        views.append(view)
    return views


def result_of(x: Any, out: Any, result: np.ndarray) -> Any:
    """A result of a call run on NumPy views as its input's kind: ``out`` itself when
    given (a torch ``out`` has its version counter bumped), else a torch tensor over
    the result's memory for a torch input, the NumPy result for a NumPy input."""
    if out is not None:
        if not isinstance(out, np.ndarray):
            bump_version(out)
        return out
    if isinstance(x, np.ndarray):
        return result  # a NumPy input: a NumPy result
    return tensor_over(result)


def tensor_over(array: np.ndarray) -> Any:
    """A torch tensor over ``array``'s memory (no copy): bfloat16 through ``int16``."""
    import torch

    if array.dtype.kind == "V" and array.dtype.itemsize == 2:  # ml_dtypes.bfloat16
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def as_results(inputs: tuple, outs: tuple, results: tuple) -> tuple:
    """Each result of a call run on NumPy views as its input's kind: ``out`` itself
    when given (a torch ``out`` has its version counter bumped), else a torch tensor
    over the result's memory for a torch input, the NumPy result for a NumPy input
    (:func:`result_of` of each)."""
    return tuple(
        result_of(x, out, result) for x, out, result in zip(inputs, outs, results, strict=True)
    )


def bump_version(tensor: Any) -> None:
    """Count a write through the NumPy view as an in-place torch operation would (an
    inference tensor has no version counter)."""
    import torch

    if not tensor.is_inference():
        torch.autograd.graph.increment_version(tensor)
