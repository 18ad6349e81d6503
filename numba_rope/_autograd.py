"""torch autograd, as numba_rope's array functions meet it.

:func:`numba_rope.rotary_embedding` (and every function built on it) reads and writes
a torch tensor's memory and records nothing for autograd. A tensor that autograd
follows is therefore refused there, with the way out (:func:`check_unrecorded`):

* one that requires grad while grad mode is on (reverse mode);
* one that carries a forward-mode tangent (``torch.autograd.forward_ad``,
  ``torch.func.jvp``): its tangent would be dropped without a word;
* one inside a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``, ...), whose
  memory is not the values it stands for (:func:`transformed`).

:mod:`numba_rope.torch` records both modes. A call on torch tensors inside a function
that torch.compile traces runs outside its graph (:func:`outside_graphs`): Dynamo
cannot trace the NumPy views and numba's code under it. torch is imported by these
functions only, which run for a caller who passed a tensor: it is already imported then.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any


def forward_ad_active() -> bool:
    """Whether a forward-mode AD level is open (``forward_ad.dual_level()``, which
    ``torch.func.jvp`` and ``jacfwd`` open too): only then can a tensor carry a
    tangent. A module attribute read, for every call with tensors (torch is imported
    then: the caller passed a tensor), kept in no global here (Dynamo, tracing a
    caller, would guard on it); if a later torch drops the attribute, every call looks
    for tangents (slower, never wrong)."""
    return getattr(sys.modules["torch.autograd.forward_ad"], "_current_level", 0) >= 0


def tangent(tensor: Any) -> Any:
    """The forward-mode tangent ``tensor`` carries at the open level, or None."""
    import torch

    return torch.autograd.forward_ad.unpack_dual(tensor).tangent


def check_unrecorded(tensor: Any, argument: str, forward_mode: bool) -> None:
    """``TypeError`` for a tensor autograd follows, or one it cannot be read as: a
    ``torch.func`` transform's wrapper (:func:`transformed`), ``requires_grad`` under
    grad mode, a forward-mode tangent where ``forward_mode`` (:func:`forward_ad_active`'s
    answer for the call). numba_rope.rotary_embedding would give a result without its
    gradient, or fail in torch."""
    import torch

    if transformed(tensor):
        raise TypeError(
            f"{argument} is a tensor inside a torch.func transform (vmap, grad, jvp, "
            f"...), which numba_rope.rotary_embedding cannot read; use "
            f"numba_rope.torch.rotary_embedding (or rotary_embedding_qk), which the "
            f"transforms go through"
        )
    if tensor.requires_grad and torch.is_grad_enabled():
        what = "requires grad"
    elif forward_mode and tangent(tensor) is not None:
        what = "carries a forward-mode tangent (torch.autograd.forward_ad)"
    else:
        return
    raise TypeError(
        f"{argument} {what}, and numba_rope.rotary_embedding records nothing for "
        f"autograd; use numba_rope.torch.rotary_embedding (or rotary_embedding_qk), which "
        f"is differentiable, or pass {argument}.detach() (or call under torch.no_grad() "
        f"and outside forward_ad.dual_level()) where no gradient is wanted"
    )


def unwrapped_if_dead(tensor: Any) -> Any:
    """``tensor``, or the tensor it stands for where it is the wrapper of a
    ``torch.func`` transform that has returned (a "dead" wrapper, which reads as that
    tensor): ``torch.func.vjp``'s function runs the backward after its transform ended,
    with the tensors saved under it (caches, offsets). Nested dead wrappers are
    unwrapped to the first live one or a plain tensor."""
    import torch

    unwrap = getattr(torch._C._functorch, "unwrap_if_dead", None)
    if unwrap is None:
        return tensor
    for _ in range(_MOST_LEVELS):  # (bounded: never a loop on a torch that would
        inner = unwrap(tensor)  # hand back a new object for the same tensor)
        if inner is tensor:
            break
        tensor = inner
    return tensor


#: Nested transforms unwrapped at most (far more than any program nests).
_MOST_LEVELS = 64


def transformed(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.func`` transform's wrapper (``vmap``, ``grad``,
    ``jvp``, ...): its memory is not the values it stands for."""
    import torch

    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return wrapped is not None and bool(wrapped(tensor))


def below_transforms() -> Any:
    """A context in which the ``torch.func`` transforms running now are switched off
    (``torch._C._DisableFuncTorch``; a no-op where torch has none): a tensor they do
    not transform (a constant to them, read as a wrapper without storage) reads as
    itself there."""
    import torch

    return getattr(torch._C, "_DisableFuncTorch", contextlib.nullcontext)()


def numpy_view(tensor: Any) -> Any:
    """``tensor.numpy()``; bfloat16 as ``ml_dtypes.bfloat16``, through an ``int16``
    view (NumPy has no bfloat16 of its own); a tensor that a ``torch.func`` transform
    running now does not transform is read below the transforms
    (:func:`below_transforms`)."""
    import torch

    if tensor.dtype is torch.bfloat16:
        import ml_dtypes  # not at import time: it costs more than the rest of numba_rope

        return _numpy(tensor.view(torch.int16)).view(ml_dtypes.bfloat16)
    return _numpy(tensor)


def _numpy(tensor: Any) -> Any:
    try:
        return tensor.numpy()
    except RuntimeError:
        if transformed(tensor):
            raise
        with below_transforms():
            return tensor.numpy()


#: Functions of numba_rope under ``torch.compiler.disable``, by function (see
#: :func:`outside_graphs`).
_OUTSIDE_GRAPHS: dict[Any, Any] = {}


def compiling() -> bool:
    """Whether torch.compile (Dynamo) is tracing the calling code."""
    import torch

    return bool(torch.compiler.is_compiling())


def outside_graphs(function: Any) -> Any:
    """``function`` under ``torch.compiler.disable``: called while torch.compile traces
    a function, it breaks the graph there and runs as it is, outside it. The array API
    on torch tensors makes NumPy views of their memory and calls numba's compiled
    code, which Dynamo cannot trace: it turned an ``int`` offset into a 0-d array, and
    numba refused that with a typing error. (The functions of ``numba_rope.torch`` are
    torch custom ops, which it traces.)"""
    found = _OUTSIDE_GRAPHS.get(function)
    if found is None:
        import torch

        found = _OUTSIDE_GRAPHS[function] = torch.compiler.disable(function)
    return found
