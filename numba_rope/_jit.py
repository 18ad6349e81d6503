"""numba as numba_rope uses it, decided in one place: where compiled code is cached,
whether this process may run parallel regions, and whether the JIT compiler is on.

* Every ``@njit`` function of the package is made by :func:`cached_njit`: cached on
  disk where numba finds a writable cache location (``NUMBA_CACHE_DIR``, the
  ``__pycache__`` next to the source, the user's cache directory), compiled in memory
  only where it finds none (a read-only site-packages and no writable home, such as a
  container run as an unprivileged user), where ``numba.njit(cache=True)`` itself
  raises ``RuntimeError: cannot cache function ...: no locator available``. The
  compiled code is the same either way.
* After ``os.fork`` of a process whose parallel regions ran on numba's ``omp``
  threading layer (GNU OpenMP on Linux, numba's choice when TBB is not installed), the
  child is killed on its first parallel region ("fork() called from a process already
  using GNU OpenMP, this is unsafe"). :func:`parallel_regions_usable` is False in such a child (and its own
  children): the CPU kernels and the cos/sin kernel then run their serial versions,
  whose results are the same bits. numba's ``workqueue`` and ``tbb`` layers start
  afresh in a forked child and keep their threads.
* A fork waits for a compilation under way on another thread to end (numba's compiler
  lock is taken before it and released after it, in the parent and the child): the
  child would otherwise inherit the lock held by a thread it does not have, and its
  first call that compiles or loads a function would wait for ever.
* The on-disk cache of every such function is stale when any source file of the
  package changes (:func:`keyed_on_package_sources`), not only the function's own;
  and what other versions of the package left for it is deleted when it is saved
  (:func:`forget_other_versions`).
* ``NUMBA_DISABLE_JIT=1`` turns ``@njit`` functions into plain Python, in which the
  rotation kernels cannot run (they are built from numba intrinsics and overloads):
  :func:`require_jit` raises a clear error instead.
* Processes that share a cache location compile each kernel once between them (POSIX):
  a process about to compile a signature waits while another compiles it, then loads
  that one's result from the cache; and no two processes write one function's cache
  index at once. numba's own cache does neither: its index of a function's compiled
  signatures is read, extended and written back unlocked, so of two processes saving
  at once one entry is lost, and both may pick the same data file name, leaving an
  index entry that names the other signature's machine code. See
  :func:`compiled_once_across_processes`.
* Every compilation (and cache load) of a new signature runs on a thread of its own
  (:func:`apart`), not under the call that needs it: numba's typing keeps exceptions
  it catches, and with their tracebacks the stack's frames, in reference cycles, and
  on the caller's stack those frames hold the call's arrays (its input and output,
  a pooled buffer too) until Python's cycle collector reaches them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pathlib
import pickle
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numba
from numba import types
from numba.core import config as numba_config
from numba.core import sigutils
from numba.core.ccallback import CFunc
from numba.core.compiler_lock import global_compiler_lock
from numba.np.ufunc import parallel as _numba_parallel

#: What ``numba.njit(cache=True)`` raises when no cache location is usable.
_NO_LOCATOR = "no locator available"

_T = TypeVar("_T")


def cached_njit(any_layout: bool = False, **options: Any) -> Callable[[Callable], Any]:
    """``numba.njit(cache=True, **options)``, or ``numba.njit(**options)`` (compiled in
    memory, each process) where numba finds no usable cache location for the function's
    file. numba's own choice of location, ``NUMBA_CACHE_DIR`` first, is kept.
    ``any_layout``: compile one specialization for arrays of any layout
    (:func:`compiled_for_any_layout`)."""

    def decorate(function: Callable) -> Any:
        try:
            dispatcher = numba.njit(cache=True, **options)(function)
        except RuntimeError as error:
            if _NO_LOCATOR not in str(error):
                raise
            dispatcher = numba.njit(**options)(function)
        else:
            keyed_on_package_sources(dispatcher)
            compiled_once_across_processes(dispatcher)
        if not getattr(numba_config, "DISABLE_JIT", False):  # else plain Python
            compiled_apart(dispatcher)
            if any_layout:
                compiled_for_any_layout(dispatcher)
        return dispatcher

    return decorate


def any_layout_types(argument_types: tuple) -> tuple:
    """``argument_types`` with every array's numba layout ("C", "F") made "A" (any
    strides): the signature :func:`compiled_for_any_layout` compiles."""
    return tuple(
        kind.copy(layout="A") if isinstance(kind, types.Array) else kind for kind in argument_types
    )


def compiled_for_any_layout(dispatcher: Any) -> None:
    """Make a dispatcher compile, for arguments of new types, the specialization of
    their :func:`any_layout_types`, and call it for the arguments' own types too.

    numba types a C-contiguous array "C", a Fortran-contiguous one "F" and others "A",
    and compiles a specialization for each combination it meets. Functions whose code
    does not depend on the layout (the CPU kernels read strides, or take rows over raw
    pointers) then compile the same code again for each: a contiguous input and a
    strided view of q, with an output of either kind, made four compilations of about
    2-4 s each. Here a call with arguments of types new to the process compiles (or
    loads from the cache) the "A" specialization, and registers it with numba's
    dispatcher under the arguments' own types, so that later calls with them find it
    at once. Arguments whose arrays are all "A" already (or that hold no array) take
    numba's own path."""
    compile_for_args = dispatcher._compile_for_args

    def _compile_for_args(*args: Any, **kws: Any) -> Any:
        if kws:  # pragma: no cover - the kernels take positional arguments only
            return compile_for_args(*args, **kws)
        exact = tuple(dispatcher.typeof_pyval(argument) for argument in args)
        general = any_layout_types(exact)
        if general == exact:
            return compile_for_args(*args)
        entry = dispatcher.compile(general)
        dispatcher._insert([kind._code for kind in exact], entry, False)
        return entry

    dispatcher._compile_for_args = _compile_for_args


