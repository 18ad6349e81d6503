"""Unusual arguments get the right answer or a clear refusal, whatever came before:
byte order, outputs whose elements overlap, integers at the edges, ndarray subclasses,
option flags, tuning constants, errors that name the right argument (issue 14)."""

from __future__ import annotations

import numpy as np
import pytest
from oracles import BFLOAT16, DTYPES, assert_bitwise_equal, float32_contract, make_case

import numba_rope
from numba_rope import config

DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
I64_MAX = int(np.iinfo(np.int64).max)


def swapped(a: np.ndarray) -> np.ndarray:
    """The same values in the other byte order."""
    return a.astype(a.dtype.newbyteorder("S"))


# -- byte order -------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@pytest.mark.parametrize("argument", ["input", "cos_cache", "sin_cache", "position_ids", "out"])
def test_non_native_byte_order_is_refused_by_name(rng, device, dtype, argument):
    on, off = device
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 8), dtype)
    arrays = {"input": x, "cos_cache": cos, "sin_cache": sin, "position_ids": ids}
    out = np.full_like(x, 7)
    if argument == "out":
        out = swapped(out)
    else:
        arrays[argument] = swapped(arrays[argument])
    assert not (out if argument == "out" else arrays[argument]).dtype.isnative
    device_out = on(out)
    with pytest.raises(TypeError, match=rf"{argument} has dtype .* non-native byte order"):
        numba_rope.rotary_embedding(**{k: on(v) for k, v in arrays.items()}, out=device_out)
    np.testing.assert_array_equal(off(device_out).astype(np.float64), 7)  # nothing written


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_non_native_offsets_and_qk_are_refused(rng, device):
    on, _ = device
    x, cos, sin, _ = make_case(rng, (2, 3, 4, 8), np.float32)
    offsets = swapped(np.array([0, 1], np.int64))
    with pytest.raises(TypeError, match="position_offset has dtype"):
        numba_rope.rotary_embedding(on(x), on(cos), on(sin), position_offset=on(offsets))
    with pytest.raises(TypeError, match="k has dtype"):
        numba_rope.rotary_embedding_qk(on(x), on(swapped(x)), on(cos), on(sin), position_offset=0)


def test_mixed_byte_order_caches_are_named_not_called_different_dtypes(rng):
    x, cos, sin, ids = make_case(rng, (1, 2, 3, 8), np.float32)
    with pytest.raises(TypeError, match="sin_cache has dtype >f4"):
        numba_rope.rotary_embedding(x, cos, swapped(sin), ids)


# -- outputs whose elements share memory --------------------------------------------------


def _overlapping_outputs(x: np.ndarray):
    """Writeable arrays of x's shape whose elements share memory."""
    zero_stride = np.lib.stride_tricks.as_strided(
        np.zeros(x.shape[-1], x.dtype), x.shape, (0, 0, 0, x.itemsize)
    )
    buffer = np.zeros(x.size, x.dtype)  # rows that overlap their neighbours by half
    half_rows = np.lib.stride_tricks.as_strided(
        buffer,
        x.shape,
        (
            x.shape[1] * x.shape[2] * x.shape[3] // 2 * x.itemsize,
            x.shape[2] * x.shape[3] // 2 * x.itemsize,
            x.shape[3] // 2 * x.itemsize,
            x.itemsize,
        ),
    )
    return {"zero stride": zero_stride, "half-overlapping rows": half_rows}


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@pytest.mark.parametrize("kind", ["zero stride", "half-overlapping rows"])
def test_outputs_with_overlapping_elements_are_refused(rng, dtype, kind):
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 8), dtype)
    numba_rope.rotary_embedding(x, cos, sin, ids, out=np.empty_like(x))  # a plan for it
    out = _overlapping_outputs(x)[kind]
    before = out.copy()
    assert out.flags.writeable
    for _ in range(2):  # the general path, and again where a plan exists
        with pytest.raises(ValueError, match="out has elements that share memory"):
            numba_rope.rotary_embedding(x, cos, sin, ids, out=out)
    np.testing.assert_array_equal(out, before)
    # In place on an input whose rows overlap: the same refusal.
    with pytest.raises(ValueError, match="share memory"):
        numba_rope.rotary_embedding(out, cos, sin, ids, out=out)
    with pytest.raises(ValueError, match="out_k has elements that share memory"):
        numba_rope.rotary_embedding_qk(x, x.copy(), cos, sin, ids, out_k=out)


