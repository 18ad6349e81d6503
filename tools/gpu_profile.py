"""Where a GPU call's time goes, on a machine with an NVIDIA GPU (numba-cuda, torch):

1. kernel durations, traced by CUPTI through ``torch.profiler`` (every kernel of the
   process, numba's too), for the bandwidth check's shapes: the GPU's own time, apart
   from the host's;
2. the host's Python per call: ``cProfile`` over a loop of small calls, and the cost of
   numba-cuda's primitives that a call uses (a launch, a context, a view, a copy);
3. the prefill's kernel time by heads per thread and threads per block.

    python tools/gpu_profile.py [primitives] [host] [kernels] [tuning]

Prints plain text; meant to be read next to ``tools/gpu_check.py``'s tables.
"""

from __future__ import annotations

import cProfile
import functools
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import numba_rope
from numba_rope.bench.gpu import NumbaArrays, kernel_milliseconds
from numba_rope.bench.workloads import make_arrays


def _per_call_us(call: Callable[[], object], n: int = 2000) -> float:
    from numba import cuda

    call()
    cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        call()
    cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def kernel_durations() -> None:
    import torch
    from numba import cuda
    from torch.profiler import ProfilerActivity, profile

    rng = np.random.default_rng(1)
    cases = [("prefill", (8, 32, 4096, 128), d) for d in ("float32", "float16", "bfloat16")]
    cases += [("decode", (256, 32, 1, 128), d) for d in ("float32", "bfloat16")]
    for kind, shape, dtype in cases:
        n_positions = shape[2] if kind == "prefill" else 4096
        ids = "arange" if kind == "prefill" else True
        arrays = make_arrays(rng, shape, dtype, position_ids=ids, n_positions=n_positions)
        dx, dcos, dsin, dids = (NumbaArrays().to_device(a) for a in arrays)
        dout = cuda.device_array_like(dx)

        def call(dx=dx, dcos=dcos, dsin=dsin, dids=dids, dout=dout):
            numba_rope.rotary_embedding(dx, dcos, dsin, dids, out=dout, check_position_ids=False)

        for _ in range(3):
            call()
        cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                call()
            cuda.synchronize()
        nbytes = 2 * arrays[0].nbytes
        print(f"\n== {kind} {shape} {dtype}: input {arrays[0].nbytes / 2**20:.0f} MiB")
        for event in prof.key_averages():
            total = getattr(event, "device_time_total", None)
            if total is None:
                total = getattr(event, "cuda_time_total", 0)
            if not total or total <= 0 or event.count == 0:
                continue
            mean_us = total / event.count
            print(
                f"  {event.key[:90]:90s} n={event.count:3d} mean {mean_us:9.1f} us"
                f"  ({nbytes / mean_us / 1e3:7.0f} GB/s of input+output)"
            )
        del arrays, dx, dcos, dsin, dids, dout, call
        torch.cuda.empty_cache()


def launch_tuning() -> None:
    """Kernel time of the prefill by heads per thread and threads per block."""
    from numba import cuda

    from numba_rope import config

    rng = np.random.default_rng(3)
    shape = (8, 32, 4096, 128)
    print("\n== launch tuning, prefill (8, 32, 4096, 128): kernel us (GB/s of input+output)")
    for dtype in ("float16", "float32"):
        arrays = make_arrays(rng, shape, dtype, position_ids="arange", n_positions=shape[2])
        dx, dcos, dsin, dids = (NumbaArrays().to_device(a) for a in arrays)
        dout = cuda.device_array_like(dx)
        call = functools.partial(
            numba_rope.rotary_embedding, dx, dcos, dsin, dids, out=dout, check_position_ids=False
        )
        nbytes = 2 * arrays[0].nbytes
        saved = config.CUDA_HEADS_PER_THREAD, config.CUDA_THREADS_PER_BLOCK
        try:
            for heads in (1, 2, 4, 8):
                cells = []
                for threads in (128, 256, 512):
                    config.CUDA_HEADS_PER_THREAD, config.CUDA_THREADS_PER_BLOCK = heads, threads
                    us = 1e3 * (kernel_milliseconds(call) or float("nan"))
                    cells.append(f"{threads} threads {us:7.1f} ({nbytes / us / 1e3:5.0f})")
                print(f"  {dtype} heads {heads}: " + " | ".join(cells), flush=True)
        finally:
            config.CUDA_HEADS_PER_THREAD, config.CUDA_THREADS_PER_BLOCK = saved
        del arrays, dx, dcos, dsin, dids, dout


