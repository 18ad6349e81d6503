"""The benchmark package (:mod:`numba_rope.bench`) and the ``bench`` command; the asv suite
and the imports are in test_bench_asv.py."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import numba
import numpy as np
import pytest

import numba_rope
from numba_rope import _cli, bench, reference
from numba_rope.bench import runner

ROOT = Path(__file__).resolve().parent.parent


def gpu_present() -> bool:
    """A cheap look for an NVIDIA GPU that imports nothing."""
    return Path("/dev/nvidiactl").exists() or Path("/dev/nvidia0").exists()


def subprocess_env() -> dict[str, str]:
    """This checkout first on the path; no CUDA simulator (it is not a GPU)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


# ------------------------------------------------------------------ workloads and data


def test_workloads_are_the_issues():
    w = bench.WORKLOADS
    assert list(w) == ["seed", "prefill", "prefill_3d", "batch_prefill", "decode", "partial"]
    assert (w["seed"].shape, w["seed"].cache_shape) == ((2, 8, 4, 512), (100, 256))
    assert (w["prefill"].shape, w["prefill"].cache_shape) == ((1, 32, 4096, 128), (8192, 64))
    assert w["prefill"].position_ids == "arange"
    three_d = w["prefill_3d"]  # the prefill with heads inside tokens (ONNX's 3-D input)
    assert (three_d.shape, three_d.input_shape) == ((1, 32, 4096, 128), (1, 4096, 4096))
    assert (three_d.cache_shape, three_d.position_ids, three_d.three_d) == (
        (8192, 64),
        "arange",
        True,
    )
    assert not any(x.three_d for name, x in w.items() if name != "prefill_3d")
    assert (w["batch_prefill"].shape, w["batch_prefill"].position_ids) == (
        (8, 32, 1024, 128),
        "none",
    )
    assert w["batch_prefill"].cache_shape == (8, 1024, 64)
    assert (w["decode"].shape, w["decode"].position_ids) == ((64, 32, 1, 128), "random")
    assert w["decode"].cache_rows == 8192
    partial = w["partial"]
    assert (partial.shape, partial.rotary_dim, partial.interleaved) == (
        (4, 16, 2048, 128),
        64,
        True,
    )
    assert partial.cache_shape == (8192, 32) and partial.position_ids == "arange"
    assert {name for name, x in w.items() if x.batched} == {"seed", "decode"}


@pytest.mark.parametrize("name", ["seed", "decode"])
def test_cases_are_reproducible_with_real_angles(name):
    case = bench.make_case(name, "bfloat16")
    again = bench.make_case(name, "bfloat16")
    assert np.array_equal(case.input.view(np.uint16), again.input.view(np.uint16))
    assert np.array_equal(case.position_ids, again.position_ids)
    workload = case.workload
    assert case.input.shape == workload.shape and case.cos_cache.shape == workload.cache_shape
    cos, sin = case.cos_cache.astype(np.float64), case.sin_cache.astype(np.float64)
    np.testing.assert_allclose(cos**2 + sin**2, 1.0, atol=2**-6)
    np.testing.assert_allclose(cos[:, 0], np.cos(np.arange(workload.cache_rows)), atol=2**-8)
    assert case.position_ids.dtype == np.int64
    assert 0 <= case.position_ids.min() and case.position_ids.max() < workload.cache_rows
    if name == "seed":
        assert case.position_ids.tolist() == [list(r) for r in bench.SEED_POSITION_IDS]


#: A small workload of the 3-D form and its 4-D twin (same arrays from the same seed).
TINY_3D = bench.Workload("tiny_3d", (2, 3, 5, 16), "random", 40, three_d=True)
TINY_4D = bench.Workload("tiny_4d", (2, 3, 5, 16), "random", 40)


