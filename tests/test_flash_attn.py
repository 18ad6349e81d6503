"""numba_rope.flash_attn: flash-attn's apply_rotary_emb (seqlen_offsets, variable-length
batches through cu_seqlens, in place), apply_rotary (conjugate), apply_rotary_emb_qkv_
and apply_rotary_emb_kv_, on NumPy arrays and on GPU arrays (numba device arrays; in the
CUDA simulator without a GPU).

Oracles: :func:`flash_attn_torch`, flash-attn's ``apply_rotary_emb_torch`` arithmetic
(``x * cos + rotate_half(x) * sin`` on the first ``rotary_dim`` channels, cos and sin
repeated as ``(2 d)`` or ``(d 2)``) written here in float64 on NumPy (flash-attn cannot
be installed), applied per sequence with the cache rows each token should use; and
``numba_rope.reference.rotary_embedding(..., precision="contract")``, bit for bit, on
each sequence cut out by NumPy with its offset.

Why the tolerance against the float64 oracle holds on every CPU: see tests/test_vllm.py
(results are first the float32 contract bit for bit; the contract and the float64 value
rounded once are within two units of the output format at the terms' scale).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from oracles import BFLOAT16, assert_bitwise_equal, ulp_of

from numba_rope import _interop, reference
from numba_rope.flash_attn import (
    apply_rotary,
    apply_rotary_emb,
    apply_rotary_emb_func,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
)

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BFLOAT16, np.dtype(np.float64)]


# -- oracles ---------------------------------------------------------------------------


def flash_attn_torch(x, cos, sin, interleaved=False):
    """flash-attn's ``apply_rotary_emb_torch`` in float64: ``x`` ``[batch, seqlen,
    nheads, headdim]``, ``cos``/``sin`` ``[seqlen, rotary_dim/2]`` or ``[batch, seqlen,
    rotary_dim/2]``; rounded once to ``x``'s dtype (bfloat16 through float32, a hair
    over half a unit: inside the bound)."""
    x64 = x.astype(np.float64)
    rotary_dim = cos.shape[-1] * 2
    if interleaved:  # repeat "... d -> ... 1 (d 2)"
        c = np.repeat(cos.astype(np.float64), 2, axis=-1)
        s = np.repeat(sin.astype(np.float64), 2, axis=-1)
    else:  # repeat "... d -> ... 1 (2 d)"
        c = np.concatenate([cos.astype(np.float64)] * 2, axis=-1)
        s = np.concatenate([sin.astype(np.float64)] * 2, axis=-1)
    c, s = c[..., None, :], s[..., None, :]
    rot = x64[..., :rotary_dim]
    if interleaved:
        x1, x2 = rot[..., ::2], rot[..., 1::2]
        rotated_half = np.stack([-x2, x1], axis=-1).reshape(rot.shape)
    else:
        x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
        rotated_half = np.concatenate([-x2, x1], axis=-1)
    out = np.concatenate([rot * c + rotated_half * s, x64[..., rotary_dim:]], axis=-1)
    return out.astype(x.dtype)


def sequences(cu_seqlens, offsets):
    """``(b, start, stop, offset)`` of each packed sequence."""
    for b in range(len(cu_seqlens) - 1):
        yield b, int(cu_seqlens[b]), int(cu_seqlens[b + 1]), int(offsets[b])


def varlen_oracle(x, cos, sin, cu_seqlens, offsets, interleaved, conjugate=False):
    """Each sequence on its own through :func:`flash_attn_torch`, with its rows."""
    out = np.empty_like(x)
    for _, start, stop, offset in sequences(cu_seqlens, offsets):
        rows = offset + np.arange(stop - start)
        sign = -1 if conjugate else 1
        out[start:stop] = flash_attn_torch(
            x[None, start:stop], cos[rows], sign * sin[rows], interleaved
        )[0]
    return out


def varlen_contract(x, cos, sin, cu_seqlens, offsets, interleaved, conjugate=False):
    """numba_rope.reference's float32 contract, each sequence on its own."""
    out = np.empty_like(x)
    for _, start, stop, offset in sequences(cu_seqlens, offsets):
        out[start:stop] = reference.rotary_embedding(
            np.ascontiguousarray(x[None, start:stop]),
            cos,
            sin,
            position_offset=offset,
            interleaved=interleaved,
            rotary_embedding_dim=2 * cos.shape[-1],
            layout="bshd",
            inverse=conjugate,
            precision="contract",
        )[0]
    return out