def host_profile() -> None:
    from numba import cuda

    rng = np.random.default_rng(2)
    x, cos, sin, ids = make_arrays(rng, (1, 1, 4, 64), np.float32)
    dx, dcos, dsin, dids = (cuda.to_device(a) for a in (x, cos, sin, ids))
    dout = cuda.to_device(x)

    def call():
        numba_rope.rotary_embedding(dx, dcos, dsin, dids, out=dout, check_position_ids=False)

    def checked_call():
        numba_rope.rotary_embedding(dx, dcos, dsin, dids, out=dout)

    print(f"\n== host: tiny unchecked call with out=: {_per_call_us(call, 500):.1f} us per call")
    print(
        f"   the same call checked (one kernel, one read-back): {_per_call_us(checked_call, 500):.1f} us"
    )
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(300):
        call()
    profiler.disable()
    cuda.synchronize()
    stats = pstats.Stats(profiler, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)


def primitives() -> None:
    from numba import cuda

    @cuda.jit
    def one(a):
        i = cuda.grid(1)
        if i < a.shape[0]:
            a[i] += 1

    @cuda.jit
    def many(a, b, c, d, e, f, g, h, i1, i2, i3, i4, i5, s):
        i = cuda.grid(1)
        if i < a.shape[0]:
            a[i] += s

    small = cuda.to_device(np.zeros(64, np.float32))
    other = cuda.to_device(np.zeros(64, np.float32))
    four = cuda.to_device(np.zeros((1, 1, 4, 64), np.float32))
    stream = cuda.default_stream()
    description = dict(small.__cuda_array_interface__)
    args = (small, other, four, four, four, four, small, small, 1, 2, 3, 4, 5, np.float32(1))

    def enter_gpu():
        with cuda.gpus[0]:
            pass

    # Launch paths that skip parts of numba-cuda's dispatcher (candidates for a cheaper
    # launch; to be A/B'd here before any is used): a dispatcher specialized to these
    # argument types (no type resolution per call), and the compiled kernel's own
    # launch (no launch configuration object, no dispatcher at all).
    try:
        many[128, 32, stream](*args)
        specialized = many.specialize(*args)
        compiled = next(iter(many.overloads.values()))
    except Exception as error:  # numba-cuda's private API moved: the other rows still run
        print(f"  (no launch candidates: {error!r})")
        specialized = compiled = None

    rows = {
        "cuda.current_context()": lambda: cuda.current_context(),
        "with cuda.gpus[0]": enter_gpu,
        "kernel[1, 32](1 array)": lambda: one[1, 32](small),
        "kernel[128, 32](1 array)": lambda: one[128, 32](small),
        "kernel[128, 32, stream](14 arguments)": lambda: many[128, 32, stream](*args),
        "specialized[128, 32, stream](14 arguments)": lambda: specialized[128, 32, stream](*args),
        "compiled.launch(14 arguments)": lambda: compiled.launch(
            args, (128, 1, 1), (32, 1, 1), stream
        ),
        "device array copy_to_device(device array)": lambda: other.copy_to_device(small),
        "cuda.from_cuda_array_interface": lambda: cuda.from_cuda_array_interface(
            description, owner=small, sync=False
        ),
        "device array .view(uint32)": lambda: small.view(np.uint32),
        "cuda.synchronize()": lambda: cuda.synchronize(),
        "cuda.external_stream(0)": lambda: cuda.external_stream(0),
    }
    print("\n== numba-cuda primitives (us per call, host)")
    for name, call in rows.items():
        try:
            print(f"  {name:45s} {_per_call_us(call):8.1f}")
        except Exception as error:  # one primitive failing leaves the others
            print(f"  {name:45s} raised {error!r}")


def main() -> int:
    parts = {"primitives": primitives, "host": host_profile, "kernels": kernel_durations}
    parts["tuning"] = launch_tuning
    chosen = sys.argv[1:] or list(parts)
    for part in (parts[name] for name in chosen):
        began = time.perf_counter()
        try:
            part()
        except Exception:  # the next part still runs
            import traceback

            traceback.print_exc()
        print(f"({part.__name__}: {time.perf_counter() - began:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
