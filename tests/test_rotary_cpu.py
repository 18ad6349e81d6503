"""rotary_embedding on NumPy arrays: what only the CPU path promises (the seed example,
the parallel kernel, thread counts and work splits, packed caches, compile-time row
options, bfloat16 two per word, concurrent calls), bit for bit. The promises of both
devices are in test_rotary.py."""

from __future__ import annotations

import itertools
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
)
from plan_counting import fresh_plan_tables

import numba_rope

DTYPE_IDS = [d.name for d in DTYPES]


def test_seed_example_matches_tensorrt_reference(rng):
    x = rng.random((2, 8, 4, 512)).astype("f")
    cos = rng.random((100, 256)).astype("f")
    sin = rng.random((100, 256)).astype("f")
    ids = np.array([[6, 2, 1, 7], [2, 8, 3, 6]])
    got = numba_rope.rotary_embedding(x, cos, sin, ids)
    want = tensorrt_reference(x, cos, sin, ids)
    # TensorRT's reference multiplies complex64 numbers: NumPy's AVX-512 loop fuses with
    # FMA (one rounding less), others do not, so it differs from the contract by up to
    # about 2 ulp at the terms' scale (<= 2): 2e-7 relative plus absolute covers both.
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


#: The parallel split of a decode step for float32 and float16 (whose token-major
#: kernels widen float16 cache rows into a scratch per range of units); bfloat16 and
#: float64 run the same split around the row code that their serial cases test
#: (bfloat16 decode steps in parallel: test_any_work_split_gives_the_contract_bits).
#: Each case compiles about ten kernels (25-33 s on a 2-core CI machine).
_DECODE_RUNS = [(dtype, False) for dtype in DTYPES] + [
    (np.dtype(np.float32), True),
    (np.dtype(np.float16), True),
]


