"""The bench's results and how they are shown: the text table, the JSON file, the plot
(and the GPU check's markdown tables).

matplotlib is imported only to plot.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import platform
import textwrap
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numba
import numpy as np

import numba_rope
from numba_rope import _conversions as conversions
from numba_rope.bench.timing import REPEATS, SINGLE_CALL_REPEATS
from numba_rope.bench.workloads import WORKLOADS


@dataclass
class Result:
    workload: str
    dtype: str
    device: str
    implementation: str
    status: str  # "ok", "FAILED" or "n/a"
    reason: str = ""
    median_s: float | None = None
    p95_s: float | None = None
    samples: int = 0
    calls_per_sample: int = 0
    bytes: int = 0
    gb_per_s: float | None = None
    ratio_to_copy: float | None = None
    error_eps: float | None = None
    kind: str = "rope"  # "copy": a floor row; "allocating copy": x.copy(); "rope": RoPE
    noisy: str = ""  # why this row's times and ratio are not to be trusted ("": nothing seen)
    sample_s: list[float] = field(default_factory=list)  # seconds per call of each sample
    # A slow numba_rope row, timed again apart (see numba_rope.bench.runner.probe_slow_row)
    probe: dict[str, Any] | None = None


@dataclass
class Report:
    settings: dict[str, Any]
    environment: dict[str, Any]
    results: list[Result] = field(default_factory=list)
    not_installed: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.status == "FAILED"]

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "environment": self.environment,
            "not_installed": self.not_installed,
            "warnings": self.warnings,
            "results": [asdict(r) for r in self.results],
        }


def load_average() -> float | None:
    """The 1-minute load average, or None where the system has none (Windows)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (the busy loop) so far."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows: this process only
        return time.process_time()
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


#: Vector extensions shown, in LLVM's spelling (what numba compiles for), and NumPy's
#: names of the same in ``__cpu_features__``: the ones RoPE's kernels can use.
VECTOR_EXTENSIONS = {
    "avx512f": "AVX512F",
    "avx512bw": "AVX512BW",
    "avx512vl": "AVX512VL",
    "avx512bf16": "AVX512BF16",
    "avx512fp16": "AVX512FP16",
    "avx2": "AVX2",
    "fma": "FMA3",
    "f16c": "F16C",
    "neon": "ASIMD",
    "fullfp16": "ASIMDHP",
    "bf16": "",
    "sve": "SVE",
    "sve2": "",
}
_X86 = ("avx512f", "avx512bw", "avx512vl", "avx512bf16", "avx512fp16", "avx2", "fma", "f16c")
_ARM = ("neon", "fullfp16", "bf16", "sve", "sve2")

# A CPU named without features (``NUMBA_CPU_NAME`` with ``NUMBA_CPU_FEATURES=""``, as
# the tests compile other CPUs' code) gets the features LLVM's CPU model of that name
# implies, which no feature string shows: the kernels' own table of x86-64 names
# (``numba_rope._conversions``), by each of ``_X86``'s extensions. A name in none of them
# (Xeon Phi's, 32-bit CPUs', one added to LLVM later) is shown as unknown, not as
# having none.

#: The x86-64 names of CPUs with none of them (SSE-only and first-AVX CPUs).
_PLAIN_NAMED = frozenset(
    {
        "generic", "x86-64", "x86-64-v2", "nocona", "core2", "penryn",
        "nehalem", "corei7", "westmere", "sandybridge", "corei7-avx", "bonnell", "atom",
        "silvermont", "slm", "goldmont", "goldmont-plus", "tremont", "k8", "opteron",
        "athlon64", "amdfam10", "barcelona", "btver1", "bdver1",
    }
)  # fmt: skip
_NAMED = {
    "avx512f": conversions.AVX512_CPUS,
    "avx512bw": conversions.AVX512_CPUS,
    "avx512vl": conversions.AVX512_CPUS,
    "avx512bf16": conversions.BF16_CPUS,
    "avx512fp16": conversions.FP16_CPUS,
    "avx2": conversions.AVX2_CPUS,
    "fma": conversions.FMA_CPUS,
    "f16c": conversions.F16C_CPUS,
}


def _implied_by_name(cpu: str) -> set[str] | None:
    """The extensions of ``_X86`` that LLVM's x86 CPU ``cpu`` has, or None for a name
    not listed here."""
    name = cpu.lower()
    if name not in conversions.F16C_CPUS and name not in _PLAIN_NAMED:
        return None
    return {feature for feature, names in _NAMED.items() if name in names}


