"""numba_rope in hostile processes, each test in a subprocess of its own: a child forked
after parallel calls, a read-only install with no writable cache location, numba's JIT
turned off, and processes compiling into one cache location at once."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import numba_rope

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "numba_rope"

#: Seconds a whole subprocess may take (cold compilation included).
SUBPROCESS_TIMEOUT = 300


def _run(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """Run ``code``, whose ``sys.argv[1]`` is the directory numba_rope must come from."""
    result = subprocess.run(
        [sys.executable, "-c", code, env["PYTHONPATH"]],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        env=env,
        cwd=cwd,
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def _env(pythonpath: Path, **changes: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(pythonpath)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


# -- read-only install ---------------------------------------------------------------------

READ_ONLY_SCRIPT = """
import hashlib, sys
import numpy as np
import numba_rope
from numba_rope import config

assert numba_rope.__file__.startswith(sys.argv[1]), numba_rope.__file__
x = np.random.default_rng(3).standard_normal((1, 4, 64, 8), dtype=np.float32)
cos, sin = numba_rope.rope_cache(64, 8, dtype=np.float32)
ids = np.arange(64)[None]
small = numba_rope.rotary_embedding(x, cos, sin, ids)
config.PARALLEL_MIN_ELEMENTS = 0
large = numba_rope.rotary_embedding(x, cos, sin, ids)
print(hashlib.sha256(small.tobytes() + cos.tobytes() + sin.tobytes()).hexdigest())
print(hashlib.sha256(large.tobytes()).hexdigest())
"""


def _expected_digests() -> list[str]:
    x = np.random.default_rng(3).standard_normal((1, 4, 64, 8), dtype=np.float32)
    cos, sin = numba_rope.rope_cache(64, 8, dtype=np.float32)
    out = numba_rope.rotary_embedding(x, cos, sin, np.arange(64)[None])
    return [
        hashlib.sha256(out.tobytes() + cos.tobytes() + sin.tobytes()).hexdigest(),
        hashlib.sha256(out.tobytes()).hexdigest(),
    ]


@pytest.fixture
def read_only_install(tmp_path):
    """A copy of the package where numba finds no cache location, even as root: every
    ``__pycache__`` is a file (no directory can be made there), and the home and cache
    directories lie under a file. Returns the environment of a process using it."""
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "numba_rope", ignore=shutil.ignore_patterns("__pycache__"))
    for init in (site / "numba_rope").rglob("__init__.py"):
        (init.parent / "__pycache__").write_text("")
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    env = _env(
        site,
        HOME=str(blocked / "home"),
        XDG_CACHE_HOME=str(blocked / "cache"),
        NUMBA_CACHE_DIR=str(blocked / "numba"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


def test_read_only_install_imports_and_computes_the_same_bits(read_only_install, tmp_path):
    """With no writable cache location (an unusable ``NUMBA_CACHE_DIR`` too), import
    used to fail with "cannot cache function 'rotate_pair': no locator available"; the
    package now compiles in memory, to the same bits."""
    env = read_only_install
    result = _run(READ_ONLY_SCRIPT, env, tmp_path)
    assert result.stdout.split() == _expected_digests()


def test_read_only_install_still_caches_in_numba_cache_dir(read_only_install, tmp_path):
    """numba's own ``NUMBA_CACHE_DIR`` is still where compiled code goes when usable."""
    env = read_only_install
    cache = tmp_path / "numba-cache"
    _run(READ_ONLY_SCRIPT, env | {"NUMBA_CACHE_DIR": str(cache)}, tmp_path)
    cached = {path.name.split(".")[0] for path in cache.rglob("*.nbi")}
    assert {"_sincos", "_rotation", "kernels"} <= cached, sorted(cached)


# -- a package whose inlined modules change -------------------------------------------------

