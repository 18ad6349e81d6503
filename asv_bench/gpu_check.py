"""numba_rope on an NVIDIA GPU: correctness against the CPU, bandwidth, host cost.

On a machine with a GPU (numba-cuda; CuPy and torch are used when installed)::

    python asv_bench/gpu_check.py --out gpu_table.md

prints markdown tables (and writes them to ``--out``):

1. correctness: every dtype x interleaved x rotary_dim x position-id variant, through
   Numba device arrays, CuPy arrays and torch tensors, against the CPU result (within
   one unit in the last place of the output dtype at the scale of the data, NaN where
   the CPU has NaN), plus the errors (IndexError, NaN rows with the check skipped,
   host/GPU mix);
2. bandwidth: CUDA-event medians for large prefill shapes and a decode shape in
   float32/float16/bfloat16, as GB/s of bytes read + written, next to a
   device-to-device copy of the input's bytes and next to a torch eager RoPE;
3. host cost: microseconds of Python per call on a tiny input.

It finishes in a few minutes. ``--quick`` runs tiny shapes only: that is how the test
suite smoke-tests this script under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``),
where timings are wall-clock and meaningless.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import ml_dtypes
import numpy as np
from numba import cuda
from numba.core import config as numba_config

import numba_rope

SIMULATOR = bool(getattr(numba_config, "ENABLE_CUDASIM", False))
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": BFLOAT16,
    "float64": np.dtype(np.float64),
}
EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7, "float64": 2.0**-52}
TARGET_COPY_FRACTION = 0.85
TARGET_HOST_US = 20.0


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# -- array libraries: host -> device -> host ---------------------------------------------


class NumbaArrays:
    name = "numba"

    def to_device(self, a):
        return None if a is None else cuda.to_device(a)

    def to_host(self, d) -> np.ndarray:
        return d.copy_to_host()


class CupyArrays:
    """CuPy has no bfloat16: bfloat16 goes through Numba views of uint16 CuPy arrays
    (the recipe in the README)."""

    name = "cupy"

    def __init__(self):
        import cupy

        self.cupy = cupy

    def to_device(self, a):
        if a is None:
            return None
        if a.dtype == BFLOAT16:
            return cuda.as_cuda_array(self.cupy.asarray(a.view(np.uint16))).view(BFLOAT16)
        return self.cupy.asarray(a)

    def to_host(self, d) -> np.ndarray:
        if isinstance(d, self.cupy.ndarray):
            return self.cupy.asnumpy(d)
        return d.copy_to_host()


class TorchArrays:
    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch

    def to_device(self, a):
        if a is None:
            return None
        if a.dtype == BFLOAT16:
            return self.torch.from_numpy(a.view(np.int16)).view(self.torch.bfloat16).cuda()
        return self.torch.from_numpy(np.ascontiguousarray(a)).cuda()

    def to_host(self, t) -> np.ndarray:
        t = t.cpu()
        if t.dtype == self.torch.bfloat16:
            return t.view(self.torch.int16).numpy().view(BFLOAT16)
        return t.numpy()


def libraries() -> list:
    found: list = [NumbaArrays()]
    if not SIMULATOR and _installed("cupy"):
        found.append(CupyArrays())
    if not SIMULATOR and _installed("torch"):
        import torch

        if torch.cuda.is_available():
            found.append(TorchArrays())
    return found


# -- data ----------------------------------------------------------------------------------


def make_case(rng, shape, dtype, *, rotary_dim=0, with_ids=True, n_positions=None, ids=None):
    batch, _, seq_len, head_size = shape
    half = (rotary_dim or head_size) // 2
    x = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    if with_ids:
        n_positions = n_positions or seq_len + 7
        if ids is None:
            ids = rng.integers(0, n_positions, size=(batch, seq_len), dtype=np.int64)
        angles = rng.uniform(-np.pi, np.pi, size=(n_positions, half)).astype(np.float32)
    else:
        ids = None
        angles = rng.uniform(-np.pi, np.pi, size=(batch, seq_len, half)).astype(np.float32)
    return x, np.cos(angles).astype(dtype), np.sin(angles).astype(dtype), ids


# -- 1. correctness --------------------------------------------------------------------------


def compare(got: np.ndarray, want: np.ndarray, x, cos, sin, dtype_name: str) -> tuple[float, float]:
    """(worst |got - want| in units of eps * scale, fraction of bitwise-equal elements);
    inf if NaNs disagree."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    if got.shape != want.shape or not np.array_equal(np.isnan(g), np.isnan(w)):
        return float("inf"), 0.0
    scale = float(np.abs(x.astype(np.float64)).max(initial=0)) * float(
        (np.abs(cos.astype(np.float64)) + np.abs(sin.astype(np.float64))).max(initial=0)
    )
    finite = np.isfinite(w)
    if not np.array_equal(g[~finite & ~np.isnan(w)], w[~finite & ~np.isnan(w)]):
        return float("inf"), 0.0
    error = float(np.abs(g[finite] - w[finite]).max(initial=0)) / (EPS[dtype_name] * scale or 1)
    same = np.ascontiguousarray(got).view(np.uint8) == np.ascontiguousarray(want).view(np.uint8)
    return error, float(same.mean()) if same.size else 1.0


