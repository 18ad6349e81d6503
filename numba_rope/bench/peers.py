"""What ``bench`` times: the copy floors, numba_rope, and its peers (the specification's
NumPy formula, onnxruntime into a bound output and its allocating ``run()``, torch eager),
each prepared for one case on one target.

Also the one opset-23 ONNX model builder (the onnxruntime peer and the conformance
tests) and the torch RoPE (the torch peer and the GPU check). onnx, onnxruntime and
torch are imported only when their peer is prepared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import numba_rope
from numba_rope._aligned import empty_on_line
from numba_rope.bench.gpu import TorchArrays, installed
from numba_rope.bench.report import ONE_THREAD_COPY
from numba_rope.bench.targets import Unavailable
from numba_rope.bench.workloads import Case, as_dtype

# ------------------------------------------------------------------ formulas and models


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


#: onnx.TensorProto element types of the dtypes (numbers, so that onnx is not imported).
ONNX_ELEMENT_TYPES = {"float32": 1, "float16": 10, "bfloat16": 16, "float64": 11}


def onnx_rotary_model(
    dtype: Any, with_ids: bool, interleaved: bool, rotary_dim: int, num_heads: int = 0
):
    """A one-node opset-23 ONNX model: ``RotaryEmbedding`` of ``input``, ``cos_cache``,
    ``sin_cache`` and, ``with_ids``, ``position_ids``, into ``output``."""
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
        num_heads=num_heads,
    )
    graph = helper.make_graph(
        [node], "rope", inputs, [helper.make_tensor_value_info("output", element, None)]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


# ------------------------------------------------------------------- implementations


@dataclass
class Prepared:
    """A ready-to-time call, a way to read its last output on the host, and what to
    run before each timed sample (None: nothing)."""

    call: Callable[[], object]
    output: Callable[[], np.ndarray]
    reset: Callable[[], object] | None = None


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
    x, out = case.input, empty_on_line(case.input.shape, case.input.dtype)
    return Prepared(lambda: np.copyto(out, x), lambda: out)


def _numpy_copy_allocating(case: Case, tgt: Any, threads: int) -> Prepared:
    """``x.copy()``: the issue's yardstick for allocating calls (fresh memory included)."""
    if tgt.name != "cpu":
        raise Unavailable("host only", everywhere=True)
    x = case.input
    last: list[Any] = [None]

    def call():
        last[0] = x.copy()

    return Prepared(call, lambda: last[0])


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


#: Where NumPy's allocator puts a large array: 16 bytes past a 64-byte line (glibc's
#: chunk header before a fresh mapping's first page).
NUMPY_PLACEMENT = 16


def _numba_rope_out_off_line(case: Case, tgt: Any, threads: int) -> Prepared:
    """``out=`` into an output :data:`NUMPY_PLACEMENT` bytes past a 64-byte line, where
    a large ``np.empty_like`` usually lands; the ``numba_rope`` row's output starts on
    a line, as torch's tensors do. Every vector store of a row then spans two lines
    unless the kernel starts its loops on a line: float32 and float16 rows do, yet
    stay 1.1-1.3x slower in large calls (``docs/performance.md``, "Nineteenth
    session")."""
    x, cos, sin, ids = _device_arguments(case, tgt)
    out = empty_on_line(x.shape, x.dtype, offset=NUMPY_PLACEMENT)
    options = case.options

    def call():
        numba_rope.rotary_embedding(x, cos, sin, ids, out=out, **options)

    _first_call(call, tgt)
    return Prepared(call, lambda: out)


def _numba_rope_alloc(case: Case, tgt: Any, threads: int) -> Prepared:
    x, cos, sin, ids = _device_arguments(case, tgt)
    options = case.options
    last: list[Any] = [None]

    def call():
        last[0] = numba_rope.rotary_embedding(x, cos, sin, ids, **options)
        tgt.synchronize()

    _first_call(call, tgt)
    return Prepared(call, lambda: tgt.to_host(last[0]))