STALE_SCRIPT = """
import json, sys
import numpy as np
from numba_rope._cpu import kernels

assert kernels.__file__.startswith(sys.argv[1]), kernels.__file__
kernels.first_bad_position(np.zeros((1, 2), np.int64), 4)
stats = kernels.first_bad_position.stats
print(json.dumps([sum(stats.cache_hits.values()), sum(stats.cache_misses.values())]))
"""


def test_cached_code_is_stale_when_any_module_of_the_package_changes(tmp_path):
    """numba keys a function's on-disk cache on its own file alone; the kernels inline
    code from other modules (the vector intrinsics, the conversions), and an edit
    there alone kept the machine code of before (a checkout after ``git pull``, an
    upgrade that leaves ``kernels.py`` as it was). Any change to the package's
    sources now recompiles."""
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "numba_rope", ignore=shutil.ignore_patterns("__pycache__"))
    env = _env(site, NUMBA_CACHE_DIR=str(tmp_path / "cache"))

    def hits_and_misses() -> list[int]:
        return json.loads(_run(STALE_SCRIPT, env, tmp_path).stdout.splitlines()[-1])

    assert hits_and_misses() == [0, 1]  # compiled and saved
    assert hits_and_misses() == [1, 0]  # loaded
    with open(site / "numba_rope" / "_cpu" / "vector.py", "a") as module:
        module.write("# an edit to a module that kernels.py inlines code from\n")
    assert hits_and_misses() == [0, 1]  # stale: compiled again
    assert hits_and_misses() == [1, 0]


# -- fork ----------------------------------------------------------------------------------

#: Run before the fork scripts below: the exit code of the forked child ``pid``, which is
#: killed after ``timeout`` seconds, the script then ending with the message ``hung``.
CHILD_EXIT_CODE = """
import os, signal, sys, time
def child_exit_code(pid, timeout, hung):
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            sys.exit(hung)
        time.sleep(0.05)
"""

FORK_SCRIPT = """
import multiprocessing, os, signal, sys, time, traceback
import numba, numpy as np
import numba_rope
from numba_rope import config
from numba_rope._cpu import backend

assert numba_rope.__file__.startswith(sys.argv[1]), numba_rope.__file__
config.PARALLEL_MIN_ELEMENTS = 1 << 12  # every call below runs the parallel kernels
TIMEOUT = 60

rng = np.random.default_rng(7)
x = rng.standard_normal((2, 4, 256, 16), dtype=np.float32)
k = rng.standard_normal((2, 2, 256, 16), dtype=np.float32)
ids = rng.integers(0, 300, size=(2, 256))

small = rng.standard_normal((1, 2, 3, 16), dtype=np.float32)
small_ids = np.ascontiguousarray(ids[:1, :3])

def work(_=None):
    cos, sin = numba_rope.rope_cache(300, 16, dtype=np.float32)  # a parallel kernel too
    out = numba_rope.rotary_embedding(x, cos, sin, ids)
    q_out, k_out = numba_rope.rotary_embedding_qk(x, k, cos, sin, ids, interleaved=True)
    # Small calls repeated: compiled plans, made before the fork and run after it.
    repeated = [
        numba_rope.rotary_embedding(small, cos, sin, small_ids)
        for _ in range(backend.FAST_AFTER + 2)
    ]
    return b"".join(a.tobytes() for a in (cos, sin, out, q_out, k_out, *repeated))

plans_ran = []
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from plan_counting import counting_plans
backend.FAST = counting_plans(lambda kind, ran: plans_ran.append(ran))
expected = work()
assert backend.FAST and plans_ran and all(plans_ran), "no compiled plan before the fork"
plans_ran.clear()
print("layer", numba.threading_layer(), flush=True)  # raises unless threads started
# Another thread inside a parallel call at the fork holds the workqueue lock: a child
# must not inherit it held.
backend._parallel_lock.acquire()

pid = os.fork()
if pid == 0:
    code = 4
    try:
        same = work() == expected
        code = 0 if same and plans_ran and all(plans_ran) else 3  # plans ran in the child
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)
code = child_exit_code(pid, TIMEOUT, "the os.fork child hung")
assert code == 0, f"the os.fork child ended with {code}"

with multiprocessing.get_context("fork").Pool(2) as pool:
    backend._parallel_lock.release()
    results = pool.map_async(work, range(4)).get(timeout=TIMEOUT)
assert all(result == expected for result in results), "a pool worker's bits differ"
assert work() == expected  # and the parent still runs in parallel
print("ok", flush=True)
"""


