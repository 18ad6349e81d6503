"""Large outputs written with non-temporal stores (``numba_rope._cpu.vector``): the same
bits as the element loop, and only where the stores' alignment holds."""

from __future__ import annotations

import itertools

import numba
import numpy as np
import pytest
from oracles import BFLOAT16, assert_bitwise_equal, float32_contract, make_case
from plan_counting import fresh_plan_tables

import numba_rope
from numba_rope import config
from numba_rope._aligned import empty_on_line
from numba_rope._cpu import backend as cpu_backend
from numba_rope._cpu import vector as cpu_vector

STREAMED = [np.dtype(np.float32), np.dtype(np.float16), BFLOAT16]


def rows(test):
    """Every row width of the vector steps (see the streamed test), both pair orders,
    each dtype."""
    marks = (
        pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"]),
        pytest.mark.parametrize("dtype", STREAMED, ids=[d.name for d in STREAMED]),
        pytest.mark.parametrize(
            ("head_size", "rotary_dim"),
            [(128, 128), (96, 48), (40, 24), (32, 16), (60, 48), (176, 176), (104, 80), (56, 56)],
            ids=[
                "full",
                "partial",
                "half-12",
                "half-8",
                "copy-12",
                "half-88",
                "half-40",
                "half-28",
            ],
        ),
    )
    for mark in reversed(marks):
        test = mark(test)
    return test


def aligned(shape, dtype, offset=0):
    """An empty array whose data starts ``offset`` bytes past a 64-byte boundary."""
    return empty_on_line(tuple(shape), dtype, offset=offset)


def test_empty_on_line_places_data_at_any_offset_past_a_line():
    # Offsets from 0 to boundary - 1, sizes of one byte to many lines, wherever NumPy's
    # allocator put the buffer: the data start there and end inside the buffer.
    for boundary in (64, 4096):
        for offset in sorted({0, 1, 4, 16, 48, 63, boundary - 1}):
            for n in (1, 7, 64, 1000, 4097):
                a = empty_on_line((n,), np.uint8, boundary=boundary, offset=offset)
                assert a.shape == (n,) and a.ctypes.data % boundary == offset
                assert a.ctypes.data + n <= a.base.ctypes.data + a.base.nbytes
    with pytest.raises(ValueError, match=r"\[0, 64\), got -1"):
        empty_on_line((4,), np.float32, offset=-1)


@pytest.fixture
def stream_always(monkeypatch):
    """Every eligible output streams, however small; calls never take a plan (plans run
    small inputs, which never stream), and the kernel options asked for are recorded."""
    monkeypatch.setattr(config, "STREAMING_MIN_BYTES", 0)
    fresh_plan_tables(monkeypatch)
    monkeypatch.setattr(cpu_backend, "remember_plan", lambda key, plan: None)
    requested = []
    kernels = cpu_backend.kernels

    def recording(*args):
        requested.append(args)
        return kernels(*args)

    monkeypatch.setattr(cpu_backend, "kernels", recording)
    return requested


def _streamed(requested):
    return [options[5] and options[2] for options in requested]


@rows
def test_streamed_rows_give_the_contract_bits(
    rng, stream_always, dtype, head_size, rotary_dim, interleaved
):
    # Pairs 16 at a time with non-temporal stores, then at most one step of 8 (half
    # 64 = 4 x 16; 88 = 5 x 16 + 8; 40 = 2 x 16 + 8; 24 = 16 + 8; 8 = 8; bfloat16 words
    # without interleaving take 32 pairs, then 16, then 8); the channels past
    # rotary_dim the same way (104 - 80 = 16 + 8). Rows that would leave pairs or
    # channels to the element loop's ordinary stores do not stream (half 28 = 16 + 8
    # + 4, 12 = 8 + 4; 60 - 48 = 8 + 4), nor do 16-bit rows with half 12, whose
    # second half is 24 bytes in (without interleaving), and 16-bit rows of 60 or 56
    # elements, 120 or 112 bytes apart: those take the element loops.
    _check_streamed_rows(rng, stream_always, dtype, head_size, rotary_dim, interleaved)


