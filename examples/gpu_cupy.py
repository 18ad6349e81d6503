"""numba_rope on a GPU with CuPy arrays: the same function, the device follows the arrays.

The result is a CuPy array on the input's device; ``out=`` may be a CuPy array too
(here the input itself). CuPy has no bfloat16: use torch tensors for that (see
gpu_torch.py). Without CuPy or a GPU this script says so and exits successfully.

Run: python examples/gpu_cupy.py
"""

import importlib.util
import sys


def cupy_or_skip():
    """CuPy, if it is installed and sees a GPU; else say why and exit 0."""
    if importlib.util.find_spec("cupy") is None:
        print("skipping: CuPy is not installed (pip install cupy-cuda12x)")
        sys.exit(0)
    import cupy

    try:
        devices = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as error:
        devices, why = 0, str(error)
    else:
        why = "CuPy sees no CUDA device"
    if devices == 0:
        print(f"no GPU, skipping: {why}")
        sys.exit(0)
    return cupy


cupy = cupy_or_skip()

import numpy as np  # noqa: E402

import numba_rope  # noqa: E402
from numba_rope import reference  # noqa: E402

batch, num_heads, seq_len, head_size = 4, 32, 512, 128
rng = np.random.default_rng(0)
inverse_frequency = 10000.0 ** (-np.arange(0, head_size, 2) / head_size)
angles = np.arange(4096)[:, np.newaxis] * inverse_frequency

cos_cache = cupy.asarray(np.cos(angles), dtype=cupy.float32)  # float32 caches on the GPU
sin_cache = cupy.asarray(np.sin(angles), dtype=cupy.float32)
position_ids = cupy.asarray(rng.integers(0, 4096, size=(batch, seq_len)))

for dtype in (np.float32, np.float16):
    x = cupy.asarray(rng.standard_normal((batch, num_heads, seq_len, head_size)), dtype=dtype)

    y = numba_rope.rotary_embedding(x, cos_cache, sin_cache, position_ids)
    cupy.cuda.Device().synchronize()  # kernels are asynchronous: wait before timing/reading
    assert isinstance(y, cupy.ndarray) and y.dtype == dtype

    # Check on the host against the float64 oracle. Rounding errors scale with the terms
    # x*cos and x*sin (|cos| + |sin| <= sqrt(2)); the GPU may also fuse a*c - b*s into
    # one multiply-add, which moves a result by a unit in the last place at most.
    x_host = cupy.asnumpy(x)
    want = reference.rotary_embedding(
        x_host, cupy.asnumpy(cos_cache), cupy.asnumpy(sin_cache), cupy.asnumpy(position_ids)
    )
    tolerance = 4 * float(np.finfo(dtype).eps) * float(np.abs(x_host).max()) * np.sqrt(2)
    error = np.abs(cupy.asnumpy(y).astype(np.float64) - want.astype(np.float64))
    assert error.max() <= tolerance, (dtype, error.max(), tolerance)

    numba_rope.rotary_embedding(x, cos_cache, sin_cache, position_ids, out=x)  # in place
    cupy.cuda.Device().synchronize()
    assert cupy.array_equal(x, y)
    print(f"CuPy {np.dtype(dtype).name}: {y.shape} on GPU {y.device.id}, checked: ok")
