"""numba_rope.vllm: vLLM's forms (one cos_sin_cache, flattened tokens, 1-D positions, the
in-place op and forward_native) on NumPy arrays and on GPU arrays (numba device arrays;
in the CUDA simulator without a GPU).

Oracles: :func:`vllm_native`, vLLM's ``RotaryEmbedding.forward_native`` arithmetic
(``index_select`` of the cache rows, ``chunk`` into cos and sin, the rotary part split in
halves or even/odd pairs, ``x1*cos - x2*sin`` and ``x2*cos + x1*sin``, the rest
concatenated) written here in float64 (vLLM cannot be installed), and
``numba_rope.reference.rotary_embedding`` with ``precision="contract"``, bit for bit,
on the same tokens rearranged by NumPy into the operator's ``bshd`` form.

Why the tolerance against the float64 oracle holds on every CPU: the results are first
asserted bit for bit equal to the float32 contract (IEEE ``+ - *`` one at a time, then
one rounding), whose distance from the exact value is at most 1.5 float32 units of the
terms' scale ``max|x| * (max|cos| + max|sin|)``, plus half a unit of the output format
for the final rounding; the float64 oracle rounded once is within half a unit too. Two
units of the output format at that scale bound the difference with room to spare. On a
real GPU ptxas may contract into FMA (more precise, one rounding less): the same bound
holds, and the contract comparison allows one unit.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from oracles import BFLOAT16, assert_bitwise_equal, ulp_of

import numba_rope
from numba_rope import reference, vllm

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BFLOAT16, np.dtype(np.float64)]


# -- the oracle: vLLM's forward_native, in float64 --------------------------------------


def vllm_native(positions, query, key, head_size, cos_sin_cache, is_neox_style):
    """vLLM's ``forward_native`` arithmetic in float64, rounded once to the query's
    dtype: new ``(query, key)``."""
    positions = np.asarray(positions).reshape(-1)
    num_tokens = positions.shape[0]
    rows = cos_sin_cache.astype(np.float64)[positions]  # index_select(0, positions)
    rotary_dim = cos_sin_cache.shape[1]
    cos, sin = rows[:, : rotary_dim // 2], rows[:, rotary_dim // 2 :]  # chunk(2, dim=-1)

    def rotate(x):
        shape = x.shape
        x = x.astype(np.float64).reshape(num_tokens, -1, head_size)
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        c, s = cos[:, None, :], sin[:, None, :]  # unsqueeze(-2)
        if is_neox_style:
            x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
        else:
            x1, x2 = rot[..., ::2], rot[..., 1::2]
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
        if is_neox_style:
            rotated = np.concatenate([o1, o2], axis=-1)
        else:
            rotated = np.stack([o1, o2], axis=-1).reshape(rot.shape)
        return np.concatenate([rotated, rest], axis=-1).reshape(shape)

    # Rounded to the output dtype (bfloat16: ml_dtypes 0.6 goes through float32, rounding
    # twice, a hair over half a unit: inside the two units allowed).
    out_q = rotate(query).astype(query.dtype)
    out_k = None if key is None else rotate(key).astype(key.dtype)
    return out_q, out_k


def contract(positions, x, head_size, cos_sin_cache, is_neox):
    """numba_rope.reference's float32 contract on ``x`` rearranged by NumPy into the
    operator's form ``[1, num_tokens, heads, head_size]`` (``[batch, seq, ...]`` for 2-D
    positions), back in ``x``'s shape."""
    positions = np.asarray(positions)
    ids = positions.reshape(1, -1) if positions.ndim == 1 else positions
    tokens = np.ascontiguousarray(x).reshape(*ids.shape, -1, head_size)
    half = cos_sin_cache.shape[1] // 2
    result = reference.rotary_embedding(
        tokens,
        np.ascontiguousarray(cos_sin_cache[:, :half]),
        np.ascontiguousarray(cos_sin_cache[:, half:]),
        ids,
        interleaved=not is_neox,
        rotary_embedding_dim=cos_sin_cache.shape[1],
        layout="bshd",
        precision="contract",
    )
    return result.reshape(x.shape)


def scale_of(x, cos_sin_cache):
    cache = np.abs(cos_sin_cache.astype(np.float64))
    return float(np.abs(x.astype(np.float64)).max(initial=0)) * 2 * float(cache.max(initial=0))


