"""Tuning constants, read at call time so that tests and users can change them.

Changing a constant never changes a result: every element is computed by the same
arithmetic whatever the split of the work. Each is checked when it is set (an integer
in its range, see ``_RANGES``): a bad value raises ``ValueError`` at the assignment,
and a name that is not a constant (a misspelt one) ``AttributeError``.
"""

from __future__ import annotations

import difflib
import operator
import sys
import types
from collections.abc import Callable

import numpy as np

#: Inputs with fewer elements than this run on the calling thread: waking the worker
#: threads costs more than the work (and can stall for milliseconds when another
#: process keeps the other cores busy).
PARALLEL_MIN_ELEMENTS: int = 1 << 20

#: Calls with at least this many elements, but fewer than ``PARALLEL_MIN_ELEMENTS``,
#: share their work with one helper thread that the caller waits for only when it has
#: taken a chunk (see ``numba_rope._cpu.helper``): a decode step (64, 32, 1, 128) in
#: float32 goes twice as fast with it on two idle cores. Below it a call runs alone,
#: by its compiled plan once repeated. On the 2-core Zen 4 VM, sharing took (one
#: process, ``out=``, the helper of 2026-12-07) 0.73-0.87x the time of running alone at
#: 32 Ki elements (the specification's example (2, 8, 4, 512) and (8, 32, 1, 128), in
#: float32, float16 and bfloat16), 0.70-0.72x at 64 Ki, 0.90-1.01x at 16 Ki and
#: 1.09-1.13x at 8 Ki (docs/performance.md, "Forty-seventh session"); on the Emerald
#: Rapids VM the example 0.90-0.93x. (This was 64 Ki until then: on 2026-12-01, with
#: the helper of that day, sharing took 1.1-1.7x the time at 32 Ki on a Zen 4 VM.)
HELPER_MIN_ELEMENTS: int = 1 << 15

#: How long the helper thread spins after its last chunk, waiting for the next call,
#: before it sleeps (a sleeping helper joins a later call, never the one that wakes it:
#: that call runs alone).
HELPER_SPIN_MICROSECONDS: int = 1000

#: Number of work chunks per worker thread in the parallel CPU kernel; more than one
#: evens out the load when a core is shared.
CHUNKS_PER_THREAD: int = 4

#: Number of chunks per thread of a call shared with the helper thread (the caller and
#: the helper take them one at a time). Each claim moves a cache line between the
#: cores, and a thread that finishes first waits for the other's last chunk (fewer,
#: larger chunks: a helper slowed by another process holds more of the call). On the
#: 2-core Intel AVX-512 VM a decode step (64, 32, 1, 128) took 0.93-0.99x the time with
#: 2 against 4, and 0.93-0.975x with 1 (docs/performance.md, "Thirty-second session").
HELPER_CHUNKS_PER_THREAD: int = 2

#: Tokens per tile of the CPU kernels: a unit of work is one sequence's tile of tokens
#: over all its heads (or a group of them). Inputs whose heads lie outside tokens in
#: memory (``bhsd``) are rotated head by head over the tile: long tiles give each head
#: one long stream. On the 2-core Zen 4 VM, 8192 against 1024 took the prefill (1, 32,
#: 4096, 128) 0.75-0.93x the time, allocating calls included, batch prefill and partial
#: unchanged (docs/performance.md); on the AVX2 VM 256 to 4096 were equal and 16 slower.
#: Inputs with heads inside tokens (``bshd``, 3-D) go token by token in tiles that
#: give each thread whole tokens (:func:`numba_rope._cpu.backend.work_split`).
TOKENS_PER_TILE: int = 8192

#: Large ``bhsd`` calls whose cache rows for consecutive tokens lie further apart than a
#: row (caches of positions broadcast over the batch, ``[batch, seq_len, half]`` with
#: the batch the inner axis; transformers' ``cat(freqs, freqs)`` cut in half) take
#: tiles short enough that a tile's rows span at most this many bytes of each cache, so
#: that the heads of a tile find them in the CPU's cache (with tiles of
#: :data:`TOKENS_PER_TILE` they were read again for every head: a prefetcher finds few
#: such rows in a page). Before, such caches were copied into dense rows at each call.
#: On the Intel AVX-512 VM (2 MiB of L2 per core), one process against that copy:
#: 0.64-0.94x the time for calls of 8 to 64 MiB, but 1.01-1.10x for the float32 batch
#: prefill (8, 32, 1024, 128) (128 MiB, bound by memory), whose C-contiguous caches take
#: 0.89-0.94x; there 32 KiB to 1 MiB took 1.06-1.15x, no cap 1.24x
#: (docs/performance.md, "Thirty-seventh session").
CACHE_SPAN_BYTES: int = 256 << 10