def test_broadcast_inputs_are_read_correctly(rng):
    # Zero strides in an input (not an output) are only read: the result is right.
    x, cos, sin, ids = make_case(rng, (1, 1, 4, 8), np.float32)
    wide = np.broadcast_to(x, (3, 5, 4, 8))
    ids3 = np.broadcast_to(ids, (3, 4))
    got = numba_rope.rotary_embedding(wide, cos, sin, ids3)
    assert_bitwise_equal(got, float32_contract(np.ascontiguousarray(wide), cos, sin, ids3))


# -- integers at the edges ----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("offset", [2**63, 2**64 - 1, 2**70, -(2**70)])
def test_python_int_offsets_beyond_int64(rng, device, offset):
    on, off = device
    x, cos, sin, _ = make_case(rng, (2, 3, 4, 8), np.float32, position_ids=True)
    with pytest.raises(IndexError, match=rf"position_offset = {offset} puts positions"):
        numba_rope.rotary_embedding(on(x), on(cos), on(sin), position_offset=offset)
    # No token, no position: any integer offset is accepted and nothing is rotated.
    empty = on(np.zeros((2, 3, 0, 8), np.float32))
    got = numba_rope.rotary_embedding(empty, on(cos), on(sin), position_offset=offset)
    assert off(got).shape == (2, 3, 0, 8)


@pytest.mark.gpu
def test_unchecked_offsets_near_the_top_of_uint64_give_nan_rows(rng, gpu):
    on, off = gpu
    x, cos, sin, _ = make_case(rng, (3, 2, 4, 8), np.float32, position_ids=True)
    n = cos.shape[0]
    # 2**64 - 2 is -2 in int64: plus s = 2 or 3 it would land on rows 0 and 1.
    offsets = np.array([0, 2**64 - 2, I64_MAX], np.uint64)
    got = off(
        numba_rope.rotary_embedding(
            on(x), on(cos), on(sin), position_offset=on(offsets), check_position_ids=False
        )
    )
    assert np.isnan(got[1:]).all()  # every token of the bad entries, every channel
    ids = (np.arange(4)[None, :] + np.zeros((1, 1), np.int64)) % n
    assert_bitwise_equal(got[:1], float32_contract(x[:1], cos, sin, ids))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_a_signaling_nan_in_a_cache_gives_nan_and_no_warning(device):
    """A signaling NaN (an invalid operand to IEEE arithmetic) in sin_cache: the
    channels it multiplies are NaN, the others exact, and no warning (the tests turn
    warnings into errors; the simulator's multiplication by the sign, in NumPy
    scalars, had warned)."""
    on, off = device
    x = np.ones((1, 1, 1, 4), np.float32)
    cos = np.ones((1, 1, 2), np.float32)
    sin = np.zeros((1, 1, 2), np.float32)
    sin.view(np.uint32)[0, 0, 0] = 0x7F800001
    got = off(numba_rope.rotary_embedding(on(x), on(cos), on(sin)))
    assert np.isnan(got[0, 0, 0, [0, 2]]).all()
    assert_bitwise_equal(got[0, 0, 0, [1, 3]], np.ones(2, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int8])