def _bfloat16_from_a_line(rotary_dim, interleaved):
    # Whether bfloat16 outputs stream from a 64-byte line only (backend.stream_start):
    # rows of non-interleaved pairs, but those whose halves are whole lines where the
    # word steps fill a line (AVX-512 targets, vector.words_fill_lines).
    whole_lines = (rotary_dim // 2 * 2) % 64 == 0
    return not interleaved and not (whole_lines and cpu_vector.words_fill_lines())


def _streams_from(out, rotary_dim, interleaved):
    # Whether an output starts where it may stream: from a line (see above), or from
    # 16 bytes.
    if out.dtype == BFLOAT16 and _bfloat16_from_a_line(rotary_dim, interleaved):
        return out.ctypes.data % 64 == 0
    return out.ctypes.data % cpu_vector.STREAM_ALIGNMENT == 0


def _check_streamed_rows(rng, requested, dtype, head_size, rotary_dim, interleaved, in_place=True):
    aligned_part = rotary_dim if interleaved else rotary_dim // 2
    streams = all(
        (size * dtype.itemsize) % cpu_vector.STREAM_ALIGNMENT == 0
        for size in (aligned_part, head_size)
    )
    # and every element stored by the vector steps (see backend.streaming)
    streams = streams and (rotary_dim // 2) % 8 == 0 and (head_size - rotary_dim) % 8 == 0
    shape = (2, 3, 5, head_size)
    x, cos, sin, ids = make_case(rng, shape, dtype, rotary_dim=rotary_dim)
    options = {"rotary_embedding_dim": rotary_dim, "interleaved": interleaved}
    want = float32_contract(x, cos, sin, ids, interleaved, rotary_dim)
    out = aligned(shape, dtype)
    assert numba_rope.rotary_embedding(x, cos, sin, ids, out=out, **options) is out
    assert_bitwise_equal(out, want)
    allocated = numba_rope.rotary_embedding(x, cos, sin, ids, **options)
    assert_bitwise_equal(allocated, want)
    # Small allocated outputs lie where NumPy puts them: some bfloat16 ones streamed
    # from a line only (backend.stream_start).
    expected = [streams, streams and _streams_from(allocated, rotary_dim, interleaved)]
    if dtype == np.float32 and head_size == 128:  # the sign is one code for all dtypes
        inverse = numba_rope.rotary_embedding(out, cos, sin, ids, inverse=True, **options)
        want_inverse = float32_contract(out, cos, -sin, ids, interleaved, rotary_dim)
        assert_bitwise_equal(inverse, want_inverse)
        expected.append(streams and _streams_from(inverse, rotary_dim, interleaved))
    if in_place:
        work = aligned(shape, dtype)
        work[...] = x
        numba_rope.rotary_embedding(work, cos, sin, ids, out=work, **options)
        assert_bitwise_equal(work, want)
        # In place, ordinary stores: each line was just read (see backend.streaming);
        # also through another view of the same elements.
        work[...] = x
        numba_rope.rotary_embedding(work[...], cos, sin, ids, out=work, **options)
        assert_bitwise_equal(work, want)
        assert _streamed(requested[-2:]) == [False, False]
        del requested[-2:]
    k = rng.standard_normal((2, 1, 5, head_size)).astype(dtype)
    got_q, got_k = numba_rope.rotary_embedding_qk(
        x, k, cos, sin, ids, out_q=aligned(shape, dtype), out_k=aligned(k.shape, dtype), **options
    )
    assert_bitwise_equal(got_q, want)
    assert_bitwise_equal(got_k, float32_contract(k, cos, sin, ids, interleaved, rotary_dim))
    assert _streamed(requested) == [*expected, streams]


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BFLOAT16], ids=["float32", "bfloat16"])
def test_streamed_rows_in_the_parallel_kernels(rng, monkeypatch, stream_always, dtype, interleaved):
    # The same row code, inlined into the parallel kernels (single and q+k): float32
    # (element vectors) and bfloat16 (word vectors); float16 shares float32's path.
    monkeypatch.setattr(config, "PARALLEL_MIN_ELEMENTS", 0)
    _check_streamed_rows(rng, stream_always, dtype, 96, 48, interleaved, in_place=False)
    streamed = _streamed(stream_always)  # out= and q+k into outputs on lines
    assert streamed[0] and streamed[-1]


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", STREAMED, ids=[d.name for d in STREAMED])
def test_streamed_outputs_off_a_line_give_the_contract_bits(rng, stream_always, dtype, interleaved):
    # Rows off a 64-byte line: streamed rows start their loops on the line, with steps
    # of 16 and 32 bytes over the edges (vector._Stream.off_line), and so does the copy
    # of the channels past rotary_dim; rows of non-interleaved pairs whose halves are
    # whole lines shift the steps of a row on a line into their lines
    # (vector._Stream.shifted_lines). Rows of 64 and 88 pairs (176 channels: a 16-bit
    # second half off its first half's line; rows of 704 and 352 bytes, every other one
    # or three in four off a line from an output on one), of 40 and 32 with channels
    # past rotary_dim (24 and 64 of them); one tensor and q+k. An output whose first
    # element is off a line (NumPy's large arrays start 16 bytes past one) streams, but
    # for bfloat16 rows of non-interleaved pairs whose halves are not whole lines (88
    # and 40 pairs), or on targets without AVX-512 any (backend.stream_start), which
    # take ordinary stores, to the same bits.
    expected = []
    for (head_size, rotary_dim), offset in itertools.product(
        [(128, 128), (176, 176), (104, 80), (128, 64)], (0, 16, 32, 48)
    ):
        from_a_line = dtype == BFLOAT16 and _bfloat16_from_a_line(rotary_dim, interleaved)
        expected += [offset == 0 or not from_a_line] * 2
        shape = (2, 3, 5, head_size)
        x, cos, sin, ids = make_case(rng, shape, dtype, rotary_dim=rotary_dim)
        k = rng.standard_normal((2, 1, 5, head_size)).astype(dtype)
        options = {"rotary_embedding_dim": rotary_dim, "interleaved": interleaved}
        want = float32_contract(x, cos, sin, ids, interleaved, rotary_dim)
        out = aligned(shape, dtype, offset)
        numba_rope.rotary_embedding(x, cos, sin, ids, out=out, **options)
        assert_bitwise_equal(out, want)
        out_q, out_k = aligned(shape, dtype, offset), aligned(k.shape, dtype, offset)
        numba_rope.rotary_embedding_qk(x, k, cos, sin, ids, out_q=out_q, out_k=out_k, **options)
        assert_bitwise_equal(out_q, want)
        assert_bitwise_equal(out_k, float32_contract(k, cos, sin, ids, interleaved, rotary_dim))
    assert _streamed(stream_always) == expected