def vector_extensions() -> dict[str, Any]:
    """The SIMD extensions numba (LLVM) compiles for and NumPy dispatches to, here.

    ``llvm`` and ``numpy`` list the present ones of :data:`VECTOR_EXTENSIONS` for this
    architecture (LLVM's names); ``absent`` the missing ones; ``numba_cpu`` is the CPU
    numba targets (``NUMBA_CPU_NAME`` if set, else LLVM's host CPU); ``numpy_found`` all
    of NumPy's runtime-detected features; ``summary`` the header's line.
    """
    import llvmlite.binding as llvm

    host = llvm.get_host_cpu_name()
    # numba compiles for NUMBA_CPU_NAME / NUMBA_CPU_FEATURES when set, else for the host.
    configured = getattr(numba.config, "CPU_FEATURES", None)
    named = getattr(numba.config, "CPU_NAME", None)
    implied: set[str] | None = set()
    if configured is not None:
        features_text = configured
        if not configured and named:  # a CPU named alone: its model's features
            implied = _implied_by_name(named)
    else:
        try:
            features_text = llvm.get_host_cpu_features().flatten()
        except RuntimeError:  # pragma: no cover - LLVM cannot read them on this host
            features_text = ""
    enabled = {f[1:] for f in features_text.split(",") if f.startswith("+")} | (implied or set())
    try:  # NumPy's runtime dispatch table (np.show_runtime()'s "found")
        umath = importlib.import_module("numpy._core._multiarray_umath")
    except ImportError:  # pragma: no cover - NumPy 1.x
        umath = importlib.import_module("numpy.core._multiarray_umath")
    numpy_features = getattr(umath, "__cpu_features__", {})
    found = sorted(name for name, present in numpy_features.items() if present)
    arm = platform.machine().lower() in ("arm64", "aarch64") or "neon" in enabled
    watched = _ARM if arm else _X86
    llvm_present = [name for name in watched if name in enabled]
    numpy_present = [n for n in watched if VECTOR_EXTENSIONS[n] and VECTOR_EXTENSIONS[n] in found]
    absent = [name for name in watched if name not in enabled]
    cpu = named or host
    if implied is None:
        llvm_present, absent = [], []
        shown = f"those LLVM's CPU model {cpu} implies (a name the bench does not list)"
    else:
        shown = " ".join(name.upper() for name in llvm_present) or "none of " + ", ".join(watched)
    summary = f"vector extensions: {shown}"
    if absent and llvm_present:
        summary += f" (no {' '.join(name.upper() for name in absent)})"
    summary += f"; numba/LLVM CPU {cpu}"
    comparable = [n for n in watched if VECTOR_EXTENSIONS[n]]
    if [n for n in llvm_present if n in comparable] == numpy_present:
        summary += ", NumPy finds the same"
    else:
        summary += f", NumPy finds {' '.join(n.upper() for n in numpy_present) or 'none'}"
    return {
        "summary": summary,
        "numba_cpu": cpu,
        "llvm_host_cpu": host,
        "llvm": llvm_present,
        "absent": absent,
        "numpy": numpy_present,
        "numpy_found": found,
    }


def environment(threads: int) -> dict[str, Any]:
    """Versions and machine facts printed above the table and stored in the JSON."""
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel region has run yet
        layer = None
    return {
        "numba_rope": numba_rope.__version__,
        "numba": numba.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "vector_extensions": vector_extensions(),
        "numba_threads": threads,
        "numba_threading_layer": layer,
        # A busy machine stalls parallel regions (a worker waits for a core): keep it in view.
        "load_average_1min": load_average(),
        "load_average_1min_end": None,  # finish() fills these in
        "load_average_own": None,
    }


# ------------------------------------------------------------------- noise warnings

#: Warn when other processes' 1-minute load average exceeds ``cores - threads +
#: LOAD_MARGIN``, i.e. when they hold on average a whole core that a parallel region of
#: ``threads`` threads needs: a worker then waits a scheduler tick. Measured on the 2-core
#: development VM with 2 threads: at 0.45-0.64 the copies' p95 stayed within 1.9x of
#: the floor; at 1.40 (others' sessions) the 2-thread copy of the 0.3 MB seed took
#: 8.00 ms for 3-4 us of work (the issue's ``cores - 0.5`` = 1.5 would not have warned).
LOAD_MARGIN = 1.0

