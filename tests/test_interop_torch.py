"""The serving drop-ins (numba_rope.vllm, numba_rope.flash_attn) on torch CPU tensors,
end to end: torch tensors in, torch tensors out (in place through views of a fused
qkv tensor), against the float32 contract of numba_rope.reference bit for bit (the
same oracles as tests/test_vllm.py and tests/test_flash_attn.py, on NumPy copies of the
tensors' values)."""

from __future__ import annotations

import numpy as np
import pytest
from oracles import BFLOAT16, assert_bitwise_equal
from test_flash_attn import varlen_contract
from test_vllm import contract

from numba_rope import flash_attn, vllm

torch = pytest.importorskip("torch")
from test_torch import host as values  # noqa: E402  (after the skip: it imports torch)
from test_torch import tensor  # noqa: E402


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BFLOAT16], ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_vllm_op_in_place_on_a_fused_qkv_tensor(rng, dtype, is_neox):
    num_tokens, heads, kv_heads, head_size = 6, 4, 2, 8
    qkv = rng.standard_normal((num_tokens, (heads + 2 * kv_heads) * head_size)).astype(dtype)
    q_end, k_end = heads * head_size, (heads + kv_heads) * head_size
    cache = vllm.make_cos_sin_cache(32, 6, dtype=np.float32)
    positions = rng.integers(0, 32, num_tokens)
    want_q = contract(positions, qkv[:, :q_end], head_size, cache, is_neox)
    want_k = contract(positions, qkv[:, q_end:k_end], head_size, cache, is_neox)
    v_before = qkv[:, k_end:].copy()
    work = tensor(qkv.copy())  # the fused projection's output, as a torch tensor
    query, key = work[:, :q_end], work[:, q_end:k_end]
    assert (
        vllm.rotary_embedding(
            torch.from_numpy(positions), query, key, head_size, torch.from_numpy(cache), is_neox
        )
        is None
    )
    result = values(work)
    assert_bitwise_equal(result[:, :q_end], want_q)
    assert_bitwise_equal(result[:, q_end:k_end], want_k)
    assert_bitwise_equal(result[:, k_end:], v_before)


def test_vllm_forward_native_returns_new_tensors(rng):
    query = rng.standard_normal((5, 3 * 8)).astype(np.float32)
    key = rng.standard_normal((5, 8)).astype(np.float32)
    cache = vllm.make_cos_sin_cache(16, 8, dtype=np.float32)
    positions = np.array([3, 0, 15, 7, 7])
    q_in, k_in = tensor(query.copy()), tensor(key.copy())
    got_q, got_k = vllm.forward_native(
        torch.from_numpy(positions), q_in, k_in, 8, tensor(cache), True
    )
    assert isinstance(got_q, torch.Tensor) and isinstance(got_k, torch.Tensor)
    assert got_q.shape == q_in.shape and got_k.shape == k_in.shape
    assert_bitwise_equal(values(got_q), contract(positions, query, 8, cache, True))
    assert_bitwise_equal(values(got_k), contract(positions, key, 8, cache, True))
    assert_bitwise_equal(values(q_in), query)  # inputs untouched


@pytest.mark.parametrize("which", ["query", "key"])
def test_vllm_forms_name_the_tensor_that_requires_grad(rng, which):
    """query or key requiring grad: refused by vLLM's name for it (the operator's
    message said "input"), before anything is written, in both forms."""
    query = torch.from_numpy(rng.standard_normal((5, 2 * 8)).astype(np.float32))
    key = torch.from_numpy(rng.standard_normal((5, 8)).astype(np.float32))
    (query if which == "query" else key).requires_grad_()
    cache = tensor(vllm.make_cos_sin_cache(16, 8, dtype=np.float32))
    positions = torch.arange(5)
    before = (query.detach().clone(), key.detach().clone())
    for form in (vllm.forward_native, vllm.rotary_embedding):
        with pytest.raises(TypeError, match=f"^{which} requires grad") as raised:
            form(positions, query, key, 8, cache, True)
        # Raised from None: a traceback does not print the operator's own error for the
        # same fault ("input requires grad") before it, as a second error.
        assert raised.value.__suppress_context__ and raised.value.__cause__ is None
    assert torch.equal(query, before[0]) and torch.equal(key, before[1])


