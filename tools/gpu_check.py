"""numba_rope on an NVIDIA GPU: correctness against the CPU, bandwidth, host cost.

On a machine with a GPU (numba-cuda; CuPy and torch are used when installed)::

    python tools/gpu_check.py --out gpu_table.md

prints markdown tables (and writes them to ``--out``):

1. correctness: every dtype x interleaved x rotary_dim x position-id variant, through
   Numba device arrays, CuPy arrays and torch tensors, against the CPU result (bit for
   bit; the worst error in units in the last place at the scale of the data is shown
   too), plus the errors (IndexError, NaN rows with the check skipped, host/GPU mix);
2. bandwidth: CUDA-event medians for large prefill shapes and a decode shape in
   float32/float16/bfloat16, as GB/s of bytes read + written, next to a
   device-to-device copy of the input's bytes and next to a torch eager RoPE;
3. host cost: microseconds of Python per call on a tiny input.

It finishes in a few minutes. ``--quick`` runs tiny shapes only: that is how the test
suite smoke-tests this script under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``),
where timings are wall-clock and meaningless. The checks live in
:mod:`numba_rope.bench.gpu_check`; this script parses the options and writes the report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from numba_rope.bench import gpu_check
from numba_rope.bench.gpu import simulator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (simulator smoke test)")
    parser.add_argument("--out", type=Path, help="also write the markdown tables here")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement")
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 50)
    if simulator():  # one Python thread per simulated CUDA thread: keep blocks small
        from numba_rope import config

        config.CUDA_THREADS_PER_BLOCK = 16
    if args.out:
        args.out.write_text("")

    def emit(section: str) -> None:  # each section as it is done: a stopped run keeps it
        print(section + "\n", flush=True)
        if args.out:
            with args.out.open("a") as out:
                out.write(section + "\n\n")

    report, ok = gpu_check.run_check(args.quick, repeats, emit=emit)
    print(report.rstrip().rsplit("\n", 1)[-1])  # the total time; the sections are out
    if args.out:
        args.out.write_text(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