#: Warn on a (workload, dtype) whose copies stalled: a copy's p95 over this many times
#: its own median (stalls now and then), or the parallel copy's median over this many
#: times the one-thread copy's (a stall at most calls: a copy on more threads is never
#: that much slower unless its workers wait for a core). Each copy against itself, not
#: against the fastest copy: one thread's copy of a large input takes 2-3x two
#: threads' on a quiet machine (on the Intel AVX-512 VM, 2026-12-04, the float32 decode
#: step's `np.copyto` p95 read 3.5x the 2-thread copy's median, 1.3x its own).
#: Measured there, quiet and with ``--busy``: own p95 / median 1.03-1.67, parallel /
#: one-thread median 0.35-1.96; a stalled 2-thread copy on the first AVX2 VM (load
#: 1.40) took 8.00 ms for 3-4 us of work.
FLOOR_SPREAD_LIMIT = 3.0

#: The copy on the calling thread alone, against which the parallel copy's median is
#: read (see :data:`FLOOR_SPREAD_LIMIT`).
ONE_THREAD_COPY = "np.copyto (1 thread)"


def _factor(value: float) -> str:
    """A ratio as a short factor.

    >>> _factor(8000.4), _factor(3.42)
    ('8000x', '3.4x')
    """
    return f"{value:.0f}x" if value >= 10 else f"{value:.1f}x"


def finish(report: Report, started: float, cpu_at_start: float) -> None:
    """After a run: the load at its end and this run's share of it, then :func:`assess`.

    ``started`` is ``time.perf_counter()`` and ``cpu_at_start`` :func:`cpu_seconds` at
    the run's start. The 1-minute load average weighs the last minute: a run that kept
    ``c`` cores busy for ``t`` seconds adds about ``c * (1 - exp(-t / 60))`` to it.
    """
    wall = max(time.perf_counter() - started, 1e-9)
    busy_cores = (cpu_seconds() - cpu_at_start) / wall
    env = report.environment
    env["load_average_1min_end"] = load_average()
    env["load_average_own"] = round(busy_cores * (1 - math.exp(-wall / 60)), 2)
    assess(report)


def assess(report: Report, cores: int | None = None) -> list[str]:
    """Mark the rows whose times are not to be trusted and say why in ``report.warnings``.

    The whole run when other processes' load average (at the start, or at the end less
    this run's share) exceeds ``cores - threads + LOAD_MARGIN``; a (workload, dtype)
    when its copies stalled (:data:`FLOOR_SPREAD_LIMIT`).
    """
    env = report.environment
    cores = cores or env.get("cpu_count") or os.cpu_count() or 1
    threads = env.get("numba_threads") or 1
    limit = max(LOAD_MARGIN, cores - threads + LOAD_MARGIN)
    warnings: list[str] = []
    start, end = env.get("load_average_1min"), env.get("load_average_1min_end")
    others_end = None if end is None else end - (env.get("load_average_own") or 0.0)
    loaded = [
        f"{what} {value:.2f}"
        for what, value in (("at the start", start), ("at the end, less this run's", others_end))
        if value is not None and value > limit
    ]
    if loaded:
        why = f"load average {' and '.join(loaded)} > {limit:g}"
        warnings.append(
            f"WARNING: other processes' {why} ({cores} cores, {threads} threads): parallel "
            "regions wait for a core, every time and ratio here may be inflated; "
            "benchmark on a quiet machine"
        )
        for r in report.results:
            r.noisy = why
    cases: dict[tuple[str, str, str], list[Result]] = {}
    for r in report.results:
        cases.setdefault((r.workload, r.dtype, r.device), []).append(r)
    spread_cases = []
    for (workload, dtype, _), rows in cases.items():
        # (median, p95, name) of each timed copy
        copies = [
            (r.median_s, r.p95_s, r.implementation)
            for r in rows
            if r.kind == "copy" and r.median_s and r.p95_s is not None
        ]
        if not copies:
            continue
        spread = max(p95 / median for median, p95, _ in copies)
        one_thread = [median for median, _, name in copies if name == ONE_THREAD_COPY]
        if one_thread:
            spread = max(spread, max(median for median, _, _ in copies) / one_thread[0])
        if spread > FLOOR_SPREAD_LIMIT:
            spread_cases.append(f"{workload} {dtype} {_factor(spread)}")
            for r in rows:
                note = f"a copy stalled ({_factor(spread)})"
                r.noisy = f"{r.noisy}; {note}" if r.noisy else note
    if spread_cases:
        warnings.append(
            f"WARNING: the copy floor stalled (a copy's p95 > {FLOOR_SPREAD_LIMIT:g}x its "
            f"median, or the parallel copy's median > {FLOOR_SPREAD_LIMIT:g}x one thread's) "
            f"on {', '.join(spread_cases)}: the ratios of those rows (marked *) mean little"
        )
    warnings += [probe_note(r) for r in report.results if r.probe]
    report.warnings = warnings
    return warnings


