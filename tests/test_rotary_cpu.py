"""rotary_embedding on NumPy arrays: the numerical contract, bit for bit."""

from __future__ import annotations

import threading

import numba
import numpy as np
import pytest
from oracles import (
    BFLOAT16,
    DTYPES,
    assert_bitwise_equal,
    float32_contract,
    make_case,
    tensorrt_reference,
    ulp_of,
)

import numba_rope
from numba_rope import reference

SHAPES = [(2, 8, 4, 512), (1, 3, 7, 64), (2, 1, 5, 16), (3, 4, 2, 10)]
DTYPE_IDS = [d.name for d in DTYPES]


def rotary_dims(head_size):
    return sorted({0, head_size, head_size // 2 - (head_size // 2) % 2, 2} - {-1})


def cases():
    for shape in SHAPES:
        for rotary_dim in rotary_dims(shape[3]):
            if rotary_dim == 0 or rotary_dim % 2 == 0:
                yield shape, rotary_dim


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("with_ids", [True, False], ids=["ids", "no_ids"])
@pytest.mark.parametrize(("shape", "rotary_dim"), list(cases()))
def test_matches_contract_bit_for_bit(rng, shape, rotary_dim, with_ids, interleaved, dtype):
    x, cos, sin, ids = make_case(rng, shape, dtype, position_ids=with_ids, rotary_dim=rotary_dim)
    got = numba_rope.rotary_embedding(
        x, cos, sin, ids, interleaved=interleaved, rotary_embedding_dim=rotary_dim
    )
    assert type(got) is np.ndarray and got.flags.c_contiguous
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids, interleaved, rotary_dim))
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
def test_float32_caches_for_other_inputs(rng, dtype, interleaved, with_ids):
    x, cos, sin, ids = make_case(
        rng, (2, 3, 6, 32), dtype, position_ids=with_ids, cache_dtype=np.float32
    )
    got = numba_rope.rotary_embedding(x, cos, sin, ids, interleaved=interleaved)
    assert got.dtype == x.dtype
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids, interleaved))


def test_seed_example_matches_tensorrt_reference(rng):
    x = rng.random((2, 8, 4, 512)).astype("f")
    cos = rng.random((100, 256)).astype("f")
    sin = rng.random((100, 256)).astype("f")
    ids = np.array([[6, 2, 1, 7], [2, 8, 3, 6]])
    got = numba_rope.rotary_embedding(x, cos, sin, ids)
    want = tensorrt_reference(x, cos, sin, ids)
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=2e-7)
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids))


def test_hand_computed_rotation():
    # One pair rotated by 90 degrees, one by 180, one untouched channel pair.
    x = np.array([[[[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]]], dtype=np.float32)
    cos = np.array([[[0.0, -1.0]]], dtype=np.float32)
    sin = np.array([[[1.0, 0.0]]], dtype=np.float32)
    half = numba_rope.rotary_embedding(x, cos, sin, rotary_embedding_dim=4)
    # pairs (x0, x2) = (1, 3) -> (-3, 1); (x1, x3) = (2, 4) -> (-2, -4)
    np.testing.assert_array_equal(half[0, 0, 0], [-3.0, -2.0, 1.0, -4.0, 5.0, 6.0])
    inter = numba_rope.rotary_embedding(x, cos, sin, interleaved=True, rotary_embedding_dim=4)
    # pairs (1, 2) -> (-2, 1); (3, 4) -> (-3, -4)
    np.testing.assert_array_equal(inter[0, 0, 0], [-2.0, 1.0, -3.0, -4.0, 5.0, 6.0])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_parallel_kernel_equals_contract(rng, parallel_always, dtype):
    x, cos, sin, ids = make_case(rng, (3, 5, 7, 24), dtype, rotary_dim=16)
    got = numba_rope.rotary_embedding(x, cos, sin, ids, interleaved=True, rotary_embedding_dim=16)
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids, True, 16))


def test_row_options_must_be_compile_time_constants():
    """A row's vector step is chosen when a kernel compiles: a run-time option is a
    typing error, never a row that silently takes some other path."""
    from numba_rope._cpu import kernels as cpu_kernels

    @numba.njit
    def rotate(x, cos, out, streaming):
        cpu_kernels.rotate_row(x, cos, cos, out, False, x.shape[0], np.float32(1), False, streaming)

    @numba.njit
    def rotate_constant(x, cos, out):
        cpu_kernels.rotate_row(x, cos, cos, out, False, x.shape[0], np.float32(1), False, False)

    x = np.ones(16, np.float32)
    out = np.empty_like(x)
    rotate_constant(x, x[:8], out)  # pairs (1, 1) by cos = sin = 1: (1 - 1, 1 + 1)
    assert np.array_equal(out, np.repeat(np.float32([0, 2]), 8))
    with pytest.raises(numba.core.errors.TypingError, match="vector_pairs"):
        rotate(x, x[:8], x.copy(), True)