def batch_oracles(x, cos, sin, offsets, interleaved, conjugate=False):
    """``(float64 oracle, contract)`` of a ``[batch, seqlen, ...]`` x: the sequences are
    rows of a packed x with equal lengths."""
    batch, seqlen = x.shape[:2]
    packed = x.reshape(batch * seqlen, *x.shape[2:])
    cu = np.arange(batch + 1) * seqlen
    want = varlen_oracle(packed, cos, sin, cu, offsets, interleaved, conjugate)
    exact = varlen_contract(packed, cos, sin, cu, offsets, interleaved, conjugate)
    return want.reshape(x.shape), exact.reshape(x.shape)


def scale_of(x, cos, sin):
    terms = np.abs(cos.astype(np.float64)).max(initial=0) + np.abs(sin.astype(np.float64)).max(
        initial=0
    )
    return float(np.abs(x.astype(np.float64)).max(initial=0) * terms)


def assert_results(device, got, want, exact, x, cos, sin):
    """Within two units of the output format of the float64 oracle, and the contract bit
    for bit (on the CPU, in the simulator and on a GPU)."""
    assert got.dtype == x.dtype and got.shape == x.shape
    scale = scale_of(x, cos, sin)
    np.testing.assert_allclose(
        got.astype(np.float64), want.astype(np.float64), rtol=0, atol=2 * ulp_of(x.dtype) * scale
    )
    assert_bitwise_equal(got, exact)


