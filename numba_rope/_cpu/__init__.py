"""The CPU: :mod:`~numba_rope._cpu.backend` (launch policy, plans, NumPy arrays in and
out), :mod:`~numba_rope._cpu.kernels` (the ``@njit`` loops) and
:mod:`~numba_rope._cpu.vector` (their hand-written LLVM vector steps)."""