def _broadcast_caches(batch, seq_len, half, dtype):
    """Per-token caches as a user computes them from positions broadcast over the
    batch: NumPy keeps the broadcast axis innermost but one, so they are not
    C-contiguous (strides (half, batch * half, 1) elements)."""
    positions = np.broadcast_to(np.arange(seq_len), (batch, seq_len)).astype(np.float64)
    angles = positions[..., np.newaxis] * 10000.0 ** (-np.arange(half) / half)
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    assert not cos.flags.c_contiguous and cos.strides[0] == half * cos.itemsize
    return cos, sin


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_scattered_caches_of_a_large_call(rng, monkeypatch, parallel_always, dtype):
    # Large calls (here: all, parallel_always) rotate from packed copies of such caches.
    from numba_rope._cpu import backend as _cpu

    x = rng.standard_normal((3, 4, 9, 16)).astype(dtype)
    k = rng.standard_normal((3, 2, 9, 16)).astype(dtype)
    cos, sin = _broadcast_caches(3, 9, 8, dtype)
    cos_before = cos.copy()
    kernels, launched = _cpu.kernels, []

    def recording(*options):
        def wrap(kernel):
            return lambda *args: launched.append(args) or kernel(*args)

        return tuple(wrap(kernel) for kernel in kernels(*options))

    monkeypatch.setattr(_cpu, "kernels", recording)
    got = numba_rope.rotary_embedding(x, cos, sin)
    assert_bitwise_equal(got, float32_contract(x, cos, sin, None))
    got_q, got_k = numba_rope.rotary_embedding_qk(x, k, cos, sin)
    assert_bitwise_equal(got_q, float32_contract(x, cos, sin, None))
    assert_bitwise_equal(got_k, float32_contract(k, cos, sin, None))
    assert_bitwise_equal(cos, cos_before)
    assert not cos.flags.c_contiguous  # the caller's caches are left as they are
    arrays = [a for args in launched for a in args if isinstance(a, np.ndarray)]
    assert len(launched) == 2 and not any(np.shares_memory(a, cos) for a in arrays)


def test_which_caches_are_packed(monkeypatch):
    from numba_rope import config
    from numba_rope._cpu import backend as _cpu

    monkeypatch.setattr(config, "PARALLEL_MIN_ELEMENTS", 1000)
    cos, sin = _broadcast_caches(2, 8, 4, np.float32)  # 2 x 256 bytes
    packed = _cpu.packed_caches(cos, sin, 1000, 2048)
    assert all(p.flags.c_contiguous for p in packed)
    assert_bitwise_equal(packed[0], cos)
    assert_bitwise_equal(packed[1], sin)
    # Not for small calls, nor for caches more than a quarter of the input's bytes
    # (each row would serve few heads), nor when they already are C-contiguous.
    assert _cpu.packed_caches(cos, sin, 999, 2048) == (cos, sin)
    assert _cpu.packed_caches(cos, sin, 1000, 2047)[0] is cos
    contiguous = (np.ascontiguousarray(cos), np.ascontiguousarray(sin))
    packed = _cpu.packed_caches(*contiguous, 1000, 2048)
    assert packed[0] is contiguous[0] and packed[1] is contiguous[1]