def test_a_three_d_case_is_its_four_d_twin_with_heads_inside_tokens():
    case, twin = bench.make_case(TINY_3D, "float32"), bench.make_case(TINY_4D, "float32")
    assert case.input.shape == (2, 5, 48) and case.input.flags.c_contiguous
    assert case.options == {"interleaved": False, "rotary_embedding_dim": 0, "num_heads": 3}
    assert np.array_equal(case.as_bhsd(case.input), twin.input)
    assert np.array_equal(case.from_bhsd(twin.input), case.input)
    assert np.array_equal(case.position_ids, twin.position_ids)
    assert case.rope_bytes == twin.rope_bytes


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_every_cpu_implementation_passes_the_check_on_a_three_d_case(dtype):
    # The 3-D input reaches numba_rope and onnxruntime as it is (num_heads=) and the
    # specification's NumPy and torch, which take [batch, heads, seq, head] only,
    # through a view; each output is checked against the float64 reference.
    case = bench.make_case(TINY_3D, dtype)
    expected = reference.rotary_embedding(
        case.input, case.cos_cache, case.sin_cache, case.position_ids, num_heads=3
    )
    assert expected.shape == (2, 5, 48)
    statuses = {}
    for implementation in bench.implementations("cpu", 1):
        result = bench.measure(
            implementation, case, expected, bench.CpuTarget(), 1, bench.Settings.quick()
        )
        if result is not None:
            statuses[implementation.name] = (result.status, result.reason)
    assert statuses["numba_rope"][0] == "ok", statuses
    assert statuses["numpy (spec formula, complex64)"][0] == "ok", statuses
    for name, (status, reason) in statuses.items():
        assert status in ("ok", "n/a"), (name, reason)
    if importlib.util.find_spec("onnxruntime"):
        assert statuses["onnxruntime"][0] == "ok", statuses
    if importlib.util.find_spec("torch"):
        assert statuses["torch eager"][0] == "ok", statuses


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_in_place_row_rotates_a_tensor_on_a_line_boundary(dtype):
    # Its tensor starts on 64 bytes, as torch's do, wherever malloc would put a copy;
    # it holds one rotation of the input when checked, within the check's tolerance
    # of the float64 reference.
    case = bench.make_case("seed", dtype)
    in_place = next(i for i in bench.implementations("cpu", 1) if i.name.endswith("(in place)"))
    prepared = in_place.prepare(case, bench.CpuTarget(), 1)
    tensor = prepared.output()
    assert tensor.ctypes.data % 64 == 0 and tensor.flags.c_contiguous
    assert tensor.dtype == case.input.dtype and tensor.shape == case.input.shape
    prepared.call()
    expected = reference.rotary_embedding(
        case.input, case.cos_cache, case.sin_cache, case.position_ids
    )
    assert bench.check_output(case, "rope", prepared.output(), expected)[0]
    assert bench.on_line_boundary(np.arange(7, dtype=np.float16)[1:]).ctypes.data % 64 == 0


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_preallocated_outputs_start_on_a_line_for_every_implementation(dtype):
    # out= of numba_rope, onnxruntime's bound output and the copies' targets alike, so
    # that no row's ratio depends on where NumPy's allocator put its output; each still
    # holds its implementation's result.
    case = bench.make_case("seed", dtype)
    names = ("numba_rope", "onnxruntime", "np.copyto (1 thread)", "copy (numba")
    seen = set()
    for implementation in bench.implementations("cpu", 2):
        name = implementation.name
        if name not in names[:3] and not name.startswith(names[3]):
            continue
        try:
            prepared = implementation.prepare(case, bench.CpuTarget(), 2)
        except bench.Unavailable:
            continue  # onnxruntime not installed
        prepared.call()
        output = prepared.output()
        assert output.ctypes.data % 64 == 0, implementation.name
        assert output.shape == case.input.shape and output.flags.c_contiguous
        kind = "copy" if "copy" in implementation.name else "rope"
        expected = (
            case.input
            if kind == "copy"
            else reference.rotary_embedding(
                case.input, case.cos_cache, case.sin_cache, case.position_ids
            )
        )
        assert bench.check_output(case, kind, output, expected)[0], implementation.name
        seen.add(name)
    assert {"numba_rope", "np.copyto (1 thread)", "copy (numba, 2 threads)"} <= seen


def test_bytes_count_each_distinct_cache_row_once():
    case = bench.make_case("seed", "float16")
    distinct = len({6, 2, 1, 7, 8, 3})
    assert case.distinct_cache_rows == distinct
    assert case.copy_bytes == 2 * case.input.nbytes
    assert case.rope_bytes == 2 * case.input.nbytes + distinct * 2 * 256 * 2


def test_spec_formula_numpy_agrees_with_the_reference():
    for name in ("seed", "decode"):
        case = bench.make_case(name, "float32")
        w = case.workload
        got = bench.spec_formula_numpy(
            case.input, case.cos_cache, case.sin_cache, case.position_ids, False, 0
        )
        want = reference.rotary_embedding(
            case.input, case.cos_cache, case.sin_cache, case.position_ids
        )
        assert got.dtype == np.float32 and w.rotary_dim == 0
        assert bench.check_output(case, "rope", got, want)[0]


def test_spec_formula_numpy_partial_interleaved(rng):
    x = rng.standard_normal((2, 3, 5, 16)).astype(np.float16)
    cos, sin = bench.rope_caches(np.arange(9), 8, np.float16)
    ids = rng.integers(0, 9, size=(2, 5))
    got = bench.spec_formula_numpy(x, cos, sin, ids, True, 8)
    want = reference.rotary_embedding(x, cos, sin, ids, interleaved=True, rotary_embedding_dim=8)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=4e-3)
    assert np.array_equal(got[..., 8:], x[..., 8:])


# --------------------------------------------------------------------- verification


def _wrong_sign(case, target, threads):
    """RoPE with the sine's sign flipped: a plausible, wrong implementation."""
    w = case.workload
    holder = []

    def call():
        holder[:] = [
            numba_rope.rotary_embedding(
                case.input,
                case.cos_cache,
                -case.sin_cache,
                case.position_ids,
                interleaved=w.interleaved,
                rotary_embedding_dim=w.rotary_dim,
            )
        ]

    return bench.Prepared(call, lambda: holder[0])


def _wrong_dtype(case, target, threads):
    result = reference.rotary_embedding(
        case.input, case.cos_cache, case.sin_cache, case.position_ids
    ).astype(np.float64)
    return bench.Prepared(lambda: None, lambda: result)