def test_unchecked_negative_offsets_leave_the_tokens_they_reach_rotated(rng, gpu, dtype):
    """Unchecked, an offset works as the position ids ``offset + arange(seq_len)``:
    with a negative one only the tokens before row 0 get NaN rows, the others their
    rotation, as with an int offset or those ids (the array form had given every token
    of the entry NaN, the rule of uint64 offsets above 2**63)."""
    on, off = gpu
    x, cos, sin, _ = make_case(rng, (3, 2, 4, 8), np.float32, position_ids=True)
    offsets = np.array([-1, -3, -(2**63) if dtype == np.int64 else -100], dtype)
    got = off(
        numba_rope.rotary_embedding(
            on(x), on(cos), on(sin), position_offset=on(offsets), check_position_ids=False
        )
    )
    for b, first_good in ((0, 1), (1, 3)):
        assert np.isnan(got[b, :, :first_good]).all()
        ids = np.arange(first_good, 4)[None, :] + offsets[b].astype(np.int64)
        want = float32_contract(x[b : b + 1, :, first_good:], cos, sin, ids)
        assert_bitwise_equal(got[b : b + 1, :, first_good:], want)
    assert np.isnan(got[2]).all()
    by_int = off(
        numba_rope.rotary_embedding(
            on(x[:1]), on(cos), on(sin), position_offset=-1, check_position_ids=False
        )
    )
    assert_bitwise_equal(by_int, got[:1])


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("value", [I64_MAX, -1, -(2**63)])
def test_int64_edge_offsets_and_ids_are_refused(rng, device, value):
    on, _ = device
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 8), np.float32)
    offsets = np.array([0, value], np.int64)
    with pytest.raises(IndexError, match=rf"position_offset\[1\] = {value}"):
        numba_rope.rotary_embedding(on(x), on(cos), on(sin), position_offset=on(offsets))
    ids = ids.copy()
    ids[1, 3] = value
    with pytest.raises(IndexError, match=rf"position_ids\[1, 3\] = {value}"):
        numba_rope.rotary_embedding(on(x), on(cos), on(sin), on(ids))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("value", [None, 0, 1, "yes", np.array([True])])
def test_check_position_ids_must_be_a_bool(rng, device, value):
    on, _ = device
    x, cos, sin, ids = make_case(rng, (1, 2, 3, 8), np.float32)
    for _ in range(2):  # also where a plan exists for the signature
        numba_rope.rotary_embedding(on(x), on(cos), on(sin), on(ids))
        with pytest.raises(TypeError, match="check_position_ids must be True or False"):
            numba_rope.rotary_embedding(on(x), on(cos), on(sin), on(ids), check_position_ids=value)


# -- GPU in place with unchecked bad ids ----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("qk", [False, True])
def test_unchecked_bad_ids_in_place_give_a_row_of_nan_every_channel(rng, gpu, qk):
    on, off = gpu
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 8), np.float32, rotary_dim=4)
    ids = ids.copy()
    ids[1, 2] = cos.shape[0] + 5  # bad
    dx = on(x)
    if qk:
        dk = on(x[:, :1].copy())
        numba_rope.rotary_embedding_qk(
            dx, dk, on(cos), on(sin), on(ids), rotary_embedding_dim=4, out_q=dx, out_k=dk,
            check_position_ids=False,
        )  # fmt: skip
        results = [off(dx), off(dk)]
    else:
        numba_rope.rotary_embedding(
            dx, on(cos), on(sin), on(ids), rotary_embedding_dim=4, out=dx, check_position_ids=False
        )
        results = [off(dx)]
    for got in results:
        assert np.isnan(got[1, :, 2]).all()  # the pass-through channels 4..7 too
        good = np.ones(got.shape, bool)
        good[1, :, 2] = False
        assert not np.isnan(got[good]).any()


# -- ndarray subclasses, flags and constants: the same answer whatever came before ---------


@pytest.mark.parametrize("make", ["masked", "matrix-like subclass"])
def test_ndarray_subclasses_that_change_meaning_are_refused(rng, make):
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 8), np.float32)

    class Tagged(np.ndarray):
        pass

    odd = np.ma.masked_array(x, mask=x > 0.5) if make == "masked" else x.view(Tagged)
    for _ in range(2):  # before and after plain calls of the same shapes
        with pytest.raises(TypeError, match=r"input is a .*; rotary_embedding accepts NumPy"):
            numba_rope.rotary_embedding(odd, cos, sin, ids)
        numba_rope.rotary_embedding(x, cos, sin, ids)
    with pytest.raises(TypeError, match="out is a"):
        numba_rope.rotary_embedding(x, cos, sin, ids, out=np.empty_like(x).view(Tagged))


