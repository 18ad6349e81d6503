"""One-process A/B of calls in the forms of flash-attn and vLLM:
numba_rope at another commit against the working tree (see ``ab_compare.py``).

A step of ``--batch`` sequences of ``--seq-len`` tokens (default: a decode step, one
token; 32 q heads, 8 kv heads, 128 channels), in each form a serving loop calls:
``bhsd`` with position ids (the bench's form; also with the cos and sin halves of
vLLM's ``cos_sin_cache`` as caches), offsets per sequence or one ``int`` offset,
``bshd`` and 3-D tensors, q and k rotated in place as views of one fused qkv buffer,
vLLM's op and flash-attn's functions. Each pair of calls is checked to give the same
bits, then timed alternately (medians).

    python tools/ab_forms.py 425cc46 --reps 31
    python tools/ab_forms.py HEAD~1 --reps 21 --batch 1 --seq-len 4096
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


def _cases(
    batch: int, dtype: str, rng: np.random.Generator, seq_len: int = 1
) -> dict[str, Callable]:
    """Calls by name, each taking the package (old or new) and returning its output."""
    import numba_rope
    from numba_rope.bench.workloads import as_dtype

    cos, sin = numba_rope.rope_cache(4000 + seq_len, HEAD_SIZE, dtype=as_dtype(dtype))
    cos_sin = np.concatenate([cos, sin], -1)  # vLLM's cache
    halves = cos_sin[:, : HEAD_SIZE // 2], cos_sin[:, HEAD_SIZE // 2 :]
    x = rng.standard_normal((batch, HEADS, seq_len, HEAD_SIZE)).astype(cos.dtype)
    offsets = rng.integers(0, 4000, batch)
    ids = offsets[:, None] + np.arange(seq_len)
    bshd = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    flat = bshd.reshape(batch, seq_len, HEADS * HEAD_SIZE)
    width = (HEADS + 2 * KV_HEADS) * HEAD_SIZE
    qkv = rng.standard_normal((batch * seq_len, width)).astype(cos.dtype)  # vLLM's tokens
    packed = rng.standard_normal((batch, seq_len, 3, HEADS, HEAD_SIZE)).astype(cos.dtype)

    def fresh(array: np.ndarray) -> Callable:
        """A call on its own copy of ``array`` per version (in-place calls change it)."""
        copies: dict[str, np.ndarray] = {}

        def mine(m: object) -> np.ndarray:
            name = m.__name__  # type: ignore[attr-defined]
            if name not in copies:  # not setdefault: it would copy at every call
                copies[name] = array.copy()
            return copies[name]

        return mine

    own_qkv, own_qkv_too = fresh(qkv), fresh(qkv)
    own_packed, own_x = fresh(packed), fresh(bshd)

    def q_and_k(buffer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return buffer[:, : HEADS * HEAD_SIZE], buffer[:, HEADS * HEAD_SIZE : -KV_HEADS * HEAD_SIZE]

    def fused(m):
        buffer = own_qkv(m)
        q, k = q_and_k(buffer)
        q3, k3 = q.reshape(batch, seq_len, -1), k.reshape(batch, seq_len, -1)
        m.rotary_embedding_qk(
            q3, k3, cos, sin, ids, num_heads=HEADS, num_kv_heads=KV_HEADS, out_q=q3, out_k=k3
        )
        return buffer

    def vllm_op(m):
        buffer = own_qkv_too(m)
        q, k = q_and_k(buffer)
        m.vllm.rotary_embedding(ids.ravel(), q, k, HEAD_SIZE, cos_sin, True)
        return buffer

    return {
        "bhsd, ids": lambda m: m.rotary_embedding(x, cos, sin, ids),
        "bhsd, ids, cos_sin halves": lambda m: m.rotary_embedding(x, *halves, ids),
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
    parser.add_argument("--seq-len", type=int, default=1)
    parser.add_argument("--dtypes", default="float32,float16")
    args = parser.parse_args(argv)
    numba_rope_old = load_old(args.revision)

    import numba_rope
    import numba_rope.flash_attn
    import numba_rope.vllm

    print(f"{'call':26s} {'dtype':8s} {'old':>10s} {'new':>10s}  new/old")
    for dtype in args.dtypes.split(","):
        for name, call in _cases(args.batch, dtype, np.random.default_rng(0), args.seq_len).items():
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
