"""numba_rope against onnxruntime in one process, the two timed in alternation.

The bench times one implementation after another, minutes apart on a full run, so
its ratios carry the machine's drift. Here each round times numba_rope's ``out=`` call
and onnxruntime's I/O-bound call (the bench's own ``numba_rope`` and ``onnxruntime``
rows) back to back, in alternating order, each after :func:`numba_rope.bench.settle`
(the other's worker threads stop spinning first: onnxruntime's pool spins about 45 ms
after its last call). Prints the medians, the ratio of the medians, and the median and
range of the per-round ratios (numba_rope / onnxruntime: below 1 is faster).

    python tools/vs_onnxruntime.py --workloads seed,decode --rounds 15
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numba

from numba_rope import bench
from numba_rope.bench import peers


def per_call(call: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="seed,decode,prefill_3d,prefill")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--sample-ms", type=float, default=20.0, help="length of one sample")
    args = parser.parse_args()
    target, threads = bench.target("cpu"), numba.get_num_threads()
    print(f"numba_rope / onnxruntime, {threads} threads, {args.rounds} alternating rounds")
    for workload in args.workloads.split(","):
        for dtype in args.dtypes.split(","):
            case = bench.make_case(workload, dtype)
            calls = {
                "numba_rope": peers.prepare("numba_rope", case, target, threads).call,
                "onnxruntime": peers.prepare("onnxruntime", case, target, threads).call,
            }
            once = min(per_call(calls["numba_rope"], 3) for _ in range(3))
            number = max(3, int(args.sample_ms * 1e-3 / once))
            times: dict[str, list[float]] = {name: [] for name in calls}
            for round_ in range(args.rounds):
                order = list(calls) if round_ % 2 == 0 else list(calls)[::-1]
                for name in order:
                    bench.settle(bench.SETTLE_SECONDS)
                    calls[name]()
                    times[name].append(per_call(calls[name], number))
            ours, theirs = (statistics.median(times[name]) for name in calls)
            ratios = [a / b for a, b in zip(times["numba_rope"], times["onnxruntime"], strict=True)]
            unit, scale = ("us", 1e6) if ours < 1e-3 else ("ms", 1e3)
            print(
                f"{workload:<11} {dtype:<8} numba_rope {ours * scale:8.2f} {unit}  "
                f"onnxruntime {theirs * scale:8.2f} {unit}  ratio {ours / theirs:.2f}  "
                f"per round {statistics.median(ratios):.2f} "
                f"[{min(ratios):.2f}-{max(ratios):.2f}]",
                flush=True,
            )


if __name__ == "__main__":
    main()
