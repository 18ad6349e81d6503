"""numba_rope for PyTorch: the operator as a differentiable torch custom op.

:func:`rotary_embedding` and :func:`rotary_embedding_qk` take and return torch tensors
(CPU or CUDA) and record autograd: the gradient with respect to the input is the
inverse rotation of the output's gradient (``inverse=True``, exact: the rotation is
orthogonal, its transpose is its inverse), computed by the same kernels. They are the
torch custom ops ``torch.ops.numba_rope.rotary_embedding`` and
``torch.ops.numba_rope.rotary_embedding_qk`` (``torch.library.custom_op``) with a fake
implementation for shapes and a registered backward, so ``torch.compile(...,
fullgraph=True)`` traces a model that uses them, on the CPU and the GPU.

Forward mode too: under ``torch.autograd.forward_ad`` and ``torch.func.jvp`` (or
``jacfwd``) the output's tangent is the input's tangent rotated by the same angles (the
operator is linear in its input). ``torch.func.grad``, ``vjp``, ``jacrev`` and ``vmap``
go through these functions as well; under ``vmap`` the mapped axis is folded into the
operator's batch axis (one call). The ops called directly through ``torch.ops`` record
reverse mode only, as any torch custom op.

The cos/sin caches are constants (built by :func:`numba_rope.rope_cache` or a rotary
module under ``no_grad``); gradients with respect to them are not computed: caches
that require grad or carry a forward-mode tangent are refused with
``NotImplementedError`` rather than given a silent zero (pass ``cache.detach()``).

Importing this module imports torch; ``import numba_rope`` does not.

Examples
--------
>>> import torch
>>> import numba_rope
>>> import numba_rope.torch
>>> cos, sin = (torch.from_numpy(c) for c in numba_rope.rope_cache(32, 8))
>>> q = torch.randn(2, 4, 5, 8, requires_grad=True)  # [batch, heads, seq, head]
>>> y = numba_rope.torch.rotary_embedding(q, cos, sin, position_offset=3)
>>> y.sum().backward()
>>> back = numba_rope.torch.rotary_embedding(torch.ones_like(q), cos, sin,
...                                          position_offset=3, inverse=True)
>>> torch.equal(q.grad, back)  # the gradient is the inverse rotation
True
"""

import warnings
from typing import Any

import numpy as np
import torch

from numba_rope._autograd import forward_ad_active, numpy_view
from numba_rope._halves import first_half
from numba_rope._interop import over_batch
from numba_rope.rotary import rotary_embedding as _rotate_one
from numba_rope.rotary import rotary_embedding_qk as _rotate_two

__all__ = ["rotary_embedding", "rotary_embedding_qk"]

Tensor = torch.Tensor


# -- the custom ops --------------------------------------------------------------------
# Position offsets travel as an int (one for the batch) or a tensor ([batch]): a custom
# op's schema has no union of the two. ``full_width``: the caches are Hugging Face's
# full-width ones (checked, then halved inside the op, where the data are real).


def _unrecorded(*tensors: Tensor | None) -> list:
    """``tensors`` without what autograd records on them (``detach``), for the NumPy
    views of the implementation; a tensor with nothing to strip as it is (``detach``
    makes a new tensor object, 0.3 us each). Where torch's forward-mode level cannot
    be read, every tensor is detached (never wrong)."""
    forward = forward_ad_active()
    return [
        tensor.detach() if tensor is not None and (forward or tensor.requires_grad) else tensor
        for tensor in tensors
    ]


def _caches(cos: Tensor, sin: Tensor, full_width: bool) -> tuple[Any, Any]:
    """The caches the kernels take: full-width ones (Hugging Face's) checked and halved
    (views), those of the CPU as NumPy views where torch gives them (bfloat16 as
    ``ml_dtypes.bfloat16``): NumPy slices and compares them in half the time of torch
    (a 64-sequence decode step's two caches: 7 against 15 us), and the call takes
    NumPy caches as they are."""
    cos, sin = _unrecorded(cos, sin)
    if not full_width:
        return cos, sin
    if cos.is_cpu and sin.is_cpu:
        try:
            cos_view, sin_view = numpy_view(cos), numpy_view(sin)
        except (TypeError, RuntimeError):  # not strided, a negative bit, no NumPy dtype
            pass
        else:
            return first_half(cos_view, "cos"), first_half(sin_view, "sin")
    return first_half(cos, "cos"), first_half(sin, "sin")


