"""Timing on the host: per-call medians of ``perf_counter`` samples, the copy floor, and a
busy core to time against.

Small workloads (``batched``) time batches of calls and report the per-call time of
each batch, so the timer's resolution and overhead do not dominate.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from numba_rope.bench.workloads import Case

#: Length of one timed batch of calls on ``batched`` workloads, in seconds.
BATCH_SECONDS = 5e-4

#: Timed samples per row by default: batches of calls on the small workloads, single
#: calls on the large ones.
REPEATS = 30

#: Timed samples per row of the small (``batched``) workloads with ``single_calls``,
#: where the 95th percentile is the latency of one call. Of 30 samples it lies between
#: the second and third largest, so two stalls of the machine (a descheduled thread, an
#: interrupt) make it; of 600, 30 stalls do. With the other core busy on the 2-core
#: Zen 4 VM (``bench --single-calls --busy --workloads decode,seed``, 24 s with 600),
#: numba_rope's p95 was over twice its median in 16 of 72 cells of three runs of 30
#: samples (up to 8.3x) and in none of 72 of three runs of 600 alternated with them (at
#: most 1.86x; docs/performance.md, "Fifty-first session"). The large workloads keep
#: :data:`REPEATS` (600 made a ``--single-calls`` run of ``prefill`` 139 s instead of 40).
SINGLE_CALL_REPEATS = 600

#: How long :func:`settle` keeps the calling thread busy before an implementation is
#: timed, in seconds. Worker threads spin on after their last call, and a spinning
#: thread takes the core that the next implementation's second thread needs: on the
#: 2-core Zen 4 VM, onnxruntime's intra-op pool kept a core busy for about 45 ms after
#: a burst of decode calls (0.86 cores over the first 50 ms, nothing after), torch's
#: OpenMP threads under 10 ms, numba_rope's helper thread 1 ms
#: (``config.HELPER_SPIN_MICROSECONDS``).
SETTLE_SECONDS = 0.06


@dataclass(frozen=True)
class Timing:
    median: float  # seconds per call
    p95: float
    samples: int
    calls_per_sample: int
    per_call: tuple[float, ...] = ()  # each sample's seconds per call, in order


def time_calls(
    call: Callable[[], object],
    repeats: int,
    *,
    batch_seconds: float = 0.0,
    warmup: int = 2,
    budget_seconds: float = math.inf,
    between: Callable[[], object] | None = None,
) -> Timing:
    """Per-call median and 95th percentile of ``repeats`` samples after ``warmup`` calls.

    With ``batch_seconds`` > 0 a sample is a batch of calls lasting about that long
    (per-call time = batch time / calls). Sampling stops early, after at least three
    samples, once ``budget_seconds`` have passed. ``between``, if given, runs before
    each sample, untimed (an in-place call's input restored, see
    :class:`~numba_rope.bench.peers.Prepared`).
    """
    for _ in range(warmup):
        call()
    number = 1
    if batch_seconds > 0:
        fastest = math.inf
        for _ in range(3):
            start = time.perf_counter()
            call()
            fastest = min(fastest, time.perf_counter() - start)
        number = max(1, min(10_000, int(batch_seconds / max(fastest, 1e-7))))
    samples = []
    began = time.perf_counter()
    for _ in range(max(1, repeats)):
        if between is not None:
            between()
        start = time.perf_counter()
        for _ in range(number):
            call()
        samples.append((time.perf_counter() - start) / number)
        if len(samples) >= 3 and time.perf_counter() - began > budget_seconds:
            break
    values = np.array(samples)
    return Timing(
        float(np.median(values)),
        float(np.percentile(values, 95)),
        len(samples),
        number,
        tuple(samples),
    )


def settle(seconds: float) -> None:
    """Keep the calling thread busy for ``seconds`` with single-thread copies of 256 KiB,
    so that the worker threads of whatever ran before (see :data:`SETTLE_SECONDS`)
    stop spinning and go to sleep before the next implementation is timed: each one is
    then timed apart from the others' threads. Busy rather than asleep, so that the
    calling thread keeps its core meanwhile.

    >>> start = time.perf_counter(); settle(0.01); time.perf_counter() - start >= 0.01
    True
    """
    if seconds <= 0:
        return
    source = np.ones(1 << 16, np.float32)
    target = np.empty_like(source)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        np.copyto(target, source)


def copy_floor(case: Case, tgt: Any, repeats: int = 15) -> float:
    """Median seconds of the fastest copy of the input into an array of its shape.

    On the CPU the faster of the numba parallel copy and ``np.copyto``; on the GPU a
    device-to-device copy.
    """
    x = tgt.put(case.input)
    out = tgt.empty_like(x)

    def copy():
        tgt.copy(x, out)
        tgt.synchronize()

    copies: list[Callable[[], object]] = [copy]
    if tgt.name == "cpu":
        copies.append(lambda: np.copyto(out, x))
    batch = BATCH_SECONDS if case.workload.batched else 0.0
    return min(time_calls(c, repeats, batch_seconds=batch).median for c in copies)


def bandwidth_fraction(
    case: Case, tgt: Any, rope_call: Callable[[], object], repeats: int = 15
) -> float:
    """Copy floor over RoPE time, both measured now: 1.0 means RoPE runs at copy speed.

    The inverse of ``bench``'s ratio column; ``rope_call`` must synchronize.
    """
    batch = BATCH_SECONDS if case.workload.batched else 0.0
    rope = time_calls(rope_call, repeats, batch_seconds=batch).median
    return copy_floor(case, tgt, repeats) / rope


@contextlib.contextmanager
def busy_loop(enabled: bool = True) -> Iterator[subprocess.Popen | None]:
    """Keep one core busy for the duration of the block: a Python process spinning in
    an endless loop, killed and reaped when the block ends (or raises). Yields the
    process, or None (and starts nothing) when not ``enabled``.

    What it shows: a call that waits for another thread stalls until the scheduler
    gives that thread a core, milliseconds on a machine whose other cores are taken;
    numba_rope's small calls run on the calling thread and should not.

    >>> with busy_loop() as process:
    ...     process.poll() is None
    True
    >>> process.poll() is None
    False
    """
    if not enabled:
        yield None
        return
    process = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield process
    finally:
        process.kill()
        process.wait()
