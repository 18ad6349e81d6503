"""The GPU check behind ``tools/gpu_check.py``: numba_rope on an NVIDIA GPU against the
CPU, its bandwidth next to a copy and torch eager, and its host cost per call.

:func:`run_check` returns the markdown report. Under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) it runs too, on tiny shapes with ``quick``: timings are then
wall-clock and meaningless. ``numba.cuda``, CuPy and torch are imported only when it runs.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

import numba_rope
from numba_rope.bench.checks import compare
from numba_rope.bench.gpu import (
    NumbaArrays,
    TorchArrays,
    cuda,
    gpu_milliseconds,
    installed,
    kernel_milliseconds,
    libraries,
    simulator,
    torch_on_gpu,
)
from numba_rope.bench.peers import torch_rope
from numba_rope.bench.report import markdown_table
from numba_rope.bench.workloads import as_dtype, make_arrays

#: The dtypes checked against the CPU (the bandwidth runs the first three).
CHECK_DTYPES = ("float32", "float16", "bfloat16", "float64")
TARGET_COPY_FRACTION = 0.85
TARGET_HOST_US = 20.0
#: Calls timed back to back between one pair of CUDA events (see ``gpu_milliseconds``).
BATCH = 10

# -- 1. correctness --------------------------------------------------------------------------


def _row(check: str, lib: Any, dtype_name: str, what: str, worst: float, same: float) -> list:
    return [check, lib.name, dtype_name, what, f"{worst:.3f}", f"{100 * same:.2f}%", _ok(same == 1)]


def _raised(error: Exception) -> str:
    """An exception as one table cell."""
    text = f"raised {type(error).__name__}: {error}"
    return text.replace("\n", " ").replace("|", "/")[:400]


def _ok(ok: bool) -> str:
    return "ok" if ok else "FAILED"


def _variants(lib, rng, shape, dtype_name: str) -> tuple[float, float, int]:
    """Every interleaved x rotary_dim x position-id variant of one dtype: GPU against CPU."""
    worst, same, n = 0.0, 1.0, 0
    for interleaved in (False, True):
        for rotary_dim in (0, shape[3] // 2):
            for with_ids in (True, False):
                x, cos, sin, ids = make_arrays(
                    rng, shape, dtype_name, rotary_dim=rotary_dim, position_ids=with_ids
                )
                kwargs: dict[str, Any] = {
                    "interleaved": interleaved,
                    "rotary_embedding_dim": rotary_dim,
                }
                want = numba_rope.rotary_embedding(x, cos, sin, ids, **kwargs)
                got = numba_rope.rotary_embedding(
                    *(lib.to_device(a) for a in (x, cos, sin, ids)), **kwargs
                )
                error, equal = compare(lib.to_host(got), want, x, cos, sin, dtype_name)
                worst, same, n = max(worst, error), min(same, equal), n + 1
    return worst, same, n


def _guarded(check: str, lib, dtype_name: str, what: str, measure, *args) -> tuple[list, bool]:
    """One row of the table: ``measure(*args)``'s worst error, or the exception it raised
    (the rows after it still run)."""
    try:
        worst, same, n = measure(*args)
    except Exception as error:  # the table says what broke, and goes on
        return [check, lib.name, dtype_name, _raised(error), "", "", _ok(False)], False
    return _row(check, lib, dtype_name, what.format(n=n), worst, same), same == 1


def check_correctness(quick: bool, rng) -> tuple[list[list[str]], bool]:
    """Every dtype x interleaved x rotary_dim x position-id variant, the features and the
    errors, through every array library: GPU against CPU, bit for bit."""
    shape = (1, 2, 3, 8) if quick else (2, 8, 33, 128)
    rows, all_ok = [], True
    for lib in libraries():
        for dtype_name in CHECK_DTYPES:
            row, ok = _guarded(
                "correctness",
                lib,
                dtype_name,
                f"{{n}} variants, shape {shape}",
                _variants,
                lib,
                rng,
                shape,
                dtype_name,
            )
            rows.append(row)
            all_ok &= ok
        for dtype_name in ("float32", "bfloat16"):
            row, ok = _guarded(
                "features",
                lib,
                dtype_name,
                "{n} calls: bshd, 3-D, offsets, inverse, fused q+k",
                check_features,
                lib,
                rng,
                quick,
                as_dtype(dtype_name),
                dtype_name,
            )
            rows.append(row)
            all_ok &= ok
        try:
            ok, detail = check_errors(lib, rng)
        except Exception as error:  # as in _guarded
            ok, detail = False, _raised(error)
        all_ok &= ok
        rows.append(["errors", lib.name, "float32", detail, "", "", _ok(ok)])
    return rows, all_ok


def check_features(lib, rng, quick: bool, dtype, dtype_name: str) -> tuple[float, float, int]:
    """Layouts, 3-D input, position offsets, the inverse and fused q+k: GPU against CPU."""
    batch, heads, seq_len, head = (2, 3, 4, 8) if quick else (2, 8, 17, 128)
    x, cos, sin, _ = make_arrays(rng, (batch, seq_len, heads, head), dtype, n_positions=64)
    k = rng.standard_normal((batch, seq_len, 2, head), dtype=np.float32).astype(dtype)
    offsets = np.array([3, 40])
    calls: list[tuple[tuple, dict[str, Any]]] = [
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
    x, cos, sin, ids = make_arrays(rng, (2, 2, 3, 8), np.float32, n_positions=4)
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


def bandwidth(quick: bool, rng, repeats: int) -> list[list[str]]:
    """One row per (case, dtype): numba_rope, unchecked and checked, next to a
    device-to-device copy of the input's bytes and torch eager."""
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
    torch = torch_on_gpu()
    rows = []
    for kind, shape, n_positions in cases:
        for dtype_name in dtypes:
            if kind == "prefill":  # positions 0..seq_len-1, caches of seq_len rows
                arrays = make_arrays(
                    rng, shape, dtype_name, position_ids="arange", n_positions=shape[2]
                )
            else:
                arrays = make_arrays(rng, shape, dtype_name, n_positions=n_positions)
            batch = 1 if quick else BATCH
            rows.append(_bandwidth_row(kind, shape, dtype_name, arrays, repeats, batch, torch))
            del arrays
            gc.collect()
    return rows