def assert_close_to_oracle(got, want, x, cos_sin_cache):
    """Within two units of the output format at the terms' scale (module docstring)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    atol = 2 * ulp_of(got.dtype) * scale_of(x, cos_sin_cache)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=0, atol=atol)


def assert_contract(device, got, want, x, cos_sin_cache):
    """Bit for bit, on every device."""
    assert_bitwise_equal(got, want)


def make_cache(max_position, rotary_dim, dtype):
    return vllm.make_cos_sin_cache(max_position, rotary_dim, dtype=dtype)


# -- every form: flat / per-head query and key, 1-D / 2-D positions ----------------------

# (positions shape, query form, key form, num_heads, num_kv_heads, head_size, rotary_dim)
FORMS = [
    ((5,), "flat", "flat", 4, 2, 8, 8),  # GQA, full rotary
    ((5,), "heads", "heads", 3, 3, 8, 4),  # partial rotary
    ((4,), "flat", "heads", 2, 1, 6, 6),  # mixed forms, MQA
    ((4,), "heads", None, 2, 0, 10, 6),  # no key
    ((2, 3), "flat", "flat", 2, 2, 8, 8),  # [batch, seq_len] positions
    ((2, 3), "heads", "flat", 3, 1, 4, 2),
]


def _tokens(rng, shape, form, heads, head_size, dtype):
    if form is None:
        return None
    full = (*shape, heads * head_size) if form == "flat" else (*shape, heads, head_size)
    return rng.standard_normal(full).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f"{f[0]}-{f[1]}-{f[2]}-rd{f[6]}")
def test_forward_native_matches_vllm_and_the_contract(rng, device, form, is_neox, dtype):
    on, off = device
    positions_shape, q_form, k_form, heads, kv_heads, head_size, rotary_dim = form
    cache = make_cache(16, rotary_dim, np.float32 if dtype == np.float64 else dtype)
    if dtype == np.float64:
        cache = cache.astype(np.float64)
    positions = rng.integers(0, 16, size=positions_shape)
    query = _tokens(rng, positions_shape, q_form, heads, head_size, dtype)
    key = _tokens(rng, positions_shape, k_form, kv_heads, head_size, dtype)
    query_before = query.copy()

    got_q, got_k = vllm.forward_native(
        on(positions), on(query), on(key), head_size, on(cache), is_neox
    )
    got_q = off(got_q)
    want_q, want_k = vllm_native(positions, query, key, head_size, cache, is_neox)
    assert_close_to_oracle(got_q, want_q, query, cache)
    assert_contract(
        device, got_q, contract(positions, query, head_size, cache, is_neox), query, cache
    )
    if key is None:
        assert got_k is None
    else:
        got_k = off(got_k)
        assert_close_to_oracle(got_k, want_k, key, cache)
        assert_contract(
            device, got_k, contract(positions, key, head_size, cache, is_neox), key, cache
        )
    assert_bitwise_equal(query, query_before)  # forward_native leaves its inputs alone


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BFLOAT16], ids=str)
def test_float32_cache_for_16_bit_tokens(rng, dtype):
    """vLLM's CUDA op reads a float32 cache into float32 for 16-bit tokens; so does
    numba_rope (rounded once at the end)."""
    cache = make_cache(32, 8, np.float32)
    positions = rng.integers(0, 32, size=6)
    query = rng.standard_normal((6, 3 * 8)).astype(dtype)
    got, _ = vllm.forward_native(positions, query, None, 8, cache, True)
    want, _ = vllm_native(positions, query, None, 8, cache, True)
    assert_close_to_oracle(got, want, query, cache)
    assert_bitwise_equal(got, contract(positions, query, 8, cache, True))


# -- in place: q and k as views of one fused qkv projection -----------------------------


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BFLOAT16], ids=str)
def test_in_place_on_views_of_a_fused_qkv(rng, device, dtype, is_neox):
    num_tokens, heads, kv_heads, head_size, rotary_dim = 5, 4, 2, 8, 6
    width = (heads + 2 * kv_heads) * head_size
    qkv = rng.standard_normal((num_tokens, width)).astype(dtype)
    q_cols, k_cols = heads * head_size, (heads + kv_heads) * head_size
    host_q, host_k = qkv[:, :q_cols], qkv[:, q_cols:k_cols]
    cache = make_cache(20, rotary_dim, np.float32)
    positions = rng.integers(0, 20, size=num_tokens)
    want_q, want_k = vllm_native(positions, host_q, host_k, head_size, cache, is_neox)
    contract_q = contract(positions, host_q, head_size, cache, is_neox)
    contract_k = contract(positions, host_k, head_size, cache, is_neox)
    v_before = qkv[:, k_cols:].copy()

    work = qkv.copy()
    base, q, k = device.views(work, work[:, :q_cols], work[:, q_cols:k_cols])
    assert (
        vllm.rotary_embedding(device.on(positions), q, k, head_size, device.on(cache), is_neox)
        is None
    )
    result = device.off(base)
    assert_close_to_oracle(result[:, :q_cols], want_q, host_q, cache)
    assert_close_to_oracle(result[:, q_cols:k_cols], want_k, host_k, cache)
    assert_contract(device, result[:, :q_cols], contract_q, host_q, cache)
    assert_contract(device, result[:, q_cols:k_cols], contract_k, host_k, cache)
    assert_bitwise_equal(result[:, k_cols:], v_before)  # v untouched


def test_in_place_per_head_form_and_no_key(rng, device):
    on, off = device
    query = rng.standard_normal((3, 2, 8)).astype(np.float32)
    cache = make_cache(8, 8, np.float32)
    positions = np.array([7, 0, 3])
    want = contract(positions, query, 8, cache, False)
    q = on(query.copy())
    vllm.rotary_embedding(on(positions), q, None, 8, on(cache), False)
    assert_contract(device, off(q), want, query, cache)


def test_the_module_form(rng):
    rope = vllm.RotaryEmbedding(8, 4, 64, 10000.0, True, np.float32)
    assert rope.cos_sin_cache.shape == (64, 4)
    positions = rng.integers(0, 64, size=7)
    query = rng.standard_normal((7, 3 * 8)).astype(np.float32)
    key = rng.standard_normal((7, 8)).astype(np.float32)
    new_q, new_k = rope.forward_native(positions, query, key)
    want_q, want_k = vllm_native(positions, query, key, 8, rope.cos_sin_cache, True)
    assert_close_to_oracle(new_q, want_q, query, rope.cos_sin_cache)
    assert_close_to_oracle(new_k, want_k, key, rope.cos_sin_cache)
    out_q, out_k = rope.forward(positions, query, key)
    assert out_q is query and out_k is key
    assert_bitwise_equal(query, new_q)
    assert_bitwise_equal(key, new_k)
    assert "rotary_dim=4" in repr(rope)


def test_make_cos_sin_cache_is_cos_then_sin():
    """Against cos/sin of position times vLLM's inverse frequencies, in float64: within
    float32's rounding of numbers at most 1 (half a unit, 2**-25) plus float64's libm
    (a few units of 2**-53 at these angles)."""
    max_position, rotary_dim, base = 40, 6, 500.0
    cache = vllm.make_cos_sin_cache(max_position, rotary_dim, base=base)
    assert cache.shape == (max_position, rotary_dim) and cache.dtype == np.float32
    inv_freq = 1.0 / base ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.arange(max_position)[:, None] * inv_freq[None, :]
    want = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1)
    np.testing.assert_allclose(cache, want, rtol=0, atol=2.0**-24)


# -- errors: the rule, the value, the fix; nothing written ------------------------------


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ({"cache": np.zeros((16, 7), np.float32)}, ValueError, ["rotary_dim = 7", "even"]),
        ({"cache": np.zeros((16,), np.float32)}, ValueError, ["2-D", "cos half"]),
        ({"cache": np.zeros((16, 10), np.float32)}, ValueError, ["exceeds head_size = 8"]),
        (
            {"query": np.zeros((4, 20), np.float32)},
            ValueError,
            ["multiple of head_size = 8", "(4, 20)"],
        ),
        ({"head_size": 0}, ValueError, ["positive"]),
        ({"head_size": 8.0}, TypeError, ["head_size"]),
        ({"positions": np.zeros(3, np.int64)}, ValueError, ["positions of shape (3,)", "(4, 24)"]),
        ({"positions": np.zeros((1, 1, 4), np.int64)}, ValueError, ["[num_tokens]"]),
        (
            {"key": np.zeros((4, 2, 6), np.float32)},
            ValueError,
            ["key's last axis", "head_size = 8"],
        ),
        ({"key": np.zeros((4, 12), np.float32)}, ValueError, ["key's last axis (12)"]),
        ({"is_neox": 1}, TypeError, ["bool"]),
        ({"positions": np.array([0, 1, 16, 2])}, IndexError, ["positions[2] = 16", "16 rows"]),
        ({"positions": np.array([0, -1, 2, 3])}, IndexError, ["positions[1] = -1", "[0, 15]"]),
        (
            {"cache": np.zeros((0, 8), np.float32)},
            IndexError,
            ["positions[0] = 0", "0 rows: no position is valid", "make_cos_sin_cache"],
        ),
        ({"positions": np.array([0.0, 1.0, 2.0, 3.0])}, TypeError, ["position_ids"]),
    ],
)
def test_bad_forms_raise_and_write_nothing(rng, change, error, words):
    args = {
        "positions": np.arange(4),
        "query": rng.standard_normal((4, 24)).astype(np.float32),
        "key": rng.standard_normal((4, 8)).astype(np.float32),
        "head_size": 8,
        "cache": make_cache(16, 8, np.float32),
        "is_neox": True,
    }
    args.update(change)
    before = args["query"].copy(), args["key"].copy()
    with pytest.raises(error) as raised:
        vllm.rotary_embedding(
            args["positions"],
            args["query"],
            args["key"],
            args["head_size"],
            args["cache"],
            args["is_neox"],
        )
    for word in words:
        assert word in str(raised.value)
    assert_bitwise_equal(args["query"], before[0])
    assert_bitwise_equal(args["key"], before[1])


@pytest.mark.gpu
def test_out_of_range_positions_on_the_gpu_raise_too(gpu):
    """GPU positions are checked by the operator's own check (one read-back)."""
    query = gpu.on(np.ones((4, 8), np.float32))
    with pytest.raises(IndexError, match="16"):
        vllm.rotary_embedding(
            gpu.on(np.array([0, 1, 16, 2])),
            query,
            None,
            8,
            gpu.on(make_cache(16, 8, np.float32)),
            True,
        )
    assert (gpu.off(query) == 1).all()


