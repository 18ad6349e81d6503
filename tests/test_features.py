"""Beyond the operator: layouts, 3-D input, position offsets, the inverse rotation and
fused q+k, on the CPU and on GPU arrays (a GPU, or numba's CUDA simulator)."""

from __future__ import annotations

import numpy as np
import pytest
from oracles import BFLOAT16, DTYPES, assert_bitwise_equal, float32_contract, make_case

import numba_rope
from numba_rope import reference

DTYPE_IDS = [d.name for d in DTYPES]


def contract_bhsd(x_bhsd, cos, sin, ids=None, interleaved=False, rotary_dim=0, inverse=False):
    return float32_contract(x_bhsd, cos, -sin if inverse else sin, ids, interleaved, rotary_dim)


def bshd(a):
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3))


# -- layout="bshd" and 3-D input ------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("with_ids", [True, False])
def test_bshd_equals_transpose_rotate_transpose(rng, device, dtype, interleaved, with_ids):
    on, off = device
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 8), dtype, position_ids=with_ids, rotary_dim=6)
    got = numba_rope.rotary_embedding(
        on(bshd(x)),
        on(cos),
        on(sin),
        on(ids),
        layout="bshd",
        interleaved=interleaved,
        rotary_embedding_dim=6,
    )
    got = off(got)
    assert got.shape == (2, 4, 3, 8)
    assert_bitwise_equal(got, bshd(contract_bhsd(x, cos, sin, ids, interleaved, 6)))
    want = reference.rotary_embedding(
        x, cos, sin, ids, interleaved=interleaved, rotary_embedding_dim=6
    )
    np.testing.assert_allclose(
        got.astype(np.float64), bshd(want).astype(np.float64), rtol=0, atol=0.02
    )


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=str)
def test_bshd_out_and_in_place(rng, device, dtype):
    on, off = device
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 8), dtype)
    want = bshd(contract_bhsd(x, cos, sin, ids))
    buffer = on(bshd(x))
    result = numba_rope.rotary_embedding(
        buffer, on(cos), on(sin), on(ids), layout="bshd", out=buffer
    )
    assert result is buffer
    assert_bitwise_equal(off(buffer), want)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=str)
def test_in_place_through_another_view_of_the_input(rng, device, dtype):
    # out= another array over the input's very elements (two views of one buffer entry,
    # partial rotary, interleaved): the entry holds the contract's rotation, its
    # channels past rotary_dim and the buffer's other entries stay as they were.
    _, cos, sin, ids = make_case(rng, (2, 4, 3, 16), dtype, rotary_dim=8)
    host = rng.standard_normal((3, 2, 4, 3, 16)).astype(dtype)
    before = host.copy()
    base, x, out = device.views(host, host[1], host[1])
    on = device.on
    options = {"rotary_embedding_dim": 8, "interleaved": True}
    result = numba_rope.rotary_embedding(x, on(cos), on(sin), on(ids), out=out, **options)
    assert result is out
    got = device.off(base)
    device.assert_contract(got[1], before[1], cos, sin, ids, interleaved=True, rotary_dim=8)
    assert np.array_equal(got[1][..., 8:], before[1][..., 8:])
    assert np.array_equal(got[[0, 2]], before[[0, 2]])


