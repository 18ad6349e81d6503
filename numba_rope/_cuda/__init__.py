"""The GPU: :mod:`~numba_rope._cuda.backend` (views, streams, launches, the caller's
array types in and out) and :mod:`~numba_rope._cuda.kernels` (the ``@cuda.jit``
kernels). Nothing here is imported until a call's arrays are on the GPU."""