def _bandwidth_row(kind, shape, dtype_name, arrays, repeats: int, batch: int, torch) -> list[str]:
    x, cos, _, ids = arrays
    numba_cuda = cuda()
    dx, dcos, dsin, dids = (NumbaArrays().to_device(a) for a in arrays)
    dout = numba_cuda.device_array_like(dx)
    rows_read = len(np.unique(ids))
    moved = 2 * x.nbytes + ids.nbytes + 2 * rows_read * cos.shape[1] * cos.itemsize

    def rope():
        numba_rope.rotary_embedding(dx, dcos, dsin, dids, out=dout, check_position_ids=False)

    def rope_checked():
        numba_rope.rotary_embedding(dx, dcos, dsin, dids, out=dout)

    bits = np.dtype(f"u{x.itemsize}")  # a plain copy of the bytes, whatever the dtype
    source, destination = dx.view(bits), dout.view(bits)

    def copy():
        destination.copy_to_device(source)

    rope_ms = gpu_milliseconds(rope, repeats, batch=batch)
    checked_ms = gpu_milliseconds(rope_checked, repeats, batch=batch)
    copy_ms = gpu_milliseconds(copy, repeats, batch=batch)
    rope_gbs, copy_gbs = moved / rope_ms / 1e6, 2 * x.nbytes / copy_ms / 1e6
    torch_text, speedup = "n/a", "n/a"
    if torch is not None:
        tx, tcos, tsin, tids = (TorchArrays("cuda").to_device(a) for a in arrays)
        torch_ms = gpu_milliseconds(
            lambda: torch_rope(torch, tx, tcos, tsin, tids, False, shape[3]),
            repeats,
            batch=batch,
        )
        torch_text, speedup = f"{torch_ms * 1e3:.1f}", f"{torch_ms / rope_ms:.2f}x"
    kernel_ms, copy_kernel_ms = kernel_milliseconds(rope), kernel_milliseconds(copy)
    kernel_text, kernel_fraction = "n/a", "n/a"
    if kernel_ms and copy_kernel_ms:
        kernel_text = f"{kernel_ms * 1e3:.1f}"
        kernel_fraction = f"{100 * (moved / kernel_ms) / (2 * x.nbytes / copy_kernel_ms):.0f}%"
    fraction = rope_gbs / copy_gbs
    meets = "" if kind == "decode" else ("yes" if fraction >= TARGET_COPY_FRACTION else "NO")
    return [
        kind,
        str(shape),
        dtype_name,
        f"{rope_ms * 1e3:.1f}",
        f"{checked_ms * 1e3:.1f}",
        f"{rope_gbs:.0f}",
        f"{copy_gbs:.0f}",
        f"{100 * fraction:.0f}%",
        meets,
        kernel_text,
        kernel_fraction,
        torch_text,
        speedup,
    ]


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
    """Microseconds of Python per call on a tiny float32 input, per array library."""
    calls = 3 if quick else 3000
    shape = (1, 1, 4, 64)
    numba_cuda = cuda()
    rows = []
    for lib in libraries():
        x, cos, sin, ids = make_arrays(rng, shape, np.float32)
        _, cos3, sin3, _ = make_arrays(rng, shape, np.float32, position_ids=False)
        dx, dcos, dsin, dids, dcos3, dsin3 = (
            lib.to_device(a) for a in (x, cos, sin, ids, cos3, sin3)
        )
        dout = lib.to_device(x)
        variants = _host_cost_calls(dx, dcos, dsin, dids, dcos3, dsin3, dout)
        for name, call in variants.items():
            call()
            numba_cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            elapsed_us = (time.perf_counter() - start) / calls * 1e6
            numba_cuda.synchronize()
            meets = "yes" if elapsed_us < TARGET_HOST_US else "NO"
            rows.append([lib.name, name, f"{elapsed_us:.1f}", meets])
    return rows


