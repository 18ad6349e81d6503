"""Benchmarks and test infrastructure: the workloads, the peers, verification, timing.

``python -m numba_rope bench``, the asv suite (``asv_bench/``) and the GPU check
(``tools/gpu_check.py``) read everything here, so they cannot drift apart; the tests
take their case maker, epsilon table and ONNX model from here too (their oracles stay
their own).

* :mod:`~numba_rope.bench.workloads`: the workload table, :func:`make_arrays` (the one
  case maker) and :func:`make_case` (a workload's data from a fixed seed);
* :mod:`~numba_rope.bench.checks`: the one epsilon table and the output checks;
* :mod:`~numba_rope.bench.targets`: the CPU and CUDA targets and the parallel copy;
* :mod:`~numba_rope.bench.peers`: the implementations timed, the ONNX model builder and
  the torch RoPE;
* :mod:`~numba_rope.bench.timing`: host timing, the copy floor, the busy core, settling;
* :mod:`~numba_rope.bench.runner`: :func:`run`, the bench itself;
* :mod:`~numba_rope.bench.report`: the table, the JSON and the plot, the machine's vector
  extensions and the warnings of a loaded run;
* :mod:`~numba_rope.bench.gpu` and :mod:`~numba_rope.bench.gpu_check`: array adapters,
  GPU timing and the GPU check.

Nothing here imports ``numba.cuda``, CuPy or torch unless it is asked for: the CUDA
target on ``device="cuda"``, torch when its peer is prepared, all three in the GPU check
when it runs. ``import numba_rope`` does not import this package.
"""

from numba_rope.bench.checks import EPSILON, TOLERANCE_EPS, check_output, compare, epsilon
from numba_rope.bench.peers import (
    Implementation,
    Prepared,
    implementations,
    on_line_boundary,
    onnx_rotary_model,
    spec_formula_numpy,
    torch_rope,
)
from numba_rope.bench.report import (
    Report,
    Result,
    assess,
    environment,
    format_table,
    markdown_table,
    plot,
    plot_figure,
    require_matplotlib,
    unsupported_plot_format,
    vector_extensions,
    write_json,
)
from numba_rope.bench.runner import Settings, measure, run
from numba_rope.bench.targets import CpuTarget, CudaTarget, Unavailable, parallel_copy, target
from numba_rope.bench.timing import (
    BATCH_SECONDS,
    REPEATS,
    SETTLE_SECONDS,
    SINGLE_CALL_REPEATS,
    Timing,
    bandwidth_fraction,
    busy_loop,
    copy_floor,
    settle,
    time_calls,
)
from numba_rope.bench.workloads import (
    DEVICES,
    DTYPES,
    ROPE_BASE,
    SEED,
    SEED_POSITION_IDS,
    WORKLOADS,
    Case,
    Workload,
    as_dtype,
    make_arrays,
    make_case,
    rope_caches,
    workload_table,
)

__all__ = [
    "BATCH_SECONDS",
    "DEVICES",
    "DTYPES",
    "EPSILON",
    "REPEATS",
    "ROPE_BASE",
    "SEED",
    "SEED_POSITION_IDS",
    "SETTLE_SECONDS",
    "SINGLE_CALL_REPEATS",
    "TOLERANCE_EPS",
    "WORKLOADS",
    "Case",
    "CpuTarget",
    "CudaTarget",
    "Implementation",
    "Prepared",
    "Report",
    "Result",
    "Settings",
    "Timing",
    "Unavailable",
    "Workload",
    "as_dtype",
    "assess",
    "bandwidth_fraction",
    "busy_loop",
    "check_output",
    "compare",
    "copy_floor",
    "environment",
    "epsilon",
    "format_table",
    "implementations",
    "make_arrays",
    "make_case",
    "markdown_table",
    "measure",
    "on_line_boundary",
    "onnx_rotary_model",
    "parallel_copy",
    "plot",
    "plot_figure",
    "require_matplotlib",
    "rope_caches",
    "run",
    "settle",
    "spec_formula_numpy",
    "target",
    "time_calls",
    "torch_rope",
    "unsupported_plot_format",
    "vector_extensions",
    "workload_table",
    "write_json",
]
