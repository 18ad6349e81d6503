import functools
import os
import random
import shutil
import sys
import threading
import warnings


def _has_nvidia_gpu() -> bool:
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


# The GPU tests run on a GPU when there is one, else in numba's CUDA simulator, which
# must be chosen before numba is first imported. A value the user set wins.
if "NUMBA_ENABLE_CUDASIM" not in os.environ and not _has_nvidia_gpu():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    if "numba" in sys.modules:  # pragma: no cover - imported early, e.g. by a plugin
        import numba.core.config

        numba.core.config.reload_config()

from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba.core import compiler, typed_passes, untyped_passes  # noqa: E402
from numba.core.typing import templates  # noqa: E402
from oracles import (  # noqa: E402
    BFLOAT16,
    assert_bitwise_equal,
    float32_contract,
    to_gpu,
    to_host,
    ulp_of,
)

# -- numba compiling under coverage -----------------------------------------------------
#
# The suite is compile-bound: a cold run is almost all numba compiling, and a trace
# function (coverage's, under --cov) nearly doubles a compile (one float32 and one
# float16 kernel, cold: 12.2 s traced, 6.7 s not). Most of that is numba's own Python:
# its type inference (4.1 -> 7.1 s), the pass inline_inlinables (2.9 -> 7.0 s), which
# copies the IR of inline="always" functions, made from their bytecode, and lowering
# (three cold kernels: 3.7 -> 5.2 s of 7.7 s). This package's Python that runs while
# numba compiles (the @overload functions and the @intrinsic typing functions, called
# from type inference; the intrinsics' code generators, called in lowering) must still
# be seen by coverage. So numba's pipeline of passes runs untraced (those three, its
# other passes and code generation: with only the three paused, cold compiles of plans
# took 1.25x as long traced as not, 1.18x with the pipeline paused; median of 6), and
# the calls into this package's typing and code generation run traced again. Each
# switch happens in one wrapper frame: a frame that the tracer saw begin ends with the
# tracer on, one that it did not see begin ends with the tracer off, so that coverage's
# stack of frames stays in step (switching in numba's event callbacks instead lost
# lines of the report).

_paused = threading.local()


def _untraced(function: Callable) -> Callable:
    """``function`` run with the trace function paused (nested calls: as they are)."""

    @functools.wraps(function)
    def untraced(*args, **kwargs):
        trace = sys.gettrace()
        if trace is None:
            return function(*args, **kwargs)
        previous = getattr(_paused, "trace", None)
        sys.settrace(None)
        _paused.trace = trace
        try:
            return function(*args, **kwargs)
        finally:
            _paused.trace = previous
            sys.settrace(trace)

    return untraced


def _traced_again(function: Callable) -> Callable:
    """``function`` run with the trace function that :func:`_untraced` paused, if any."""

    @functools.wraps(function)
    def traced(*args, **kwargs):
        trace = getattr(_paused, "trace", None)
        if trace is None or sys.gettrace() is not None:
            return function(*args, **kwargs)
        _paused.trace = None
        sys.settrace(trace)
        try:
            return function(*args, **kwargs)
        finally:
            sys.settrace(None)
            _paused.trace = trace

    return traced


def _intrinsic_definition(definition: Callable) -> Callable:
    """An @intrinsic's typing function, run traced again, whose code generator (called
    in lowering) runs traced again too."""
    traced = _traced_again(definition)

    @functools.wraps(definition)
    def typing(*args, **kwargs):
        result = traced(*args, **kwargs)
        if result is None:
            return None
        signature, codegen = result
        return signature, _traced_again(codegen)

    return typing


#: The mark of a template function that :func:`_template_using` has wrapped.
_SWITCHED = "_numba_rope_traced_again"


def _template_using(attribute: str, wrap: Callable) -> Callable[[Callable], Callable]:
    """A wrapper of a template's method that first replaces the template's function
    ``attribute`` (a staticmethod: the package's @overload or @intrinsic function) by
    ``wrap`` of it, once, before its first use (templates are made when a module
    defines its functions, before or after this file is imported)."""

    def wrapper(method: Callable) -> Callable:
        @functools.wraps(method)
        def switched(self, *args, **kwargs):
            template = type(self)
            function = template.__dict__.get(attribute)
            if isinstance(function, staticmethod) and not hasattr(function.__func__, _SWITCHED):
                wrapped = wrap(function.__func__)
                setattr(wrapped, _SWITCHED, True)
                setattr(template, attribute, staticmethod(wrapped))
            return method(self, *args, **kwargs)

        return switched

    return wrapper


