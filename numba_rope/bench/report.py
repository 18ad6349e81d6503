"""The bench's results and how they are shown: the text table, the JSON file, the plot
(and the GPU check's markdown tables).

matplotlib is imported only to plot.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from typing import Any

import numba
import numpy as np

import numba_rope


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


@dataclass
class Report:
    settings: dict[str, Any]
    environment: dict[str, Any]
    results: list[Result] = field(default_factory=list)
    not_installed: dict[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.status == "FAILED"]

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "environment": self.environment,
            "not_installed": self.not_installed,
            "results": [asdict(r) for r in self.results],
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
        "numba_threads": threads,
        "numba_threading_layer": layer,
        # A busy machine stalls parallel regions (a worker waits for a core): keep it in view.
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


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


def format_table(report: Report) -> str:
    """The results as a text table, one row per (workload, dtype, implementation)."""
    env = report.environment
    sampled = "single calls" if report.settings.get("single_calls") else "samples"
    busy = ", a busy loop on another core" if report.settings.get("busy") else ""
    lines = [
        f"numba_rope {env['numba_rope']} on {report.settings['device']}: numba {env['numba']}, "
        f"numpy {env['numpy']}, {env['numba_threads']} threads "
        f"({env['numba_threading_layer'] or 'no parallel region run'}), "
        f"median of up to {report.settings['repeats']} {sampled}, "
        f"load average {_load(env.get('load_average_1min'))} at the start{busy}",
        "GB/s: input read + output written + distinct cache rows read, over the median; "
        "ratio: median / fastest copy (1.0 = copy speed)",
    ]
    name_width = max([len(r.implementation) for r in report.results] + [14])
    header = (
        f"{'workload':<14} {'dtype':<9} {'implementation':<{name_width}} "
        f"{'median':>10} {'p95':>10} {'GB/s':>7} {'ratio':>6}  check"
    )
    lines += [header, "-" * len(header)]
    previous = None
    for r in report.results:
        if previous is not None and (r.workload, r.dtype) != previous:
            lines.append("")
        previous = (r.workload, r.dtype)
        gbs = "-" if r.gb_per_s is None else f"{r.gb_per_s:.1f}"
        ratio = "-" if r.ratio_to_copy is None else f"{r.ratio_to_copy:.2f}"
        check = {"ok": "ok", "FAILED": "FAILED", "n/a": "n/a"}[r.status]
        if r.reason:
            check += f" ({r.reason})"
        lines.append(
            f"{r.workload:<14} {r.dtype:<9} {r.implementation:<{name_width}} "
            f"{_seconds(r.median_s):>10} {_seconds(r.p95_s):>10} {gbs:>7} {ratio:>6}  {check}"
        )
    for name, why in report.not_installed.items():
        lines.append(f"not run: {name}: {why}")
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


def plot(report: Report, path: str) -> None:
    """Bar chart of GB/s per workload and implementation, one panel per dtype."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in report.results if r.gb_per_s is not None]
    dtypes = [d for d in report.settings["dtypes"] if any(r.dtype == d for r in timed)] or ["-"]
    workloads = [w for w in report.settings["workloads"] if any(r.workload == w for r in timed)]
    names = list(dict.fromkeys(r.implementation for r in timed))
    figure, axes = plt.subplots(
        1, len(dtypes), figsize=(5 * len(dtypes) + 1, 4.5), squeeze=False, sharey=True
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
    figure.suptitle(f"numba_rope {report.environment['numba_rope']}: RoPE throughput")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
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