def make_cos_sin(rng, rows, rotary_dim, dtype):
    """As flash-attn's tests: random angles in [0, 2 pi), cos and sin in ``dtype``."""
    angle = rng.random((rows, rotary_dim // 2)) * 2 * np.pi
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)


# -- fixed-length batches ---------------------------------------------------------------


@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
@pytest.mark.parametrize("offsets", ["zero", "int", "array"])
@pytest.mark.parametrize("rotary_dim", [8, 4], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batches_match_flash_attn(rng, device, dtype, interleaved, rotary_dim, offsets, inplace):
    on, off = device
    batch, seqlen, nheads, headdim = 2, 3, 2, 8
    x = rng.standard_normal((batch, seqlen, nheads, headdim)).astype(dtype)
    cos, sin = make_cos_sin(rng, 2 * seqlen, rotary_dim, dtype)
    per_batch = {"zero": np.zeros(batch, int), "int": np.full(batch, 2), "array": np.array([3, 1])}
    seqlen_offsets = {"zero": 0, "int": 2, "array": on(per_batch["array"])}[offsets]
    want, exact = batch_oracles(x, cos, sin, per_batch[offsets], interleaved)

    x_on = on(x.copy())
    result = apply_rotary_emb(
        x_on, on(cos), on(sin), interleaved, inplace, seqlen_offsets=seqlen_offsets
    )
    if inplace:
        assert result is x_on
    assert_results(device, off(result), want, exact, x, cos, sin)


def test_float32_caches_for_16_bit_x(rng):
    """flash-attn wants cos in x's dtype; numba_rope also takes float32 caches (more
    precise), as everywhere."""
    x = rng.standard_normal((1, 4, 2, 8)).astype(BFLOAT16)
    cos, sin = make_cos_sin(rng, 8, 8, np.float32)
    want, exact = batch_oracles(x, cos, sin, [1], False)
    got = apply_rotary_emb(x, cos, sin, seqlen_offsets=1)
    assert_results(SimpleNamespace(exact=True), got, want, exact, x, cos, sin)  # the CPU


def test_conjugate_rotates_back(rng, device):
    on, off = device
    x = rng.standard_normal((2, 4, 1, 6))
    cos, sin = make_cos_sin(rng, 6, 6, np.float64)
    want, exact = batch_oracles(x, cos, sin, [2, 0], True, conjugate=True)
    got = apply_rotary(
        on(x), on(cos), on(sin), on(np.array([2, 0])), interleaved=True, conjugate=True
    )
    assert_results(device, off(got), want, exact, x, cos, sin)
    back = apply_rotary(got, on(cos), on(sin), on(np.array([2, 0])), interleaved=True)
    np.testing.assert_allclose(off(back), x, rtol=0, atol=1e-14)


def test_in_place_on_a_strided_view(rng, device):
    """q as the first heads of a [batch, seqlen, 3 * nheads, headdim] buffer: written
    where it lies, k and v untouched."""
    qkv = rng.standard_normal((2, 3, 3 * 2, 8)).astype(np.float32)
    cos, sin = make_cos_sin(rng, 8, 8, np.float32)
    want, exact = batch_oracles(qkv[:, :, :2], cos, sin, [4, 5], False)
    work = qkv.copy()
    base, q = device.views(work, work[:, :, :2])
    apply_rotary_emb(
        q, device.on(cos), device.on(sin), inplace=True, seqlen_offsets=device.on(np.array([4, 5]))
    )
    result = device.off(base)
    assert_results(
        device, np.ascontiguousarray(result[:, :, :2]), want, exact, qkv[:, :, :2], cos, sin
    )
    assert_bitwise_equal(result[:, :, 2:], qkv[:, :, 2:])


# -- variable-length batches ------------------------------------------------------------

LENGTHS = [3, 0, 5, 1]  # unequal, one empty


@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
@pytest.mark.parametrize("offsets", ["int", "array"])
@pytest.mark.parametrize("rotary_dim", [8, 6], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), BFLOAT16], ids=str)
def test_varlen_matches_flash_attn(rng, device, dtype, interleaved, rotary_dim, offsets, inplace):
    on, off = device
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    total = int(cu[-1])
    x = rng.standard_normal((total, 2, 8)).astype(dtype)
    cos, sin = make_cos_sin(rng, 12, rotary_dim, dtype)
    per_batch = np.array([4, 100, 7, 11]) if offsets == "array" else np.full(4, 3)
    seqlen_offsets = on(per_batch) if offsets == "array" else 3  # 100: empty, never read
    want = varlen_oracle(x, cos, sin, cu, per_batch, interleaved)
    exact = varlen_contract(x, cos, sin, cu, per_batch, interleaved)

    x_on = on(x.copy())
    result = apply_rotary_emb(
        x_on,
        on(cos),
        on(sin),
        interleaved=interleaved,
        inplace=inplace,
        seqlen_offsets=seqlen_offsets,
        cu_seqlens=on(cu),
        max_seqlen=max(LENGTHS),
    )
    if inplace:
        assert result is x_on
    assert_results(device, off(result), want, exact, x, cos, sin)


def test_varlen_in_place_on_a_strided_view_with_conjugate(rng, device):
    packed = rng.standard_normal((6, 2 + 1, 4)).astype(np.float32)  # q heads, then a k head
    cu, offsets = np.array([0, 2, 6]), np.array([1, 0])
    cos, sin = make_cos_sin(rng, 6, 4, np.float32)
    q = packed[:, :2]
    want = varlen_oracle(q, cos, sin, cu, offsets, False, conjugate=True)
    exact = varlen_contract(q, cos, sin, cu, offsets, False, conjugate=True)
    work = packed.copy()
    base, view = device.views(work, work[:, :2])
    out = apply_rotary(
        view,
        device.on(cos),
        device.on(sin),
        device.on(offsets),
        device.on(cu),
        None,
        inplace=True,
        conjugate=True,
    )
    assert out is view
    result = device.off(base)
    assert_results(device, np.ascontiguousarray(result[:, :2]), want, exact, q, cos, sin)
    assert_bitwise_equal(result[:, 2:], packed[:, 2:])