#: (owner, method, wrapper): numba's internals (numba 0.68, checked). Lowering is also
#: called from type inference (a function's callees are compiled while it is typed).
_SWITCHES = (
    (getattr(compiler, "CompilerBase", None), "_compile_core", _untraced),
    (getattr(typed_passes, "NopythonTypeInference", None), "run_pass", _untraced),
    (getattr(untyped_passes, "InlineInlinables", None), "run_pass", _untraced),
    (getattr(typed_passes, "BaseNativeLowering", None), "run_pass", _untraced),
    (
        getattr(templates, "_OverloadFunctionTemplate", None),
        "_build_impl",
        _template_using("_overload_func", _traced_again),
    ),
    (
        getattr(templates, "_IntrinsicTemplate", None),
        "generic",
        _template_using("_definition_func", _intrinsic_definition),
    ),
)

#: Whether the switches are in place: all or none (a numba whose internals moved runs
#: the suite fully traced, slower; tests/test_conftest.py then fails and says so).
COMPILING_UNTRACED = all(hasattr(owner, name) for owner, name, _ in _SWITCHES)
if COMPILING_UNTRACED:
    for owner, name, wrap in _SWITCHES:
        setattr(owner, name, wrap(getattr(owner, name)))


# -- order: the long tests first -------------------------------------------------------
#
# The tests of these files take tens of seconds each (they compile every kernel for
# other CPUs in a process of their own): run first, so that xdist's workers
# (--dist worksteal, pyproject.toml) share out the many short tests after them and
# finish together, instead of one waiting while the other ends on a two-minute test.
LONG_FIRST = ("test_targets.py",)


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--shuffle",
        type=int,
        metavar="SEED",
        default=None,
        help="run the tests in an order shuffled by SEED (the same in every xdist worker): "
        "no test may depend on the ones before it, and worksteal's order varies anyway",
    )


def pytest_collection_modifyitems(config, items: list) -> None:
    items.sort(key=lambda item: item.path.name not in LONG_FIRST)  # stable: else as found
    seed = config.getoption("--shuffle", None)
    if seed is not None:
        random.Random(seed).shuffle(items)


DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.fixture
def rng():
    return np.random.default_rng(20261129)


@pytest.fixture(scope="module")
def load_tool():
    """A function that imports a script of ``tools/`` as a module (``load_tool("accuracy")``
    for ``tools/accuracy.py``), dropped from ``sys.modules`` after the test module."""
    import importlib.util
    from pathlib import Path

    loaded: list[str] = []

    def load(name: str):
        path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"{name}_tool", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        loaded.append(spec.name)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in loaded:
        sys.modules.pop(name, None)


@pytest.fixture
def parallel_always(monkeypatch):
    """Make every input take the parallel kernel, however small."""
    from numba_rope import config

    monkeypatch.setattr(config, "PARALLEL_MIN_ELEMENTS", 0)


@pytest.fixture
def small_cuda_launches(monkeypatch):
    """Shrink the CUDA launch so that tiny inputs span several blocks, several head
    groups (one of them partial) and several turns of every grid-stride loop. On a GPU
    numba-cuda warns of low occupancy for such grids (of fewer than 128 blocks, which
    the default launch never uses: test_rotary_cuda.py checks that); the test ignores
    that warning alone (pytest restores the filters after each test)."""
    from numba_rope import config

    # numba-cuda's message starts with a terminal's bold code: match anywhere in it.
    warnings.filterwarnings("ignore", r".*Grid size \d+ will likely result in GPU under-utili")

    monkeypatch.setattr(config, "CUDA_THREADS_PER_BLOCK", 4)
    monkeypatch.setattr(config, "CUDA_HEADS_PER_THREAD", 2)
    monkeypatch.setattr(config, "CUDA_MAX_BLOCKS", 2)


# -- devices: the same test on NumPy arrays and on GPU arrays --------------------------


