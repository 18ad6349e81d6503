"""How far 16-bit RoPE results are from the exact value: numba_rope against the
arithmetic of the common implementations, each measured in units in the last place
(ulp) of the result's type against the float64 reference on the very same 16-bit
inputs and caches.

    python tools/accuracy.py                 # the table of README's "Accuracy"
    python tools/accuracy.py --positions 32768 --tokens 4096

numba_rope computes in float32 and rounds once, so its error is at most half an ulp
(plus float32's own rounding, about 2**-16 ulp for bfloat16). The others evaluate
``x1*cos - x2*sin`` (vLLM's native path) or ``x*cos + rotate_half(x)*sin`` (Hugging
Face, flash-attn's torch reference) in the tensors' own 16-bit type, one rounding after
every operation, as PyTorch does in eager mode: where the two products nearly cancel,
their rounding errors are large beside the result. Those rows are computed here with
NumPy on the same 16-bit types (``ml_dtypes`` rounds each operation's float32 result
once, as PyTorch's CPU and CUDA kernels do); with transformers installed, Hugging Face's
own ``apply_rotary_pos_emb`` is measured too, and with onnxruntime, its
``RotaryEmbedding`` (opset 23).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import ml_dtypes
import numpy as np

import numba_rope
from numba_rope import reference

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}


def ulp_error(result: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """``|result - exact|`` in units of the spacing of ``result``'s 16-bit type at
    ``exact`` (float64; subnormal spacing below the smallest normal)."""
    info = ml_dtypes.finfo(result.dtype)
    exact = np.asarray(exact, np.float64)
    magnitude = np.maximum(np.abs(exact), float(info.smallest_normal))
    exponent = np.floor(np.log2(magnitude))
    spacing = np.exp2(exponent - info.nmant)
    return np.abs(result.astype(np.float64) - exact) / spacing


def _halves(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def vllm_native(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """vLLM's native path: ``x1*cos - x2*sin``, ``x2*cos + x1*sin`` in x's dtype."""
    x1, x2 = _halves(x)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rotate_half_form(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Hugging Face's and flash-attn's torch reference: ``x*cos + rotate_half(x)*sin``
    with full-width caches, in x's dtype."""
    x1, x2 = _halves(x)
    full_cos = np.concatenate([cos, cos], axis=-1)
    full_sin = np.concatenate([sin, sin], axis=-1)
    return x * full_cos + np.concatenate([-x2, x1], axis=-1) * full_sin


def transformers_hf(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray | None:
    """transformers' own ``apply_rotary_pos_emb`` (Llama), or None without it."""
    try:
        import torch
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except ImportError:
        return None

    def tensor(a: np.ndarray) -> torch.Tensor:
        if a.dtype == BFLOAT16:
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(a.copy())

    full_cos = tensor(np.concatenate([cos, cos], axis=-1))  # [batch, seq, head]
    full_sin = tensor(np.concatenate([sin, sin], axis=-1))
    q = tensor(x)
    got, _ = apply_rotary_pos_emb(q, q, full_cos, full_sin)
    if x.dtype == BFLOAT16:
        return got.view(torch.int16).numpy().view(BFLOAT16)
    return got.numpy()


def onnxruntime_rope(
    x: np.ndarray, cos_cache: np.ndarray, sin_cache: np.ndarray, ids: np.ndarray
) -> np.ndarray | None:
    """onnxruntime's ``RotaryEmbedding`` (its CPU kernel takes float16, not bfloat16;
    None without onnxruntime)."""
    if x.dtype != np.float16:
        return None
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    from numba_rope.bench.peers import onnx_rotary_model

    model = onnx_rotary_model(x.dtype, True, False, 0)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    feeds = {"input": x, "cos_cache": cos_cache, "sin_cache": sin_cache, "position_ids": ids}
    return np.asarray(session.run(None, feeds)[0])


def measure(
    dtype: np.dtype, positions: int, tokens: int, seed: int = 0
) -> dict[str, tuple[float, float, float]]:
    """``{implementation: (max ulp, mean ulp, share not the nearest value)}`` for one decode-like batch of
    ``tokens`` tokens at random positions below ``positions``, 8 heads of 128, caches
    of ``rope_cache`` (base 10000) in ``dtype``."""
    rng = np.random.default_rng(seed)
    cos_cache, sin_cache = numba_rope.rope_cache(positions, 128, dtype=dtype)
    x = rng.standard_normal((1, 8, tokens, 128)).astype(dtype)
    ids = rng.integers(0, positions, (1, tokens))
    exact = reference.rotary_embedding(
        x.astype(np.float64), cos_cache.astype(np.float64), sin_cache.astype(np.float64), ids
    )
    cos = cos_cache[ids][:, None]  # [batch, 1, seq, half], the caches' own 16-bit values
    sin = sin_cache[ids][:, None]
    candidates: dict[str, Callable[[], np.ndarray | None]] = {
        "numba_rope": lambda: numba_rope.rotary_embedding(x, cos_cache, sin_cache, ids),
        "x1*cos - x2*sin in 16 bits (vLLM native)": lambda: vllm_native(x, cos, sin),
        "x*cos + rotate_half(x)*sin in 16 bits (HF, flash-attn torch)": lambda: rotate_half_form(
            x, cos, sin
        ),
        "transformers apply_rotary_pos_emb": lambda: transformers_hf(x, cos[:, 0], sin[:, 0]),
        "onnxruntime RotaryEmbedding": lambda: onnxruntime_rope(x, cos_cache, sin_cache, ids),
    }
    found = {}
    for name, run in candidates.items():
        got = run()
        if got is None:
            continue
        errors = ulp_error(np.asarray(got), exact)
        # Not the nearest 16-bit value: more than half an ulp off, beyond what float32's
        # own rounding adds (under 2**-10 ulp for both 16-bit types).
        wrong = float(np.mean(errors > 0.5 + 2.0**-10))
        found[name] = (float(errors.max()), float(errors.mean()), wrong)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=4096, help="cache rows")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens (x 8 heads of 128)")
    args = parser.parse_args(argv)
    print(
        f"ulp from the float64 value; {args.tokens} tokens x 8 heads x 128 at random "
        f"positions below {args.positions}, caches from rope_cache in the same dtype"
    )
    print(
        "| implementation | float16: max / mean ulp, not nearest "
        "| bfloat16: max / mean ulp, not nearest |"
    )
    print("|---|---|---|")
    results = {name: measure(dtype, args.positions, args.tokens) for name, dtype in DTYPES.items()}
    names = list(dict.fromkeys(n for found in results.values() for n in found))
    for name in names:
        cells = []
        for dtype_name in DTYPES:
            entry = results[dtype_name].get(name)
            cells.append(
                "n/a"
                if entry is None
                else f"{entry[0]:.3g} / {entry[1]:.3g}, {100 * entry[2]:.1f}%"
            )
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    return 0 if all(math.isfinite(v[0]) for r in results.values() for v in r.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