def test_memmap_is_an_ndarray_like_any_other(rng, tmp_path):
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 8), np.float32)
    mapped = np.memmap(tmp_path / "x.bin", np.float32, "w+", shape=x.shape)
    mapped[...] = x
    numba_rope.rotary_embedding(mapped, cos, sin, ids, out=mapped)
    assert_bitwise_equal(np.asarray(mapped), float32_contract(x, cos, sin, ids))


@pytest.mark.parametrize(
    ("name", "value"),
    [("TOKENS_PER_TILE", 0), ("TOKENS_PER_TILE", -4), ("CHUNKS_PER_THREAD", 0),
     ("HELPER_CHUNKS_PER_THREAD", 0), ("CUDA_THREADS_PER_BLOCK", 2048),
     ("CUDA_HEADS_PER_THREAD", 1.0), ("PARALLEL_MIN_ELEMENTS", -1), ("STREAMING_MIN_BYTES", None), ("CUDA_MAX_BLOCKS", True)],
)  # fmt: skip
def test_tuning_constants_are_checked_when_set(rng, name, value):
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 8), np.float32)
    before = getattr(config, name)
    with pytest.raises(ValueError, match=rf"numba_rope.config.{name} must be an integer"):
        setattr(config, name, value)
    assert getattr(config, name) == before
    want = float32_contract(x, cos, sin, ids)
    for _ in range(2):  # the general path, then the plan: both still right
        assert_bitwise_equal(numba_rope.rotary_embedding(x, cos, sin, ids), want)


def test_a_misspelt_tuning_constant_is_refused():
    """A name that is not a constant would be set and never read: AttributeError
    naming the closest constant, nothing set; private names stay settable."""
    with pytest.raises(AttributeError, match="did you mean PARALLEL_MIN_ELEMENTS"):
        config.PARALEL_MIN_ELEMENTS = 5
    assert not hasattr(config, "PARALEL_MIN_ELEMENTS")
    with pytest.raises(AttributeError, match=r"no constant TILE_TOKENS.*TOKENS_PER_TILE"):
        config.TILE_TOKENS = 8


def test_tuning_constants_accept_integers_of_any_kind(monkeypatch):
    monkeypatch.setattr(config, "TOKENS_PER_TILE", np.int64(8))
    assert type(config.TOKENS_PER_TILE) is int and config.TOKENS_PER_TILE == 8