def has_signature(dispatcher: Any, sig: Any) -> bool:
    """Whether ``dispatcher`` has compiled (or loaded) the arguments of ``sig``."""
    return tuple(sigutils.normalize_signature(sig)[0]) in dispatcher.overloads


def compiled_apart(dispatcher: Any) -> None:
    """Make a dispatcher compile (or load from its cache) each signature new to it on a
    thread of its own (:func:`apart`); signatures it has are returned at once."""
    compile_here = dispatcher.compile

    def compile(sig: Any) -> Any:
        if has_signature(dispatcher, sig):
            return compile_here(sig)
        return apart(functools.partial(compile_here, sig), dispatcher.py_func.__module__)

    dispatcher.compile = compile


def apart(work: Callable[[], _T], module: str) -> _T:
    """``work()`` (a compilation of a function of ``module``) run on a new thread while
    this one waits: its result, or its exception raised here.

    numba's typing catches exceptions and keeps them (with their tracebacks, so the
    frames of the stack they were raised through) in reference cycles. Under a call
    those frames hold the call's arrays: a float32 call of a new signature kept its
    input and its output alive, after the caller had dropped both, until the next
    collection of the cycles (a cold cache with the collector off, in
    ``tests/test_robustness.py``; in a running program, until the collector passes over
    the generation they reached, and a pooled output's buffer was not reused
    meanwhile). On a thread of its own the compilation's frames hold only types. Run
    here instead where the new thread would wait for this one: a compilation nested in
    one this thread is running (which holds numba's compiler lock), or of a function
    whose module is being imported (a C callback compiled as its module runs: numba's
    lowering imports the module, whose import lock this thread holds); and where no
    thread can be started (at interpreter shutdown)."""
    spec = getattr(sys.modules.get(module), "__spec__", None)
    if global_compiler_lock.is_locked() or getattr(spec, "_initializing", False):
        return work()
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as error:  # raised again on the calling thread
            outcome.append((False, error))

    thread = threading.Thread(target=run, name="numba_rope compiler")
    try:
        thread.start()
    except RuntimeError:  # pragma: no cover - at interpreter shutdown
        return work()
    thread.join()
    done, value = outcome.pop()
    if not done:
        try:
            raise value
        finally:
            del value  # else a cycle: its traceback holds this frame, which holds it
    return value  # type: ignore[no-any-return]


