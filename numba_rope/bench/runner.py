"""The bench itself: verify, then time, every implementation on every (workload, dtype).

What is measured, and how:

* Every implementation's output is checked against :func:`numba_rope.reference.rotary_embedding`
  (float64, rounded once) before it is timed; one that disagrees is reported as
  ``FAILED`` and not timed. The copies are checked to reproduce the input bit for bit.
* Times are medians (and 95th percentiles) of ``perf_counter`` samples after warm-up.
  Small workloads (``batched``) time batches of calls and report the per-call time of
  each batch, so the timer's resolution and overhead do not dominate; with
  ``single_calls`` every sample is one call, and the 95th percentile is then the
  latency of a single call (issue 5's decode target).
* Each implementation is timed apart from the threads of the one before: the calling
  thread first copies on its own for ``settle_seconds`` (see
  :func:`~numba_rope.bench.timing.settle`), while onnxruntime's, OpenMP's and
  numba_rope's worker threads stop spinning.
* The implementations of a (workload, dtype) take turns: ``rounds`` rounds (3 unless
  set), each timing every implementation for its share of ``repeats`` and
  ``budget_seconds``, and an implementation's median and 95th percentile are those of
  its samples from all rounds. A machine whose speed drifts over minutes (a shared
  VM's can by 2x) then moves every implementation alike, and the ratios between them
  hold; timed one after the other, they compared moments as much as code. Each round
  prepares an implementation afresh (its arrays and sessions, dropped after it is
  timed), so memory holds one implementation's arrays at a time; the output is
  checked in the first round only.
* With ``busy``, another process spins on one core while everything is timed (see
  :func:`~numba_rope.bench.timing.busy_loop`): small calls must not stall when the
  machine's other cores are taken.
* Bytes that RoPE must move: the input read, the output written, and each distinct
  cache row read once (cos and sin). GB/s is those bytes over the median time.
* The floor is a copy of the input into a preallocated array of the same shape: a
  ``parallel=True`` numba loop with numba_rope's thread count, and ``np.copyto`` on one
  thread; the faster of the two is the floor, and ``ratio`` is an implementation's
  median over the floor's median (1.0 = as fast as copying the input).
* Rows whose times are not to be trusted are marked and the report warns (see
  :func:`~numba_rope.bench.report.assess`): every row when other processes' load average
  leaves the threads no idle cores, a (workload, dtype) when its copies stalled.
* A numba_rope row of a large input that takes more than :data:`SLOW_ROW_FACTOR` copy
  floors is probed right after its samples (:func:`probe_slow_row`), and the report
  notes what it found: whether the row is slow again, without streaming stores, and
  whether a plain copy into its output is slow too (the machine's memory, not the
  kernel).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import numba
import numpy as np

from numba_rope import config, reference
from numba_rope.bench.checks import check_output
from numba_rope.bench.peers import Implementation, implementations
from numba_rope.bench.report import Report, Result, cpu_seconds, environment, finish
from numba_rope.bench.targets import Unavailable, target
from numba_rope.bench.timing import (
    BATCH_SECONDS,
    REPEATS,
    SETTLE_SECONDS,
    SINGLE_CALL_REPEATS,
    busy_loop,
    settle,
    time_calls,
)
from numba_rope.bench.workloads import DTYPES, WORKLOADS, Case, Workload, make_case


@dataclass
class Settings:
    device: str = "cpu"
    dtypes: Sequence[str] = DTYPES
    workloads: Sequence[str] = tuple(WORKLOADS)
    threads: int = 0  # 0: numba's current number of threads
    repeats: int = 0  # 0: a workload's default (samples_for)
    warmup: int = 2
    batch_seconds: float = BATCH_SECONDS
    budget_seconds: float = 5.0
    single_calls: bool = False  # every sample one call, also on the batched workloads
    busy: bool = False  # a process spins on one core while timing (busy_loop)
    smoke: bool = False  # made by quick() (`bench --quick`): the numbers mean little
    settle_seconds: float = SETTLE_SECONDS  # before each implementation (timing.settle)
    rounds: int = 3  # turns of every implementation of a (workload, dtype), samples pooled

    def samples_for(self, workload: Workload) -> int:
        """Timed samples per row of ``workload``: ``repeats`` where it is set (above 0),
        else :data:`SINGLE_CALL_REPEATS` for a small workload timed call by call
        (``single_calls``) and :data:`REPEATS` for the rest.

        >>> from numba_rope.bench.workloads import WORKLOADS
        >>> single = Settings(single_calls=True)
        >>> single.samples_for(WORKLOADS["decode"]), single.samples_for(WORKLOADS["prefill"])
        (600, 30)
        >>> Settings().samples_for(WORKLOADS["decode"])
        30
        """
        if self.repeats > 0:
            return self.repeats
        return SINGLE_CALL_REPEATS if self.single_calls and workload.batched else REPEATS

    @classmethod
    def quick(cls, **changes: Any) -> Settings:
        """Tiny repeats for smoke tests: numbers are not meaningful."""
        settings = cls(
            repeats=3,
            warmup=1,
            batch_seconds=1e-4,
            budget_seconds=0.2,
            smoke=True,
            settle_seconds=0.0,
            rounds=1,
        )
        for name, value in changes.items():
            setattr(settings, name, value)
        return settings


def _progress_printer(stream: TextIO | None) -> Callable[[str], None]:
    if stream is None:
        return lambda message: None
    interactive = stream.isatty()

    def show(message: str) -> None:
        if interactive:
            stream.write("\r\033[K" + message)
        else:
            stream.write(message + "\n")
        stream.flush()

    return show


def run(
    settings: Settings,
    *,
    progress: TextIO | None = sys.stderr,
    extra: Iterable[Implementation] = (),
) -> Report:
    """Verify and time every implementation on every (workload, dtype) of ``settings``.

    ``extra`` implementations are run after the built-in ones (the tests feed a wrong
    one here to see it reported as FAILED). Raises :class:`Unavailable` when the device
    is absent.
    """
    started, cpu_at_start = time.perf_counter(), cpu_seconds()
    tgt = target(settings.device)
    if settings.threads:
        numba.set_num_threads(settings.threads)
    threads = numba.get_num_threads()
    candidates = implementations(settings.device, threads) + list(extra)
    report = Report(
        settings={
            **asdict(settings),
            "threads": threads,
            "samples": {name: settings.samples_for(WORKLOADS[name]) for name in settings.workloads},
        },
        environment=environment(threads),
    )
    show = _progress_printer(progress)
    rounds = max(1, settings.rounds)
    total = len(settings.workloads) * len(settings.dtypes) * len(candidates) * rounds
    with busy_loop(settings.busy):
        step = 0
        for workload_name in settings.workloads:
            workload = WORKLOADS[workload_name]
            for dtype_name in settings.dtypes:
                show(
                    f"[{step}/{total}] {workload_name} {dtype_name}: building data and reference..."
                )
                case = make_case(workload, dtype_name)
                expected = reference.rotary_embedding(
                    case.input, case.cos_cache, case.sin_cache, case.position_ids, **case.options
                )
                results: dict[str, Result] = {}
                for turn in range(rounds):
                    for implementation in candidates:
                        step += 1
                        earlier = results.get(implementation.name)
                        if turn and (earlier is None or earlier.median_s is None):
                            continue  # not installed, not available here, or failed
                        show(
                            f"[{step}/{total}] {workload_name} {dtype_name} "
                            f"{implementation.name}" + (f", round {turn + 1}..." if turn else "...")
                        )
                        settle(settings.settle_seconds)
                        floors = [r.median_s for r in results.values() if r.kind == "copy"]
                        result = measure(
                            implementation, case, expected, tgt, threads, settings, report,
                            rounds=rounds, check=not turn,
                            floor_s=min((f for f in floors if f), default=None),
                        )  # fmt: skip
                        if result is None:
                            continue
                        results[implementation.name] = (
                            result if earlier is None else _pooled(earlier, result)
                        )
                _add_ratios(list(results.values()))
                report.results += results.values()
                del case, expected
    finish(report, started, cpu_at_start)
    show(f"[{total}/{total}] done")
    if progress is not None and progress.isatty():
        progress.write("\n")
    return report


def _pooled(first: Result, later: Result) -> Result:
    """``first`` with the samples of a later round of the same implementation: the
    median and 95th percentile of them all, or the later round's failure."""
    if later.median_s is None:
        return later  # a failure in a later round: reported, not averaged away
    first.sample_s = first.sample_s + later.sample_s
    values = np.array(first.sample_s)
    first.median_s = float(np.median(values))
    first.p95_s = float(np.percentile(values, 95))
    first.samples = len(first.sample_s)
    first.gb_per_s = first.bytes / first.median_s / 1e9
    first.probe = first.probe or later.probe  # the first round's probe, if it had one
    return first