@pytest.mark.parametrize("threads", [1, 2])
def test_result_independent_of_thread_count(rng, parallel_always, threads):
    x, cos, sin, ids = make_case(rng, (2, 4, 33, 64), np.float32)
    previous = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        got = numba_rope.rotary_embedding(x, cos, sin, ids)
    finally:
        numba.set_num_threads(previous)
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids))


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("tile", [1, 3])
@pytest.mark.parametrize(
    "shape", [(2, 5, 7, 8), (1, 9, 1, 8), (1, 3, 10, 8)], ids=["batch", "decode", "prefill"]
)
def test_any_work_split_gives_the_contract_bits(rng, monkeypatch, shape, tile, parallel):
    # Token tiles (several per sequence, one partial), head groups (one sequence of one
    # token over many heads) and chunks of units: every split gives the same bits.
    from numba_rope import config
    from numba_rope._cpu import backend as _dispatch

    monkeypatch.setattr(config, "TOKENS_PER_TILE", tile)
    if parallel:
        monkeypatch.setattr(config, "PARALLEL_MIN_ELEMENTS", 0)
    _dispatch.PLANS.clear()
    x, cos, sin, ids = make_case(rng, shape, BFLOAT16)
    k = rng.standard_normal((shape[0], 2, shape[2], shape[3])).astype(BFLOAT16)
    for interleaved in (False, True):
        got = numba_rope.rotary_embedding(x, cos, sin, ids, interleaved=interleaved)
        assert_bitwise_equal(got, float32_contract(x, cos, sin, ids, interleaved))
        got_q, got_k = numba_rope.rotary_embedding_qk(x, k, cos, sin, ids, interleaved=interleaved)
        assert_bitwise_equal(got_q, float32_contract(x, cos, sin, ids, interleaved))
        assert_bitwise_equal(got_k, float32_contract(k, cos, sin, ids, interleaved))


def test_work_split_groups_heads_when_units_are_few(monkeypatch):
    from numba_rope import config
    from numba_rope._cpu import backend as _cpu

    monkeypatch.setattr(config, "TOKENS_PER_TILE", 4)
    monkeypatch.setattr(config, "CHUNKS_PER_THREAD", 4)
    monkeypatch.setattr(numba, "get_num_threads", lambda: 2)
    assert _cpu.work_split(1, 32, 1, parallel=True) == (4, 8, 8)  # one token, 32 heads
    assert _cpu.work_split(8, 32, 4, parallel=True) == (4, 1, 8)  # enough units
    assert _cpu.work_split(1, 32, 10, parallel=True) == (4, 3, 8)  # 3 tiles x 3 groups
    assert _cpu.work_split(1, 32, 10, parallel=False) == (4, 1, 1)


def test_default_threshold_routes_small_serial_and_large_parallel(rng, monkeypatch):
    from numba_rope import config
    from numba_rope._cpu import backend as _cpu

    calls = []
    real = _cpu._run_parallel
    monkeypatch.setattr(
        _cpu, "_run_parallel", lambda *args: calls.append(args[1][0].shape) or real(*args)
    )
    small = make_case(rng, (2, 8, 4, 512), np.float32)
    numba_rope.rotary_embedding(*small)
    assert calls == []
    shape = (1, 4, config.PARALLEL_MIN_ELEMENTS // (4 * 64), 64)
    x, cos, sin, ids = make_case(rng, shape, np.float16)
    got = numba_rope.rotary_embedding(x, cos, sin, ids)
    if numba.get_num_threads() > 1:
        assert calls == [shape]
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_strided_views_equal_contiguous_copy(rng, dtype):
    qkv = rng.standard_normal((2, 3, 5, 3 * 32)).astype(dtype)
    _, cos, sin, ids = make_case(rng, (2, 3, 5, 32), dtype)
    views = {
        "slice of fused qkv": qkv[:, :, :, 32:64],
        "transposed": np.ascontiguousarray(qkv[..., :32].transpose(0, 2, 1, 3)).transpose(
            0, 2, 1, 3
        ),
        "negative strides": qkv[::-1, :, ::-1, :32][:, :, :, ::-1],
        "every other head": np.concatenate([qkv[..., :32]] * 2, axis=1)[:, ::2],
    }
    for name, view in views.items():
        assert not view.flags.c_contiguous, name
        got = numba_rope.rotary_embedding(view, cos, sin, ids)
        assert_bitwise_equal(
            got, numba_rope.rotary_embedding(np.ascontiguousarray(view), cos, sin, ids)
        )
        assert_bitwise_equal(got, float32_contract(view, cos, sin, ids))


def test_strided_caches_and_ids(rng):
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 16), np.float32, n_positions=20)
    big_cos = np.zeros((20, 16), np.float32)
    big_cos[:, ::2] = cos
    big_sin = np.asfortranarray(sin)
    big_ids = np.zeros((2, 8), np.int64)
    big_ids[:, ::2] = ids
    got = numba_rope.rotary_embedding(x, big_cos[:, ::2], big_sin, big_ids[:, ::2])
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_out_and_in_place(rng, dtype):
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 16), dtype)
    want = float32_contract(x, cos, sin, ids)
    out = np.empty_like(x)
    assert numba_rope.rotary_embedding(x, cos, sin, ids, out=out) is out
    assert_bitwise_equal(out, want)
    inplace = x.copy()
    assert numba_rope.rotary_embedding(inplace, cos, sin, ids, out=inplace) is inplace
    assert_bitwise_equal(inplace, want)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("start", [0, 1], ids=["even", "odd"])