def test_vllm_torch_positions_out_of_the_cache_are_named_as_numpy_ones():
    """A torch tensor of positions, one outside the cache: named as the caller indexes
    positions (as NumPy positions are), not as the operator's ids; nothing written."""
    query = torch.ones(3, 2 * 8)
    cache = tensor(vllm.make_cos_sin_cache(32, 8, dtype=np.float32))
    for form in (vllm.rotary_embedding, vllm.forward_native):
        with pytest.raises(IndexError, match=r"^positions\[2\] = 32 is outside cos_sin_cache"):
            form(torch.tensor([5, 6, 32]), query, None, 8, cache, True)
        assert bool((query == 1).all())


@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_flash_attn_varlen_with_torch_tensors(rng, interleaved, inplace):
    lengths = [3, 0, 5, 2]
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    offsets = np.array([0, 4, 1, 9])
    x = rng.standard_normal((int(cu_seqlens[-1]), 2, 8)).astype(np.float32)
    cos = rng.uniform(-1, 1, (16, 3)).astype(np.float32)
    sin = rng.uniform(-1, 1, (16, 3)).astype(np.float32)
    want = varlen_contract(x, cos, sin, cu_seqlens, offsets, interleaved)
    x_t = tensor(x.copy())
    got = flash_attn.apply_rotary_emb(
        x_t,
        tensor(cos),
        tensor(sin),
        interleaved=interleaved,
        inplace=inplace,
        seqlen_offsets=torch.from_numpy(offsets),
        cu_seqlens=torch.from_numpy(cu_seqlens),
        max_seqlen=max(lengths),
    )
    assert isinstance(got, torch.Tensor)
    assert (got is x_t) == inplace
    assert_bitwise_equal(values(got), want)
    if not inplace:
        assert_bitwise_equal(values(x_t), x)


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "float64"])
def test_vllm_module_takes_a_torch_dtype(rng, name):
    """vLLM's ``RotaryEmbedding(head_size, rotary_dim, max_position_embeddings, base,
    is_neox_style, dtype)`` takes a ``torch.dtype`` (the model's): the cache is the one
    of the NumPy dtype of that name, bit for bit, and rotates tokens of that dtype."""
    numpy_dtype = BFLOAT16 if name == "bfloat16" else np.dtype(name)
    rope = vllm.RotaryEmbedding(8, 6, 32, 10000.0, True, getattr(torch, name))
    want_cache = vllm.make_cos_sin_cache(32, 6, dtype=numpy_dtype)
    assert_bitwise_equal(np.asarray(rope.cos_sin_cache), want_cache)
    query = rng.standard_normal((5, 2 * 8)).astype(numpy_dtype)
    positions = np.array([0, 31, 4, 4, 9])
    got, _ = rope.forward_native(torch.from_numpy(positions), tensor(query))
    assert got.dtype == getattr(torch, name)
    assert_bitwise_equal(values(got), contract(positions, query, 8, want_cache, True))
    with pytest.raises(TypeError, match=r"dtype must be one of .*torch\.int32"):
        vllm.RotaryEmbedding(8, 6, 32, 10000.0, True, torch.int32)


def _rotate_half_torch(x, cos, sin, rotary_dim):
    """flash-attn's ``apply_rotary_emb_torch`` (halves), in torch: ``x*cos +
    rotate_half(x)*sin`` on the first ``rotary_dim`` channels, cos/sin ``[tokens, d/2]``."""
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
    c = torch.cat([cos, cos], dim=-1)[:, None, :]
    s = torch.cat([sin, sin], dim=-1)[:, None, :]
    return torch.cat([rot * c + torch.cat([-x2, x1], dim=-1) * s, rest], dim=-1)