def test_3d_equals_reshaped_4d_including_strided_views(rng):
    batch, heads, seq_len, head_size = 2, 3, 5, 8
    x, cos, sin, ids = make_case(rng, (batch, heads, seq_len, head_size), np.float32)
    hidden = heads * head_size
    fused = np.zeros((batch, seq_len, 3 * hidden), np.float32)
    fused[..., hidden : 2 * hidden] = bshd(x).reshape(batch, seq_len, hidden)
    x3 = fused[..., hidden : 2 * hidden]  # a strided 3-D view (a slice of a fused qkv)
    want = bshd(contract_bhsd(x, cos, sin, ids)).reshape(batch, seq_len, hidden)
    got = numba_rope.rotary_embedding(x3, cos, sin, ids, num_heads=heads)
    assert got.shape == (batch, seq_len, hidden)
    assert_bitwise_equal(got, want)
    numba_rope.rotary_embedding(x3, cos, sin, ids, num_heads=heads, out=x3)  # in place
    assert_bitwise_equal(fused[..., hidden : 2 * hidden], want)
    assert not fused[..., :hidden].any() and not fused[..., 2 * hidden :].any()


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=str)
def test_3d_on_gpu_arrays_and_cpu_agree(rng, device, dtype):
    on, off = device
    x, cos, sin, ids = make_case(rng, (2, 2, 3, 4), dtype)
    x3 = bshd(x).reshape(2, 3, 8)
    got = off(numba_rope.rotary_embedding(on(x3), on(cos), on(sin), on(ids), num_heads=2))
    assert_bitwise_equal(got, bshd(contract_bhsd(x, cos, sin, ids)).reshape(2, 3, 8))


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"layout": "sbhd"}, ValueError, r"layout must be one of \('bhsd', 'bshd'\), got 'sbhd'"),
        ({"num_heads": 4}, ValueError, "num_heads=4 contradicts"),
        ({"num_heads": 2.0}, TypeError, "num_heads must be a positive integer"),
    ],
)
def test_layout_errors(rng, kwargs, error, fragment):
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 8), np.float32)
    with pytest.raises(error, match=fragment):
        numba_rope.rotary_embedding(x, cos, sin, ids, **kwargs)


def test_3d_errors(rng):
    x3 = np.zeros((2, 4, 12), np.float32)
    cache = np.zeros((8, 2), np.float32)
    with pytest.raises(ValueError, match="not a multiple of num_heads=5"):
        numba_rope.rotary_embedding(x3, cache, cache, np.zeros((2, 4), np.int64), num_heads=5)
    with pytest.raises(ValueError, match="needs num_heads="):
        numba_rope.rotary_embedding(x3, cache, cache, np.zeros((2, 4), np.int64))


# -- position_offset --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["int", "array", "0-d array"])
def test_position_offset_equals_the_ids_it_stands_for(rng, device, dtype, kind):
    """An int, a [batch] array, or a 0-d array (on the GPU a 0-d device array, read
    back: it has no int())."""
    on, off = device
    x, cos, sin, _ = make_case(rng, (3, 2, 4, 8), dtype, n_positions=12)
    offset = {"int": 6, "array": np.array([0, 5, 8]), "0-d array": np.array(6)}[kind]
    ids = np.asarray(offset).reshape(-1, 1) + np.arange(4)
    ids = np.broadcast_to(ids, (3, 4)).copy()
    got = off(numba_rope.rotary_embedding(on(x), on(cos), on(sin), position_offset=on(offset)))
    assert_bitwise_equal(got, contract_bhsd(x, cos, sin, ids))


@pytest.mark.parametrize("offset_dtype", [np.int32, np.uint8, np.int64])
def test_position_offset_dtypes_and_numpy_scalars(rng, offset_dtype):
    x, cos, sin, _ = make_case(rng, (2, 1, 3, 4), np.float32, n_positions=9)
    ids = np.array([[4, 5, 6], [4, 5, 6]])
    want = contract_bhsd(x, cos, sin, ids)
    scalar = numba_rope.rotary_embedding(x, cos, sin, position_offset=offset_dtype(4))
    array = numba_rope.rotary_embedding(x, cos, sin, position_offset=np.array([4, 4], offset_dtype))
    assert_bitwise_equal(scalar, want)
    assert_bitwise_equal(array, want)


@pytest.mark.parametrize(
    ("offset", "error", "fragment"),
    [
        (7, IndexError, r"position_offset = 7 puts positions 7\.\.10 .* \[0, 6\]"),
        (-1, IndexError, r"position_offset = -1 puts"),
        (np.array([0, 7]), IndexError, r"position_offset\[1\] = 7 puts positions 7\.\.10"),
        (np.array([2**64 - 1, 0], np.uint64), IndexError, str(2**64 - 1)),
        (2**70, IndexError, str(2**70)),
        (2.0, TypeError, "position_offset must be an integer"),
        (True, TypeError, "position_offset must be an integer"),
        (np.array([1.0, 2.0]), TypeError, "got dtype float64"),
        (np.array([1, 2, 3]), ValueError, r"shape \[batch\] = \(2,\), got shape \(3,\)"),
    ],
    ids=[
        "past end",
        "negative",
        "array",
        "uint64",
        "beyond int64",
        "float",
        "bool",
        "float array",
        "shape",
    ],
)
def test_position_offset_errors_write_nothing(rng, device, offset, error, fragment):
    on, off = device
    x, cos, sin, _ = make_case(rng, (2, 1, 4, 4), np.float32, n_positions=10)
    out = on(np.full(x.shape, 7.0, np.float32))
    offset = on(offset) if isinstance(offset, np.ndarray) else offset
    with pytest.raises(error, match=fragment):
        numba_rope.rotary_embedding(on(x), on(cos), on(sin), position_offset=offset, out=out)
    assert (off(out) == 7.0).all()


