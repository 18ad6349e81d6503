"""numba_rope.huggingface.apply_rotary_pos_emb against transformers' own
``apply_rotary_pos_emb`` and rotary modules (Llama; GPT-NeoX for partial rotary), and
against numba_rope.reference for 16-bit input.

Why float32 is compared bit for bit with transformers: ``q * cos + rotate_half(q) * sin``
rounds, per element, the two products ``x1*c`` and ``x2*s`` (the negation in
rotate_half is exact) and their sum or difference, each once, in separate eager torch
kernels (nothing fuses them into an FMA); the operator evaluates the same two products
and the same sum or difference with one rounding each. So the bits agree on every CPU.
In 16-bit transformers rounds after every operation; the operator rounds once, so there
the oracle is the float64 reference's ``precision="contract"``.

The NumPy path needs no torch; the rest skips where torch or transformers is absent.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from oracles import BFLOAT16

import numba_rope
from numba_rope import reference
from numba_rope.huggingface import apply_rotary_pos_emb

ROOT = Path(__file__).resolve().parent.parent


def full_width_caches(rng, batch, seq_len, rotary_dim, dtype=np.float32):
    """Hugging Face's form: ``cat(freqs, freqs)`` of angles per token."""
    freqs = rng.uniform(-20, 20, (batch, seq_len, rotary_dim // 2))
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(dtype), np.sin(emb).astype(dtype)


# -- NumPy: no torch needed ------------------------------------------------------------


@pytest.mark.parametrize("unsqueeze_dim", [1, 2, -3, -2])
def test_numpy_matches_the_operator_on_halved_caches(rng, unsqueeze_dim):
    layout = "bhsd" if unsqueeze_dim in (1, -3) else "bshd"
    shape_q = (2, 4, 5, 16) if layout == "bhsd" else (2, 5, 4, 16)
    shape_k = (2, 2, 5, 16) if layout == "bhsd" else (2, 5, 2, 16)
    q = rng.standard_normal(shape_q).astype(np.float32)
    k = rng.standard_normal(shape_k).astype(np.float32)
    cos, sin = full_width_caches(rng, 1, 5, 12)  # partial rotary, one table for the batch
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    half = np.broadcast_to(cos[..., :6], (2, 5, 6)), np.broadcast_to(sin[..., :6], (2, 5, 6))
    for got, x in ((q_embed, q), (k_embed, k)):
        expected = reference.rotary_embedding(
            x, *half, rotary_embedding_dim=12, layout=layout, precision="contract"
        )
        np.testing.assert_array_equal(got, expected)


def test_two_dimensional_caches_with_position_ids(rng):
    """transformers before 4.38: ``cos[position_ids]`` taken inside."""
    q = rng.standard_normal((2, 3, 4, 8)).astype(np.float32)
    k = rng.standard_normal((2, 1, 4, 8)).astype(np.float32)
    cos, sin = full_width_caches(rng, 1, 20, 8)
    ids = rng.integers(0, 20, (2, 4))
    q_embed, _ = apply_rotary_pos_emb(q, k, cos[0], sin[0], ids)
    expected = reference.rotary_embedding(
        q, cos[0, :, :4], sin[0, :, :4], ids, precision="contract"
    )
    np.testing.assert_array_equal(q_embed, expected)
    with pytest.raises(ValueError, match=r"pass position_ids \[batch, seq_len\]"):
        apply_rotary_pos_emb(q, k, cos[0], sin[0])


def test_halves_that_differ_are_refused_with_the_first_place(rng):
    q = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    cos, sin = full_width_caches(rng, 1, 3, 8)
    sin = sin.copy()
    sin[0, 2, 5] += 1.0
    with pytest.raises(
        ValueError, match=r"the halves of sin differ: sin\[0, 2, 1\] = .* but sin\[0, 2, 5\]"
    ):
        apply_rotary_pos_emb(q, q, cos, sin)
    nan = cos.copy()
    nan[0, 1, [0, 4]] = np.nan  # NaN in both halves at one place: equal halves
    apply_rotary_pos_emb(q, q, nan, np.concatenate([sin[..., :4]] * 2, axis=-1))
    with pytest.raises(ValueError, match="even number of channels"):
        apply_rotary_pos_emb(q, q, cos[..., :7], sin[..., :7])


@pytest.mark.parametrize("seq_len", [3, 600])  # halves of 384 bytes, of 150 KiB
def test_halves_compared_small_and_large(rng, seq_len):
    """Halves equal bit for bit pass (small ones compared as bytes, large ones as
    integers); one bit changed in the second half is refused with its place, in the
    first row and in the last."""
    q = rng.standard_normal((1, 2, seq_len, 128)).astype(np.float32)
    cos, sin = full_width_caches(rng, 1, seq_len, 128)
    got, _ = apply_rotary_pos_emb(q, q, cos, sin)
    expected = reference.rotary_embedding(q, cos[..., :64], sin[..., :64], precision="contract")
    np.testing.assert_array_equal(got, expected)
    for token in (0, seq_len - 1):
        different = cos.copy()
        different.view(np.uint32)[0, token, 64 + 7] ^= 1
        with pytest.raises(ValueError, match=rf"halves of cos differ: cos\[0, {token}, 7\]"):
            apply_rotary_pos_emb(q, q, different, sin)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_halves_equal_in_value_but_not_in_bits_are_accepted(rng, kind):
    # Halves equal bit for bit pass one comparison of their bits; halves whose only
    # differences are +0 against -0 or NaN payloads are equal values and pass the
    # element-wise check; any other difference is refused. Caches of 16-bit and
    # float32 elements, also as strided views (cut from a wider array).
    if kind == "torch":
        pytest.importorskip("torch")
        from test_torch import host, tensor

        as_kind, values = tensor, host
    else:

        def as_kind(array):
            return array

        values = as_kind

    def strided(array):
        wider = np.concatenate([array, np.zeros_like(array)], axis=-1)
        return as_kind(wider)[..., : array.shape[-1]]

    for dtype in (np.float32, np.float16, BFLOAT16):
        q = as_kind(rng.standard_normal((1, 2, 3, 8)).astype(dtype))
        cos, sin = full_width_caches(rng, 1, 3, 8, dtype)
        unsigned = np.uint16 if cos.itemsize == 2 else np.uint32
        bits = cos.view(unsigned).copy()
        bits[0, 0, [1, 5]] = (0, 1 << (8 * cos.itemsize - 1))  # +0 and -0
        nans = {np.dtype(np.float16): (0x7E00, 0x7E01), BFLOAT16: (0x7FC0, 0x7FC1)}
        bits[0, 1, [2, 6]] = nans.get(np.dtype(dtype), (0x7FC00000, 0x7FC00001))
        by_value = bits.view(cos.dtype)
        for caches in ((cos, sin), (by_value, sin)):
            want, _ = apply_rotary_pos_emb(q, q, as_kind(caches[0]), as_kind(caches[1]))
            got, _ = apply_rotary_pos_emb(q, q, strided(caches[0]), strided(caches[1]))
            assert np.array_equal(values(want).view(unsigned), values(got).view(unsigned))
        different = bits.copy()
        different[0, 2, 7] ^= 1  # the last bit of one value
        with pytest.raises(ValueError, match=r"the halves of cos differ: cos\[0, 2, 3\]"):
            apply_rotary_pos_emb(q, q, as_kind(different.view(cos.dtype)), as_kind(sin))


def test_bad_arguments():
    q = np.zeros((1, 2, 3, 8), np.float32)
    cos = np.ones((1, 3, 8), np.float32)
    with pytest.raises(ValueError, match=r"unsqueeze_dim must be 1 .* or 2"):
        apply_rotary_pos_emb(q, q, cos, cos, unsqueeze_dim=3)
    with pytest.raises(TypeError, match=r"pass unsqueeze_dim=2 by keyword"):
        apply_rotary_pos_emb(q, q, cos, cos, 2)  # transformers 5's positional unsqueeze_dim
    with pytest.raises(ValueError, match=r"cos and sin have shapes"):
        apply_rotary_pos_emb(q, q, cos[None], cos[None])


def test_caches_that_do_not_fit_q_are_named_in_its_words():
    """cos and sin wider than the head, or covering another number of positions than
    q's sequence: said in this function's terms and the caller's shapes (not the
    operator's rotary_embedding_dim, nor the halved caches' shape)."""
    q = np.ones((2, 4, 6, 8), np.float32)
    for width in (10, 16):
        cos = np.ones((2, 6, width), np.float32)
        with pytest.raises(ValueError) as raised:
            apply_rotary_pos_emb(q, q, cos, cos)
        message = str(raised.value)
        assert f"cos and sin have {width} columns" in message and "head_dim = 8" in message
        assert "rotary_embedding_dim" not in message
    cos = np.ones((2, 5, 8), np.float32)
    with pytest.raises(ValueError) as raised:
        apply_rotary_pos_emb(q, q, cos, cos)
    message = str(raised.value)
    assert "positions of cos (shape (2, 5, 8))" in message, message
    assert "[batch, seq_len, rotary_dim] with seq_len = 6" in message, message
    with pytest.raises(ValueError, match=r"position_ids must be \[batch, seq_len\]"):
        table = np.ones((9, 8), np.float32)
        apply_rotary_pos_emb(q, q, table, table, np.zeros((2, 5), int))
    assert (q == 1).all()


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_the_other_unsqueeze_dim_is_named_in_its_words(unsqueeze_dim):
    """q and k in the other order than unsqueeze_dim says: the message names the
    unsqueeze_dim that fits (this function takes no layout=, the operator's word for
    it), for 3-D cos and for 2-D cos with position_ids; nothing is written."""
    shape = (2, 4, 5, 8) if unsqueeze_dim == 2 else (2, 5, 4, 8)  # [b, h, s, d], [b, s, h, d]
    q = np.ones(shape, np.float32)
    other = 3 - unsqueeze_dim
    cos3 = np.ones((2, 5, 8), np.float32)
    cos2, ids = np.ones((9, 8), np.float32), np.zeros((2, 5), np.int64)
    for cos, ids_given, what in ((cos3, None, "cos"), (cos2, ids, "position_ids")):
        with pytest.raises(ValueError) as raised:
            apply_rotary_pos_emb(q, q, cos, cos, ids_given, unsqueeze_dim=unsqueeze_dim)
        message = str(raised.value)
        assert f"pass unsqueeze_dim={other}" in message and "layout" not in message, message
        assert f"the 5 positions of {what}" in message, message
        assert (q == 1).all()
        # The same call with the other unsqueeze_dim runs.
        apply_rotary_pos_emb(q, q, cos, cos, ids_given, unsqueeze_dim=other)


def test_16_bit_numpy_against_the_contract(rng):
    q = rng.standard_normal((2, 3, 4, 8)).astype(BFLOAT16)
    cos, sin = full_width_caches(rng, 2, 4, 8, BFLOAT16)
    q_embed, k_embed = apply_rotary_pos_emb(q, q, cos, sin)
    expected = reference.rotary_embedding(q, cos[..., :4], sin[..., :4], precision="contract")
    np.testing.assert_array_equal(q_embed.view(np.uint16), expected.view(np.uint16))
    np.testing.assert_array_equal(k_embed.view(np.uint16), expected.view(np.uint16))


# -- torch and transformers --------------------------------------------------------------


@pytest.fixture
def hf():
    """transformers' Llama and GPT-NeoX modules (torch first: it is the heavier skip)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.gpt_neox import modeling_gpt_neox
    from transformers.models.llama import modeling_llama

    return modeling_llama, modeling_gpt_neox


def llama_caches(hf, q, position_ids):
    """cos/sin from transformers' LlamaRotaryEmbedding for a small config."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=4 * 16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    return hf[0].LlamaRotaryEmbedding(config=config)(q, position_ids)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_float32_equals_transformers_bit_for_bit_with_gradients(hf, unsqueeze_dim):
    import torch

    generator = torch.Generator().manual_seed(7)
    batch, seq_len = 3, 6
    q_shape = (batch, 4, seq_len, 16) if unsqueeze_dim == 1 else (batch, seq_len, 4, 16)
    k_shape = (batch, 2, seq_len, 16) if unsqueeze_dim == 1 else (batch, seq_len, 2, 16)
    q = torch.randn(q_shape, generator=generator)
    k = torch.randn(k_shape, generator=generator)
    positions = torch.randint(0, 256, (batch, seq_len), generator=generator)
    cos, sin = llama_caches(hf, q, positions)
    assert tuple(cos.shape) == (batch, seq_len, 16)

    ours_q, ours_k = q.clone().requires_grad_(), k.clone().requires_grad_()
    theirs_q, theirs_k = q.clone().requires_grad_(), k.clone().requires_grad_()
    got = apply_rotary_pos_emb(ours_q, ours_k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    want = hf[0].apply_rotary_pos_emb(theirs_q, theirs_k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    # Backward: per pair g1*c + g2*s and g2*c - g1*s, rounded alike (see test_torch.py).
    grad_q, grad_k = (
        torch.randn(q_shape, generator=generator),
        torch.randn(k_shape, generator=generator),
    )
    torch.autograd.backward(got, (grad_q, grad_k))
    torch.autograd.backward(want, (grad_q, grad_k))
    assert torch.equal(ours_q.grad, theirs_q.grad)
    assert torch.equal(ours_k.grad, theirs_k.grad)


def test_partial_rotary_equals_gpt_neox(hf):
    import torch

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 5, 16, generator=generator)
    k = torch.randn(2, 4, 5, 16, generator=generator)
    freqs = torch.rand(1, 5, 3, generator=generator) * 40 - 20
    emb = torch.cat([freqs, freqs], dim=-1)  # rotary_dim 6 of head_dim 16
    cos, sin = emb.cos(), emb.sin()
    got = apply_rotary_pos_emb(q, k, cos, sin)
    want = hf[1].apply_rotary_pos_emb(q, k, cos, sin)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_one_table_for_the_batch_with_gradients(hf):
    """cos/sin ``[1, seq_len, head_dim]`` (transformers' rotary modules with position ids
    of one row) serve every sequence: values and gradients equal transformers' own,
    whose multiplication broadcasts them."""
    import torch

    generator = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, 5, 8, generator=generator)
    k = torch.randn(3, 2, 5, 8, generator=generator)
    freqs = torch.rand(1, 5, 4, generator=generator) * 20
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    ours = [t.clone().requires_grad_() for t in (q, k)]
    theirs = [t.clone().requires_grad_() for t in (q, k)]
    got = apply_rotary_pos_emb(*ours, cos, sin)
    want = hf[0].apply_rotary_pos_emb(*theirs, cos, sin)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    torch.autograd.backward(got, [torch.ones_like(t) for t in got])
    torch.autograd.backward(want, [torch.ones_like(t) for t in want])
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_16_bit_tensors_against_the_contract(hf, dtype_name):
    """In 16-bit the oracle is the float64 reference's contract (rounded once), on the
    very caches transformers produced; transformers' own result (rounded at every step)
    is within a few units of it."""
    import torch

    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 6, 16, generator=generator).to(dtype)
    positions = torch.arange(6).expand(2, 6) + torch.tensor([[0], [100]])
    cos, sin = llama_caches(hf, q, positions)
    assert cos.dtype == dtype
    q_embed, _ = apply_rotary_pos_emb(q, q, cos, sin)
    assert q_embed.dtype == dtype

    def host(t):
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(BFLOAT16)
        return t.numpy()

    expected = reference.rotary_embedding(
        host(q), host(cos)[..., :8], host(sin)[..., :8], precision="contract"
    )
    np.testing.assert_array_equal(host(q_embed).view(np.uint16), expected.view(np.uint16))


def test_torch_halves_refused_and_numpy_ids(hf):
    import torch

    q = torch.zeros(1, 2, 3, 8)
    cos = torch.ones(1, 3, 8)
    sin = torch.zeros(1, 3, 8)
    sin[0, 1, 2] = 0.5
    with pytest.raises(
        ValueError,
        match=r"the halves of sin differ: sin\[0, 1, 2\] = 0\.5 but sin\[0, 1, 6\] = 0\.0",
    ):
        apply_rotary_pos_emb(q, q, cos, sin)
    table = torch.ones(10, 8)
    ids = np.array([[1, 2, 3]])
    got, _ = apply_rotary_pos_emb(q + 1, q, table, torch.zeros(10, 8), ids)
    assert torch.equal(got, q + 1)  # angle 0: unchanged


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_forward_mode_tangents_of_q_and_k(rng):
    """torch.func.jvp through the torch path (full-width tensor caches, halved in the
    op): each tangent is its rotation (numba_rope.reference, float64); caches with a
    tangent are refused. Before, the tangents were dropped without a word."""
    torch = pytest.importorskip("torch")
    q, k = rng.standard_normal((2, 4, 5, 8)), rng.standard_normal((2, 2, 5, 8))
    cos, sin = full_width_caches(rng, 2, 5, 8, np.float64)
    dq, dk = rng.standard_normal(q.shape), rng.standard_normal(k.shape)
    tc, ts = torch.from_numpy(cos), torch.from_numpy(sin)
    _, (tq, tk) = torch.func.jvp(
        lambda a, b: apply_rotary_pos_emb(a, b, tc, ts),
        (torch.from_numpy(q), torch.from_numpy(k)),
        (torch.from_numpy(dq), torch.from_numpy(dk)),
    )
    half = cos[..., :4], sin[..., :4]
    for got, direction in ((tq, dq), (tk, dk)):
        np.testing.assert_array_equal(got.numpy(), reference.rotary_embedding(direction, *half))
    with pytest.raises(NotImplementedError, match="cos_cache"):
        torch.func.jvp(
            lambda c: apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), c, ts),
            (tc,),
            (torch.ones_like(tc),),
        )


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
def test_compiles_in_a_module_with_fullgraph(hf):
    """A Llama-style block: transformers' rotary module, then this apply_rotary_pos_emb,
    traced whole by torch.compile (aot_eager: the same tracing, no C++ build); its
    halves check runs inside the op, on real data."""
    import torch
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=32, num_attention_heads=2, head_dim=16, max_position_embeddings=64
    )

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rotary = hf[0].LlamaRotaryEmbedding(config=config)
            self.proj = torch.nn.Linear(32, 64)

        def forward(self, x, position_ids):
            q, k = self.proj(x).view(x.shape[0], x.shape[1], 2, 2, 16).unbind(2)
            cos, sin = self.rotary(x, position_ids)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
            return (q * k).sum()

    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 5, 32)
    ids = torch.arange(5).expand(2, 5)
    loss = torch.compile(block, fullgraph=True, backend="aot_eager")(x, ids)
    loss.backward()
    grad = block.proj.weight.grad.clone()
    block.zero_grad()
    eager = block(x, ids)
    eager.backward()
    assert torch.equal(loss, eager)  # aot_eager runs the same kernels in the same order
    assert torch.equal(grad, block.proj.weight.grad)


