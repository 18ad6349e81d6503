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
* ``NUMBA_DISABLE_JIT=1`` turns ``@njit`` functions into plain Python, in which the
  rotation kernels cannot run (they are built from numba intrinsics and overloads):
  :func:`require_jit` raises a clear error instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numba
from numba.core import config as numba_config
from numba.np.ufunc import parallel as _numba_parallel

#: What ``numba.njit(cache=True)`` raises when no cache location is usable.
_NO_LOCATOR = "no locator available"


def cached_njit(**options: Any) -> Callable[[Callable], Any]:
    """``numba.njit(cache=True, **options)``, or ``numba.njit(**options)`` (compiled in
    memory, each process) where numba finds no usable cache location for the function's
    file. numba's own choice of location, ``NUMBA_CACHE_DIR`` first, is kept."""

    def decorate(function: Callable) -> Any:
        try:
            return numba.njit(cache=True, **options)(function)
        except RuntimeError as error:
            if _NO_LOCATOR not in str(error):
                raise
        return numba.njit(**options)(function)

    return decorate


def cached_cfunc(signature: Any, **options: Any) -> Callable[[Callable], Any]:
    """``numba.cfunc(signature, cache=True, **options)``, compiled in memory where numba
    finds no usable cache location (see :func:`cached_njit`)."""

    def decorate(function: Callable) -> Any:
        try:
            return numba.cfunc(signature, cache=True, **options)(function)
        except RuntimeError as error:
            if _NO_LOCATOR not in str(error):
                raise
        return numba.cfunc(signature, **options)(function)

    return decorate


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