def _numba_rope_in_place(case: Case, tgt: Any, threads: int) -> Prepared:
    """Rotated in place (``out=x``: the form of vLLM's op and of flash-attn's
    ``inplace=True``). The first call (compiling) is undone by copying the input back,
    so that the checked output is one rotation of it; the timed calls rotate it further
    by the same angles, as a serving loop rotates each new step's tensor.

    On the host the tensor starts on a 64-byte boundary, as torch's tensors do: where
    ``malloc`` put a copy (16 bytes past a page for a fresh mapping, anywhere on the
    heap once a peer has raised glibc's mapping threshold) changed the partial
    workload's float16 row 2.5x from run to run (see ``docs/performance.md``, "Eighth
    session").

    Before each timed sample the input is copied back (``reset``, untimed): rotated
    again and again by the same rounded angles, whose cos² + sin² is not 1, a tensor
    grows or shrinks geometrically, and after 20,000-60,000 calls of the decode step
    holds infinities, NaNs and subnormals, whose float32 arithmetic took the bfloat16
    decode in a loop of its own from 29 to 515-715 us a call (Emerald Rapids VM, see
    ``docs/performance.md``, "Fourteenth session")."""
    _, cos, sin, ids = _device_arguments(case, tgt)
    x = tgt.put(on_line_boundary(case.input) if tgt.name == "cpu" else case.input.copy())
    source = tgt.put(case.input)
    options = case.options

    def call():
        numba_rope.rotary_embedding(x, cos, sin, ids, out=x, **options)
        tgt.synchronize()

    def reset():
        tgt.restore(source, x)
        tgt.synchronize()

    _first_call(call, tgt)
    reset()
    return Prepared(call, lambda: tgt.to_host(x), reset)


def on_line_boundary(array: np.ndarray, boundary: int = 64) -> np.ndarray:
    """A C-contiguous copy of ``array`` whose data start on a multiple of ``boundary``
    bytes.

    >>> on_line_boundary(np.arange(5.0)).ctypes.data % 64
    0
    """
    copy = empty_on_line(array.shape, array.dtype, boundary)
    np.copyto(copy, array)
    return copy


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
        last[0] = case.from_bhsd(
            spec_formula_numpy(
                case.as_bhsd(case.input),
                case.cos_cache,
                case.sin_cache,
                case.position_ids,
                w.interleaved,
                w.rotary_dim,
            )
        )

    return Prepared(call, lambda: last[0])