def _crashes(case, target, threads):
    def call():
        raise RuntimeError("kernel exploded")

    return bench.Prepared(call, lambda: case.input)


def _not_a_copy(case, target, threads):
    out = case.input.copy()
    out.reshape(-1)[-1] += 1
    return bench.Prepared(lambda: None, lambda: out)


@pytest.mark.parametrize(
    ("kind", "prepare", "reason"),
    [
        ("rope", _wrong_sign, "max error"),
        ("rope", _wrong_dtype, "float64"),
        ("rope", _crashes, "RuntimeError: kernel exploded"),
        ("copy", _not_a_copy, "not a bitwise copy"),
    ],
)
def test_a_wrong_implementation_is_failed_and_not_timed(kind, prepare, reason):
    case = bench.make_case("seed", "float32")
    expected = reference.rotary_embedding(
        case.input, case.cos_cache, case.sin_cache, case.position_ids
    )
    wrong = bench.Implementation("wrong", kind, prepare)
    result = bench.measure(wrong, case, expected, bench.CpuTarget(), 1, bench.Settings.quick())
    assert result.status == "FAILED"
    assert reason in result.reason
    assert result.median_s is None and result.gb_per_s is None and result.samples == 0


def test_run_reports_a_wrong_extra_implementation():
    settings = bench.Settings.quick(workloads=["seed"], dtypes=["float16"])
    wrong = bench.Implementation("sign-flipped", "rope", _wrong_sign)
    report = bench.run(settings, progress=None, extra=[wrong])
    assert [r.implementation for r in report.failed] == ["sign-flipped"]
    table = bench.format_table(report)
    assert "sign-flipped" in table and "FAILED" in table


def test_check_output_tolerance_is_a_few_eps():
    case = bench.make_case("seed", "bfloat16")
    want = reference.rotary_embedding(case.input, case.cos_cache, case.sin_cache, case.position_ids)
    assert bench.check_output(case, "rope", want, want) == (True, 0.0, "")
    scale = float(np.abs(case.input.astype(np.float32)).max())  # cos + sin >= 1 somewhere
    nudged = want.astype(np.float32)
    nudged.reshape(-1)[0] += 8 * bench.EPSILON["bfloat16"] * scale * np.sqrt(2)
    ok, error, reason = bench.check_output(case, "rope", nudged.astype(want.dtype), want)
    assert not ok and error > bench.TOLERANCE_EPS and "eps" in reason
    with_nan = want.copy()
    with_nan.reshape(-1)[3] = np.nan
    assert bench.check_output(case, "rope", with_nan, want)[:1] == (False,)


def test_time_calls_batches_small_calls():
    calls = []
    timing = bench.time_calls(lambda: calls.append(1), 4, batch_seconds=1e-3, warmup=1)
    assert timing.samples == 4 and timing.calls_per_sample > 1
    assert 0 < timing.median <= timing.p95
    assert len(calls) == 1 + 3 + 4 * timing.calls_per_sample
    single = bench.time_calls(lambda: None, 5, warmup=0)
    assert single.calls_per_sample == 1 and single.samples == 5