#: Outputs of at least this many bytes (q and k together) are written with non-temporal
#: stores, straight to memory: a third less memory traffic (the output is not read into
#: the cache first), but the result is not left in the cache for whoever reads it next,
#: so only for outputs larger than a last-level cache. Only for rows on 16-byte
#: boundaries (NumPy's large arrays are); results are the same bits.
STREAMING_MIN_BYTES: int = 16 << 20

#: Bytes of freed outputs that CPU calls may keep for reuse (0: none). An allocating
#: call's output of 16 MiB or more is taken from buffers that earlier calls returned and
#: their callers have since dropped (nothing refers to them any more), so its pages are
#: not faulted in and zeroed by the operating system again: what onnxruntime's arena
#: does for its ``run()``, and CuPy's memory pool on the GPU (see
#: ``numba_rope._cpu.pool``). On the 2-core Zen 4 VM the allocating prefill (1, 4096,
#: 32 * 128) float32 took 2.8 ms with it against 6.0 ms without. The memory stays with
#: the process, up to this many bytes; setting the value releases what is over it at
#: once (``0`` releases everything and turns the pool off).
OUTPUT_POOL_BYTES: int = 256 << 20

#: Threads per block of the CUDA kernels. Tests shrink it so that tiny inputs span
#: several blocks in the CUDA simulator.
CUDA_THREADS_PER_BLOCK: int = 256

#: Heads each CUDA thread rotates for its pair: the position id, the cache reads and the
#: index arithmetic are shared by them, and all their loads are issued before the first
#: store (more bytes in flight per thread). Compiled into the kernel: each value gets its
#: own compilation.
CUDA_HEADS_PER_THREAD: int = 4

#: Most blocks per grid dimension; larger inputs are covered by grid-stride loops.
#: 65535 is the hardware limit on the y dimension. Tests shrink it to exercise the loops.
CUDA_MAX_BLOCKS: int = 65535


#: The range each constant must lie in: ``(least, most)``, most None for no bound.
#: Checked when a constant is set (see ``_CheckedConfig``), so a call never meets a
#: value that would skip its work or divide by zero.
_RANGES: dict[str, tuple[int, int | None]] = {
    "PARALLEL_MIN_ELEMENTS": (0, None),
    "CHUNKS_PER_THREAD": (1, None),
    "HELPER_CHUNKS_PER_THREAD": (1, None),
    "HELPER_MIN_ELEMENTS": (0, None),
    "HELPER_SPIN_MICROSECONDS": (0, None),
    "TOKENS_PER_TILE": (1, None),
    "CACHE_SPAN_BYTES": (1, None),
    "STREAMING_MIN_BYTES": (0, None),
    "OUTPUT_POOL_BYTES": (0, None),
    "CUDA_THREADS_PER_BLOCK": (1, 1024),  # the hardware's limit per block
    "CUDA_HEADS_PER_THREAD": (1, None),
    "CUDA_MAX_BLOCKS": (1, None),
}


#: Functions called after any constant of ``_RANGES`` is set (see :func:`on_change`).
_listeners: list[Callable[[], None]] = []


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener()`` whenever a tuning constant is set: what was decided under
    the old value (the CPU backend's compiled plans) is then forgotten."""
    _listeners.append(listener)


class _CheckedConfig(types.ModuleType):
    """This module, with its constants checked when they are set: an integer in its
    range (``numba_rope.config.TOKENS_PER_TILE = 0`` raises ``ValueError`` at once)."""

    def __setattr__(self, name: str, value: object) -> None:
        bounds = _RANGES.get(name)
        if bounds is None and not name.startswith("_") and not hasattr(self, name):
            # A misspelt constant would be set and never read: refused, as a misspelt
            # keyword is.
            close = difflib.get_close_matches(name, _RANGES, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise AttributeError(
                f"numba_rope.config has no constant {name}{hint} (the constants: "
                f"{', '.join(_RANGES)})"
            )
        if bounds is not None:
            least, most = bounds
            try:
                number = operator.index(value)  # type: ignore[arg-type]
            except TypeError:
                number = None
            if (
                number is None
                or isinstance(value, (bool, np.bool_))
                or number < least
                or (most is not None and number > most)
            ):
                rule = f">= {least}" if most is None else f"in [{least}, {most}]"
                raise ValueError(
                    f"numba_rope.config.{name} must be an integer {rule}, got {value!r}"
                )
            value = number
        super().__setattr__(name, value)
        if bounds is not None:
            for listener in _listeners:
                listener()


sys.modules[__name__].__class__ = _CheckedConfig