def test_varlen_with_equal_lengths_equals_the_batch_form(rng):
    x = rng.standard_normal((3, 4, 2, 8)).astype(np.float32)
    cos, sin = make_cos_sin(rng, 10, 8, np.float32)
    offsets = np.array([0, 6, 2])
    batch = apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets)
    packed = apply_rotary_emb_func(
        x.reshape(12, 2, 8), cos, sin, seqlen_offsets=offsets, cu_seqlens=np.array([0, 4, 8, 12])
    )
    assert_bitwise_equal(packed.reshape(x.shape), batch)


def test_an_empty_batch(rng):
    x = np.zeros((0, 2, 8), np.float32)
    cos, sin = make_cos_sin(rng, 4, 8, np.float32)
    assert apply_rotary_emb(x, cos, sin, cu_seqlens=np.array([0])).shape == (0, 2, 8)


# -- packed qkv and kv ------------------------------------------------------------------


@pytest.mark.parametrize("separate_k_caches", [False, True], ids=["shared", "cos_k"])
@pytest.mark.parametrize("form", ["5-D", "GQA"])
def test_qkv_in_place(rng, device, form, separate_k_caches):
    batch, seqlen, headdim = 2, 3, 8
    if form == "5-D":
        qkv = rng.standard_normal((batch, seqlen, 3, 2, headdim)).astype(np.float32)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        num_heads_q = None
    else:
        qkv = rng.standard_normal((batch, seqlen, 4 + 2 * 1, headdim)).astype(np.float32)
        q, k, v = qkv[:, :, :4], qkv[:, :, 4:5], qkv[:, :, 5:]
        num_heads_q = 4
    cos, sin = make_cos_sin(rng, 8, 6, np.float32)
    cos_k, sin_k = make_cos_sin(rng, 8, 6, np.float32) if separate_k_caches else (None, None)
    offsets = np.array([2, 5])
    want_q, exact_q = batch_oracles(q, cos, sin, offsets, True)
    k_cos, k_sin = (cos_k, sin_k) if separate_k_caches else (cos, sin)
    want_k, exact_k = batch_oracles(k, k_cos, k_sin, offsets, True)

    qkv_on = device.on(qkv.copy())
    returned = apply_rotary_emb_qkv_(
        qkv_on,
        device.on(cos),
        device.on(sin),
        device.on(cos_k),
        device.on(sin_k),
        interleaved=True,
        seqlen_offsets=device.on(offsets),
        num_heads_q=num_heads_q,
    )
    assert returned is qkv_on
    result = device.off(qkv_on)
    if form == "5-D":
        got_q, got_k, got_v = result[:, :, 0], result[:, :, 1], result[:, :, 2]
    else:
        got_q, got_k, got_v = result[:, :, :4], result[:, :, 4:5], result[:, :, 5:]
    assert_results(device, np.ascontiguousarray(got_q), want_q, exact_q, q, cos, sin)
    assert_results(device, np.ascontiguousarray(got_k), want_k, exact_k, k, k_cos, k_sin)
    assert_bitwise_equal(np.ascontiguousarray(got_v), np.ascontiguousarray(v))


def test_kv_in_place(rng, device):
    kv = rng.standard_normal((2, 3, 2, 2, 8)).astype(np.float16)
    cos, sin = make_cos_sin(rng, 6, 8, np.float16)
    want, exact = batch_oracles(kv[:, :, 0], cos, sin, [3, 3], False)
    kv_on = device.on(kv.copy())
    assert apply_rotary_emb_kv_(kv_on, device.on(cos), device.on(sin), seqlen_offsets=3) is kv_on
    result = device.off(kv_on)
    assert_results(
        device, np.ascontiguousarray(result[:, :, 0]), want, exact, kv[:, :, 0], cos, sin
    )
    assert_bitwise_equal(result[:, :, 1], kv[:, :, 1])


# -- errors: the rule, the value, the fix; nothing written ------------------------------


