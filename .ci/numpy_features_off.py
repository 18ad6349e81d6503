"""Print the NPY_DISABLE_CPU_FEATURES value that switches off every SIMD target NumPy
dispatches to on this machine above its baseline (e.g. "X86_V3 X86_V4 AVX512_ICL" on an
AVX-512 x86 machine), so that a second test run takes NumPy's baseline code paths.

NumPy refuses to disable baseline features and names that are not dispatch targets, so
only the dispatch targets this CPU has are printed; nothing when there are none.
"""

try:
    from numpy._core import _multiarray_umath as umath  # NumPy 2
except ImportError:  # pragma: no cover - NumPy 1.x
    from numpy.core import _multiarray_umath as umath

present = umath.__cpu_features__
print(" ".join(name for name in umath.__cpu_dispatch__ if present.get(name)))