@pytest.mark.parametrize("layer", [None, "workqueue"], ids=["default-layer", "workqueue"])
def test_calls_in_forked_children_give_the_parents_bits(layer):
    """After parallel calls, a child of ``os.fork`` and the workers of a fork-context
    pool compute the same bits as the parent. Under GNU OpenMP (numba's default
    threading layer on Linux) the child used to be killed on its first parallel call
    and the pool hung."""
    env = _env(ROOT, NUMBA_NUM_THREADS="2", NUMBA_THREADING_LAYER=layer)
    result = _run(CHILD_EXIT_CODE + FORK_SCRIPT, env, ROOT)
    assert "ok" in result.stdout
    if layer is not None:
        assert f"layer {layer}" in result.stdout


COMPILING_AT_FORK_SCRIPT = """
import threading
import numpy as np
import numba_rope
from numba.core.compiler_lock import global_compiler_lock
from numba_rope import reference

x = np.random.default_rng(5).standard_normal((2, 4, 8, 64)).astype(np.float32)
cos, sin = numba_rope.rope_cache(16, 64, dtype=np.float32)
ids = np.arange(8)[None].repeat(2, 0)
numba_rope.rotary_embedding(x, cos, sin, ids)  # the process has run calls before

# Another thread compiling at the fork, for as long as the fork takes: it holds numba's
# compiler lock (as numba_rope's compiler thread does, see _jit.apart).
compiling, fork_started, released = threading.Event(), threading.Event(), []
def compile_elsewhere():
    with global_compiler_lock:
        compiling.set()
        fork_started.wait()
        time.sleep(0.5)
        released.append(time.monotonic())
compiler = threading.Thread(target=compile_elsewhere)
compiler.start()
compiling.wait()
fork_started.set()
pid = os.fork()
if pid == 0:
    # A signature new to the process: compiled, or loaded from numba's cache, here.
    y = x.astype(np.float64)
    got = numba_rope.rotary_embedding(y, cos, sin, ids, interleaved=True)
    want = reference.rotary_embedding(y, cos, sin, ids, interleaved=True)
    os._exit(0 if np.array_equal(got, want) else 3)
returned = time.monotonic()
compiler.join()
code = child_exit_code(pid, 240, "the child hung: it inherited numba's compiler lock held")
assert code == 0, f"the child ended with {code}"
assert returned >= released[0], "the fork did not wait for the compilation"
assert global_compiler_lock._lock.acquire(blocking=False)  # the parent's is free again
print("ok", flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_fork_while_another_thread_compiles_waits_for_it_and_the_child_compiles():
    """A fork waits for a compilation under way on another thread; the child then
    compiles (or loads) a new signature. Before, the child inherited numba's compiler
    lock held by a thread it does not have, and its first such call hung."""
    result = _run(
        CHILD_EXIT_CODE + COMPILING_AT_FORK_SCRIPT, _env(ROOT, NUMBA_NUM_THREADS="2"), ROOT
    )
    assert "ok" in result.stdout


# -- NUMBA_DISABLE_JIT ---------------------------------------------------------------------

DISABLED_JIT_SCRIPT = """
import numpy as np
import numba_rope
from numba_rope import reference