@pytest.mark.parametrize(
    ("dtype", "parallel"),
    _DECODE_RUNS,
    ids=[f"{d.name}-{'parallel' if p else 'serial'}" for d, p in _DECODE_RUNS],
)
def test_decode_steps_go_token_by_token_with_the_contract_bits(rng, monkeypatch, dtype, parallel):
    """One-token inputs (a decode step) take the token-major kernels, which share a
    token's cos/sin row across its heads: position ids, offsets per batch entry and
    per-token caches, interleaved and partial rows, in place, q+k with fewer kv heads,
    one thread and the parallel split (heads then in groups), all the contract's bits."""
    from numba_rope import config
    from numba_rope._cpu import backend as cpu_backend

    if parallel:
        monkeypatch.setattr(config, "PARALLEL_MIN_ELEMENTS", 0)
    requested = []
    kernels = cpu_backend.kernels
    monkeypatch.setattr(
        cpu_backend, "kernels", lambda *args: requested.append(args) or kernels(*args)
    )
    fresh_plan_tables(monkeypatch)  # the general path, then a plan
    x, cos, sin, ids = make_case(rng, (5, 6, 1, 20), dtype, rotary_dim=12)
    options = {"interleaved": True, "rotary_embedding_dim": 12}
    want = float32_contract(x, cos, sin, ids, True, 12)
    for _ in range(2):  # the second call runs the remembered plan (serially)
        assert_bitwise_equal(numba_rope.rotary_embedding(x, cos, sin, ids, **options), want)
    offsets = np.array([3, 0, cos.shape[0] - 1, 1, 4])
    by_offset = numba_rope.rotary_embedding(x, cos, sin, position_offset=offsets, **options)
    assert_bitwise_equal(by_offset, float32_contract(x, cos, sin, offsets[:, None], True, 12))
    per_token = (cos[ids], sin[ids])  # [batch, 1, half]: caches without position ids
    got = numba_rope.rotary_embedding(x, *per_token, **options)
    assert_bitwise_equal(got, want)
    work = x.copy()
    numba_rope.rotary_embedding(work, cos, sin, ids, out=work, **options)
    assert_bitwise_equal(work, want)
    k = rng.standard_normal((5, 2, 1, 20)).astype(dtype)
    got_q, got_k = numba_rope.rotary_embedding_qk(x, k, cos, sin, ids, **options)
    assert_bitwise_equal(got_q, want)
    assert_bitwise_equal(got_k, float32_contract(k, cos, sin, ids, True, 12))
    contiguous_requests = [args for args in requested if args[2]]
    assert contiguous_requests and all(args[6] for args in contiguous_requests)


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
    from numba_rope._jit import thread_count

    if thread_count() < 2:
        pytest.skip("one numba thread: large calls run serially, in untiled caches")
    # Large calls (here: all, parallel_always) rotate such caches where they lie, in
    # tiles whose rows span at most config.CACHE_SPAN_BYTES of each cache: here rows 3
    # rows apart (a batch of 3) and a span of 3.5 such steps, so tiles of 3 tokens, and
    # a sequence of 9 takes 3 tiles.
    from numba_rope import config
    from numba_rope._cpu import backend as cpu_backend

    x = rng.standard_normal((3, 4, 9, 16)).astype(dtype)
    k = rng.standard_normal((3, 2, 9, 16)).astype(dtype)
    cos, sin = _broadcast_caches(3, 9, 8, dtype)
    step = 3 * 8 * cos.itemsize  # between a sequence's rows
    monkeypatch.setattr(config, "CACHE_SPAN_BYTES", 3 * step + step // 2)
    cos_before = cos.copy()
    kernels, launched = cpu_backend.kernels, []

    def recording(*options):
        def wrap(kernel):
            return lambda *args: launched.append(args) or kernel(*args)

        chosen = kernels(*options)
        return chosen._replace(**{name: wrap(getattr(chosen, name)) for name in chosen._fields[1:]})

    monkeypatch.setattr(cpu_backend, "kernels", recording)
    got = numba_rope.rotary_embedding(x, cos, sin)
    assert_bitwise_equal(got, float32_contract(x, cos, sin, None))
    got_q, got_k = numba_rope.rotary_embedding_qk(x, k, cos, sin)
    assert_bitwise_equal(got_q, float32_contract(x, cos, sin, None))
    assert_bitwise_equal(got_k, float32_contract(k, cos, sin, None))
    assert_bitwise_equal(cos, cos_before)
    assert len(launched) == 2
    for args in launched:  # (x, k, cos, sin, positions, out, out_k, rotary_dim, check, tile, ...)
        assert np.shares_memory(args[2], cos) and np.shares_memory(args[3], sin)
        assert args[9] == 3


def test_which_caches_take_shorter_tiles():
    # cache_step: the bytes between a sequence's consecutive cache rows where they are
    # further apart than a row and not one buffer of cos and sin rows; else 0.
    from numba_rope._cpu import backend as cpu_backend

    cos, sin = _broadcast_caches(2, 8, 4, np.float32)  # rows 2 rows apart
    assert cpu_backend.cache_step(cos, sin) == 2 * 16
    halves = np.zeros((2, 8, 8), np.float32)  # transformers' cat(freqs, freqs), cut
    assert cpu_backend.cache_step(halves[..., :4], np.ones((2, 8, 8), np.float32)[..., :4]) == 32
    assert cpu_backend.cache_step(halves[..., :4], halves[..., 4:]) == 0  # one buffer, as vLLM's
    assert cpu_backend.cache_step(halves[..., :4], np.zeros((2, 8, 4), np.float32)) == 32
    one_buffer = np.zeros((8, 2, 4), np.float32)  # vLLM's cos_sin_cache: dense
    assert cpu_backend.cache_step(one_buffer[:, 0], one_buffer[:, 1]) == 0
    assert cpu_backend.cache_step(np.ascontiguousarray(cos), np.ascontiguousarray(sin)) == 0
    assert cpu_backend.cache_step(cos[:, :1], sin[:, :1]) == 0  # one row a sequence
    reversed_rows = np.zeros((8, 4), np.float32)[::-1]  # a row apart: no shorter tiles
    assert cpu_backend.cache_step(reversed_rows, reversed_rows) == 0
    # The tiles: in parallel and head by head only, at most CACHE_SPAN_BYTES // step.
    from numba_rope import config

    span = config.CACHE_SPAN_BYTES
    step = span // 100
    assert cpu_backend.work_split(1, 8, 4096, True, cache_step=step)[0] == span // step
    assert cpu_backend.work_split(1, 8, 4096, True, cache_step=2 * span)[0] == 1
    assert cpu_backend.work_split(1, 8, 4096, False, cache_step=span)[0] == config.TOKENS_PER_TILE
    assert (
        cpu_backend.work_split(1, 8, 4096, True, 2, True, span)[0]
        == cpu_backend.work_split(1, 8, 4096, True, 2, True)[0]
    )


def _dense(cos, sin):
    from numba_rope._cpu import backend as cpu_backend

    return cpu_backend.rows_dense(cos, sin)


def test_which_cache_rows_are_dense():
    # Dense: each sequence's rows next to each other, so a head reads them as one or
    # two streams. Checked against the addresses the rows start at.
    both = np.zeros((6, 2, 4), np.float32)  # vLLM's cos_sin_cache: cos half, sin half
    flat = both.reshape(6, 8)
    assert _dense(flat[:, :4], flat[:, 4:]) and _dense(flat[:, 4:], flat[:, :4])
    assert _dense(np.zeros((6, 4), np.float32), np.ones((6, 4), np.float32))
    per_token = np.zeros((3, 5, 2, 4), np.float32)
    assert _dense(per_token[:, :, 0], per_token[:, :, 1])
    one_row = np.zeros((1, 5, 4), np.float32)  # broadcast over the batch: the same rows
    assert _dense(np.broadcast_to(one_row, (3, 5, 4)), np.broadcast_to(one_row + 1, (3, 5, 4)))
    assert _dense(np.zeros((3, 1, 4), np.float32), np.zeros((3, 1, 4), np.float32))
    # Not dense: rows with holes (transformers' cat(cos, cos) cut in half), every other
    # row, cos and sin of one buffer that are not each other's halves, rows a power of
    # two apart (broadcast positions), reversed rows, strided channels, unequal strides.
    duplicated = np.zeros((6, 8), np.float32)
    assert not _dense(duplicated[:, :4], np.zeros((6, 8), np.float32)[:, :4])
    assert not _dense(flat[::2, :4], flat[::2, 4:])
    wide = np.zeros((6, 16), np.float32)
    assert not _dense(wide[:, :4], wide[:, 8:12])
    assert not _dense(*_broadcast_caches(2, 8, 4, np.float32))
    contiguous = np.zeros((6, 4), np.float32)
    assert not _dense(contiguous[::-1], contiguous[::-1])
    assert not _dense(duplicated[:, ::2], duplicated[:, 1::2])
    assert not _dense(contiguous, flat[:, :4])
    gaps = np.zeros((3, 6, 4), np.float32)[:, :5]  # sequences one row apart
    assert not _dense(gaps, gaps)


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

    monkeypatch.setattr(config, "TOKENS_PER_TILE", tile)
    if parallel:
        monkeypatch.setattr(config, "PARALLEL_MIN_ELEMENTS", 0)
    fresh_plan_tables(monkeypatch)
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
    from numba_rope._cpu import backend as cpu_backend

    monkeypatch.setattr(config, "TOKENS_PER_TILE", 4)
    monkeypatch.setattr(config, "CHUNKS_PER_THREAD", 4)
    monkeypatch.setattr(numba, "get_num_threads", lambda: 2)
    assert cpu_backend.work_split(1, 32, 1, parallel=True) == (4, 8, 8)  # one token, 32 heads
    assert cpu_backend.work_split(8, 32, 4, parallel=True) == (4, 1, 8)  # enough units
    assert cpu_backend.work_split(1, 32, 10, parallel=True) == (4, 3, 8)  # 3 tiles x 3 groups
    assert cpu_backend.work_split(1, 32, 10, parallel=False) == (4, 1, 1)


def _run_on(monkeypatch, run: str) -> None:
    """Make the calls of a test run ``run``: "serial" (the calling thread alone, as
    small calls do), "helper" (shared with the helper thread) or "parallel" (numba's
    parallel region), however small; no remembered plan from an earlier test."""
    from numba_rope import config

    if run == "parallel":
        monkeypatch.setattr(config, "PARALLEL_MIN_ELEMENTS", 0)
    if run == "helper":
        monkeypatch.setattr(config, "HELPER_MIN_ELEMENTS", 0)
    fresh_plan_tables(monkeypatch)


@pytest.mark.parametrize("run", ["serial", "helper", "parallel"])
@pytest.mark.parametrize("form", ["bshd", "3-D"])
def test_token_major_order_gives_the_contract_bits(rng, monkeypatch, form, run):
    # Heads inside tokens (bshd, ONNX's 3-D input) are rotated token by token, in
    # tiles cut to give each chunk whole tokens: the bits of the contract all the same.
    from numba_rope._cpu import backend as cpu_backend

    _run_on(monkeypatch, run)
    asked = []  # the kernels' options, on the general path and the plan's
    kernels = cpu_backend.kernels
    monkeypatch.setattr(cpu_backend, "kernels", lambda *o: asked.append(o) or kernels(*o))
    x, cos, sin, ids = make_case(rng, (3, 5, 11, 8), np.float16)
    bshd = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    assert cpu_backend.token_major(bshd.transpose(0, 2, 1, 3))
    kwargs = {"layout": "bshd"} if form == "bshd" else {"num_heads": 5}
    given = bshd if form == "bshd" else bshd.reshape(3, 11, 40)
    for interleaved in (False, True):
        want = float32_contract(x, cos, sin, ids, interleaved).transpose(0, 2, 1, 3)
        for _ in range(2):  # the general path, then the plan
            got = numba_rope.rotary_embedding(
                given, cos, sin, ids, interleaved=interleaved, **kwargs
            )
            assert_bitwise_equal(got.reshape(want.shape), want)
    assert len(asked) >= 2 and all(options[6] for options in asked)  # token_major


#: Token by token (decode, bshd) and head by head (bhsd), each on the calling thread,
#: shared with the helper and in parallel; bshd (several tokens a unit) on the calling
#: thread only: its units split as decode's do (test_token_major_order_gives_the_
#: contract_bits runs bshd shared and in parallel). bfloat16 token by token only (its
#: head-by-head rows take no scratch), each case compiles 10-20 s on CI.
_CACHE_16_BIT_RUNS = [
    ("float16", form, run)
    for form in ("decode", "bhsd")
    for run in ("serial", "helper", "parallel")
] + [
    ("float16", "bshd", "serial"),
    ("bfloat16", "decode", "serial"),
    ("bfloat16", "decode", "helper"),
    ("bfloat16", "bshd", "serial"),
]


@pytest.mark.parametrize(
    ("dtype", "form", "run"),
    _CACHE_16_BIT_RUNS,
    ids=["-".join(case) for case in _CACHE_16_BIT_RUNS],
)
def test_16_bit_caches_give_the_contract_bits(rng, monkeypatch, dtype, form, run):
    # Token by token (decode, bshd), float16 and bfloat16 cache rows are widened to
    # float32 once for all the token's heads (exact; for bfloat16's non-interleaved
    # word loop in the order it reads them) and the heads rotate by the widened rows;
    # head by head (bhsd) each head's vector steps convert them. The contract's bits
    # either way, for every vector step width (float16, 24 pairs: a step of 16 and
    # one of 8; 60: and 4 left to the element loop; bfloat16 words, 60 pairs: a step
    # of 32, one of 16 and 12 left), partial rotation, the inverse, in place, and q
    # with k of fewer heads.
    _run_on(monkeypatch, run)
    dtype = BFLOAT16 if dtype == "bfloat16" else np.dtype(np.float16)
    seq_len = 1 if form == "decode" else 7
    for head_size, rotary_dim in ((48, 0), (128, 120), (130, 48)):
        x, cos, sin, ids = make_case(rng, (3, 6, seq_len, head_size), dtype, rotary_dim=rotary_dim)
        assert cos.dtype == dtype  # 16-bit caches, which the token-major kernels widen
        k = rng.standard_normal((3, 2, seq_len, head_size)).astype(dtype)
        layout = "bshd" if form == "bshd" else "bhsd"

        def given(a):
            return np.ascontiguousarray(a.transpose(0, 2, 1, 3)) if form == "bshd" else a.copy()

        def back(a):
            return a.transpose(0, 2, 1, 3) if form == "bshd" else a

        for interleaved, inverse in ((False, False), (True, True)):
            signed = -sin if inverse else sin  # negation is exact
            want = float32_contract(x, cos, signed, ids, interleaved, rotary_dim)
            options = dict(interleaved=interleaved, rotary_embedding_dim=rotary_dim, layout=layout)
            for _ in range(2):  # the general path, then the plan
                got = numba_rope.rotary_embedding(
                    given(x), cos, sin, ids, inverse=inverse, **options
                )
                assert_bitwise_equal(back(got), want)
        # q and k of fewer heads, in place
        want_k = float32_contract(k, cos, sin, ids, False, rotary_dim)
        want = float32_contract(x, cos, sin, ids, False, rotary_dim)
        q_in, k_in = given(x), given(k)
        numba_rope.rotary_embedding_qk(
            q_in, k_in, cos, sin, ids, out_q=q_in, out_k=k_in,
            rotary_embedding_dim=rotary_dim, layout=layout,
        )  # fmt: skip
        assert_bitwise_equal(back(q_in), want)
        assert_bitwise_equal(back(k_in), want_k)


#: Input and cache dtypes whose interleaved rows, taken token by token, rotate by cache
#: rows holding each value twice (kernels.duplicates_pairs).
_DUPLICATED = [
    (np.float32, np.float32),
    (np.float16, np.float16),
    (np.float16, np.float32),
    (BFLOAT16, np.float32),
]


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    _DUPLICATED,
    ids=[f"{np.dtype(d).name}-{np.dtype(c).name}-caches" for d, c in _DUPLICATED],
)
def test_interleaved_pairs_as_they_lie_give_the_contract_bits(rng, dtype, cache_dtype):
    # Interleaved rows taken token by token (decode steps, bshd) rotate the pairs as
    # they lie: times cos, minus (even lanes) or plus (odd lanes) the pairs swapped
    # within themselves times sin, by cache rows widened once per token with each value
    # twice. The contract's bits for every vector step width and the element loop past
    # them (60 pairs: steps of 16 and 8 and 4 pairs left; 24; 3: the element loop
    # alone), partial rotation, the inverse, in place, NaN and infinities in the input
    # and the caches, and q with k of fewer heads.
    from numba_rope._cpu import kernels
    from numba_rope._cpu.backend import storage_dtype

    storage = numba.from_dtype(storage_dtype(np.dtype(dtype)) or np.dtype(dtype))
    cache_storage = numba.from_dtype(storage_dtype(np.dtype(cache_dtype)) or np.dtype(cache_dtype))
    assert kernels.duplicates_pairs(
        numba.types.Array(storage, 4, "C"), numba.types.Array(cache_storage, 2, "C"), True, False
    )
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0])
    for head_size, rotary_dim in ((130, 120), (48, 0), (10, 6)):
        x, cos, sin, ids = make_case(
            rng, (3, 6, 1, head_size), dtype, rotary_dim=rotary_dim, cache_dtype=cache_dtype
        )
        x[0, 1, 0, : len(specials)] = specials.astype(dtype)
        cos[ids[1, 0], :2] = specials[:2].astype(cache_dtype)
        sin[ids[2, 0], 1:3] = specials[1:3].astype(cache_dtype)
        k = rng.standard_normal((3, 2, 1, head_size)).astype(dtype)
        # bshd: the 3 sequences' tokens as 3 tokens of one sequence
        _assert_contract_in_every_form(x, k, cos, sin, ids, True, rotary_dim, (2, 0, 1, 3), ids.T)


