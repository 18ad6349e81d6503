"""Tuning constants, read at call time so that tests and users can change them.

Changing a constant never changes a result: every element is computed by the same
arithmetic whatever the split of the work.
"""

from __future__ import annotations

#: Inputs with fewer elements than this run on the calling thread: waking the worker
#: threads costs more than the work (and can stall for milliseconds when another
#: process keeps the other cores busy).
PARALLEL_MIN_ELEMENTS: int = 1 << 20

#: Number of work chunks per worker thread in the parallel CPU kernel; more than one
#: evens out the load when a core is shared.
CHUNKS_PER_THREAD: int = 4

#: Threads per block of the CUDA kernels. Tests shrink it so that tiny inputs span
#: several blocks in the CUDA simulator.
CUDA_THREADS_PER_BLOCK: int = 256