def _rotary_impl(
    input: Tensor,
    cos_cache: Tensor,
    sin_cache: Tensor,
    position_ids: Tensor | None,
    position_offset: int | None,
    position_offsets: Tensor | None,
    interleaved: bool,
    rotary_embedding_dim: int,
    layout: str,
    num_heads: int | None,
    inverse: bool,
    full_width: bool,
) -> Tensor:
    cos, sin = _caches(cos_cache, sin_cache, full_width)
    input, position_ids = _unrecorded(input, position_ids)
    return _rotate_one(
        input,
        cos,
        sin,
        position_ids,
        interleaved=interleaved,
        rotary_embedding_dim=rotary_embedding_dim,
        layout=layout,
        num_heads=num_heads,
        position_offset=position_offset if position_offsets is None else position_offsets,
        inverse=inverse,
    )


_rotary_op = torch.library.custom_op("numba_rope::rotary_embedding", mutates_args=())(_rotary_impl)


def _rotary_qk_impl(
    q: Tensor,
    k: Tensor,
    cos_cache: Tensor,
    sin_cache: Tensor,
    position_ids: Tensor | None,
    position_offset: int | None,
    position_offsets: Tensor | None,
    interleaved: bool,
    rotary_embedding_dim: int,
    layout: str,
    num_heads: int | None,
    num_kv_heads: int | None,
    inverse: bool,
    full_width: bool,
) -> tuple[Tensor, Tensor]:
    cos, sin = _caches(cos_cache, sin_cache, full_width)
    if full_width and len(cos.shape) == 3 and cos.shape[0] == 1 and q.shape[0] != 1:
        # Hugging Face's one table for the batch, checked and halved once, then
        # broadcast over the batch (a view).
        cos, sin = over_batch(cos, sin, q.shape[0])
    q, k, position_ids = _unrecorded(q, k, position_ids)
    return _rotate_two(
        q,
        k,
        cos,
        sin,
        position_ids,
        interleaved=interleaved,
        rotary_embedding_dim=rotary_embedding_dim,
        layout=layout,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        position_offset=position_offset if position_offsets is None else position_offsets,
        inverse=inverse,
    )


_rotary_qk_op = torch.library.custom_op("numba_rope::rotary_embedding_qk", mutates_args=())(
    _rotary_qk_impl
)


@_rotary_op.register_fake
def _rotary_fake(input: Tensor, *args: Any) -> Tensor:
    return input.new_empty(input.shape)  # C-contiguous, as the real result


@_rotary_qk_op.register_fake
def _rotary_qk_fake(q: Tensor, k: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


# -- autograd: the gradient of a rotation is the inverse rotation -----------------------

#: Places of the cos/sin caches among each op's inputs.
_CACHES_ONE = (1, 2)
_CACHES_TWO = (2, 3)


def _refuse_cache_gradient(needs_input_grad: Any, caches: tuple[int, int]) -> None:
    if any(needs_input_grad[i] for i in caches):
        raise NotImplementedError(_CACHE_GRADIENT)


_CACHE_GRADIENT = (
    "numba_rope.torch differentiates with respect to the input (q and k) only, not "
    "cos_cache/sin_cache; caches are constants (rope_cache, or a rotary module under "
    "no_grad): pass cos_cache.detach() and sin_cache.detach()"
)


def _constants(inputs: tuple) -> tuple:
    """The tensors a derivative reuses (cos, sin, position ids, offsets), the int
    offset, and the options (interleaved ... full_width), from an op's inputs."""
    first_cache = 2 if len(inputs) == 14 else 1  # (q and k, or one tensor)
    cos, sin, ids, offset, offsets = inputs[first_cache : first_cache + 5]
    return (cos, sin, ids, offsets), offset, inputs[first_cache + 5 :]


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    tensors, ctx.offset, ctx.options = _constants(inputs)
    ctx.save_for_backward(*tensors)


def _zeros_for_none(ctx: Any, *tensors: Tensor | None) -> tuple[Tensor, ...]:
    """q's and k's tangents or gradients, zeros of their forms where None."""
    return tuple(
        torch.zeros(shape, dtype=dtype, device=device) if x is None else x
        for x, (shape, dtype, device) in zip(tensors, ctx.forms, strict=True)
    )


#: torch's test for a batched tensor of its older vmap (None where a torch has none).
_IS_LEGACY_BATCHED = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)


