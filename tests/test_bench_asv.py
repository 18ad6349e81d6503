"""The other users of :mod:`numba_rope.bench`: the asv suite, and what importing the
package (or the GPU check script) pulls in."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
from oracles import assert_bitwise_equal, float32_contract
from test_bench import ROOT, gpu_present, subprocess_env

import numba_rope
from numba_rope import bench

ASV_DIR = ROOT / "asv_bench"


def test_importing_the_package_or_the_gpu_check_imports_no_gpu_library():
    # numba_rope does not import its benchmarks; they, and the GPU check script, import
    # numba.cuda, CuPy and torch only when a GPU run asks for them.
    code = (
        "import sys, runpy, numba_rope\n"
        "assert 'numba_rope.bench' not in sys.modules\n"
        "import numba_rope.bench\n"
        f"runpy.run_path({str(ROOT / 'tools' / 'gpu_check.py')!r}, run_name='gpu_check')\n"
        "assert 'numba_rope.bench.gpu_check' in sys.modules\n"
        "loaded = {'numba.cuda', 'cupy', 'torch', 'onnx', 'onnxruntime', 'matplotlib'}\n"
        "assert not loaded & set(sys.modules), sorted(loaded & set(sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stderr


def _load_asv_suite():
    spec = importlib.util.spec_from_file_location(
        "bench_rope", ASV_DIR / "benchmarks" / "bench_rope.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_asv_suite_uses_the_bench_workloads():
    suite = _load_asv_suite()
    for cls in (suite.Time, suite.Memory, suite.Bandwidth):
        assert cls.params == (list(bench.DEVICES), list(bench.DTYPES), list(bench.WORKLOADS))
        assert tuple(cls.param_names) == ("device", "dtype", "workload")


def test_asv_benchmarks_run_on_the_cpu_and_skip_cuda_without_a_gpu():
    suite = _load_asv_suite()
    args = ("cpu", "float16", "seed")
    timed = suite.Time()
    timed.setup(*args)
    timed.time_rope_out(*args)
    timed.time_rope_alloc(*args)
    timed.time_rope_in_place(*args)  # one rotation of the input, in place
    assert_bitwise_equal(timed.work, timed.out)
    timed.time_rope_qk_q_in_place(*args)
    _, cos, sin, ids = timed.arguments
    assert timed.k.shape[1] == 2  # a quarter of the 8 heads
    want_k = numba_rope.rotary_embedding(timed.k, cos, sin, ids, **timed.options)
    assert_bitwise_equal(timed.k_out, want_k)
    memory = suite.Memory()
    memory.setup(*args)
    memory.peakmem_rope_alloc(*args)
    bandwidth = suite.Bandwidth()
    bandwidth.setup(*args)
    fraction = bandwidth.track_bandwidth_fraction(*args)
    assert 0 < fraction < 100
    assert suite.Bandwidth.track_bandwidth_fraction.unit
    caches32 = suite.TimeFloat32Caches()
    for dtype in suite.TimeFloat32Caches.params[1]:
        args32 = ("cpu", dtype, "seed")
        caches32.setup(*args32)
        _, cos, sin, ids = caches32.arguments
        assert cos.dtype == sin.dtype == np.float32 and caches32.out.dtype != np.float32
        caches32.time_rope_out(*args32)
        host = caches32.case
        want = float32_contract(host.input, cos, sin, ids, **host.options)
        assert_bitwise_equal(caches32.out, want)
    with pytest.raises(NotImplementedError, match="host memory"):
        suite.Memory().setup("cuda", "float16", "seed")
    if not gpu_present():
        with pytest.raises(NotImplementedError):
            suite.Time().setup("cuda", "float16", "seed")


@pytest.mark.skipif(importlib.util.find_spec("asv") is None, reason="asv is not installed")
def test_asv_check_accepts_the_suite():
    env = subprocess_env()
    env["ASV_PYTHONPATH"] = env["PYTHONPATH"]  # asv drops PYTHONPATH: test this checkout
    result = subprocess.run(
        [sys.executable, "-m", "asv", "check", "--python=same"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ASV_DIR,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No problems found" in result.stdout, result.stdout