# -- report -------------------------------------------------------------------------------------


def describe_machine() -> str:
    import numba

    parts = [f"numba_rope {numba_rope.__version__}", f"numba {numba.__version__}"]
    for name in ("numba_cuda", "cupy", "torch"):
        if installed(name):
            module = __import__(name)
            parts.append(f"{name} {getattr(module, '__version__', '?')}")
    if simulator():
        device = "CUDA simulator (timings are meaningless)"
    else:
        device = cuda().get_current_device().name
        device = device.decode() if isinstance(device, bytes) else str(device)
    return f"Device: {device}. " + ", ".join(parts) + "."


def _section(title: str, build: Callable[[], tuple[str, bool]]) -> tuple[str, bool]:
    """One section of the report; an exception becomes the section's text (its last
    lines of traceback) and a failure, so that the sections after it still run."""
    began = time.perf_counter()
    try:
        body, ok = build()
    except Exception:  # the report says what broke and goes on with the next section
        lines = traceback.format_exc().strip().splitlines()
        body, ok = (
            "ERROR (the check raised):\n\n```text\n" + "\n".join(lines[-12:]) + "\n```",
            False,
        )
    return f"### {title}\n\n{body}\n\n({time.perf_counter() - began:.0f} s)", ok


def run_check(
    quick: bool, repeats: int, seed: int = 2026, emit: Callable[[str], object] | None = None
) -> tuple[str, bool]:
    """The markdown report of the three checks, and whether every correctness check passed
    and no section raised. ``emit`` gets each section as soon as it is done (a long run
    stopped half-way keeps what it measured)."""
    rng = np.random.default_rng(seed)
    began = time.perf_counter()

    def correctness() -> tuple[str, bool]:
        rows, ok = check_correctness(quick, rng)
        header = ["check", "arrays", "dtype", "variants", "worst error", "bitwise equal"]
        return (
            "Worst |GPU - CPU| over all variants, in units of eps(dtype) x max|x| x "
            "max(|cos|+|sin|); 1 is one unit in the last place at the scale of the data. "
            "A row passes when the GPU's result is the CPU's bit for bit.\n\n"
            + markdown_table([*header, "result"], rows),
            ok,
        )

    def bandwidth_section() -> tuple[str, bool]:
        header = ["case", "shape", "dtype", "rope us", "rope us (checked)", "rope GB/s"]
        header += ["copy GB/s", "of copy", f">= {TARGET_COPY_FRACTION:.0%}"]
        header += ["rope kernel us", "kernels: of copy"]
        header += ["torch eager us", "speedup vs torch"]
        return (
            f"Median of CUDA-event timings after warm-up, each over {BATCH} calls back to "
            "back (1 with quick). GB/s counts bytes read + written (input, output, ids, "
            "cache rows used); the copy moves the input's bytes device to device. "
            "'checked' includes the position-id check and its read-back. The kernel "
            "columns are the GPU's own time (CUPTI, through torch's profiler; n/a "
            "without torch), apart from the host's dispatch, which bounds small calls.\n\n"
            + markdown_table(header, bandwidth(quick, rng, repeats)),
            True,
        )

    def host_section() -> tuple[str, bool]:
        header = ["arrays", "call", "us per call", f"< {TARGET_HOST_US:.0f} us"]
        return markdown_table(header, host_cost(quick, rng)), True

    sections, all_ok = [], True
    parts: list[tuple[str, Callable[[], tuple[str, bool]]]] = [
        ("Machine", lambda: (describe_machine(), True)),
        ("Correctness against the CPU", correctness),
        ("Bandwidth", bandwidth_section),
        ("Host cost per call (tiny input (1, 1, 4, 64), float32)", host_section),
    ]
    for title, build in parts:
        text, ok = _section(title, build)
        all_ok &= ok
        sections.append(text)
        if emit is not None:
            emit(text)
    sections.append(f"Total time of this check: {time.perf_counter() - began:.0f} s.")
    return "\n\n".join(sections) + "\n", all_ok