def _legacy_batched(grad: Tensor) -> bool:
    """Whether ``grad`` is a batched tensor of torch's older vmap, which
    ``torch.autograd.grad(..., is_grads_batched=True)`` hands a backward (so do
    ``gradcheck(check_batched_grad=True)`` and ``jacobian(vectorize=True)``). It has
    no memory of its own to read, so the backward calls the op through torch's
    dispatcher, whose fallback for that vmap runs the op on each gradient of the
    batch (about 0.1 us a test)."""
    return _IS_LEGACY_BATCHED is not None and bool(_IS_LEGACY_BATCHED(grad))


def _rotary_backward(ctx: Any, grad: Tensor | None) -> tuple:
    _refuse_cache_gradient(ctx.needs_input_grad, _CACHES_ONE)
    if grad is None:  # (the forward-mode function does not materialize zeros)
        return (None,) * 12
    cos, sin, ids, offsets = ctx.saved_tensors
    interleaved, rotary_dim, layout, num_heads, inverse, full_width = ctx.options
    grad_input = (_rotary_op if _legacy_batched(grad) else recorded_op)(
        grad,
        cos,
        sin,
        ids,
        ctx.offset,
        offsets,
        interleaved,
        rotary_dim,
        layout,
        num_heads,
        not inverse,
        full_width,
    )
    return (grad_input, *(None,) * 11)


def _rotary_qk_backward(ctx: Any, grad_q: Tensor | None, grad_k: Tensor | None) -> tuple:
    # The op's autograd materializes the gradient of an unused output as zeros; the
    # forward-mode function does not (None), and its forms make the zeros.
    _refuse_cache_gradient(ctx.needs_input_grad, _CACHES_TWO)
    if grad_q is None and grad_k is None:
        return (None,) * 14
    if grad_q is None or grad_k is None:
        grad_q, grad_k = _zeros_for_none(ctx, grad_q, grad_k)
    cos, sin, ids, offsets = ctx.saved_tensors
    interleaved, rotary_dim, layout, num_heads, num_kv_heads, inverse, full_width = ctx.options
    batched = _legacy_batched(grad_q) or _legacy_batched(grad_k)
    grads = (_rotary_qk_op if batched else recorded_qk_op)(
        grad_q,
        grad_k,
        cos,
        sin,
        ids,
        ctx.offset,
        offsets,
        interleaved,
        rotary_dim,
        layout,
        num_heads,
        num_kv_heads,
        not inverse,
        full_width,
    )
    return (*grads, *(None,) * 12)


_rotary_op.register_autograd(_rotary_backward, setup_context=_setup)
_rotary_qk_op.register_autograd(_rotary_qk_backward, setup_context=_setup)


# -- vmap: the batch of the transform folded into the operator's batch axis ----------------
# torch.func.vmap (and jacfwd, jacrev, per-sample gradients) maps the ops over one more
# axis. Every tensor argument has the operator's batch first (input, q, k; position
# ids [batch, seq_len]; offsets [batch]; per-token caches [batch, seq_len, half]), so
# the transform's axis is moved in front and folded into it: one call of the op over
# ``B * batch`` sequences (unmapped arguments are tiled over B; a 2-D position table is
# shared as it is). A table mapped itself (a different cos/sin table for each of the B)
# cannot be folded: the op then runs once per table.


def _batching_rule(name: str) -> Any:
    """``torch.library.register_vmap(name)`` (torch 2.5 on); before it, torch's loop."""
    register = getattr(torch.library, "register_vmap", None)
    return (lambda rule: rule) if register is None else register(name)


