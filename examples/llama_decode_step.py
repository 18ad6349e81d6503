"""Decoder steps of a Llama-style attention layer with a KV cache, on the CPU.

Four sequences of different lengths are already in the KV cache; each step appends one
token per sequence. The fused projection ``qkv = hidden @ w_qkv`` gives the queries,
keys and values; RoPE rotates q and k *in place, as strided views of qkv* (no copies),
each token at its own position: the length of its sequence's cache (the cache offset).
Grouped-query attention: 8 query heads share 2 key/value heads.

Run: python examples/llama_decode_step.py
"""

import numpy as np

import numba_rope
from numba_rope import reference

batch, num_heads, num_kv_heads, head_dim = 4, 8, 2, 64
hidden_size = num_heads * head_dim
max_positions = 1024
rope_theta = 10000.0

# cos/sin caches, built once: row p holds cos and sin of p * theta ** (-2i / head_dim).
inverse_frequency = rope_theta ** (-np.arange(0, head_dim, 2) / head_dim)
angles = np.arange(max_positions)[:, np.newaxis] * inverse_frequency
cos_cache = np.cos(angles).astype(np.float32)  # [max_positions, head_dim / 2]
sin_cache = np.sin(angles).astype(np.float32)

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
    # [batch, heads, seq_len, head_dim] views into qkv: RoPE reads and writes them in place.
    heads = qkv.reshape(batch, seq_len, -1, head_dim).transpose(0, 2, 1, 3)
    q = heads[:, :num_heads]
    k = heads[:, num_heads : num_heads + num_kv_heads]
    v = heads[:, num_heads + num_kv_heads :]

    positions = cache_lengths[:, np.newaxis] + np.arange(seq_len)  # [batch, seq_len]
    q_before, k_before = q.copy(), k.copy()  # only to check the result below
    numba_rope.rotary_embedding(q, cos_cache, sin_cache, positions, out=q)
    numba_rope.rotary_embedding(k, cos_cache, sin_cache, positions, out=k)

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
