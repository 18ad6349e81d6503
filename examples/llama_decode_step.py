"""Decoder steps of a Llama-style attention layer with a KV cache, on the CPU.

Four sequences of different lengths are already in the KV cache; each step appends one
token per sequence. The fused projection ``qkv = hidden @ w_qkv`` gives the queries,
keys and values; RoPE rotates q and k *in place, as strided views of qkv* (no copies),
in one pass (``rotary_embedding_qk``), in Hugging Face's ``[batch, seq, heads, dim]``
layout, each token at its own position given by its sequence's cache length
(``position_offset``). Grouped-query attention: 8 query heads share 2 key/value heads.
The cos/sin caches come from ``rope_cache``.

Run: python examples/llama_decode_step.py
"""

import numpy as np

import numba_rope
from numba_rope import reference

batch, num_heads, num_kv_heads, head_dim = 4, 8, 2, 64
hidden_size = num_heads * head_dim
max_positions = 1024
rope_theta = 10000.0

# cos/sin caches, built once: row p holds cos and sin of p * theta ** (-2i / head_dim)
# (computed in float64, rounded once). Llama 3 models would pass their scaling, e.g.
# scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
#          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}.
cos_cache, sin_cache = numba_rope.rope_cache(max_positions, head_dim, base=rope_theta)

rng = np.random.default_rng(0)
qkv_size = (num_heads + 2 * num_kv_heads) * head_dim
w_qkv = (rng.standard_normal((hidden_size, qkv_size)) / np.sqrt(hidden_size)).astype(np.float32)

# The KV cache of earlier tokens (random stand-ins here), and each sequence's length.
k_cache = np.zeros((batch, num_kv_heads, max_positions, head_dim), np.float32)
v_cache = np.zeros_like(k_cache)
cache_lengths = np.array([5, 17, 0, 300])
for b, length in enumerate(cache_lengths):
    k_cache[b, :, :length] = rng.standard_normal((num_kv_heads, length, head_dim))
    v_cache[b, :, :length] = rng.standard_normal((num_kv_heads, length, head_dim))


def decode_step(hidden: np.ndarray) -> np.ndarray:
    """One new token per sequence: hidden [batch, 1, hidden_size] -> attention output."""
    seq_len = hidden.shape[1]
    qkv = hidden @ w_qkv  # [batch, seq_len, (num_heads + 2 * num_kv_heads) * head_dim]
    # [batch, seq_len, heads, head_dim] ("bshd", as Hugging Face holds them) views into
    # qkv: RoPE reads and writes them in place, q and k in one pass.
    heads = qkv.reshape(batch, seq_len, -1, head_dim)
    q = heads[:, :, :num_heads]
    k = heads[:, :, num_heads : num_heads + num_kv_heads]
    v = heads[:, :, num_heads + num_kv_heads :].transpose(0, 2, 1, 3)

    q_before, k_before = q.copy(), k.copy()  # only to check the result below
    # Each sequence's new tokens sit at positions cache_length + 0, 1, ...: an offset.
    numba_rope.rotary_embedding_qk(
        q, k, cos_cache, sin_cache, position_offset=cache_lengths, layout="bshd", out_q=q, out_k=k
    )
    q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)  # [batch, heads, seq, dim] views
    q_before, k_before = q_before.transpose(0, 2, 1, 3), k_before.transpose(0, 2, 1, 3)
    positions = cache_lengths[:, np.newaxis] + np.arange(seq_len)  # [batch, seq_len]

    # Check against the float64 oracle (float32 arithmetic: within a few ulps).
    for rotated, before in ((q, q_before), (k, k_before)):
        want = reference.rotary_embedding(before, cos_cache, sin_cache, positions)
        assert np.allclose(rotated, want, rtol=1e-6, atol=1e-6)

    # Append the new keys and values at their positions, then attend over the cache.
    output = np.empty((batch, num_heads, seq_len, head_dim), np.float32)
    for b in range(batch):
        start, end = cache_lengths[b], cache_lengths[b] + seq_len
        k_cache[b, :, start:end] = k[b]
        v_cache[b, :, start:end] = v[b]
        keys = np.repeat(k_cache[b, :, :end], num_heads // num_kv_heads, axis=0)
        values = np.repeat(v_cache[b, :, :end], num_heads // num_kv_heads, axis=0)
        scores = q[b] @ keys.transpose(0, 2, 1) / np.sqrt(head_dim)  # [heads, seq_len, end]
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        output[b] = weights @ values
    cache_lengths[:] += seq_len
    return output


for step in range(3):
    hidden = rng.standard_normal((batch, 1, hidden_size)).astype(np.float32)
    attention = decode_step(hidden)
    assert attention.shape == (batch, num_heads, 1, head_dim) and np.isfinite(attention).all()
    print(f"step {step}: positions {(cache_lengths - 1).tolist()}, attention {attention.shape}: ok")

# Why RoPE: a query-key score depends on their positions only through the difference.
x = rng.standard_normal((1, 1, 2, head_dim)).astype(np.float32)  # a query and a key
near = numba_rope.rotary_embedding(x, cos_cache, sin_cache, np.array([[10, 3]]))
far = numba_rope.rotary_embedding(x, cos_cache, sin_cache, np.array([[510, 503]]))
score_near = float(near[0, 0, 0] @ near[0, 0, 1])
score_far = float(far[0, 0, 0] @ far[0, 0, 1])
assert abs(score_near - score_far) < 1e-3 * (1 + abs(score_near))
print(f"score at positions (10, 3) {score_near:.5f} == at (510, 503) {score_far:.5f}: ok")
