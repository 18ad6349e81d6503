"""rotary_embedding on GPU arrays: what only the CUDA path promises (launch
configuration, the device conversions, the position check and its skip switch, host and
GPU arrays mixed, streams, lazy imports, CuPy and torch, compiling for a real GPU). The
promises of both devices are in test_rotary.py.

On a machine with an NVIDIA GPU these run on it; elsewhere in numba's CUDA simulator
(see conftest.py), on tiny shapes with launches shrunk so that several blocks, head
groups and grid-stride turns are exercised. Results must equal the float32 contract bit
for bit, in the simulator and on a GPU alike (the kernels round each product on their
own: no FMA). The CuPy and torch tests run where those libraries and a GPU are present.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from oracles import (
    BFLOAT16,
    DTYPES,
    assert_bitwise_equal,
    float32_contract,
    make_case,
    to_gpu,
    to_host,
)

import numba_rope

cuda = pytest.importorskip(
    "numba.cuda", reason="numba-cuda is not installed (pip install -e '.[cuda]')"
)
from numba.core import config as numba_config  # noqa: E402

from numba_rope._cuda import kernels as numba_rope_cuda  # noqa: E402

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


def test_default_launch_configuration(rng, gpu, monkeypatch):
    from numba_rope import config

    monkeypatch.setattr(config, "CUDA_THREADS_PER_BLOCK", 64)
    monkeypatch.setattr(config, "CUDA_HEADS_PER_THREAD", 4)
    monkeypatch.setattr(config, "CUDA_MAX_BLOCKS", 65535)
    x, cos, sin, ids = make_case(rng, (2, 5, 3, 16), BFLOAT16, rotary_dim=12)
    got = numba_rope.rotary_embedding(
        to_gpu(x), to_gpu(cos), to_gpu(sin), to_gpu(ids), rotary_embedding_dim=12
    )
    gpu.assert_contract(to_host(got), x, cos, sin, ids, rotary_dim=12)


def test_a_tiny_call_with_the_default_launch_warns_of_nothing(rng, gpu, monkeypatch):
    """numba-cuda warns of low occupancy for grids under 128 blocks (on a GPU; the
    simulator never warns): the default launch pads its grids, so that a caller running
    with warnings as errors can make small calls (the check, the kernel, the copy)."""
    from numba_rope import config

    monkeypatch.setattr(config, "CUDA_THREADS_PER_BLOCK", 256)
    monkeypatch.setattr(config, "CUDA_MAX_BLOCKS", 65535)
    x, cos, sin, ids = make_case(rng, (1, 1, 2, 8), np.float32)
    base = cuda.to_device(np.concatenate([x.ravel(), np.zeros(4, np.float32)]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # before this module's ignore filter
        got = numba_rope.rotary_embedding(to_gpu(x), to_gpu(cos), to_gpu(sin), to_gpu(ids))
        gpu_x = base[:16].reshape(x.shape)  # an output two elements on: a copy first
        shifted = numba_rope.rotary_embedding(
            gpu_x, to_gpu(cos), to_gpu(sin), to_gpu(ids), out=base[2:18].reshape(x.shape)
        )
    for result in (got, shifted):
        gpu.assert_contract(to_host(result), x, cos, sin, ids)


def test_grids_padded_to_the_minimum_give_the_same_results(rng, gpu, monkeypatch):
    """Blocks past the work (the padding of small grids on a GPU) find nothing to do, in
    the kernel and in the position check; the padding stays within CUDA_MAX_BLOCKS."""
    from numba_rope import config
    from numba_rope._cuda import backend

    monkeypatch.setattr(config, "CUDA_MAX_BLOCKS", 65535)
    monkeypatch.setattr(backend, "MIN_GRID_BLOCKS", 13)
    (grid_x, grid_y), _ = backend._grid(n_tokens=2, n_slots=4, n_groups=2)
    assert grid_y == 2 and grid_x * grid_y >= 13  # padded on x
    monkeypatch.setattr(config, "CUDA_MAX_BLOCKS", 5)
    assert backend._grid(n_tokens=2, n_slots=4, n_groups=2)[0] == (5, 2)  # the limit holds
    monkeypatch.setattr(config, "CUDA_MAX_BLOCKS", 65535)
    x, cos, sin, ids = make_case(rng, (2, 3, 5, 8), np.float32, rotary_dim=6, n_positions=7)
    args = (to_gpu(x), to_gpu(cos), to_gpu(sin))
    got = numba_rope.rotary_embedding(*args, to_gpu(ids), rotary_embedding_dim=6)
    gpu.assert_contract(to_host(got), x, cos, sin, ids, rotary_dim=6)
    ids[1, 3], ids[1, 4] = 7, -1  # the first bad id is found among padded blocks
    with pytest.raises(IndexError, match=r"position_ids\[1, 3\] = 7"):
        numba_rope.rotary_embedding(*args, to_gpu(ids), rotary_embedding_dim=6)


def test_the_position_check_copies_nothing_to_the_device_and_survives_bad_calls(
    rng, gpu, monkeypatch
):
    """The check's flag stays at "none found" between calls, so a checked call copies
    nothing to the device (one numba-cuda copy between device arrays took 111 us of host
    time on the H200's machine; a copy from the host was not timed apart). A call that
    found a bad id, or that was interrupted between the check and its read-back with
    the flag lowered, leaves the next call's check right."""
    x, cos, sin, ids = make_case(rng, (2, 3, 5, 8), np.float32, n_positions=7)
    args = (to_gpu(x), to_gpu(cos), to_gpu(sin))
    good, bad = ids.copy(), ids.copy()
    bad[1, 2] = 7

    def call(position_ids):
        out = cuda.device_array(x.shape, x.dtype)
        return to_host(numba_rope.rotary_embedding(*args, to_gpu(position_ids), out=out))

    array_type = type(args[0])
    copy_to_device, copy_to_host = array_type.copy_to_device, array_type.copy_to_host
    gpu.assert_contract(call(good), x, cos, sin, good)  # the thread's flag exists
    gpu_ids, out = to_gpu(good), cuda.device_array(x.shape, x.dtype)
    copies: list = []
    monkeypatch.setattr(array_type, "copy_to_device", lambda *a, **k: copies.append(a))
    for _ in range(2):
        numba_rope.rotary_embedding(*args, gpu_ids, out=out)
    assert copies == []
    monkeypatch.setattr(array_type, "copy_to_device", copy_to_device)
    gpu.assert_contract(to_host(out), x, cos, sin, good)

    with pytest.raises(IndexError, match=r"position_ids\[1, 2\] = 7"):
        call(bad)
    gpu.assert_contract(call(good), x, cos, sin, good)  # the lowered flag is not reused

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt  # as Ctrl-C between the check's launch and read-back

    monkeypatch.setattr(array_type, "copy_to_host", interrupted)
    with pytest.raises(KeyboardInterrupt):
        numba_rope.rotary_embedding(*args, to_gpu(bad), out=out)
    monkeypatch.setattr(array_type, "copy_to_host", copy_to_host)
    gpu.assert_contract(call(good), x, cos, sin, good)
    with pytest.raises(IndexError, match=r"position_ids\[1, 2\] = 7"):
        call(bad)


def test_a_view_that_changes_nothing_is_the_array_itself(rng):
    """A bhsd Numba array is launched as it is: no new numba array per call (each costs
    host time: 9.5 us on the H200's machine); a bshd one gets its bhsd view."""
    from numba_rope._cuda.backend import numba_view
    from numba_rope._geometry import bhsd_geometry

    x = to_gpu(rng.standard_normal((2, 3, 4, 8)).astype(np.float32))

    def as_bhsd(layout, logical_shape):  # what CudaBackend.view passes
        return lambda shape, strides: bhsd_geometry(shape, strides, layout, logical_shape)

    assert numba_view(x, "numba", x.dtype, as_bhsd("bhsd", (2, 3, 4, 8))) is x
    seen_as_bshd = numba_view(x, "numba", x.dtype, as_bhsd("bshd", (2, 4, 3, 8)))
    assert seen_as_bshd is not x and seen_as_bshd.shape == (2, 4, 3, 8)


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


# -- position ids: NaN rows when the check is skipped (the check: test_validation.py) ---


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
    np.testing.assert_array_equal(as_float[~bad], want[~bad])


def test_cpu_ignores_the_skip_switch_and_still_checks():
    x = np.ones((1, 1, 2, 4), np.float32)
    cache = np.ones((3, 2), np.float32)
    with pytest.raises(IndexError):
        numba_rope.rotary_embedding(x, cache, cache, np.array([[0, 3]]), check_position_ids=False)


# -- host and GPU arrays mixed, streams, imports -------------------------------------------


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


class Exporter:
    """A bare ``__cuda_array_interface__`` exporter (version 3) over a Numba device
    array's memory: no ``shape``, ``strides`` or ``dtype`` attributes (unless ``dtype``
    is given: bfloat16's typestr reads as ``uint16``), as the interface allows. In the
    simulator, whose device memory is host memory, the interface points at that."""

    def __init__(self, device_array, stream=None, read_only=False, dtype=None):
        self._array, self._stream, self._read_only = device_array, stream, read_only
        if dtype is not None:
            self.dtype = np.dtype(dtype)

    @property
    def __cuda_array_interface__(self):
        if SIMULATOR:
            host = self._array._ary
            interface = {
                "shape": host.shape,
                "strides": None if host.flags.c_contiguous else host.strides,
                "typestr": host.dtype.str,
                "data": (host.__array_interface__["data"][0], self._read_only),
                "version": 3,
            }
        else:
            interface = dict(self._array.__cuda_array_interface__)
            interface["data"] = (interface["data"][0], self._read_only)
            interface.pop("stream", None)
        if self._stream is not None:
            interface["stream"] = self._stream
        return interface


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bare_interface_exporters_are_rotated_in_their_memory(rng, gpu, dtype):
    # Objects that offer only __cuda_array_interface__ (the README's "other objects
    # exporting" it): allocated (a Numba device array back), into a strided view of a
    # larger buffer (the rest untouched), in place, q and k; read-only outputs and bad
    # ids refused, naming the rule.
    x, cos, sin, ids = make_case(rng, (2, 3, 5, 8), dtype)
    want = float32_contract(x, cos, sin, ids)
    named = {"dtype": dtype} if dtype == BFLOAT16 else {}

    def bare(host, **options):
        device = gpu.on(host)
        return Exporter(device.view(np.uint16) if host.dtype == BFLOAT16 else device, **options)

    caches = (bare(cos, **named), bare(sin, **named), bare(ids))
    got = numba_rope.rotary_embedding(bare(x, **named), *caches)
    gpu.assert_contract(gpu.off(got), x, cos, sin, ids)  # and the float64 reference's

    host_base = np.zeros((2, 3, 5, 16), dtype)
    base, view = gpu.views(host_base, host_base[..., ::-2])
    storage = (lambda a: a.view(np.uint16)) if dtype == BFLOAT16 else (lambda a: a)
    out = Exporter(storage(view), **named)
    assert numba_rope.rotary_embedding(bare(x, **named), *caches, out=out) is out
    written = gpu.off(base)
    assert_bitwise_equal(written[..., ::-2], want)
    assert not written[..., -2::-2].view(f"u{written.itemsize}").any()

    in_place = bare(x, **named)
    numba_rope.rotary_embedding(in_place, *caches, out=in_place)
    assert_bitwise_equal(gpu.off(in_place._array).view(dtype), want)

    q, k = bare(x, **named), bare(x[:, :1], **named)
    got_q, got_k = numba_rope.rotary_embedding_qk(q, k, *caches, num_kv_heads=1)
    assert_bitwise_equal(gpu.off(got_q), want)
    assert_bitwise_equal(gpu.off(got_k), want[:, :1])

    with pytest.raises(ValueError, match="out is a read-only array"):
        numba_rope.rotary_embedding(bare(x, **named), *caches, out=bare(x, read_only=True, **named))
    with pytest.raises(IndexError, match=r"position_ids\[0, 0\] = 40 is outside"):
        bad = ids.copy()
        bad[0, 0] = 40
        numba_rope.rotary_embedding(bare(x, **named), *caches[:2], bare(bad))


def test_streams_that_exporters_name_are_synchronized_first(rng, gpu, monkeypatch):
    # The interface's version 3 asks a consumer to synchronize the stream an exporter
    # names before using its data: each named stream once, not the call's own, none
    # for exporters that name none. (Recorded, not run: in the simulator every stream
    # is the default one, and these handles name no stream on a GPU.)
    from numba_rope._cuda import backend

    synchronized = []

    class Recorded:
        def __init__(self, handle):
            self.handle = handle

        def synchronize(self):
            synchronized.append(self.handle)

    made = {}
    real = backend.numba_stream
    real_handles = {None, 0}  # streams that launch (the call's own)

    def recording(handle, ordinal=None):
        if handle in real_handles:
            return real(handle, ordinal)
        return made.setdefault(handle, Recorded(handle))

    monkeypatch.setattr(backend, "numba_stream", recording)
    x, cos, sin, ids = make_case(rng, (1, 2, 3, 8), np.float32)
    caches = (Exporter(gpu.on(cos), stream=5), Exporter(gpu.on(sin), stream=2))
    got = numba_rope.rotary_embedding(Exporter(gpu.on(x), stream=5), *caches, gpu.on(ids))
    assert sorted(synchronized) == [2, 5]
    assert_bitwise_equal(gpu.off(got), float32_contract(x, cos, sin, ids))

    synchronized.clear()
    numba_rope.rotary_embedding(Exporter(gpu.on(x)), gpu.on(cos), gpu.on(sin), gpu.on(ids))
    assert synchronized == []

    synchronized.clear()  # the call's own stream (stream=, a raw handle) is not synchronized
    own_stream = cuda.stream()  # held until the test ends: its handle stays valid
    own = 7 if SIMULATOR else int(own_stream.handle.value)
    real_handles.add(own)
    monkeypatch.setattr(real(own), "synchronize", lambda: synchronized.append(own))
    x_on_own = Exporter(gpu.on(x), stream=own)
    unchecked = {"stream": own, "check_position_ids": False}  # (the check reads back on it)
    numba_rope.rotary_embedding(x_on_own, *caches, gpu.on(ids), **unchecked)
    assert sorted(synchronized) == [2, 5]  # the caches' streams; not the input's, own


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
def test_cupy_in_cupy_out(rng, gpu, dtype, interleaved):
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
    gpu.assert_contract(cupy.asnumpy(got), x, cos, sin, ids, interleaved, 12)


@needs_cupy
def test_cupy_strided_out_stream_and_errors(rng, gpu):
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
    gpu.assert_contract(
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
def test_cupy_bfloat16_through_numba_views(rng, gpu):
    import cupy

    x, cos, sin, ids = make_case(rng, (2, 4, 5, 16), BFLOAT16)
    as_bf16 = lambda a: cuda.as_cuda_array(cupy.asarray(a.view(np.uint16))).view(BFLOAT16)  # noqa: E731
    got = numba_rope.rotary_embedding(as_bf16(x), as_bf16(cos), as_bf16(sin), cupy.asarray(ids))
    assert cuda.is_cuda_array(got) and got.dtype == BFLOAT16
    bits = cupy.asarray(got.view(np.uint16))  # back to CuPy, as uint16 bits
    gpu.assert_contract(cupy.asnumpy(bits).view(BFLOAT16), x, cos, sin, ids)


@needs_torch
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16", "float64"])
def test_torch_in_torch_out(rng, gpu, dtype_name):
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
    gpu.assert_contract(host, x, cos, sin, ids, rotary_dim=8)


@needs_torch
def test_torch_stream_in_place_and_errors(rng, gpu):
    import torch

    x, cos, sin, ids = make_case(rng, (2, 4, 5, 16), np.float32)
    tx, tc, ts, ti = (torch.from_numpy(a).cuda() for a in (x, cos, sin, ids))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        result = numba_rope.rotary_embedding(tx, tc, ts, ti, out=tx)
    stream.synchronize()
    assert result is tx
    gpu.assert_contract(tx.cpu().numpy(), x, cos, sin, ids)
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