def _front(x: Tensor | None, dim: int | None, size: int) -> Tensor | None:
    """``x`` with the mapped axis first, ``[size, ...]`` (an unmapped ``x`` expanded)."""
    if x is None:
        return None
    return x.expand(size, *x.shape) if dim is None else x.movedim(dim, 0)


def _fold(x: Tensor | None, dim: int | None, size: int, batch: int, one_row: bool = False) -> Any:
    """A batch-first argument with the mapped axis folded into its batch axis: row ``i *
    batch + j`` is sample ``i``'s row ``j``. An unmapped one is tiled over the ``size``
    samples, a 0-d offset (one for every sequence) kept as it is, a mapped 0-d offset
    (one per sample) repeated over its sample's sequences. ``one_row``: an unmapped
    one-row table is broadcast over the batch first (Hugging Face's one table for the
    batch, which the qk op broadcasts itself)."""
    if x is None or (dim is None and x.dim() == 0):
        return x
    if dim is None:
        if one_row and x.shape[0] == 1 and batch != 1:
            x = x.expand(batch, *x.shape[1:])
        return x.repeat(size, *(1,) * (x.dim() - 1))
    x = x.movedim(dim, 0)
    if x.dim() == 1:
        return x.repeat_interleave(batch)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _folded_call(op: Any, size: int, batch: int, *args: Any) -> Any:
    """``op(*args)`` on folded arguments; its error says that the batch it names is
    the samples' batches folded into one."""
    try:
        return op(*args)
    except (ValueError, IndexError, TypeError) as error:
        if type(error) not in (ValueError, IndexError, TypeError):
            raise
        raise type(error)(
            f"{error} [under torch.func.vmap: the {size} samples' batches of {batch} "
            f"are folded into one batch of {size * batch} here]"
        ) from None


def _unfold(y: Tensor, size: int) -> Tensor:
    return y.reshape(size, y.shape[0] // size, *y.shape[1:])


def _per_sample(op: Any, info: Any, in_dims: tuple, args: tuple) -> Any:
    """The op once per sample (a cos/sin table mapped itself), results stacked."""
    results = [
        op(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims, strict=True)))
        for i in range(info.batch_size)
    ]
    if isinstance(results[0], tuple):
        return tuple(torch.stack(r) for r in zip(*results, strict=True)), (0, 0)
    return torch.stack(results), 0


@_batching_rule("numba_rope::rotary_embedding")
def _rotary_vmap(info: Any, in_dims: tuple, *args: Any) -> Any:
    input, cos, sin, ids, offset, offsets, *options = args
    size = info.batch_size
    if in_dims[1] is not None or in_dims[2] is not None:
        return _per_sample(_rotary_op, info, in_dims, args)
    x = _front(input, in_dims[0], size)
    assert x is not None  # (the input is a tensor)
    batch = x.shape[1]
    if cos.dim() == 3:  # a row per token of each sequence
        cos, sin = _fold(cos, None, size, batch), _fold(sin, None, size, batch)
    y = _folded_call(
        _rotary_op,
        size,
        batch,
        x.reshape(size * batch, *x.shape[2:]),
        cos,
        sin,
        _fold(ids, in_dims[3], size, batch),
        offset,
        _fold(offsets, in_dims[5], size, batch),
        *options,
    )
    return _unfold(y, size), 0


@_batching_rule("numba_rope::rotary_embedding_qk")
def _rotary_qk_vmap(info: Any, in_dims: tuple, *args: Any) -> Any:
    q, k, cos, sin, ids, offset, offsets, *options = args
    size = info.batch_size
    if in_dims[2] is not None or in_dims[3] is not None:
        return _per_sample(_rotary_qk_op, info, in_dims, args)
    q, k = _front(q, in_dims[0], size), _front(k, in_dims[1], size)
    assert q is not None and k is not None
    batch = q.shape[1]
    if cos.dim() == 3:  # (full_width: the op's one table for the batch, broadcast first)
        full_width = options[-1]
        cos, sin = (_fold(c, None, size, batch, full_width) for c in (cos, sin))
    y_q, y_k = _folded_call(
        _rotary_qk_op,
        size,
        batch,
        q.reshape(size * batch, *q.shape[2:]),
        k.reshape(size * k.shape[1], *k.shape[2:]),
        cos,
        sin,
        _fold(ids, in_dims[4], size, batch),
        offset,
        _fold(offsets, in_dims[6], size, batch),
        *options,
    )
    return (_unfold(y_q, size), _unfold(y_k, size)), (0, 0)


