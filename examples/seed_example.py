"""The specification's example, run with numba_rope.

TensorRT's RotaryEmbedding sample: input [batch=2, num_heads=8, seq_len=4, head_size=512],
cos/sin caches of 100 positions x 256 pairs, one position id per (batch, token), the
whole head rotating (rotary_embedding_dim=0) in halves (interleaved=False).

Run: python examples/seed_example.py
"""

import numpy as np

import numba_rope
from numba_rope import reference

rng = np.random.default_rng(0)
x = rng.random((2, 8, 4, 512)).astype(np.float32)  # the sample's np.random.rand(...).astype("f")
cos_cache = rng.random((100, 256)).astype(np.float32)
sin_cache = rng.random((100, 256)).astype(np.float32)
position_ids = np.array([[6, 2, 1, 7], [2, 8, 3, 6]])  # token (b, s) uses cache row ids[b, s]

y = numba_rope.rotary_embedding(
    x, cos_cache, sin_cache, position_ids, interleaved=False, rotary_embedding_dim=0
)

# The float64 NumPy oracle: same arguments, computed in float64 and rounded once.
y_reference = reference.rotary_embedding(x, cos_cache, sin_cache, position_ids)
error = float(np.abs(y.astype(np.float64) - y_reference.astype(np.float64)).max())
# float32 arithmetic: a few units in the last place of the terms x*cos, x*sin (here < 2).
assert y.shape == x.shape and y.dtype == np.float32
assert error <= 4 * np.finfo(np.float32).eps * 2, error

# Pair 0 of token (b=0, s=0) by hand: it uses cache row 6 and rotates x[..., 0] with x[..., 256].
x1, x2 = x[0, 0, 0, 0], x[0, 0, 0, 256]
c, s = cos_cache[6, 0], sin_cache[6, 0]
assert y[0, 0, 0, 0] == x1 * c - x2 * s and y[0, 0, 0, 256] == x2 * c + x1 * s

# In place: out may be the input itself.
numba_rope.rotary_embedding(x, cos_cache, sin_cache, position_ids, out=x)
assert np.array_equal(x, y)

print(f"seed example: output {y.shape} {y.dtype}, max |error| vs float64 reference {error:.2e}: ok")
