"""Command line: ``python -m numba_rope demo``, ``python -m numba_rope bench`` and
``python -m numba_rope --version``."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from collections.abc import Callable, Sequence

import numpy as np

import numba_rope
from numba_rope import reference

SEED_SHAPE = (2, 8, 4, 512)
SEED_CACHE_ROWS = 100
SEED_POSITION_IDS = ((6, 2, 1, 7), (2, 8, 3, 6))


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls, after one warm-up call."""
    call()
    times = np.empty(repeats)
    for i in range(repeats):
        start = time.perf_counter()
        call()
        times[i] = time.perf_counter() - start
    return float(np.median(times))


def seed_example(dtype, rng: np.random.Generator):
    """The specification's example: input (2, 8, 4, 512), caches (100, 256), its ids."""
    x = rng.random(SEED_SHAPE).astype(dtype)
    cos = rng.random((SEED_CACHE_ROWS, SEED_SHAPE[3] // 2)).astype(dtype)
    sin = rng.random((SEED_CACHE_ROWS, SEED_SHAPE[3] // 2)).astype(dtype)
    return x, cos, sin, np.array(SEED_POSITION_IDS, dtype=np.int64)


def demo(repeats: int = 2000, out=sys.stdout) -> bool:
    """Run the seed example in float32, float16 and bfloat16; return True if all pass."""
    import ml_dtypes

    from numba_rope.bench import epsilon

    rng = np.random.default_rng(0)
    print(
        f"numba_rope {numba_rope.__version__}: TensorRT/ONNX RotaryEmbedding seed example on the CPU",
        file=out,
    )
    print(
        f"input {SEED_SHAPE}, caches ({SEED_CACHE_ROWS}, {SEED_SHAPE[3] // 2}), "
        f"position_ids {[list(r) for r in SEED_POSITION_IDS]}, interleaved=False, rotary_embedding_dim=0",
        file=out,
    )
    header = f"{'dtype':<9} {'max |error| vs float64 reference':>33} {'in eps*scale':>13} {'median time/call':>17}  check"
    print(header, file=out)
    all_ok = True
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        x, cos, sin, ids = seed_example(dtype, rng)
        got = numba_rope.rotary_embedding(x, cos, sin, ids)
        want = reference.rotary_embedding(x, cos, sin, ids)
        error = np.abs(got.astype(np.float64) - want.astype(np.float64))
        # The formula's rounding error scales with its terms |x1*cos| + |x2*sin|, not with
        # the (possibly cancelling) result: measure it in units of eps * that scale.
        eps = epsilon(dtype)
        scale = float(np.abs(x).astype(np.float64).max()) * float(
            (np.abs(cos).astype(np.float64) + np.abs(sin).astype(np.float64)).max()
        )
        ulps = float(error.max()) / (eps * scale)
        ok = ulps <= 2.0
        all_ok &= ok
        result = np.empty_like(x)

        def call(x=x, cos=cos, sin=sin, ids=ids, result=result):
            return numba_rope.rotary_embedding(x, cos, sin, ids, out=result)

        seconds = median_seconds(call, repeats)
        print(
            f"{np.dtype(dtype).name:<9} {error.max():>33.3g} {ulps:>13.3f} "
            f"{seconds * 1e6:>14.1f} us  {'ok' if ok else 'FAILED'}",
            file=out,
        )
    return all_ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m numba_rope", description=__doc__)
    parser.add_argument(
        "--version", action="version", version=f"numba_rope {numba_rope.__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="run the specification's example and check it")
    demo_parser.add_argument(
        "--repeats", type=_positive, default=2000, help="timed calls per dtype"
    )
    add_bench_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return 0 if demo(args.repeats) else 1
    if args.command == "bench":
        return bench(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


def _names(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated list of names from ``allowed``."""

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"{text!r}: choose from {', '.join(allowed)} (comma-separated)"
            )
        return names

    return parse


def _positive(text: str) -> int:
    """argparse type: an integer >= 1 (argparse's own message would name this function)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _thread_count(text: str) -> int:
    """argparse type: 1 to numba's thread count (``NUMBA_NUM_THREADS``)."""
    import numba

    value, most = _positive(text), numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
    if value > most:
        raise argparse.ArgumentTypeError(
            f"must lie in [1, {most}] (numba's threads on this machine, NUMBA_NUM_THREADS), "
            f"got {value}"
        )
    return value


def _output_path(path: str, what: str) -> str | None:
    """Why ``path`` cannot be written (its folder missing or read-only, a folder
    itself), or None: checked before the bench runs, so that a bad ``--json`` or
    ``--plot`` path does not throw away minutes of timing."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{what} {path!r} is a folder: name a file"
    if not os.path.isdir(folder):
        return f"{what} {path!r}: its folder {folder!r} does not exist"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{what} {path!r} cannot be written here (permission denied)"
    return None


def add_bench_parser(commands) -> None:
    from numba_rope import bench as benchmarks

    parser = commands.add_parser(
        "bench",
        help="time numba_rope against a copy, NumPy, onnxruntime and torch",
        description=textwrap.fill(
            "Verify, then time numba_rope next to the bandwidth floor (a copy of the input) "
            "and the peers that are installed (the specification's NumPy formula, "
            "onnxruntime with a bound output and its allocating run(), torch eager). "
            "The header shows the load average and the vector extensions; a WARNING "
            "line and * mark the rows of a loaded machine or a stalled floor. Workloads:"
        )
        + "\n\n"
        + benchmarks.workload_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", choices=benchmarks.DEVICES, default="cpu")
    parser.add_argument(
        "--dtypes",
        type=_names(benchmarks.DTYPES),
        default=list(benchmarks.DTYPES),
        help=f"comma-separated, default {','.join(benchmarks.DTYPES)}",
    )
    parser.add_argument(
        "--workloads",
        type=_names(tuple(benchmarks.WORKLOADS)),
        default=list(benchmarks.WORKLOADS),
        help=f"comma-separated, default {','.join(benchmarks.WORKLOADS)}",
    )
    parser.add_argument(
        "--threads",
        type=_thread_count,
        default=0,
        help="numba (and peer) threads, at most numba's (NUMBA_NUM_THREADS); default: numba's",
    )
    parser.add_argument(
        "--repeats",
        type=_positive,
        default=None,
        help="timed samples per row (default 30; 600 on seed and decode with --single-calls)",
    )
    parser.add_argument(
        "--rounds",
        type=_positive,
        default=None,
        help="turns of every implementation of a workload, samples pooled (default 3)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="3 samples, 1 round, short budgets: a smoke test"
    )
    parser.add_argument(
        "--single-calls",
        action="store_true",
        help="time every call on its own, so that p95 is the latency of one call "
        "(default: the small workloads time batches of calls)",
    )
    parser.add_argument(
        "--busy",
        action="store_true",
        help="keep one core busy (a spinning process) while timing",
    )
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw GB/s per workload, with the load and any warning (needs matplotlib)",
    )


def bench(args: argparse.Namespace) -> int:
    """Run ``python -m numba_rope bench``: 0 if every check passed, 1 if one failed."""
    from numba_rope import bench as benchmarks

    if args.plot:
        try:
            benchmarks.require_matplotlib()
        except ImportError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    unwritable = [
        why
        for why in (
            args.json and _output_path(args.json, "--json"),
            args.plot and _output_path(args.plot, "--plot"),
            args.plot and benchmarks.unsupported_plot_format(args.plot),
        )
        if why
    ]
    if unwritable:
        for why in unwritable:
            print(f"error: {why}", file=sys.stderr)
        return 2
    chosen = {"device": args.device, "dtypes": args.dtypes, "workloads": args.workloads}
    chosen["threads"] = args.threads
    chosen["single_calls"] = args.single_calls
    chosen["busy"] = args.busy
    settings = benchmarks.Settings.quick(**chosen) if args.quick else benchmarks.Settings(**chosen)
    if args.repeats is not None:
        settings.repeats = args.repeats
    if args.rounds is not None:
        settings.rounds = args.rounds
    try:
        report = benchmarks.run(settings)
    except benchmarks.Unavailable as why:
        print(f"error: cannot benchmark on {args.device}: {why}", file=sys.stderr)
        return 2
    print(benchmarks.format_table(report))
    for failure in report.failed:
        print(
            f"FAILED: {failure.implementation} on {failure.workload} {failure.dtype}: "
            f"{failure.reason}",
            file=sys.stderr,
        )
    written = True
    for path, write in ((args.json, benchmarks.write_json), (args.plot, benchmarks.plot)):
        if not path:
            continue
        try:
            write(report, path)
        except OSError as error:  # checked before the run; the disk may still refuse
            print(f"error: could not write {path}: {error}", file=sys.stderr)
            written = False
        else:
            print(f"wrote {path}")
    return 1 if report.failed else 0 if written else 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