def test_position_offset_with_ids_or_3d_caches_is_refused(rng):
    x, cos, sin, ids = make_case(rng, (2, 1, 4, 4), np.float32)
    with pytest.raises(ValueError, match="not both"):
        numba_rope.rotary_embedding(x, cos, sin, ids, position_offset=0)
    with pytest.raises(ValueError, match="caches must be 2-D"):
        numba_rope.rotary_embedding(x, cos[ids], sin[ids], position_offset=0)


@pytest.mark.gpu
def test_unchecked_bad_offsets_give_nan_rows_on_the_gpu(rng, gpu):
    on, off = gpu
    x, cos, sin, _ = make_case(rng, (2, 1, 4, 4), np.float32, n_positions=6)
    got = off(
        numba_rope.rotary_embedding(
            on(x), on(cos), on(sin), position_offset=on(np.array([1, 4])), check_position_ids=False
        )
    )
    ids = np.array([[1, 2, 3, 4]])
    assert_bitwise_equal(got[:1], contract_bhsd(x[:1], cos, sin, ids))
    # offset 4: positions 4, 5 exist, 6 and 7 do not (NaN rows, the caches never read)
    assert_bitwise_equal(
        got[1, :, :2], contract_bhsd(x[1:], cos, sin, np.array([[4, 5, 4, 5]]))[0, :, :2]
    )
    assert np.isnan(got[1, :, 2:]).all()
    # An offset no int64 holds is refused even unchecked: the kernel could not take it.
    with pytest.raises(IndexError, match=str(2**70)):
        numba_rope.rotary_embedding(
            on(x), on(cos), on(sin), position_offset=2**70, check_position_ids=False
        )


# -- inverse ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_inverse_is_rotation_by_the_negative_angle(rng, device, dtype, interleaved):
    on, off = device
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 8), dtype, rotary_dim=6)
    got = off(
        numba_rope.rotary_embedding(
            on(x),
            on(cos),
            on(sin),
            on(ids),
            inverse=True,
            interleaved=interleaved,
            rotary_embedding_dim=6,
        )
    )
    assert_bitwise_equal(got, contract_bhsd(x, cos, sin, ids, interleaved, 6, inverse=True))
    want = reference.rotary_embedding(
        x, cos, -sin, ids, interleaved=interleaved, rotary_embedding_dim=6
    )
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=0, atol=0.05)


@pytest.mark.parametrize(("dtype", "tolerance"), [(np.float64, 1e-14), (np.float32, 3e-6)], ids=str)
def test_inverse_round_trips(rng, dtype, tolerance):
    cos, sin = numba_rope.rope_cache(64, 16, dtype=dtype)
    x = rng.standard_normal((2, 3, 10, 16)).astype(dtype)
    ids = rng.integers(0, 64, (2, 10))
    rotated = numba_rope.rotary_embedding(x, cos, sin, ids)
    back = numba_rope.rotary_embedding(rotated, cos, sin, ids, inverse=True)
    np.testing.assert_allclose(back, x, rtol=0, atol=tolerance * np.abs(x).max())
    assert not np.allclose(rotated, x)


def test_inverse_must_be_bool(rng):
    x, cos, sin, ids = make_case(rng, (1, 1, 2, 4), np.float32)
    with pytest.raises(TypeError, match="inverse must be True or False"):
        numba_rope.rotary_embedding(x, cos, sin, ids, inverse=1)