def probe_note(result: Result) -> str:
    """The line that reports a probed slow row (see
    :func:`numba_rope.bench.runner.probe_slow_row`): its time again, without streaming
    stores, on one thread, and a plain copy into its output, next to the floor it was
    slow against.

    >>> r = Result("prefill_3d", "bfloat16", "cpu", "numba_rope", "ok", median_s=0.0186)
    >>> r.probe = {"floor_s": 0.003, "again_s": 0.0185, "unstreamed_s": 0.0033,
    ...            "one_thread_s": 0.0052, "copy_into_output_s": 0.0031,
    ...            "minor_faults_per_call": 0.0}
    >>> print(probe_note(r))
    NOTE: prefill_3d bfloat16 numba_rope took 6.2x the copy floor (3.00 ms); timed again after its samples: 18.50 ms; without streaming stores 3.30 ms; on one thread 5.20 ms; a copy of the input into its output 3.10 ms; 0 page faults a call
    """
    probe = result.probe or {}
    floor = probe.get("floor_s")
    parts = [f"timed again after its samples: {_seconds(probe.get('again_s'))}"]
    parts.append(f"without streaming stores {_seconds(probe.get('unstreamed_s'))}")
    if probe.get("one_thread_s") is not None:
        parts.append(f"on one thread {_seconds(probe['one_thread_s'])}")
    if probe.get("copy_into_output_s") is not None:
        parts.append(f"a copy of the input into its output {_seconds(probe['copy_into_output_s'])}")
    if probe.get("minor_faults_per_call") is not None:
        parts.append(f"{probe['minor_faults_per_call']:.0f} page faults a call")
    slow = _factor(result.median_s / floor) if result.median_s and floor else "?"
    return (
        f"NOTE: {result.workload} {result.dtype} {result.implementation} took {slow} the "
        f"copy floor ({_seconds(floor)}); " + "; ".join(parts)
    )


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.1f} us"
    if value < 1:
        return f"{value * 1e3:.2f} ms"
    return f"{value:.3f} s"


