"""What the bench says around its numbers: the allocating onnxruntime peer, the vector
extensions in the header and the JSON, and the warnings when the load average or the
copy floor's spread makes the ratios meaningless (in the table, the JSON and the plot).

The load and the spread are injected (monkeypatched load average, made-up rows), never
produced by loading the machine.
"""

from __future__ import annotations

import json
import platform

import pytest

from numba_rope import _cli, bench, reference
from numba_rope import _conversions as conversions
from numba_rope.bench import report as report_module

ORT_RUN = "onnxruntime run()"


def _quiet(monkeypatch, value=0.0):
    """A load average of ``value`` at the start and the end of every run."""
    monkeypatch.setattr(report_module, "load_average", lambda: value)


# ------------------------------------------------------------- onnxruntime's run()


@pytest.mark.parametrize("workload", ["seed", "partial"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_onnxruntime_run_is_a_verified_peer(workload, dtype):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    peers = {i.name: i for i in bench.implementations("cpu", 1)}
    names = list(peers)
    assert names.index(ORT_RUN) == names.index("onnxruntime") + 1
    case = bench.make_case(workload, dtype)
    expected = reference.rotary_embedding(
        case.input, case.cos_cache, case.sin_cache, case.position_ids, **case.options
    )
    result = bench.measure(
        peers[ORT_RUN], case, expected, bench.CpuTarget(), 1, bench.Settings.quick()
    )
    assert result.status == "ok", result.reason
    assert result.kind == "rope" and result.error_eps <= bench.TOLERANCE_EPS
    assert result.median_s > 0 and result.gb_per_s > 0


def test_onnxruntime_run_returns_a_fresh_array_each_call():
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    peer = next(i for i in bench.implementations("cpu", 1) if i.name == ORT_RUN)
    case = bench.make_case("seed", "float32")
    prepared = peer.prepare(case, bench.CpuTarget(), 1)
    prepared.call()
    first = prepared.output()
    prepared.call()
    assert prepared.output() is not first  # onnxruntime allocated a new output


def test_onnxruntime_run_has_no_bfloat16_and_no_gpu():
    pytest.importorskip("onnxruntime")
    peer = next(i for i in bench.implementations("cpu", 1) if i.name == ORT_RUN)
    with pytest.raises(bench.Unavailable, match="bfloat16"):
        peer.prepare(bench.make_case("seed", "bfloat16"), bench.CpuTarget(), 1)
    assert ORT_RUN not in {i.name for i in bench.implementations("cuda", 1)}


def test_onnxruntime_run_row_in_the_command(monkeypatch, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    _quiet(monkeypatch)
    path = tmp_path / "bench.json"
    code = _cli.main(
        ["bench", "--quick", "--workloads", "seed", "--dtypes", "float16", "--json", str(path)]
    )
    assert code == 0
    rows = {r["implementation"]: r for r in json.loads(path.read_text())["results"]}
    assert rows[ORT_RUN]["status"] == "ok" and rows[ORT_RUN]["ratio_to_copy"] > 0
    assert ORT_RUN in capsys.readouterr().out


# ------------------------------------------------------------- vector extensions


def test_vector_extensions_agree_with_llvm_and_numpy():
    import llvmlite.binding as llvm

    try:
        from numpy._core._multiarray_umath import __cpu_features__  # NumPy 2
    except ImportError:  # NumPy 1.x (the oldest supported, 1.24)
        from numpy.core._multiarray_umath import __cpu_features__

    found = report_module.vector_extensions()
    assert found["llvm_host_cpu"] == llvm.get_host_cpu_name()
    assert found["numba_cpu"]
    assert found["summary"].startswith("vector extensions: ")
    assert set(found["llvm"]).isdisjoint(found["absent"])
    assert found["numpy_found"] == sorted(k for k, v in __cpu_features__.items() if v)
    enabled = {f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f[0] == "+"}
    assert set(found["llvm"]) <= enabled
    for name in found["llvm"]:
        assert name.upper() in found["summary"]
    if "avx512f" in enabled:
        assert "AVX512F" in found["summary"] and "AVX512F" in __cpu_features__


def test_numba_cpu_name_and_features_override_the_host(monkeypatch):
    import numba

    monkeypatch.setattr(numba.config, "CPU_NAME", "haswell")
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+avx2,+fma,+f16c,-avx512f")
    found = report_module.vector_extensions()
    assert found["numba_cpu"] == "haswell" and "numba/LLVM CPU haswell" in found["summary"]
    if found["llvm"][:1] != ["neon"]:  # x86
        assert found["llvm"] == ["avx2", "fma", "f16c"] and "avx512f" in found["absent"]


X86_64 = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 CPU names"
)


@X86_64
def test_a_cpu_named_without_features_shows_what_its_model_implies(monkeypatch):
    import numba

    monkeypatch.setattr(numba.config, "CPU_FEATURES", "")  # NUMBA_CPU_FEATURES=""
    for name, present in (
        ("haswell", ["avx2", "fma", "f16c"]),
        ("znver4", ["avx512f", "avx512bw", "avx512vl", "avx512bf16", "avx2", "fma", "f16c"]),
        ("generic", []),
    ):
        monkeypatch.setattr(numba.config, "CPU_NAME", name)
        found = report_module.vector_extensions()
        assert found["llvm"] == present, name
        assert f"numba/LLVM CPU {name}" in found["summary"]
        assert found["summary"].startswith(
            "vector extensions: none of " if not present else "vector extensions: AVX"
        )
    monkeypatch.setattr(numba.config, "CPU_NAME", "some-future-core")
    found = report_module.vector_extensions()
    assert found["llvm"] == [] and found["absent"] == []
    assert "CPU model some-future-core implies" in found["summary"]


# Each extension's tell in LLVM's own code for a CPU name: the oracle of the kernels'
# table of names (numba_rope._conversions, which the bench's header reads through
# report_module._NAMED; AVX, which the header does not show, straight from it). FMA4's ``vfmaddps`` (AMD's Bulldozers, which
# LLVM prefers there) does not tell FMA3 apart; AVX-NE-CONVERT's ``vcvtneps2bf16`` on
# ymm is not AVX512_BF16.
_PROBES = {
    "avx512f": ("<16 x float>", "fadd <16 x float> %a, %a", "<16 x float>", r"vaddps\s+%zmm"),
    "avx512bw": ("<64 x i8>", "add <64 x i8> %a, %a", "<64 x i8>", r"vpaddb\s+%zmm"),
    "avx512vl": ("<8 x float>", "fptoui <8 x float> %a to <8 x i32>", "<8 x i32>",
                 r"vcvttps2udq\s+%ymm"),
    "avx2": ("<8 x i32>", "add <8 x i32> %a, %a", "<8 x i32>", r"vpaddd\s+%ymm"),
    "fma": ("<8 x float>",
            "call <8 x float> @llvm.fma.v8f32(<8 x float> %a, <8 x float> %a, <8 x float> %a)",
            "<8 x float>", r"vfmadd\d{3}ps"),
    "f16c": ("<8 x half>", "fpext <8 x half> %a to <8 x float>", "<8 x float>", r"vcvtph2ps"),
    "avx512bf16": ("<16 x float>", "fptrunc <16 x float> %a to <16 x bfloat>", "<16 x bfloat>",
                   r"vcvtneps2bf16\s+%zmm"),
    "avx512fp16": ("<32 x half>", "fadd <32 x half> %a, %a", "<32 x half>", r"vaddph\s+%zmm"),
    "avx": ("<8 x float>", "fadd <8 x float> %a, %a", "<8 x float>", r"vaddps\s+%ymm"),
}  # fmt: skip


@X86_64
def test_the_table_of_cpu_names_agrees_with_llvms_code_for_them(capfd):
    import re

    import llvmlite.binding as llvm
    from numba.core.codegen import initialize_llvm

    if llvm.llvm_version_info < (22,):
        # LLVM 14 (numba 0.60) aborts the process ("64-bit code requested on a subtarget
        # that doesn't support it") on code for a CPU name it does not know, where LLVM
        # 22 warns and takes a generic CPU; the versions between were not tried.
        pytest.skip("the probes need LLVM 22 (numba 0.67 or later)")
    initialize_llvm()
    target = llvm.Target.from_triple(llvm.get_process_triple())
    checked = 0
    for name in sorted(conversions.F16C_CPUS | report_module._PLAIN_NAMED):
        machine = target.create_target_machine(cpu=name, features="", opt=2)
        capfd.readouterr()
        code = {}
        for feature, (argument, instruction, result, _) in _PROBES.items():
            if feature == "avx512bf16" and llvm.llvm_version_info < (17,):
                continue  # no bfloat vectors before LLVM 17
            module = llvm.parse_assembly(
                "declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)\n"
                f"define {result} @f({argument} %a) {{\n  %r = {instruction}\n"
                f"  ret {result} %r\n}}\n"
            )
            code[feature] = machine.emit_assembly(module)
        if "not a recognized processor" in capfd.readouterr().err:
            continue  # a name newer than this LLVM
        implied = report_module._implied_by_name(name)
        assert implied is not None
        for feature, text in code.items():
            if feature == "fma" and "vfmaddps" in text:
                continue  # FMA4 chosen: says nothing of FMA3
            found = re.search(_PROBES[feature][3], text) is not None
            listed = name in conversions.AVX_CPUS if feature == "avx" else feature in implied
            assert found == listed, (name, feature)
        checked += 1
    assert checked >= 40


def test_header_and_json_carry_the_vector_extensions(monkeypatch, tmp_path, capsys):
    _quiet(monkeypatch)
    path = tmp_path / "bench.json"
    arguments = ["bench", "--quick", "--workloads", "seed", "--dtypes", "float32"]
    assert _cli.main([*arguments, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    env = json.loads(path.read_text())["environment"]
    vector = env["vector_extensions"]
    assert set(vector) >= {"summary", "numba_cpu", "llvm", "absent", "numpy", "numpy_found"}
    header = out.splitlines()[:3]
    assert sum(vector["summary"] in line for line in header) == 1
    assert env["cpu_count"] >= 1 and f"{env['cpu_count']} cores" in out


# -------------------------------------------------------------------- the warnings


def _row(workload, implementation, kind, median, p95, dtype="float32"):
    return bench.Result(
        workload,
        dtype,
        "cpu",
        implementation,
        "ok",
        median_s=median,
        p95_s=p95,
        gb_per_s=1e-3 / median,
        kind=kind,
    )


def _made_up_report(
    start=0.1, end=0.1, own=0.0, copy_p95=1.2e-6, threads=2, copy_median=1e-6, one_thread=2e-6
):
    """Two cases: the seed's parallel copy (median ``copy_median``, p95 ``copy_p95``)
    and one-thread copy (median ``one_thread``, steady), a steady prefill."""
    rows = [
        _row("seed", "copy", "copy", copy_median, copy_p95),
        _row("seed", report_module.ONE_THREAD_COPY, "copy", one_thread, 1.1 * one_thread),
        _row("seed", "numba_rope", "rope", 3e-6, 3.1e-6),
        _row("prefill", "copy", "copy", 4e-3, 4.2e-3),
        _row("prefill", "numba_rope", "rope", 3e-3, 3.1e-3),
    ]
    environment = {
        "numba_rope": "x",
        "numba": "x",
        "numpy": "x",
        "numba_threads": threads,
        "numba_threading_layer": "omp",
        "cpu_count": 2,
        "load_average_1min": start,
        "load_average_1min_end": end,
        "load_average_own": own,
        "vector_extensions": {"summary": "vector extensions: AVX2 FMA F16C"},
    }
    settings = {
        "device": "cpu",
        "repeats": 3,
        "dtypes": ["float32"],
        "workloads": ["seed", "prefill"],
        "smoke": True,
    }
    return bench.Report(settings=settings, environment=environment, results=rows)


def test_a_quiet_run_warns_of_nothing():
    report = _made_up_report()
    assert report_module.assess(report) == []
    table = bench.format_table(report)
    assert "WARNING" not in table and "*" not in table
    assert all(r.noisy == "" for r in report.results)


@pytest.mark.parametrize(
    ("start", "end", "own", "threads", "warned"),
    [
        (1.4, 0.1, 0.0, 2, True),  # 2 threads on 2 cores: others' 1.4 > 1.0
        (0.6, 0.1, 0.0, 2, False),
        (0.1, 2.3, 1.9, 2, False),  # the end's load is this run's own
        (0.1, 2.3, 0.5, 2, True),
        (1.4, 1.9, 0.0, 1, False),  # 1 thread: one core is enough, limit 2.0
        (2.1, 0.1, 0.0, 1, True),
    ],
)
def test_load_average_warns_on_every_row(start, end, own, threads, warned):
    report = _made_up_report(start, end, own, threads=threads)
    warnings = report_module.assess(report)
    assert bool(warnings) == warned
    assert all(bool(r.noisy) == warned for r in report.results)
    if warned:
        assert "load average" in warnings[0] and "2 cores" in warnings[0]
        table = bench.format_table(report)
        assert table.splitlines()[-1] == warnings[0]
        rows = [line for line in table.splitlines() if line.startswith(("seed ", "prefill "))]
        assert len(rows) == 5 and all("*" in line for line in rows)


def test_a_stalled_floor_marks_its_case_only():
    limit = report_module.FLOOR_SPREAD_LIMIT
    steady = _made_up_report(copy_p95=0.99 * limit * 1e-6)
    assert report_module.assess(steady) == []
    report = _made_up_report(copy_p95=8e-3)  # an 8 ms p95 for 1 us of copy
    warnings = report_module.assess(report)
    assert len(warnings) == 1 and "seed float32 8000x" in warnings[0]
    noisy = {r.workload for r in report.results if r.noisy}
    assert noisy == {"seed"}
    table = bench.format_table(report).splitlines()
    marked = [line for line in table if "*" in line and not line.startswith("WARNING")]
    assert len(marked) == 3 and all(line.startswith("seed") for line in marked)
    assert table[-1] == warnings[0]


def test_copies_are_read_each_against_itself():
    # One thread's copy of a large input takes 2-3x two threads' on a quiet machine
    # (the float32 decode step on the Intel AVX-512 VM: its p95 3.5x the 2-thread
    # copy's median, 1.3x its own): no warning.
    limit = report_module.FLOOR_SPREAD_LIMIT
    quiet = _made_up_report(copy_median=1e-6, copy_p95=1.1e-6, one_thread=3.5e-6)
    assert report_module.assess(quiet) == []
    # The parallel copy's median stalled at most calls, its own p95 steady: a warning.
    stalled = _made_up_report(copy_median=1.1 * limit * 2e-6, copy_p95=1.2 * limit * 2e-6)
    warnings = report_module.assess(stalled)
    assert len(warnings) == 1 and f"seed float32 {1.1 * limit:.1f}x" in warnings[0]
    assert {r.workload for r in stalled.results if r.noisy} == {"seed"}
    # Just under the limit both ways: no warning.
    under = _made_up_report(copy_median=0.99 * limit * 2e-6, copy_p95=0.99 * limit * 2e-6)
    assert report_module.assess(under) == []


def test_a_loaded_run_warns_in_the_output_and_the_json(monkeypatch, tmp_path, capsys):
    _quiet(monkeypatch, 7.5)  # injected: the machine is not loaded
    path = tmp_path / "bench.json"
    arguments = ["bench", "--quick", "--workloads", "seed", "--dtypes", "float16"]
    assert _cli.main([*arguments, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "load average 7.50 at the start, 7.50 at the end" in out
    warning = next(line for line in out.splitlines() if line.startswith("WARNING"))
    assert "load average at the start 7.50" in warning
    data = json.loads(path.read_text())
    assert warning in data["warnings"]
    assert data["environment"]["load_average_1min_end"] == 7.5
    assert all(r["noisy"] for r in data["results"])
    assert {r["kind"] for r in data["results"]} == {"copy", "allocating copy", "rope"}


def test_a_run_records_its_own_share_of_the_load(monkeypatch):
    _quiet(monkeypatch)
    settings = bench.Settings.quick(workloads=["seed"], dtypes=["float32"])
    report = bench.run(settings, progress=None)
    env = report.environment
    assert env["load_average_1min"] == env["load_average_1min_end"] == 0.0
    assert 0 <= env["load_average_own"] < env["cpu_count"] + 1
    assert report.settings["smoke"] is True


# ------------------------------------------------------------------------ the plot


def _texts(figure):
    texts = [t.get_text() for t in figure.texts]
    texts += [axis.get_title() for axis in figure.axes]
    return "\n".join(texts)


def test_the_plot_carries_the_load_the_warning_and_quick():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    report = _made_up_report(start=1.4, copy_p95=8e-3)
    report_module.assess(report)
    figure = report_module.plot_figure(report)
    try:
        text = _texts(figure)
    finally:
        plt.close(figure)
    assert "--quick" in text
    assert "load average 1.40 at the start, 0.10 at the end" in text and "2 cores" in text
    assert "vector extensions: AVX2 FMA F16C" in text
    assert "WARNING: other processes' load average" in text
    assert "WARNING: the copy floor stalled" in text


def test_a_quiet_full_plot_has_no_warning(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    report = _made_up_report()
    report.settings["smoke"] = False
    report_module.assess(report)
    figure = report_module.plot_figure(report)
    try:
        text = _texts(figure)
    finally:
        plt.close(figure)
    assert "WARNING" not in text and "--quick" not in text and "load average 0.10" in text
    bench.plot(report, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
