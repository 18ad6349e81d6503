"""rotary_embedding on GPU arrays: the CUDA kernels behind the same call.

On a machine with an NVIDIA GPU these run on it; elsewhere in numba's CUDA simulator
(see conftest.py), on tiny shapes with launches shrunk so that several blocks, head
groups and grid-stride turns are exercised. In the simulator results must equal the
float32 contract bit for bit; on a GPU within one unit in the last place of the output
dtype at the scale of the data (ptxas may contract into FMA). The CuPy and torch tests
run where those libraries and a GPU are present.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from oracles import (
    BFLOAT16,
    DTYPES,
    assert_bitwise_equal,
    float32_contract,
    make_case,
    ulp_of,
)

import numba_rope
from numba_rope import reference

cuda = pytest.importorskip(
    "numba.cuda", reason="numba-cuda is not installed (pip install -e '.[cuda]')"
)
from numba.core import config as numba_config  # noqa: E402

from numba_rope import _cuda as numba_rope_cuda  # noqa: E402

SIMULATOR = bool(numba_config.ENABLE_CUDASIM)
ROOT = Path(__file__).resolve().parent.parent
DTYPE_IDS = [d.name for d in DTYPES]

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("small_cuda_launches")]


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


needs_cupy = pytest.mark.skipif(
    SIMULATOR or not _installed("cupy"), reason="needs CuPy and an NVIDIA GPU"
)
needs_torch = pytest.mark.skipif(
    SIMULATOR or not _installed("torch"), reason="needs torch and an NVIDIA GPU"
)


# -- moving arrays ----------------------------------------------------------------------


def to_gpu(a):
    return None if a is None else cuda.to_device(a)


def to_host(d) -> np.ndarray:
    return d.copy_to_host()


def gpu_view(host_base: np.ndarray, host_view: np.ndarray):
    """The device twin of ``host_view``, a view into ``host_base`` (any strides, negative
    too): the same offset and strides over a device copy of ``host_base``. Returns the
    view and the device base."""
    base = cuda.to_device(host_base)
    offset = host_view.__array_interface__["data"][0] - host_base.__array_interface__["data"][0]
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        view = np.ndarray(
            host_view.shape,
            host_view.dtype,
            buffer=base._ary,
            offset=offset,
            strides=host_view.strides,
        )
        return FakeCUDAArray(view), base
    storage = np.dtype(np.uint16) if host_view.dtype == BFLOAT16 else host_view.dtype
    description = {
        "shape": host_view.shape,
        "strides": host_view.strides,
        "data": (base.device_ctypes_pointer.value + offset, False),
        "typestr": storage.str,
        "version": 3,
    }
    view = cuda.from_cuda_array_interface(description, owner=base, sync=False)
    return (view.view(BFLOAT16) if storage != host_view.dtype else view), base


def assert_matches_contract(got, x, cos, sin, ids=None, interleaved=False, rotary_dim=0):
    """Bit for bit in the simulator; on a GPU within one unit in the last place of the
    output dtype at the scale of the terms (FMA contraction)."""
    want = float32_contract(x, cos, sin, ids, interleaved, rotary_dim)
    if SIMULATOR:
        assert_bitwise_equal(got, want)
    else:
        assert got.dtype == want.dtype and got.shape == want.shape
        g, w = got.astype(np.float64), want.astype(np.float64)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        finite = np.isfinite(w)
        np.testing.assert_array_equal(g[~finite & ~np.isnan(w)], w[~finite & ~np.isnan(w)])
        scale = (
            np.abs(x.astype(np.float64)).max()
            * (np.abs(cos.astype(np.float64)) + np.abs(sin.astype(np.float64))).max()
        )
        assert np.abs(g[finite] - w[finite]).max(initial=0) <= ulp_of(x.dtype) * scale
    # And within the rounding of the format from the float64 reference.
    with np.errstate(all="ignore"):
        ref = reference.rotary_embedding(
            x, cos, sin, ids, interleaved=interleaved, rotary_embedding_dim=rotary_dim
        ).astype(np.float64)
    finite = np.isfinite(ref)
    scale = np.abs(x.astype(np.float64)).max(initial=0) * 2
    assert np.allclose(
        got.astype(np.float64)[finite], ref[finite], rtol=0, atol=4 * ulp_of(x.dtype) * scale
    )


# -- every dtype x interleaved x rotary_dim x position-id variant ------------------------

SHAPE = (2, 5, 3, 12)  # 5 heads, 2 per thread: 3 groups (one partial) over 2 blocks
ID_VARIANTS = ["int64 ids", "int32 ids", "no ids"]


@pytest.mark.parametrize("ids_variant", ID_VARIANTS)
@pytest.mark.parametrize("rotary_dim", [0, 8, 2])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_matches_contract(rng, dtype, interleaved, rotary_dim, ids_variant):
    with_ids = ids_variant != "no ids"
    x, cos, sin, ids = make_case(rng, SHAPE, dtype, position_ids=with_ids, rotary_dim=rotary_dim)
    if ids_variant == "int32 ids":
        ids = ids.astype(np.int32)
    dx = to_gpu(x)
    got = numba_rope.rotary_embedding(
        dx,
        to_gpu(cos),
        to_gpu(sin),
        to_gpu(ids),
        interleaved=interleaved,
        rotary_embedding_dim=rotary_dim,
    )
    assert type(got) is type(dx) and got.dtype == x.dtype and got.shape == x.shape
    assert_matches_contract(to_host(got), x, cos, sin, ids, interleaved, rotary_dim)


@pytest.mark.parametrize("with_ids", [True, False], ids=["ids", "no_ids"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float64], ids=str)
def test_float32_caches_for_other_inputs(rng, dtype, interleaved, with_ids):
    x, cos, sin, ids = make_case(
        rng, (1, 3, 4, 8), dtype, position_ids=with_ids, cache_dtype=np.float32
    )
    got = numba_rope.rotary_embedding(
        to_gpu(x), to_gpu(cos), to_gpu(sin), to_gpu(ids), interleaved=interleaved
    )
    assert got.dtype == x.dtype
    assert_matches_contract(to_host(got), x, cos, sin, ids, interleaved)


def test_default_launch_configuration(rng, monkeypatch):
    from numba_rope import config

    monkeypatch.setattr(config, "CUDA_THREADS_PER_BLOCK", 64)
    monkeypatch.setattr(config, "CUDA_HEADS_PER_THREAD", 4)
    monkeypatch.setattr(config, "CUDA_MAX_BLOCKS", 65535)
    x, cos, sin, ids = make_case(rng, (2, 5, 3, 16), BFLOAT16, rotary_dim=12)
    got = numba_rope.rotary_embedding(
        to_gpu(x), to_gpu(cos), to_gpu(sin), to_gpu(ids), rotary_embedding_dim=12
    )
    assert_matches_contract(to_host(got), x, cos, sin, ids, rotary_dim=12)


@pytest.mark.parametrize("id_dtype", [np.uint8, np.int16, np.uint64])
def test_position_id_dtypes(rng, id_dtype):
    x, cos, sin, ids = make_case(rng, (2, 2, 3, 8), np.float32)
    got = numba_rope.rotary_embedding(
        to_gpu(x), to_gpu(cos), to_gpu(sin), to_gpu(ids.astype(id_dtype))
    )
    assert_matches_contract(to_host(got), x, cos, sin, ids)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nan_and_inf_propagate_as_the_formula_says(dtype):
    values = np.array([np.nan, np.inf, -np.inf, 1.0, 0.0, -2.5, 3.0, np.inf], np.float64)
    x = values.astype(dtype).reshape(1, 1, 1, 8)
    cos = np.array([[0.5, 1.0, np.nan, 0.0]]).astype(dtype)
    sin = np.array([[0.25, 0.0, 1.0, np.inf]]).astype(dtype)
    ids = np.zeros((1, 1), np.int64)
    got = to_host(numba_rope.rotary_embedding(to_gpu(x), to_gpu(cos), to_gpu(sin), to_gpu(ids)))
    assert_bitwise_equal(got, float32_contract(x, cos, sin, ids))


_widen_bfloat16 = numba_rope_cuda._bfloat16_bits_to_float32
_narrow_bfloat16 = numba_rope_cuda._float32_to_bfloat16_bits
_narrow_float16 = numba_rope_cuda._to_float16


@cuda.jit
def _convert_kernel(bfloat16_bits, widened, float32_values, bfloat16_rounded, float16_rounded):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, bfloat16_bits.shape[0], stride):
        widened[i] = _widen_bfloat16(bfloat16_bits[i])
    for i in range(start, float32_values.shape[0], stride):
        bfloat16_rounded[i] = _narrow_bfloat16(float32_values[i])
        float16_rounded[i] = _narrow_float16(float32_values[i])


def test_device_conversions_match_numpy_and_ml_dtypes():
    """Every bfloat16 pattern widens exactly; float32 values around every bfloat16
    rounding boundary (ties included), infinities and NaNs narrow to nearest even."""
    every_bfloat16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    low_bits = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    patterns = (np.arange(1 << 16, dtype=np.uint32)[:, None] << 16 | low_bits).ravel()
    if SIMULATOR:  # one Python loop iteration per value: a sample keeps it short
        every_bfloat16 = every_bfloat16[::7].copy()
        patterns = patterns[::61].copy()
    values = patterns.view(np.float32)
    widened = cuda.device_array(every_bfloat16.shape, np.float32)
    bfloat16_rounded = cuda.device_array(values.shape, np.uint16)
    float16_rounded = cuda.device_array(values.shape, np.float16)
    _convert_kernel[4, 8](
        cuda.to_device(every_bfloat16),
        widened,
        cuda.to_device(values),
        bfloat16_rounded,
        float16_rounded,
    )
    assert_bitwise_equal(to_host(widened), every_bfloat16.view(BFLOAT16).astype(np.float32))
    with np.errstate(all="ignore"):  # NaN and overflow are data here
        assert_bitwise_equal(to_host(bfloat16_rounded).view(BFLOAT16), values.astype(BFLOAT16))
        assert_bitwise_equal(to_host(float16_rounded), values.astype(np.float16))


# -- out=, in place, strides, overlaps, empty dimensions ----------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_out_and_in_place(rng, dtype):
    x, cos, sin, ids = make_case(rng, (2, 3, 2, 12), dtype, rotary_dim=8)
    args = (to_gpu(cos), to_gpu(sin), to_gpu(ids))
    out = cuda.device_array(x.shape, x.dtype)
    assert numba_rope.rotary_embedding(to_gpu(x), *args, rotary_embedding_dim=8, out=out) is out
    assert_matches_contract(to_host(out), x, cos, sin, ids, rotary_dim=8)
    inplace = to_gpu(x)
    assert (
        numba_rope.rotary_embedding(inplace, *args, rotary_embedding_dim=8, out=inplace) is inplace
    )
    assert_matches_contract(to_host(inplace), x, cos, sin, ids, rotary_dim=8)


def _views(qkv: np.ndarray):
    return {
        "slice of fused qkv": qkv[:, :, :, 16:32],
        "transposed": qkv.transpose(0, 2, 1, 3)[:, :, :, :16],
        "negative strides": qkv[::-1, :, ::-1, :16][:, :, :, ::-1],
        "every other head": qkv[:, ::2, :, 32:],
    }


@pytest.mark.parametrize("view_name", list(_views(np.zeros((1, 1, 1, 48)))))
@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=str)
def test_strided_inputs_and_out(rng, dtype, view_name):
    qkv = rng.standard_normal((2, 4, 4, 48)).astype(dtype)
    base_view = _views(qkv)[view_name]
    shape = base_view.shape
    _, cos, sin, ids = make_case(rng, shape, dtype)
    x = np.ascontiguousarray(base_view)
    dview, _ = gpu_view(qkv, base_view)
    got = numba_rope.rotary_embedding(dview, to_gpu(cos), to_gpu(sin), to_gpu(ids))
    assert_matches_contract(to_host(got), x, cos, sin, ids)
    # The same view as out (in place) leaves every other element of the buffer alone.
    dview, dbase = gpu_view(qkv, base_view)
    numba_rope.rotary_embedding(dview, to_gpu(cos), to_gpu(sin), to_gpu(ids), out=dview)
    after = to_host(dbase)
    want = qkv.copy()
    _views(want)[view_name][...] = float32_contract(x, cos, sin, ids)
    if SIMULATOR:
        assert_bitwise_equal(after, want)
    assert_matches_contract(np.ascontiguousarray(_views(after)[view_name]), x, cos, sin, ids)


def test_strided_caches_and_ids(rng):
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 8), np.float32, n_positions=20)
    big_cos = np.zeros((20, 8), np.float32)
    big_cos[:, ::2] = cos
    big_ids = np.zeros((2, 8), np.int64)
    big_ids[:, ::2] = ids
    dcos, _ = gpu_view(big_cos, big_cos[:, ::2])
    dids, _ = gpu_view(big_ids, big_ids[:, ::2])
    got = numba_rope.rotary_embedding(to_gpu(x), dcos, to_gpu(sin), dids)
    assert_matches_contract(to_host(got), x, cos, sin, ids)


def test_out_overlapping_input_is_still_correct(rng):
    buffer = rng.standard_normal((2, 2, 3, 20)).astype(np.float32)
    _, cos, sin, ids = make_case(rng, (2, 2, 3, 16), np.float32)
    x = buffer[..., :16].copy()
    device_buffer = to_gpu(buffer)
    # out starts 4 channels further into the same memory: a shifted overlap.
    numba_rope.rotary_embedding(
        device_buffer[..., :16], to_gpu(cos), to_gpu(sin), to_gpu(ids), out=device_buffer[..., 4:20]
    )
    assert_matches_contract(
        np.ascontiguousarray(to_host(device_buffer)[..., 4:20]), x, cos, sin, ids
    )


def test_out_overlapping_caches_is_still_correct(rng):
    x, cos, sin, _ = make_case(rng, (1, 1, 4, 8), np.float32, position_ids=False)
    out_host = np.zeros((1, 1, 4, 8), np.float32)
    out_host.reshape(1, 4, 8)[:, :, :4] = cos
    dout = to_gpu(out_host)
    dcos = dout.reshape(1, 4, 8)[:, :, :4]  # the caches live inside out
    numba_rope.rotary_embedding(to_gpu(x), dcos, to_gpu(sin), out=dout)
    assert_matches_contract(to_host(dout), x, cos, sin)


@pytest.mark.parametrize("shape", [(0, 2, 3, 8), (2, 0, 3, 8), (2, 3, 0, 8), (2, 3, 4, 0)], ids=str)
def test_empty_dimensions(shape):
    batch, _, seq_len, head = shape
    x = np.zeros(shape, np.float32)
    cache = np.zeros((1, head // 2), np.float32)
    got = numba_rope.rotary_embedding(
        to_gpu(x), to_gpu(cache), to_gpu(cache), to_gpu(np.zeros((batch, seq_len), np.int64))
    )
    assert got.shape == shape and got.dtype == np.float32 and type(got) is type(to_gpu(x))
    no_ids = np.zeros((batch, seq_len, head // 2), np.float32)
    assert numba_rope.rotary_embedding(to_gpu(x), to_gpu(no_ids), to_gpu(no_ids)).shape == shape


# -- position ids: IndexError by default, NaN rows when the check is skipped -------------


@pytest.mark.parametrize(
    ("bad_value", "where", "id_dtype"),
    [(-1, (1, 2), np.int64), (10, (0, 3), np.int32), (2**64 - 1, (1, 1), np.uint64)],
)
def test_out_of_range_position_id_raises_before_writing(bad_value, where, id_dtype):
    x = np.ones((2, 3, 4, 8), np.float32)
    cache = np.ones((10, 4), np.float32)
    ids = np.zeros((2, 4), id_dtype)
    ids[where] = bad_value
    dx = to_gpu(x)
    with pytest.raises(
        IndexError, match=rf"position_ids\[{where[0]}, {where[1]}\] = {bad_value} .* \[0, 9\]"
    ):
        numba_rope.rotary_embedding(dx, to_gpu(cache), to_gpu(cache), to_gpu(ids), out=dx)
    np.testing.assert_array_equal(to_host(dx), x)  # nothing written


def test_first_bad_position_is_the_first_in_row_major_order(rng):
    x, cos, sin, ids = make_case(rng, (3, 1, 5, 4), np.float32, n_positions=6)
    ids[2, 0] = 50
    ids[1, 3] = -7
    ids[1, 4] = 99
    with pytest.raises(IndexError, match=r"position_ids\[1, 3\] = -7"):
        numba_rope.rotary_embedding(to_gpu(x), to_gpu(cos), to_gpu(sin), to_gpu(ids))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_skipping_the_check_fills_bad_rows_with_nan(rng, dtype):
    x, cos, sin, ids = make_case(rng, (2, 3, 4, 12), dtype, rotary_dim=8, n_positions=5)
    ids[0, 1] = 5
    ids[1, 3] = -1
    bad = np.zeros(ids.shape, bool)
    bad[0, 1] = bad[1, 3] = True
    got = to_host(
        numba_rope.rotary_embedding(
            to_gpu(x),
            to_gpu(cos),
            to_gpu(sin),
            to_gpu(ids),
            rotary_embedding_dim=8,
            check_position_ids=False,
        )
    )
    as_float = got.astype(np.float64).transpose(0, 2, 1, 3)  # [batch, seq, heads, head]
    assert np.isnan(as_float[bad]).all()  # every channel of the bad tokens, pass-through too
    good_ids = np.where(bad, 0, ids)
    want = (
        float32_contract(x, cos, sin, good_ids, False, 8).astype(np.float64).transpose(0, 2, 1, 3)
    )
    assert not np.isnan(as_float[~bad]).any()
    if SIMULATOR:
        np.testing.assert_array_equal(as_float[~bad], want[~bad])


def test_cpu_ignores_the_skip_switch_and_still_checks():
    x = np.ones((1, 1, 2, 4), np.float32)
    cache = np.ones((3, 2), np.float32)
    with pytest.raises(IndexError):
        numba_rope.rotary_embedding(x, cache, cache, np.array([[0, 3]]), check_position_ids=False)


# -- errors ---------------------------------------------------------------------------------


def _good_gpu_args(dtype=np.float32):
    x = np.ones((2, 3, 4, 8), dtype)
    cache = np.ones((10, 4), dtype)
    return {
        "input": to_gpu(x),
        "cos_cache": to_gpu(cache),
        "sin_cache": to_gpu(cache),
        "position_ids": to_gpu(np.zeros((2, 4), np.int64)),
    }


def _call_leaves_out_untouched(args, **kwargs):
    out = cuda.to_device(np.full((2, 3, 4, 8), 7.0, np.float32))
    try:
        numba_rope.rotary_embedding(**args, out=out, **kwargs)
    finally:
        np.testing.assert_array_equal(to_host(out), 7.0)


@pytest.mark.parametrize("host_argument", ["input", "cos_cache", "sin_cache", "position_ids"])
def test_mixing_host_and_gpu_arrays_is_type_error(host_argument):
    args = _good_gpu_args()
    args[host_argument] = to_host(args[host_argument])
    with pytest.raises(TypeError, match=rf"{host_argument} is a NumPy array on the host") as error:
        _call_leaves_out_untouched(args)
    assert "is on the GPU" in str(error.value)


def test_host_out_for_gpu_input_is_type_error():
    with pytest.raises(TypeError, match=r"out is a NumPy array on the host"):
        numba_rope.rotary_embedding(**_good_gpu_args(), out=np.zeros((2, 3, 4, 8), np.float32))


GPU_TYPE_ERRORS = {
    "int input": ({"input": np.ones((2, 3, 4, 8), np.int32)}, "int32"),
    "float64 caches for float32": (
        {"cos_cache": np.ones((10, 4)), "sin_cache": np.ones((10, 4))},
        "float64",
    ),
    "cos/sin dtypes differ": ({"sin_cache": np.ones((10, 4), np.float16)}, "same dtype"),
    "float position ids": ({"position_ids": np.zeros((2, 4))}, "position_ids must be an integer"),
    "list cache": ({"cos_cache": [[1.0] * 4] * 10}, "list"),
}


@pytest.mark.parametrize("case", GPU_TYPE_ERRORS, ids=str)
def test_type_errors(case):
    changes, fragment = GPU_TYPE_ERRORS[case]
    args = _good_gpu_args()
    args.update({k: v if isinstance(v, list) else to_gpu(v) for k, v in changes.items()})
    with pytest.raises(TypeError, match=fragment):
        _call_leaves_out_untouched(args)


GPU_VALUE_ERRORS = {
    "3-D input without num_heads": (
        {"input": np.ones((2, 3, 8), np.float32)},
        {},
        "needs num_heads=",
    ),
    "odd rotary dim": ({}, {"rotary_embedding_dim": 3}, "must be even"),
    "cache width": (
        {"cos_cache": np.ones((10, 3), np.float32), "sin_cache": np.ones((10, 3), np.float32)},
        {},
        "rotary_dim/2 = 4",
    ),
    "ids shape": ({"position_ids": np.zeros((2, 5), np.int64)}, {}, r"\(2, 4\), got \(2, 5\)"),
}


@pytest.mark.parametrize("case", GPU_VALUE_ERRORS, ids=str)
def test_value_errors(case):
    changes, kwargs, fragment = GPU_VALUE_ERRORS[case]
    args = _good_gpu_args()
    args.update({k: to_gpu(v) for k, v in changes.items()})
    with pytest.raises(ValueError, match=fragment):
        _call_leaves_out_untouched(args, **kwargs)


def test_out_of_wrong_dtype_and_shape():
    with pytest.raises(TypeError, match="out must have the input's dtype float32, got float16"):
        numba_rope.rotary_embedding(
            **_good_gpu_args(), out=cuda.device_array((2, 3, 4, 8), np.float16)
        )
    with pytest.raises(ValueError, match="out must have the input's shape"):
        numba_rope.rotary_embedding(
            **_good_gpu_args(), out=cuda.device_array((2, 3, 4, 6), np.float32)
        )


def test_stream_argument():
    args = _good_gpu_args()
    stream = cuda.stream()
    got = numba_rope.rotary_embedding(**args, stream=stream)
    stream.synchronize()
    ones = np.ones((2, 3, 4, 8), np.float32)
    want = np.concatenate([ones[..., :4] * 0.0, ones[..., 4:] * 2.0], axis=-1)  # 1-1, 1+1
    np.testing.assert_array_equal(to_host(got), want)
    numba_rope.rotary_embedding(**args, stream=0)  # a raw handle: the default stream
    with pytest.raises(TypeError, match=r"stream is a builtins\.str"):
        numba_rope.rotary_embedding(**args, stream="fast")


def test_stream_is_ignored_for_numpy_arrays():
    x = np.ones((1, 1, 1, 2), np.float32)
    cache = np.ones((1, 1, 1), np.float32)
    assert numba_rope.rotary_embedding(x, cache, cache, stream=object()).shape == x.shape


def test_gpu_path_never_imports_cupy_or_torch_and_cpu_path_never_imports_cuda():
    code = (
        "import sys, numpy as np, numba_rope\n"
        "x = np.ones((1, 1, 1, 2), np.float32); c = np.ones((1, 1, 1), np.float32)\n"
        "numba_rope.rotary_embedding(x, c, c)\n"
        "assert 'numba.cuda' not in sys.modules and 'numba_rope._cuda' not in sys.modules\n"
        "from numba import cuda\n"
        "numba_rope.rotary_embedding(cuda.to_device(x), cuda.to_device(c), cuda.to_device(c))\n"
        "assert 'numba_rope._cuda' in sys.modules\n"
        "assert 'cupy' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr


def test_gpu_check_script_runs_quick_in_this_mode(tmp_path):
    table = tmp_path / "table.md"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--quick", "--out", str(table)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = table.read_text()
    assert "| check |" in text and "FAILED" not in text, text


# -- CuPy and torch: real tests on a machine with a GPU and the library ------------------


@needs_cupy
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
def test_cupy_in_cupy_out(rng, dtype, interleaved):
    import cupy

    x, cos, sin, ids = make_case(rng, (2, 4, 5, 16), dtype, rotary_dim=12)
    got = numba_rope.rotary_embedding(
        cupy.asarray(x),
        cupy.asarray(cos),
        cupy.asarray(sin),
        cupy.asarray(ids),
        interleaved=interleaved,
        rotary_embedding_dim=12,
    )
    assert type(got) is cupy.ndarray and got.dtype == dtype
    assert_matches_contract(cupy.asnumpy(got), x, cos, sin, ids, interleaved, 12)


@needs_cupy
def test_cupy_strided_out_stream_and_errors(rng):
    import cupy

    qkv = rng.standard_normal((2, 4, 5, 48)).astype(np.float32)
    _, cos, sin, ids = make_case(rng, (2, 4, 5, 16), np.float32)
    view = qkv[::-1, :, ::-1, 16:32]
    dqkv = cupy.asarray(qkv)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        dview = dqkv[::-1, :, ::-1, 16:32]
        numba_rope.rotary_embedding(
            dview, cupy.asarray(cos), cupy.asarray(sin), cupy.asarray(ids), out=dview
        )
    stream.synchronize()
    assert_matches_contract(
        np.ascontiguousarray(cupy.asnumpy(dqkv)[::-1, :, ::-1, 16:32]),
        np.ascontiguousarray(view),
        cos,
        sin,
        ids,
    )
    with pytest.raises(TypeError, match="cos_cache is a NumPy array on the host"):
        numba_rope.rotary_embedding(cupy.asarray(view), cos, cupy.asarray(sin), cupy.asarray(ids))
    bad = ids.copy()
    bad[1, 2] = 100
    with pytest.raises(IndexError, match=r"position_ids\[1, 2\] = 100"):
        numba_rope.rotary_embedding(
            cupy.asarray(view), cupy.asarray(cos), cupy.asarray(sin), cupy.asarray(bad)
        )


@needs_cupy
def test_cupy_bfloat16_through_numba_views(rng):
    import cupy

    x, cos, sin, ids = make_case(rng, (2, 4, 5, 16), BFLOAT16)
    as_bf16 = lambda a: cuda.as_cuda_array(cupy.asarray(a.view(np.uint16))).view(BFLOAT16)  # noqa: E731
    got = numba_rope.rotary_embedding(as_bf16(x), as_bf16(cos), as_bf16(sin), cupy.asarray(ids))
    assert cuda.is_cuda_array(got) and got.dtype == BFLOAT16
    bits = cupy.asarray(got.view(np.uint16))  # back to CuPy, as uint16 bits
    assert_matches_contract(cupy.asnumpy(bits).view(BFLOAT16), x, cos, sin, ids)


@needs_torch
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16", "float64"])
def test_torch_in_torch_out(rng, dtype_name):
    import torch

    dtype = BFLOAT16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
    x, cos, sin, ids = make_case(rng, (2, 4, 5, 16), dtype, rotary_dim=8)

    def tensor(a):
        if a.dtype == BFLOAT16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()
        return torch.from_numpy(a).cuda()

    got = numba_rope.rotary_embedding(
        tensor(x), tensor(cos), tensor(sin), tensor(ids), rotary_embedding_dim=8
    )
    assert isinstance(got, torch.Tensor) and got.is_cuda
    assert got.dtype == getattr(torch, dtype_name)
    host = got.cpu()
    host = host.view(torch.int16).numpy().view(BFLOAT16) if dtype == BFLOAT16 else host.numpy()
    assert_matches_contract(host, x, cos, sin, ids, rotary_dim=8)


@needs_torch
def test_torch_stream_in_place_and_errors(rng):
    import torch

    x, cos, sin, ids = make_case(rng, (2, 4, 5, 16), np.float32)
    tx, tc, ts, ti = (torch.from_numpy(a).cuda() for a in (x, cos, sin, ids))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        result = numba_rope.rotary_embedding(tx, tc, ts, ti, out=tx)
    stream.synchronize()
    assert result is tx
    assert_matches_contract(tx.cpu().numpy(), x, cos, sin, ids)
    with pytest.raises(TypeError, match=r"torch\.Tensor on the CPU"):
        numba_rope.rotary_embedding(torch.from_numpy(x), tc, ts, ti)
    with pytest.raises(TypeError, match="sin_cache is a NumPy array on the host"):
        numba_rope.rotary_embedding(tx, tc, sin, ti)


def test_every_kernel_compiles_for_a_real_gpu():
    """The simulator runs kernels as Python; this compiles them as numba-cuda does for a
    device (NVVM only, no GPU needed), so typing errors cannot hide until a GPU runs."""
    env = {
        **os.environ,
        "NUMBA_ENABLE_CUDASIM": "0",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "compile_for_gpu.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if result.returncode == 77:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout + result.stderr