def test_streamed_rows_with_float32_caches_and_no_position_ids(rng, stream_always):
    for dtype in (np.float16, BFLOAT16):
        x, cos, sin, _ = make_case(
            rng, (2, 2, 3, 32), dtype, position_ids=False, cache_dtype=np.float32
        )
        got = numba_rope.rotary_embedding(x, cos, sin, out=aligned(x.shape, x.dtype))
        assert_bitwise_equal(got, float32_contract(x, cos, sin))
    assert all(_streamed(stream_always))


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_streamed_16_bit_rows_with_float32_caches_off_a_line(rng, stream_always, interleaved):
    # 16-bit rows with float32 caches take the element steps (bfloat16 too: words need
    # bfloat16 caches), whose edges off a line store 16 bytes; their bfloat16 results
    # stay in registers for the non-temporal store (test_targets.py checks the code).
    # float16 outputs 16 and 48 bytes past a line, bfloat16 ones too where they stream
    # so (rows of 128 rotated: halves of two whole lines, vector._Stream.shifted_lines,
    # without interleaving; on AVX-512 targets); bfloat16 ones of 144 rotated channels,
    # which stream only from a line without interleaving (backend.stream_start), on
    # one, with rows of 288 bytes: every other row 32 bytes past a line; with 128 of
    # them rotated, halves of two whole lines, float16 too.
    bfloat16_offsets = (0, 0) if _bfloat16_from_a_line(128, interleaved) else (16, 48)
    for dtype, head_size, rotary_dim, offset in (
        (np.float16, 128, 128, 16),
        (np.float16, 128, 128, 48),
        *((BFLOAT16, 128, 128, offset) for offset in bfloat16_offsets),
        (BFLOAT16, 144, 144, 0),
        (BFLOAT16, 144, 128, 0),
        (np.float16, 144, 128, 0),
    ):
        shape = (2, 3, 5, head_size)
        x, cos, sin, ids = make_case(
            rng, shape, dtype, rotary_dim=rotary_dim, cache_dtype=np.float32
        )
        want = float32_contract(x, cos, sin, ids, interleaved, rotary_dim)
        out = aligned(shape, dtype, offset)
        numba_rope.rotary_embedding(
            x, cos, sin, ids, out=out, interleaved=interleaved, rotary_embedding_dim=rotary_dim
        )
        assert_bitwise_equal(out, want)
    assert len(stream_always) == 7
    assert all(_streamed(stream_always))