def check_correctness(quick: bool, rng) -> tuple[list[list[str]], bool]:
    shape = (1, 2, 3, 8) if quick else (2, 8, 33, 128)
    head_size = shape[3]
    rows, all_ok = [], True
    for lib in libraries():
        for dtype_name, dtype in DTYPES.items():
            worst, same, n = 0.0, 1.0, 0
            for interleaved in (False, True):
                for rotary_dim in (0, head_size // 2):
                    for with_ids in (True, False):
                        x, cos, sin, ids = make_case(
                            rng, shape, dtype, rotary_dim=rotary_dim, with_ids=with_ids
                        )
                        kwargs = {"interleaved": interleaved, "rotary_embedding_dim": rotary_dim}
                        want = numba_rope.rotary_embedding(x, cos, sin, ids, **kwargs)
                        got = numba_rope.rotary_embedding(
                            *(lib.to_device(a) for a in (x, cos, sin, ids)), **kwargs
                        )
                        error, equal = compare(lib.to_host(got), want, x, cos, sin, dtype_name)
                        worst, same, n = max(worst, error), min(same, equal), n + 1
            ok = worst <= 1.0
            all_ok &= ok
            rows.append(
                [
                    "correctness",
                    lib.name,
                    dtype_name,
                    f"{n} variants, shape {shape}",
                    f"{worst:.3f}",
                    f"{100 * same:.2f}%",
                    "ok" if ok else "FAILED",
                ]
            )
        for dtype_name in ("float32", "bfloat16"):
            worst, same, n = check_features(lib, rng, quick, DTYPES[dtype_name], dtype_name)
            ok = worst <= 1.0
            all_ok &= ok
            rows.append(
                [
                    "features",
                    lib.name,
                    dtype_name,
                    f"{n} calls: bshd, 3-D, offsets, inverse, fused q+k",
                    f"{worst:.3f}",
                    f"{100 * same:.2f}%",
                    "ok" if ok else "FAILED",
                ]
            )
        ok, detail = check_errors(lib, rng)
        all_ok &= ok
        rows.append(["errors", lib.name, "float32", detail, "", "", "ok" if ok else "FAILED"])
    return rows, all_ok


def check_features(lib, rng, quick: bool, dtype, dtype_name: str) -> tuple[float, float, int]:
    """Layouts, 3-D input, position offsets, the inverse and fused q+k: GPU against CPU."""
    batch, heads, seq_len, head = (2, 3, 4, 8) if quick else (2, 8, 17, 128)
    x, cos, sin, _ = make_case(rng, (batch, seq_len, heads, head), dtype, n_positions=64)
    k = rng.standard_normal((batch, seq_len, 2, head), dtype=np.float32).astype(dtype)
    offsets = np.array([3, 40])
    calls = [
        ((x, cos, sin), {"layout": "bshd", "position_offset": 5}),
        ((x, cos, sin), {"layout": "bshd", "position_offset": offsets, "inverse": True}),
        (
            (x.reshape(batch, seq_len, heads * head), cos, sin),
            {"num_heads": heads, "position_offset": 7},
        ),
    ]
    worst, same, n = 0.0, 1.0, 0
    for args, kwargs in calls:
        want = numba_rope.rotary_embedding(*args, **kwargs)
        device_kwargs = {
            key: lib.to_device(value) if isinstance(value, np.ndarray) else value
            for key, value in kwargs.items()
        }
        got = numba_rope.rotary_embedding(*(lib.to_device(a) for a in args), **device_kwargs)
        error, equal = compare(lib.to_host(got), want, x, cos, sin, dtype_name)
        worst, same, n = max(worst, error), min(same, equal), n + 1
    want_q, want_k = numba_rope.rotary_embedding_qk(
        x, k, cos, sin, position_offset=2, layout="bshd"
    )
    got_q, got_k = numba_rope.rotary_embedding_qk(
        lib.to_device(x),
        lib.to_device(k),
        lib.to_device(cos),
        lib.to_device(sin),
        position_offset=2,
        layout="bshd",
    )
    for got, want in ((got_q, want_q), (got_k, want_k)):
        error, equal = compare(lib.to_host(got), want, x, cos, sin, dtype_name)
        worst, same, n = max(worst, error), min(same, equal), n + 1
    return worst, same, n


def check_errors(lib, rng) -> tuple[bool, str]:
    """IndexError before writing, NaN rows when skipped, TypeError for a host/GPU mix."""
    x, cos, sin, ids = make_case(rng, (2, 2, 3, 8), np.float32, n_positions=4)
    ids[1, 2] = 4
    dx, dcos, dsin, dids = (lib.to_device(a) for a in (x, cos, sin, ids))
    failures = []
    try:
        numba_rope.rotary_embedding(dx, dcos, dsin, dids, out=dx)
        failures.append("no IndexError")
    except IndexError as error:
        if "position_ids[1, 2] = 4" not in str(error):
            failures.append(f"message {error}")
    if not np.array_equal(lib.to_host(dx), x):
        failures.append("out written before the IndexError")
    got = lib.to_host(numba_rope.rotary_embedding(dx, dcos, dsin, dids, check_position_ids=False))
    if not (np.isnan(got[1, :, 2]).all() and not np.isnan(got[0]).any()):
        failures.append("bad rows not NaN")
    try:
        numba_rope.rotary_embedding(dx, cos, dsin, dids)
        failures.append("no TypeError for a host cache")
    except TypeError as error:
        if "cos_cache is a NumPy array on the host" not in str(error):
            failures.append(f"message {error}")
    detail = "IndexError, NaN rows (check skipped), host/GPU mix"
    return not failures, detail if not failures else "; ".join(failures)


# -- 2. bandwidth ------------------------------------------------------------------------------


def gpu_milliseconds(call: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median over ``repeats`` runs, each timed with a pair of CUDA events on the default
    stream (wall clock in the simulator, where events do not time)."""
    for _ in range(warmup):
        call()
    cuda.synchronize()
    times = []
    for _ in range(repeats):
        if SIMULATOR:
            start_s = time.perf_counter()
            call()
            times.append((time.perf_counter() - start_s) * 1e3)
            continue
        start, end = cuda.event(), cuda.event()
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def torch_eager_rope(torch, x, cos_cache, sin_cache, position_ids, rotary_dim):
    """The usual eager RoPE (Hugging Face style, rotate_half, non-interleaved)."""
    cos = cos_cache[position_ids].unsqueeze(1)  # [b, 1, s, half]
    sin = sin_cache[position_ids].unsqueeze(1)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotate_half = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1)
    return torch.cat((rotated * cos + rotate_half * sin, passed), dim=-1)


def bandwidth(quick: bool, rng, repeats: int) -> list[list[str]]:
    if quick:
        cases = [("prefill", (1, 2, 4, 8), None), ("decode", (4, 2, 1, 8), 16)]
        dtypes = ["float32", "bfloat16"]
    else:
        cases = [
            ("prefill", (8, 32, 4096, 128), None),
            ("prefill", (1, 32, 32768, 128), None),
            ("decode", (256, 32, 1, 128), 4096),
        ]
        dtypes = ["float32", "float16", "bfloat16"]
    torch = None
    if not SIMULATOR and _installed("torch"):
        import torch as torch_module

        torch = torch_module if torch_module.cuda.is_available() else None
    torch_lib = TorchArrays() if torch is not None else None
    rows = []
    for kind, shape, n_positions in cases:
        batch, _, seq_len, _ = shape
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            if kind == "prefill":
                ids = np.broadcast_to(np.arange(seq_len, dtype=np.int64), (batch, seq_len)).copy()
                x, cos, sin, ids = make_case(rng, shape, dtype, n_positions=seq_len, ids=ids)
            else:
                x, cos, sin, ids = make_case(rng, shape, dtype, n_positions=n_positions)
            dx, dcos, dsin, dids = (cuda.to_device(a) for a in (x, cos, sin, ids))
            dout = cuda.device_array_like(dx)
            rows_read = len(np.unique(ids))
            moved = 2 * x.nbytes + ids.nbytes + 2 * rows_read * cos.shape[1] * cos.itemsize

            def rope(dx=dx, dcos=dcos, dsin=dsin, dids=dids, dout=dout):
                numba_rope.rotary_embedding(
                    dx, dcos, dsin, dids, out=dout, check_position_ids=False
                )

            def rope_checked(dx=dx, dcos=dcos, dsin=dsin, dids=dids, dout=dout):
                numba_rope.rotary_embedding(dx, dcos, dsin, dids, out=dout)

            bits = np.dtype(f"u{x.itemsize}")  # a plain copy of the bytes, whatever the dtype
            source, destination = dx.view(bits), dout.view(bits)

            def copy(source=source, destination=destination):
                destination.copy_to_device(source)

            rope_ms = gpu_milliseconds(rope, repeats)
            checked_ms = gpu_milliseconds(rope_checked, repeats)
            copy_ms = gpu_milliseconds(copy, repeats)
            rope_gbs, copy_gbs = moved / rope_ms / 1e6, 2 * x.nbytes / copy_ms / 1e6
            torch_text, speedup = "n/a", "n/a"
            if torch is not None and torch_lib is not None:
                tx, tcos, tsin, tids = (torch_lib.to_device(a) for a in (x, cos, sin, ids))
                torch_ms = gpu_milliseconds(
                    lambda tx=tx, tcos=tcos, tsin=tsin, tids=tids, dim=shape[3]: torch_eager_rope(
                        torch, tx, tcos, tsin, tids, dim
                    ),
                    repeats,
                )
                torch_text, speedup = f"{torch_ms * 1e3:.1f}", f"{torch_ms / rope_ms:.2f}x"
                del tx, tcos, tsin, tids
            fraction = rope_gbs / copy_gbs
            meets = (
                "" if kind == "decode" else ("yes" if fraction >= TARGET_COPY_FRACTION else "NO")
            )
            rows.append(
                [
                    kind,
                    str(shape),
                    dtype_name,
                    f"{rope_ms * 1e3:.1f}",
                    f"{checked_ms * 1e3:.1f}",
                    f"{rope_gbs:.0f}",
                    f"{copy_gbs:.0f}",
                    f"{100 * fraction:.0f}%",
                    meets,
                    torch_text,
                    speedup,
                ]
            )
            del dx, dcos, dsin, dids, dout, x, cos, sin, ids
            gc.collect()
    return rows


# -- 3. host cost ---------------------------------------------------------------------------------


def _host_cost_calls(dx, dcos, dsin, dids, dcos3, dsin3, dout) -> dict[str, Callable[[], object]]:
    rope = numba_rope.rotary_embedding
    return {
        "position ids, checked (1 sync)": lambda: rope(dx, dcos, dsin, dids, out=dout),
        "position ids, unchecked": lambda: rope(
            dx, dcos, dsin, dids, out=dout, check_position_ids=False
        ),
        "no position ids": lambda: rope(dx, dcos3, dsin3, out=dout),
        "no position ids, new result": lambda: rope(dx, dcos3, dsin3),
    }


def host_cost(quick: bool, rng) -> list[list[str]]:
    calls = 3 if quick else 3000
    shape = (1, 1, 4, 64)
    rows = []
    for lib in libraries():
        x, cos, sin, ids = make_case(rng, shape, np.float32)
        _, cos3, sin3, _ = make_case(rng, shape, np.float32, with_ids=False)
        dx, dcos, dsin, dids, dcos3, dsin3 = (
            lib.to_device(a) for a in (x, cos, sin, ids, cos3, sin3)
        )
        dout = lib.to_device(x)
        variants = _host_cost_calls(dx, dcos, dsin, dids, dcos3, dsin3, dout)
        for name, call in variants.items():
            call()
            cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            elapsed_us = (time.perf_counter() - start) / calls * 1e6
            cuda.synchronize()
            meets = "yes" if elapsed_us < TARGET_HOST_US else "NO"
            rows.append([lib.name, name, f"{elapsed_us:.1f}", meets])
    return rows


# -- report -------------------------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def describe_machine() -> str:
    import numba

    parts = [f"numba_rope {numba_rope.__version__}", f"numba {numba.__version__}"]
    for name in ("numba_cuda", "cupy", "torch"):
        if _installed(name):
            module = __import__(name)
            parts.append(f"{name} {getattr(module, '__version__', '?')}")
    if SIMULATOR:
        device = "CUDA simulator (timings are meaningless)"
    else:
        device = cuda.get_current_device().name
        device = device.decode() if isinstance(device, bytes) else str(device)
    return f"Device: {device}. " + ", ".join(parts) + "."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (simulator smoke test)")
    parser.add_argument("--out", type=Path, help="also write the markdown tables here")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement")
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 50)
    if SIMULATOR:  # one Python thread per simulated CUDA thread: keep blocks small
        from numba_rope import config

        config.CUDA_THREADS_PER_BLOCK = 16
    rng = np.random.default_rng(2026)
    began = time.perf_counter()

    correctness_rows, ok = check_correctness(args.quick, rng)
    sections = [
        describe_machine(),
        "### Correctness against the CPU\n\n"
        "Worst |GPU - CPU| over all variants, in units of eps(dtype) x max|x| x max(|cos|+|sin|); "
        "1 is one unit in the last place at the scale of the data.\n\n"
        + table(
            ["check", "arrays", "dtype", "variants", "worst error", "bitwise equal", "result"],
            correctness_rows,
        ),
        "### Bandwidth\n\n"
        "Median of CUDA-event timings after warm-up. GB/s counts bytes read + written "
        "(input, output, ids, cache rows used); the copy moves the input's bytes device to "
        "device. 'checked' includes the position-id check and its read-back.\n\n"
        + table(
            [
                "case",
                "shape",
                "dtype",
                "rope us",
                "rope us (checked)",
                "rope GB/s",
                "copy GB/s",
                "of copy",
                f">= {TARGET_COPY_FRACTION:.0%}",
                "torch eager us",
                "speedup vs torch",
            ],
            bandwidth(args.quick, rng, repeats),
        ),
        "### Host cost per call (tiny input (1, 1, 4, 64), float32)\n\n"
        + table(
            ["arrays", "call", "us per call", f"< {TARGET_HOST_US:.0f} us"],
            host_cost(args.quick, rng),
        ),
        f"Total time of this check: {time.perf_counter() - began:.0f} s.",
    ]
    report = "\n\n".join(sections) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
