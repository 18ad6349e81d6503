"""Benchmarks: the workload table, the data, the peers, verification and timing.

Both ``python -m numba_rope bench`` and the asv suite (``asv_bench/``) read the
workloads from :data:`WORKLOADS`, so the two cannot drift apart.

What is measured, and how:

* Every implementation's output is checked against :func:`numba_rope.reference.rotary_embedding`
  (float64, rounded once) before it is timed; one that disagrees is reported as
  ``FAILED`` and not timed. The copies are checked to reproduce the input bit for bit.
* Times are medians (and 95th percentiles) of ``perf_counter`` samples after warm-up.
  Small workloads (``batched``) time batches of calls and report the per-call time of
  each batch, so the timer's resolution and overhead do not dominate; with
  ``single_calls`` every sample is one call, and the 95th percentile is then the
  latency of a single call (issue 5's decode target).
* With ``busy``, another process spins on one core while everything is timed (see
  :func:`busy_loop`): small calls must not stall when the machine's other cores are
  taken.
* Bytes that RoPE must move: the input read, the output written, and each distinct
  cache row read once (cos and sin). GB/s is those bytes over the median time.
* The floor is a copy of the input into a preallocated array of the same shape: a
  ``parallel=True`` numba loop with numba_rope's thread count, and ``np.copyto`` on one
  thread; the faster of the two is the floor, and ``ratio`` is an implementation's
  median over the floor's median (1.0 = as fast as copying the input).

Nothing here imports ``numba.cuda``, CuPy or torch unless it is asked for: the CUDA
target on ``device="cuda"``, torch when its peer is prepared.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import ml_dtypes
import numba
import numpy as np
from numba import njit, prange

import numba_rope
from numba_rope import reference

# --------------------------------------------------------------------------- workloads

#: Seed of every random array of the benchmarks.
SEED = 20261129

#: Base of the rotary frequencies (Llama, GPT-NeoX): ``inv_freq[i] = BASE ** (-2i / rotary_dim)``.
ROPE_BASE = 10000.0

#: The specification's example position ids (input (2, 8, 4, 512), caches (100, 256)).
SEED_POSITION_IDS = ((6, 2, 1, 7), (2, 8, 3, 6))

DTYPES = ("float32", "float16", "bfloat16")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Workload:
    """One benchmark shape.

    ``position_ids`` says how ids are made: ``"seed"`` (the specification's), ``"arange"``
    (positions ``0..seq_len-1`` of every sequence), ``"random"`` (uniform in
    ``[0, cache_rows)``) or ``"none"`` (no ids: caches of shape ``[batch, seq_len,
    rotary_dim/2]``, sequence positions ``0..seq_len-1``).
    """

    name: str
    shape: tuple[int, int, int, int]  # [batch, num_heads, seq_len, head_size]
    position_ids: str
    cache_rows: int | None  # rows of the 2-D caches indexed by position ids
    rotary_dim: int = 0  # 0: the whole head
    interleaved: bool = False
    batched: bool = False  # small calls: time batches of calls
    description: str = ""

    @property
    def half(self) -> int:
        return (self.rotary_dim or self.shape[3]) // 2

    @property
    def cache_shape(self) -> tuple[int, ...]:
        batch, _, seq_len, _ = self.shape
        if self.cache_rows is None:
            return (batch, seq_len, self.half)
        return (self.cache_rows, self.half)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "seed",
            (2, 8, 4, 512),
            "seed",
            100,
            batched=True,
            description="the specification's example",
        ),
        Workload(
            "prefill",
            (1, 32, 4096, 128),
            "arange",
            8192,
            description="one 4096-token prompt, position ids arange(4096)",
        ),
        Workload(
            "batch_prefill",
            (8, 32, 1024, 128),
            "none",
            None,
            description="eight 1024-token prompts, per-token caches, no position ids",
        ),
        Workload(
            "decode",
            (64, 32, 1, 128),
            "random",
            8192,
            batched=True,
            description="one new token for each of 64 sequences, random positions",
        ),
        Workload(
            "partial",
            (4, 16, 2048, 128),
            "arange",
            8192,
            rotary_dim=64,
            interleaved=True,
            description="rotary_dim 64 of 128, interleaved pairs, position ids",
        ),
    )
}


def workload_table() -> str:
    """The workloads as a text table (for ``--help`` and the README)."""
    lines = [
        f"{'name':<14} {'input':<20} {'caches':<16} {'position ids':<13} {'rotary dim':<11} interleaved"
    ]
    for w in WORKLOADS.values():
        ids = "none" if w.position_ids == "none" else w.position_ids
        lines.append(
            f"{w.name:<14} {w.shape!s:<20} {w.cache_shape!s:<16} {ids:<13} "
            f"{w.rotary_dim or w.shape[3]:<11} {w.interleaved}"
        )
    return "\n".join(lines)


def as_dtype(dtype: Any) -> np.dtype:
    """``"bfloat16"`` -> ``ml_dtypes.bfloat16``; any other name or dtype as NumPy reads it."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def rope_caches(positions: np.ndarray, rotary_dim: int, dtype: Any = np.float32):
    """cos and sin caches of real angles: ``position * ROPE_BASE ** (-2i / rotary_dim)``.

    ``positions`` of shape ``S`` give caches of shape ``S + (rotary_dim // 2,)``.
    """
    inverse_frequency = ROPE_BASE ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angles = np.asarray(positions, dtype=np.float64)[..., np.newaxis] * inverse_frequency
    dtype = as_dtype(dtype)
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


@dataclass
class Case:
    """The arrays of one workload in one dtype, on the host."""

    workload: Workload
    dtype: np.dtype
    input: np.ndarray
    cos_cache: np.ndarray
    sin_cache: np.ndarray
    position_ids: np.ndarray | None

    @property
    def options(self) -> dict[str, Any]:
        return {
            "interleaved": self.workload.interleaved,
            "rotary_embedding_dim": self.workload.rotary_dim,
        }

    @property
    def distinct_cache_rows(self) -> int:
        if self.position_ids is None:
            return self.workload.shape[0] * self.workload.shape[2]
        return int(np.unique(self.position_ids).size)

    @property
    def rope_bytes(self) -> int:
        """Bytes RoPE must move: input read, output written, distinct cos and sin rows read."""
        row_bytes = 2 * self.workload.half * self.cos_cache.dtype.itemsize
        return 2 * self.input.nbytes + self.distinct_cache_rows * row_bytes

    @property
    def copy_bytes(self) -> int:
        """Bytes a copy of the input moves: read once, written once."""
        return 2 * self.input.nbytes


def make_case(workload: Workload | str, dtype: Any, seed: int = SEED) -> Case:
    """Build a workload's input, caches and position ids from a fixed seed."""
    if isinstance(workload, str):
        workload = WORKLOADS[workload]
    dtype = as_dtype(dtype)
    rng = np.random.default_rng(seed)
    batch, _, seq_len, _ = workload.shape
    x = rng.standard_normal(workload.shape, dtype=np.float32).astype(dtype)
    rotary_dim = 2 * workload.half
    ids: np.ndarray | None
    if workload.position_ids == "none":
        ids = None
        positions = np.broadcast_to(np.arange(seq_len), (batch, seq_len))
    else:
        assert workload.cache_rows is not None
        positions = np.arange(workload.cache_rows)
        if workload.position_ids == "seed":
            ids = np.array(SEED_POSITION_IDS, dtype=np.int64)
        elif workload.position_ids == "arange":
            ids = np.ascontiguousarray(
                np.broadcast_to(np.arange(seq_len, dtype=np.int64), (batch, seq_len))
            )
        elif workload.position_ids == "random":
            ids = rng.integers(0, workload.cache_rows, size=(batch, seq_len), dtype=np.int64)
        else:
            raise ValueError(f"unknown position_ids kind {workload.position_ids!r}")
    cos, sin = rope_caches(positions, rotary_dim, dtype)
    return Case(workload, dtype, x, cos, sin, ids)


# ------------------------------------------------------------------------ the copy floor


@njit(parallel=True, cache=True)
def _copy_parallel(source, destination):
    # One flat loop: numba gives each thread one contiguous block of it.
    for i in prange(source.shape[0]):
        destination[i] = source[i]


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def parallel_copy(source: np.ndarray, destination: np.ndarray) -> None:
    """Copy C-contiguous ``source`` into ``destination`` on numba's threads.

    Both are viewed as flat unsigned integers of their item size (numba has no
    float16 or bfloat16 type), so every dtype copies the same way.
    """
    unsigned = _UNSIGNED[source.dtype.itemsize]
    _copy_parallel(source.reshape(-1).view(unsigned), destination.reshape(-1).view(unsigned))


# ----------------------------------------------------------------------- the peers


def spec_formula_numpy(x, cos_cache, sin_cache, position_ids=None, interleaved=False, rotary_dim=0):
    """The specification's NumPy algorithm (complex numbers), in complex64.

    Our own words for the reference printed with the operator: pairs become complex
    numbers ``x1 + i*x2`` multiplied by ``cos + i*sin``. Computed in float32/complex64
    (16-bit inputs are widened first, as NumPy has no complex32) and cast back to the
    input dtype, so it is the fair "plain NumPy" peer of a float32 kernel.
    """
    dtype = x.dtype
    x = x.astype(np.float32, copy=False)
    rotary_dim = rotary_dim or x.shape[3]
    x_rotate, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    cache = cos_cache.astype(np.float32, copy=False) + 1j * sin_cache.astype(np.float32, copy=False)
    if position_ids is not None:
        cache = cache[position_ids]  # [batch, seq_len, rotary_dim/2]
    cache = cache[:, np.newaxis]  # broadcast over heads
    if interleaved:
        x1, x2 = x_rotate[..., 0::2], x_rotate[..., 1::2]
    else:
        x1, x2 = x_rotate[..., : rotary_dim // 2], x_rotate[..., rotary_dim // 2 :]
    rotated = (x1 + 1j * x2) * cache
    if interleaved:
        parts = np.stack((rotated.real, rotated.imag), axis=-1).reshape(x_rotate.shape)
    else:
        parts = np.concatenate((rotated.real, rotated.imag), axis=-1)
    return np.concatenate((parts, x_pass), axis=-1).astype(dtype, copy=False)


def torch_rope(torch: Any, x, cos_cache, sin_cache, position_ids, interleaved, rotary_dim):
    """RoPE in torch eager ops, same formula, computed in the input's dtype."""
    rotary_dim = rotary_dim or x.shape[3]
    if position_ids is not None:
        cos_cache, sin_cache = cos_cache[position_ids], sin_cache[position_ids]
    cos, sin = cos_cache.unsqueeze(1), sin_cache.unsqueeze(1)
    x_rotate, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        x1, x2 = x_rotate[..., 0::2], x_rotate[..., 1::2]
    else:
        x1, x2 = x_rotate.chunk(2, dim=-1)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    if interleaved:
        rotated = torch.stack((y1, y2), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((y1, y2), dim=-1)
    if rotary_dim == x.shape[3]:
        return rotated
    return torch.cat((rotated, x_pass), dim=-1)


ONNX_ELEMENT_TYPES = {"float32": 1, "float16": 10, "bfloat16": 16}  # onnx.TensorProto


def onnx_rotary_model(dtype: Any, with_ids: bool, interleaved: bool, rotary_dim: int):
    """A one-node opset-23 ONNX model: ``RotaryEmbedding`` of a 4-D input."""
    from onnx import TensorProto, helper

    element = ONNX_ELEMENT_TYPES[as_dtype(dtype).name]
    names = ["input", "cos_cache", "sin_cache"] + (["position_ids"] if with_ids else [])
    inputs = [helper.make_tensor_value_info(name, element, None) for name in names[:3]]
    if with_ids:
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, None))
    node = helper.make_node(
        "RotaryEmbedding",
        names,
        ["output"],
        interleaved=int(interleaved),
        rotary_embedding_dim=rotary_dim,
    )
    graph = helper.make_graph(
        [node], "rope", inputs, [helper.make_tensor_value_info("output", element, None)]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


# ------------------------------------------------------------------------- targets


class Unavailable(Exception):
    """An implementation or device that cannot run here; the message says why.

    ``everywhere`` marks reasons that hold for every case (a package not installed).
    """

    def __init__(self, reason: str, everywhere: bool = False):
        super().__init__(reason)
        self.everywhere = everywhere


class CpuTarget:
    """NumPy arrays on the host."""

    name = "cpu"

    def put(self, array):
        return array

    def empty_like(self, array):
        return np.empty(array.shape, dtype=array.dtype)

    def to_host(self, array) -> np.ndarray:
        return np.asarray(array)

    def synchronize(self) -> None:
        pass

    def copy(self, source, destination) -> None:
        parallel_copy(source, destination)


class CudaTarget:
    """numba-cuda device arrays; every timed call ends with ``cuda.synchronize()``."""

    name = "cuda"

    def __init__(self):
        if numba.config.ENABLE_CUDASIM:
            raise Unavailable(
                "NUMBA_ENABLE_CUDASIM=1: the CUDA simulator runs on the CPU, its times mean "
                "nothing; unset it to benchmark a GPU",
                everywhere=True,
            )
        if importlib.util.find_spec("numba.cuda") is None:  # pragma: no cover
            raise Unavailable("numba-cuda is not installed", everywhere=True)
        from numba import cuda

        if not cuda.is_available():
            raise Unavailable("no CUDA GPU: numba.cuda.is_available() is False", everywhere=True)
        self.cuda = cuda

    def put(self, array):
        if array is None:
            return None
        try:
            return self.cuda.to_device(np.ascontiguousarray(array))
        except Exception as error:  # e.g. a dtype numba-cuda cannot hold
            raise Unavailable(
                f"numba-cuda cannot copy a {array.dtype.name} array to the GPU: {error}"
            ) from None

    def empty_like(self, array):
        return self.cuda.device_array(array.shape, dtype=array.dtype)

    def to_host(self, array) -> np.ndarray:
        return array.copy_to_host()

    def synchronize(self) -> None:
        self.cuda.synchronize()

    def copy(self, source, destination) -> None:
        destination.copy_to_device(source)  # device to device


def target(device: str) -> CpuTarget | CudaTarget:
    """The arrays and synchronisation of a device; ``Unavailable`` if it is absent."""
    if device == "cpu":
        return CpuTarget()
    if device == "cuda":
        return CudaTarget()
    raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")


# ------------------------------------------------------------------- implementations


@dataclass
class Prepared:
    """A ready-to-time call and a way to read its last output on the host."""

    call: Callable[[], object]
    output: Callable[[], np.ndarray]


@dataclass(frozen=True)
class Implementation:
    """A benchmarked implementation: ``kind`` "copy" copies the input, "rope" rotates it."""

    name: str
    kind: str
    prepare: Callable[[Case, Any, int], Prepared]  # (case, target, threads); may raise Unavailable


def _numba_copy(case: Case, tgt: Any, threads: int) -> Prepared:
    x = tgt.put(case.input)
    out = tgt.empty_like(x)

    def call():
        tgt.copy(x, out)
        tgt.synchronize()

    return Prepared(call, lambda: tgt.to_host(out))


def _numpy_copyto(case: Case, tgt: Any, threads: int) -> Prepared:
    if tgt.name != "cpu":
        raise Unavailable("host only", everywhere=True)
    x, out = case.input, np.empty_like(case.input)
    return Prepared(lambda: np.copyto(out, x), lambda: out)


def _device_arguments(case: Case, tgt: Any):
    return (
        tgt.put(case.input),
        tgt.put(case.cos_cache),
        tgt.put(case.sin_cache),
        tgt.put(case.position_ids),
    )


def _numba_rope_out(case: Case, tgt: Any, threads: int) -> Prepared:
    x, cos, sin, ids = _device_arguments(case, tgt)
    out = tgt.empty_like(x)
    options = case.options

    def call():
        numba_rope.rotary_embedding(x, cos, sin, ids, out=out, **options)
        tgt.synchronize()

    _first_call(call, tgt)
    return Prepared(call, lambda: tgt.to_host(out))


def _numba_rope_alloc(case: Case, tgt: Any, threads: int) -> Prepared:
    x, cos, sin, ids = _device_arguments(case, tgt)
    options = case.options
    last: list[Any] = [None]

    def call():
        last[0] = numba_rope.rotary_embedding(x, cos, sin, ids, **options)
        tgt.synchronize()

    _first_call(call, tgt)
    return Prepared(call, lambda: tgt.to_host(last[0]))


def _first_call(call: Callable[[], object], tgt: Any) -> None:
    """Run once (compiling); a device the library does not accept yet is n/a, not FAILED."""
    try:
        call()
    except TypeError as error:
        if tgt.name == "cpu":
            raise
        raise Unavailable(f"numba_rope does not accept {tgt.name} arrays: {error}") from None


def _numpy_spec(case: Case, tgt: Any, threads: int) -> Prepared:
    if tgt.name != "cpu":
        raise Unavailable("host only", everywhere=True)
    last: list[Any] = [None]
    w = case.workload

    def call():
        last[0] = spec_formula_numpy(
            case.input,
            case.cos_cache,
            case.sin_cache,
            case.position_ids,
            w.interleaved,
            w.rotary_dim,
        )

    return Prepared(call, lambda: last[0])


def _onnxruntime(case: Case, tgt: Any, threads: int) -> Prepared:
    if tgt.name != "cpu":
        raise Unavailable("CPU execution provider only", everywhere=True)
    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None:
        raise Unavailable("onnxruntime or onnx is not installed", everywhere=True)
    if case.dtype.name not in ("float32", "float16"):
        raise Unavailable(f"onnxruntime has no CPU {case.dtype.name} RotaryEmbedding kernel")
    seq_len = case.workload.shape[2]
    if case.position_ids is not None and case.cos_cache.shape[0] < seq_len:
        raise Unavailable("onnxruntime rejects caches with fewer rows than seq_len")
    import onnxruntime as ort

    w = case.workload
    model = onnx_rotary_model(
        case.dtype, case.position_ids is not None, w.interleaved, w.rotary_dim
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    out = np.empty_like(case.input)
    binding = session.io_binding()
    binding.bind_cpu_input("input", case.input)
    binding.bind_cpu_input("cos_cache", case.cos_cache)
    binding.bind_cpu_input("sin_cache", case.sin_cache)
    if case.position_ids is not None:
        binding.bind_cpu_input("position_ids", case.position_ids)
    binding.bind_output("output", "cpu", 0, case.dtype, out.shape, out.ctypes.data)
    return Prepared(lambda: session.run_with_iobinding(binding), lambda: out)


def _torch_tensor(torch: Any, array: np.ndarray | None, device: str):
    if array is None:
        return None
    if array.dtype == np.dtype(ml_dtypes.bfloat16):
        tensor = torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.to(device)


def _torch_to_numpy(torch: Any, tensor: Any) -> np.ndarray:
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _no_synchronization() -> None:
    pass


def _torch(case: Case, tgt: Any, threads: int) -> Prepared:
    if importlib.util.find_spec("torch") is None:
        raise Unavailable("torch is not installed", everywhere=True)
    import torch

    synchronize: Callable[[], object] = _no_synchronization
    if tgt.name == "cpu":
        torch.set_num_threads(threads)
    else:
        if not torch.cuda.is_available():
            raise Unavailable("torch has no CUDA device", everywhere=True)
        synchronize = torch.cuda.synchronize
    device = tgt.name
    x, cos, sin, ids = (
        _torch_tensor(torch, a, device)
        for a in (case.input, case.cos_cache, case.sin_cache, case.position_ids)
    )
    w = case.workload
    last: list[Any] = [None]

    def call():
        with torch.inference_mode():
            last[0] = torch_rope(torch, x, cos, sin, ids, w.interleaved, w.rotary_dim)
        synchronize()

    return Prepared(call, lambda: _torch_to_numpy(torch, last[0]))


def implementations(device: str, threads: int) -> list[Implementation]:
    """What ``bench`` times on a device, floors first."""
    copy_name = f"copy (numba, {threads} threads)" if device == "cpu" else "copy (device to device)"
    found = [Implementation(copy_name, "copy", _numba_copy)]
    if device == "cpu":
        found.append(Implementation("np.copyto (1 thread)", "copy", _numpy_copyto))
    found += [
        Implementation("numba_rope", "rope", _numba_rope_out),
        Implementation("numba_rope (allocating)", "rope", _numba_rope_alloc),
    ]
    if device == "cpu":
        found += [
            Implementation("numpy (spec formula, complex64)", "rope", _numpy_spec),
            Implementation("onnxruntime", "rope", _onnxruntime),
        ]
    found.append(Implementation("torch eager", "rope", _torch))
    return found


# ---------------------------------------------------------------------- verification

#: Unit in the last place at 1.0 of each format.
EPSILON = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7, "float64": 2.0**-52}

#: Allowed error, in units of ``EPSILON * max|x| * max(|cos| + |sin|)``: the formula's
#: rounding error scales with its terms, not with a (possibly cancelling) result.
TOLERANCE_EPS = 4.0


def check_output(case: Case, kind: str, got: Any, expected: np.ndarray) -> tuple[bool, float, str]:
    """``(ok, error in eps units, reason)`` of an output against what it should be.

    ``kind`` "copy": the input bit for bit. ``kind`` "rope": the float64 reference
    within :data:`TOLERANCE_EPS`.
    """
    got = np.asarray(got)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return (
            False,
            math.inf,
            f"got {got.dtype} {got.shape}, want {expected.dtype} {expected.shape}",
        )
    if kind == "copy":
        unsigned = _UNSIGNED[got.dtype.itemsize]
        same = np.array_equal(got.view(unsigned), expected.view(unsigned))
        return same, 0.0 if same else math.inf, "" if same else "not a bitwise copy"
    eps = EPSILON[case.dtype.name]
    x_scale = float(np.abs(case.input.astype(np.float32)).max(initial=0.0))
    cache_scale = float(
        (np.abs(case.cos_cache.astype(np.float32)) + np.abs(case.sin_cache.astype(np.float32))).max(
            initial=0.0
        )
    )
    scale = max(x_scale * cache_scale, float(np.finfo(np.float32).tiny))
    with np.errstate(invalid="ignore"):
        difference = np.abs(got.astype(np.float32) - expected.astype(np.float32))
        error = float(difference.max(initial=0.0)) / (eps * scale)
    if math.isnan(error):
        return False, math.nan, "NaN in the output"
    ok = error <= TOLERANCE_EPS
    return ok, error, "" if ok else f"max error {error:.3g} eps > {TOLERANCE_EPS:g}"


# ---------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Timing:
    median: float  # seconds per call
    p95: float
    samples: int
    calls_per_sample: int


def time_calls(
    call: Callable[[], object],
    repeats: int,
    *,
    batch_seconds: float = 0.0,
    warmup: int = 2,
    budget_seconds: float = math.inf,
) -> Timing:
    """Per-call median and 95th percentile of ``repeats`` samples after ``warmup`` calls.

    With ``batch_seconds`` > 0 a sample is a batch of calls lasting about that long
    (per-call time = batch time / calls). Sampling stops early, after at least three
    samples, once ``budget_seconds`` have passed.
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
        start = time.perf_counter()
        for _ in range(number):
            call()
        samples.append((time.perf_counter() - start) / number)
        if len(samples) >= 3 and time.perf_counter() - began > budget_seconds:
            break
    values = np.array(samples)
    return Timing(float(np.median(values)), float(np.percentile(values, 95)), len(samples), number)


#: Length of one timed batch of calls on ``batched`` workloads, in seconds.
BATCH_SECONDS = 5e-4


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


# ------------------------------------------------------------------------- the bench


@dataclass
class Result:
    workload: str
    dtype: str
    device: str
    implementation: str
    status: str  # "ok", "FAILED" or "n/a"
    reason: str = ""
    median_s: float | None = None
    p95_s: float | None = None
    samples: int = 0
    calls_per_sample: int = 0
    bytes: int = 0
    gb_per_s: float | None = None
    ratio_to_copy: float | None = None
    error_eps: float | None = None


@dataclass
class Settings:
    device: str = "cpu"
    dtypes: Sequence[str] = DTYPES
    workloads: Sequence[str] = tuple(WORKLOADS)
    threads: int = 0  # 0: numba's current number of threads
    repeats: int = 30
    warmup: int = 2
    batch_seconds: float = BATCH_SECONDS
    budget_seconds: float = 5.0
    single_calls: bool = False  # every sample one call, also on the batched workloads
    busy: bool = False  # a process spins on one core while timing (busy_loop)

    @classmethod
    def quick(cls, **changes: Any) -> Settings:
        """Tiny repeats for smoke tests: numbers are not meaningful."""
        settings = cls(repeats=3, warmup=1, batch_seconds=1e-4, budget_seconds=0.2)
        for name, value in changes.items():
            setattr(settings, name, value)
        return settings


@dataclass
class Report:
    settings: dict[str, Any]
    environment: dict[str, Any]
    results: list[Result] = field(default_factory=list)
    not_installed: dict[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.status == "FAILED"]

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "environment": self.environment,
            "not_installed": self.not_installed,
            "results": [asdict(r) for r in self.results],
        }


def environment(threads: int) -> dict[str, Any]:
    """Versions and machine facts printed above the table and stored in the JSON."""
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel region has run yet
        layer = None
    return {
        "numba_rope": numba_rope.__version__,
        "numba": numba.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "numba_threads": threads,
        "numba_threading_layer": layer,
        # A busy machine stalls parallel regions (a worker waits for a core): keep it in view.
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


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
    tgt = target(settings.device)
    if settings.threads:
        numba.set_num_threads(settings.threads)
    threads = numba.get_num_threads()
    candidates = implementations(settings.device, threads) + list(extra)
    report = Report(
        settings={**asdict(settings), "threads": threads},
        environment=environment(threads),
    )
    show = _progress_printer(progress)
    total = len(settings.workloads) * len(settings.dtypes) * len(candidates)
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
                floor: float | None = None
                for implementation in candidates:
                    step += 1
                    show(f"[{step}/{total}] {workload_name} {dtype_name} {implementation.name}...")
                    result = measure(implementation, case, expected, tgt, threads, settings, report)
                    if result is None:
                        continue
                    if result.median_s is not None:
                        if implementation.kind == "copy":
                            floor = (
                                result.median_s if floor is None else min(floor, result.median_s)
                            )
                        elif floor is not None:
                            result.ratio_to_copy = result.median_s / floor
                    report.results.append(result)
                del case, expected
    show(f"[{total}/{total}] done")
    if progress is not None and progress.isatty():
        progress.write("\n")
    return report


def measure(
    implementation: Implementation,
    case: Case,
    expected: np.ndarray,
    tgt: Any,
    threads: int,
    settings: Settings,
    report: Report | None = None,
) -> Result | None:
    """Prepare, verify and time one implementation on one case.

    Returns None for an implementation that cannot run anywhere here (recorded in
    ``report.not_installed``).
    """
    result = Result(case.workload.name, case.dtype.name, tgt.name, implementation.name, "n/a")
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
    want = case.input if implementation.kind == "copy" else expected
    ok, error_eps, reason = check_output(case, implementation.kind, prepared.output(), want)
    result.error_eps = error_eps
    if not ok:
        result.status, result.reason = "FAILED", reason
        return result
    batched = case.workload.batched and not settings.single_calls
    timing = time_calls(
        prepared.call,
        settings.repeats,
        batch_seconds=settings.batch_seconds if batched else 0.0,
        warmup=settings.warmup,
        budget_seconds=settings.budget_seconds,
    )
    moved = case.copy_bytes if implementation.kind == "copy" else case.rope_bytes
    result.status = "ok"
    result.median_s, result.p95_s = timing.median, timing.p95
    result.samples, result.calls_per_sample = timing.samples, timing.calls_per_sample
    result.bytes = moved
    result.gb_per_s = moved / timing.median / 1e9
    return result


# --------------------------------------------------------------------------- output


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.1f} us"
    if value < 1:
        return f"{value * 1e3:.2f} ms"
    return f"{value:.3f} s"


def _load(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"


def format_table(report: Report) -> str:
    """The results as a text table, one row per (workload, dtype, implementation)."""
    env = report.environment
    sampled = "single calls" if report.settings.get("single_calls") else "samples"
    busy = ", a busy loop on another core" if report.settings.get("busy") else ""
    lines = [
        f"numba_rope {env['numba_rope']} on {report.settings['device']}: numba {env['numba']}, "
        f"numpy {env['numpy']}, {env['numba_threads']} threads "
        f"({env['numba_threading_layer'] or 'no parallel region run'}), "
        f"median of up to {report.settings['repeats']} {sampled}, "
        f"load average {_load(env.get('load_average_1min'))} at the start{busy}",
        "GB/s: input read + output written + distinct cache rows read, over the median; "
        "ratio: median / fastest copy (1.0 = copy speed)",
    ]
    name_width = max([len(r.implementation) for r in report.results] + [14])
    header = (
        f"{'workload':<14} {'dtype':<9} {'implementation':<{name_width}} "
        f"{'median':>10} {'p95':>10} {'GB/s':>7} {'ratio':>6}  check"
    )
    lines += [header, "-" * len(header)]
    previous = None
    for r in report.results:
        if previous is not None and (r.workload, r.dtype) != previous:
            lines.append("")
        previous = (r.workload, r.dtype)
        gbs = "-" if r.gb_per_s is None else f"{r.gb_per_s:.1f}"
        ratio = "-" if r.ratio_to_copy is None else f"{r.ratio_to_copy:.2f}"
        check = {"ok": "ok", "FAILED": "FAILED", "n/a": "n/a"}[r.status]
        if r.reason:
            check += f" ({r.reason})"
        lines.append(
            f"{r.workload:<14} {r.dtype:<9} {r.implementation:<{name_width}} "
            f"{_seconds(r.median_s):>10} {_seconds(r.p95_s):>10} {gbs:>7} {ratio:>6}  {check}"
        )
    for name, why in report.not_installed.items():
        lines.append(f"not run: {name}: {why}")
    return "\n".join(lines)


def write_json(report: Report, path: str) -> None:
    with open(path, "w") as stream:
        json.dump(report.to_json(), stream, indent=2, allow_nan=False, default=_json_default)
        stream.write("\n")


def _json_default(value: Any) -> Any:  # pragma: no cover - every field is a plain type
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def require_matplotlib() -> None:
    """Raise ``ImportError`` with the fix when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'numba_rope[bench]')"
        ) from None