def test_streamed_special_values(stream_always):
    # NaN, infinities, overflow and signaling NaNs through the vector conversions.
    values = np.array([np.nan, np.inf, -np.inf, 1.0, 0.0, -2.5, 3e38, np.inf], np.float64)
    for dtype in STREAMED:
        with np.errstate(over="ignore"):  # 3e38 is infinite in float16: data here
            x = np.resize(values, (1, 1, 2, 16)).astype(dtype)
            cos = np.resize(np.array([0.5, 1.0, np.nan, 0.0, 3e38]), (1, 8)).astype(dtype)
            sin = np.resize(np.array([0.25, 0.0, 1.0, np.inf, 3e38]), (1, 8)).astype(dtype)
        if dtype == BFLOAT16:
            x.view(np.uint16)[0, 0, 1, :3] = (0x7F81, 0xFFA0, 0x7FBF)
        ids = np.zeros((1, 2), np.int64)
        got = numba_rope.rotary_embedding(x, cos, sin, ids, out=aligned(x.shape, dtype))
        assert_bitwise_equal(got, float32_contract(x, cos, sin, ids))
        assert np.isnan(got.astype(np.float32)).any() and np.isinf(got.astype(np.float32)).any()
    assert all(_streamed(stream_always))


def test_what_streams(monkeypatch):
    monkeypatch.setattr(config, "STREAMING_MIN_BYTES", 1 << 12)
    big = aligned((1, 4, 8, 64), np.float32)  # 8 KiB
    assert cpu_backend.streaming(64, False, big)
    assert cpu_backend.streaming(32, False, big)  # partial: half 16 floats
    assert cpu_backend.streaming(64, True, big)
    assert cpu_backend.streaming(16, True, big)  # interleaved: 8 pairs, no second half
    assert not cpu_backend.streaming(2, True, big)  # channels past rotary_dim 8 bytes in
    # Rows whose vector steps would leave pairs or channels to the element loop's
    # ordinary stores, into the lines streamed: 4 or 12 pairs (16 or 48 bytes, on 16),
    # 4 channels past rotary_dim (the 60 of a row of 64, 56 rotated).
    assert not cpu_backend.streaming(4, True, big)
    assert not cpu_backend.streaming(24, True, big)
    assert not cpu_backend.streaming(24, False, big)
    wide = aligned((1, 4, 8, 68), np.float32)  # rows of 272 bytes
    assert not cpu_backend.streaming(64, False, wide)  # 4 channels past rotary_dim
    assert cpu_backend.streaming(48, False, wide[..., :64])  # 24 pairs, 16 channels past
    # bfloat16 words without interleaving: 8 pairs a step too (4 words)
    words = aligned((1, 4, 16, 80), np.int16)
    assert cpu_vector.STREAM_PAIRS == 8
    assert cpu_backend.streaming(48, False, words)  # 24 pairs
    assert cpu_backend.streaming(16, False, words)  # 8 pairs
    assert not cpu_backend.streaming(24, False, words)  # 12 pairs
    assert not cpu_backend.streaming(64, False, big[:, :1, :2])  # 512 bytes: too small
    assert cpu_backend.streaming(64, False, big[:, :1, :2], big)  # q and k count together
    # Not in place: an output that is its input's elements, as the same array or another
    # view of them; an input elsewhere (or over other elements of the buffer) streams.
    assert not cpu_backend.streaming(64, False, big, inputs=(big,))
    assert not cpu_backend.streaming(64, False, big, inputs=(big[...],))
    other = aligned(big.shape, np.float32)
    assert not cpu_backend.streaming(64, False, other, big, inputs=(other.copy(), big[...]))
    assert cpu_backend.streaming(64, False, big, inputs=(other,))
    assert cpu_backend.streaming(64, False, big[:, :2], inputs=(big[:, 2:],))
    assert not cpu_backend.streaming(2, False, big)  # second half 4 bytes in
    assert not cpu_backend.streaming(64, False, aligned((1, 4, 8, 64), np.float32, offset=4))
    # The first element on 16 bytes for float32 and float16 (uint16), and for bfloat16
    # (int16 storage) rows of interleaved pairs, or whose halves are whole 64-byte lines
    # (32 pairs: 64 bytes) where the word steps fill a line; other bfloat16 rows on a
    # line (see backend.stream_start).
    whole_lines = cpu_vector.words_fill_lines()
    for offset in (16, 32, 48):
        assert cpu_backend.streaming(64, False, aligned((1, 4, 8, 64), np.float32, offset=offset))
        assert not cpu_backend.streaming(
            80, False, aligned((1, 4, 16, 80), np.int16, offset=offset)
        )
        assert cpu_backend.streaming(80, True, aligned((1, 4, 16, 80), np.int16, offset=offset))
        assert (
            cpu_backend.streaming(64, False, aligned((1, 4, 16, 80), np.int16, offset=offset))
            == whole_lines
        )
        assert cpu_backend.streaming(80, False, aligned((1, 4, 16, 80), np.uint16, offset=offset))
    assert cpu_backend.streaming(80, False, aligned((1, 4, 16, 80), np.int16))
    assert not cpu_backend.streaming(64, False, aligned((1, 4, 8, 64), np.float64))
    assert not cpu_backend.streaming(60, False, aligned((1, 4, 8, 60), np.float32))  # rows 240 B
    uint16 = aligned((1, 4, 16, 80), np.uint16)  # 16-bit storage: rows of 160 bytes
    assert cpu_backend.streaming(80, False, uint16)
    assert not cpu_backend.streaming(72, False, uint16[..., :72])  # second half 72 bytes in
    assert not cpu_backend.streaming(64, False, uint16[..., 1:65])  # rows start 2 bytes in
    assert not cpu_backend.streaming(8, False, uint16)  # second half 8 bytes in
    assert cpu_backend.streaming(16, True, uint16)
    assert not cpu_backend.streaming(8, True, uint16)  # 4 pairs
    monkeypatch.setattr(config, "STREAMING_MIN_BYTES", 1 << 30)
    assert not cpu_backend.streaming(64, False, big)