def _packed(rng):
    x = rng.standard_normal((6, 2, 8)).astype(np.float32)
    cos, sin = make_cos_sin(rng, 8, 8, np.float32)
    return x, cos, sin


@pytest.mark.parametrize(
    ("keywords", "error", "words"),
    [
        (
            {"cu_seqlens": np.array([0, 4, 2, 6])},
            ValueError,
            ["must not decrease", "cu_seqlens[2] = 2 < cu_seqlens[1] = 4"],
        ),
        ({"cu_seqlens": np.array([1, 3, 6])}, ValueError, ["start at 0", "cu_seqlens[0] = 1"]),
        (
            {"cu_seqlens": np.array([0, 3, 5])},
            ValueError,
            ["cu_seqlens[-1] = 5", "x.shape[0] = 6", "x[:5]"],
        ),
        ({"cu_seqlens": np.array([0, 3, 7])}, ValueError, ["cu_seqlens[-1] = 7", "fewer tokens"]),
        ({"cu_seqlens": np.array([[0, 6]])}, ValueError, ["1-D [batch + 1]"]),
        ({"cu_seqlens": np.array([0.0, 6.0])}, TypeError, ["integers"]),
        (
            {"cu_seqlens": np.array([0, 2, 6]), "max_seqlen": 3},
            ValueError,
            ["max_seqlen = 3", "length 4 of sequence 1"],
        ),
        (
            {"cu_seqlens": np.array([0, 2, 6]), "seqlen_offsets": np.array([0, 5])},
            IndexError,
            ["seqlen_offsets[1] = 5", "5..8", "8 rows"],
        ),
        (
            {"cu_seqlens": np.array([0, 2, 6]), "seqlen_offsets": 5},
            IndexError,
            ["seqlen_offsets = 5", "sequence 1"],
        ),
        (
            {"cu_seqlens": np.array([0, 2, 6]), "seqlen_offsets": np.array([-1, 0])},
            IndexError,
            ["seqlen_offsets[0] = -1"],
        ),
        (
            {"cu_seqlens": np.array([0, 2, 6]), "seqlen_offsets": np.array([0, 0, 0])},
            ValueError,
            ["shape [batch] = (2,)", "(3,)"],
        ),
        (
            {"cu_seqlens": np.array([0, 2, 6]), "seqlen_offsets": 1.0},
            TypeError,
            ["int or an integer array"],
        ),
        (
            {"cu_seqlens": np.array([0, 2, 6]), "seqlen_offsets": np.array([0.0, 1.0])},
            TypeError,
            ["integers"],
        ),
        ({}, ValueError, ["[batch, seqlen, nheads, headdim]", "pass cu_seqlens="]),
    ],
)
def test_bad_varlen_calls_raise_and_write_nothing(rng, keywords, error, words):
    x, cos, sin = _packed(rng)
    before = x.copy()
    with pytest.raises(error) as raised:
        apply_rotary_emb(x, cos, sin, inplace=True, **keywords)
    for word in words:
        assert word in str(raised.value), str(raised.value)
    assert_bitwise_equal(x, before)