def test_single_calls_take_enough_samples_that_a_few_stalls_are_not_their_p95(monkeypatch):
    # With --single-calls p95 is one call's latency. Two stalls of the machine in a
    # row's samples (2 ms each among calls that take microseconds) make the p95 of 30
    # samples; of the default number for the small workloads' single calls, they do not.
    small, large = bench.WORKLOADS["decode"], bench.WORKLOADS["prefill"]
    assert small.batched and not large.batched
    for settings, counts in (
        (bench.Settings(), (30, 30)),
        (bench.Settings(single_calls=True), (bench.SINGLE_CALL_REPEATS, 30)),
        (bench.Settings(single_calls=True, repeats=7), (7, 7)),
        (bench.Settings.quick(single_calls=True), (3, 3)),
    ):
        assert (settings.samples_for(small), settings.samples_for(large)) == counts
    assert bench.REPEATS == 30 and bench.SINGLE_CALL_REPEATS >= 200

    def stalling_twice_in(repeats):
        calls, stalled = iter(range(repeats)), (5, repeats // 2)
        return lambda: time.sleep(2e-3) if next(calls) in stalled else None

    for repeats, stalls_are_p95 in ((bench.REPEATS, True), (bench.SINGLE_CALL_REPEATS, False)):
        timing = bench.time_calls(stalling_twice_in(repeats), repeats, warmup=0)
        assert timing.samples == repeats and (timing.p95 > 1e-3) is stalls_are_p95
    # The command takes the same defaults, and --repeats over them; the header says so.
    chosen = []
    monkeypatch.setattr(
        bench, "run", lambda settings: chosen.append(settings.samples_for(small)) or 1 / 0
    )
    single, forty = ["--single-calls"], ["--single-calls", "--repeats", "40"]
    for arguments, repeats in (([], 30), (single, 600), (forty, 40)):
        with pytest.raises(ZeroDivisionError):
            _cli.main(["bench", "--workloads", "seed", *arguments])
        assert chosen.pop() == repeats
    report = bench.Report(settings={"device": "cpu", "single_calls": True}, environment={
        "numba_rope": "x", "numba": "x", "numpy": "x", "numba_threads": 2,
        "numba_threading_layer": "omp"}, results=[])  # fmt: skip
    header = bench.format_table(report).splitlines()[0]
    assert "600 single calls (seed, decode; 30 on the others)" in header


def test_time_calls_runs_between_before_each_sample_untimed():
    events = []
    timing = bench.time_calls(
        lambda: events.append("call"),
        3,
        batch_seconds=1e-3,
        warmup=0,
        between=lambda: events.append("between"),
    )
    number = timing.calls_per_sample
    assert events == ["call"] * 3 + (["between"] + ["call"] * number) * 3


def test_the_in_place_row_starts_each_sample_from_the_input(monkeypatch):
    # Rotated again and again, a bfloat16 tensor drifts (its cos and sin are rounded);
    # reset copies the input back between samples, bit for bit, on the calling thread
    # (numba's parallel copy would leave its worker threads spinning on the core the
    # helper thread needs for the calls timed next).
    from numba_rope.bench import targets

    def parallel_copy(source, destination):
        raise AssertionError("a reset must not wake numba's worker threads")

    monkeypatch.setattr(targets, "parallel_copy", parallel_copy)
    case = bench.make_case("seed", "bfloat16")
    in_place = next(i for i in bench.implementations("cpu", 1) if i.name.endswith("(in place)"))
    prepared = in_place.prepare(case, bench.CpuTarget(), 1)
    for _ in range(5):
        prepared.call()
    assert not np.array_equal(prepared.output().view(np.uint16), case.input.view(np.uint16))
    assert prepared.reset is not None
    prepared.reset()
    assert np.array_equal(prepared.output().view(np.uint16), case.input.view(np.uint16))


def test_the_in_place_row_resets_on_the_gpu_target():
    # The same reset through CudaTarget.restore (device to device), under the simulator
    # where there is no GPU: the target refuses the simulator only for timing.
    import numba
    from numba import cuda

    if numba.config.ENABLE_CUDASIM:  # the target without its refusal of the simulator
        target = bench.CudaTarget.__new__(bench.CudaTarget)
        target.cuda = cuda
    else:  # pragma: no cover - a GPU machine
        target = bench.CudaTarget()
    case = bench.make_case("seed", "float16")
    in_place = next(i for i in bench.implementations("cuda", 1) if i.name.endswith("(in place)"))
    prepared = in_place.prepare(case, target, 1)
    prepared.call()
    assert not np.array_equal(prepared.output().view(np.uint16), case.input.view(np.uint16))
    assert prepared.reset is not None
    prepared.reset()
    assert np.array_equal(prepared.output().view(np.uint16), case.input.view(np.uint16))


def test_time_calls_stops_at_its_budget():
    timing = bench.time_calls(lambda: None, 10_000, budget_seconds=0.0, warmup=0)
    assert timing.samples == 3


def test_parallel_copy_copies_every_dtype(rng):
    for dtype in bench.DTYPES:
        x = rng.standard_normal((3, 5, 7)).astype(bench.as_dtype(dtype))
        out = np.empty_like(x)
        bench.parallel_copy(x, out)
        assert np.array_equal(out.view(np.uint8), x.view(np.uint8))


# ------------------------------------------------------------------------ the command


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    """One quick bench of the seed in float32 and bfloat16, through the command."""
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    code = _cli.main(
        [
            "bench",
            "--quick",
            "--workloads",
            "seed",
            "--dtypes",
            "float32,bfloat16",
            "--json",
            str(path),
        ]
    )
    return code, json.loads(path.read_text())


def test_bench_quick_writes_json_with_every_field(quick_report):
    code, data = quick_report
    assert code == 0
    assert data["settings"]["workloads"] == ["seed"]
    assert data["settings"]["dtypes"] == ["float32", "bfloat16"]
    assert data["environment"]["numba_rope"] == numba_rope.__version__
    rows = {(r["dtype"], r["implementation"]): r for r in data["results"]}
    threads = data["settings"]["threads"]
    for dtype in ("float32", "bfloat16"):
        for name in (
            f"copy (numba, {threads} threads)",
            "np.copyto (1 thread)",
            "x.copy() (allocating, 1 thread)",
            "numba_rope",
            "numba_rope (allocating)",
            "numba_rope (in place)",
            "numba_rope (out= 16 B past a line)",
            "numpy (spec formula, complex64)",
        ):
            row = rows[(dtype, name)]
            assert row["status"] == "ok", row
            assert row["workload"] == "seed" and row["device"] == "cpu"
            assert row["median_s"] > 0 and row["p95_s"] >= row["median_s"]
            assert row["gb_per_s"] > 0 and row["bytes"] > 0 and row["samples"] >= 1
            assert row["calls_per_sample"] >= 1
            if not name.startswith(("copy", "np.copyto")):
                assert row["ratio_to_copy"] > 0 and row["error_eps"] <= bench.TOLERANCE_EPS
        # x.copy() is a bitwise copy, and no floor: a ratio of its own, not the ratios'
        # denominator (the numba_rope rows' ratios divide by the faster preallocated copy).
        fresh = rows[(dtype, "x.copy() (allocating, 1 thread)")]
        assert fresh["kind"] == "allocating copy" and fresh["error_eps"] == 0.0
        floor = min(rows[(dtype, n)]["median_s"] for n in (
            f"copy (numba, {threads} threads)", "np.copyto (1 thread)"))  # fmt: skip
        rope = rows[(dtype, "numba_rope")]
        assert rope["ratio_to_copy"] == pytest.approx(rope["median_s"] / floor)


def test_bench_runs_onnxruntime_where_it_can(quick_report):
    pytest.importorskip("onnxruntime")
    _, data = quick_report
    rows = {(r["dtype"], r["implementation"]): r for r in data["results"]}
    assert rows[("float32", "onnxruntime")]["status"] == "ok"
    bf16 = rows[("bfloat16", "onnxruntime")]
    assert bf16["status"] == "n/a" and "bfloat16" in bf16["reason"]


def test_bench_notes_peers_that_are_not_installed(quick_report):
    _, data = quick_report
    if importlib.util.find_spec("torch") is None:
        assert "torch eager" in data["not_installed"]
        assert all(r["implementation"] != "torch eager" for r in data["results"])
    else:  # pragma: no cover - torch is not a test dependency
        assert any(r["implementation"] == "torch eager" for r in data["results"])


def test_bench_command_in_a_subprocess_prints_table_and_progress(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "numba_rope",
            "bench",
            "--quick",
            "--workloads",
            "seed",
            "--dtypes",
            "float16",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "[1/" in result.stderr and "seed float16" in result.stderr
    header = next(line for line in result.stdout.splitlines() if line.startswith("workload"))
    for column in ("dtype", "implementation", "median", "p95", "GB/s", "ratio", "check"):
        assert column in header
    assert "copy (numba, 1 threads)" in result.stdout
    assert "1 threads" in result.stdout


def test_bench_plot_draws_a_png(quick_report, tmp_path):
    pytest.importorskip("matplotlib")
    _, data = quick_report
    report = bench.Report(
        settings=data["settings"],
        environment=data["environment"],
        results=[bench.Result(**r) for r in data["results"]],
    )
    path = tmp_path / "bench.png"
    bench.plot(report, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plot_without_matplotlib_says_how_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code = _cli.main(["bench", "--quick", "--workloads", "seed", "--plot", str(tmp_path / "p.png")])
    assert code == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_bench_refuses_unwritable_outputs_before_it_runs(monkeypatch, capsys, tmp_path):
    """A --json or --plot path that cannot be written (no such folder, a folder, a
    suffix matplotlib draws no format for) is refused before any timing: a full bench
    takes minutes, and its end is too late to say so."""
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(bench, "run", lambda settings: pytest.fail("the bench ran"))
    missing = tmp_path / "no such folder" / "b.json"
    cases = (
        (["--json", str(missing)], "its folder"),
        (["--plot", str(tmp_path / "no such folder" / "p.png")], "does not exist"),
        (["--json", str(tmp_path)], "is a folder"),
        (["--plot", str(tmp_path / "p.xyz")], "matplotlib draws no 'xyz' files"),
    )
    for arguments, words in cases:
        assert _cli.main(["bench", "--quick", "--workloads", "seed", *arguments]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_bench_reports_its_failures_and_a_write_that_fails_after_the_run(
    monkeypatch, capsys, tmp_path
):
    """The FAILED lines come before the outputs are written, and a write the disk
    refuses after the run is an error line (exit 2 unless a check failed: 1), not a
    traceback."""
    report = bench.Report(settings={"device": "cpu"}, environment={
        "numba_rope": "x", "numba": "x", "numpy": "x", "numba_threads": 2,
        "numba_threading_layer": "omp"}, results=[])  # fmt: skip

    def refuse(report, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench, "run", lambda settings: report)
    monkeypatch.setattr(bench, "write_json", refuse)
    path = str(tmp_path / "b.json")
    assert _cli.main(["bench", "--quick", "--workloads", "seed", "--json", path]) == 2
    err = capsys.readouterr().err
    assert f"error: could not write {path}: [Errno 28] No space left on device" in err
    failure = types.SimpleNamespace(
        implementation="numba_rope", workload="seed", dtype="float32", reason="wrong bits"
    )
    monkeypatch.setattr(bench.Report, "failed", property(lambda self: [failure]))
    assert _cli.main(["bench", "--quick", "--workloads", "seed", "--json", path]) == 1
    err = capsys.readouterr().err
    assert err.index("FAILED: numba_rope on seed float32: wrong bits") < err.index("error:")


def test_counts_out_of_range_are_refused_by_name(capsys):
    """Counts that are not positive integers, and threads beyond numba's, are argparse
    errors that say the rule and the value (not a numba traceback at the run, nor
    argparse's message naming a private function)."""
    threads = numba.config.NUMBA_NUM_THREADS
    for arguments, words in (
        (["bench", "--threads", str(threads + 1)], f"must lie in [1, {threads}]"),
        (["bench", "--repeats", "abc"], "must be a positive integer, got 'abc'"),
        (["bench", "--rounds", "0"], "must be a positive integer, got '0'"),
        (["demo", "--repeats", "0"], "must be a positive integer, got '0'"),
        (["demo", "--repeats", "-1"], "must be a positive integer, got '-1'"),
    ):
        with pytest.raises(SystemExit):
            _cli.main(arguments)
        err = capsys.readouterr().err
        assert words in err and "_positive" not in err, err


def test_bench_rejects_unknown_names(capsys):
    with pytest.raises(SystemExit):
        _cli.main(["bench", "--workloads", "seed,nonsense"])
    assert "choose from seed, prefill" in capsys.readouterr().err


@pytest.mark.skipif(gpu_present(), reason="a GPU is present: the cuda bench would run")
def test_bench_on_cuda_without_a_gpu_is_a_clear_error():
    result = subprocess.run(
        [sys.executable, "-m", "numba_rope", "bench", "--device", "cuda", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert result.returncode == 2
    assert "cannot benchmark on cuda" in result.stderr and "GPU" in result.stderr


def test_cuda_target_refuses_the_simulator(monkeypatch):
    import numba

    monkeypatch.setattr(numba.config, "ENABLE_CUDASIM", 1)
    with pytest.raises(bench.Unavailable, match="simulator"):
        bench.target("cuda")


# ---------------------------------------------------------------- latency on a busy core


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as stream:
        fields = stream.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_busy_loop_spins_only_inside_its_block():
    with bench.busy_loop() as process:
        assert process is not None and process.poll() is None
        if os.path.exists(f"/proc/{process.pid}/stat"):  # Linux: it takes a core
            before = _cpu_seconds(process.pid)
            time.sleep(0.5)
            assert _cpu_seconds(process.pid) - before > 0.05
    assert process.poll() is not None  # killed and reaped
    with pytest.raises(RuntimeError), bench.busy_loop() as raised_in:
        raise RuntimeError("the block fails")
    assert raised_in is not None and raised_in.poll() is not None
    with bench.busy_loop(False) as nothing:
        assert nothing is None


def test_each_implementation_is_timed_after_settling(monkeypatch):
    # The calling thread copies on its own before each implementation, so that the
    # worker threads of the one before (onnxruntime's pool, OpenMP's, numba_rope's
    # helper) have stopped spinning when it is timed.
    events = []
    real_measure = runner.measure
    monkeypatch.setattr(runner, "settle", lambda seconds: events.append(("settle", seconds)))

    def measure(implementation, *args, **kwargs):
        events.append(("measure", implementation.name))
        return real_measure(implementation, *args, **kwargs)

    monkeypatch.setattr(runner, "measure", measure)
    settings = bench.Settings.quick(workloads=["seed"], dtypes=["float32"], settle_seconds=0.002)
    report = bench.run(settings, progress=None)
    threads = report.settings["threads"]
    names = [implementation.name for implementation in bench.implementations("cpu", threads)]
    assert events == [event for name in names for event in (("settle", 0.002), ("measure", name))]
    assert "each after 2 ms of settling" in bench.format_table(report).splitlines()[0]
    assert bench.Settings().settle_seconds == bench.SETTLE_SECONDS > 0.045  # > onnxruntime's spin
    assert bench.Settings.quick().settle_seconds == 0


def test_implementations_take_turns_in_rounds_and_pool_their_samples(monkeypatch):
    # Round after round, every implementation of a (workload, dtype) is timed again
    # (settled first, prepared afresh, checked in the first round only, for its share
    # of the samples and budget), and a row's median and p95 are those of its samples
    # from all rounds, so that a machine's drift moves all rows alike. The timer is
    # replaced by one whose samples say which round took them ("drifting" slows down
    # from round to round), so that nothing here depends on this machine's timing.
    events = []
    real_measure = runner.measure
    monkeypatch.setattr(runner, "settle", lambda seconds: events.append(("settle", seconds)))

    def measure(implementation, *args, **kwargs):
        events.append(("measure", implementation.name, kwargs["check"]))
        return real_measure(implementation, *args, **kwargs)

    asked = []

    def time_calls(call, repeats, **kwargs):
        asked.append((repeats, kwargs["budget_seconds"]))
        call()
        turn = getattr(call, "turn", 0)
        values = tuple(1e-3 * (1 + turn) * (1 + 0.5 * i) for i in range(repeats))
        median, p95 = float(np.median(values)), float(np.percentile(values, 95))
        return bench.Timing(median, p95, len(values), 1, values)

    monkeypatch.setattr(runner, "measure", measure)
    monkeypatch.setattr(runner, "time_calls", time_calls)
    prepared_in: list[int] = []

    def drifting(case, tgt, threads):
        turn = len(prepared_in)
        prepared_in.append(turn)
        want = reference.rotary_embedding(
            case.input, case.cos_cache, case.sin_cache, case.position_ids, **case.options
        )

        def call():
            pass

        call.turn = turn  # type: ignore[attr-defined]
        return bench.Prepared(call, lambda: want if turn == 0 else want * 0)

    extra = [bench.Implementation("drifting", "rope", drifting)]
    settings = bench.Settings.quick(
        workloads=["seed"], dtypes=["float32"], settle_seconds=0.001, rounds=3, repeats=6
    )
    settings.budget_seconds = 30.0
    report = bench.run(settings, progress=None, extra=extra)
    threads = report.settings["threads"]
    names = [implementation.name for implementation in bench.implementations("cpu", threads)]
    names.append("drifting")
    ran = [e for e in events if e[0] == "measure"]
    assert [e[1] for e in ran] == names * 3  # in turns, not one implementation at a time
    assert [e[2] for e in ran] == [True] * len(names) + [False] * (2 * len(names))
    assert events[::2] == [("settle", 0.001)] * len(ran)
    assert prepared_in == [0, 1, 2]  # prepared afresh each round; checked in the first only
    assert set(asked) == {(2, 10.0)}  # a third of the samples and of the budget
    row = next(r for r in report.results if r.implementation == "drifting")
    pooled = [1e-3, 1.5e-3, 2e-3, 3e-3, 3e-3, 4.5e-3]
    assert row.status == "ok" and row.samples == 6
    np.testing.assert_allclose(row.sample_s, pooled)
    assert row.median_s == pytest.approx(2.5e-3)
    assert row.p95_s == pytest.approx(float(np.percentile(pooled, 95)))
    assert row.gb_per_s == pytest.approx(row.bytes / 2.5e-3 / 1e9)
    floor = min(r.median_s for r in report.results if r.kind == "copy")
    assert floor == pytest.approx(1.25e-3)  # a copy's three rounds of (1, 1.5) ms
    assert row.ratio_to_copy == pytest.approx(2.0)
    assert "6 samples in 3 rounds" in bench.format_table(report).splitlines()[0]
    assert bench.Settings().rounds == 3 and bench.Settings.quick().rounds == 1


def test_a_slow_numba_rope_row_of_a_large_input_is_probed_and_noted(monkeypatch):
    """A numba_rope row over SLOW_ROW_FACTOR copy floors is timed again as it was,
    without streaming stores and on one thread (both settings restored after), and as
    a copy into its output; the report notes it. Rows of other implementations, and faster ones, are
    not probed. A fake timer gives each call its time (the slow row's is the floor's
    without streaming stores), so nothing depends on this machine's speed."""
    from numba_rope import config

    monkeypatch.setattr(runner, "PROBE_MIN_BYTES", 0)  # the seed stands in for a large input
    default = config.STREAMING_MIN_BYTES
    floor = 1e-3

    def time_calls(call, repeats, **kwargs):
        call()
        seconds = getattr(call, "seconds", lambda: floor)()
        return bench.Timing(seconds, seconds, repeats, 1, (seconds,) * repeats)

    monkeypatch.setattr(runner, "time_calls", time_calls)
    monkeypatch.setattr(runner, "implementations", lambda device, threads: [])

    def prepare(seconds):
        def prepared(case, tgt, threads):
            want = reference.rotary_embedding(
                case.input, case.cos_cache, case.sin_cache, case.position_ids, **case.options
            )

            def call():
                pass

            call.seconds = seconds  # type: ignore[attr-defined]
            return bench.Prepared(call, lambda: want)

        return prepared

    def copy(case, tgt, threads):
        out = np.empty_like(case.input)

        def call():
            np.copyto(out, case.input)

        return bench.Prepared(call, lambda: out)

    threads = numba.get_num_threads()

    def slow_when_streaming():  # on two threads or more, as the OpenMP team's state
        # (where the process has one numba thread, whenever it streams: the probe then
        # has no one-thread rerun to make)
        streaming = config.STREAMING_MIN_BYTES == default
        return 5 * floor if streaming and (numba.get_num_threads() > 1 or threads == 1) else floor

    extra = [
        bench.Implementation("copy", "copy", copy),
        bench.Implementation("numba_rope (slow)", "rope", prepare(slow_when_streaming)),
        bench.Implementation("numba_rope (fast)", "rope", prepare(lambda: 1.2 * floor)),
        bench.Implementation("a slow peer", "rope", prepare(lambda: 9 * floor)),
    ]
    settings = bench.Settings.quick(workloads=["seed"], dtypes=["float32"], settle_seconds=0)
    report = bench.run(settings, progress=None, extra=extra)
    assert config.STREAMING_MIN_BYTES == default and numba.get_num_threads() == threads
    rows = {r.implementation: r for r in report.results}
    probe = rows["numba_rope (slow)"].probe
    assert probe is not None
    assert probe["floor_s"] == floor and probe["again_s"] == 5 * floor
    assert probe["unstreamed_s"] == floor and probe["copy_into_output_s"] == floor
    assert probe["one_thread_s"] == (floor if threads > 1 else None)
    faults = probe["minor_faults_per_call"]
    assert faults is None or faults >= 0
    assert rows["numba_rope (fast)"].probe is None and rows["a slow peer"].probe is None
    (note,) = [w for w in report.warnings if w.startswith("NOTE:")]
    assert note.startswith("NOTE: seed float32 numba_rope (slow) took 5.0x the copy floor")
    assert "without streaming stores 1.00 ms" in note
    assert ("on one thread 1.00 ms" in note) == (threads > 1)
    assert "a copy of the input into its output 1.00 ms" in note
    assert json.loads(json.dumps(report.to_json()))["results"][1]["probe"] == probe


def test_probing_a_slow_row_restores_the_streaming_setting_when_the_call_raises():
    from numba_rope import config

    default = config.STREAMING_MIN_BYTES

    def call():
        if config.STREAMING_MIN_BYTES != default:
            raise RuntimeError("failed without streaming stores")

    case = bench.make_case(bench.WORKLOADS["seed"], "float32")
    prepared = bench.Prepared(call, lambda: case.input)
    with pytest.raises(RuntimeError, match="without streaming"):
        runner.probe_slow_row(prepared, case, 1e-3, repeats=1)
    assert config.STREAMING_MIN_BYTES == default


def test_a_failure_in_a_later_round_is_reported(monkeypatch):
    calls: list[int] = []

    def fails_in_round_two(case, tgt, threads):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("kernel exploded in round 2")
        want = reference.rotary_embedding(
            case.input, case.cos_cache, case.sin_cache, case.position_ids, **case.options
        )
        return bench.Prepared(lambda: None, lambda: want)

    settings = bench.Settings.quick(workloads=["seed"], dtypes=["float32"], rounds=3)
    monkeypatch.setattr(runner, "implementations", lambda device, threads: [])  # "flaky" alone
    report = bench.run(
        settings, progress=None, extra=[bench.Implementation("flaky", "rope", fails_in_round_two)]
    )
    (row,) = report.results
    assert row.status == "FAILED" and "round 2" in row.reason and row.median_s is None
    assert len(calls) == 2  # not timed again after failing


def test_bench_single_calls_with_a_busy_core(monkeypatch, tmp_path, capsys, quick_report):
    spun = []
    real_busy_loop = bench.busy_loop

    @contextlib.contextmanager
    def watched(enabled=True):
        with real_busy_loop(enabled) as process:
            spun.append(process is not None and process.poll() is None)
            yield process

    monkeypatch.setattr(runner, "busy_loop", watched)  # where run() looks it up
    path = tmp_path / "bench.json"
    arguments = ["bench", "--quick", "--workloads", "seed", "--dtypes", "float32"]
    code = _cli.main([*arguments, "--single-calls", "--busy", "--json", str(path)])
    assert code == 0 and spun == [True]
    data = json.loads(path.read_text())
    assert data["settings"]["single_calls"] is True and data["settings"]["busy"] is True
    assert data["settings"]["samples"] == {"seed": 3}  # --quick's, per workload
    timed = [r for r in data["results"] if r["median_s"] is not None]
    assert len(timed) >= 4 and all(r["calls_per_sample"] == 1 for r in timed)
    header = capsys.readouterr().out.splitlines()[0]
    assert "single calls" in header and "a busy loop on another core" in header
    # Without the options the same small workload times batches of calls, on idle cores.
    _, batched = quick_report
    assert batched["settings"]["single_calls"] is False and batched["settings"]["busy"] is False
    copy = next(r for r in batched["results"] if r["implementation"] == "np.copyto (1 thread)")
    assert copy["calls_per_sample"] > 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_off_line_row_writes_where_numpy_puts_large_arrays(dtype):
    # The row's output starts NUMPY_PLACEMENT (16) bytes past a 64-byte line, the
    # `numba_rope` row's on one; both hold the contract's bits after a call.
    from oracles import assert_bitwise_equal, float32_contract

    from numba_rope.bench import peers
    from numba_rope.bench.targets import target

    case = bench.make_case("seed", dtype)
    want = float32_contract(case.input, case.cos_cache, case.sin_cache, case.position_ids,
                            **case.options)  # fmt: skip
    for make, offset in ((peers._numba_rope_out_off_line, 16), (peers._numba_rope_out, 0)):
        prepared = make(case, target("cpu"), 2)
        prepared.call()
        out = prepared.output()
        assert out.ctypes.data % 64 == offset
        assert_bitwise_equal(out, want)


def test_numba_rope_rows_are_timed_after_their_compiled_plans_are_made():
    # The eighth repeat of a small NumPy call makes its compiled plan (a load from
    # numba's cache: milliseconds), the ninth its helper-sharing entry: both before
    # the timed calls, or two of 30 single calls are those loads (the row's p95).
    from numba_rope._cpu import backend as cpu_backend
    from numba_rope.bench.runner import Settings, warmup_calls

    rows = bench.implementations("cpu", 2)
    for row in rows:
        warm = warmup_calls(Settings(), row)
        if row.name.startswith("numba_rope"):
            assert warm >= cpu_backend.FAST_AFTER + 2
        else:
            assert warm == Settings().warmup  # peers as before
        assert warmup_calls(Settings.quick(), row) == Settings.quick().warmup