@pytest.mark.parametrize(
    ("head_size", "rotary_dim"),
    [(8, 8), (9, 8), (7, 6), (13, 10), (34, 34), (40, 2), (80, 72), (130, 128)],
)
def test_bfloat16_two_per_word_at_any_alignment(rng, head_size, rotary_dim, start, interleaved):
    # bfloat16 rows go two elements per 32-bit word, 16 pairs (8 interleaved) a step,
    # the rest element by element: rows starting between words (``start`` 1, odd head
    # sizes), pairs left over (half 3, 5, 17, 36), channels past rotary_dim, in place,
    # caches starting between words too.
    shape = (2, 3, 5, head_size)
    half = rotary_dim // 2
    buffer = rng.standard_normal((2, 3, 5, head_size + 2)).astype(BFLOAT16)
    x = buffer[..., start : start + head_size]
    # Signaling NaNs in: arithmetic makes them quiet, the output rounds them as such.
    flat = buffer.view(np.uint16).reshape(-1)
    flat[7::53] = 0x7F81
    flat[11::61] = 0xFFA0
    _, cos, sin, ids = make_case(rng, shape, BFLOAT16, rotary_dim=rotary_dim)
    cos_view = np.zeros((cos.shape[0], half + 1), BFLOAT16)[:, start : start + half]
    sin_view = np.zeros((sin.shape[0], half + 1), BFLOAT16)[:, start : start + half]
    cos_view[:], sin_view[:] = cos, sin
    want = float32_contract(x, cos, sin, ids, interleaved, rotary_dim)
    assert np.isnan(want.astype(np.float32)).any()
    options = {"interleaved": interleaved, "rotary_embedding_dim": rotary_dim}
    got = numba_rope.rotary_embedding(x, cos_view, sin_view, ids, **options)
    assert_bitwise_equal(got, want)
    out_buffer = np.zeros_like(buffer)
    out = out_buffer[..., 1 - start : 1 - start + head_size]
    numba_rope.rotary_embedding(x, cos_view, sin_view, ids, out=out, **options)
    assert_bitwise_equal(out, want)
    numba_rope.rotary_embedding(x, cos_view, sin_view, ids, out=x, **options)
    assert_bitwise_equal(x, want)
    # Rotated NaNs are the canonical quiet NaN of their sign.
    nan = np.isnan(x.astype(np.float32))
    assert nan.any()
    rotated = np.zeros(shape, bool)
    rotated[..., :rotary_dim] = True
    assert set(np.unique(x.view(np.uint16)[nan & rotated]) & 0x7FFF) == {0x7FC0}


@pytest.mark.parametrize("interleaved", [False, True])
def test_in_place_on_views_of_fused_qkv(rng, interleaved):
    qkv = rng.standard_normal((2, 4, 6, 3 * 16)).astype(np.float32)
    _, cos, sin, ids = make_case(rng, (2, 4, 6, 16), np.float32)
    want_q = float32_contract(qkv[..., :16], cos, sin, ids, interleaved)
    want_k = float32_contract(qkv[..., 16:32], cos, sin, ids, interleaved)
    v = qkv[..., 32:].copy()
    q, k = qkv[..., :16], qkv[..., 16:32]
    numba_rope.rotary_embedding(q, cos, sin, ids, interleaved=interleaved, out=q)
    numba_rope.rotary_embedding(k, cos, sin, ids, interleaved=interleaved, out=k)
    assert_bitwise_equal(qkv[..., :16], want_q)
    assert_bitwise_equal(qkv[..., 16:32], want_k)
    assert_bitwise_equal(qkv[..., 32:], v)


def test_out_overlapping_input_is_still_correct(rng):
    buffer = rng.standard_normal((2, 2, 3, 40)).astype(np.float32)
    _, cos, sin, ids = make_case(rng, (2, 2, 3, 32), np.float32)
    x = buffer[..., :32].copy()
    want = float32_contract(x, cos, sin, ids)
    buffer[..., :32] = x
    # out starts 8 channels further into the same memory: a shifted overlap.
    numba_rope.rotary_embedding(buffer[..., :32], cos, sin, ids, out=buffer[..., 8:40])
    assert_bitwise_equal(buffer[..., 8:40], want)


