"""The helper thread: a second thread for calls too small for numba's parallel regions
(see :mod:`numba_rope._cpu.relay` for how a call shares its chunks with it).

One daemon thread per process, started by the first call that can use it. It runs
:func:`numba_rope._cpu.relay.serve`, compiled, without the GIL, and never returns to
Python until it is stopped (at exit): a thread that needed the GIL to join a call
would wait for it while the caller holds it. It spins on the control block for
``config.HELPER_SPIN_MICROSECONDS`` after its last chunk, then sleeps: on Linux on a
futex that the next call wakes (that call runs alone: woken, the helper would come late
to it, see :func:`numba_rope._cpu.relay.rouse`), elsewhere in growing steps (50 us to
10 ms), looking for work between them. It runs any kind of job: each job
names the compiled function that runs its chunks (:func:`numba_rope._cpu.kernels.make_runner`,
made here on the caller's thread the first time a kind is seen). No call waits for
the helper to wake or start, only for a chunk it has claimed.

Not used where it cannot help: one numba thread (``numba.set_num_threads(1)`` or
``NUMBA_NUM_THREADS=1``), or calls below ``config.HELPER_MIN_ELEMENTS``. After
``os.fork`` the child starts its own helper when it needs one; at exit the helper is
stopped before the interpreter tears down.

On Linux the helper keeps off the CPU of the caller whose job it serves: a call wakes
it with the caller's CPU taken out of its CPUs for the moment, and a helper that finds
itself there, when a job wakes it or while it spins, moves to another CPU the process
may use (:func:`numba_rope._cpu.relay.wake_apart`, :func:`~numba_rope._cpu.relay.keep_apart`).
Two threads on one CPU take turns rather than share the work, and the scheduler of a
virtual machine tends to leave them so.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import platform
import sys
import threading
import time
from typing import Any

import numpy as np

from numba_rope import config
from numba_rope._cpu import relay
from numba_rope._cpu.kernels import make_runner
from numba_rope._jit import thread_count

#: The futex system call's number, by machine (Linux).
_FUTEX_NUMBERS = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}

#: The numbers of sched_getaffinity and sched_setaffinity, by machine (Linux).
_AFFINITY_NUMBERS = {
    "x86_64": (204, 203),
    "amd64": (204, 203),
    "aarch64": (123, 122),
    "arm64": (123, 122),
}


def _libc_address(posix: str, windows: str | None) -> int:
    """Address of the C library's function ``posix`` (``windows`` from kernel32 on
    Windows), 0 if there is none."""
    try:
        if os.name == "nt":
            if windows is None:
                return 0
            function: Any = getattr(ctypes.windll.kernel32, windows)  # type: ignore[attr-defined]
        else:
            function = getattr(ctypes.CDLL(ctypes.util.find_library("c")), posix)
        return ctypes.cast(function, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):  # pragma: no cover - every platform we know has them
        return 0


def _like(array: Any) -> Any:
    """A tiny array of ``array``'s dtype and dimensions, not contiguous (numba layout
    "A"): the helper's loop is compiled for arrays like it, whatever the call's layout.
    None and integers (one position offset) stand for themselves."""
    if array is None:
        return None
    if not isinstance(array, np.ndarray):
        return np.int64(0)
    return np.zeros((1,) * (array.ndim - 1) + (4,), array.dtype)[..., ::2]


class Helper:
    """The helper thread and its control block (see :mod:`numba_rope._cpu.relay`)."""

    def __init__(self) -> None:
        storage = np.zeros(relay.BLOCK_SLOTS + 8, np.int64)
        start = (-storage.ctypes.data % 64) // 8  # counters on their own cache lines
        self.block = storage[start : start + relay.BLOCK_SLOTS]
        self.thread: threading.Thread | None = None
        self.spin_microseconds = -1  # none given yet
        self.turns_per_microsecond = 0.0
        self.yield_address = _libc_address("sched_yield", "SwitchToThread")
        self.sleep_address = _libc_address("usleep", "Sleep")
        self.block[relay.SLEEP_UNIT] = 1000 if os.name == "nt" else 1  # Sleep takes ms
        machine = platform.machine().lower()
        futex = _FUTEX_NUMBERS.get(machine)
        #: The CPU masks read and set to keep the helper off the caller's CPU
        #: (relay.exclude_cpu): the helper's two, then the callers' two.
        self.masks = np.zeros(4 * relay.MASK_WORDS, np.int64)
        if sys.platform.startswith("linux") and futex is not None:
            self.block[relay.SYSCALL] = _libc_address("syscall", None)
            self.block[relay.FUTEX] = futex
            self.block[relay.TIMESPEC : relay.TIMESPEC + 2] = (0, 100_000_000)  # 100 ms
            affinity = _AFFINITY_NUMBERS.get(machine)
            if self.block[relay.SYSCALL] and affinity is not None:
                self.block[relay.GETCPU] = _libc_address("sched_getcpu", None)
                self.block[relay.MASKS] = self.masks.ctypes.data
                self.block[relay.GET_AFFINITY], self.block[relay.SET_AFFINITY] = affinity
        self.block[relay.CALLER_CPU] = -1

    def start(self) -> None:
        """Start the helper thread unless it runs, and give it this moment's
        ``config.HELPER_SPIN_MICROSECONDS`` (returns at once). Python threads that
        call at once start one thread: the first takes :data:`_lock`, the others wait
        for it and then find the thread started."""
        if self.thread is None or self.spin_microseconds != config.HELPER_SPIN_MICROSECONDS:
            with _lock:
                self._start()

    def _start(self) -> None:
        # start()'s work, under _lock: compiling relay.serve and starting the thread let
        # other Python threads run, which would otherwise start a second helper thread
        # on this block.
        if self.spin_microseconds != config.HELPER_SPIN_MICROSECONDS:
            self.spin_microseconds = config.HELPER_SPIN_MICROSECONDS
            if not self.turns_per_microsecond:
                self.turns_per_microsecond = _turns_per_microsecond(self.block)
            turns = self.spin_microseconds * self.turns_per_microsecond
            self.block[relay.SPINS] = min(int(turns), 1 << 62)
        if self.thread is None:
            # Compiled (or loaded) here: the new thread, needing the GIL at every step
            # of that while the caller holds it, would take seconds. A block asking to
            # stop makes the loop return at once.
            stopped = np.zeros(relay.BLOCK_SLOTS, np.int64)
            stopped[relay.STOP] = 1
            relay.serve(stopped, 0, 0)
            self.thread = threading.Thread(
                target=relay.serve,
                args=(self.block, self.yield_address, self.sleep_address),
                name="numba_rope helper",
                daemon=True,
            )
            self.thread.start()
            if self.block[relay.MASKS]:  # callers wake it off their CPU (wake_apart)
                self.block[relay.HELPER_THREAD] = self.thread.native_id or 0

    def stop(self) -> None:
        """Ask the helper to stop and wait (a second at most) for it."""
        block = self.block
        block[relay.STOP] = 1
        block[relay.HELPER_THREAD] = 0  # callers no longer touch its CPUs
        if block[relay.SYSCALL] and block[relay.SLEEPING]:
            block[relay.SLEEPING] = 0
            syscall = ctypes.CFUNCTYPE(ctypes.c_long, *(ctypes.c_long,) * 5)
            address = block.ctypes.data + 8 * relay.SLEEPING
            syscall(int(block[relay.SYSCALL]))(
                int(block[relay.FUTEX]), address, relay.FUTEX_WAKE, 1, 0
            )
        if self.thread is not None:
            self.thread.join(timeout=1.0)


def _turns_per_microsecond(block: np.ndarray) -> float:
    """How many idle turns of the helper's loop make a microsecond, measured."""
    relay.idle_turns(block, 1)  # compiled (or loaded) first
    turns = 20000
    start = time.perf_counter()
    relay.idle_turns(block, turns)
    return turns / (max(time.perf_counter() - start, 1e-6) * 1e6)