# -- errors that name the right argument (q and k) -----------------------------------------


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_qk_compares_q_and_k_before_anything_else(rng, device):
    on, _ = device
    q, cos, sin, ids = make_case(rng, (2, 3, 4, 8), np.float32)
    k_batch = rng.standard_normal((1, 3, 4, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="q and k must have the same batch, got 2 and 1"):
        numba_rope.rotary_embedding_qk(on(q), on(k_batch), on(cos), on(sin), on(ids))
    k_head = rng.standard_normal((2, 3, 4, 6)).astype(np.float32)
    with pytest.raises(ValueError, match="same head_size, got 8 and 6"):
        numba_rope.rotary_embedding_qk(on(q), on(k_head), on(cos), on(sin), on(ids))
    q3 = on(np.ascontiguousarray(q.transpose(0, 2, 1, 3)).reshape(2, 4, 24))
    k3 = on(rng.standard_normal((2, 4, 8)).astype(np.float32))  # one kv head
    with pytest.raises(ValueError, match="pass num_kv_heads="):
        numba_rope.rotary_embedding_qk(q3, k3, on(cos), on(sin), on(ids), num_heads=3)
    with pytest.raises(TypeError, match="q and k must have one dtype, got float32 and float16"):
        numba_rope.rotary_embedding_qk(on(q), on(q.astype(np.float16)), on(cos), on(sin), on(ids))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_qk_with_one_array_as_both_outputs_is_refused(rng, device):
    on, off = device
    q, cos, sin, ids = make_case(rng, (2, 3, 4, 8), BFLOAT16)
    dq = on(q)
    with pytest.raises(ValueError, match="out_q and out_k share memory"):
        numba_rope.rotary_embedding_qk(dq, dq, on(cos), on(sin), on(ids), out_q=dq, out_k=dq)
    assert_bitwise_equal(off(dq), q)  # not rotated, once or twice


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("kind", ["out_k inside out_q", "q and k overlap, in place"])
def test_qk_outputs_that_share_some_elements_are_refused(rng, device, kind):
    """Outputs that share memory without being one view: on the GPU too (it once took
    only the very same view for shared outputs), and exactly: views of one fused qkv
    buffer, whose byte ranges interleave, are still rotated (the oracle: the float32
    contract of each tensor)."""
    _, cos, sin, ids = make_case(rng, (1, 3, 4, 8), np.float32)
    host = rng.standard_normal((1, 3, 4, 8)).astype(np.float32)
    if kind == "out_k inside out_q":
        base, q, k = device.views(host, host[:, 0:2], host[:, 2:3])
        outputs = device.on(np.zeros((1, 2, 4, 8), np.float32))
        out_q, out_k = outputs, outputs[:, :1]
    else:
        base, q, k = device.views(host, host[:, 0:2], host[:, 1:2])
        outputs, out_q, out_k = base, q, k
    before, outputs_before = device.off(base).copy(), device.off(outputs).copy()
    with pytest.raises(ValueError, match="out_q and out_k share memory"):
        numba_rope.rotary_embedding_qk(
            q, k, device.on(cos), device.on(sin), device.on(ids), out_q=out_q, out_k=out_k
        )
    assert_bitwise_equal(device.off(base), before)
    assert_bitwise_equal(device.off(outputs), outputs_before)
    # Heads of one buffer side by side, in place: apart, rotated.
    fresh = host.copy()  # on the CPU the views are the host arrays themselves
    base, q, k = device.views(fresh, fresh[:, 0:2], fresh[:, 2:3])
    numba_rope.rotary_embedding_qk(
        q, k, device.on(cos), device.on(sin), device.on(ids), out_q=q, out_k=k
    )
    got = device.off(base)
    assert_bitwise_equal(got[:, 0:2], float32_contract(host[:, 0:2], cos, sin, ids))
    assert_bitwise_equal(got[:, 2:3], float32_contract(host[:, 2:3], cos, sin, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["zero stride", "half-overlapping rows"])
def test_gpu_outputs_with_overlapping_elements_are_refused(rng, gpu, kind):
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 8), np.float32)
    host_out = _overlapping_outputs(x)[kind]
    base = host_out.base
    while getattr(base, "base", None) is not None:
        base = base.base
    device_base, device_out = gpu.views(base, host_out)
    before = gpu.off(device_base).copy()
    with pytest.raises(ValueError, match="out has elements that share memory"):
        numba_rope.rotary_embedding(
            gpu.on(x), gpu.on(cos), gpu.on(sin), gpu.on(ids), out=device_out
        )
    np.testing.assert_array_equal(gpu.off(device_base), before)


# -- errors that point the way ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "ids_shape", "caches", "fragment"),
    [
        ("bhsd", (2, 8), (20, 8), r"would fit an input in \[batch, seq_len, num_heads, head_size\] order: .* layout='bshd'"),
        ("bshd", (2, 5), (20, 8), r"would fit an input in \[batch, num_heads, seq_len, head_size\] order: .* layout='bhsd'"),
        ("bhsd", (5,), (20, 8), r"for 1-D ids of one sequence pass position_ids\[None, :\]"),
        ("bhsd", (2, 5), (20, 16), r"full width .* pass cos\[\.\.\., :8\] and sin\[\.\.\., :8\]"),
        ("bhsd", None, (2, 8, 8), r"would fit an input in \[batch, seq_len, num_heads, head_size\] order"),
    ],
)  # fmt: skip
def test_shape_errors_say_what_would_fit(layout, ids_shape, caches, fragment):
    x = np.zeros((2, 8, 5, 16), np.float32)  # bhsd: 8 heads, 5 tokens
    cache = np.zeros(caches, np.float32)
    ids = None if ids_shape is None else np.zeros(ids_shape, np.int64)
    with pytest.raises(ValueError, match=fragment):
        numba_rope.rotary_embedding(x, cache, cache, ids, layout=layout)