def cached_cfunc(signature: Any, **options: Any) -> Callable[[Callable], Any]:
    """``numba.cfunc(signature, cache=True, **options)`` (what that decorator does,
    with its cache index read and written under :func:`index_lock`), compiled in memory
    where numba finds no usable cache location (see :func:`cached_njit`)."""

    def decorate(function: Callable) -> Any:
        callback = CFunc(function, sigutils.normalize_signature(signature), {}, options)
        try:
            callback.enable_caching()
        except RuntimeError as error:
            if _NO_LOCATOR not in str(error):
                raise
            return apart(lambda: numba.cfunc(signature, **options)(function), function.__module__)
        keyed_on_package_sources(callback)
        _index_locked(callback)
        apart(callback.compile, function.__module__)
        return callback

    return decorate


# -- cached code keyed on every source it was compiled from --------------------------------


@functools.cache
def package_sources() -> bytes:
    """SHA-256 of every ``.py`` file of the package (names and contents, in order of
    name): read once per process, about 0.5 MB."""
    root = pathlib.Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.digest()


def keyed_on_package_sources(compiled: Any) -> bool:
    """Make the on-disk cache of a caching dispatcher or C callback stale when any
    source file of the package changes, not only the function's own file. numba keys a
    function's cache on its own file's contents; the kernels inline code from other
    modules (the vector intrinsics, the conversions, the relay), and a change there
    alone left the machine code of the version before in use: after ``git pull`` in a
    checkout, or an upgrade that leaves the kernels' file as it was. The cache file's
    source stamp becomes (numba's stamp, :func:`package_sources`); an index saved
    under another stamp is ignored and overwritten, as numba does for an edited file.
    False (and nothing changed) on a numba whose cache lacks the attribute."""
    cache_file: Any = getattr(getattr(compiled, "_cache", None), "_cache_file", None)
    if not hasattr(cache_file, "_source_stamp"):
        return False  # pragma: no cover - another numba
    cache_file._source_stamp = (cache_file._source_stamp, package_sources())
    return True


# -- one compilation across processes ------------------------------------------------------

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: numba's cache as it is
    fcntl = None  # type: ignore[assignment]

#: The file whose byte ranges are the locks, one per cache directory.
LOCK_FILE = "numba_rope.lock"

_lock_fds: dict[str, int] = {}


@contextlib.contextmanager
def cache_lock(directory: str, name: str) -> Iterator[None]:
    """Hold, across processes, the lock called ``name`` in the cache ``directory``: a
    byte of :data:`LOCK_FILE` there, at an offset hashed from the name (POSIX record
    locks: released when the process ends, however it ends; not inherited by ``fork``
    children; a process never waits on its own lock, and taken twice, the inner release
    releases it: the names used here never nest). Where the lock cannot be taken (no
    such file can be made, a file system without locks, a deadlock the kernel
    reports), the block runs unlocked: numba's cache as it is without this module."""
    offset = int(hashlib.sha256(name.encode()).hexdigest()[:15], 16)
    fd = _lock_fds.get(directory)
    try:
        if fd is None:
            # One descriptor per file and process, never closed: closing any descriptor
            # of a file drops every record lock the process holds on it.
            fd = _lock_fds[directory] = os.open(
                os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o666
            )
        fcntl.lockf(fd, fcntl.LOCK_EX, 1, offset)
    except OSError:
        fd = None
    try:
        yield
    finally:
        if fd is not None:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, offset)


def compile_lock(dispatcher: Any, sig: Any) -> contextlib.AbstractContextManager[None]:
    """The lock a caching dispatcher of :func:`cached_njit` takes, across processes,
    to compile ``sig``: named after numba's own cache key of the signature (the
    signature, the target CPU and the hashes of the function's code and closure
    cells)."""
    index_path = dispatcher._cache._cache_file._index_path
    key = dispatcher._cache._index_key(sig, dispatcher.targetctx.codegen())
    return cache_lock(os.path.dirname(index_path), f"compile {index_path} {key!r}")