@pytest.mark.parametrize("offset_dtype", ["int32", "int64"])
@pytest.mark.parametrize("form", ["apply_rotary_emb", "apply_rotary_emb_qkv_"])
def test_torch_cpu_batches_leave_offsets_to_the_operator(rng, offset_dtype, form):
    # torch CPU tensors with integer tensor offsets take the operator's own check, as
    # NumPy batches do (no loop over the batch on the host): the results of NumPy
    # arrays, and bad offsets named as flash-attn's arguments, nothing written.
    torch = pytest.importorskip("torch")
    from numba_rope import flash_attn
    from numba_rope._interop import host_integers, host_tensor

    # What takes this path: plain strided CPU tensors, integer ones for the offsets.
    plain = torch.zeros(2, dtype=torch.int32)
    assert host_tensor(plain) and host_integers(plain) and host_integers(np.arange(2))
    assert not host_tensor(plain.to_sparse()) and not host_tensor(plain._neg_view())
    assert not host_integers(torch.zeros(2)) and not host_integers(plain.bool())
    assert not host_tensor(plain.as_subclass(type("Mine", (torch.Tensor,), {})))

    calls = []
    checked = flash_attn._checked_offsets

    def counting(*args):
        calls.append(args)
        return checked(*args)

    cos, sin = make_cos_sin(rng, 8, 8, np.float32)
    shape = (2, 3, 2, 8) if form == "apply_rotary_emb" else (2, 3, 3, 2, 8)
    x = rng.standard_normal(shape).astype(np.float32)
    function = getattr(flash_attn, form)
    good = np.array([0, 5])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flash_attn, "_checked_offsets", counting)
        want = function(x.copy(), cos, sin, seqlen_offsets=good, **(
            {"inplace": True} if form == "apply_rotary_emb" else {}
        ))  # fmt: skip
        tx = torch.from_numpy(x.copy())
        offsets = torch.from_numpy(good.astype(offset_dtype))
        got = function(tx, torch.from_numpy(cos), torch.from_numpy(sin), seqlen_offsets=offsets, **(
            {"inplace": True} if form == "apply_rotary_emb" else {}
        ))  # fmt: skip
        assert calls == []  # neither call looped over the batch on the host
    assert got is tx
    np.testing.assert_array_equal(got.numpy(), want)
    for bad, words in (([0, 6], ["seqlen_offsets[1] = 6", "6..8"]), ([-1, 0], ["[0] = -1"])):
        tx = torch.from_numpy(x.copy())
        with pytest.raises(IndexError) as raised:
            function(
                tx, torch.from_numpy(cos), torch.from_numpy(sin),
                seqlen_offsets=torch.tensor(bad, dtype=getattr(torch, offset_dtype)),
                **({"inplace": True} if form == "apply_rotary_emb" else {}),
            )  # fmt: skip
        for word in words:
            assert word in str(raised.value), str(raised.value)
        assert raised.value.__suppress_context__ and raised.value.__cause__ is None
        np.testing.assert_array_equal(tx.numpy(), x)


@pytest.mark.parametrize(
    ("offsets", "error", "words"),
    [
        (np.array([0, 6]), IndexError, ["seqlen_offsets[1] = 6", "6..8", "8 rows"]),
        (6, IndexError, ["seqlen_offsets = 6", "8 rows"]),
        (np.array([-1, 0]), IndexError, ["seqlen_offsets[0] = -1"]),
        (
            np.array([0, 2**63 + 5], np.uint64),
            IndexError,
            ["seqlen_offsets[1] = 9223372036854775813"],
        ),
        (2**70, IndexError, ["seqlen_offsets = 1180591620717411303424"]),
        (np.array([0, 0, 0]), ValueError, ["shape [batch] = (2,)", "(3,)"]),
        (np.array([0.0, 1.0]), TypeError, ["integers"]),
        (1.0, TypeError, ["int or an integer array"]),
    ],
)
@pytest.mark.parametrize("form", ["apply_rotary_emb", "apply_rotary_emb_qkv_"])
def test_bad_offsets_of_batches_raise_and_write_nothing(rng, offsets, error, words, form):
    # NumPy batches leave the offsets to the operator's own check (made before it
    # writes); the error still names them as flash-attn's arguments.
    cos, sin = make_cos_sin(rng, 8, 8, np.float32)
    if form == "apply_rotary_emb":
        x = rng.standard_normal((2, 3, 2, 8)).astype(np.float32)
        before = x.copy()
        with pytest.raises(error) as raised:
            apply_rotary_emb(x, cos, sin, inplace=True, seqlen_offsets=offsets)
    else:
        x = rng.standard_normal((2, 3, 3, 2, 8)).astype(np.float32)
        before = x.copy()
        with pytest.raises(error) as raised:
            apply_rotary_emb_qkv_(x, cos, sin, seqlen_offsets=offsets)
    for word in words:
        assert word in str(raised.value), str(raised.value)
    # Raised from None: a traceback does not print the operator's error for the same
    # offsets (named position_offset) before it, as a second error.
    assert raised.value.__context__ is None or raised.value.__suppress_context__
    assert_bitwise_equal(x, before)