cos, sin = numba_rope.rope_cache(8, 4, dtype=np.float32)  # runs as Python
x = np.ones((1, 2, 4, 4), np.float32)
ids = np.arange(4)[None]
reference.rotary_embedding(x, cos, sin, ids)
for call in (
    lambda: numba_rope.rotary_embedding(x, cos, sin, ids),
    lambda: numba_rope.rotary_embedding_qk(x, x, cos, sin, ids),
):
    try:
        call()
    except RuntimeError as error:
        assert "NUMBA_DISABLE_JIT=1 is not supported" in str(error), error
    else:
        raise AssertionError("no error under NUMBA_DISABLE_JIT=1")
print("ok")
"""


def test_disabled_jit_is_refused_clearly():
    """Under ``NUMBA_DISABLE_JIT=1`` a rotation raises a RuntimeError that says so (it
    used to be a bare NotImplementedError from a kernel run as Python); ``rope_cache``
    and the reference still run."""
    result = _run(DISABLED_JIT_SCRIPT, _env(ROOT, NUMBA_DISABLE_JIT="1"), ROOT)
    assert "ok" in result.stdout


@pytest.mark.gpu
def test_disabled_jit_is_refused_clearly_on_the_gpu():
    code = """
import numpy as np
from numba import cuda
import numba_rope
x = cuda.to_device(np.ones((1, 2, 4, 4), np.float32))
cos, sin = (cuda.to_device(a) for a in numba_rope.rope_cache(8, 4, dtype=np.float32))
try:
    numba_rope.rotary_embedding(x, cos, sin, cuda.to_device(np.arange(4)[None]))
except RuntimeError as error:
    assert "NUMBA_DISABLE_JIT=1 is not supported" in str(error), error
else:
    raise AssertionError("no error under NUMBA_DISABLE_JIT=1")
print("ok")
"""
    result = _run(code, _env(ROOT, NUMBA_DISABLE_JIT="1", NUMBA_ENABLE_CUDASIM="1"), ROOT)
    assert "ok" in result.stdout


# -- processes sharing a cache location ----------------------------------------------------

SHARED_MODULE = """
from numba import types

from numba_rope._jit import cached_cfunc, cached_njit

@cached_njit()
def add(a, b):
    return a + b

@cached_cfunc(types.float64(types.float64))
def twice(a):
    return 2.0 * a
