"""Property tests over classes of unusual but legal arrays: byte orders, zero and
negative strides, outputs whose elements overlap, non-contiguous views, zero-size axes,
any integer dtype of position ids. Each call either equals the float32-contract oracle
bit for bit (tests/oracles.py, which shares no code with the kernels), or is refused
with the stated exception, and then writes nothing.

The examples of issue 14 (big-endian 16-bit input, a zero-stride ``out``, in place on
rows that overlap) are members of these classes; the strategies draw others.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import BFLOAT16, DTYPES, assert_bitwise_equal, float32_contract

import numba_rope

settings.register_profile("unusual", deadline=None, max_examples=80, derandomize=True)

ID_DTYPES = [np.int64, np.int32, np.int16, np.uint8, np.uint32, np.uint64]


def _view(draw, rng, shape, dtype, *, zero_stride_ok: bool):
    """An array of ``shape`` drawn as a view: steps and flips on each axis, perhaps a
    zero stride (a broadcast axis), perhaps the other byte order."""
    steps = [draw(st.sampled_from([1, 2, -1, -3])) for _ in shape]
    parent = rng.standard_normal([max(1, n) * abs(s) for n, s in zip(shape, steps, strict=True)])
    view = parent.astype(dtype)[
        tuple(slice(None, n * s if s > 0 else None, s) for n, s in zip(shape, steps, strict=True))
    ]
    view = view[tuple(slice(0, n) for n in shape)]
    if zero_stride_ok and draw(st.booleans()) and len(shape) == 4 and shape[1] > 0:
        view = np.broadcast_to(view[:, :1], shape)
    if draw(st.integers(0, 5)) == 0:
        view = view.astype(view.dtype.newbyteorder("S"))  # same values, other byte order
    return view


@st.composite
def calls(draw):
    dtype = draw(st.sampled_from(DTYPES))
    batch, heads, seq_len = (draw(st.integers(0 if i == 1 else 1, 3)) for i in range(3))
    if draw(st.integers(0, 7)) == 0:
        seq_len = 0
    pairs = draw(st.integers(1, 6))
    head_size = 2 * pairs + draw(st.integers(0, 2))
    rotary_dim = 2 * draw(st.integers(1, pairs))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = (batch, heads, seq_len, head_size)
    x = _view(draw, rng, shape, dtype, zero_stride_ok=True)
    n_positions = seq_len + 5
    cache_dtype = dtype if dtype.itemsize != 2 or draw(st.booleans()) else np.dtype(np.float32)
    cos = _view(draw, rng, (n_positions, rotary_dim // 2), cache_dtype, zero_stride_ok=False)
    sin = _view(draw, rng, (n_positions, rotary_dim // 2), cache_dtype, zero_stride_ok=False)
    ids = rng.integers(0, n_positions, (batch, seq_len)).astype(draw(st.sampled_from(ID_DTYPES)))
    if draw(st.integers(0, 5)) == 0:
        ids = ids.astype(ids.dtype.newbyteorder("S"))
    out_kind = draw(
        st.sampled_from(["new", "fresh", "view", "in place", "zero stride", "rows overlap"])
    )
    return {
        "x": x, "cos": cos, "sin": sin, "ids": ids, "rotary_dim": rotary_dim,
        "interleaved": draw(st.booleans()), "out_kind": out_kind,
    }  # fmt: skip


def _out(call):
    x, kind = call["x"], call["out_kind"]
    if kind == "new":
        return None
    if kind == "fresh":
        return np.full(x.shape, 7, x.dtype)
    if kind == "view":  # every other element of a larger buffer, last axis flipped
        return np.full((*x.shape[:-1], 2 * x.shape[-1]), 7, x.dtype)[..., ::-2]
    if kind == "in place":
        return x
    if kind == "zero stride":
        return np.lib.stride_tricks.as_strided(
            np.full(x.shape[-1], 7, x.dtype), x.shape, (0, 0, 0, x.itemsize)
        )
    buffer = np.full(x.size + x.shape[-1], 7, x.dtype)  # consecutive rows overlap by one
    *_, head = x.shape
    return np.lib.stride_tricks.as_strided(
        buffer,
        x.shape,
        (x.shape[1] * x.shape[2] * (head - 1) * x.itemsize, x.shape[2] * (head - 1) * x.itemsize,
         (head - 1) * x.itemsize, x.itemsize),
    )  # fmt: skip


def _expected_refusal(call, out):
    """The exception a call must raise, or None if it must succeed."""
    arrays = (call["x"], call["cos"], call["sin"], call["ids"], out)
    if any(a is not None and not a.dtype.isnative for a in arrays):
        return TypeError, "non-native byte order"
    if out is not None and not out.flags.writeable:  # a broadcast input, in place
        return ValueError, "read-only"
    if out is not None and _elements_overlap(out):
        return ValueError, "share memory"
    return None


def _elements_overlap(a: np.ndarray) -> bool:
    """Whether two elements of ``a`` share memory, by brute force over their addresses
    (independent of the library's stride test)."""
    if a.size == 0:
        return False
    offsets = np.zeros(1, np.int64)
    for n, stride in zip(a.shape, a.strides, strict=True):
        offsets = (offsets[:, None] + np.arange(n) * stride).ravel()
    starts = np.sort(offsets)
    return bool((np.diff(starts) < a.itemsize).any())


@settings(settings.get_profile("unusual"))
@given(calls())
def test_unusual_arrays_are_rotated_exactly_or_refused_clearly(call):
    out = _out(call)
    before = None if out is None or not out.flags.writeable else out.copy()
    refusal = _expected_refusal(call, out)
    arguments = (call["x"], call["cos"], call["sin"], call["ids"])
    options = {"rotary_embedding_dim": call["rotary_dim"], "interleaved": call["interleaved"]}
    if refusal is not None:
        error, fragment = refusal
        with pytest.raises(error, match=fragment):
            numba_rope.rotary_embedding(*arguments, out=out, **options)
        if before is not None:
            assert_bitwise_equal(out, before)  # nothing written
        return
    native = [np.array(a, order="C") for a in arguments]  # copies: in place changes x
    want = float32_contract(*native, call["interleaved"], call["rotary_dim"])
    for _ in range(2):  # the general path, then the remembered plan of the signature
        if call["out_kind"] == "in place":  # rotates the input itself: start from it again
            call["x"][...] = native[0]
        got = numba_rope.rotary_embedding(*arguments, out=out, **options)
        assert got is out or out is None
        assert_bitwise_equal(np.asarray(got), want)


# -- memory orders: rows whose channels lie far apart ---------------------------------------


def _laid_out(a: np.ndarray, order: tuple[int, ...]) -> tuple[np.ndarray, Callable[[], np.ndarray]]:
    """``(view, rest)``: ``a`` copied into a buffer of 7s whose axes lie in memory in
    ``order`` (outermost first), its innermost axis padded to 520 elements so that the
    next axis out is at least 1 KiB away (channels anywhere but innermost then lie as far
    apart as the kernels' orders of heads or tokens inside need, ``INSIDE_MIN_STEP``),
    and a function giving the buffer's elements outside the view."""
    shape = [a.shape[i] for i in order]
    shape[-1] = 520
    buffer = np.full(shape, 7, a.dtype)
    region = tuple(slice(0, a.shape[i]) for i in order)
    view = buffer[region].transpose(np.argsort(order))
    view[...] = a
    outside = np.ones(shape, bool)
    outside[region] = False
    return view, lambda: buffer[outside]


def _storage(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.itemsize == 2 else a


#: Options of the memory-order test by dtype: interleaved, rotary_dim (of 10 channels),
#: inverse. One set each: every set is a kernel to compile per kind of call (2-3 s).
ORDER_OPTIONS = {
    np.dtype(np.float32): (False, 8, False),
    np.dtype(np.float16): (True, 10, True),
    BFLOAT16: (True, 8, False),
    np.dtype(np.float64): (False, 10, True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_memory_order_is_rotated_exactly(rng, dtype):
    """The input, the output and a second tensor in each of the 24 orders of their axes
    in memory (Fortran order among them), with large steps: out=, in place, allocated,
    and q and k in other orders, equal the contract bit for bit and leave the rest of
    their buffers alone. Rows whose channels are not innermost are rotated pair by pair
    over heads or tokens (``kernels.strided_order``); every order is taken."""
    from itertools import permutations

    from numba_rope._cpu.kernels import strided_order

    shape = (2, 3, 4, 10)
    x = rng.standard_normal(shape).astype(dtype)
    k = rng.standard_normal((2, 1, 4, 10)).astype(dtype)
    cos_all = rng.standard_normal((9, 5)).astype(dtype)
    sin_all = rng.standard_normal((9, 5)).astype(dtype)
    ids = rng.integers(0, 9, (2, 4))
    interleaved, rotary_dim, inverse = ORDER_OPTIONS[dtype]
    options = {"interleaved": interleaved, "rotary_embedding_dim": rotary_dim}
    half = rotary_dim // 2  # C-contiguous caches: fewer kinds of arrays to compile for
    cos, sin = cos_all[:, :half].copy(), sin_all[:, :half].copy()
    signed = -sin if inverse else sin  # the inverse rotates by -sin, exactly
    want = float32_contract(x, cos, signed, ids, interleaved, rotary_dim)
    want_k = float32_contract(k, cos, signed, ids, interleaved, rotary_dim)
    orders = list(permutations(range(4)))
    taken = set()
    for n, order in enumerate(orders):
        view, view_rest = _laid_out(x, order)
        out, out_rest = _laid_out(np.zeros_like(x), orders[-1 - n])
        taken.add(int(strided_order(_storage(view), _storage(out))))
        got = numba_rope.rotary_embedding(view, cos, sin, ids, out=out, inverse=inverse, **options)
        assert got is out
        assert_bitwise_equal(out, want)
        assert_bitwise_equal(view, x)
        allocated = numba_rope.rotary_embedding(view, cos, sin, ids, inverse=inverse, **options)
        assert_bitwise_equal(allocated, want)
        numba_rope.rotary_embedding(view, cos, sin, ids, out=view, inverse=inverse, **options)
        assert_bitwise_equal(view, want)
        kview, k_rest = _laid_out(k, orders[(n + 5) % len(orders)])
        view[...] = x
        q_out, k_out = numba_rope.rotary_embedding_qk(
            view, kview, cos, sin, ids, out_q=view, out_k=kview, inverse=inverse, **options
        )
        assert q_out is view and k_out is kview
        assert_bitwise_equal(view, want)
        assert_bitwise_equal(kview, want_k)
        for rest in (view_rest, out_rest, k_rest):
            assert (rest().astype(np.float64) == 7).all()
    assert taken == {0, 1, 2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BFLOAT16], ids=str)
def test_every_memory_order_is_rotated_exactly_on_the_gpu(rng, gpu, dtype):
    """The GPU's kernels, given device views in each of the 24 memory orders (the same
    padded buffers as on the CPU): allocated and in place, the contract bit for bit, and
    the rest of the device buffer untouched."""
    from itertools import permutations

    x = rng.standard_normal((2, 3, 4, 10)).astype(dtype)
    cos = rng.standard_normal((9, 4)).astype(dtype)
    sin = rng.standard_normal((9, 4)).astype(dtype)
    ids = rng.integers(0, 9, (2, 4))
    options = {"interleaved": True, "rotary_embedding_dim": 8}
    caches = (gpu.on(cos), gpu.on(sin), gpu.on(ids))
    want = float32_contract(x, cos, sin, ids, True, 8)
    for order in permutations(range(4)):
        view, _ = _laid_out(x, order)
        buffer = view.base
        while buffer.base is not None:
            buffer = buffer.base
        device_buffer, device_view = gpu.views(buffer, view)
        got = gpu.off(numba_rope.rotary_embedding(device_view, *caches, **options))
        gpu.assert_contract(got, x, cos, sin, ids, True, 8)
        numba_rope.rotary_embedding(device_view, *caches, out=device_view, **options)
        after = gpu.off(device_buffer)
        region = tuple(slice(0, x.shape[i]) for i in order)
        assert_bitwise_equal(after[region].transpose(np.argsort(order)), want)
        outside = np.ones(after.shape, bool)
        outside[region] = False
        assert (after[outside].astype(np.float64) == 7).all()
