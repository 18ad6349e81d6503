"""One-process A/B of numba_rope at another commit against the working tree.

The other commit's package is exported (``git archive``) into a temporary folder and
renamed ``numba_rope_old``, so both versions live in one process and their calls can
alternate: the machine's drift over minutes then touches both alike. For each workload
of :mod:`numba_rope.bench` and each 16/32-bit dtype it times ``out=``, the allocating
call and ``rotary_embedding_qk`` (k a quarter of q's heads), after checking that both
versions give the same bits, and prints the medians and new / old. Each version's
samples run with the other's helper thread asleep (see :func:`handing_over`).

    python tools/ab_compare.py 635ba95 --reps 31
    python tools/ab_compare.py HEAD~3 --reps 61 --workloads seed,decode
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def export_old(revision: str, folder: Path) -> None:
    """``numba_rope`` at ``revision`` as the package ``numba_rope_old`` in ``folder``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "numba_rope"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    (folder / "numba_rope").rename(folder / "numba_rope_old")
    for path in (folder / "numba_rope_old").rglob("*.py"):
        text = path.read_text()
        path.write_text(text.replace("numba_rope", "numba_rope_old"))


def load_old(revision: str) -> ModuleType:
    """``numba_rope`` at ``revision``, imported as ``numba_rope_old`` (see
    :func:`export_old`), with its ``flash_attn`` and ``vllm`` modules."""
    folder = Path(tempfile.mkdtemp(prefix="numba_rope_ab_"))
    export_old(revision, folder)
    sys.path.insert(0, str(folder))
    for name in ("numba_rope_old", "numba_rope_old.flash_attn", "numba_rope_old.vllm"):
        importlib.import_module(name)
    return sys.modules["numba_rope_old"]


def per_call(call: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def compare(
    old: Callable[[], object],
    new: Callable[[], object],
    reps: int,
    prepare: tuple[Callable[[], object], Callable[[], object]] | None = None,
) -> tuple[float, float]:
    """Medians of ``reps`` alternating samples of about 2 ms each (the order flips).
    ``prepare``: what runs before each sample of the old and of the new version."""
    calls = max(1, int(2e-3 / max(per_call(new, 1), 1e-7)))
    times_old: list[float] = []
    times_new: list[float] = []
    before_old, before_new = prepare or (lambda: None, lambda: None)
    for rep in range(reps):
        pair = [(times_old, old, before_old), (times_new, new, before_new)]
        for times, call, before in pair[:: 1 if rep % 2 else -1]:
            before()
            times.append(per_call(call, calls))
    return statistics.median(times_old), statistics.median(times_new)


def handing_over(version, call, other, other_call) -> Callable[[], object]:
    """What runs before a sample of ``version`` (``call``): the other version's helper
    thread is put to sleep (one call of it with a spin of 0 us: its helper sleeps
    after its last chunk) and this version's spin restored. Two helpers spinning on
    the machine's cores at once slowed the calls shared with them (float32 decode 58
    against 41 us on a 2-core VM), and unequally."""
    spin = version.config.HELPER_SPIN_MICROSECONDS

    def prepare() -> None:
        other.config.HELPER_SPIN_MICROSECONDS = 0
        other_call()
        other.config.HELPER_SPIN_MICROSECONDS = spin
        version.config.HELPER_SPIN_MICROSECONDS = spin
        time.sleep(0.002)  # the other helper's spin (0 us) ends, it sleeps
        # This version's helper, woken by its first job, back in its steady state (a
        # helper that slept through a few jobs leaves the calls alone for a while).
        start = time.perf_counter()
        while True:
            call()
            if time.perf_counter() - start > 5e-3:
                break

    return prepare


def print_row(
    label: str,
    old: Callable[[], object],
    new: Callable[[], object],
    reps: int,
    prepare: tuple[Callable[[], object], Callable[[], object]] | None = None,
) -> None:
    """One line of a table: ``label``, the medians of :func:`compare` and new / old."""
    median_old, median_new = compare(old, new, reps, prepare)
    print(
        f"{label} {median_old * 1e6:8.2f}us {median_new * 1e6:8.2f}us  "
        f"{median_new / median_old:5.3f}",
        flush=True,
    )


def _call(rope, name: str, case, k, out, out_k) -> Callable[[], object]:
    """One timed call of a version (``rope``): ``out=``, allocating, or q+k."""
    x, cos, sin, ids = case.input, case.cos_cache, case.sin_cache, case.position_ids
    if name == "out":
        return lambda: rope.rotary_embedding(x, cos, sin, ids, out=out, **case.options)
    if name == "alloc":
        return lambda: rope.rotary_embedding(x, cos, sin, ids, **case.options)
    options = dict(case.options)
    if case.workload.three_d:  # k's heads, which a 3-D k's shape does not say
        options["num_kv_heads"] = max(1, case.workload.shape[1] // 4)
    return lambda: rope.rotary_embedding_qk(x, k, cos, sin, ids, out_q=out, out_k=out_k, **options)


def result_bytes(result) -> bytes:
    """The bytes of a call's result (an array, or q and k), copied: both versions
    write into the same outputs."""
    arrays = result if isinstance(result, tuple) else (result,)
    return b"".join(np.ascontiguousarray(a).view(np.uint8).tobytes() for a in arrays)


def kv_heads(case) -> np.ndarray:
    """k for the q+k call: the first quarter of the input's heads (at least one), in
    the input's form (a 3-D input's heads lie inside its last axis)."""
    x = case.input
    if not case.workload.three_d:
        return np.ascontiguousarray(x[:, : max(1, x.shape[1] // 4)])
    batch, heads, seq_len, head_size = case.workload.shape
    kept = max(1, heads // 4)
    split = x.reshape(batch, seq_len, heads, head_size)[:, :, :kept]
    return np.ascontiguousarray(split).reshape(batch, seq_len, kept * head_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("revision", help="the commit to compare against")
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--workloads", default="seed,decode,prefill,batch_prefill,partial")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    args = parser.parse_args(argv)
    numba_rope_old = load_old(args.revision)

    import numba_rope
    from numba_rope import bench
    from numba_rope._aligned import empty_on_line

    print(f"{'workload':14s} {'dtype':9s} {'call':6s} {'old':>10s} {'new':>10s}  new/old")
    for workload in args.workloads.split(","):
        for dtype in args.dtypes.split(","):
            case = bench.make_case(workload, dtype)
            k = kv_heads(case)
            # One pair of outputs, on 64-byte lines, for both versions. With NumPy's own
            # placement two outputs could start at different offsets from a line, which
            # alone moved a float32 decode step by 1.2-1.4x; and two outputs on lines
            # still lie at different distances from the input, which moved decode rows
            # by up to 15% either way from one process to the next (docs/performance.md,
            # "Fortieth session").
            outs = (
                empty_on_line(case.input.shape, case.input.dtype),
                empty_on_line(k.shape, k.dtype),
            )
            for name in ("out", "alloc", "qk"):
                old = _call(numba_rope_old, name, case, k, *outs)
                new = _call(numba_rope, name, case, k, *outs)
                if result_bytes(old()) != result_bytes(new()):
                    print(f"{workload} {dtype} {name}: the two versions differ")
                    return 1
                prepare = (
                    handing_over(numba_rope_old, old, numba_rope, new),
                    handing_over(numba_rope, new, numba_rope_old, old),
                )
                print_row(f"{workload:14s} {dtype:9s} {name:6s}", old, new, args.reps, prepare)
    return 0


if __name__ == "__main__":
    sys.exit(main())
