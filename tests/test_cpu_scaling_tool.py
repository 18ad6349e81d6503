"""``tools/cpu_scaling.py``, the script for machines with more cores than the 2-core
VMs every figure of docs/performance.md comes from: it runs, prints a row per mode,
and leaves numba's thread count and the constants it changes as it found them."""

from __future__ import annotations

import numba
import pytest

from numba_rope import config


@pytest.fixture(scope="module")
def scaling(load_tool):
    return load_tool("cpu_scaling")


def test_one_row_per_mode_and_everything_restored(scaling, capsys, monkeypatch):
    monkeypatch.setattr(scaling, "PAUSE", 0.0)
    threads = numba.get_num_threads()
    constants = (config.PARALLEL_MIN_ELEMENTS, config.HELPER_MIN_ELEMENTS)
    assert scaling.main(["--workloads", "seed", "--dtypes", "float32", "--threads", "1",
                         "--repeats", "3", "--rounds", "2"]) == 0  # fmt: skip
    table, verdict = capsys.readouterr().out.split("\n\n")
    lines = table.splitlines()
    modes = [line.split()[3] for line in lines[2:]]
    assert modes[:3] == ["helper", "parallel", "alone"]
    assert set(modes[3:]) <= {"onnxruntime"}
    (said,) = verdict.splitlines()  # one workload and dtype: one verdict
    assert said.startswith("seed float32: the parallel region ")
    for line in lines[2:]:
        workload, dtype, count, _, median, p95 = line.split()
        assert (workload, dtype, count) == ("seed", "float32", "1")
        assert 0 < float(median) <= float(p95)  # medians of medians and of p95s
    assert numba.get_num_threads() == threads
    assert (config.PARALLEL_MIN_ELEMENTS, config.HELPER_MIN_ELEMENTS) == constants


def test_thread_counts_beyond_numbas_are_refused(scaling, capsys):
    with pytest.raises(SystemExit):
        scaling.main(["--threads", str(numba.config.NUMBA_NUM_THREADS + 1)])
    assert "thread counts must lie in [1," in capsys.readouterr().err


def test_verdicts_name_the_first_thread_count_where_a_rival_is_faster(scaling):
    rows = [
        ("decode", "float16", 2, "helper", 14.0, 20.0),
        ("decode", "float16", 2, "parallel", 16.0, 20.0),
        ("decode", "float16", 2, "onnxruntime", 40.0, 50.0),
        ("decode", "float16", 8, "helper", 13.0, 20.0),
        ("decode", "float16", 8, "parallel", 5.5, 9.0),
        ("decode", "float16", 8, "onnxruntime", 9.0, 12.0),
        ("decode", "float16", 16, "helper", 13.5, 20.0),
        ("decode", "float16", 16, "parallel", 14.0, 19.0),  # slower again: 8 stays first
        ("seed", "float32", 2, "helper", 4.0, 5.0),
        ("seed", "float32", 2, "parallel", 4.5, 6.0),
        ("seed", "float32", 2, "alone", 5.0, 6.0),
    ]
    assert scaling.verdicts(rows) == [
        "decode float16: the parallel region first faster than the helper at 8 threads "
        "(5.5 against 13.0 us); onnxruntime first faster than the helper at 8 threads "
        "(9.0 against 13.0 us)",
        "seed float32: the parallel region slower than the helper at every count tried",
    ]
