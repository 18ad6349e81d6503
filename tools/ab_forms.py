"""One-process A/B of small calls in the forms of flash-attn and vLLM:
numba_rope at another commit against the working tree (see ``ab_compare.py``).

A decode step of ``--batch`` sequences (32 q heads, 8 kv heads, 128 channels), in
each form a serving loop calls: ``bhsd`` with position ids (the bench's form), offsets
per sequence or one ``int`` offset, ``bshd`` and 3-D tensors, q and k rotated in place
as views of one fused qkv buffer, vLLM's op and flash-attn's functions. Each pair of
calls is checked to give the same bits, then timed alternately (medians).

    python tools/ab_forms.py 425cc46 --reps 31
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_compare import load_old, print_row

HEADS, KV_HEADS, HEAD_SIZE = 32, 8, 128


def _cases(batch: int, dtype: str, rng: np.random.Generator) -> dict[str, Callable]:
    """Calls by name, each taking the package (old or new) and returning its output."""
    import numba_rope

    cos, sin = numba_rope.rope_cache(4096, HEAD_SIZE, dtype=np.dtype(dtype))
    cos_sin = np.concatenate([cos, sin], -1)  # vLLM's cache
    x = rng.standard_normal((batch, HEADS, 1, HEAD_SIZE)).astype(cos.dtype)
    ids = rng.integers(0, 4000, (batch, 1))
    offsets = ids[:, 0].copy()
    bshd = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    flat = bshd.reshape(batch, 1, HEADS * HEAD_SIZE)
    width = (HEADS + 2 * KV_HEADS) * HEAD_SIZE
    qkv = rng.standard_normal((batch, width)).astype(cos.dtype)  # vLLM's tokens
    packed = rng.standard_normal((batch, 1, 3, HEADS, HEAD_SIZE)).astype(cos.dtype)  # flash-attn's

    def fresh(array: np.ndarray) -> Callable:
        """A call on its own copy of ``array`` per version (in-place calls change it)."""
        copies: dict[str, np.ndarray] = {}

        def mine(m: object) -> np.ndarray:
            return copies.setdefault(m.__name__, array.copy())  # type: ignore[attr-defined]

        return mine

    own_qkv, own_qkv_too = fresh(qkv), fresh(qkv)
    own_packed, own_x = fresh(packed), fresh(bshd)

    def q_and_k(buffer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return buffer[:, : HEADS * HEAD_SIZE], buffer[:, HEADS * HEAD_SIZE : -KV_HEADS * HEAD_SIZE]

    def fused(m):
        buffer = own_qkv(m)
        q, k = q_and_k(buffer)
        q3, k3 = q.reshape(1, batch, -1), k.reshape(1, batch, -1)
        m.rotary_embedding_qk(
            q3, k3, cos, sin, offsets[None], num_heads=HEADS, num_kv_heads=KV_HEADS,
            out_q=q3, out_k=k3,
        )  # fmt: skip
        return buffer

    def vllm_op(m):
        buffer = own_qkv_too(m)
        q, k = q_and_k(buffer)
        m.vllm.rotary_embedding(offsets, q, k, HEAD_SIZE, cos_sin, True)
        return buffer

    return {
        "bhsd, ids": lambda m: m.rotary_embedding(x, cos, sin, ids),
        "bhsd, offsets": lambda m: m.rotary_embedding(x, cos, sin, position_offset=offsets),
        "bhsd, int offset": lambda m: m.rotary_embedding(x, cos, sin, position_offset=17),
        "bshd, ids": lambda m: m.rotary_embedding(bshd, cos, sin, ids, layout="bshd"),
        "bshd, offsets": lambda m: m.rotary_embedding(
            bshd, cos, sin, position_offset=offsets, layout="bshd"
        ),
        "3-D, ids": lambda m: m.rotary_embedding(flat, cos, sin, ids, num_heads=HEADS),
        "q+k fused 3-D, in place": fused,
        "vLLM op, fused qkv": vllm_op,
        "flash apply_rotary_emb": lambda m: m.flash_attn.apply_rotary_emb(
            own_x(m), cos, sin, seqlen_offsets=offsets, inplace=True
        ),
        "flash qkv_, in place": lambda m: m.flash_attn.apply_rotary_emb_qkv_(
            own_packed(m), cos, sin, seqlen_offsets=offsets
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("revision", help="the commit to compare against")
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtypes", default="float32,float16")
    args = parser.parse_args(argv)
    numba_rope_old = load_old(args.revision)

    import numba_rope
    import numba_rope.flash_attn
    import numba_rope.vllm

    print(f"{'call':26s} {'dtype':8s} {'old':>10s} {'new':>10s}  new/old")
    for dtype in args.dtypes.split(","):
        for name, call in _cases(args.batch, dtype, np.random.default_rng(0)).items():
            first_old, first_new = call(numba_rope_old), call(numba_rope)
            if not np.array_equal(
                np.asarray(first_old).view(np.uint8), np.asarray(first_new).view(np.uint8)
            ):
                print(f"{name} {dtype}: the two versions differ")
                return 1
            print_row(
                f"{name:26s} {dtype:8s}",
                partial(call, numba_rope_old),
                partial(call, numba_rope),
                args.reps,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