def test_read_only_query_or_key_is_named_as_vllm_names_it():
    """vLLM's in-place op on a read-only query or key: refused by its name, with the
    form that returns new arrays (the operator would name its own out_q), nothing
    written; forward_native takes read-only arrays."""
    cache = make_cache(16, 8, np.float32)
    positions = np.array([1, 2, 3])
    query, key = np.ones((3, 16), np.float32), np.ones((3, 8), np.float32)
    for name in ("query", "key"):
        arrays = {"query": query.copy(), "key": key.copy()}
        arrays[name].flags.writeable = False
        with pytest.raises(ValueError) as raised:
            vllm.rotary_embedding(positions, arrays["query"], arrays["key"], 8, cache, True)
        message = str(raised.value)
        assert message.startswith(f"{name} is a read-only array") and "out_q" not in message
        assert "forward_native" in message
        assert (arrays["query"] == 1).all() and (arrays["key"] == 1).all()
        got_q, got_k = vllm.forward_native(
            positions, arrays["query"], arrays["key"], 8, cache, True
        )
        assert_bitwise_equal(got_q, contract(positions, query, 8, cache, True))
        assert_bitwise_equal(got_k, contract(positions, key, 8, cache, True))


def test_2d_positions_out_of_range_name_their_place():
    positions = np.zeros((2, 3), np.int64)
    positions[1, 2] = 99
    with pytest.raises(IndexError, match=r"positions\[1, 2\] = 99") as raised:
        vllm.forward_native(
            positions, np.ones((2, 3, 8), np.float32), None, 8, make_cache(16, 8, np.float32), True
        )
    # Raised from None: not printed after the operator's error for the same position.
    assert raised.value.__suppress_context__ and raised.value.__cause__ is None