#: Runners by kernel options and argument dtypes and dimensions (see :func:`runner`).
#: Kept for the life of the process: the compiled code lives as long as the cfunc
#: object does, and jobs and compiled plans hold its address.
_RUNNERS: dict[tuple, Any] = {}


def runner(options: tuple, arrays: tuple) -> Any:
    """The compiled function (a numba cfunc; ``.address`` is its address) that runs a
    chunk of a job of the kernels of ``options`` with arguments like ``arrays`` (x, k,
    cos, sin, positions), compiled (or loaded from numba's cache) the first time, on
    the caller's thread. Every kernel rotates its chunks by it (see
    :func:`numba_rope._cpu.kernels.serial`): the calling thread, numba's threads, the
    helper and the compiled plans (:func:`numba_rope._cpu.kernels.planned`)."""
    signature = (options, *(_signature(a) for a in arrays))
    found = _RUNNERS.get(signature)
    if found is None:
        found = _RUNNERS[signature] = make_runner(options, tuple(_like(a) for a in arrays))
    return found


def _signature(array: Any) -> Any:
    if array is None:
        return None
    if not isinstance(array, np.ndarray):
        return int
    return array.dtype, array.ndim


_helper: Helper | None = None

#: Held while the helper is made and while its thread is started: both let other
#: Python threads run (``Helper()`` looks up the C library, which may start a
#: process; starting compiles or loads the loop), and two threads calling at once
#: would otherwise make two helpers, or start two threads on one block. A helper
#: made and dropped that way had already started its thread, which went on writing
#: CPU masks into the dropped helper's freed array.
_lock = threading.Lock()


def helper() -> Helper:
    """This process's helper (made on first use; one, whichever threads call at once)."""
    global _helper
    found = _helper
    if found is None:
        with _lock:
            if _helper is None:
                _helper = Helper()
            found = _helper
    return found


def usable(size: int) -> bool:
    """Whether a call of ``size`` elements on the calling thread shares its work with
    the helper: at least ``config.HELPER_MIN_ELEMENTS``, and more than one numba
    thread."""
    return size >= config.HELPER_MIN_ELEMENTS and thread_count() > 1


def _forget_after_fork() -> None:
    # The child has no helper thread; a call there starts one with a block of its own.
    # The lock too is new: another thread of the parent may have held it at the fork.
    global _helper, _lock
    _helper = None
    _lock = threading.Lock()


def _stop_at_exit() -> None:
    if _helper is not None:
        _helper.stop()


if hasattr(os, "register_at_fork"):  # POSIX only: Windows has no fork
    os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(_stop_at_exit)
