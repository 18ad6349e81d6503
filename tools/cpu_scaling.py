"""How calls of a decode step's size scale with the machine's cores: numba_rope's two
threads (the caller and its helper), against numba's parallel region and onnxruntime on
as many threads as asked.

numba_rope sends calls from ``config.HELPER_MIN_ELEMENTS`` up to
``config.PARALLEL_MIN_ELEMENTS`` (a decode step (64, 32, 1, 128) among them) to the
calling thread and one helper thread, whatever the number of cores; larger ones to
numba's parallel region on all of numba's threads. onnxruntime spreads every call over
its intra-op threads. Every figure in docs/performance.md comes from 2-core machines,
where the helper is the faster of the two (the parallel region paid 1.1-1.4 us more a
decode step on the Zen 4 VM); this script is for a machine with more cores (the machine
lent for GPU checks has 16), to see from how many threads the parallel region pays for
calls of this size, and how far onnxruntime pulls ahead with its threads.

For each workload, dtype and thread count (``numba.set_num_threads``; at most
``NUMBA_NUM_THREADS``) it prints the median and 95th percentile per call of the rows
below, and at the end, for each workload and dtype, the fewest threads at which the
parallel region and onnxruntime were first faster than the helper (:func:`verdicts`):

* ``helper``: ``rotary_embedding(..., out=)`` as the library sends it (two threads);
* ``parallel``: the same with ``PARALLEL_MIN_ELEMENTS`` = 0 (numba's parallel region);
* ``alone``: on the calling thread only (the helper and the region off);
* ``onnxruntime``: its ``RotaryEmbedding`` with that many intra-op threads (float32 and
  float16, where onnxruntime and onnx are installed).

Each figure is followed by a pause, so that spinning workers (onnxruntime's, numba's
after a parallel region) do not take the next figure's cores.

    python tools/cpu_scaling.py
    python tools/cpu_scaling.py --workloads decode,seed --threads 2,4,8,16 --repeats 400
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numba

from numba_rope import bench, config, rotary_embedding
from numba_rope._aligned import empty_on_line
from numba_rope.bench.peers import Unavailable, prepare
from numba_rope.bench.targets import target
from numba_rope.bench.timing import time_calls

#: Seconds of pause after each figure: onnxruntime's workers, and numba's after a
#: parallel region, spin for a while after a run.
PAUSE = 0.05


def numba_rope_call(case: bench.Case) -> Callable[[], object]:
    """The ``out=`` call of a case (an output on a 64-byte line, as the bench's)."""
    out = empty_on_line(case.input.shape, case.input.dtype)
    x, cos, sin, ids = case.input, case.cos_cache, case.sin_cache, case.position_ids
    return lambda: rotary_embedding(x, cos, sin, ids, out=out, **case.options)


def timed(call: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median and 95th percentile of one call, in microseconds."""
    timing = time_calls(call, repeats, warmup=50)
    return timing.median * 1e6, timing.p95 * 1e6


def modes() -> list[tuple[str, dict[str, int]]]:
    """numba_rope's rows: a name, and the ``config`` constants it runs with."""
    never = 1 << 62
    return [
        ("helper", {}),
        ("parallel", {"PARALLEL_MIN_ELEMENTS": 0}),
        ("alone", {"PARALLEL_MIN_ELEMENTS": never, "HELPER_MIN_ELEMENTS": never}),
    ]


def measure(
    workloads: list[str], dtypes: list[str], thread_counts: list[int], repeats: int, rounds: int
) -> list[tuple[str, str, int, str, float, float]]:
    """Rows of (workload, dtype, threads, mode, median us, p95 us), printed as they come:
    for each thread count, ``rounds`` rounds of every mode in turn, and the median of
    the rounds' figures (this machine's drift from one second to the next touches every
    mode alike)."""
    rows = []
    names = ("PARALLEL_MIN_ELEMENTS", "HELPER_MIN_ELEMENTS")
    saved = {name: getattr(config, name) for name in names}
    before = numba.get_num_threads()
    try:
        for workload in workloads:
            for dtype in dtypes:
                case = bench.make_case(workload, dtype)
                for threads in thread_counts:
                    numba.set_num_threads(threads)
                    figures: dict[str, list[tuple[float, float]]] = {}
                    for _ in range(rounds):
                        for mode, constants in modes():
                            for name, value in saved.items():
                                setattr(config, name, constants.get(name, value))
                            figures.setdefault(mode, []).append(
                                timed(numba_rope_call(case), repeats)
                            )
                            time.sleep(PAUSE)  # numba's workers, spinning after a region
                        for name, value in saved.items():
                            setattr(config, name, value)
                        try:
                            prepared = prepare("onnxruntime", case, target("cpu"), threads)
                        except Unavailable:
                            continue
                        figures.setdefault("onnxruntime", []).append(timed(prepared.call, repeats))
                        del prepared
                        time.sleep(PAUSE)
                    for mode, samples in figures.items():
                        median = statistics.median(m for m, _ in samples)
                        p95 = statistics.median(p for _, p in samples)
                        rows.append((workload, dtype, threads, mode, median, p95))
                        print(_line(rows[-1]), flush=True)
    finally:
        for name, value in saved.items():
            setattr(config, name, value)
        numba.set_num_threads(before)
    return rows


def verdicts(rows: list[tuple[str, str, int, str, float, float]]) -> list[str]:
    """One line per (workload, dtype) of ``rows``: the fewest threads at which numba's
    parallel region, and onnxruntime, were first faster than the helper (medians), or
    that they never were at the counts tried.

    >>> rows = [("decode", "float32", 2, "helper", 20.0, 25.0),
    ...         ("decode", "float32", 2, "parallel", 21.0, 26.0),
    ...         ("decode", "float32", 4, "helper", 19.0, 24.0),
    ...         ("decode", "float32", 4, "parallel", 12.5, 15.0)]
    >>> verdicts(rows)
    ['decode float32: the parallel region first faster than the helper at 4 threads (12.5 against 19.0 us)']
    """
    medians: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for workload, dtype, threads, mode, median, _ in rows:
        medians.setdefault((workload, dtype), {}).setdefault(threads, {})[mode] = median
    lines = []
    for (workload, dtype), by_threads in medians.items():
        parts = []
        for rival, name in (("parallel", "the parallel region"), ("onnxruntime", "onnxruntime")):
            counts = [t for t in sorted(by_threads) if {rival, "helper"} <= set(by_threads[t])]
            if not counts:
                continue
            faster = [t for t in counts if by_threads[t][rival] < by_threads[t]["helper"]]
            if faster:
                first = by_threads[faster[0]]
                parts.append(
                    f"{name} first faster than the helper at {faster[0]} threads "
                    f"({first[rival]:.1f} against {first['helper']:.1f} us)"
                )
            else:
                parts.append(f"{name} slower than the helper at every count tried")
        if parts:
            lines.append(f"{workload} {dtype}: " + "; ".join(parts))
    return lines


def _line(row: tuple[str, str, int, str, float, float]) -> str:
    workload, dtype, threads, mode, median, p95 = row
    return f"{workload:10s} {dtype:9s} {threads:7d}  {mode:12s} {median:9.2f} {p95:9.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--workloads", default="decode")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument(
        "--threads",
        default=None,
        help="thread counts, comma-separated (default: 2, 4, 8, ... up to numba's)",
    )
    parser.add_argument("--repeats", type=int, default=300, help="calls timed per figure")
    parser.add_argument("--rounds", type=int, default=3, help="figures per mode (median)")
    args = parser.parse_args(argv)
    most = int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    if args.threads is None:
        counts = [n for n in (2, 4, 8, 16, 32, 64) if n < most] + [most]
    else:
        counts = [int(n) for n in args.threads.split(",")]
    if any(n < 1 or n > most for n in counts):
        parser.error(f"thread counts must lie in [1, {most}] (NUMBA_NUM_THREADS), got {counts}")
    print(f"{os.cpu_count()} CPUs, numba {numba.__version__} ({most} threads at most)")
    print(
        f"{'workload':10s} {'dtype':9s} {'threads':>7s}  {'mode':12s} {'median us':>9s} {'p95 us':>9s}"
    )
    rows = measure(
        args.workloads.split(","),
        args.dtypes.split(","),
        sorted(set(counts)),
        args.repeats,
        args.rounds,
    )
    print()
    for line in verdicts(rows):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