def _load(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"


def load_line(report: Report) -> str:
    """The load average at the start and the end of the run (this run's share at the end)."""
    env = report.environment
    text = f"load average {_load(env.get('load_average_1min'))} at the start"
    if env.get("load_average_1min_end") is not None:
        text += f", {_load(env['load_average_1min_end'])} at the end"
        if env.get("load_average_own") is not None:
            text += f" (about {env['load_average_own']:.2f} of it this run's)"
    return text


def format_table(report: Report) -> str:
    """The results as a text table, one row per (workload, dtype, implementation); rows
    whose times are doubtful carry a ``*`` after the ratio, and the warnings close it."""
    env = report.environment
    single = bool(report.settings.get("single_calls"))
    repeats = report.settings.get("repeats") or 0
    if repeats > 0:
        sampled = f"{repeats} {'single calls' if single else 'samples'}"
    elif single:
        small = ", ".join(name for name, workload in WORKLOADS.items() if workload.batched)
        sampled = f"{SINGLE_CALL_REPEATS} single calls ({small}; {REPEATS} on the others)"
    else:
        sampled = f"{REPEATS} samples"
    busy = ", a busy loop on another core" if report.settings.get("busy") else ""
    settled = report.settings.get("settle_seconds") or 0
    apart = f", each after {settled * 1e3:.0f} ms of settling" if settled else ""
    rounds = report.settings.get("rounds") or 1
    if rounds > 1:
        sampled += f" in {rounds} rounds"
    vector = env.get("vector_extensions") or {}
    lines = [
        f"numba_rope {env['numba_rope']} on {report.settings['device']}: numba {env['numba']}, "
        f"numpy {env['numpy']}, {env['numba_threads']} threads "
        f"({env['numba_threading_layer'] or 'no parallel region run'}), "
        f"median of up to {sampled}{apart}, "
        f"{load_line(report)}{busy}",
        f"{env.get('processor') or env.get('machine')}, {env.get('cpu_count')} cores, "
        f"{vector.get('summary', 'vector extensions: unknown')}",
        "GB/s: input read + output written + distinct cache rows read, over the median; "
        "ratio: median / fastest copy (1.0 = copy speed); preallocated outputs (out=, "
        "onnxruntime's I/O binding, copies, in place) start on 64-byte lines",
    ]
    name_width = max([len(r.implementation) for r in report.results] + [14])
    header = (
        f"{'workload':<14} {'dtype':<9} {'implementation':<{name_width}} "
        f"{'median':>10} {'p95':>10} {'GB/s':>7} {'ratio':>6}   check"
    )
    lines += [header, "-" * len(header)]
    previous = None
    for r in report.results:
        if previous is not None and (r.workload, r.dtype) != previous:
            lines.append("")
        previous = (r.workload, r.dtype)
        gbs = "-" if r.gb_per_s is None else f"{r.gb_per_s:.1f}"
        ratio = "-" if r.ratio_to_copy is None else f"{r.ratio_to_copy:.2f}"
        mark = "*" if r.noisy else " "
        check = {"ok": "ok", "FAILED": "FAILED", "n/a": "n/a"}[r.status]
        if r.reason:
            check += f" ({r.reason})"
        lines.append(
            f"{r.workload:<14} {r.dtype:<9} {r.implementation:<{name_width}} "
            f"{_seconds(r.median_s):>10} {_seconds(r.p95_s):>10} {gbs:>7} {ratio:>6}{mark}  {check}"
        )
    for name, why in report.not_installed.items():
        lines.append(f"not run: {name}: {why}")
    lines += report.warnings
    return "\n".join(lines)


def write_json(report: Report, path: str) -> None:
    with open(path, "w") as stream:
        json.dump(report.to_json(), stream, indent=2, allow_nan=False, default=_json_default)
        stream.write("\n")


def _json_default(value: Any) -> Any:  # pragma: no cover - every field is a plain type
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def require_matplotlib() -> None:
    """Raise ``ImportError`` with the fix when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'numba_rope[bench]')"
        ) from None


def unsupported_plot_format(path: str) -> str | None:
    """Why matplotlib cannot draw into ``path`` (a suffix it has no format for), or
    None; matplotlib must be installed (:func:`require_matplotlib`)."""
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = os.path.splitext(path)[1][1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        return (
            f"--plot {path!r}: matplotlib draws no {suffix!r} files; name a file ending in "
            f"one of {', '.join('.' + name for name in sorted(formats))}"
        )
    return None


def plot_figure(report: Report) -> Any:
    """The bar chart of GB/s per workload and implementation, one panel per dtype, as a
    matplotlib figure (closed by the caller): the title says ``--quick`` when it was
    used, the footer the load average and the warnings."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in report.results if r.gb_per_s is not None]
    dtypes = [d for d in report.settings["dtypes"] if any(r.dtype == d for r in timed)] or ["-"]
    workloads = [w for w in report.settings["workloads"] if any(r.workload == w for r in timed)]
    names = list(dict.fromkeys(r.implementation for r in timed))
    footer = [load_line(report) + f" on {report.environment.get('cpu_count')} cores"]
    footer.append(report.environment.get("vector_extensions", {}).get("summary", ""))
    footer += report.warnings
    footer = [wrapped for line in footer if line for wrapped in textwrap.wrap(line, 150)]
    figure, axes = plt.subplots(
        1,
        len(dtypes),
        figsize=(5 * len(dtypes) + 1, 4.5 + 0.3 * len(footer)),
        squeeze=False,
        sharey=True,
    )
    width = 0.8 / max(1, len(names))
    for axis, dtype in zip(axes[0], dtypes, strict=True):
        for k, name in enumerate(names):
            values = [
                next(
                    (
                        r.gb_per_s
                        for r in timed
                        if r.dtype == dtype and r.workload == w and r.implementation == name
                    ),
                    0.0,
                )
                for w in workloads
            ]
            positions = [i + (k - (len(names) - 1) / 2) * width for i in range(len(workloads))]
            axis.bar(positions, values, width, label=name)
        axis.set_xticks(range(len(workloads)), workloads, rotation=20)
        axis.set_title(f"{dtype} on {report.settings['device']}")
        axis.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("GB/s (input + output + cache rows)")
    axes[0][-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    title = f"numba_rope {report.environment['numba_rope']}: RoPE throughput"
    if report.settings.get("smoke"):
        title += " (--quick: a smoke test, the numbers mean little)"
    figure.suptitle(title)
    warned = bool(report.warnings)
    figure.text(
        0.01,
        0.01,
        "\n".join(footer),
        fontsize="small",
        color="firebrick" if warned else "dimgray",
        va="bottom",
        ha="left",
    )
    figure.tight_layout(rect=(0, min(0.5, 0.035 * len(footer)), 1, 1))
    return figure


def plot(report: Report, path: str) -> None:
    """Draw :func:`plot_figure` into ``path`` (a PNG, or what its suffix names)."""
    figure = plot_figure(report)
    import matplotlib.pyplot as plt

    try:
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table (the GPU check's output).

    >>> print(markdown_table(["a", "b"], [["1", "2"]]))
    | a | b |
    |---|---|
    | 1 | 2 |
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
