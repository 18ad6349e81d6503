"""Conformance with ONNX RotaryEmbedding-23: onnx's reference evaluator (every dtype) and
onnxruntime (float32 and float16: it has no CPU bfloat16 or float64 kernel, and it rejects
caches with fewer rows than seq_len)."""

from __future__ import annotations

import numpy as np
import pytest
from oracles import DTYPES, make_case, ulp_of

import numba_rope
from numba_rope.bench import TOLERANCE_EPS, onnx_rotary_model

onnx = pytest.importorskip("onnx")
from onnx.reference import ReferenceEvaluator  # noqa: E402


def feeds(x, cos, sin, ids):
    named = {"input": x, "cos_cache": cos, "sin_cache": sin}
    if ids is not None:
        named["position_ids"] = ids
    return named


VARIANTS = [
    (interleaved, with_ids, rotary_dim)
    for interleaved in (False, True)
    for with_ids in (True, False)
    for rotary_dim in (0, 32, 2)
]


def close_enough(got, want, dtype):
    # ONNX's evaluators round after every operation in the input dtype (and onnxruntime
    # may fuse into FMA on some CPUs): each output is a few roundings of at most half a
    # unit at the terms' scale from the exact value, which numba_rope's result is
    # within one unit of; 4 units (TOLERANCE_EPS) at max|want| + 1 holds on every CPU.
    tol = TOLERANCE_EPS * ulp_of(dtype) * (np.abs(want.astype(np.float64)).max() + 1)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@pytest.mark.parametrize(("interleaved", "with_ids", "rotary_dim"), VARIANTS)
def test_matches_onnx_reference_evaluator(rng, dtype, interleaved, with_ids, rotary_dim):
    x, cos, sin, ids = make_case(
        rng, (2, 3, 5, 64), dtype, position_ids=with_ids, rotary_dim=rotary_dim
    )
    # ONNX 4-D input is [batch, num_heads, seq_len, head_size] as ours.
    evaluator = ReferenceEvaluator(onnx_rotary_model(dtype, with_ids, interleaved, rotary_dim, 0))
    (want,) = evaluator.run(None, feeds(x, cos, sin, ids))
    got = numba_rope.rotary_embedding(
        x, cos, sin, ids, interleaved=interleaved, rotary_embedding_dim=rotary_dim
    )
    assert got.shape == want.shape
    close_enough(got, want, dtype)


ORT_DTYPES = [np.dtype(np.float32), np.dtype(np.float16)]  # no CPU bfloat16/float64 kernel


@pytest.mark.parametrize("dtype", ORT_DTYPES, ids=[d.name for d in ORT_DTYPES])
@pytest.mark.parametrize(("interleaved", "with_ids", "rotary_dim"), VARIANTS)
def test_matches_onnxruntime(rng, dtype, interleaved, with_ids, rotary_dim):
    ort = pytest.importorskip("onnxruntime")
    # onnxruntime rejects caches with fewer rows than seq_len: give it enough positions.
    x, cos, sin, ids = make_case(
        rng, (2, 3, 5, 64), dtype, position_ids=with_ids, rotary_dim=rotary_dim, n_positions=16
    )
    model = onnx_rotary_model(dtype, with_ids, interleaved, rotary_dim, 0)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, feeds(x, cos, sin, ids))
    got = numba_rope.rotary_embedding(
        x, cos, sin, ids, interleaved=interleaved, rotary_embedding_dim=rotary_dim
    )
    close_enough(got, want, dtype)