"""

#: A process that imports the shared module, says so, adds two float64 numbers (a
#: compilation or a cache load) and prints whether it compiled and when it was done.
SHARING_SCRIPT = """
import json, sys, time
sys.path.insert(0, sys.argv[2])
import shared_module
print("ready", flush=True)
assert shared_module.add(1.0, 2.0) == 3.0
stats = shared_module.add.stats
print(json.dumps([sum(stats.cache_hits.values()), sum(stats.cache_misses.values()), time.time()]))
"""

#: Seconds a child is given to compile and save a one-line function where nothing
#: keeps it waiting (it takes well under one on any machine).
WAIT_SECONDS = 2.0


@pytest.fixture
def shared_module(tmp_path, monkeypatch):
    """A module with one cached function, imported here; its cache location is the
    one a child process finds too (``NUMBA_CACHE_DIR`` where set, else next to it)."""
    folder = tmp_path / "module"
    folder.mkdir()
    (folder / "shared_module.py").write_text(SHARED_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "shared_module", raising=False)
    import shared_module

    yield shared_module, folder
    sys.modules.pop("shared_module", None)


def _start_child(code: str, folder: Path, tmp_path: Path) -> subprocess.Popen:
    """Start ``code`` with numba_rope from this tree and ``folder`` as ``sys.argv[2]``."""
    return subprocess.Popen(
        [sys.executable, "-c", code, str(ROOT), str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(ROOT),
        cwd=tmp_path,
    )


def _start_sharing_child(folder: Path, tmp_path: Path) -> subprocess.Popen:
    child = _start_child(SHARING_SCRIPT, folder, tmp_path)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready", child.communicate(timeout=60)
    return child


def _child_result(child: subprocess.Popen) -> list:
    # Read through the text streams: "ready" was read from stdout's, which may already
    # hold the next line (communicate() reads the pipes' descriptors, past that buffer).
    assert child.stdout is not None and child.stderr is not None
    with child:  # closes the pipes
        out, err = child.stdout.read(), child.stderr.read()
        child.wait(timeout=SUBPROCESS_TIMEOUT)
    assert child.returncode == 0, f"exit {child.returncode}\n{out}\n{err}"
    return json.loads(out.splitlines()[-1])


def test_a_signature_another_process_compiles_is_waited_for_and_loaded(shared_module, tmp_path):
    """A process about to compile what another process is compiling waits for it and
    loads its result from the cache: concurrent cold starts compile each kernel once."""
    from numba import float64

    from numba_rope._jit import compile_lock

    module, folder = shared_module
    with compile_lock(module.add, (float64, float64)):
        child = _start_sharing_child(folder, tmp_path)
        time.sleep(WAIT_SECONDS)  # unlocked, the child would have compiled it by now
        compiling = time.time()
        # Compiled here, and saved to the cache. The compilation takes the same lock
        # (a process never waits on its own record lock) and releases it when done.
        assert module.add(1.0, 2.0) == 3.0
    hits, misses, done = _child_result(child)
    assert (hits, misses) == (1, 0)  # loaded, not compiled
    assert done >= compiling
    stats = module.add.stats
    assert sum(stats.cache_misses.values()) == 1


def test_the_cache_index_is_written_by_one_process_at_a_time(shared_module, tmp_path):
    """numba reads a function's cache index, adds an entry and writes it back: two
    processes doing so at once lose an entry, or pair one with the other's machine
    code. A process that holds the index lets no other process save meanwhile."""
    from numba_rope._jit import index_lock

    module, folder = shared_module
    with index_lock(module.add):
        child = _start_sharing_child(folder, tmp_path)
        time.sleep(WAIT_SECONDS)
        assert child.poll() is None  # waiting to read the index, then to write it
    hits, misses, _ = _child_result(child)
    assert (hits, misses) == (0, 1)
    later = _start_sharing_child(folder, tmp_path)
    assert _child_result(later)[:2] == [1, 0]  # the entry was saved


def test_a_c_callback_saves_to_its_cache_index_by_one_process_at_a_time(shared_module, tmp_path):
    """The helper's runners (``cached_cfunc``) compile when made, and save under the
    same lock of their cache index."""
    from numba_rope._jit import index_lock

    module, folder = shared_module  # compiled (and saved) here, on import
    (folder / "shared_module.py").write_text(SHARED_MODULE + "\n")  # a new source stamp
    code = "import sys; sys.path.insert(0, sys.argv[2]); import shared_module as m; "
    code += "print(m.twice.cache_hits, m.twice.ctypes(2.0))"
    with index_lock(module.twice):  # the same index file: the name and folder are the same
        child = _start_child(code, folder, tmp_path)
        time.sleep(WAIT_SECONDS + 3.0)  # the child imports numba first
        assert child.poll() is None
    out, err = child.communicate(timeout=SUBPROCESS_TIMEOUT)
    assert child.returncode == 0, err
    assert out.split() == ["0", "4.0"]  # the edited source is compiled anew, then saved
    again = _start_child(code, folder, tmp_path).communicate(timeout=SUBPROCESS_TIMEOUT)[0]
    assert again.split() == ["1", "4.0"]


def test_a_save_deletes_the_cache_files_other_versions_left(shared_module, tmp_path):
    """numba names a function's cache files after its line and never reads those of
    another line again: each change that moved a function left its machine code on
    disk for good. A save deletes the files of the same function at other lines that
    other sources of the package saved; those of this version, of another numba, and
    unreadable ones stay."""
    import pickle
    import re

    import numba

    module, folder = shared_module
    cache_file = module.add._cache._cache_file
    directory = Path(cache_file._cache_path)
    base = re.fullmatch(r"(.+)-(\d+)\.([^.]+)\.nbi", cache_file._index_name)
    assert base is not None, cache_file._index_name
    function, line, tag = base[1], int(base[2]), base[3]
    ours = cache_file._source_stamp

    def plant(name, at, stamp, version=numba.__version__):
        index = directory / f"{name}-{at}.{tag}.nbi"
        with open(index, "wb") as file:
            pickle.dump(version, file, protocol=-1)
            file.write(pickle.dumps((stamp, {}), protocol=-1))
        data = [directory / f"{name}-{at}.{tag}.{n}.nbc" for n in (1, 2)]
        for path in data:
            path.write_bytes(b"machine code")
        return [index, *data]

    directory.mkdir(parents=True, exist_ok=True)
    stale = plant(function, line + 40, (ours[0], b"other sources of the package"))
    stale += plant(function, line + 41, (1.0, 456))  # a version before the sources' key
    kept = plant(function, line + 42, ours)  # this version's (another function's)
    kept += plant(function, line + 43, (1.0, b"x"), version="0.0.1")  # another numba's
    kept += plant(f"{function}_other", line + 40, (1.0, b"x"))  # another function's
    garbled = directory / f"{function}-{line + 44}.{tag}.nbi"
    garbled.write_bytes(b"not a pickle")
    assert module.add(1.0, 2.0) == 3.0  # compiled and saved
    assert [path.name for path in stale if path.exists()] == []
    assert [path.name for path in [*kept, garbled] if not path.exists()] == []
    own = directory / cache_file._index_name
    assert own.exists() and (directory / f"{function}-{line}.{tag}.1.nbc").stat().st_size > 0
    again = _start_sharing_child(folder, tmp_path)
    assert _child_result(again)[:2] == [1, 0]  # its own entry loads


def test_a_cache_lock_that_cannot_be_taken_leaves_the_cache_as_numba_has_it(tmp_path):
    """Where no lock file can be made, the locked block still runs (unlocked)."""
    from numba_rope._jit import cache_lock

    ran = []
    with cache_lock(str(tmp_path / "no such directory"), "compile"):
        ran.append(True)
    assert ran == [True]


# -- one specialization for arrays of any layout --------------------------------------------


def test_a_function_compiled_for_any_layout_serves_every_layout_with_one_compilation():
    import numba
    from numba import types

    from numba_rope._jit import compiled_for_any_layout

    @numba.njit
    def weighted(a, b, scale):  # a sum in a fixed order: exact on small integers
        total = 0.0
        for i in range(a.shape[0]):
            for j in range(a.shape[1]):
                total += a[i, j] * b[i, j] * scale
        return total

    compiled_for_any_layout(weighted)
    values = np.arange(12.0).reshape(3, 4)
    wide = np.zeros((3, 8))
    wide[:, ::2] = values
    forms = (values, np.asfortranarray(values), wide[:, ::2])  # numba layouts C, F, A
    assert [numba.typeof(f).layout for f in forms] == ["C", "F", "A"]
    for a in forms:
        for b in forms:
            assert weighted(a, b, 2) == 2.0 * float(np.sum(values * values))
    # One specialization, of layout "A", for the nine pairs; every pair then found by
    # numba's dispatcher itself.
    assert list(weighted.overloads) == [
        (types.Array(types.float64, 2, "A"), types.Array(types.float64, 2, "A"), types.int64)
    ]
    read_only = values.copy()
    read_only.flags.writeable = False  # another type: a specialization of its own
    assert weighted(read_only, values, 1) == float(np.sum(values * values))
    assert len(weighted.overloads) == 2
    assert all(kind.layout == "A" for args in weighted.overloads for kind in args[:2])


# -- compilations apart from the call that needs them ---------------------------------------

#: A process with a cache of its own (cold): the first calls compile numba's parallel
#: kernels, q and k's too, and the compiled plans (made at a signature's 8th call), with
#: Python's collector of cycles off; prints, for each call, how many of its arrays
#: (input, k, outputs) outlived the caller's last reference to them.
COLD_CALLS_SCRIPT = """
import gc, json, sys, weakref
import numpy as np
import numba_rope
from numba_rope import config

