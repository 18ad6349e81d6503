"""Property tests: random shapes, strides, values and positions."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import DTYPES, assert_bitwise_equal, float32_contract

import numba_rope
from numba_rope import reference

settings.register_profile("numba_rope", deadline=None, max_examples=60, derandomize=True)
settings.load_profile("numba_rope")


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from(DTYPES))
    batch = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 4))
    seq_len = draw(st.integers(1, 6))
    pairs = draw(st.integers(1, 12))
    head_size = 2 * pairs + draw(st.integers(0, 3))
    rotary_dim = 2 * draw(st.integers(1, pairs))
    if rotary_dim == head_size and draw(st.booleans()):
        rotary_dim = 0
    interleaved = draw(st.booleans())
    with_ids = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    # A larger parent array, then a view with random steps and flips on each axis.
    steps = [draw(st.sampled_from([1, 2, -1, -2])) for _ in range(4)]
    parent_shape = [
        n * abs(step) for n, step in zip((batch, heads, seq_len, head_size), steps, strict=True)
    ]
    parent = (rng.standard_normal(parent_shape) * draw(st.sampled_from([1e-3, 1.0, 300.0]))).astype(
        dtype
    )
    x = parent[tuple(slice(None, None, step) for step in steps)]
    if draw(st.booleans()):
        x = np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    half = (rotary_dim or head_size) // 2
    if with_ids:
        n_positions = draw(st.integers(1, 20))
        ids = rng.integers(0, n_positions, size=(batch, seq_len))
        angles = rng.uniform(-10, 10, size=(n_positions, half))
    else:
        ids = None
        angles = rng.uniform(-10, 10, size=(batch, seq_len, half))
    cache_dtype = draw(st.sampled_from([dtype, np.dtype(np.float32)]))
    if dtype == np.float32:
        cache_dtype = dtype
    cos = np.cos(angles).astype(cache_dtype)
    sin = np.sin(angles).astype(cache_dtype)
    return x, cos, sin, ids, interleaved, rotary_dim


@given(problems())
def test_random_problems_match_contract_and_reference(problem):
    x, cos, sin, ids, interleaved, rotary_dim = problem
    got = numba_rope.rotary_embedding(
        x, cos, sin, ids, interleaved=interleaved, rotary_embedding_dim=rotary_dim
    )
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids, interleaved, rotary_dim))
    want = reference.rotary_embedding(
        x, cos, sin, ids, interleaved=interleaved, rotary_embedding_dim=rotary_dim
    ).astype(np.float64)
    eps = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
    tolerance = 4 * eps[x.dtype.name] * (2 * np.abs(x.astype(np.float64)).max() + 1e-30)
    assert (
        np.abs(got.astype(np.float64) - want).max()
        <= tolerance + np.abs(want).max() * eps[x.dtype.name]
    )


@given(problems())
def test_rotation_preserves_each_pair_norm(problem):
    x, cos, sin, ids, interleaved, rotary_dim = problem
    # Unit-norm rotation caches in float64 arithmetic: the only error left is rounding.
    got = numba_rope.rotary_embedding(
        x, cos, sin, ids, interleaved=interleaved, rotary_embedding_dim=rotary_dim
    ).astype(np.float64)
    rd = rotary_dim or x.shape[3]
    x64 = x.astype(np.float64)
    if interleaved:
        pairs_in = (x64[..., 0:rd:2], x64[..., 1:rd:2])
        pairs_out = (got[..., 0:rd:2], got[..., 1:rd:2])
    else:
        pairs_in = (x64[..., : rd // 2], x64[..., rd // 2 : rd])
        pairs_out = (got[..., : rd // 2], got[..., rd // 2 : rd])
    norm_in = np.hypot(*pairs_in)
    norm_out = np.hypot(*pairs_out)
    # cos^2 + sin^2 of the rounded caches is 1 within a few units of the cache format.
    eps = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
    rel = 8 * max(eps[x.dtype.name], eps[cos.dtype.name])
    assert np.all(np.abs(norm_out - norm_in) <= rel * norm_in + 1e-300)
    np.testing.assert_array_equal(got[..., rd:], x64[..., rd:])


@given(problems())
def test_identity_caches_give_identity(problem):
    x, cos, sin, ids, interleaved, rotary_dim = problem
    ones = np.ones_like(cos)
    zeros = np.zeros_like(sin)
    got = numba_rope.rotary_embedding(
        x, ones, zeros, ids, interleaved=interleaved, rotary_embedding_dim=rotary_dim
    )
    assert_bitwise_equal(got, np.ascontiguousarray(x))