# -- fused q and k ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("positions", ["ids", "offset", "none"])
def test_qk_equals_two_calls_with_fewer_kv_heads(rng, device, dtype, positions):
    on, off = device
    q, cos, sin, ids = make_case(
        rng, (2, 4, 3, 8), dtype, position_ids=positions != "none", rotary_dim=6
    )
    k = rng.standard_normal((2, 2, 3, 8)).astype(dtype)
    kwargs = {"interleaved": True, "rotary_embedding_dim": 6, "inverse": positions == "none"}
    if positions == "offset":
        kwargs["position_offset"], ids = 2, None
    got_q, got_k = numba_rope.rotary_embedding_qk(on(q), on(k), on(cos), on(sin), on(ids), **kwargs)
    for got, x in ((got_q, q), (got_k, k)):
        alone = numba_rope.rotary_embedding(on(x), on(cos), on(sin), on(ids), **kwargs)
        assert_bitwise_equal(off(got), off(alone))
    want_ids = np.array([[2, 3, 4]] * 2) if positions == "offset" else ids
    assert_bitwise_equal(
        off(got_k), contract_bhsd(k, cos, sin, want_ids, True, 6, kwargs["inverse"])
    )


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_qk_in_place_on_views_of_one_fused_qkv(rng, device, layout):
    on, off = device
    heads, head = 3, 8
    qkv = rng.standard_normal((2, 5, heads, 3 * head)).astype(np.float32)  # bshd
    if layout == "bhsd":
        qkv = np.ascontiguousarray(qkv.transpose(0, 2, 1, 3))
    cos, sin = numba_rope.rope_cache(16, head)
    expected = [
        numba_rope.rotary_embedding(
            qkv[..., i * head : (i + 1) * head], cos, sin, position_offset=3, layout=layout
        )
        for i in range(2)
    ]
    device_qkv = on(qkv)
    q, k = device_qkv[:, :, :, :head], device_qkv[:, :, :, head : 2 * head]  # numba: no ...
    numba_rope.rotary_embedding_qk(
        q, k, on(cos), on(sin), position_offset=3, layout=layout, out_q=q, out_k=k
    )
    result = off(device_qkv)
    assert_bitwise_equal(result[..., :head], expected[0])
    assert_bitwise_equal(result[..., head : 2 * head], expected[1])
    assert_bitwise_equal(result[..., 2 * head :], qkv[..., 2 * head :])  # v untouched


def test_qk_parallel_kernel(rng, parallel_always):
    q, cos, sin, ids = make_case(rng, (2, 4, 9, 16), np.float16)
    k = rng.standard_normal((2, 1, 9, 16)).astype(np.float16)
    got_q, got_k = numba_rope.rotary_embedding_qk(q, k, cos, sin, ids)
    assert_bitwise_equal(got_q, contract_bhsd(q, cos, sin, ids))
    assert_bitwise_equal(got_k, contract_bhsd(k, cos, sin, ids))


def test_qk_errors(rng):
    q, cos, sin, ids = make_case(rng, (2, 4, 3, 8), np.float32)
    with pytest.raises(ValueError, match="same seq_len, got 3 and 4"):
        numba_rope.rotary_embedding_qk(
            q, np.zeros((2, 4, 4, 8), np.float32), cos, sin, position_offset=0
        )
    with pytest.raises(TypeError, match="one dtype, got float32 and float64"):
        numba_rope.rotary_embedding_qk(q, q.astype(np.float64), cos, sin, ids)
    out = np.zeros_like(q)
    with pytest.raises(ValueError, match="out_q and out_k share memory"):
        numba_rope.rotary_embedding_qk(q, q.copy(), cos, sin, ids, out_q=out, out_k=out)
    with pytest.raises(IndexError, match="position_ids"):
        numba_rope.rotary_embedding_qk(q, q, cos, sin, ids + 100)


def test_qk_3d_with_num_kv_heads(rng):
    q4, cos, sin, ids = make_case(rng, (2, 4, 3, 8), np.float32)
    k4 = rng.standard_normal((2, 2, 3, 8)).astype(np.float32)
    q3, k3 = bshd(q4).reshape(2, 3, 32), bshd(k4).reshape(2, 3, 16)
    got_q, got_k = numba_rope.rotary_embedding_qk(
        q3, k3, cos, sin, ids, num_heads=4, num_kv_heads=2
    )
    assert_bitwise_equal(got_q, bshd(contract_bhsd(q4, cos, sin, ids)).reshape(2, 3, 32))
    assert_bitwise_equal(got_k, bshd(contract_bhsd(k4, cos, sin, ids)).reshape(2, 3, 16))