def test_readme_hugging_face_example_runs(hf):
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Hugging Face (apply_rotary_pos_emb)\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {"numba_rope": numba_rope})


# -- review findings: forms a port from transformers passes ------------------------------


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_one_row_of_position_ids_serves_the_batch(hf, unsqueeze_dim):
    """transformers before 4.38 gathered ``cos[position_ids]`` inside, and its models
    made ``position_ids = arange(past, past + seq_len).unsqueeze(0)``: one row ``[1,
    seq_len]`` for a batch of any size, broadcast. The oracle is transformers' own
    function on the gathered caches (float32 bit for bit, see the module docstring)."""
    import torch

    generator = torch.Generator().manual_seed(5)
    batch, seq_len = 3, 4
    q_shape = (batch, 4, seq_len, 16) if unsqueeze_dim == 1 else (batch, seq_len, 4, 16)
    k_shape = (batch, 2, seq_len, 16) if unsqueeze_dim == 1 else (batch, seq_len, 2, 16)
    q = torch.randn(q_shape, generator=generator)
    k = torch.randn(k_shape, generator=generator)
    freqs = torch.rand(32, 8, generator=generator) * 40 - 20
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()  # [max_position, head_dim]
    ids = torch.arange(7, 7 + seq_len)[None]  # [1, seq_len]
    got = apply_rotary_pos_emb(q, k, cos, sin, ids, unsqueeze_dim=unsqueeze_dim)
    want = hf[0].apply_rotary_pos_emb(q, k, cos[ids], sin[ids], unsqueeze_dim=unsqueeze_dim)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert torch.equal(a, b)
    # The row as a NumPy array with torch tensors: broadcast read-only, and read without
    # torch's "not writable" warning (an error under this suite's filterwarnings).
    got = apply_rotary_pos_emb(q, k, cos, sin, ids.numpy(), unsqueeze_dim=unsqueeze_dim)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    # NumPy too, against the float64 reference's contract on the gathered rows.
    got_q, _ = apply_rotary_pos_emb(
        q.numpy(), k.numpy(), cos.numpy(), sin.numpy(), ids.numpy(), unsqueeze_dim=unsqueeze_dim
    )
    layout = "bhsd" if unsqueeze_dim == 1 else "bshd"
    rows = np.broadcast_to(ids.numpy(), (batch, seq_len))
    expected = reference.rotary_embedding(
        q.numpy(),
        cos.numpy()[:, :8],
        sin.numpy()[:, :8],
        rows,
        layout=layout,
        precision="contract",
    )
    np.testing.assert_array_equal(got_q, expected)