def test_large_default_call_streams_and_small_one_does_not(rng, monkeypatch):
    # With the default threshold: a 16 MiB float16 output streams, a small one does not.
    requested = []
    kernels = cpu_backend.kernels
    monkeypatch.setattr(
        cpu_backend, "kernels", lambda *args: requested.append(args) or kernels(*args)
    )
    x, cos, sin, ids = make_case(rng, (1, 16, 4096, 128), np.float16, n_positions=4096)
    assert x.nbytes == config.STREAMING_MIN_BYTES
    got = numba_rope.rotary_embedding(x, cos, sin, ids)
    assert_bitwise_equal(got[:, :, :64], float32_contract(x[:, :, :64], cos, sin, ids[:, :64]))
    assert_bitwise_equal(got[:, -2:], float32_contract(x[:, -2:], cos, sin, ids))
    assert _streamed(requested) == [True]
    requested.clear()
    numba_rope.rotary_embedding(x[:, :, :64], cos, sin, ids[:, :64])
    assert _streamed(requested) == [False]


def test_plans_leave_streamed_outputs_to_the_general_path(rng, monkeypatch):
    # A repeated call normally runs a plan (one thread, ordinary stores); an output at
    # or above the streaming threshold takes the general path every time, so a lowered
    # threshold applies to small repeated calls as well (single and q+k).
    monkeypatch.setattr(config, "STREAMING_MIN_BYTES", 0)
    fresh_plan_tables(monkeypatch)
    requested = []
    kernels = cpu_backend.kernels
    monkeypatch.setattr(
        cpu_backend, "kernels", lambda *args: requested.append(args) or kernels(*args)
    )
    x, cos, sin, ids = make_case(rng, (2, 3, 5, 32), np.float32)
    k = rng.standard_normal((2, 1, 5, 32)).astype(np.float32)
    for _ in range(3):
        got = numba_rope.rotary_embedding(x, cos, sin, ids, out=aligned(x.shape, x.dtype))
        assert_bitwise_equal(got, float32_contract(x, cos, sin, ids))
        got_q, got_k = numba_rope.rotary_embedding_qk(
            x, k, cos, sin, ids, out_q=aligned(x.shape, x.dtype), out_k=aligned(k.shape, k.dtype)
        )
        assert_bitwise_equal(got_q, float32_contract(x, cos, sin, ids))
        assert_bitwise_equal(got_k, float32_contract(k, cos, sin, ids))
    assert _streamed(requested) == [True] * 6