def _onnxruntime_session(case: Case, tgt: Any, threads: int) -> tuple[Any, dict[str, Any]]:
    """An onnxruntime CPU session of the case's one-node model, and its inputs by name."""
    if tgt.name != "cpu":
        raise Unavailable("CPU execution provider only", everywhere=True)
    if not installed("onnxruntime") or not installed("onnx"):
        raise Unavailable("onnxruntime or onnx is not installed", everywhere=True)
    if case.dtype.name not in ("float32", "float16"):
        raise Unavailable(f"onnxruntime has no CPU {case.dtype.name} RotaryEmbedding kernel")
    seq_len = case.workload.shape[2]
    if case.position_ids is not None and case.cos_cache.shape[0] < seq_len:
        raise Unavailable("onnxruntime rejects caches with fewer rows than seq_len")
    import onnxruntime as ort

    w = case.workload
    model = onnx_rotary_model(
        case.dtype,
        case.position_ids is not None,
        w.interleaved,
        w.rotary_dim,
        num_heads=w.shape[1] if w.three_d else 0,
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    feeds = {"input": case.input, "cos_cache": case.cos_cache, "sin_cache": case.sin_cache}
    if case.position_ids is not None:
        feeds["position_ids"] = case.position_ids
    return session, feeds


def _onnxruntime(case: Case, tgt: Any, threads: int) -> Prepared:
    """onnxruntime writing into a preallocated output bound with I/O binding. The
    binding holds the output's address only: the call keeps the array alive, so that a
    caller that keeps the call and drops the rest does not have it write into freed
    memory."""
    session, feeds = _onnxruntime_session(case, tgt, threads)
    out = empty_on_line(case.input.shape, case.input.dtype)
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    binding.bind_output("output", "cpu", 0, case.dtype, out.shape, out.ctypes.data)

    def call():
        session.run_with_iobinding(binding)
        return out

    return Prepared(call, lambda: out)


def _onnxruntime_run(case: Case, tgt: Any, threads: int) -> Prepared:
    """onnxruntime's plain ``run()``: it allocates the output and returns it as NumPy."""
    session, feeds = _onnxruntime_session(case, tgt, threads)
    last: list[Any] = [None]

    def call():
        last[0] = session.run(["output"], feeds)[0]

    return Prepared(call, lambda: last[0])


def _no_synchronization() -> None:
    pass


def _torch(case: Case, tgt: Any, threads: int) -> Prepared:
    if not installed("torch"):
        raise Unavailable("torch is not installed", everywhere=True)
    import torch

    synchronize: Callable[[], object] = _no_synchronization
    if tgt.name == "cpu":
        torch.set_num_threads(threads)
    else:
        if not torch.cuda.is_available():
            raise Unavailable("torch has no CUDA device", everywhere=True)
        synchronize = torch.cuda.synchronize
    tensors = TorchArrays(tgt.name)
    x, cos, sin, ids = (
        tensors.to_device(a)
        for a in (case.input, case.cos_cache, case.sin_cache, case.position_ids)
    )
    w = case.workload
    last: list[Any] = [None]

    def call():
        with torch.inference_mode():
            rotated = torch_rope(torch, case.as_bhsd(x), cos, sin, ids, w.interleaved, w.rotary_dim)
            last[0] = case.from_bhsd(rotated)
        synchronize()

    return Prepared(call, lambda: tensors.to_host(last[0]))


#: The row of ``x.copy()``: a copy into fresh memory, not a floor (the ratios divide by
#: the faster preallocated copy), the yardstick of allocating calls.
ALLOCATING_COPY = "x.copy() (allocating, 1 thread)"
#: ``out=`` where NumPy puts its output (see :func:`_numba_rope_out_off_line`).
OFF_LINE = f"numba_rope (out= {NUMPY_PLACEMENT} B past a line)"


def implementations(device: str, threads: int) -> list[Implementation]:
    """What ``bench`` times on a device, floors first."""
    copy_name = f"copy (numba, {threads} threads)" if device == "cpu" else "copy (device to device)"
    found = [Implementation(copy_name, "copy", _numba_copy)]
    if device == "cpu":
        found.append(Implementation(ONE_THREAD_COPY, "copy", _numpy_copyto))
        found.append(Implementation(ALLOCATING_COPY, "allocating copy", _numpy_copy_allocating))
    found += [
        Implementation("numba_rope", "rope", _numba_rope_out),
        Implementation("numba_rope (allocating)", "rope", _numba_rope_alloc),
        Implementation("numba_rope (in place)", "rope", _numba_rope_in_place),
    ]
    if device == "cpu":
        found += [
            Implementation(OFF_LINE, "rope", _numba_rope_out_off_line),
            Implementation("numpy (spec formula, complex64)", "rope", _numpy_spec),
            Implementation("onnxruntime", "rope", _onnxruntime),
            Implementation("onnxruntime run()", "rope", _onnxruntime_run),
        ]
    found.append(Implementation("torch eager", "rope", _torch))
    return found


def prepare(name: str, case: Case, tgt: Any, threads: int) -> Prepared:
    """The prepared call of the implementation called ``name`` in
    :func:`implementations` (for the device ``tgt`` names), for tools that time one
    peer on its own; raises :class:`Unavailable` where it cannot run and ``KeyError``
    for a name the device has no implementation of.

    >>> from numba_rope.bench import make_case, target
    >>> case = make_case("seed", "float32")
    >>> copy = prepare("x.copy() (allocating, 1 thread)", case, target("cpu"), 1)
    >>> copy.call()
    >>> bool((copy.output() == case.input).all())
    True
    >>> prepare("cuBLAS", case, target("cpu"), 1)
    Traceback (most recent call last):
    KeyError: "no implementation called 'cuBLAS' on cpu"
    """
    device = tgt.name
    for implementation in implementations(device, threads):
        if implementation.name == name:
            return implementation.prepare(case, tgt, threads)
    raise KeyError(f"no implementation called {name!r} on {device}")