@pytest.mark.parametrize(
    ("x_shape", "cos_shape", "sin_shape", "keywords", "error", "words"),
    [
        (
            (1, 4, 2, 8),
            (8, 4),
            (8, 4),
            {"seqlen_offsets": 5},
            IndexError,
            ["seqlen_offsets = 5", "positions 5..8", "[0, 4]"],
        ),
        (
            (2, 4, 2, 8),
            (8, 4),
            (8, 4),
            {"seqlen_offsets": np.array([0, 6])},
            IndexError,
            ["seqlen_offsets[1] = 6"],
        ),
        ((2, 4, 2, 8), (8, 4), (8, 4), {"seqlen_offsets": np.array([0])}, ValueError, ["(2,)"]),
        (  # longer than the caches whatever the offset: no "[0, -4]" range
            (1, 12, 2, 8),
            (8, 4),
            (8, 4),
            {},
            IndexError,
            ["sequence 0 (length 12)", "8 rows", "seqlen_ro >= seqlen"],
        ),
        (
            (1, 4, 2, 8),
            (8, 5),
            (8, 5),
            {},
            ValueError,
            ["rotary_dim = 2 * cos.shape[-1] = 10", "headdim = 8"],
        ),
        ((1, 4, 2, 8), (8, 0), (8, 0), {}, ValueError, ["rotary_dim = 2 * cos.shape[-1] = 0"]),
        ((1, 4, 2, 8), (8, 4), (8, 3), {}, ValueError, ["sin must have the shape of cos"]),
        (
            (1, 4, 2, 8),
            (1, 8, 4),
            (1, 8, 4),
            {},
            ValueError,
            ["[seqlen_ro, rotary_dim / 2]", "numba_rope.rotary_embedding"],
        ),
        ((4, 2, 8), (8, 4), (8, 4), {}, ValueError, ["pass cu_seqlens="]),
        (
            (1, 4, 2, 8),
            (8, 4),
            (8, 4),
            {"cu_seqlens": np.array([0, 4])},
            ValueError,
            ["[total_seqlen, nheads, headdim]", "leave cu_seqlens=None"],
        ),
    ],
)
def test_bad_calls_raise_and_write_nothing(x_shape, cos_shape, sin_shape, keywords, error, words):
    x = np.ones(x_shape, np.float32)
    with pytest.raises(error) as raised:
        apply_rotary_emb(
            x,
            np.ones(cos_shape, np.float32),
            np.zeros(sin_shape, np.float32),
            inplace=True,
            **keywords,
        )
    for word in words:
        assert word in str(raised.value), str(raised.value)
    assert (x == 1).all()


@pytest.mark.parametrize(
    ("shape", "num_heads_q", "words"),
    [
        ((1, 2, 4, 2, 8), None, ["axis 2 has 4 entries, not 3"]),
        ((1, 2, 5, 8), None, ["needs num_heads_q="]),
        ((1, 2, 5, 8), 2, ["5 heads are not num_heads_q + 2 * num_heads_k", "num_heads_q=2"]),
        ((1, 2, 5, 8), 5, ["num_heads_k >= 1"]),
        ((2, 5, 8), None, ["3-D"]),
    ],
)
def test_bad_qkv_raise(shape, num_heads_q, words):
    qkv = np.ones(shape, np.float32)
    cos = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError) as raised:
        apply_rotary_emb_qkv_(qkv, cos, cos, num_heads_q=num_heads_q)
    for word in words:
        assert word in str(raised.value), str(raised.value)
    assert (qkv == 1).all()


def test_bad_kv_raises():
    with pytest.raises(ValueError, match=r"\[batch, seqlen, 2, nheads, headdim\]"):
        apply_rotary_emb_kv_(np.ones((1, 2, 3, 2, 8)), np.ones((4, 4)), np.ones((4, 4)))


