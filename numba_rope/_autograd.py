"""torch autograd, as numba_rope's array functions meet it.

:func:`numba_rope.rotary_embedding` (and every function built on it) reads and writes
a torch tensor's memory and records nothing for autograd. A tensor that autograd
follows is therefore refused there, with the way out (:func:`check_unrecorded`):

* one that requires grad while grad mode is on (reverse mode);
* one that carries a forward-mode tangent (``torch.autograd.forward_ad``,
  ``torch.func.jvp``): its tangent would be dropped without a word;
* one inside a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``, ...), whose
  memory is not the values it stands for (:func:`transformed_error`).

:mod:`numba_rope.torch` records both modes (:func:`forward_ad_active` decides which).
torch is imported by these functions only, which run for a caller who passed a
tensor: it is already imported then.
"""

from __future__ import annotations

from typing import Any

_forward_ad: Any = None


def forward_ad_active() -> bool:
    """Whether a forward-mode AD level is open (``forward_ad.dual_level()``, which
    ``torch.func.jvp`` and ``jacfwd`` open too): only then can a tensor carry a
    tangent. A module attribute read, for every call with tensors; if a later torch
    drops the attribute, every call looks for tangents (slower, never wrong)."""
    global _forward_ad
    if _forward_ad is None:
        import torch.autograd.forward_ad

        _forward_ad = torch.autograd.forward_ad
    return getattr(_forward_ad, "_current_level", 0) >= 0


def tangent(tensor: Any) -> Any:
    """The forward-mode tangent ``tensor`` carries at the open level, or None."""
    forward_ad_active()  # (imports the module)
    return _forward_ad.unpack_dual(tensor).tangent


def check_unrecorded(tensor: Any, argument: str, forward_mode: bool) -> None:
    """``TypeError`` for a tensor autograd follows (``requires_grad`` under grad mode;
    a forward-mode tangent where ``forward_mode``, :func:`forward_ad_active`'s answer
    for the call): numba_rope.rotary_embedding would give a result without its
    gradient."""
    import torch

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


def transformed_error(tensor: Any, argument: str) -> TypeError | None:
    """The ``TypeError`` for a tensor inside a ``torch.func`` transform (a wrapper
    whose memory cannot be read), or None for any other tensor."""
    import torch

    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    if wrapped is None or not wrapped(tensor):
        return None
    return TypeError(
        f"{argument} is a tensor inside a torch.func transform (vmap, grad, jvp, ...), "
        f"which numba_rope.rotary_embedding cannot read; use "
        f"numba_rope.torch.rotary_embedding (or rotary_embedding_qk), which the "
        f"transforms go through"
    )
