"""Independent oracles for the tests. None of them calls numba_rope's kernels.

* :func:`float32_contract`: the numerical contract emulated with NumPy, one operation at
  a time: inputs and caches converted to the compute type (float32, or float64 for
  float64 input), ``x1*cos - x2*sin`` and ``x2*cos + x1*sin`` evaluated with one rounding
  per operation, the result rounded once to the input dtype by NumPy/ml_dtypes.
  Written with explicit per-token loops over the cache rows so that it shares no
  indexing code with the reference.
* :func:`tensorrt_reference`: the specification's own NumPy reference, verbatim in
  behaviour (complex arithmetic), for finite inputs.

Why the tolerances hold on every CPU: :func:`float32_contract` and
``numba_rope.reference`` use only IEEE ``+ - *`` on float32/float64 arrays and rounding
casts (NumPy's float16 cast, ml_dtypes' bfloat16 cast), which give the same bits on
every CPU whatever SIMD code NumPy dispatches (no libm, no FMA: NumPy never fuses two
ufuncs). numba_rope's CPU results are asserted bit for bit against the contract first,
so a tolerance between them and the float64 reference is checked on the same numbers
everywhere. What can vary by CPU are the peers: onnxruntime's kernels and NumPy's
complex64 multiply (AVX-512 builds use FMA, one rounding less); their tolerances say
so where they are used. GPU results are held to the contract bit for bit too: the CUDA
kernels round each product on their own (``fmul_rn``), which nothing contracts into an
FMA (``tests/compile_for_gpu.py`` checks the PTX).

Test infrastructure that is not an oracle comes from :mod:`numba_rope.bench`, shared with
the benchmarks and the GPU check: :func:`make_case` (its case maker) and :func:`ulp_of`
(its epsilon table).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from numba_rope.bench import epsilon, make_arrays
from numba_rope.bench.gpu import NumbaArrays

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16, np.dtype(np.float64))


def compute_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def float32_contract(x, cos, sin, position_ids=None, interleaved=False, rotary_embedding_dim=0):
    with np.errstate(all="ignore"):  # inf and NaN are data here, not mistakes
        return _float32_contract(x, cos, sin, position_ids, interleaved, rotary_embedding_dim)


def _float32_contract(x, cos, sin, position_ids, interleaved, rotary_embedding_dim):
    batch, _, seq_len, head_size = x.shape
    rotary_dim = rotary_embedding_dim or head_size
    half = rotary_dim // 2
    work = compute_dtype(x.dtype)
    xc = x.astype(work)
    out = xc.copy()
    for b in range(batch):
        for s in range(seq_len):
            row = (b, s) if position_ids is None else (int(position_ids[b, s]),)
            c = cos[row].astype(work)
            sn = sin[row].astype(work)
            tokens = xc[b, :, s, :]  # [num_heads, head_size]
            if interleaved:
                x1, x2 = tokens[:, 0:rotary_dim:2], tokens[:, 1:rotary_dim:2]
            else:
                x1, x2 = tokens[:, :half], tokens[:, half:rotary_dim]
            y1 = np.subtract(np.multiply(x1, c), np.multiply(x2, sn))
            y2 = np.add(np.multiply(x2, c), np.multiply(x1, sn))
            if interleaved:
                out[b, :, s, 0:rotary_dim:2] = y1
                out[b, :, s, 1:rotary_dim:2] = y2
            else:
                out[b, :, s, :half] = y1
                out[b, :, s, half:rotary_dim] = y2
    result = out.astype(x.dtype)
    # Channels that do not rotate are copied, not converted twice.
    result[..., rotary_dim:] = x[..., rotary_dim:]
    return result


def tensorrt_reference(
    input, cos_cache, sin_cache, position_ids=None, interleaved=False, rotary_embedding_dim=0
):
    """The reference implementation printed in TensorRT's RotaryEmbedding page."""
    head_size = input.shape[3]
    rotary_embedding_dim = head_size if rotary_embedding_dim == 0 else rotary_embedding_dim
    x_rotate, x_not_rotate = np.split(input, [rotary_embedding_dim], axis=-1)
    cache = cos_cache + 1j * sin_cache
    if position_ids is not None:
        cache = cache[position_ids]
    cache = cache[:, np.newaxis, :, :]
    if interleaved:
        x1, x2 = x_rotate[..., 0::2], x_rotate[..., 1::2]
    else:
        x1, x2 = np.split(x_rotate, 2, axis=-1)
    x = x1 + 1j * x2
    x = x * cache
    if interleaved:
        x = np.expand_dims(x, axis=-1)
        x = np.concatenate((np.real(x), np.imag(x)), axis=-1)
        x = np.reshape(x, x_rotate.shape)
    else:
        x = np.concatenate((np.real(x), np.imag(x)), axis=-1)
    return np.concatenate((x, x_not_rotate), axis=-1)


def to_gpu(a):
    """A NumPy array as a Numba device array (anything else as it is): the bench's
    :class:`~numba_rope.bench.gpu.NumbaArrays`, which copies bfloat16 through its
    ``uint16`` bits (numba-cuda copies through the buffer protocol, which NumPy refuses
    for ml_dtypes' types on a GPU) and keeps a base array's layout
    (``conftest.gpu_views``)."""
    return NumbaArrays().to_device(a) if isinstance(a, np.ndarray) else a


def to_host(d) -> np.ndarray:
    """A Numba device array as a NumPy array (bfloat16 through its bits)."""
    return NumbaArrays().to_host(d)


def bits(a: np.ndarray) -> np.ndarray:
    """Bit patterns of a float array, with every NaN mapped to one pattern."""
    a = np.ascontiguousarray(a)
    unsigned = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    pattern = a.view(unsigned).copy()
    with np.errstate(invalid="ignore"):
        pattern[np.isnan(a.astype(np.float64))] = 0
    return pattern


def assert_bitwise_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = bits(actual), bits(expected)
    mismatched = np.flatnonzero(a.reshape(-1) != e.reshape(-1))
    if mismatched.size:
        i = mismatched[0]
        raise AssertionError(
            f"{mismatched.size} of {a.size} elements differ; first at flat index {i}: "
            f"{actual.reshape(-1)[i]!r} != {expected.reshape(-1)[i]!r}"
        )


#: Relative size of one unit in the last place of a format (machine epsilon), by dtype.
ulp_of = epsilon

#: Random input, caches of real angles and (optionally) position ids:
#: ``make_case(rng, shape, dtype, *, position_ids=True, rotary_dim=0, n_positions=None,
#: cache_dtype=None)``.
make_case = make_arrays