def simulator() -> bool:
    """Whether GPU arrays live in numba's CUDA simulator (else on a real GPU)."""
    from numba.core import config

    return bool(config.ENABLE_CUDASIM)


@dataclass(frozen=True)
class Device:
    """Where a test's arrays live. ``on`` moves a NumPy array there (anything else, None,
    scalars and lists, passes as it is), ``off`` brings a result back as a NumPy array;
    it unpacks as ``on, off = device``."""

    name: str
    on: Callable
    off: Callable

    def __iter__(self):
        return iter((self.on, self.off))

    def views(self, host_base, *host_views):
        """``(base, *views)``: ``host_base`` and views into it (any strides, any dtype
        over the same bytes) on this device: the host arrays themselves on the CPU, else
        the same offsets and strides over one device copy of ``host_base``."""
        if self.name == "cpu":
            return (host_base, *host_views)
        return gpu_views(host_base, *host_views)

    def assert_contract(self, got, x, cos, sin, ids=None, interleaved=False, rotary_dim=0):
        """On the CPU bit for bit; on GPU arrays :func:`assert_matches_contract`."""
        if self.name == "cpu":
            want = float32_contract(x, cos, sin, ids, interleaved, rotary_dim)
            assert_bitwise_equal(got, want)
        else:
            assert_matches_contract(got, x, cos, sin, ids, interleaved, rotary_dim)


def _gpu_movers(request) -> Device:
    pytest.importorskip("numba.cuda")
    request.getfixturevalue("small_cuda_launches")
    return Device("gpu", to_gpu, to_host)


@pytest.fixture(params=DEVICES)
def device(request) -> Device:
    """NumPy arrays, or numba device arrays with the CUDA launch shrunk so that tiny
    inputs span several blocks. Parametrize it indirectly with "cpu" and
    ``pytest.param("gpu", marks=pytest.mark.gpu)`` to give each its own cases."""
    if request.param == "cpu":
        return Device("cpu", lambda a: a, lambda a: a)
    return _gpu_movers(request)


@pytest.fixture
def gpu(request) -> Device:
    return _gpu_movers(request)


def gpu_views(host_base: np.ndarray, *host_views: np.ndarray):
    """``(base, *views)``: a device copy of ``host_base`` and the device twins of
    ``host_views``, views into ``host_base`` (any strides, negative too, any dtype over
    the same bytes): the same offsets and strides over that copy."""
    from numba import cuda

    base = to_gpu(host_base)
    return (base, *(_gpu_view(cuda, base, host_base, view) for view in host_views))


def _gpu_view(cuda, base, host_base: np.ndarray, host_view: np.ndarray):
    offset = host_view.__array_interface__["data"][0] - host_base.__array_interface__["data"][0]
    if simulator():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        view = np.ndarray(
            host_view.shape,
            host_view.dtype,
            buffer=base._ary,
            offset=offset,
            strides=host_view.strides,
        )
        return FakeCUDAArray(view)
    storage = np.dtype(np.uint16) if host_view.dtype == BFLOAT16 else host_view.dtype
    description = {
        "shape": host_view.shape,
        "strides": host_view.strides,
        "data": (base.device_ctypes_pointer.value + offset, False),
        "typestr": storage.str,
        "version": 3,
    }
    view = cuda.from_cuda_array_interface(description, owner=base, sync=False)
    return view.view(BFLOAT16) if storage != host_view.dtype else view


def assert_matches_contract(got, x, cos, sin, ids=None, interleaved=False, rotary_dim=0):
    """A GPU result: the float32 contract bit for bit, in the simulator and on a GPU (the
    kernels round each product on their own: no FMA)."""
    want = float32_contract(x, cos, sin, ids, interleaved, rotary_dim)
    assert_bitwise_equal(got, want)
    # And within the rounding of the format from the float64 reference.
    from numba_rope import reference

    with np.errstate(all="ignore"):
        ref = reference.rotary_embedding(
            x, cos, sin, ids, interleaved=interleaved, rotary_embedding_dim=rotary_dim
        ).astype(np.float64)
    finite = np.isfinite(ref)
    scale = np.abs(x.astype(np.float64)).max(initial=0) * 2
    assert np.allclose(
        got.astype(np.float64)[finite], ref[finite], rtol=0, atol=4 * ulp_of(x.dtype) * scale
    )