@rows
def test_vector_steps_with_ordinary_stores_give_the_contract_bits(
    rng, dtype, head_size, rotary_dim, interleaved
):
    # Rows too small to stream take the same vector steps with ordinary stores (16
    # pairs, then 8, then the element loop), on outputs at any element offset, in place
    # and not, with caches of the input's dtype or float32, and for the inverse.
    shape = (2, 3, 5, head_size)
    x, cos, sin, ids = make_case(rng, shape, dtype, rotary_dim=rotary_dim)
    options = {"rotary_embedding_dim": rotary_dim, "interleaved": interleaved}
    for caches in ((cos, sin), (cos.astype(np.float32), sin.astype(np.float32))):
        want = float32_contract(x, *caches, ids, interleaved, rotary_dim)
        out = aligned(shape, dtype, offset=dtype.itemsize)  # off any vector boundary
        for _ in range(2):  # the general path, then the plan
            assert numba_rope.rotary_embedding(x, *caches, ids, out=out, **options) is out
            assert_bitwise_equal(out, want)
            work = x.copy()
            numba_rope.rotary_embedding(work, *caches, ids, out=work, **options)
            assert_bitwise_equal(work, want)
            back = numba_rope.rotary_embedding(out, *caches, ids, inverse=True, **options)
            assert_bitwise_equal(
                back, float32_contract(out, caches[0], -caches[1], ids, interleaved, rotary_dim)
            )


@pytest.mark.parametrize("storage", [np.float32, np.uint16, np.int16])
def test_stream_copy_of_channels_from_any_16_bytes(storage):
    # The copy of the channels past rotary_dim (vector.stream_copy) starts where a row's
    # rotated pairs end, on 16 bytes: from the first element on a 64-byte line, with
    # steps of 16 and 32 bytes before it and after the last whole step (see
    # _Stream.off_line), where it starts off a line by 16 to 48 bytes and copies a
    # line's elements or more; from its start otherwise. It copies every element up to
    # what it returns (the largest multiple of 8, or of 16 bytes off a line, up to the
    # end) and none past it.
    from numba_rope._cpu.vector import stream_copy

    @numba.njit
    def copy(x_row, out_row, start, end):
        return stream_copy(x_row, out_row, start, end, True)

    itemsize = np.dtype(storage).itemsize
    per_line = 64 // itemsize
    for count, offset in itertools.product(range(4, 104, 4), (0, 16, 32, 48)):
        start = 2 * per_line  # the rotated pairs' part of the row
        x = np.arange(1, start + count + 1).astype(storage)
        out = empty_on_line(x.shape, np.dtype(storage), offset=offset)
        out[:] = 0
        done = copy(x, out, start, start + count)
        off = offset and count >= max(16, per_line)
        assert done == start + (count - count % (16 // itemsize) if off else count - count % 8)
        assert_bitwise_equal(out[start:done], x[start:done])
        assert not out[:start].any() and not out[done:].any()