def test_torch_tokens_with_numpy_caches(hf):
    """torch q and k with NumPy caches (numba_rope.rope_cache's, written twice as
    transformers does): the NumPy path takes torch caches, so the torch path takes NumPy
    ones; the result is transformers' on the same caches as tensors, bit for bit."""
    import torch

    generator = torch.Generator().manual_seed(9)
    q = torch.randn(2, 4, 5, 8, generator=generator)
    k = torch.randn(2, 2, 5, 8, generator=generator)
    half_cos, half_sin = numba_rope.rope_cache(5, 8)
    cos = np.concatenate([half_cos, half_cos], axis=-1)[None]  # [1, seq_len, head_dim]
    sin = np.concatenate([half_sin, half_sin], axis=-1)[None]
    got = apply_rotary_pos_emb(q, k, cos, sin)
    want = hf[0].apply_rotary_pos_emb(q, k, torch.from_numpy(cos), torch.from_numpy(sin))
    for a, b in zip(got, want, strict=True):
        assert isinstance(a, torch.Tensor)
        assert torch.equal(a, b)
    # Differentiable with respect to q and k as with torch caches.
    q_grad = q.clone().requires_grad_()
    out_q, _ = apply_rotary_pos_emb(q_grad, k, cos, sin)
    out_q.sum().backward()
    theirs = q.clone().requires_grad_()
    hf[0].apply_rotary_pos_emb(theirs, k, torch.from_numpy(cos), torch.from_numpy(sin))[
        0
    ].sum().backward()
    assert torch.equal(q_grad.grad, theirs.grad)


def test_caches_numpy_cannot_view_take_torch_path(hf):
    """Full-width CPU caches are checked and halved as NumPy views where torch gives
    them; a cache with torch's negative bit (which ``Tensor.numpy()`` refuses) takes
    torch's own slicing and comparison, with the same result: transformers' bit for bit,
    and the halves still checked."""
    import torch

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 5, 8, generator=generator)
    freqs = torch.rand(1, 5, 4, generator=generator) * 20
    cos = torch.cat([freqs, freqs], -1).cos()
    minus_sin = -torch.cat([freqs, freqs], -1).sin()
    sin = minus_sin._neg_view()  # the values of sin, stored negated
    assert sin.is_neg()
    got, _ = apply_rotary_pos_emb(q, q, cos, sin)
    want, _ = hf[0].apply_rotary_pos_emb(q, q, cos, sin.resolve_neg())
    assert torch.equal(got, want)
    minus_sin[0, 2, 5] += 1.0  # sin[0, 2, 5] changes, sin[0, 2, 1] does not
    with pytest.raises(ValueError, match=r"the halves of sin differ: sin\[0, 2, 1\]"):
        apply_rotary_pos_emb(q, q, cos, sin)
