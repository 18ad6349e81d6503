"""Where arrays' elements lie (numba_rope._geometry): the tests that decide whether an
output may be written without copying. Each must be sound: never "distinct" or "apart"
for arrays that share a byte (checked against NumPy's exact ``np.shares_memory`` and
against the bytes themselves), and its compiled copy must agree with it."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from numba_rope._geometry import elements_distinct, token_rows_apart, token_rows_apart_jit


def _compiled_token_rows_apart(a, b):
    """The kernels' compiled copy, on the arrays' geometry."""
    return token_rows_apart_jit(
        a.ctypes.data, a.shape, a.strides, b.ctypes.data, b.shape, b.strides, a.itemsize
    )


@numba.njit
def _compiled_elements_distinct(shape, strides, itemsize):
    return elements_distinct(shape, strides, itemsize)


def _bytes_distinct(shape, strides, itemsize):
    """Whether no two elements share a byte, by listing every element's bytes."""
    starts = np.zeros(1, np.int64)
    for extent, stride in zip(shape, strides, strict=True):
        starts = (starts[:, None] + stride * np.arange(extent)[None, :]).reshape(-1)
    touched = (starts[:, None] + np.arange(itemsize)[None, :]).reshape(-1)
    return len(np.unique(touched)) == touched.size


def test_elements_distinct_is_sound(rng):
    seen = {True: 0, False: 0}
    for _ in range(3000):
        ndim = int(rng.integers(1, 5))
        shape = tuple(int(n) for n in rng.integers(1, 4, ndim))
        itemsize = int(rng.choice([1, 2, 4, 8]))
        strides = tuple(int(s) * itemsize for s in rng.integers(-7, 8, ndim))
        claimed = elements_distinct(shape, strides, itemsize)
        assert claimed == _compiled_elements_distinct(shape, strides, itemsize)
        if claimed:
            assert _bytes_distinct(shape, strides, itemsize), (shape, strides, itemsize)
        seen[claimed] += 1
    assert seen[True] > 100 and seen[False] > 100  # both answers were put to the test


def test_elements_distinct_of_ordinary_arrays():
    a = np.zeros((3, 4, 5, 6), np.float32)
    for view in (a, a.T, a[:, ::2], a[..., ::-1], a.transpose(0, 2, 1, 3), a[:, :, :1]):
        assert elements_distinct(view.shape, view.strides, view.itemsize)
    assert elements_distinct((0, 3), (0, 0), 4)  # empty: nothing to share
    assert not elements_distinct((2, 3), (4, 4), 4)
    assert not elements_distinct((2, 3), (0, 4), 4)


def _runs(rng, base, heads, head_size):
    """A random run of ``heads`` heads inside each token row of ``base`` [batch,
    seq_len, width] as a BHSD view (``bshd`` heads inside tokens), or, when ``base``
    is 4-D [batch, heads, seq_len, width], a random run of ``head_size`` channels of
    each row; tokens reversed at random."""
    width = base.shape[-1]
    if base.ndim == 4:
        start = int(rng.integers(0, width - head_size + 1))
        view = base[..., start : start + head_size]
        return view[:, :, ::-1] if rng.random() < 0.3 else view
    start = int(rng.integers(0, width - heads * head_size + 1))
    view = base[..., start : start + heads * head_size]
    view = view.reshape(*base.shape[:2], heads, head_size).transpose(0, 2, 1, 3)
    return view[:, :, ::-1] if rng.random() < 0.3 else view


@pytest.mark.parametrize("heads_inside", [True, False], ids=["bshd", "bhsd"])
def test_token_rows_apart_is_sound(rng, heads_inside):
    # Views of one buffer, as q and k of a fused qkv are, overlapping or not.
    proven = 0
    for _ in range(3000):
        batch, seq_len = (int(n) for n in rng.integers(1, 4, 2))
        head_size = int(rng.choice([1, 2, 4]))
        heads_a, heads_b = (int(n) for n in rng.integers(1, 4, 2))
        if heads_inside:
            width = int(rng.integers(max(heads_a, heads_b), heads_a + heads_b + 3)) * head_size
            shape = (batch, seq_len, width)
        else:
            heads_b = heads_a
            width = int(rng.integers(head_size, 2 * head_size + 3))
            shape = (batch, heads_a, seq_len, width)
        # Rows of the buffer a token apart, or closer (rows overlapping: blocks of
        # different tokens then meet).
        step = width if rng.random() < 0.5 else int(rng.integers(1, width + 1))
        strides = [4 * step, 4]  # the token axis, the channels
        for extent in reversed(shape[1:-1]):  # each outer axis steps over the next one
            strides.insert(0, strides[0] * extent)
        last = sum((n - 1) * stride for n, stride in zip(shape, strides, strict=True))
        buffer = np.zeros(last // 4 + 1, np.float32)
        base = np.lib.stride_tricks.as_strided(buffer, shape, strides)
        a = _runs(rng, base, heads_a, head_size)
        b = _runs(rng, base, heads_b, head_size)
        claimed = token_rows_apart(
            a.ctypes.data, a.shape, a.strides, b.ctypes.data, b.shape, b.strides, 4
        )
        assert claimed == _compiled_token_rows_apart(a, b)
        if claimed:
            assert not np.shares_memory(a, b)
            proven += 1
    assert proven > 300


@pytest.mark.parametrize("form", ["vllm", "flash-attn", "bhsd heads"])
def test_token_rows_apart_proves_q_and_k_of_a_fused_buffer(form):
    heads, kv_heads, head_size = 8, 2, 16
    if form == "vllm":
        qkv = np.zeros((1, 5, (heads + 2 * kv_heads) * head_size), np.float32)
        q = qkv[..., : heads * head_size].reshape(1, 5, heads, head_size)
        k = qkv[..., heads * head_size : (heads + kv_heads) * head_size]
        k = k.reshape(1, 5, kv_heads, head_size)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    elif form == "flash-attn":
        qkv = np.zeros((2, 5, 3, heads, head_size), np.float32)
        q, k = qkv[:, :, 0].transpose(0, 2, 1, 3), qkv[:, :, 1].transpose(0, 2, 1, 3)
    else:  # one head per token row: [batch, heads, seq, 2 * head_size] split in two
        qk = np.zeros((2, heads, 5, 2 * head_size), np.float32)
        q, k = qk[..., :head_size], qk[..., head_size:]
    assert token_rows_apart(
        q.ctypes.data, q.shape, q.strides, k.ctypes.data, k.shape, k.strides, q.itemsize
    )
    assert _compiled_token_rows_apart(q, k)
    # One element more for q, and the runs meet.
    wide = np.zeros((1, 5, 3 * head_size + 1), np.float32)
    q = wide[..., : head_size + 1][..., None, :].transpose(0, 2, 1, 3)
    k = wide[..., head_size : 2 * head_size + 1][..., None, :].transpose(0, 2, 1, 3)
    assert not token_rows_apart(
        q.ctypes.data, q.shape, q.strides, k.ctypes.data, k.shape, k.strides, 4
    )