def plot(report: Report, path: str) -> None:
    """Bar chart of GB/s per workload and implementation, one panel per dtype."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in report.results if r.gb_per_s is not None]
    dtypes = [d for d in report.settings["dtypes"] if any(r.dtype == d for r in timed)] or ["-"]
    workloads = [w for w in report.settings["workloads"] if any(r.workload == w for r in timed)]
    names = list(dict.fromkeys(r.implementation for r in timed))
    figure, axes = plt.subplots(
        1, len(dtypes), figsize=(5 * len(dtypes) + 1, 4.5), squeeze=False, sharey=True
    )
    width = 0.8 / max(1, len(names))
    for axis, dtype in zip(axes[0], dtypes, strict=True):
        for k, name in enumerate(names):
            values = [
                next(
                    (
                        r.gb_per_s
                        for r in timed
                        if r.dtype == dtype and r.workload == w and r.implementation == name
                    ),
                    0.0,
                )
                for w in workloads
            ]
            positions = [i + (k - (len(names) - 1) / 2) * width for i in range(len(workloads))]
            axis.bar(positions, values, width, label=name)
        axis.set_xticks(range(len(workloads)), workloads, rotation=20)
        axis.set_title(f"{dtype} on {report.settings['device']}")
        axis.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("GB/s (input + output + cache rows)")
    axes[0][-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.suptitle(f"numba_rope {report.environment['numba_rope']}: RoPE throughput")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