def test_out_overlapping_caches_is_still_correct(rng):
    x, cos, sin, ids = make_case(rng, (1, 1, 4, 8), np.float32, position_ids=False)
    want = float32_contract(x, cos, sin, ids)
    out = np.empty((1, 1, 4, 8), np.float32)
    cos_in_out = out.reshape(1, 4, 8)[:, :, :4]
    cos_in_out[...] = cos
    numba_rope.rotary_embedding(x, cos_in_out, sin, out=out)
    assert_bitwise_equal(out, want)


@pytest.mark.parametrize("shape", [(0, 2, 3, 8), (2, 0, 3, 8), (2, 3, 0, 8), (2, 3, 4, 0)], ids=str)
def test_empty_dimensions(shape):
    batch, _, seq_len, head = shape
    x = np.zeros(shape, np.float32)
    ids = np.zeros((batch, seq_len), np.int64)
    cache = np.zeros((1, head // 2), np.float32)
    got = numba_rope.rotary_embedding(x, cache, cache, ids)
    assert got.shape == shape and got.dtype == np.float32
    no_ids = np.zeros((batch, seq_len, head // 2), np.float32)
    assert numba_rope.rotary_embedding(x, no_ids, no_ids).shape == shape


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nan_and_inf_propagate_as_the_formula_says(dtype):
    values = np.array([np.nan, np.inf, -np.inf, 1.0, 0.0, -2.5, 3.0, np.inf], np.float64)
    x = values.astype(dtype).reshape(1, 1, 1, 8)
    cos = np.array([[0.5, 1.0, np.nan, 0.0]]).astype(dtype)
    sin = np.array([[0.25, 0.0, 1.0, np.inf]]).astype(dtype)
    got = numba_rope.rotary_embedding(x, cos, sin, np.zeros((1, 1), np.int64))
    assert_bitwise_equal(got, float32_contract(x, cos, sin, np.zeros((1, 1), np.int64)))
    want = reference.rotary_embedding(x, cos, sin, np.zeros((1, 1), np.int64))
    np.testing.assert_array_equal(
        np.isnan(got.astype(np.float64)), np.isnan(want.astype(np.float64))
    )
    assert np.isnan(got.astype(np.float64)).any() and np.isinf(got.astype(np.float64)).any()


def test_float16_overflow_rounds_to_infinity_and_subnormals_survive():
    # pairs (x0, x2) = (60000, 60000) and (x1, x3) = two float16 subnormals
    x = np.array([60000.0, 1e-7, 60000.0, 3e-8], np.float16).reshape(1, 1, 1, 4)
    cos = np.full((1, 1, 2), 1.0, np.float32)
    sin = np.full((1, 1, 2), 1.0, np.float32)
    got = numba_rope.rotary_embedding(x, cos, sin)
    assert_bitwise_equal(got, float32_contract(x, cos, sin))
    assert np.isinf(got[0, 0, 0, 2])  # 60000 + 60000 overflows float16
    assert got[0, 0, 0, 1] != 0 and got[0, 0, 0, 3] != 0  # subnormal results kept


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64, np.uint8, np.int16, np.uint64])
def test_position_id_dtypes(rng, id_dtype):
    x, cos, sin, ids = make_case(rng, (2, 2, 3, 8), np.float32)
    got = numba_rope.rotary_embedding(x, cos, sin, ids.astype(id_dtype))
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids))


def test_concurrent_calls_from_python_threads(rng, parallel_always):
    cases = [make_case(np.random.default_rng(i), (2, 4, 32, 64), np.float32) for i in range(4)]
    wants = [float32_contract(*case) for case in cases]
    errors: list[BaseException] = []

    def work(i):
        try:
            for _ in range(10):
                assert_bitwise_equal(numba_rope.rotary_embedding(*cases[i]), wants[i])
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_out_overlapping_position_ids_is_still_correct(rng):
    batch, seq_len = 2, 3
    x, cos, sin, ids = make_case(rng, (batch, 1, seq_len, 4), np.float64, n_positions=5)
    want = float32_contract(x, cos, sin, ids)
    out = np.zeros((batch, 1, seq_len, 4), np.float64)
    ids_in_out = out.view(np.int64).reshape(-1)[: batch * seq_len].reshape(batch, seq_len)
    ids_in_out[...] = ids
    numba_rope.rotary_embedding(x, cos, sin, ids_in_out, out=out)
    assert_bitwise_equal(out, want)
