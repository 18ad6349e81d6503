"""bfloat16 and float16 inputs with float32 caches.

16-bit inputs are widened to float32, rotated in float32 and rounded once to their own
dtype. The caches may be the input's dtype or float32: float32 caches keep cos and sin at
float32 precision instead of rounding them to 8 (bfloat16) or 11 (float16) significant
bits first. The output's own rounding still dominates, so the gain is modest (a mean
error about a quarter lower here), but it costs nothing: the caches are small.

Run: python examples/half_precision.py
"""

import ml_dtypes
import numpy as np

import numba_rope
from numba_rope import reference

batch, num_heads, seq_len, head_size = 2, 16, 256, 128
rng = np.random.default_rng(0)

# Real RoPE angles: position p, pair i turns by p * 10000 ** (-2i / head_size).
inverse_frequency = 10000.0 ** (-np.arange(0, head_size, 2) / head_size)
angles = np.arange(4096)[:, np.newaxis] * inverse_frequency  # [positions, head_size/2]
cos64, sin64 = np.cos(angles), np.sin(angles)
cos32, sin32 = cos64.astype(np.float32), sin64.astype(np.float32)
position_ids = np.sort(rng.integers(0, 4096, size=(batch, seq_len)), axis=1)

for dtype in (ml_dtypes.bfloat16, np.float16):
    name = np.dtype(dtype).name
    x = rng.standard_normal((batch, num_heads, seq_len, head_size)).astype(dtype)

    y = numba_rope.rotary_embedding(x, cos32, sin32, position_ids)  # float32 caches
    assert y.dtype == dtype

    # The contract: the float32 result rounded once, so within one unit in the last place
    # of the float64 reference (computed from the same float32 caches).
    want = reference.rotary_embedding(x, cos32, sin32, position_ids).astype(np.float64)
    got = y.astype(np.float64)
    eps = float(ml_dtypes.finfo(dtype).eps)
    assert np.all(np.abs(got - want) <= eps * np.abs(want) + 1e-6), name

    # Against the exact rotation (float64 angles, no rounding of the output), float32
    # caches beat caches rounded to the input's dtype.
    exact = reference.rotary_embedding(x.astype(np.float64), cos64, sin64, position_ids)
    y_16bit_caches = numba_rope.rotary_embedding(
        x, cos64.astype(dtype), sin64.astype(dtype), position_ids
    )
    error_32 = np.abs(got - exact).mean()
    error_16 = np.abs(y_16bit_caches.astype(np.float64) - exact).mean()
    assert error_32 < error_16, (name, error_32, error_16)
    print(
        f"{name:<9} mean |error| vs exact rotation: float32 caches {error_32:.2e}, "
        f"{name} caches {error_16:.2e}: ok"
    )
