"""rotary_embedding's promises on both devices: NumPy arrays (the CPU kernels) and GPU
arrays (the CUDA kernels, on a GPU or in numba's CUDA simulator, there on tiny shapes
with launches shrunk so that several blocks, head groups and grid-stride turns run).

On the CPU and in the simulator results equal the float32 contract bit for bit; on a GPU
within one unit in the last place of the output dtype (see ``Device.assert_contract`` in
conftest.py). Where a device runs cases of its own (the simulator is slow: small shapes
there), ``device`` is parametrized indirectly with each device's list of cases.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracles import BFLOAT16, DTYPES, assert_bitwise_equal, float32_contract, make_case, ulp_of

import numba_rope
from numba_rope import reference

DTYPE_IDS = [d.name for d in DTYPES]


def _case_id(value) -> str:
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)


def per_device(cpu_cases, gpu_cases):
    """``pytest.param``s for ``parametrize(("device", ...), ..., indirect=["device"])``:
    the CPU's cases and the GPU's (marked gpu)."""
    return [
        pytest.param(name, *case, id="-".join([name, *map(_case_id, case)]), marks=marks)
        for name, cases, marks in (("cpu", cpu_cases, ()), ("gpu", gpu_cases, pytest.mark.gpu))
        for case in cases
    ]


# -- every dtype x interleaved x rotary_dim x position-id variant ------------------------

CPU_SHAPES = [(2, 8, 4, 512), (1, 3, 7, 64), (2, 1, 5, 16), (3, 4, 2, 10)]
GPU_SHAPE = (2, 5, 3, 12)  # 5 heads, 2 per thread: 3 groups (one partial) over 2 blocks


def rotary_dims(head_size):
    return sorted({0, head_size, head_size // 2 - (head_size // 2) % 2, 2} - {-1})


def cpu_shapes_and_dims():
    for shape in CPU_SHAPES:
        for rotary_dim in rotary_dims(shape[3]):
            if rotary_dim == 0 or rotary_dim % 2 == 0:
                yield shape, rotary_dim


# The GPU's cases run on the CPU too; the CPU's large shapes not in the simulator.
GPU_CONTRACT = [
    (GPU_SHAPE, rotary_dim, ids)
    for rotary_dim in (0, 8, 2)
    for ids in ("int64 ids", "int32 ids", "no ids")
]
CPU_CONTRACT = [
    (shape, rotary_dim, ids)
    for shape, rotary_dim in cpu_shapes_and_dims()
    for ids in ("int64 ids", "no ids")
] + GPU_CONTRACT


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize(
    ("device", "shape", "rotary_dim", "ids_variant"),
    per_device(CPU_CONTRACT, GPU_CONTRACT),
    indirect=["device"],
)
def test_matches_contract(rng, device, shape, rotary_dim, ids_variant, interleaved, dtype):
    on, off = device
    x, cos, sin, ids = make_case(
        rng, shape, dtype, position_ids=ids_variant != "no ids", rotary_dim=rotary_dim
    )
    if ids_variant == "int32 ids":
        ids = ids.astype(np.int32)
    dx = on(x)
    got = numba_rope.rotary_embedding(
        dx, on(cos), on(sin), on(ids), interleaved=interleaved, rotary_embedding_dim=rotary_dim
    )
    assert type(got) is type(dx) and got.dtype == x.dtype and got.shape == x.shape
    if device.name == "cpu":
        assert got.flags.c_contiguous
    got = off(got)
    device.assert_contract(got, x, cos, sin, ids, interleaved, rotary_dim)
    # And within the rounding of the format from the float64 reference.
    want = reference.rotary_embedding(
        x, cos, sin, ids, interleaved=interleaved, rotary_embedding_dim=rotary_dim
    )
    scale = np.abs(x.astype(np.float64)).max() * 2
    assert np.allclose(
        got.astype(np.float64), want.astype(np.float64), rtol=0, atol=4 * ulp_of(dtype) * scale
    )


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float64], ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("with_ids", [True, False])
def test_float32_caches_for_other_inputs(rng, device, dtype, interleaved, with_ids):
    on, off = device
    shape = {"cpu": (2, 3, 6, 32), "gpu": (1, 3, 4, 8)}[device.name]
    x, cos, sin, ids = make_case(rng, shape, dtype, position_ids=with_ids, cache_dtype=np.float32)
    got = numba_rope.rotary_embedding(on(x), on(cos), on(sin), on(ids), interleaved=interleaved)
    assert got.dtype == x.dtype
    device.assert_contract(off(got), x, cos, sin, ids, interleaved)


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64, np.uint8, np.int16, np.uint64])
def test_position_id_dtypes(rng, device, id_dtype):
    on, off = device
    x, cos, sin, ids = make_case(rng, (2, 2, 3, 8), np.float32)
    got = numba_rope.rotary_embedding(on(x), on(cos), on(sin), on(ids.astype(id_dtype)))
    device.assert_contract(off(got), x, cos, sin, ids)


# -- NaN, infinity, overflow, subnormals ---------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nan_and_inf_propagate_as_the_formula_says(device, dtype):
    on, off = device
    values = np.array([np.nan, np.inf, -np.inf, 1.0, 0.0, -2.5, 3.0, np.inf], np.float64)
    x = values.astype(dtype).reshape(1, 1, 1, 8)
    cos = np.array([[0.5, 1.0, np.nan, 0.0]]).astype(dtype)
    sin = np.array([[0.25, 0.0, 1.0, np.inf]]).astype(dtype)
    ids = np.zeros((1, 1), np.int64)
    got = off(numba_rope.rotary_embedding(on(x), on(cos), on(sin), on(ids)))
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids))  # on a GPU too
    want = reference.rotary_embedding(x, cos, sin, ids)
    np.testing.assert_array_equal(
        np.isnan(got.astype(np.float64)), np.isnan(want.astype(np.float64))
    )
    assert np.isnan(got.astype(np.float64)).any() and np.isinf(got.astype(np.float64)).any()


def test_float16_overflow_rounds_to_infinity_and_subnormals_survive(device):
    on, off = device
    # pairs (x0, x2) = (60000, 60000) and (x1, x3) = two float16 subnormals
    x = np.array([60000.0, 1e-7, 60000.0, 3e-8], np.float16).reshape(1, 1, 1, 4)
    cos = np.full((1, 1, 2), 1.0, np.float32)
    sin = np.full((1, 1, 2), 1.0, np.float32)
    got = off(numba_rope.rotary_embedding(on(x), on(cos), on(sin)))
    device.assert_contract(got, x, cos, sin)
    assert np.isinf(got[0, 0, 0, 2])  # 60000 + 60000 overflows float16
    assert got[0, 0, 0, 1] != 0 and got[0, 0, 0, 3] != 0  # subnormal results kept


# -- out=, in place ------------------------------------------------------------------------

OUT_CASES = [((2, 3, 2, 12), 8)]  # (shape, rotary_dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    ("device", "shape", "rotary_dim"),
    per_device([((2, 3, 4, 16), 0), *OUT_CASES], OUT_CASES),
    indirect=["device"],
)
def test_out_and_in_place(rng, device, shape, rotary_dim, dtype):
    on, off = device
    x, cos, sin, ids = make_case(rng, shape, dtype, rotary_dim=rotary_dim)
    args = (on(cos), on(sin), on(ids))
    out = on(np.empty_like(x))
    result = numba_rope.rotary_embedding(on(x), *args, rotary_embedding_dim=rotary_dim, out=out)
    assert result is out
    device.assert_contract(off(out), x, cos, sin, ids, rotary_dim=rotary_dim)
    inplace = on(x.copy())
    result = numba_rope.rotary_embedding(
        inplace, *args, rotary_embedding_dim=rotary_dim, out=inplace
    )
    assert result is inplace
    device.assert_contract(off(inplace), x, cos, sin, ids, rotary_dim=rotary_dim)


@pytest.mark.parametrize("interleaved", [False, True])
def test_in_place_on_views_of_fused_qkv(rng, device, interleaved):
    on, off = device
    (batch, heads, seq_len), head = {"cpu": ((2, 4, 6), 16), "gpu": ((1, 2, 3), 8)}[device.name]
    qkv = rng.standard_normal((batch, heads, seq_len, 3 * head)).astype(np.float32)
    _, cos, sin, ids = make_case(rng, (batch, heads, seq_len, head), np.float32)
    q_before, k_before = qkv[..., :head].copy(), qkv[..., head : 2 * head].copy()
    v = qkv[..., 2 * head :].copy()
    dqkv = on(qkv)
    q, k = dqkv[:, :, :, :head], dqkv[:, :, :, head : 2 * head]  # numba: no Ellipsis
    args = (on(cos), on(sin), on(ids))
    numba_rope.rotary_embedding(q, *args, interleaved=interleaved, out=q)
    numba_rope.rotary_embedding(k, *args, interleaved=interleaved, out=k)
    after = off(dqkv)
    device.assert_contract(
        np.ascontiguousarray(after[..., :head]), q_before, cos, sin, ids, interleaved
    )
    device.assert_contract(
        np.ascontiguousarray(after[..., head : 2 * head]), k_before, cos, sin, ids, interleaved
    )
    assert_bitwise_equal(after[..., 2 * head :], v)


# -- strided views, caches and ids ---------------------------------------------------------

# (base from a [batch, heads, seq, 3 * width] buffer, the view of that base)
VIEWS = {
    "slice of fused qkv": (lambda q, w: q, lambda b, w: b[..., w : 2 * w]),
    "transposed": (lambda q, w: q, lambda b, w: b.transpose(0, 2, 1, 3)[..., :w]),
    "transposed copy": (
        lambda q, w: np.ascontiguousarray(q[..., :w].transpose(0, 2, 1, 3)),
        lambda b, w: b.transpose(0, 2, 1, 3),
    ),
    "negative strides": (lambda q, w: q, lambda b, w: b[::-1, :, ::-1, :w][..., ::-1]),
    "every other head": (lambda q, w: q, lambda b, w: b[:, ::2, :, 2 * w :]),
    "every other head of a copy": (
        lambda q, w: np.concatenate([q[..., :w]] * 2, axis=1),
        lambda b, w: b[:, ::2],
    ),
}


@pytest.mark.parametrize("view_name", list(VIEWS))
@pytest.mark.parametrize(
    ("device", "dtype"),
    per_device([(d,) for d in DTYPES], [(np.dtype(np.float32),), (BFLOAT16,)]),
    indirect=["device"],
)
def test_strided_views_as_input_and_out(rng, device, dtype, view_name):
    on, off = device
    shape = {"cpu": (2, 3, 5, 96), "gpu": (2, 4, 4, 48)}[device.name]
    width = shape[3] // 3
    make_base, take_view = VIEWS[view_name]
    base = make_base(rng.standard_normal(shape).astype(dtype), width)
    view = take_view(base, width)
    assert not view.flags.c_contiguous
    x = np.ascontiguousarray(view)
    _, cos, sin, ids = make_case(rng, view.shape, dtype)
    args = (on(cos), on(sin), on(ids))
    _, dview = device.views(base, view)
    got = off(numba_rope.rotary_embedding(dview, *args))
    device.assert_contract(got, x, cos, sin, ids)
    assert_bitwise_equal(got, off(numba_rope.rotary_embedding(on(x), *args)))
    # The same view as out (in place) leaves every other element of the buffer alone.
    want = base.copy()
    take_view(want, width)[...] = float32_contract(x, cos, sin, ids)
    dbase, dview = device.views(base, view)
    numba_rope.rotary_embedding(dview, *args, out=dview)
    after = off(dbase)
    assert_bitwise_equal(after, want)
    device.assert_contract(np.ascontiguousarray(take_view(after, width)), x, cos, sin, ids)


def test_strided_caches_and_ids(rng, device):
    on, off = device
    head = {"cpu": 16, "gpu": 8}[device.name]
    x, cos, sin, ids = make_case(rng, (2, 3, 4, head), np.float32, n_positions=20)
    big_cos = np.zeros((20, head), np.float32)
    big_cos[:, ::2] = cos
    big_sin = np.asfortranarray(sin)
    big_ids = np.zeros((2, 8), np.int64)
    big_ids[:, ::2] = ids
    _, dcos = device.views(big_cos, big_cos[:, ::2])
    _, dsin = device.views(big_sin, big_sin)
    _, dids = device.views(big_ids, big_ids[:, ::2])
    got = numba_rope.rotary_embedding(on(x), dcos, dsin, dids)
    device.assert_contract(off(got), x, cos, sin, ids)


# -- out overlapping an input ---------------------------------------------------------------


def test_out_overlapping_input_is_still_correct(rng, device):
    on, off = device
    head, shift = {"cpu": (32, 8), "gpu": (16, 4)}[device.name]
    buffer = rng.standard_normal((2, 2, 3, head + shift)).astype(np.float32)
    _, cos, sin, ids = make_case(rng, (2, 2, 3, head), np.float32)
    x = buffer[..., :head].copy()
    dbuffer = on(buffer)
    # out starts ``shift`` channels further into the same memory: a shifted overlap.
    numba_rope.rotary_embedding(
        dbuffer[:, :, :, :head], on(cos), on(sin), on(ids), out=dbuffer[:, :, :, shift:]
    )
    device.assert_contract(np.ascontiguousarray(off(dbuffer)[..., shift:]), x, cos, sin, ids)


def test_out_overlapping_caches_is_still_correct(rng, device):
    on, off = device
    x, cos, sin, _ = make_case(rng, (1, 1, 4, 8), np.float32, position_ids=False)
    out = np.zeros((1, 1, 4, 8), np.float32)
    out.reshape(1, 4, 8)[:, :, :4] = cos
    dout = on(out)
    dcos = dout.reshape(1, 4, 8)[:, :, :4]  # the caches live inside out
    numba_rope.rotary_embedding(on(x), dcos, on(sin), out=dout)
    device.assert_contract(off(dout), x, cos, sin)


def test_out_overlapping_position_ids_is_still_correct(rng, device):
    off = device.off
    batch, seq_len = 2, 3
    x, cos, sin, ids = make_case(rng, (batch, 1, seq_len, 4), np.float64, n_positions=5)
    out = np.zeros((batch, 1, seq_len, 4), np.float64)
    ids_in_out = out.view(np.int64).reshape(-1)[: batch * seq_len].reshape(batch, seq_len)
    ids_in_out[...] = ids
    dout, dids = device.views(out, ids_in_out)  # the ids live inside out
    numba_rope.rotary_embedding(device.on(x), device.on(cos), device.on(sin), dids, out=dout)
    device.assert_contract(off(dout), x, cos, sin, ids)


# -- empty dimensions -----------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 2, 3, 8), (2, 0, 3, 8), (2, 3, 0, 8), (2, 3, 4, 0)], ids=str)
def test_empty_dimensions(device, shape):
    on, _ = device
    batch, _, seq_len, head = shape
    x = np.zeros(shape, np.float32)
    ids = np.zeros((batch, seq_len), np.int64)
    cache = np.zeros((1, head // 2), np.float32)
    got = numba_rope.rotary_embedding(on(x), on(cache), on(cache), on(ids))
    assert got.shape == shape and got.dtype == np.float32 and type(got) is type(on(x))
    no_ids = np.zeros((batch, seq_len, head // 2), np.float32)
    assert numba_rope.rotary_embedding(on(x), on(no_ids), on(no_ids)).shape == shape


@pytest.mark.parametrize("offset", [0, 1, -5, 1 << 70])
@pytest.mark.parametrize("rows", [0, 2])
def test_an_empty_batch_reads_no_position(device, rows, offset):
    """A batch of no sequences uses no position: any offset is accepted, as for an
    empty sequence, with caches of any number of rows (the reference gives an empty
    result: its positions index nothing). It was refused with an IndexError when the
    offset's positions left the caches."""
    on, off = device
    x = np.zeros((0, 2, 3, 8), np.float32)
    cache = np.zeros((rows, 4), np.float32)
    if abs(offset) < 1 << 62:
        want = reference.rotary_embedding(x, cache, cache, position_offset=offset)
        assert want.shape == (0, 2, 3, 8)
    got = numba_rope.rotary_embedding(on(x), on(cache), on(cache), position_offset=offset)
    assert off(got).shape == (0, 2, 3, 8)
    q, k = numba_rope.rotary_embedding_qk(
        on(x), on(x[:, :1]), on(cache), on(cache), position_offset=offset
    )
    assert off(q).shape == (0, 2, 3, 8) and off(k).shape == (0, 1, 3, 8)
    # a sequence that is there still has its positions checked
    with pytest.raises(IndexError, match="position_offset"):
        numba_rope.rotary_embedding(
            on(np.zeros((1, 2, 3, 8), np.float32)), on(cache), on(cache), position_offset=7
        )