def _assert_contract_in_every_form(x, k, cos, sin, ids, interleaved, rotary_dim, axes, bshd_ids):
    """The float32 contract's bits from a call, twice (the general path, then the plan),
    from the input laid out as bshd (``x.transpose(axes)``, ids ``bshd_ids``), in place
    with the inverse, and from q with k."""
    options = dict(interleaved=interleaved, rotary_embedding_dim=rotary_dim)
    want = float32_contract(x, cos, sin, ids, interleaved, rotary_dim)
    for _ in range(2):  # the general path, then the plan
        assert_bitwise_equal(numba_rope.rotary_embedding(x, cos, sin, ids, **options), want)
    bshd = np.ascontiguousarray(x.transpose(axes))
    got = numba_rope.rotary_embedding(bshd, cos, sin, bshd_ids, layout="bshd", **options)
    assert_bitwise_equal(got, want.transpose(axes))
    work = x.copy()
    numba_rope.rotary_embedding(work, cos, sin, ids, out=work, inverse=True, **options)
    assert_bitwise_equal(work, float32_contract(x, cos, -sin, ids, interleaved, rotary_dim))
    got_q, got_k = numba_rope.rotary_embedding_qk(x, k, cos, sin, ids, **options)
    assert_bitwise_equal(got_q, want)
    assert_bitwise_equal(got_k, float32_contract(k, cos, sin, ids, interleaved, rotary_dim))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_in_place_rows_off_lines_with_channels_past_rotary_dim(rng, dtype):
    # Rotated in place, rows whose channels past rotary_dim are not written and which
    # start off a 64-byte line prefetch the rows PREFETCH_ROWS ahead (a hint: the
    # bits are those of the contract, the channels past rotary_dim untouched).
    from numba_rope._cpu.kernels import PREFETCH_ROWS

    tokens = 2 * PREFETCH_ROWS + 3  # rows with and without a row that far ahead
    x, cos, sin, ids = make_case(rng, (2, 3, tokens, 136), dtype, rotary_dim=64)
    for interleaved in (False, True):
        raw = np.empty(x.nbytes + 64, np.uint8)
        start = (16 - raw.ctypes.data) % 64  # 16 bytes past a line
        work = raw[start : start + x.nbytes].view(x.dtype).reshape(x.shape)
        work[...] = x
        numba_rope.rotary_embedding(
            work, cos, sin, ids, out=work, interleaved=interleaved, rotary_embedding_dim=64
        )
        want = float32_contract(x, cos, sin, ids, interleaved, 64)
        assert_bitwise_equal(work, want)
        assert_bitwise_equal(work[..., 64:], x[..., 64:])