def index_lock(compiled: Any) -> contextlib.AbstractContextManager[None]:
    """The lock a caching dispatcher of :func:`cached_njit` (or C callback of
    :func:`cached_cfunc`) takes, across processes, to read or write its cache index."""
    index_path = compiled._cache._cache_file._index_path
    return cache_lock(os.path.dirname(index_path), f"index {index_path}")


def compiled_once_across_processes(dispatcher: Any) -> None:
    """Make a caching dispatcher compile each signature once across the processes that
    share its cache location, and read and write its cache index one process at a time.

    Its ``compile`` takes :func:`compile_lock` before compiling a signature new to the
    process: a process that finds it taken waits, then finds the other process's
    result in the cache and loads it. Its cache file's ``save`` and ``load`` take
    :func:`index_lock`, so that an entry is never lost or paired with another entry's
    data file (see the module's docstring). Compilation within a process holds numba's
    compiler lock; it is taken first here too, so that a thread never waits on a file
    lock held by another thread of its own process that waits for the compiler lock.
    Without ``fcntl`` (Windows), or on a numba whose cache lacks these attributes, the
    dispatcher is left as it is."""
    if not _index_locked(dispatcher):
        return  # pragma: no cover - Windows, or another numba
    compile_now = dispatcher.compile

    def compile(sig: Any) -> Any:
        with global_compiler_lock:
            if has_signature(dispatcher, sig):
                return compile_now(sig)  # compiled or loaded before: no lock, no key
            with compile_lock(dispatcher, sig):
                return compile_now(sig)

    dispatcher.compile = compile


def _index_locked(compiled: Any) -> bool:
    """Make the cache file of a caching dispatcher or C callback read and write its
    index under :func:`index_lock`; False (and nothing changed) without ``fcntl`` or
    on a numba whose cache lacks the attributes used here."""
    cache: Any = getattr(compiled, "_cache", None)
    cache_file: Any = getattr(cache, "_cache_file", None)
    if fcntl is None or not hasattr(cache_file, "_index_path") or not hasattr(cache, "_index_key"):
        return False  # pragma: no cover - Windows, or another numba
    save, load = cache_file.save, cache_file.load

    def save_locked(key: Any, data: Any) -> None:
        with index_lock(compiled):
            save(key, data)
        forget_other_versions(cache_file)

    def load_locked(key: Any) -> Any:
        with index_lock(compiled):
            return load(key)

    cache_file.save, cache_file.load = save_locked, load_locked
    return True


#: The name of a cache index file: ``<module>.<qualname>-<line>.<python tag>.nbi``.
_INDEX_NAME = re.compile(r"(?P<function>.+)-(?P<line>\d+)\.(?P<tag>[^.]+)\.nbi")


def forget_other_versions(cache_file: Any) -> list[str]:
    """Delete the cache files that other versions of the package left for the function
    of ``cache_file`` (a numba cache file of :func:`keyed_on_package_sources`), and
    return their names. numba names a function's cache files after the line it starts
    on, and reads only the files of its current line: whenever a change moved the
    function, its machine code of before stayed on disk for good (in a development
    checkout, 113 MB in ``_cpu/__pycache__`` after a few days; after an upgrade, the
    version before's). Called after each save (a compilation, which takes far longer
    than this): the index files of the same function at other lines whose stamp names
    other sources of the package go, with their data files. Index files of this
    version (another function of the same name), of another numba version, or that
    cannot be read stay, as does anything that cannot be deleted. POSIX only, with the
    index lock (:func:`_index_locked`, whose save calls it)."""
    name = _INDEX_NAME.fullmatch(getattr(cache_file, "_index_name", ""))
    stamp = getattr(cache_file, "_source_stamp", None)
    if name is None or not isinstance(stamp, tuple) or len(stamp) != 2:
        return []  # pragma: no cover - another numba, or not keyed on the sources
    directory = cache_file._cache_path
    function, tag = re.escape(name["function"]), re.escape(name["tag"])
    index_pattern = re.compile(rf"{function}-(\d+)\.{tag}\.nbi")
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    deleted = []
    for other in names:
        match = index_pattern.fullmatch(other)
        if match is None or match[1] == name["line"]:
            continue
        if not _saved_by_other_sources(os.path.join(directory, other), stamp[1]):
            continue
        data_pattern = re.compile(rf"{function}-{match[1]}\.{tag}\.\d+\.nbc")
        for stale in [other, *filter(data_pattern.fullmatch, names)]:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, stale))
                deleted.append(stale)
    return deleted