# -- the ops as the public functions call them ---------------------------------------------
# The ops above record reverse mode only: a torch custom op has no forward-mode rule, and
# one called on a tensor that carries a forward-mode tangent returns a result without one
# (torch 2.13), and torch.func's reverse transforms refuse the autograd function torch
# generates for an op. So the public functions (and numba_rope.huggingface) call
# :func:`recorded_op` / :func:`recorded_qk_op`. These take the op itself where nothing is
# recorded, under torch.compile (Dynamo traces the op with its registered autograd; an
# autograd.Function would be traced through, which in torch 2.13 warns, and one that
# defines ``jvp`` is refused) and under vmap alone (the op's batching rule); an
# autograd.Function of it where reverse mode records in eager mode (torch.func.grad,
# vjp, jacrev included); and one with a forward-mode rule (``jvp``) where a
# forward-mode level is open (torch.autograd.forward_ad, torch.func.jvp, jacfwd), in
# eager mode (a compiled function breaks its graph there; see _records). The derivative
# of a rotation with respect to the input is the rotation itself (the operator is
# linear in it): the tangent is the op applied to the input's tangent.


def _save_for_forward(ctx: Any, inputs: tuple, output: Any) -> None:
    _setup(ctx, inputs, output)
    ctx.save_for_forward(*_constants(inputs)[0])
    # Tangents (and gradients) that are absent come as None, not zeros: a cache with a
    # tangent is then told from one without, at every level of nested transforms.
    ctx.set_materialize_grads(False)
    if len(inputs) == 14:  # q's and k's forms, for zeros where only one has a tangent
        ctx.forms = [(x.shape, x.dtype, x.device) for x in inputs[:2]]


def _refuse_cache_tangents(*tangents: Tensor | None) -> None:
    # A cache's tangent, at this level of forward mode (an outer torch.func.jvp's
    # included, which the public functions' check cannot see).
    if any(t is not None for t in tangents):
        raise NotImplementedError(_CACHE_GRADIENT)


class _Rotary(torch.autograd.Function):
    """:func:`_rotary_op` recording reverse mode."""

    generate_vmap_rule = True  # vmap maps forward, backward and jvp: the ops' rules

    @staticmethod
    def forward(*inputs: Any) -> Any:
        return _rotary_op(*inputs)

    setup_context = staticmethod(_setup)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        return _rotary_backward(ctx, grad)


class _RotaryDual(_Rotary):
    """:class:`_Rotary` with forward mode."""

    setup_context = staticmethod(_save_for_forward)

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor | None, *others: Any) -> Tensor | None:  # type: ignore[override]
        _refuse_cache_tangents(*others[:2])
        if tangent is None:
            return None
        cos, sin, ids, offsets = ctx.saved_tensors
        return recorded_op(tangent, cos, sin, ids, ctx.offset, offsets, *ctx.options)