def test_a_prefetch_is_a_hint_that_never_faults():
    from numba_rope._cpu.vector import prefetch_rows, prefetch_span

    @numba.njit
    def touch(a, b, offset, nbytes):
        prefetch_span(a, offset, nbytes)
        prefetch_rows(a, offset, b, -offset, nbytes)  # a for reading, b for writing
        return a[0] + b[0]

    a = np.arange(4, dtype=np.float32)
    b = np.ones(4, dtype=np.float32)
    # past the end, before the start, a span of many lines: nothing read or written
    for offset, nbytes in ((0, 16), (1 << 20, 4096), (-(1 << 20), 200), (3, 1)):
        assert touch(a, b, offset, nbytes) == 1.0
    np.testing.assert_array_equal(a, np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(b, np.ones(4, dtype=np.float32))


def test_large_float32_rows_into_another_array_prefetch_rows_ahead(rng):
    # float32 rows rotated into another array, the input larger than AHEAD_MIN_BYTES,
    # prefetch the rows AHEAD_ROWS heads (token by token) or tokens (head by head)
    # ahead (a hint that reaches past the last rows and into the other thread's
    # chunks): the bits are the contract's, for a decode step, heads inside tokens,
    # q with k and heads outside tokens.
    from numba_rope._cpu.kernels import AHEAD_MIN_BYTES

    heads, head_size = 16, 128
    batch = AHEAD_MIN_BYTES // (heads * head_size * 4) + 3
    x, cos, sin, ids = make_case(rng, (batch, heads, 1, head_size), np.float32)
    assert x.nbytes > AHEAD_MIN_BYTES
    want = float32_contract(x, cos, sin, ids)
    out = np.empty_like(x)
    assert numba_rope.rotary_embedding(x, cos, sin, ids, out=out) is out
    assert_bitwise_equal(out, want)
    bshd = np.ascontiguousarray(x.transpose(2, 0, 1, 3))  # batch tokens of one sequence
    got = numba_rope.rotary_embedding(bshd, cos, sin, ids.T, layout="bshd")
    assert_bitwise_equal(got, want.transpose(2, 0, 1, 3))
    k = x[:, : heads // 4].copy()
    got_q, got_k = numba_rope.rotary_embedding_qk(x, k, cos, sin, ids)
    assert_bitwise_equal(got_q, want)
    assert_bitwise_equal(got_k, want[:, : heads // 4])
    # Head by head (bhsd, several tokens): the rows AHEAD_ROWS tokens ahead.
    bhsd = np.ascontiguousarray(x.reshape(1, batch, heads, head_size).transpose(0, 2, 1, 3))
    got = numba_rope.rotary_embedding(bhsd, cos, sin, ids.T)
    want_bhsd = float32_contract(bhsd, cos, sin, ids.T)
    assert_bitwise_equal(got, want_bhsd)


def test_token_major_follows_memory_order():
    from numba_rope._cpu import backend as cpu_backend

    bhsd = np.empty((2, 4, 6, 8), np.float32)
    assert not cpu_backend.token_major(bhsd)  # heads outside tokens
    assert cpu_backend.token_major(np.empty((2, 6, 4, 8), np.float32).transpose(0, 2, 1, 3))
    assert cpu_backend.token_major(bhsd[:, :, :1])  # one token: a decode step
    assert not cpu_backend.token_major(np.empty((2, 6, 1, 8), np.float32).transpose(0, 2, 1, 3))


def test_work_split_gives_token_major_chunks_whole_tokens(monkeypatch):
    from numba_rope import config
    from numba_rope._cpu import backend as cpu_backend

    monkeypatch.setattr(config, "TOKENS_PER_TILE", 8192)
    monkeypatch.setattr(config, "CHUNKS_PER_THREAD", 4)
    monkeypatch.setattr(numba, "get_num_threads", lambda: 2)
    # One 4096-token prompt: 8 tiles of 512 tokens, all heads each, not 8 head groups.
    assert cpu_backend.work_split(1, 32, 4096, True, token_major=True) == (512, 1, 8)
    assert cpu_backend.work_split(1, 32, 4096, True) == (8192, 8, 8)
    assert cpu_backend.work_split(3, 32, 10, True, token_major=True) == (4, 1, 8)  # 9 units
    assert cpu_backend.work_split(16, 32, 100, True, token_major=True) == (100, 1, 8)
    assert cpu_backend.work_split(1, 32, 1, True, token_major=True) == (8192, 8, 8)  # decode
    assert cpu_backend.work_split(1, 32, 4096, False, token_major=True) == (8192, 1, 1)


def test_default_threshold_routes_small_serial_and_large_parallel(rng, monkeypatch):
    from numba_rope import config
    from numba_rope._cpu import backend as cpu_backend

    calls = []
    real = cpu_backend._run_parallel
    monkeypatch.setattr(
        cpu_backend, "_run_parallel", lambda *args: calls.append(args[1][0].shape) or real(*args)
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


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("start", [0, 1], ids=["even", "odd"])
@pytest.mark.parametrize(
    ("head_size", "rotary_dim"),
    [
        (8, 8),
        (9, 8),
        (7, 6),
        (13, 10),
        (34, 34),
        (40, 2),
        (80, 72),
        (130, 128),
        (50, 48),
        (120, 112),
    ],
)
def test_bfloat16_two_per_word_at_any_alignment(rng, head_size, rotary_dim, start, interleaved):
    # bfloat16 rows go two elements per 32-bit word, 32 pairs (16 interleaved) a step,
    # then at most one step of 16 (8), the rest element by element: rows starting
    # between words (``start`` 1, odd head sizes), pairs left over (half 3, 5, 17, 36,
    # 24 = 16 + 8, 56 = 32 + 16 + 8 or 3 x 16 + 8), channels past rotary_dim, in
    # place, caches starting between words too.
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


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (np.float32, np.float32),
        (np.float16, np.float16),
        (np.float16, np.float32),
        (BFLOAT16, BFLOAT16),
        (BFLOAT16, np.float32),
    ],
    ids=["float32", "float16", "float16-float32-caches", "bfloat16", "bfloat16-float32-caches"],
)
def test_rows_of_pairs_past_the_widest_steps(rng, dtype, cache_dtype, interleaved):
    # With ordinary stores, rows whose rotated pairs are not a multiple of 8 go on with
    # narrower steps (vector.*_TAIL_WIDTHS: float16 rows and interleaved rows 4, 2 and 1
    # pairs, the bfloat16 halves 2 words and 1; float32 halves none)
    # before the element loop: GPT-NeoX-20B's 24 channels of 96 (12 pairs = 8 + 4),
    # StableLM's 20 of 80 (8 + 2), 28 (8 + 4 + 2), 40, odd pair counts (13, 7: the
    # bfloat16 halves leave one pair to the element loop) and rows shorter than a
    # step (3 pairs). Decode rows (one token: cache rows widened once per
    # token, bfloat16's in the order of the word steps), head-major rows, bshd rows, in
    # place, the inverse, q with k, and NaN and infinities in the input and the caches:
    # the contract's bits.
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0])
    for head_size, rotary_dim in ((96, 24), (80, 20), (30, 28), (64, 40), (30, 26), (14, 14),
                                  (9, 6)):  # fmt: skip
        for shape in ((3, 6, 1, head_size), (2, 3, 5, head_size)):
            x, cos, sin, ids = make_case(
                rng, shape, dtype, rotary_dim=rotary_dim, cache_dtype=cache_dtype
            )
            x[0, 1, 0, : len(specials)] = specials[:head_size].astype(dtype)
            cos[ids[1, 0], :2] = specials[:2].astype(cache_dtype)
            sin[ids[-1, -1], 1:3] = specials[1:3].astype(cache_dtype)
            k = rng.standard_normal((shape[0], 2, *shape[2:])).astype(dtype)
            _assert_contract_in_every_form(
                x, k, cos, sin, ids, interleaved, rotary_dim, (0, 2, 1, 3), ids
            )


@pytest.mark.parametrize(("head_size", "rotary_dim"), [(64, 64), (130, 128), (120, 112), (90, 80)])
def test_float16_halves_two_steps_at_a_time(rng, head_size, rotary_dim):
    # float16 rows of non-interleaved pairs go two vector steps at a time, both
    # steps' halves narrowed and stored as one vector (32 pairs), then at most one step
    # of 16 and one of 8, the rest element by element: half 32 (one double step), 64
    # (two), 56 (32 + 16 + 8), 40 (32 + 8); rows starting one element into their
    # buffer (off 64-byte lines), in place and not, the inverse, and extremes (the
    # largest float16, whose rotation may overflow, subnormals, NaN).
    shape = (2, 3, 5, head_size)
    buffer = rng.standard_normal((2, 3, 5, head_size + 1)).astype(np.float16)
    flat = buffer.reshape(-1)
    flat[5::37] = np.float16(65504.0)
    flat[9::41] = np.float16(6e-8)  # subnormal
    flat[13::43] = np.float16(np.nan)
    x = buffer[..., 1 : 1 + head_size]
    _, cos, sin, ids = make_case(rng, shape, np.float16, rotary_dim=rotary_dim)
    for inverse in (False, True):
        want = float32_contract(x, cos, -sin if inverse else sin, ids, False, rotary_dim)
        options = {"rotary_embedding_dim": rotary_dim, "inverse": inverse}
        assert_bitwise_equal(numba_rope.rotary_embedding(x, cos, sin, ids, **options), want)
        work = x.copy()
        numba_rope.rotary_embedding(work, cos, sin, ids, out=work, **options)
        assert_bitwise_equal(work, want)


@pytest.mark.parametrize("cache_dtype", [np.float16, np.float32], ids=["float16", "float32"])
def test_float16_products_fused_only_where_exact(rng, cache_dtype):
    # float16 rows rotated by float16 caches fuse each product with the sum on CPUs with
    # FMA (numba_rope._cpu.vector._Stream.rotate): a product of two float16 values is
    # exact in float32, so the fused step rounds the same sum once. The premise, for
    # every finite float16 value times cache values at the extremes and with every
    # significand bit set: the float32 product equals the float64 one.
    values = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    values = values[np.isfinite(values)]  # 63,488 values, both zeros included
    extremes = np.array(
        [65504, -65504, 2**-24, -(2**-24), 2**-14, 1 - 2**-11, -(1 - 2**-11), 0.0, -0.0],
        dtype=np.float16,
    )
    factors = np.concatenate([extremes, rng.uniform(-1, 1, 55).astype(np.float16)])
    wide = values.astype(np.float32)[:, None]
    assert np.array_equal(
        (wide * factors.astype(np.float32)).astype(np.float64),
        wide.astype(np.float64) * factors.astype(np.float64),
    )
    # The kernels, on every finite float16 value: decode steps (cache rows widened once
    # per token), head by head, tokens by heads, interleaved, the inverse. With float32
    # caches of full significands, whose products are not exact, a fused step would
    # round once where the contract rounds twice: those take no FMA, and every bit
    # checked here would show one.
    x_rows = values[: 496 * 128].reshape(496, 128)
    cos = rng.uniform(-1, 1, (40, 64)).astype(cache_dtype)
    sin = rng.uniform(-1, 1, (40, 64)).astype(cache_dtype)
    cos[0, :9], sin[1, :9] = extremes, extremes[::-1]
    if cache_dtype == np.float32:  # every significand bit in use
        assert np.any(cos.view(np.uint32) & 1) and np.any(sin.view(np.uint32) & 1)
    for shape, layout in (
        ((31, 16, 1, 128), "bhsd"),
        ((1, 16, 31, 128), "bhsd"),
        ((1, 31, 16, 128), "bshd"),
    ):
        x = x_rows.reshape(shape)
        tokens = shape[2] if layout == "bhsd" else shape[1]
        ids = rng.integers(0, 40, (shape[0], tokens))
        ids[0, 0], ids[-1, -1] = 0, 1
        # the test's own NumPy oracle, which takes bhsd: a bshd input seen as one
        bhsd = x if layout == "bhsd" else x.transpose(0, 2, 1, 3)
        for interleaved, inverse in ((False, False), (True, False), (False, True)):
            options = {"interleaved": interleaved, "inverse": inverse, "layout": layout}
            want = float32_contract(bhsd, cos, -sin if inverse else sin, ids, interleaved)
            if layout == "bshd":
                want = want.transpose(0, 2, 1, 3)
            assert_bitwise_equal(numba_rope.rotary_embedding(x, cos, sin, ids, **options), want)
            work = x.copy()
            numba_rope.rotary_embedding(work, cos, sin, ids, out=work, **options)
            assert_bitwise_equal(work, want)


def _vector_steps(interleaved, words, streaming):
    """A function of a row running the vector steps alone, with these options as the
    compile-time constants the kernels give them and the row length as a value."""
    from numba_rope._cpu.vector import vector_pairs

    @numba.njit
    def steps(x_row, cos_row, sin_row, out_row, half):
        sign = np.float32(1.0)
        return vector_pairs(
            x_row, cos_row, sin_row, out_row, half, sign, interleaved, words, streaming
        )

    return steps


@pytest.mark.parametrize("streaming", [False, True], ids=["stores", "streaming"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize(
    ("dtype", "words"),
    [(np.float32, False), (np.float16, False), (BFLOAT16, True)],
    ids=["float32", "float16", "bfloat16-words"],
)
def test_vector_steps_of_rows_of_every_length(rng, dtype, words, interleaved, streaming):
    for duplicated in (False, True) if interleaved and not words else (False,):
        _check_vector_steps(rng, dtype, words, interleaved, streaming, duplicated)


def _check_vector_steps(rng, dtype, words, interleaved, streaming, duplicated):
    # The vector steps are emitted once with the row's length as a constant for each
    # of CONSTANT_HALVES and once for any length (see vector._by_half): every length,
    # those and their neighbours, rotates the same pairs (half rounded down to 8
    # pairs with streaming stores and for float32 halves; with ordinary ones, after
    # narrower steps, every pair of float16 rows and of interleaved rows, and to 2
    # pairs for the bfloat16 halves taken two per word) with the contract's bits,
    # and leaves the rest to the element loops untouched. float32 rows, and streaming
    # float16 rows, whose output starts off a 64-byte line by 16 to 48 bytes, of a
    # line's pairs and a step's or more, are done from the first pair on a line, with
    # steps of 16 and 32 bytes over the edges (see _Stream.off_line): all but the
    # pairs past the last 16 bytes, in place too but for streaming halves (the pairs
    # after the first half's last whole line are rotated twice, each half's elements
    # stored apart: the kernels never stream in place, see backend.streaming).
    # Outputs on a line and off it by 16 to 48 bytes, and by 4 (part of an interleaved
    # pair: as on a line); streaming stores need the output and its second half on 16
    # bytes: halves of 8 pairs there.
    # Interleaved rows of float32 and float16 also with cache rows that hold each value
    # twice, the sin rows' first negated (``duplicated``: what token-major kernels give
    # them, see kernels.duplicates_pairs), the pairs then rotated as they lie.
    from numba_rope._aligned import empty_on_line
    from numba_rope._cpu.backend import storage_dtype
    from numba_rope._cpu.vector import CONSTANT_HALVES

    steps = _vector_steps(interleaved, words, streaming)
    storage = storage_dtype(np.dtype(dtype))
    view = (lambda a: a) if storage is None else (lambda a: a.view(storage))
    itemsize = np.dtype(dtype).itemsize
    pair_bytes = itemsize * (2 if interleaved else 1)
    halves = {h for special in CONSTANT_HALVES for h in (special - 8, special, special + 8)}
    offsets = [0, 16, 32, 48]
    if not streaming:  # and the narrower steps after the widest (vector.*_TAIL_WIDTHS)
        halves |= {h for special in CONSTANT_HALVES for h in (special - 1, special + 1)}
        halves |= {1, 2, 3, 4, 5, 6, 7, 10, 12, 14, 20, 28}
        offsets.append(4)
    in_places = (False,) if streaming and not interleaved and not words else (False, True)
    for half, offset, in_place in itertools.product(sorted(halves | {8, 24}), offsets, in_places):
        x = rng.standard_normal(2 * half).astype(dtype)
        _, cos, sin, _ = make_case(rng, (1, 1, 1, 2 * half), dtype, position_ids=False)
        want = float32_contract(x[None, None, None], cos, sin, None, interleaved)[0, 0, 0]
        out = empty_on_line((2 * half,), dtype, offset=offset)
        out[:] = x if in_place else 0
        source = out if in_place else x
        cos_row, sin_row = view(cos[0, 0]), view(sin[0, 0])
        if duplicated:  # float32 rows of (half, 2), each value twice (token-major rows),
            # the sin row's first negated (kernels._token_cache_rows)
            cos_row, sin_row = (
                np.repeat(r.astype(np.float32), 2).reshape(half, 2) for r in (cos[0, 0], sin[0, 0])
            )
            sin_row[:, 0] = -sin_row[:, 0]
        done = steps(view(source), cos_row, sin_row, view(out), half)
        lead = -offset % 64
        lines = not words and (dtype == np.float32 or streaming)
        if not streaming and (interleaved or dtype == np.float16):  # vector.*_TAIL_WIDTHS
            assert done == half, (half, offset)
        elif not streaming and words:
            assert done == half - half % 2, (half, offset)
        elif lines and lead % 16 == 0 < lead and half >= max(16, 64 // pair_bytes):
            assert done == half - half % (16 // pair_bytes), (half, offset)
        else:
            assert done == half - half % 8, (half, offset)
        rotated = np.zeros(2 * half, bool)
        if interleaved:
            rotated[: 2 * done] = True
        else:
            rotated[:done] = rotated[half : half + done] = True
        assert_bitwise_equal(out[rotated], want[rotated])
        # left to the element loops
        untouched = x if in_place else np.zeros_like(x)
        assert_bitwise_equal(out[~rotated], untouched[~rotated])


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("shape", [(4, 8, 1, 128), (2, 3, 5, 128), (2, 3, 5, 72)])
def test_float32_outputs_off_a_line_give_the_contract_bits(rng, shape, interleaved):
    # Through the public call (decode and head-major rows, one tensor and q+k, in
    # place): outputs 16, 32 and 48 bytes past a 64-byte line, where float32 rows
    # start their vector steps on the line and cover the edges with narrower steps
    # (vector._Stream.off_line), and 4 bytes past (part of an interleaved pair).
    from numba_rope._aligned import empty_on_line

    x, cos, sin, ids = make_case(rng, shape, np.float32)
    k = rng.standard_normal((shape[0], 2, *shape[2:])).astype(np.float32)
    want_x = float32_contract(x, cos, sin, ids, interleaved)
    want_k = float32_contract(k, cos, sin, ids, interleaved)

    def placed(like, offset):
        return empty_on_line(like.shape, like.dtype, offset=offset)

    for offset in (16, 32, 48, 4):
        out, out_k = placed(x, offset), placed(k, offset)
        numba_rope.rotary_embedding(x, cos, sin, ids, interleaved=interleaved, out=out)
        assert_bitwise_equal(out, want_x)
        numba_rope.rotary_embedding_qk(
            x, k, cos, sin, ids, interleaved=interleaved, out_q=out, out_k=out_k
        )
        assert_bitwise_equal(out, want_x)
        assert_bitwise_equal(out_k, want_k)
        work = placed(x, offset)
        work[...] = x
        numba_rope.rotary_embedding(work, cos, sin, ids, interleaved=interleaved, out=work)
        assert_bitwise_equal(work, want_x)


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


def test_one_kernel_specialization_serves_inputs_and_outputs_of_any_layout(rng):
    # A contiguous input and a strided view of one, into a contiguous output and a
    # strided one: the contract bits each time, and the kernels' specializations hold
    # arrays of numba layout "A" only (see numba_rope._jit.compiled_for_any_layout).
    from numba import types

    from numba_rope._cpu import kernels as cpu_kernels

    x, cos, sin, ids = make_case(rng, (2, 3, 4, 16), np.float32)
    expected = float32_contract(x, cos, sin, ids)
    wide_x = np.zeros((2, 3, 4, 32), np.float32)
    wide_x[..., ::2] = x
    for given in (x, wide_x[..., ::2]):
        for out in (np.empty_like(x), np.zeros((2, 3, 4, 32), np.float32)[..., 16:]):
            numba_rope.rotary_embedding(given, cos, sin, ids, out=out)
            assert_bitwise_equal(out, expected)
    compiled = [
        kind
        for kernel in (cpu_kernels.serial, cpu_kernels.parallel, cpu_kernels.relayed)
        for args in kernel.overloads
        for kind in args
        if isinstance(kind, types.Array)
    ]
    assert compiled and all(kind.layout == "A" for kind in compiled)


def test_one_kernel_serves_every_option_set_through_the_runner_of_each(rng):
    # The kernels check a call and have its rows rotated by the runner of its options
    # (make_runner): the same compiled kernels for every option set, a runner of its
    # own for each, the contract bits each time. The compiled plans of repeated calls
    # (into a C-contiguous output and one whose rows lie apart) are compiled for arrays
    # of any layout.
    from numba import types

    from numba_rope._cpu import backend as cpu_backend
    from numba_rope._cpu import helper
    from numba_rope._cpu import kernels as cpu_kernels

    x, cos, sin, ids = make_case(rng, (2, 3, 4, 16), np.float32)
    runners, chosen = set(), set()
    for interleaved in (False, True):
        for inverse in (False, True):
            want = float32_contract(x, cos, -sin if inverse else sin, ids, interleaved)
            got = numba_rope.rotary_embedding(
                x, cos, sin, ids, interleaved=interleaved, inverse=inverse
            )
            assert_bitwise_equal(got, want)
            found = cpu_backend.kernels(interleaved, inverse, True)
            chosen.add((found.serial, found.parallel, found.relayed))
            runners.add(found.runner(x, None, cos, sin, ids))
    assert chosen == {(cpu_kernels.serial, cpu_kernels.parallel, cpu_kernels.relayed)}
    assert len(runners) == 4 and all(runners)
    assert len(helper._RUNNERS) >= 4
    wide = np.zeros((2, 3, 4, 32), np.float32)
    for out in (np.empty_like(x), wide[..., 8:24]):  # C-contiguous, then rows apart
        for _ in range(cpu_backend.FAST_AFTER + 2):  # a Python plan, then a compiled one
            numba_rope.rotary_embedding(x, cos, sin, ids, out=out)
            assert_bitwise_equal(out, float32_contract(x, cos, sin, ids))
    compiled = [
        kind
        for args in cpu_kernels.planned_one.overloads
        for kind in args
        if isinstance(kind, types.Array)
    ]
    assert compiled and all(kind.layout == "A" for kind in compiled)