def _add_ratios(results: list[Result]) -> None:
    """Each timed RoPE row's ``ratio_to_copy``: its median over the fastest copy's."""
    floors = [r.median_s for r in results if r.kind == "copy" and r.median_s is not None]
    if not floors:
        return
    floor = min(floors)
    for result in results:
        if result.kind != "copy" and result.median_s is not None:
            result.ratio_to_copy = result.median_s / floor


def measure(
    implementation: Implementation,
    case: Case,
    expected: np.ndarray,
    tgt: Any,
    threads: int,
    settings: Settings,
    report: Report | None = None,
    *,
    rounds: int = 1,
    check: bool = True,
    floor_s: float | None = None,
) -> Result | None:
    """Prepare, verify (unless not ``check``: a later round) and time one
    implementation on one case, for a ``rounds``-th of the settings' samples and
    budget; a numba_rope row on the host slower than :data:`SLOW_ROW_FACTOR` times
    ``floor_s`` (the copy floor so far) on an input of :data:`PROBE_MIN_BYTES` or more
    is then probed (:func:`probe_slow_row`; a row keeps its first round's probe).

    Returns None for an implementation that cannot run anywhere here (recorded in
    ``report.not_installed``).
    """
    result = Result(case.workload.name, case.dtype.name, tgt.name, implementation.name, "n/a")
    result.kind = implementation.kind
    try:
        prepared = implementation.prepare(case, tgt, threads)
        prepared.call()
    except Unavailable as why:
        if why.everywhere and report is not None:
            report.not_installed[implementation.name] = str(why)
            return None
        result.reason = str(why)
        return result
    except Exception as error:  # a crashing peer is a failed peer, not a crashed bench
        result.status, result.reason = "FAILED", f"{type(error).__name__}: {error}"
        return result
    copies = implementation.kind in ("copy", "allocating copy")
    if check:
        want = case.input if copies else expected
        ok, error_eps, reason = check_output(case, implementation.kind, prepared.output(), want)
        result.error_eps = error_eps
        if not ok:
            result.status, result.reason = "FAILED", reason
            return result
    batched = case.workload.batched and not settings.single_calls
    rounds = max(1, rounds)
    timing = time_calls(
        prepared.call,
        -(-settings.samples_for(case.workload) // rounds),
        batch_seconds=settings.batch_seconds if batched else 0.0,
        warmup=warmup_calls(settings, implementation),
        budget_seconds=settings.budget_seconds / rounds,
        between=prepared.reset,
    )
    moved = case.copy_bytes if copies else case.rope_bytes
    result.status = "ok"
    result.median_s, result.p95_s = timing.median, timing.p95
    result.samples, result.calls_per_sample = timing.samples, timing.calls_per_sample
    result.sample_s = list(timing.per_call)
    result.bytes = moved
    result.gb_per_s = moved / timing.median / 1e9
    if (
        floor_s
        and timing.median > SLOW_ROW_FACTOR * floor_s
        and tgt.name == "cpu"
        and implementation.name.startswith("numba_rope")
        and case.input.nbytes >= PROBE_MIN_BYTES
    ):
        result.probe = probe_slow_row(prepared, case, floor_s)
    return result


#: Untimed calls before a numba_rope row's samples (outside ``bench --quick``): a small
#: NumPy call of one signature runs by its compiled plan from its ninth repeat on,
#: made (or loaded from numba's cache) by the eighth, which took 3.6-4.7 ms on the
#: 2-core Intel VM, and its helper-sharing entry by the ninth (a second load): two of
#: the 30 single calls of ``--single-calls`` (its p95) before this warm-up
#: (docs/performance.md, "Thirty-second session").
PLAN_WARMUP = 12


def warmup_calls(settings: Settings, implementation: Implementation) -> int:
    """Untimed calls before an implementation's samples: ``settings.warmup``, and for
    numba_rope's rows at least :data:`PLAN_WARMUP` unless the settings are a smoke
    test's (``--quick``, whose few calls are not made to compile plans).

    >>> rope, peer = implementations("cpu", 2)[3], implementations("cpu", 2)[7]
    >>> rope.name, warmup_calls(Settings(), rope), warmup_calls(Settings(), peer)
    ('numba_rope', 12, 2)
    >>> warmup_calls(Settings.quick(), rope)
    1
    """
    if implementation.name.startswith("numba_rope") and not settings.smoke:
        return max(settings.warmup, PLAN_WARMUP)
    return settings.warmup


#: A numba_rope row slower than this many copy floors is probed: the usual rows of
#: large inputs take 0.5-1.4 floors on the development VMs; in 4 of 7 full benches on
#: the Zen 3 VM (docs/performance.md, "Twenty-fifth session") the bfloat16 prefill_3d
#: rows writing another array took 6x: streaming stores on two threads, in some
#: OpenMP teams ("Twenty-sixth session"; the cause is not known).
SLOW_ROW_FACTOR = 3.0

#: Inputs this large or larger are probed when slow (the sizes whose outputs are
#: written with streaming stores, ``config.STREAMING_MIN_BYTES``'s default).
PROBE_MIN_BYTES = 16 << 20


def _minor_faults() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def probe_slow_row(prepared: Any, case: Any, floor_s: float, repeats: int = 5) -> dict[str, Any]:
    """Time a slow row's call again, in four ways, right after its samples: as it was
    (with this process's page faults counted), without streaming stores
    (``config.STREAMING_MIN_BYTES`` raised for these calls only, then restored), on
    one thread (``numba.set_num_threads(1)``, then restored), and as a plain
    ``np.copyto`` of the input into the row's output. A copy into the output as slow
    as the row points at that memory, not at the kernel; a row fast without streaming
    stores, or on one thread, points at them, or at the OpenMP team's state of
    docs/performance.md ("What to expect"). Median seconds of ``repeats`` calls each.
    """

    def median(call: Callable[[], object], between: Callable[[], object] | None) -> float:
        return time_calls(call, repeats, warmup=1, between=between).median

    faults = _minor_faults()
    again = median(prepared.call, prepared.reset)
    faults_after = _minor_faults()
    saved = config.STREAMING_MIN_BYTES
    try:
        config.STREAMING_MIN_BYTES = 1 << 62
        unstreamed = median(prepared.call, prepared.reset)
    finally:
        config.STREAMING_MIN_BYTES = saved
    threads, one_thread = numba.get_num_threads(), None
    if threads > 1:
        try:
            numba.set_num_threads(1)
            one_thread = median(prepared.call, prepared.reset)
        finally:
            numba.set_num_threads(threads)
    output, x = prepared.output(), case.input
    copy_into = None
    if (
        isinstance(output, np.ndarray)
        and output.shape == x.shape
        and output.dtype == x.dtype
        and not np.shares_memory(output, x)
    ):
        copy_into = median(lambda: np.copyto(output, x), None)
    per_call = None
    if faults is not None and faults_after is not None:
        per_call = (faults_after - faults) / (repeats + 1)
    return {
        "floor_s": floor_s,
        "again_s": again,
        "unstreamed_s": unstreamed,
        "one_thread_s": one_thread,
        "copy_into_output_s": copy_into,
        "minor_faults_per_call": per_call,
    }