def test_flash_attn_is_differentiable_like_flash_attn(rng):
    """A tensor that records autograd goes through numba_rope.torch: the forward and the
    gradient equal autograd through flash-attn's torch arithmetic written here (float64:
    both evaluate each element as the same two products and one sum, so they agree to
    float64 rounding), variable-length batches included."""
    lengths = [4, 2, 3]
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    offsets = [1, 0, 6]
    x = torch.tensor(rng.standard_normal((9, 2, 10)), requires_grad=True)
    cos = torch.tensor(rng.uniform(-1, 1, (12, 3)))
    sin = torch.tensor(rng.uniform(-1, 1, (12, 3)))
    weights = torch.tensor(rng.standard_normal((9, 2, 10)))

    got = flash_attn.apply_rotary_emb(
        x, cos, sin, seqlen_offsets=torch.tensor(offsets), cu_seqlens=cu_seqlens
    )
    (got * weights).sum().backward()
    got_grad, x.grad = x.grad.clone(), None

    rows = torch.cat([torch.arange(n) + o for n, o in zip(lengths, offsets, strict=True)])
    want = _rotate_half_torch(x, cos[rows], sin[rows], 6)
    (want * weights).sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    torch.testing.assert_close(got_grad, x.grad, rtol=0, atol=1e-13)

    with pytest.raises(TypeError, match="requires grad"):  # in place: the way out is named
        flash_attn.apply_rotary_emb(x, cos, sin, inplace=True, cu_seqlens=cu_seqlens)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_flash_attn_forward_mode_equals_torch_arithmetic(rng):
    """A tensor with a forward-mode tangent, or under torch.func.vmap, goes through
    numba_rope.torch too: the tangent from torch.func.jvp equals torch's own forward
    mode through flash-attn's arithmetic written here (float64, as above), and each
    sample under vmap that arithmetic, variable-length batches included."""
    lengths, offsets = [4, 2, 3], [1, 0, 6]
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    x, direction = (torch.tensor(rng.standard_normal((9, 2, 10))) for _ in range(2))
    cos = torch.tensor(rng.uniform(-1, 1, (12, 3)))
    sin = torch.tensor(rng.uniform(-1, 1, (12, 3)))
    rows = torch.cat([torch.arange(n) + o for n, o in zip(lengths, offsets, strict=True)])
    _, got = torch.func.jvp(
        lambda a: flash_attn.apply_rotary_emb(
            a, cos, sin, seqlen_offsets=torch.tensor(offsets), cu_seqlens=cu_seqlens
        ),
        (x,),
        (direction,),
    )
    _, want = torch.func.jvp(
        lambda a: _rotate_half_torch(a, cos[rows], sin[rows], 6), (x,), (direction,)
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    # vmap over a stack of such batches: through numba_rope.torch as well.
    stack = torch.stack([x, direction])
    got = torch.func.vmap(
        lambda a: flash_attn.apply_rotary_emb(
            a, cos, sin, seqlen_offsets=torch.tensor(offsets), cu_seqlens=cu_seqlens
        )
    )(stack)
    with pytest.raises(TypeError, match=r"mapped by torch\.func\.vmap"):
        torch.func.vmap(  # offsets mapped: read on the host, they cannot be
            lambda a, o: flash_attn.apply_rotary_emb(
                a, cos, sin, seqlen_offsets=o, cu_seqlens=cu_seqlens
            )
        )(stack, torch.tensor([offsets, offsets]))
    for one, a in zip(got, stack, strict=True):
        torch.testing.assert_close(
            one, _rotate_half_torch(a, cos[rows], sin[rows], 6), rtol=0, atol=1e-13
        )


def test_flash_attn_batch_form_is_differentiable(rng):
    x = torch.tensor(rng.standard_normal((2, 3, 2, 8)), requires_grad=True)
    cos = torch.tensor(rng.uniform(-1, 1, (10, 4)))
    sin = torch.tensor(rng.uniform(-1, 1, (10, 4)))
    got = flash_attn.apply_rotary_emb(x, cos, sin, seqlen_offsets=5)
    got.sum().backward()
    got_grad, x.grad = x.grad.clone(), None
    rows = torch.arange(3) + 5
    want = torch.stack([_rotate_half_torch(x[b], cos[rows], sin[rows], 8) for b in range(2)])
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    torch.testing.assert_close(got_grad, x.grad, rtol=0, atol=1e-13)