class _RotaryQK(torch.autograd.Function):
    """:func:`_rotary_qk_op` recording reverse mode."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*inputs: Any) -> Any:
        return _rotary_qk_op(*inputs)

    setup_context = staticmethod(_setup)

    @staticmethod
    def backward(ctx: Any, grad_q: Tensor, grad_k: Tensor) -> tuple:  # type: ignore[override]
        return _rotary_qk_backward(ctx, grad_q, grad_k)


class _RotaryQKDual(_RotaryQK):
    """:class:`_RotaryQK` with forward mode."""

    setup_context = staticmethod(_save_for_forward)

    @staticmethod
    def jvp(ctx: Any, tangent_q: Any, tangent_k: Any, *others: Any) -> tuple:  # type: ignore[override]
        _refuse_cache_tangents(*others[:2])
        if tangent_q is None and tangent_k is None:
            return None, None
        tangent_q, tangent_k = _zeros_for_none(ctx, tangent_q, tangent_k)
        cos, sin, ids, offsets = ctx.saved_tensors
        return recorded_qk_op(
            tangent_q, tangent_k, cos, sin, ids, ctx.offset, offsets, *ctx.options
        )


def _records(first: Tensor, second: Tensor | None = None) -> int:
    """How :func:`recorded_op` calls the op. 0: the op itself: nothing to record, a
    tracer (Dynamo, torch.jit.trace: the op and its registered autograd go into the
    graph, as a tracer expects of a custom op), or torch.func transforms none of which
    differentiates (vmap: the op's batching rule; functionalize). 1: the reverse-mode
    autograd.Function: grad mode with an input that requires grad, or a grad or jvp
    transform running (an outer level may track what the innermost wraps). 2: the
    forward-mode one (a forward-mode level is open)."""
    # (_autograd.forward_ad_active's test, through torch's attributes: Dynamo traces them)
    if getattr(torch.autograd.forward_ad, "_current_level", 0) >= 0:
        mode = 2
    elif torch.is_grad_enabled() and (
        first.requires_grad or (second is not None and second.requires_grad)
    ):
        mode = 1
    elif torch._C._functorch.peek_interpreter_stack() is None:
        return 0
    elif torch.compiler.is_compiling() or not _differentiating():
        return 0
    else:
        mode = 1
    if torch.compiler.is_compiling():
        # The op's registered autograd has no forward mode: that call runs eagerly,
        # through the forward-mode function (recorded_op runs it by _eagerly; with
        # fullgraph=True Dynamo refuses that). A graph break here would not do: torch
        # resumes tracing inside this function after it, where it took the op and
        # lost the tangent.
        return 2 if mode == 2 else 0
    return 0 if torch.jit.is_tracing() else mode


@torch.compiler.disable
def _eagerly(function: Any, inputs: tuple) -> Any:
    """``function.apply(*inputs)`` outside any compiled graph, and with nothing under
    it compiled: Dynamo breaks a graph at this call and runs it as it is, its
    forward-mode tangents included. (A forward-mode call made eagerly inside a
    compiled function, as ``torch.func.jvp`` runs there, had its autograd.Function's
    ``forward`` compiled as a frame of its own, where the op lost its tangents' link
    and torch failed an internal assertion.)"""
    return function.apply(*inputs)


def _differentiating() -> bool:
    """Whether a grad or jvp transform of torch.func is running."""
    kinds = torch._C._functorch.TransformType
    derivatives = (kinds.Grad, kinds.Jvp)
    return any(level.key() in derivatives for level in torch._C._functorch.get_interpreter_stack())


#: torch's counts of active dispatch and function modes (FakeTensorMode, FlopCounterMode,
#: a user's TorchDispatchMode), private in torch; without them every call takes the op.
_DISPATCH_MODES = getattr(torch._C, "_len_torch_dispatch_stack", None)
_FUNCTION_MODES = getattr(torch._C, "_is_torch_function_mode_enabled", None)


def _direct(inputs: tuple) -> bool:
    """Whether a call that records nothing (:func:`_records` 0) may run the op's
    implementation without torch's dispatcher, which costs about 30 µs a call on the
    Intel VM (a CPU decode step of 64 sequences, q and k: 56-64 µs through the op,
    39-41 directly; docs/performance.md, "Thirty-third session"): plain tensors (no
    subclass, no fake tensor), nothing that requires grad where grad mode is on
    (whatever the op's registered autograd would do, refusing caches that require
    grad included), no tracer (torch.compile, torch.jit.trace), no torch.func
    transform, and no dispatch or function mode that expects to see the op. The same
    implementation, so the same results. ``inputs``: the call's tensor arguments
    (None where one is not given)."""
    if _DISPATCH_MODES is None or _FUNCTION_MODES is None or inputs[0].is_meta:
        return False  # (meta tensors: the op's fake implementation gives their result)
    grad = torch.is_grad_enabled()
    for value in inputs:
        if isinstance(value, Tensor) and (
            type(value) is not Tensor or (grad and value.requires_grad)
        ):
            return False
    return not (
        torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or _DISPATCH_MODES()
        or _FUNCTION_MODES()
    )


def recorded_op(*inputs: Any) -> Tensor:
    """:func:`_rotary_op` (its arguments), recording what autograd needs (above)."""
    mode = _records(inputs[0])
    if mode == 0:
        direct = _direct(inputs[:4] + inputs[5:6])  # its tensors: input to offsets
        return _rotary_impl(*inputs) if direct else _rotary_op(*inputs)
    if mode == 2:  # eagerly, compiled or not: see _eagerly
        return _eagerly(_RotaryDual, inputs)  # type: ignore[no-any-return]
    return _Rotary.apply(*inputs)


def recorded_qk_op(*inputs: Any) -> tuple[Tensor, Tensor]:
    """:func:`_rotary_qk_op` (its arguments), recording what autograd needs (above)."""
    mode = _records(inputs[0], inputs[1])
    if mode == 0:
        direct = _direct(inputs[:5] + inputs[6:7])  # its tensors: q to offsets
        return _rotary_qk_impl(*inputs) if direct else _rotary_qk_op(*inputs)
    if mode == 2:  # eagerly, compiled or not: see _eagerly
        return _eagerly(_RotaryQKDual, inputs)  # type: ignore[no-any-return]
    return _RotaryQK.apply(*inputs)


# -- the public functions ---------------------------------------------------------------


def _tensor(array: Any, like: Tensor) -> Any:
    """A NumPy cache or position array as a tensor on ``like``'s device (a view of its
    memory on the CPU, a copy on a GPU); tensors and None as they are."""
    if array is None or isinstance(array, Tensor):
        return array
    if isinstance(array, np.ndarray):
        with warnings.catch_warnings():
            # A read-only array (np.broadcast_to, a read-only memmap) is only read here;
            # torch warns that it cannot guard it against writes.
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            if array.dtype.kind == "V" and array.dtype.itemsize == 2:  # ml_dtypes.bfloat16
                tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
            else:
                tensor = torch.from_numpy(array)
        return tensor.to(like.device)
    raise TypeError(
        f"numba_rope.torch takes torch tensors (or NumPy caches and positions), got a "
        f"{type(array).__module__}.{type(array).__qualname__}; for NumPy input use "
        f"numba_rope.rotary_embedding"
    )


def _check_inputs(*inputs: Any) -> None:
    for name, x in inputs:
        if not isinstance(x, Tensor):
            raise TypeError(
                f"{name} is a {type(x).__module__}.{type(x).__qualname__}; "
                f"numba_rope.torch takes torch tensors (for NumPy arrays, which need no "
                f"autograd, use numba_rope.rotary_embedding)"
            )


def _offsets(position_offset: Any, like: Tensor) -> tuple[int | None, Tensor | None]:
    """``position_offset`` as the ops take it: ``(int, None)`` or ``(None, tensor)``."""
    if position_offset is None:
        return None, None
    if isinstance(position_offset, Tensor):
        return None, position_offset
    if isinstance(position_offset, np.ndarray):
        return None, _tensor(position_offset, like)
    if isinstance(position_offset, (bool, np.bool_)) or not isinstance(
        position_offset, (int, np.integer)
    ):
        raise TypeError(
            f"position_offset must be an integer or an integer tensor of shape [batch], "
            f"got {position_offset!r}"
        )
    return int(position_offset), None


def check_caches(cos: Tensor, sin: Tensor) -> None:
    """``NotImplementedError`` for caches that require grad (before the call; a tangent
    of a cache is refused by the forward-mode rule, at whatever level it comes)."""
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise NotImplementedError(_CACHE_GRADIENT)


def rotary_embedding(
    input: Tensor,
    cos_cache: Tensor,
    sin_cache: Tensor,
    position_ids: Tensor | None = None,
    *,
    interleaved: bool = False,
    rotary_embedding_dim: int = 0,
    layout: str = "bhsd",
    num_heads: int | None = None,
    position_offset: int | Tensor | None = None,
    inverse: bool = False,
) -> Tensor:
    """:func:`numba_rope.rotary_embedding` on torch tensors, differentiable with
    respect to ``input``.

    The arguments and the result are those of :func:`numba_rope.rotary_embedding`
    (same numerical contract, same errors), as torch tensors on one device (CPU or
    CUDA; NumPy caches and positions are taken as tensors, copied to the GPU for CUDA
    input). The result is a new C-contiguous tensor; there is no ``out=`` (write in
    place with :func:`numba_rope.rotary_embedding`, which records no autograd).
    ``position_offset``: an int or an integer tensor of shape ``[batch]``.

    Backward: the gradient with respect to ``input`` is the output's gradient rotated
    by the negative angle (``inverse=True``), by the same kernels; forward mode: the
    output's tangent is the input's tangent rotated. Caches that require grad or carry
    a tangent raise ``NotImplementedError``.

    Examples
    --------
    >>> import torch
    >>> import numba_rope
    >>> import numba_rope.torch
    >>> cos, sin = (torch.from_numpy(c) for c in numba_rope.rope_cache(16, 4))
    >>> x = torch.randn(1, 6, 2, 4, dtype=torch.float64, requires_grad=True)  # bshd
    >>> def rope(x):
    ...     return numba_rope.torch.rotary_embedding(
    ...         x, cos.double(), sin.double(), position_offset=2, layout="bshd")
    >>> torch.autograd.gradcheck(rope, (x,))
    True
    """
    _check_inputs(("input", input))
    cos, sin = _tensor(cos_cache, input), _tensor(sin_cache, input)
    check_caches(cos, sin)
    offset, offsets = _offsets(position_offset, input)
    return recorded_op(
        input,
        cos,
        sin,
        _tensor(position_ids, input),
        offset,
        offsets,
        interleaved,
        rotary_embedding_dim,
        layout,
        num_heads,
        inverse,
        False,
    )


def rotary_embedding_qk(
    q: Tensor,
    k: Tensor,
    cos_cache: Tensor,
    sin_cache: Tensor,
    position_ids: Tensor | None = None,
    *,
    interleaved: bool = False,
    rotary_embedding_dim: int = 0,
    layout: str = "bhsd",
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    position_offset: int | Tensor | None = None,
    inverse: bool = False,
) -> tuple[Tensor, Tensor]:
    """:func:`numba_rope.rotary_embedding_qk` on torch tensors, differentiable with
    respect to ``q`` and ``k`` (see :func:`rotary_embedding`): one pass over both
    forward, and one over both gradients backward.

    Examples
    --------
    >>> import torch
    >>> import numba_rope
    >>> import numba_rope.torch
    >>> cos, sin = (torch.from_numpy(c) for c in numba_rope.rope_cache(16, 8))
    >>> q = torch.randn(2, 3, 4, 8, requires_grad=True)   # bshd: 4 query heads
    >>> k = torch.randn(2, 3, 2, 8, requires_grad=True)   # 2 key heads
    >>> q_out, k_out = numba_rope.torch.rotary_embedding_qk(
    ...     q, k, cos, sin, position_offset=torch.tensor([0, 7]), layout="bshd")
    >>> (q_out.sum() + k_out.sum()).backward()
    >>> q.grad.shape, k.grad.shape
    (torch.Size([2, 3, 4, 8]), torch.Size([2, 3, 2, 8]))
    """
    _check_inputs(("q", q), ("k", k))
    cos, sin = _tensor(cos_cache, q), _tensor(sin_cache, q)
    check_caches(cos, sin)
    offset, offsets = _offsets(position_offset, q)
    return recorded_qk_op(
        q,
        k,
        cos,
        sin,
        _tensor(position_ids, q),
        offset,
        offsets,
        interleaved,
        rotary_embedding_dim,
        layout,
        num_heads,
        num_kv_heads,
        inverse,
        False,
    )