# -- the array helpers with torch tensors (CPU) -----------------------------------------


def test_helpers_with_torch_tensors():
    torch = pytest.importorskip("torch")
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    host = _interop.to_host(cu)
    assert isinstance(host, np.ndarray) and host.tolist() == [0, 3, 5]
    moved = _interop.like(np.arange(4), cu)
    assert isinstance(moved, torch.Tensor) and moved.device == cu.device
    assert moved.tolist() == [0, 1, 2, 3]
    x = torch.zeros(3, 4)[:, :2]
    view = _interop.add_leading_axis(x)
    assert tuple(view.shape) == (1, 3, 2) and view.data_ptr() == x.data_ptr()


def test_integer_tensors_with_the_negative_bit_are_read_as_their_values(rng):
    """torch's negative bit (``torch._neg_view``) on ``cu_seqlens`` and
    ``seqlen_offsets``: their values are what the view reads (``.numpy()`` refuses such
    a tensor until it is resolved). The oracle: the same call on the resolved tensors'
    values as NumPy arrays, and flash-attn's arithmetic in float64."""
    torch = pytest.importorskip("torch")
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int64)
    x = rng.standard_normal((int(cu[-1]), 2, 8)).astype(np.float32)
    cos, sin = make_cos_sin(rng, 12, 8, np.float32)
    per_batch = np.array([4, 100, 7, 1])
    negated = {name: torch._neg_view(torch.from_numpy(-values)) for name, values in
               (("cu", cu), ("offsets", per_batch))}  # fmt: skip
    assert all(t.is_neg() for t in negated.values())
    got = apply_rotary_emb(
        torch.from_numpy(x),
        torch.from_numpy(cos),
        torch.from_numpy(sin),
        seqlen_offsets=negated["offsets"],
        cu_seqlens=negated["cu"],
        max_seqlen=max(LENGTHS),
    )
    want = apply_rotary_emb(
        x, cos, sin, seqlen_offsets=per_batch, cu_seqlens=cu, max_seqlen=max(LENGTHS)
    )
    assert_bitwise_equal(got.numpy(), want)
    assert_results(
        (np.asarray, np.asarray),
        want,
        varlen_oracle(x, cos, sin, cu, per_batch, False),
        varlen_contract(x, cos, sin, cu, per_batch, False),
        x,
        cos,
        sin,
    )


def test_read_only_inputs_of_in_place_forms_are_named_as_flash_attn_names_them(rng):
    """A read-only x with inplace=True, and a read-only qkv or kv (always rotated in
    place): refused by flash-attn's names, with its fix (inplace=False), not the
    operator's out=; nothing written. inplace=False reads a read-only x."""
    cos, sin = make_cos_sin(rng, 8, 8, np.float32)
    x = rng.standard_normal((2, 3, 2, 8)).astype(np.float32)
    frozen = x.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError) as raised:
        apply_rotary_emb(frozen, cos, sin, inplace=True)
    assert str(raised.value).startswith("x is a read-only array") and "inplace=False" in str(
        raised.value
    )
    packed = frozen[0]  # [total_seqlen, nheads, headdim]: the varlen form
    with pytest.raises(ValueError, match=r"^x is a read-only array"):
        apply_rotary_emb(packed, cos, sin, inplace=True, cu_seqlens=np.array([0, 1, 3]))
    assert_bitwise_equal(apply_rotary_emb(frozen, cos, sin), apply_rotary_emb(x, cos, sin))
    for form, name, shape in (
        (apply_rotary_emb_qkv_, "qkv", (2, 3, 3, 2, 8)),
        (apply_rotary_emb_kv_, "kv", (2, 3, 2, 2, 8)),
    ):
        values = np.ones(shape, np.float32)
        values.flags.writeable = False
        with pytest.raises(ValueError) as raised:
            form(values, cos, sin)
        message = str(raised.value)
        assert message.startswith(f"{name} is a read-only array") and "out" not in message
        assert (values == 1).all()