def test_module_refuses_a_rotary_dim_beyond_the_head():
    with pytest.raises(
        ValueError, match=r"rotary_dim must be even and lie in \[2, head_size = 8\]"
    ):
        vllm.RotaryEmbedding(8, 10, 64, 10000.0, True)


def test_equals_the_operator_on_the_same_tokens(rng):
    """The drop-in is the operator on views: equal, bit for bit, to rotary_embedding on a
    bshd copy with 2-D ids (the tokens as one sequence)."""
    query = rng.standard_normal((6, 2 * 8)).astype(np.float16)
    cache = make_cache(12, 8, np.float16)
    positions = rng.integers(0, 12, size=6)
    got, _ = vllm.forward_native(positions, query, None, 8, cache, False)
    want = numba_rope.rotary_embedding(
        query.reshape(1, 6, 2, 8),
        cache[:, :4].copy(),
        cache[:, 4:].copy(),
        positions[None],
        interleaved=True,
        layout="bshd",
    )
    assert_bitwise_equal(got, want.reshape(6, 16))


@pytest.mark.parametrize(
    ("positions_shape", "query_shape", "key_shape"),
    [
        ((2, 3), (6, 32), (6, 2, 8)),  # [batch, seq_len] positions, [num_tokens, ...] tokens
        ((6,), (2, 3, 32), (2, 3, 1, 8)),  # [num_tokens] positions, [batch, seq_len, ...]
        ((6,), (2, 3, 4, 8), None),
        # a decode step: seq_len 1, so the query's first axis has as many entries as
        # the positions (vLLM views it as [num_tokens, -1, head_size] all the same)
        ((3,), (3, 1, 4, 8), (3, 1, 1, 8)),
        ((3,), (3, 1, 32), (3, 1, 8)),
    ],
)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_forward_native_takes_positions_in_the_other_form(
    rng, positions_shape, query_shape, key_shape, is_neox
):
    """vLLM's forward_native flattens the positions and views the query as [num_tokens,
    -1, head_size], so it takes positions that list the tokens in the other form than
    the query does; the in-place op (as vLLM's CUDA op) does not."""
    cache = make_cache(16, 8, np.float32)
    positions = rng.integers(0, 16, positions_shape)
    query = rng.standard_normal(query_shape).astype(np.float32)
    key = None if key_shape is None else rng.standard_normal(key_shape).astype(np.float32)
    before = query.copy()
    got_q, got_k = vllm.forward_native(positions, query, key, 8, cache, is_neox)
    want_q, want_k = vllm_native(positions, query, key, 8, cache, is_neox)
    assert_close_to_oracle(got_q, want_q, query, cache)
    assert_bitwise_equal(got_q, contract(positions, query, 8, cache, is_neox))
    if key is None:
        assert got_k is None
    else:
        assert_close_to_oracle(got_k, want_k, key, cache)
        assert_bitwise_equal(got_k, contract(positions, key, 8, cache, is_neox))
    assert_bitwise_equal(query, before)
    # vLLM's in-place op takes positions in the query's form only: refused, naming the
    # positions' shape (a [num_tokens, num_heads] query: its last axis, not head_size).
    if query_shape == (3, 1, 32):
        message = re.escape("query's last axis must be head_size = 8, got shape (3, 1, 32)")
    else:
        message = re.escape(f"positions of shape {positions_shape},")
    with pytest.raises(ValueError, match=message):
        vllm.rotary_embedding(positions, query, key, 8, cache, is_neox)
    assert_bitwise_equal(query, before)


def test_positions_in_the_other_form_out_of_range_name_the_callers_place():
    positions = np.zeros(6, np.int64)
    positions[4] = 99
    with pytest.raises(IndexError, match=r"positions\[4\] = 99") as raised:
        vllm.forward_native(
            positions, np.ones((2, 3, 8), np.float32), None, 8, make_cache(16, 8, np.float32), True
        )
    assert raised.value.__suppress_context__ and raised.value.__cause__ is None


def test_query_and_key_in_different_token_forms_are_refused_by_name():
    """The positions are taken as the query's tokens; a key in the other form would
    need its own positions: refused, naming both shapes of the positions."""
    with pytest.raises(ValueError, match=r"positions of shape \(2, 3\) \(positions of shape"):
        vllm.forward_native(
            np.arange(6),
            np.ones((2, 3, 8), np.float32),
            np.ones((6, 8), np.float32),
            8,
            make_cache(16, 8, np.float32),
            True,
        )