def _saved_by_other_sources(index_path: str, sources: bytes) -> bool:
    """Whether the cache index at ``index_path`` was saved by this numba for other
    sources of the package than ``sources`` (:func:`package_sources`): its stamp is
    not (numba's stamp, ``sources``). False where it cannot be read."""
    try:
        with open(index_path, "rb") as index:
            if pickle.load(index) != numba.__version__:
                return False  # another numba's: not ours to judge
            stamp, _ = pickle.loads(index.read())
    except Exception:  # unreadable (being written, truncated, not a pickle): kept
        return False
    return not (isinstance(stamp, tuple) and len(stamp) == 2 and stamp[1] == sources)


# -- parallel regions after fork -----------------------------------------------------------

_forked_from_openmp = False


def _after_fork_in_child() -> None:
    global _forked_from_openmp
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel region ran before the fork: threads start here afresh
        return
    if layer == "omp":
        _forked_from_openmp = True


if hasattr(os, "register_at_fork"):  # POSIX only: Windows has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
    # numba's compiler lock, held across the fork: a thread compiling at that moment
    # (numba_rope compiles on a thread of its own, see apart) would otherwise leave it
    # held in the child, where no thread releases it, and the child's first call that
    # compiles or loads a function from numba's cache would wait for ever. A fork waits
    # for a compilation under way to end, as the logging module's lock makes it wait
    # for a record being written; the forking thread may hold the lock itself (it is
    # reentrant).
    os.register_at_fork(
        before=global_compiler_lock.acquire,
        after_in_parent=global_compiler_lock.release,
        after_in_child=global_compiler_lock.release,
    )


def parallel_regions_usable() -> bool:
    """False in a process forked (directly or not) from one that had started numba's
    OpenMP threads: a parallel region would kill it. Callers then run serial code."""
    return not _forked_from_openmp


# -- numba's thread count, without starting its threads ------------------------------


def thread_count() -> int:
    """``numba.get_num_threads()`` without its side effect of starting numba's worker
    threads (which would, among other things, keep a later ``fork`` child from running
    parallel regions, see :func:`parallel_regions_usable`), and at a sixth of its cost:
    before numba has started them, no ``set_num_threads`` can have run (it starts
    them), so the count is ``NUMBA_NUM_THREADS``; after, numba's own per-thread count is
    read."""
    try:
        if not _numba_parallel._is_initialized:
            return int(numba_config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
        return int(_numba_parallel._get_num_threads())  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover - a numba without these names
        return numba.get_num_threads()


# -- NUMBA_DISABLE_JIT ---------------------------------------------------------------------

JIT_DISABLED_MESSAGE = (
    "numba_rope needs numba's JIT compiler: NUMBA_DISABLE_JIT=1 is not supported "
    "(the rotation kernels are built from numba intrinsics and overloads, which exist "
    "only in compiled code). Unset NUMBA_DISABLE_JIT; numba_rope.reference and "
    "numba_rope.rope_cache (slowly) run without the JIT."
)


def require_jit() -> None:
    """Raise RuntimeError with :data:`JIT_DISABLED_MESSAGE` if numba's JIT is off."""
    if getattr(numba_config, "DISABLE_JIT", False):
        raise RuntimeError(JIT_DISABLED_MESSAGE)