assert numba_rope.__file__.startswith(sys.argv[1]), numba_rope.__file__
cos, sin = numba_rope.rope_cache(8, 16, dtype=np.float32)
ids = np.arange(8)[None]
rng = np.random.default_rng(5)
config.PARALLEL_MIN_ELEMENTS = 0  # numba's parallel kernels, whose typing keeps cycles
gc.disable()
alive = []
for call in range(10):
    x = rng.standard_normal((1, 2, 8, 16), dtype=np.float32)
    k = rng.standard_normal((1, 1, 8, 16), dtype=np.float32)
    out = numba_rope.rotary_embedding(x, cos, sin, ids)
    q_out, k_out = numba_rope.rotary_embedding_qk(x, k, cos, sin, ids)
    held = [weakref.ref(array) for array in (x, k, out, q_out, k_out)]
    del x, k, out, q_out, k_out
    alive.append(sum(ref() is not None for ref in held))
print(json.dumps(alive))
"""


def test_arrays_of_a_call_that_compiles_are_freed_with_the_callers_references(tmp_path):
    """numba's typing keeps the exceptions it catches in reference cycles, and with
    them the frames they passed through. Compiled under the call that needed it, a
    kernel's typing kept that call's input and outputs alive after the caller had let
    go of them, until the collector passed over the generation the cycles had reached:
    a pooled output's buffer was not reused meanwhile. Compiled on a
    thread of its own, the arrays go with the caller's last reference."""
    env = _env(ROOT, NUMBA_CACHE_DIR=str(tmp_path / "cold-cache"))
    alive = json.loads(_run(COLD_CALLS_SCRIPT, env, tmp_path).stdout.splitlines()[-1])
    assert alive == [0] * 10


