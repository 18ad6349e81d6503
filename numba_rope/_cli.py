"""Command line: ``python -m numba_rope demo``."""

from __future__ import annotations

import argparse
import sys
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
        eps = (
            float(np.finfo(np.float32).eps)
            if dtype == np.float32
            else 2.0 ** -(10 if dtype == np.float16 else 7)
        )
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
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="run the specification's example and check it")
    demo_parser.add_argument("--repeats", type=int, default=2000, help="timed calls per dtype")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return 0 if demo(args.repeats) else 1
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