def test_a_compilation_runs_on_a_thread_of_its_own_nested_ones_here():
    import gc
    import threading
    import weakref

    import numba
    from numba import types
    from numba.core.compiler_lock import global_compiler_lock

    from numba_rope._jit import apart, compiled_apart

    @numba.njit
    def total(a):
        return a.sum()

    threads = []
    compile_here = total.compile

    def compile_keeping_frames(sig):
        # What numba's typing does: an exception caught and kept in a reference cycle,
        # its traceback holding this frame, and through it every frame under it.
        try:
            raise ValueError("kept")
        except ValueError as error:
            kept: list = [error]
            kept.append(kept)
        threads.append(threading.get_ident())
        return compile_here(sig)

    total.compile = compile_keeping_frames
    compiled_apart(total)
    collecting = gc.isenabled()
    gc.disable()
    try:
        values = np.arange(4.0)
        held = weakref.ref(values)
        assert total(values) == 6.0
        del values
        assert held() is None  # not held by the compilation's frames
    finally:
        if collecting:
            gc.enable()
    here = threading.get_ident()
    assert len(threads) == 1 and threads[0] != here
    total.compile((types.Array(types.float64, 1, "C"),))  # compiled before: at once, here
    assert threads[1:] == [here]
    with global_compiler_lock:  # nested in a compilation of this thread: here
        total.compile((types.Array(types.float32, 1, "C"),))
    assert threads[2:] == [here]
    assert total(np.arange(3, dtype=np.float32)) == 3.0
    with pytest.raises(ZeroDivisionError):  # raised again on the calling thread
        apart(lambda: 1 / 0, __name__)
    assert apart(threading.get_ident, __name__) != here
    assert apart(lambda: "result", __name__) == "result"
