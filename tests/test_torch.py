"""torch tensors: CPU tensors in and out of the operator (every dtype, zero-copy, out=
and in place, strided views), and numba_rope.torch, the differentiable custom op
(gradcheck, the gradient of an independent torch RoPE, torch.compile).

Oracles: ``numba_rope.reference.rotary_embedding`` on the same data as NumPy arrays
(``precision="contract"``: the kernels' promise, bit for bit in every dtype; it uses
only IEEE + - * and rounding casts, the same bits on every CPU), the tests' own
``float32_contract``, and autograd through a RoPE written here with torch operations
(Hugging Face's rotate_half form). Skipped as a whole where torch is not installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from oracles import BFLOAT16, float32_contract
from plan_counting import fresh_plan_tables

import numba_rope
from numba_rope import reference
from numba_rope._cpu import backend as cpu_backend

torch = pytest.importorskip("torch")
import numba_rope.torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NUMPY_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": BFLOAT16,
    "float64": np.dtype(np.float64),
}


def tensor(array: np.ndarray):
    """A torch tensor over a NumPy array's memory (bfloat16 through int16)."""
    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def host(t) -> np.ndarray:
    """A NumPy copy of a tensor's values (bfloat16 as ml_dtypes.bfloat16)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16).copy()
    return t.numpy().copy()


def case(rng, dtype, shape=(2, 3, 5, 8), n_positions=12, half=None):
    x = rng.standard_normal(shape).astype(dtype)
    half = half or shape[-1] // 2
    angles = rng.uniform(-4, 4, (n_positions, half))
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    return x, cos, sin


# -- torch CPU tensors through numba_rope.rotary_embedding ------------------------------


@pytest.mark.parametrize("dtype_name", NUMPY_DTYPES)
@pytest.mark.parametrize(
    "options",
    [
        {"position_ids": "ids"},
        {"position_offset": 3},
        {"position_offset": "offsets", "layout": "bshd"},
        {"position_ids": "ids", "interleaved": True, "rotary_embedding_dim": 4},
        {"position_offset": 2, "inverse": True},
    ],
    ids=["ids", "offset", "offsets-bshd", "interleaved-partial", "inverse"],
)
def test_cpu_tensors_match_the_reference_bit_for_bit(rng, dtype_name, options):
    dtype = NUMPY_DTYPES[dtype_name]
    x, cos, sin = case(rng, dtype, half=options.get("rotary_embedding_dim", 8) // 2)
    options = dict(options)
    numpy_options = dict(options)
    if options.get("position_ids") == "ids":
        ids = rng.integers(0, 12, (2, 5))
        numpy_options["position_ids"], options["position_ids"] = ids, torch.from_numpy(ids)
    if options.get("position_offset") == "offsets":
        offsets = np.array([0, 6])
        numpy_options["position_offset"] = offsets
        options["position_offset"] = torch.from_numpy(offsets)
    if dtype != np.float32 and dtype != np.float64 and "rotary_embedding_dim" not in options:
        cos, sin = cos.astype(np.float32), sin.astype(np.float32)  # float32 caches too
    got = numba_rope.rotary_embedding(tensor(x), tensor(cos), tensor(sin), **options)
    assert isinstance(got, torch.Tensor) and got.dtype == getattr(torch, dtype_name)
    assert got.is_contiguous() and tuple(got.shape) == x.shape
    expected = reference.rotary_embedding(x, cos, sin, precision="contract", **numpy_options)
    np.testing.assert_array_equal(
        host(got).view(f"u{dtype.itemsize}"), expected.view(f"u{dtype.itemsize}")
    )


def test_float32_contract_oracle_agrees(rng):
    """The same call against the tests' own contract emulation (independent indexing)."""
    x, cos, sin = case(rng, np.float32)
    ids = rng.integers(0, 12, (2, 5))
    got = numba_rope.rotary_embedding(tensor(x), tensor(cos), tensor(sin), torch.from_numpy(ids))
    np.testing.assert_array_equal(host(got), float32_contract(x, cos, sin, ids))


def _capture_backend_run(monkeypatch):
    """Record the NumPy arrays the CPU backend receives and returns (every call through
    the general path: no remembered plans)."""
    seen: dict = {}
    original = cpu_backend.run
    fresh_plan_tables(monkeypatch)
    monkeypatch.setattr(cpu_backend, "remember_plan", lambda key, plan: None)

    def run(call, inputs, outs, cos, sin, *rest):
        seen["inputs"], seen["outs"], seen["caches"] = inputs, outs, (cos, sin)
        seen["results"] = original(call, inputs, outs, cos, sin, *rest)
        return seen["results"]

    monkeypatch.setattr(cpu_backend, "run", run)
    return seen


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_no_hidden_copies(rng, monkeypatch, dtype_name):
    """The kernel reads the tensors' own memory and writes the memory of the tensor
    returned: views in, a view out (bfloat16 too, through int16)."""
    dtype = NUMPY_DTYPES[dtype_name]
    x, cos, sin = case(rng, dtype)
    tx, tc, ts = tensor(x), tensor(cos), tensor(sin)
    seen = _capture_backend_run(monkeypatch)
    got = numba_rope.rotary_embedding(tx, tc, ts, position_offset=1)
    (kernel_input,), (kernel_result,) = seen["inputs"], seen["results"]
    assert kernel_input.ctypes.data == tx.data_ptr()
    assert [c.ctypes.data for c in seen["caches"]] == [tc.data_ptr(), ts.data_ptr()]
    assert got.data_ptr() == kernel_result.ctypes.data
    kernel_result.view(np.uint8)[:] = 0  # what the kernel's memory holds, the tensor shows
    assert not bool(got.view(torch.uint8).any())


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_out_and_in_place(rng, monkeypatch, dtype_name):
    dtype = NUMPY_DTYPES[dtype_name]
    x, cos, sin = case(rng, dtype)
    expected = reference.rotary_embedding(x, cos, sin, position_offset=4, precision="contract")
    out = torch.zeros(x.shape, dtype=getattr(torch, dtype_name))
    pointer, version = out.data_ptr(), out._version
    seen = _capture_backend_run(monkeypatch)
    got = numba_rope.rotary_embedding(
        tensor(x), tensor(cos), tensor(sin), position_offset=4, out=out
    )
    assert got is out and out.data_ptr() == pointer
    assert seen["outs"][0].ctypes.data == pointer  # written through a view, not copied back
    assert out._version > version  # as an in-place torch operation would count it
    np.testing.assert_array_equal(host(out), expected)

    tx = tensor(x.copy())
    got = numba_rope.rotary_embedding(tx, tensor(cos), tensor(sin), position_offset=4, out=tx)
    assert got is tx
    assert seen["inputs"][0] is seen["outs"][0]  # one view: the kernel knows it is in place
    np.testing.assert_array_equal(host(tx), expected)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_repeated_small_calls_take_the_plans_of_numpy_calls(rng, monkeypatch, dtype_name):
    """torch CPU calls run as the NumPy call on the tensors' memory: a signature seen
    before takes its remembered plan (no general path), and still writes the tensors'
    own memory, in place and into out=, with the contract's bits."""
    dtype = NUMPY_DTYPES[dtype_name]
    x, cos, sin = case(rng, dtype)
    expected = reference.rotary_embedding(x, cos, sin, position_offset=2, precision="contract")
    tc, ts = tensor(cos), tensor(sin)
    fresh_plan_tables(monkeypatch)
    numba_rope.rotary_embedding(tensor(x.copy()), tc, ts, position_offset=2)  # a plan now
    out = torch.zeros(x.shape, dtype=getattr(torch, dtype_name))
    numba_rope.rotary_embedding(tensor(x.copy()), tc, ts, position_offset=2, out=out)
    general = []
    monkeypatch.setattr(cpu_backend, "run", lambda *args: general.append(args))
    version = out._version
    got = numba_rope.rotary_embedding(tensor(x), tc, ts, position_offset=2, out=out)
    assert got is out and out._version > version
    np.testing.assert_array_equal(host(out), expected)
    allocated = numba_rope.rotary_embedding(tensor(x), tc, ts, position_offset=2)
    assert isinstance(allocated, torch.Tensor)
    np.testing.assert_array_equal(host(allocated), expected)
    work = tensor(x.copy())
    assert numba_rope.rotary_embedding(work, tc, ts, position_offset=2, out=work) is work
    np.testing.assert_array_equal(host(work), expected)
    assert general == []  # every call above ran a plan


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_plain_tensors_take_one_pass_and_others_the_general_path(rng, monkeypatch, dtype_name):
    """Calls whose tensors are plain (``torch.Tensor`` itself on the CPU, strided, no
    autograd, no negative or conjugate bit; an ``int`` offset or none) are viewed in one
    pass (``torch_host.plain_views``) and made as the NumPy call; any other goes the
    general path (``rotary._torch_host_views``), which resolves or refuses what it
    finds. Both give the contract's bits, write the tensors' own memory and count
    the write in ``out``'s version."""
    from numba_rope import rotary

    dtype = NUMPY_DTYPES[dtype_name]
    x, cos, sin = case(rng, dtype)
    k = rng.standard_normal((2, 1, 5, 8)).astype(dtype)
    want = reference.rotary_embedding(x, cos, sin, position_offset=3, precision="contract")
    want_k = reference.rotary_embedding(k, cos, sin, position_offset=3, precision="contract")
    general = []
    views = rotary._torch_host_views
    monkeypatch.setattr(rotary, "_torch_host_views", lambda *a: general.append(1) or views(*a))
    tc, ts = tensor(cos), tensor(sin)

    for _ in range(cpu_backend.FAST_AFTER + 2):  # compiled plans of the NumPy call too
        got = numba_rope.rotary_embedding(tensor(x), tc, ts, position_offset=3)
        assert isinstance(got, torch.Tensor) and got.dtype == tc.dtype
        np.testing.assert_array_equal(host(got), want)
        out = torch.zeros_like(tc.new_empty(x.shape))
        version = out._version
        assert numba_rope.rotary_embedding(tensor(x), tc, ts, position_offset=3, out=out) is out
        assert out._version > version
        np.testing.assert_array_equal(host(out), want)
        work = tensor(x.copy())
        assert numba_rope.rotary_embedding(work, tc, ts, position_offset=3, out=work) is work
        np.testing.assert_array_equal(host(work), want)
        q_work, k_work = tensor(x.copy()), tensor(k.copy())
        got_q, got_k = numba_rope.rotary_embedding_qk(
            q_work, k_work, tc, ts, position_offset=3, out_q=q_work, out_k=k_work
        )
        assert got_q is q_work and got_k is k_work
        np.testing.assert_array_equal(host(q_work), want)
        np.testing.assert_array_equal(host(k_work), want_k)
        got_q, got_k = numba_rope.rotary_embedding_qk(
            tensor(x), tensor(k), tc, ts, position_offset=3
        )
        np.testing.assert_array_equal(host(got_q), want)
        np.testing.assert_array_equal(host(got_k), want_k)
    assert general == []

    class Mine(torch.Tensor):
        pass

    others = {
        "a subclass": lambda: numba_rope.rotary_embedding(
            tensor(x).as_subclass(Mine), tc, ts, position_offset=3
        ),
        "a negative view": lambda: numba_rope.rotary_embedding(
            torch._neg_view(-tensor(x)), tc, ts, position_offset=3
        ),
        "an offset tensor": lambda: numba_rope.rotary_embedding(
            tensor(x), tc, ts, position_offset=torch.tensor(3)
        ),
        "requiring grad, under no_grad": lambda: numba_rope.rotary_embedding(
            tensor(x.copy()).requires_grad_(), tc, ts, position_offset=3
        ),
    }
    for name, call in others.items():
        with torch.no_grad():
            got = call()
        np.testing.assert_array_equal(host(got), want, err_msg=name)
    assert len(general) == len(others)
    with pytest.raises(TypeError, match="input requires grad"):  # named by the general path
        numba_rope.rotary_embedding(tensor(x.copy()).requires_grad_(), tc, ts, position_offset=3)


def test_in_place_bump_makes_a_stale_graph_fail(rng):
    """A tensor saved for backward and then rotated in place: backward refuses, as
    after any in-place torch operation (no silent gradient of stale values)."""
    x, cos, sin = case(rng, np.float32)
    w = torch.randn(x.shape, requires_grad=True)
    t = torch.from_numpy(x.copy())
    loss = (w * t).sum()  # saves t for w's gradient
    numba_rope.rotary_embedding(t, tensor(cos), tensor(sin), position_offset=0, out=t)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_strided_views_and_fused_qkv_in_place(rng):
    """Views of a fused qkv tensor (bshd), rotated in place through rotary_embedding_qk,
    and a transposed input and output."""
    qkv = rng.standard_normal((2, 5, 4 + 2 + 2, 8)).astype(np.float32)
    cos, sin = case(rng, np.float32)[1:]
    q_np, k_np = qkv[:, :, :4], qkv[:, :, 4:6]
    expected_q = reference.rotary_embedding(
        q_np, cos, sin, position_offset=2, layout="bshd", precision="contract"
    )
    expected_k = reference.rotary_embedding(
        k_np, cos, sin, position_offset=2, layout="bshd", precision="contract"
    )
    t = torch.from_numpy(qkv.copy())
    q, k = t[:, :, :4], t[:, :, 4:6]
    got_q, got_k = numba_rope.rotary_embedding_qk(
        q, k, tensor(cos), tensor(sin), position_offset=2, layout="bshd", out_q=q, out_k=k
    )
    assert got_q is q and got_k is k
    np.testing.assert_array_equal(t[:, :, :4].numpy(), expected_q)
    np.testing.assert_array_equal(t[:, :, 4:6].numpy(), expected_k)
    np.testing.assert_array_equal(t[:, :, 6:].numpy(), qkv[:, :, 6:])  # v untouched

    # A bhsd tensor seen as bshd through a transpose, written into a transposed out.
    x = rng.standard_normal((2, 3, 5, 8)).astype(np.float32)
    tx = torch.from_numpy(x).transpose(1, 2)  # [b, s, h, d], not contiguous
    out = torch.empty(2, 3, 5, 8).transpose(1, 2)
    numba_rope.rotary_embedding(
        tx, tensor(cos), tensor(sin), position_offset=1, layout="bshd", out=out
    )
    expected = reference.rotary_embedding(x, cos, sin, position_offset=1, precision="contract")
    np.testing.assert_array_equal(out.transpose(1, 2).numpy(), expected)


def test_torch_and_numpy_mixed_on_the_host(rng):
    """Both are host memory: accepted; each result is of its input's kind."""
    x, cos, sin = case(rng, np.float32)
    expected = reference.rotary_embedding(x, cos, sin, position_offset=0, precision="contract")
    got = numba_rope.rotary_embedding(torch.from_numpy(x), cos, sin, position_offset=0)
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), expected)
    got = numba_rope.rotary_embedding(x, tensor(cos), tensor(sin), position_offset=torch.tensor(0))
    assert type(got) is np.ndarray
    np.testing.assert_array_equal(got, expected)
    q, k = numba_rope.rotary_embedding_qk(
        torch.from_numpy(x), x.copy(), cos, sin, position_offset=0
    )
    assert isinstance(q, torch.Tensor) and type(k) is np.ndarray
    np.testing.assert_array_equal(q.numpy(), k)


def test_inference_tensors_are_written_only_in_inference_mode(rng):
    """An ``out`` made under torch.inference_mode() is refused outside it, untouched (in
    place too, and q's and k's), as torch refuses to update one in place; inside it, it
    gets the contract's bits."""
    x, cos, sin = case(rng, np.float32)
    tc, ts = tensor(cos), tensor(sin)
    expected = reference.rotary_embedding(x, cos, sin, position_offset=1, precision="contract")
    with torch.inference_mode():
        out, q, k = torch.zeros(x.shape), torch.from_numpy(x.copy()), torch.from_numpy(x.copy())
    calls = {
        "out": lambda: numba_rope.rotary_embedding(torch.from_numpy(x), tc, ts, out=out,
                                                   position_offset=1),
        "in place": lambda: numba_rope.rotary_embedding(q, tc, ts, out=q, position_offset=1),
        "q and k": lambda: numba_rope.rotary_embedding_qk(q, k, tc, ts, out_q=q, out_k=k,
                                                          position_offset=1),
    }  # fmt: skip
    for name, call in calls.items():
        for _ in range(cpu_backend.FAST_AFTER + 2):  # compiled plans too
            with pytest.raises(RuntimeError, match=r"inference tensor.*torch.inference_mode"):
                call()
        assert not out.any() and torch.equal(q, k), name
        np.testing.assert_array_equal(q.numpy(), x)
    with torch.inference_mode():
        for call in calls.values():
            call()
    # out and k rotated once; q twice (in place, then with k)
    np.testing.assert_array_equal(out.numpy(), expected)
    np.testing.assert_array_equal(k.numpy(), expected)
    np.testing.assert_array_equal(
        q.numpy(), reference.rotary_embedding(expected, cos, sin, position_offset=1,
                                              precision="contract")
    )  # fmt: skip


def test_negative_and_conjugate_views(rng):
    """A negative view as input is read as the values it means; as out it is refused
    before anything is written."""
    x, cos, sin = case(rng, np.float32)
    negated = torch._neg_view(torch.from_numpy(-x))
    assert negated.is_neg()
    got = numba_rope.rotary_embedding(negated, tensor(cos), tensor(sin), position_offset=0)
    expected = reference.rotary_embedding(x, cos, sin, position_offset=0, precision="contract")
    np.testing.assert_array_equal(got.numpy(), expected)
    out = torch._neg_view(torch.zeros(x.shape))
    with pytest.raises(ValueError, match=r"out is a torch view with the negative bit set"):
        numba_rope.rotary_embedding(
            torch.from_numpy(x), tensor(cos), tensor(sin), position_offset=0, out=out
        )
    assert not bool(out.any())
    complex_conj = torch.zeros(2, 3, 5, 8, dtype=torch.complex64).conj()
    with pytest.raises(TypeError, match="complex64"):
        numba_rope.rotary_embedding(complex_conj, tensor(cos), tensor(sin), position_offset=0)


def test_refusals(rng):
    x, cos, sin = case(rng, np.float32)
    tc, ts = tensor(cos), tensor(sin)
    grad_x = torch.from_numpy(x).requires_grad_()
    with pytest.raises(
        TypeError, match=r"input requires grad.*numba_rope\.torch\.rotary_embedding"
    ):
        numba_rope.rotary_embedding(grad_x, tc, ts, position_offset=0)
    with torch.no_grad():  # no gradient wanted: accepted
        got = numba_rope.rotary_embedding(grad_x, tc, ts, position_offset=0)
    expected = reference.rotary_embedding(x, cos, sin, position_offset=0, precision="contract")
    np.testing.assert_array_equal(got.numpy(), expected)
    with pytest.raises(TypeError, match=r"float8_e4m3fn, which has no NumPy equivalent"):
        numba_rope.rotary_embedding(
            torch.zeros(2, 3, 5, 8, dtype=torch.float8_e4m3fn), tc, ts, position_offset=0
        )
    with pytest.raises(TypeError, match=r"layout torch\.sparse_coo.*to_dense"):
        numba_rope.rotary_embedding(torch.from_numpy(x).to_sparse(), tc, ts, position_offset=0)
    with pytest.raises(TypeError, match=r"torch\.Tensor on device 'meta'"):
        numba_rope.rotary_embedding(
            torch.empty(2, 3, 5, 8, device="meta"), tc, ts, position_offset=0
        )
    with pytest.raises(TypeError, match=r"input has dtype int32"):
        numba_rope.rotary_embedding(
            torch.zeros(2, 3, 5, 8, dtype=torch.int32), tc, ts, position_offset=0
        )
    out = torch.zeros(2, 3, 5, 8)
    with pytest.raises(IndexError, match="position_ids"):
        numba_rope.rotary_embedding(torch.from_numpy(x), tc, ts, torch.full((2, 5), 12), out=out)
    assert not bool(out.any())  # nothing written on an error
    with pytest.raises(ValueError, match="share"):
        numba_rope.rotary_embedding(
            torch.from_numpy(x), tc, ts, position_offset=0, out=torch.zeros(8).expand(2, 3, 5, 8)
        )


def test_import_numba_rope_imports_neither_torch_nor_cuda_and_torch_cpu_stays_off_cuda():
    code = (
        "import sys, numba_rope\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "x = torch.ones(1, 1, 2, 4)\n"
        "cos, sin = numba_rope.rope_cache(4, 4)\n"
        "y = numba_rope.rotary_embedding(x, cos, sin, position_offset=0)\n"
        "assert isinstance(y, torch.Tensor)\n"
        "assert 'numba.cuda' not in sys.modules, 'numba.cuda imported'\n"
        "assert 'numba_rope.torch' not in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr


# -- numba_rope.torch: autograd --------------------------------------------------------


def hf_style_rope(x, cos, sin, positions, rotary_dim):
    """RoPE in torch operations, as Hugging Face writes it (bhsd, non-interleaved):
    ``x * cos + rotate_half(x) * sin`` over the first ``rotary_dim`` channels, with
    full-width caches gathered by position. Independent of numba_rope."""
    c = torch.cat([cos, cos], dim=-1)[positions].unsqueeze(1)  # [b, 1, s, rotary_dim]
    s = torch.cat([sin, sin], dim=-1)[positions].unsqueeze(1)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * c + rotated_half * s, rest], dim=-1)


@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_gradient_equals_autograd_through_an_independent_torch_rope(rng, rotary_dim):
    """float32, bit for bit: autograd of ``x*c + rotate_half(x)*s`` gives, per pair,
    ``g1*c + g2*s`` and ``g2*c - g1*s`` (two products rounded, one sum rounded; the
    negation is exact and IEEE addition commutes), which is what the inverse rotation
    evaluates, one rounding per operation. So they agree on every CPU."""
    x, cos, sin = case(rng, np.float32, half=rotary_dim // 2)
    ids = rng.integers(0, 12, (2, 5))
    g = torch.from_numpy(rng.standard_normal(x.shape).astype(np.float32))
    ours = torch.from_numpy(x).requires_grad_()
    theirs = torch.from_numpy(x.copy()).requires_grad_()
    y_ours = numba_rope.torch.rotary_embedding(
        ours, tensor(cos), tensor(sin), torch.from_numpy(ids), rotary_embedding_dim=rotary_dim
    )
    y_theirs = hf_style_rope(theirs, tensor(cos), tensor(sin), torch.from_numpy(ids), rotary_dim)
    assert torch.equal(y_ours, y_theirs)  # the same products and sums forward too
    y_ours.backward(g)
    y_theirs.backward(g)
    assert torch.equal(ours.grad, theirs.grad)


def test_gradient_against_finite_differences_of_the_float64_reference(rng):
    """The backward of float64 input against central differences of
    numba_rope.reference (an independent float64 evaluation): the function is linear in
    the input, so a central difference is exact up to rounding (step 1, error about
    1e-15 per element)."""
    x, cos, sin = case(rng, np.float64, shape=(1, 2, 3, 6), n_positions=5)
    ids = np.array([[4, 0, 2]])
    weights = rng.standard_normal(x.shape)
    t = torch.from_numpy(x.copy()).requires_grad_()
    y = numba_rope.torch.rotary_embedding(
        t, tensor(cos), tensor(sin), torch.from_numpy(ids), interleaved=True
    )
    (y * torch.from_numpy(weights)).sum().backward()
    numeric = np.empty_like(x)
    for index in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[index] = 1.0
        plus = reference.rotary_embedding(x + step, cos, sin, ids, interleaved=True)
        minus = reference.rotary_embedding(x - step, cos, sin, ids, interleaved=True)
        numeric[index] = ((plus - minus) * weights).sum() / 2
    np.testing.assert_allclose(t.grad.numpy(), numeric, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "options",
    [
        {"position_offset": 2},
        {"position_offset": "offsets", "layout": "bshd", "interleaved": True},
        {"position_ids": "ids", "rotary_embedding_dim": 4, "inverse": True},
        {"num_heads": 2, "position_offset": 1},  # 3-D: [batch, seq, heads * head]
    ],
    ids=["offset", "offsets-bshd-interleaved", "ids-partial-inverse", "3d"],
)
def test_gradcheck_float64(rng, options):
    """The kernels take float64 (computed in float64): torch's gradcheck compares the
    backward with its own finite differences, and gradgradcheck the double backward."""
    options = dict(options)
    three_d = "num_heads" in options  # [batch, seq, heads * head] from [b, s, h, d]
    x, cos, sin = case(rng, np.float64, shape=(2, 5, 2, 8) if three_d else (2, 3, 5, 8))
    x = x.reshape(2, 5, 16) if three_d else x
    if options.get("position_offset") == "offsets":
        options["position_offset"] = torch.tensor([0, 4])
    if options.get("position_ids") == "ids":
        options["position_ids"] = torch.from_numpy(rng.integers(0, 12, (2, 5)))
    if options.get("rotary_embedding_dim") == 4:
        cos, sin = cos[:, :2], sin[:, :2]
    tc, ts = tensor(np.ascontiguousarray(cos)), tensor(np.ascontiguousarray(sin))

    def rope(t):
        return numba_rope.torch.rotary_embedding(t, tc, ts, **options)

    t = torch.from_numpy(x).requires_grad_()
    assert torch.autograd.gradcheck(rope, (t,))
    assert torch.autograd.gradgradcheck(rope, (t,))


def test_qk_gradients_with_grouped_query_attention_and_one_unused(rng):
    x, cos, sin = case(rng, np.float64, shape=(2, 5, 4, 8))
    k_np = rng.standard_normal((2, 5, 2, 8))
    tc, ts = tensor(cos), tensor(sin)
    q = torch.from_numpy(x).requires_grad_()
    k = torch.from_numpy(k_np).requires_grad_()

    def rope(q, k):
        return numba_rope.torch.rotary_embedding_qk(q, k, tc, ts, position_offset=3, layout="bshd")

    assert torch.autograd.gradcheck(rope, (q, k))
    q_out, _ = rope(q, k)  # k's output unused: torch hands backward zeros for it
    q_out.sum().backward()
    assert not bool(k.grad.any())
    expected = numba_rope.rotary_embedding(
        np.ones_like(x), cos, sin, position_offset=3, layout="bshd", inverse=True
    )
    np.testing.assert_array_equal(q.grad.numpy(), expected)


def test_cache_gradients_are_refused(rng):
    x, cos, sin = case(rng, np.float32)
    tc = tensor(cos).requires_grad_()
    with pytest.raises(NotImplementedError, match=r"cos_cache\.detach\(\)"):
        numba_rope.torch.rotary_embedding(torch.from_numpy(x), tc, tensor(sin), position_offset=0)
    with torch.no_grad():
        numba_rope.torch.rotary_embedding(torch.from_numpy(x), tc, tensor(sin), position_offset=0)
    # Through the op itself (no wrapper check): refused at backward, not a silent None.
    y = torch.ops.numba_rope.rotary_embedding(
        torch.from_numpy(x), tc, tensor(sin), None, 0, None, False, 0, "bhsd", None, False, False
    )
    with pytest.raises(NotImplementedError, match="cos_cache"):
        y.sum().backward()


# -- forward mode and torch.func --------------------------------------------------------
# torch's own warning: forward mode's first use compiles torch's decompositions with
# torch.jit.script, which torch 2.13 deprecates. (vmap's "performance drop" warning, for
# an op without a batching rule, stays an error here: the ops have one.)
FORWARD_WARNINGS = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")


FORWARD_OPTIONS = [
    {"position_offset": 2},
    {"position_offset": "offsets", "layout": "bshd", "interleaved": True},
    {"position_ids": "ids", "rotary_embedding_dim": 4, "inverse": True},
    {"num_heads": 2, "position_offset": 1},  # 3-D: [batch, seq, heads * head]
]
FORWARD_IDS = ["offset", "offsets-bshd-interleaved", "ids-partial-inverse", "3d"]


def _float64_case(rng, options):
    """float64 input, caches and the call's options (tensors), as test_gradcheck_float64."""
    options = dict(options)
    three_d = "num_heads" in options
    x, cos, sin = case(rng, np.float64, shape=(2, 5, 2, 8) if three_d else (2, 3, 5, 8))
    x = x.reshape(2, 5, 16) if three_d else x
    if options.get("position_offset") == "offsets":
        options["position_offset"] = np.array([0, 4])
    if options.get("position_ids") == "ids":
        options["position_ids"] = rng.integers(0, 12, (2, 5))
    if options.get("rotary_embedding_dim") == 4:
        cos, sin = np.ascontiguousarray(cos[:, :2]), np.ascontiguousarray(sin[:, :2])
    return x, cos, sin, options


def _as_tensors(options):
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in options.items()}


@FORWARD_WARNINGS
@pytest.mark.parametrize("options", FORWARD_OPTIONS, ids=FORWARD_IDS)
def test_forward_mode_gives_the_rotated_tangent(rng, options):
    """The operator is linear in its input: the tangent of the output is the rotation of
    the input's tangent, and the Jacobian the rotation of each unit vector. Oracle:
    numba_rope.reference in float64, bit for bit on every CPU: both evaluate each
    element as two products and one sum or difference, each rounded once (the kernels
    contract no FMA, NumPy's elementwise operations none either); for a unit vector
    each element is a cache value, its negation or zero, exactly. Before, a tangent
    was dropped without a word (a custom op has no forward-mode rule): jvp gave None,
    jacfwd zeros."""
    x, cos, sin, options = _float64_case(rng, options)
    direction = rng.standard_normal(x.shape)
    expected = reference.rotary_embedding(direction, cos, sin, **options)
    tc, ts, topts = tensor(cos), tensor(sin), _as_tensors(options)

    def rope(t):
        return numba_rope.torch.rotary_embedding(t, tc, ts, **topts)

    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(torch.from_numpy(x), torch.from_numpy(direction))
        primal, tangent = torch.autograd.forward_ad.unpack_dual(rope(dual))
    np.testing.assert_array_equal(
        primal.numpy(), reference.rotary_embedding(x, cos, sin, **options)
    )
    np.testing.assert_array_equal(tangent.numpy(), expected)
    _, tangent = torch.func.jvp(rope, (torch.from_numpy(x),), (torch.from_numpy(direction),))
    np.testing.assert_array_equal(tangent.numpy(), expected)

    basis = np.eye(x.size).reshape(x.size, *x.shape)
    jacobian = np.stack([reference.rotary_embedding(e, cos, sin, **options) for e in basis], -1)
    jacobian = jacobian.reshape(*x.shape, *x.shape)
    for transform in (torch.func.jacfwd, torch.func.jacrev):
        np.testing.assert_array_equal(transform(rope)(torch.from_numpy(x)).numpy(), jacobian)
    t = torch.from_numpy(x).requires_grad_()
    assert torch.autograd.gradcheck(rope, (t,), check_forward_ad=True, check_batched_grad=False)


@FORWARD_WARNINGS
def test_qk_forward_mode_with_a_tangent_for_q_only(rng):
    """q and k with grouped-query heads, q dual, k not: q's tangent is its rotation, k's
    none (forward_ad) or zero (torch.func.jvp); oracle as above."""
    q, cos, sin = case(rng, np.float64, shape=(2, 5, 4, 8))
    k = rng.standard_normal((2, 5, 2, 8))
    direction = rng.standard_normal(q.shape)
    options = {"position_offset": 3, "layout": "bshd"}
    expected = reference.rotary_embedding(direction, cos, sin, **options)
    tc, ts = tensor(cos), tensor(sin)

    def rope(q, k):
        return numba_rope.torch.rotary_embedding_qk(q, k, tc, ts, **options)

    forward_ad = torch.autograd.forward_ad
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(torch.from_numpy(q), torch.from_numpy(direction))
        q_out, k_out = rope(dual, torch.from_numpy(k))
        np.testing.assert_array_equal(forward_ad.unpack_dual(q_out).tangent.numpy(), expected)
        k_tangent = forward_ad.unpack_dual(k_out).tangent
        assert k_tangent is None or not bool(k_tangent.any())
        np.testing.assert_array_equal(
            forward_ad.unpack_dual(k_out).primal.numpy(),
            reference.rotary_embedding(k, cos, sin, **options),
        )
    # Both modes at once, k's output unused: q's gradient is the inverse rotation of
    # the weights (k's output gets no gradient: the forward-mode function's zeros).
    weights = rng.standard_normal(q.shape)
    with forward_ad.dual_level():
        q_both = torch.from_numpy(q.copy()).requires_grad_()
        q_out, _ = rope(
            forward_ad.make_dual(q_both, torch.from_numpy(direction)), torch.from_numpy(k)
        )
        (q_out * torch.from_numpy(weights)).sum().backward()
    np.testing.assert_array_equal(
        q_both.grad.numpy(), reference.rotary_embedding(weights, cos, sin, inverse=True, **options)
    )
    tangents = (torch.from_numpy(direction), torch.zeros(k.shape, dtype=torch.float64))
    _, (q_tangent, k_tangent) = torch.func.jvp(
        rope, (torch.from_numpy(q), torch.from_numpy(k)), tangents
    )
    np.testing.assert_array_equal(q_tangent.numpy(), expected)
    assert not bool(k_tangent.any())


@FORWARD_WARNINGS
def test_hessian_vector_product_through_forward_over_reverse(rng):
    """torch.func.jvp of torch.func.grad (the backward run under a forward-mode level):
    for f(x) = sum(rope(x)**2) the Hessian is 2 R^T R = 2 I (R is orthogonal), so the
    product with v is 2v, up to float64 rounding of cos**2 + sin**2 and the sums."""
    x, cos, sin = case(rng, np.float64)
    v = rng.standard_normal(x.shape)
    tc, ts = tensor(cos), tensor(sin)

    def loss(t):
        return (numba_rope.torch.rotary_embedding(t, tc, ts, position_offset=1) ** 2).sum()

    _, product = torch.func.jvp(
        torch.func.grad(loss), (torch.from_numpy(x),), (torch.from_numpy(v),)
    )
    np.testing.assert_allclose(product.numpy(), 2 * v, rtol=0, atol=1e-13)


VMAP_CASES = {
    # name: (options, the arguments mapped: a different one per sample; the rest shared)
    "offset": ({"position_offset": 2}, {"input"}),
    "offsets-mapped-bshd": ({"position_offset": "array", "layout": "bshd"}, {"input", "position_offset"}),
    "offsets-shared-interleaved": ({"position_offset": "array", "interleaved": True}, {"input"}),
    "ids-mapped-partial": ({"position_ids": "array", "rotary_embedding_dim": 4}, {"input", "position_ids"}),
    "ids-mapped-input-shared": ({"position_ids": "array"}, {"position_ids"}),
    "per-token-caches-inverse": ({"caches": "per-token", "inverse": True}, {"input"}),
    "caches-mapped": ({"position_offset": 1}, {"input", "cos_cache", "sin_cache"}),
    "3d": ({"num_heads": 2, "position_offset": 1}, {"input"}),
}  # fmt: skip


@FORWARD_WARNINGS
@pytest.mark.parametrize("axis", [0, 2])
@pytest.mark.parametrize("name", VMAP_CASES)
def test_vmap_folds_the_mapped_axis_into_the_batch(rng, monkeypatch, name, axis):
    """torch.func.vmap over numba_rope.torch.rotary_embedding, the mapped axis first or
    inside, each argument mapped or shared: each sample equals numba_rope.reference on
    it (float32, precision="contract": bit for bit on every CPU). The ops' batching rule
    folds the mapped axis into the operator's batch axis (one call); mapped cos/sin
    tables run the op once per sample."""
    rotate = numba_rope.torch._rotate_one
    options, mapped = VMAP_CASES[name]
    options, n = dict(options), 3
    shape = (2, 5, 16) if "num_heads" in options else (2, 3, 5, 8)
    half = 2 if options.get("rotary_embedding_dim") == 4 else 4
    per_token = options.pop("caches", None) == "per-token"
    angles = rng.uniform(-4, 4, (n, 2, 5, half) if per_token else (n, 12, half))
    samples = {
        "input": rng.standard_normal((n, *shape)).astype(np.float32),
        "cos_cache": np.cos(angles).astype(np.float32),
        "sin_cache": np.sin(angles).astype(np.float32),
    }
    for key, values in (
        ("position_offset", rng.integers(0, 6, (n, 2))),
        ("position_ids", rng.integers(0, 12, (n, 2, 5))),
    ):
        if options.get(key) == "array":
            samples[key] = values
            del options[key]
    names = sorted(mapped)
    shared = {k: torch.from_numpy(v[0]) for k, v in samples.items() if k not in mapped}
    in_dims = tuple(min(axis, samples[k].ndim - 1) for k in names)
    stacked = [
        torch.from_numpy(samples[k]).movedim(0, d) for k, d in zip(names, in_dims, strict=True)
    ]

    def rope(*values):
        arguments = {**shared, **dict(zip(names, values, strict=True))}
        x, cos, sin = (arguments.pop(k) for k in ("input", "cos_cache", "sin_cache"))
        return numba_rope.torch.rotary_embedding(x, cos, sin, **arguments, **options)

    calls = []
    monkeypatch.setattr(
        numba_rope.torch, "_rotate_one", lambda *a, **k: calls.append(1) or rotate(*a, **k)
    )
    got = torch.func.vmap(rope, in_dims=in_dims)(*stacked)
    assert len(calls) == (n if "cos_cache" in mapped else 1)
    for i in range(n):
        arguments = {k: v[i if k in mapped else 0] for k, v in samples.items()}
        x, cos, sin = (arguments.pop(k) for k in ("input", "cos_cache", "sin_cache"))
        expected = reference.rotary_embedding(
            x, cos, sin, **arguments, **options, precision="contract"
        )
        np.testing.assert_array_equal(got[i].numpy(), expected)


@FORWARD_WARNINGS
@pytest.mark.parametrize("mapped", ["q", "k", "both"])
def test_vmap_of_q_and_k_and_per_sample_gradients(rng, mapped):
    """q and k with grouped-query heads, one or both mapped, per-token full-width caches
    (Hugging Face's one table for the batch, through numba_rope.huggingface): each sample
    equals the reference; and per-sample gradients (vmap of grad) equal the inverse
    rotation of each sample's weights (the reference with inverse=True)."""
    from numba_rope.huggingface import apply_rotary_pos_emb

    n = 3
    q = rng.standard_normal((n, 2, 4, 5, 8)).astype(np.float32)
    k = rng.standard_normal((n, 2, 2, 5, 8)).astype(np.float32)
    angles = rng.uniform(-4, 4, (1, 5, 4))
    full = np.concatenate([angles, angles], -1)
    cos, sin = np.cos(full).astype(np.float32), np.sin(full).astype(np.float32)
    tc, ts = torch.from_numpy(cos), torch.from_numpy(sin)
    q_in = torch.from_numpy(q) if mapped != "k" else torch.from_numpy(q[0])
    k_in = torch.from_numpy(k) if mapped != "q" else torch.from_numpy(k[0])
    in_dims = (None if mapped == "k" else 0, None if mapped == "q" else 0)
    got_q, got_k = torch.func.vmap(
        lambda a, b: apply_rotary_pos_emb(a, b, tc, ts), in_dims=in_dims
    )(q_in, k_in)
    half = np.broadcast_to(cos[..., :4], (2, 5, 4)), np.broadcast_to(sin[..., :4], (2, 5, 4))
    for i in range(n):
        for got, x in (
            (got_q[i], q[0 if mapped == "k" else i]),
            (got_k[i], k[0 if mapped == "q" else i]),
        ):
            expected = reference.rotary_embedding(x, *half, precision="contract")
            np.testing.assert_array_equal(got.numpy(), expected)

    weights = rng.standard_normal(q.shape).astype(np.float32)
    tw = torch.from_numpy(weights)
    table_cos, table_sin = (
        tensor(np.ascontiguousarray(cos[0, :, :4])),
        tensor(np.ascontiguousarray(sin[0, :, :4])),
    )

    def loss(x, w):
        y = numba_rope.torch.rotary_embedding(x, table_cos, table_sin, position_offset=0)
        return (y * w).sum()

    grads = torch.func.vmap(torch.func.grad(loss))(torch.from_numpy(q), tw)
    for i in range(n):
        expected = reference.rotary_embedding(
            weights[i], cos[0, :, :4], sin[0, :, :4], position_offset=0, inverse=True,
            precision="contract",
        )  # fmt: skip
        np.testing.assert_array_equal(grads[i].numpy(), expected)


@FORWARD_WARNINGS
def test_nested_transforms(rng):
    """Transforms inside transforms. f(x) = sum(rope(x)**2) has the Hessian 2 R^T R = 2I
    (R orthogonal; float64 rounding of cos**2 + sin**2 and the sums aside): jacrev of
    jacrev (reverse over reverse: an outer grad level tracks what the inner one wraps),
    and the Jacobian of vmap(R) through vjp, reverse over vmap."""
    x, cos, sin = case(rng, np.float64, shape=(1, 2, 3, 4), n_positions=5, half=2)
    tc, ts = tensor(cos), tensor(sin)

    def rope(t):
        return numba_rope.torch.rotary_embedding(t, tc, ts, position_offset=1)

    hessian = torch.func.jacrev(torch.func.jacrev(lambda t: (rope(t) ** 2).sum()))(
        torch.from_numpy(x)
    )
    np.testing.assert_allclose(
        hessian.numpy().reshape(x.size, x.size), 2 * np.eye(x.size), rtol=0, atol=1e-14
    )
    rows = torch.from_numpy(np.stack([x, 2 * x]))
    weights = rng.standard_normal(rows.shape)
    _, pull = torch.func.vjp(torch.func.vmap(rope), rows)
    (grad,) = pull(torch.from_numpy(weights))
    for g, w in zip(grad.numpy(), weights, strict=True):
        np.testing.assert_array_equal(
            g, reference.rotary_embedding(w, cos, sin, position_offset=1, inverse=True)
        )


@FORWARD_WARNINGS
def test_errors_under_vmap_say_the_batch_is_folded(rng):
    """An error of the op under vmap names the folded batch (samples x batch): the
    message says so, and still names the rule (the position ids' shape)."""
    x, cos, sin = case(rng, np.float32, shape=(3, 2, 4, 5, 8))
    tc, ts = tensor(cos), tensor(sin)
    ids = torch.zeros(2, 6, dtype=torch.int64)  # seq_len 6 for inputs of 5 tokens
    with pytest.raises(ValueError, match=r"position_ids must have shape.*3 samples' batches of 2"):
        torch.func.vmap(lambda t: numba_rope.torch.rotary_embedding(t, tc, ts, ids))(
            torch.from_numpy(x)
        )


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_vjp_functions_run_after_their_transform_with_offset_tensors(rng, dtype_name):
    """torch.func.vjp returns a function that runs the backward after the transform
    has ended, with the tensors saved under it (caches, offsets) as its dead wrappers:
    they read as the tensors they stand for (a tensor of offsets took the general
    path, which refused them as tensors inside a transform). The gradient is the
    inverse rotation of the weights: the contract's reference, bit for bit."""
    dtype = NUMPY_DTYPES[dtype_name]
    x, cos, sin = case(rng, dtype, shape=(2, 5, 3, 8))
    k = rng.standard_normal((2, 5, 1, 8)).astype(dtype)
    offsets = np.array([3, 0])
    tc, ts, to = tensor(cos), tensor(sin), torch.from_numpy(offsets)
    weights = rng.standard_normal(x.shape).astype(dtype)
    weights_k = rng.standard_normal(k.shape).astype(dtype)

    def inverse(w):
        return reference.rotary_embedding(
            w, cos, sin, position_offset=offsets, layout="bshd", inverse=True,
            precision="contract",
        )  # fmt: skip

    _, pull = torch.func.vjp(
        lambda t: numba_rope.torch.rotary_embedding(t, tc, ts, position_offset=to, layout="bshd"),
        torch.from_numpy(x),
    )
    (grad,) = pull(torch.from_numpy(weights))
    np.testing.assert_array_equal(grad.numpy(), inverse(weights))
    _, pull = torch.func.vjp(
        lambda q, kk: numba_rope.torch.rotary_embedding_qk(
            q, kk, tc, ts, position_offset=to, layout="bshd"
        ),
        torch.from_numpy(x),
        torch.from_numpy(k),
    )
    grad_q, grad_k = pull((torch.from_numpy(weights), torch.from_numpy(weights_k)))
    np.testing.assert_array_equal(grad_q.numpy(), inverse(weights))
    np.testing.assert_array_equal(grad_k.numpy(), inverse(weights_k))


def test_batched_gradients_of_the_older_vmap(rng):
    """``torch.autograd.grad(..., is_grads_batched=True)`` (and what uses it:
    gradcheck's batched check, ``jacobian(vectorize=True)``) hands the backward a
    batched tensor of torch's older vmap, which has no memory to read: the backward
    calls the op through the dispatcher, whose fallback rotates each gradient of the
    batch. Each must be the inverse rotation of its weights (the reference, float64
    computed in float64 by both); the Jacobian of a rotation is its matrix, orthogonal."""
    x, cos, sin = case(rng, np.float64, shape=(2, 5, 2, 8))
    k = rng.standard_normal((2, 5, 1, 8))
    tc, ts = tensor(cos), tensor(sin)
    q_t = torch.from_numpy(x).requires_grad_()
    k_t = torch.from_numpy(k).requires_grad_()
    weights = rng.standard_normal((3, *x.shape))
    weights_k = rng.standard_normal((3, *k.shape))

    def inverse(w):
        return reference.rotary_embedding(
            w, cos, sin, position_offset=2, layout="bshd", inverse=True
        )

    def rope(t):
        return numba_rope.torch.rotary_embedding(t, tc, ts, position_offset=2, layout="bshd")

    (grads,) = torch.autograd.grad(rope(q_t), q_t, torch.from_numpy(weights), is_grads_batched=True)
    q_out, k_out = numba_rope.torch.rotary_embedding_qk(
        q_t, k_t, tc, ts, position_offset=2, layout="bshd"
    )
    grads_q, grads_k = torch.autograd.grad(
        (q_out, k_out), (q_t, k_t),
        (torch.from_numpy(weights), torch.from_numpy(weights_k)), is_grads_batched=True,
    )  # fmt: skip
    for i in range(3):
        np.testing.assert_array_equal(grads[i].numpy(), inverse(weights[i]))
        np.testing.assert_array_equal(grads_q[i].numpy(), inverse(weights[i]))
        np.testing.assert_array_equal(grads_k[i].numpy(), inverse(weights_k[i]))
    assert torch.autograd.gradcheck(rope, (q_t,), check_batched_grad=True)
    jacobian = torch.autograd.functional.jacobian(rope, q_t.detach(), vectorize=True)
    matrix = jacobian.numpy().reshape(x.size, x.size)
    # Each row holds one pair's cos and +-sin (float64): the diagonal is cos**2 + sin**2,
    # 1 within a few units of 2**-53 however BLAS sums (FMA or not), the rest 0 or c*s -
    # s*c, so 1e-14 holds on every CPU.
    np.testing.assert_allclose(matrix @ matrix.T, np.eye(x.size), rtol=0, atol=1e-14)


def test_meta_tensors_give_the_shape_of_the_result(rng):
    """Meta tensors (no data: shapes only, as a model built on ``torch.device("meta")``
    runs) go to the op's fake implementation, with or without grad (without grad they
    had taken the direct path and were refused as a device NumPy cannot read)."""
    x = torch.empty(2, 5, 3, 8, device="meta")
    k = torch.empty(2, 5, 1, 8, device="meta", dtype=torch.float32)
    cos, sin = torch.empty(12, 4, device="meta"), torch.empty(12, 4, device="meta")
    for grad in (False, True):
        q = x.clone().requires_grad_(grad)
        y = numba_rope.torch.rotary_embedding(q, cos, sin, position_offset=1, layout="bshd")
        yq, yk = numba_rope.torch.rotary_embedding_qk(
            q, k, cos, sin, position_offset=1, layout="bshd"
        )
        for got, like in ((y, x), (yq, x), (yk, k)):
            assert (got.shape, got.dtype, got.device.type) == (like.shape, like.dtype, "meta")
        assert y.requires_grad is grad


def test_nested_tensors_are_refused_with_the_way_out(rng):
    x, cos, sin = case(rng, np.float32, shape=(3, 2, 8))
    nested = torch.nested.nested_tensor(
        [torch.from_numpy(x), torch.from_numpy(x[:2])], layout=torch.jagged
    )
    with pytest.raises(TypeError, match=r"input is a nested torch tensor.*to_padded_tensor"):
        numba_rope.rotary_embedding(nested, tensor(cos), tensor(sin), position_offset=0)


def test_functionalize_calls_the_op(rng):
    """torch.func.functionalize (which torch.export and make_fx use) over the functions,
    vmap inside it too: the reference's values (it refused the autograd.Function a
    commit of this session had put there)."""
    x, cos, sin = case(rng, np.float32)
    tc, ts = tensor(cos), tensor(sin)

    def rope(t):
        return numba_rope.torch.rotary_embedding(t, tc, ts, position_offset=2)

    expected = reference.rotary_embedding(x, cos, sin, position_offset=2, precision="contract")
    got = torch.func.functionalize(rope)(torch.from_numpy(x))
    np.testing.assert_array_equal(got.numpy(), expected)
    stacked = torch.func.functionalize(torch.func.vmap(rope))(torch.from_numpy(x[None]))
    np.testing.assert_array_equal(stacked[0].numpy(), expected)


@FORWARD_WARNINGS
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
def test_forward_mode_inside_a_compiled_function_is_not_dropped(rng):
    """torch.compile(fullgraph=True) of torch.func.jvp over the function: an error (the
    op's registered autograd has no forward mode, so the call breaks the graph), not
    the zero tangent it gave before."""
    x, cos, sin = case(rng, np.float64)
    tc, ts = tensor(cos), tensor(sin)

    def tangent(t):
        rope = lambda a: numba_rope.torch.rotary_embedding(a, tc, ts, position_offset=1)  # noqa: E731
        return torch.func.jvp(rope, (t,), (t,))[1]

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"graph_break|disable\(\)"):
        torch.compile(tangent, fullgraph=True, backend="aot_eager")(torch.from_numpy(x))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_the_array_api_on_tensors_inside_torch_compile_runs_outside_its_graph(rng, backend):
    """numba_rope.rotary_embedding(_qk) (not numba_rope.torch) on torch CPU tensors in a
    compiled function: an int offset (which Dynamo makes a symbolic int after a second
    value), ids, ``out=`` in place, q and k, and flash_attn's form (offsets as ints):
    the contract's bits. Dynamo traced the NumPy views and numba refused the offset,
    turned into a 0-d array, with a typing error."""
    from numba_rope import flash_attn

    x, cos, sin = case(rng, np.float32, shape=(2, 3, 5, 8))
    tc, ts = tensor(cos), tensor(sin)
    ids = rng.integers(0, 12, (2, 5))

    def expected(offset=None, position_ids=None, values=x):
        return reference.rotary_embedding(
            values, cos, sin, position_ids, position_offset=offset, precision="contract"
        )

    def new(a, offset):
        return numba_rope.rotary_embedding(a, tc, ts, position_offset=offset)

    def in_place(a, offset):
        numba_rope.rotary_embedding(a, tc, ts, position_offset=offset, out=a)
        return a * 1

    def two(a, offset):
        return numba_rope.rotary_embedding_qk(a, a * 2, tc, ts, position_offset=offset)[1]

    def flash(a, offset):  # [batch, seq, heads, head]: the bshd layout
        return flash_attn.apply_rotary_emb(a.transpose(1, 2), tc, ts, seqlen_offsets=offset)

    torch._dynamo.reset()
    compiled = {name: torch.compile(f, backend=backend) for name, f in
                {"new": new, "in_place": in_place, "two": two, "flash": flash}.items()}  # fmt: skip
    for offset in (0, 3, 4):
        np.testing.assert_array_equal(
            compiled["new"](torch.from_numpy(x), offset).numpy(), expected(offset)
        )
        np.testing.assert_array_equal(
            compiled["in_place"](torch.from_numpy(x.copy()), offset).numpy(), expected(offset)
        )
        np.testing.assert_array_equal(
            compiled["two"](torch.from_numpy(x), offset).numpy(), expected(offset, values=x * 2)
        )
        got = compiled["flash"](torch.from_numpy(x), offset).transpose(1, 2)
        np.testing.assert_array_equal(got.numpy(), expected(offset))
    with_ids = torch.compile(lambda a: numba_rope.rotary_embedding(a, tc, ts, torch.from_numpy(ids)),
                             backend=backend)  # fmt: skip
    np.testing.assert_array_equal(with_ids(torch.from_numpy(x)).numpy(), expected(position_ids=ids))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("two", [False, True], ids=["one", "qk"])
def test_forward_mode_through_a_compiled_function_keeps_its_tangent(rng, backend, two):
    """torch.compile (graphs may break) of a function calling numba_rope under forward
    mode, a dual tensor passed in or torch.func.jvp inside: the tangent is the rotated
    tangent, bit for bit. It came back None or zero (the eager backend), or torch
    failed an internal assertion (aot_eager, inductor): torch resumed tracing after the
    graph break that was to run the call eagerly, and took the op, which has no
    forward mode; and a forward-mode call run eagerly inside the compiled function
    had its autograd.Function's forward compiled."""
    x, cos, sin = case(rng, np.float64)
    direction = rng.standard_normal(x.shape)
    tc, ts = tensor(cos), tensor(sin)
    options = {"position_offset": 1}

    def rope(a):
        if two:
            return numba_rope.torch.rotary_embedding_qk(a, a * 2, tc, ts, **options)[1]
        return numba_rope.torch.rotary_embedding(a, tc, ts, **options)

    scale = 2.0 if two else 1.0  # k = 2 q: its tangent is twice q's
    expected = reference.rotary_embedding(
        direction * scale, cos, sin, precision="contract", **options
    )
    forward_ad = torch.autograd.forward_ad
    t, dt = torch.from_numpy(x), torch.from_numpy(direction)
    torch._dynamo.reset()
    compiled = torch.compile(rope, backend=backend)
    with forward_ad.dual_level():
        tangent = forward_ad.unpack_dual(compiled(forward_ad.make_dual(t, dt))).tangent
    assert tangent is not None
    np.testing.assert_array_equal(tangent.numpy(), expected)
    torch._dynamo.reset()
    through_jvp = torch.compile(lambda a: torch.func.jvp(rope, (a,), (dt,))[1], backend=backend)
    np.testing.assert_array_equal(through_jvp(t).numpy(), expected)


@FORWARD_WARNINGS
def test_zero_dimensional_offsets_under_vmap(rng):
    """One offset tensor for the batch (0-d), shared by the samples or one per sample
    (mapped over a [samples] tensor): the reference's answer for each sample."""
    x, cos, sin = case(rng, np.float32, shape=(3, 2, 4, 5, 8))
    tc, ts = tensor(cos), tensor(sin)

    def rope(t, offset):
        return numba_rope.torch.rotary_embedding(t, tc, ts, position_offset=offset)

    shared = torch.func.vmap(lambda t: rope(t, torch.tensor(2)))(torch.from_numpy(x))
    each = torch.func.vmap(rope)(torch.from_numpy(x), torch.tensor([0, 4, 1]))
    for i, offset in enumerate([0, 4, 1]):
        for got, o in ((shared[i], 2), (each[i], offset)):
            expected = reference.rotary_embedding(
                x[i], cos, sin, position_offset=o, precision="contract"
            )
            np.testing.assert_array_equal(got.numpy(), expected)


@FORWARD_WARNINGS
def test_cache_tangents_are_refused(rng):
    x, cos, sin = case(rng, np.float64)
    forward_ad = torch.autograd.forward_ad
    t, tc, ts = torch.from_numpy(x), tensor(cos), tensor(sin)
    with forward_ad.dual_level(), pytest.raises(NotImplementedError, match="cos_cache"):
        numba_rope.torch.rotary_embedding(
            t, tc, forward_ad.make_dual(ts, torch.ones_like(ts)), position_offset=0
        )
    with pytest.raises(NotImplementedError, match="cos_cache"):
        torch.func.jvp(
            lambda c: numba_rope.torch.rotary_embedding(t, c, ts, position_offset=0),
            (tc,),
            (torch.ones_like(tc),),
        )

    # A tangent of a cache at an outer level, under an inner transform of the input:
    # refused too (it was dropped, the derivative read 0).
    def inner_jvp(c):
        rope = lambda a: numba_rope.torch.rotary_embedding(a, c, ts, position_offset=0)  # noqa: E731
        return torch.func.jvp(rope, (t,), (torch.ones_like(t),))[1]

    def inner_grad(c):
        rope = lambda a: numba_rope.torch.rotary_embedding(a, c, ts, position_offset=0)  # noqa: E731
        return torch.func.grad(lambda a: (rope(a) ** 2).sum())(t)

    for inner in (inner_jvp, inner_grad):
        with pytest.raises(NotImplementedError, match="cos_cache"):
            torch.func.jvp(inner, (tc,), (torch.ones_like(tc),))


@FORWARD_WARNINGS
@pytest.mark.parametrize("two", [False, True], ids=["one", "qk"])
def test_array_functions_refuse_what_autograd_follows(rng, two):
    """numba_rope.rotary_embedding records nothing for autograd: a tensor that carries a
    forward-mode tangent (input, k or out=) or sits inside a torch.func transform is
    refused, naming it and the way out, and nothing is written (before, the tangent
    was dropped, or torch's "Cannot access data pointer" was raised)."""
    x, cos, sin = case(rng, np.float32)
    tc, ts = tensor(cos), tensor(sin)
    k = torch.from_numpy(x.copy())

    def call(t, out=None):
        if two:
            return numba_rope.rotary_embedding_qk(
                t, k, tc, ts, position_offset=1, out_q=out, out_k=None
            )
        return numba_rope.rotary_embedding(t, tc, ts, position_offset=1, out=out)

    forward_ad = torch.autograd.forward_ad
    t = torch.from_numpy(x.copy())
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(t, torch.ones_like(t))
        with pytest.raises(TypeError, match=r"(input|q) carries a forward-mode tangent"):
            call(dual, out=dual)  # in place
        np.testing.assert_array_equal(t.numpy(), x)
        target = torch.zeros_like(t)
        dual_out = forward_ad.make_dual(target, torch.ones_like(t))
        with pytest.raises(TypeError, match=r"(out|out_q) carries a forward-mode tangent"):
            call(t, out=dual_out)
        assert not bool(target.any())
        call(t)  # tensors without a tangent go through while a level is open
    transforms = (
        torch.func.vmap,
        lambda f: lambda a: torch.func.jvp(f, (a,), (torch.ones_like(a),))[0],
        lambda f: torch.func.grad(lambda a: f(a).sum()),
    )
    for transform in transforms:
        with pytest.raises(TypeError, match=r"torch\.func transform.*numba_rope\.torch"):
            transform(lambda a: call(a) if not two else call(a)[0])(t)
    # A tensor the transform does not transform is a constant to it: read, rotated.
    expected = reference.rotary_embedding(x, cos, sin, position_offset=1, precision="contract")
    for transform in transforms:
        seen: list = []

        def constant(a, seen=seen):
            seen.append(call(t) if not two else call(t)[0])
            return a.sum()

        transform(constant)(torch.zeros(2))
        np.testing.assert_array_equal(host(seen[0]), expected)


def test_torch_compile_as_the_first_call_of_a_process():
    """torch.compile(fullgraph=True) of a function whose caches are arguments, before
    any eager call in the process: the compiled loss and gradient equal eager. (A
    review saw Dynamo fail here at 9176fef, guarding on a module that numba_rope kept
    in a global after its first call; not reproduced since, and nothing is kept so.)"""
    script = """
import torch, numba_rope, numba_rope.torch as nrt
def f(q, k, c, s):
    q, k = nrt.rotary_embedding_qk(q, k, c, s, position_offset=1)
    return (q * q).sum() + k.sum()
c, s = (torch.from_numpy(a) for a in numba_rope.rope_cache(32, 8))
q = torch.randn(1, 2, 3, 8, requires_grad=True); k = torch.randn(1, 1, 3, 8)
loss = torch.compile(f, fullgraph=True)(q, k, c, s); loss.backward(); grad = q.grad.clone()
q.grad = None; eager = f(q, k, c, s); eager.backward()
torch.testing.assert_close(loss, eager); torch.testing.assert_close(grad, q.grad)
print("same")
"""
    done = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-2000:]


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")
def test_torch_jit_trace_records_the_op(rng):
    """torch.jit.trace of a call whose input requires grad records the custom op (as
    before the autograd.Function paths; tracing through one fails torch's check that
    two traces agree), and the traced function's result and gradient are the
    reference's (float32 contract bits; the gradient is the inverse rotation)."""
    x, cos, sin = case(rng, np.float32)
    tc, ts = tensor(cos), tensor(sin)
    t = torch.from_numpy(x).requires_grad_()
    traced = torch.jit.trace(
        lambda a: numba_rope.torch.rotary_embedding(a, tc, ts, position_offset=3), (t,)
    )
    assert "numba_rope::rotary_embedding" in str(traced.graph)
    y = traced(t)
    y.backward(torch.ones_like(y))
    options = {"position_offset": 3, "precision": "contract"}
    np.testing.assert_array_equal(host(y), reference.rotary_embedding(x, cos, sin, **options))
    np.testing.assert_array_equal(
        t.grad.numpy(),
        reference.rotary_embedding(np.ones_like(x), cos, sin, inverse=True, **options),
    )


@FORWARD_WARNINGS
def test_the_gpu_path_refuses_what_autograd_follows():
    """The CUDA backend's first look at torch tensors refuses them as the CPU path does
    (it read a tensor that requires grad through data_ptr() and dropped its gradient).
    Seen here through a CPU tensor handed to it as a CUDA one: the checks come first."""
    from numba_rope._cuda.backend import CudaBackend

    with pytest.raises(TypeError, match="input requires grad"):
        CudaBackend((torch.zeros(3, requires_grad=True),), ("input",), ("torch",))
    forward_ad = torch.autograd.forward_ad
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(torch.zeros(3), torch.ones(3))
        with pytest.raises(TypeError, match="cos_cache carries a forward-mode tangent"):
            CudaBackend((torch.zeros(3), dual), ("input", "cos_cache"), ("torch", "torch"))
    with pytest.raises(TypeError, match=r"torch\.func transform"):
        torch.func.vmap(lambda a: CudaBackend((a,), ("input",), ("torch",)))(torch.zeros(2, 3))


def test_numpy_caches_and_16_bit_results(rng):
    """numba_rope.torch takes NumPy caches (bfloat16 too) and keeps the contract."""
    x, cos, sin = case(rng, BFLOAT16)
    t = tensor(x).clone().requires_grad_()
    got = numba_rope.torch.rotary_embedding(t, cos, sin, position_offset=np.int64(1))
    expected = reference.rotary_embedding(x, cos, sin, position_offset=1, precision="contract")
    np.testing.assert_array_equal(host(got), expected)
    with pytest.raises(TypeError, match=r"numba_rope\.torch takes torch tensors"):
        numba_rope.torch.rotary_embedding(x, cos, sin, position_offset=0)


# torch 2.14's opcheck makes fake tensors of non-leaf tensors of its own, reading their
# .grad (a warning of torch's, about torch's code).
@pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
)
def test_opcheck(rng):
    """torch's own checks of a custom op: schema, fake (meta) implementation against
    the real one, autograd registration, and what torch.compile relies on."""
    x, cos, sin = case(rng, np.float32)
    args = (torch.from_numpy(x).requires_grad_(), tensor(cos), tensor(sin))
    one = (
        *args,
        torch.from_numpy(rng.integers(0, 12, (2, 5))),
        None,
        None,
        False,
        0,
        "bhsd",
        None,
        False,
        False,
    )
    torch.library.opcheck(torch.ops.numba_rope.rotary_embedding.default, one)
    k = torch.from_numpy(rng.standard_normal((2, 1, 5, 8)).astype(np.float32)).requires_grad_()
    two = (
        args[0],
        k,
        *args[1:],
        None,
        None,
        torch.tensor([0, 3]),
        True,
        0,
        "bhsd",
        None,
        None,
        False,
        False,
    )
    torch.library.opcheck(torch.ops.numba_rope.rotary_embedding_qk.default, two)


class _Attention(torch.nn.Module):
    """A tiny attention block that rotates q and k with numba_rope.torch."""

    def __init__(self, cos, sin):
        super().__init__()
        self.proj = torch.nn.Linear(16, 3 * 2 * 8)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x, offsets):
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, 2, 8).unbind(2)
        q, k = numba_rope.torch.rotary_embedding_qk(
            q, k, self.cos, self.sin, position_offset=offsets, layout="bshd"
        )
        attention = torch.einsum("bshd,bthd->bhst", q, k).softmax(-1)
        return torch.einsum("bhst,bthd->bshd", attention, v).sum()


def _compiled_matches_eager(device: str) -> None:
    torch.manual_seed(0)
    cos, sin = (torch.from_numpy(c).to(device) for c in numba_rope.rope_cache(32, 8))
    model = _Attention(cos, sin).to(device)
    x = torch.randn(2, 5, 16, device=device)
    offsets = torch.tensor([0, 9], device=device)
    compiled = torch.compile(model, fullgraph=True)  # inductor: fails if it cannot trace
    loss = compiled(x, offsets)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager = model(x, offsets)
    eager.backward()
    # Inductor may fuse and reorder the float32 linear algebra around the op
    # (einsum, softmax): a few float32 ulps of loss-sized values.
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# Inductor's own imports use torch.jit.script_method, which torch 2.13 deprecates.
COMPILE_WARNINGS = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")


@COMPILE_WARNINGS
def test_torch_compile_fullgraph_on_the_cpu():
    torch._dynamo.reset()
    _compiled_matches_eager("cpu")


@COMPILE_WARNINGS
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with an NVIDIA GPU")
def test_torch_compile_fullgraph_on_the_gpu():  # pragma: no cover - CI has no GPU
    torch._dynamo.reset()
    _compiled_matches_eager("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with an NVIDIA GPU")
def test_gradient_on_the_gpu(rng):  # pragma: no cover - CI has no GPU
    x, cos, sin = case(rng, np.float32)
    t = torch.from_numpy(x).cuda().requires_grad_()
    y = numba_rope.torch.rotary_embedding(
        t, tensor(cos).cuda(), tensor(sin).cuda(), position_offset=2
    )
    y.backward(torch.ones_like(y))
    expected = numba_rope.rotary_embedding(
        np.ones_like(x), cos, sin, position_offset=2, inverse=True
    )
    # The GPU may contract into FMA: one float32 ulp at the scale of the terms (|c|, |s| <= 1).
    np.testing.assert_allclose(t.grad.cpu().numpy(), expected, rtol=0, atol=4 * 2.0**-23)


def test_readme_pytorch_example_runs():
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## PyTorch\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_inference_tensors_parameters_and_subclasses(rng):
    """Inference-mode tensors (no version counter), an nn.Parameter under no_grad, and
    a user's subclass of torch.Tensor (recognised by its torch base) all run on the CPU."""
    x, cos, sin = case(rng, np.float32)
    expected = reference.rotary_embedding(x, cos, sin, position_offset=1, precision="contract")
    with torch.inference_mode():
        t = torch.from_numpy(x.copy())
        assert (
            numba_rope.rotary_embedding(t, tensor(cos), tensor(sin), position_offset=1, out=t) is t
        )
    np.testing.assert_array_equal(t.numpy(), expected)
    with torch.no_grad():
        got = numba_rope.rotary_embedding(
            torch.nn.Parameter(torch.from_numpy(x)), tensor(cos), tensor(sin), position_offset=1
        )
    np.testing.assert_array_equal(got.numpy(), expected)

    class Mine(torch.Tensor):
        pass

    got = numba_rope.rotary_embedding(
        torch.from_numpy(x).as_subclass(Mine), tensor(cos), tensor(sin), position_offset=1
    )
    np.testing.assert_array_equal(got.numpy(), expected)


def test_calls_that_record_nothing_skip_the_dispatcher_and_modes_still_see_the_op(rng, monkeypatch):
    """A call with nothing to record (grad off, or nothing requiring grad) runs the op's
    implementation directly (torch's dispatcher cost about 30 µs a call); the op's
    bits either way. Under a dispatch mode (fake tensors, torch.export, a user's
    TorchDispatchMode) or with something to record, the op is called as before."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x, cos, sin = case(rng, np.float32)
    k = rng.standard_normal((2, 1, 5, 8)).astype(np.float32)
    want = reference.rotary_embedding(x, cos, sin, position_offset=2, precision="contract")
    want_k = reference.rotary_embedding(k, cos, sin, position_offset=2, precision="contract")
    tx, tk, tc, ts = (tensor(a) for a in (x, k, cos, sin))

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    def calls(seen):
        return [name for name in seen.ops if name.startswith("numba_rope.")]

    seen = Seen()
    with seen:
        y = numba_rope.torch.rotary_embedding(tx, tc, ts, position_offset=2)
        yq, yk = numba_rope.torch.rotary_embedding_qk(tx, tk, tc, ts, position_offset=2)
    assert calls(seen) == [
        "numba_rope.rotary_embedding.default",
        "numba_rope.rotary_embedding_qk.default",
    ]
    for got, expected in ((y, want), (yq, want), (yk, want_k)):
        np.testing.assert_array_equal(got.numpy(), expected)

    def refuse(*args):
        raise AssertionError("the op was called")

    monkeypatch.setattr(numba_rope.torch, "_rotary_op", refuse)
    monkeypatch.setattr(numba_rope.torch, "_rotary_qk_op", refuse)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            y = numba_rope.torch.rotary_embedding(tx, tc, ts, position_offset=2)
            yq, yk = numba_rope.torch.rotary_embedding_qk(tx, tk, tc, ts, position_offset=2)
        for got, expected in ((y, want), (yq, want), (yk, want_k)):
            assert not got.requires_grad
            np.testing.assert_array_equal(got.numpy(), expected)
    with pytest.raises(AssertionError, match="the op was called"), Seen():
        numba_rope.torch.rotary_embedding(tx, tc, ts, position_offset=2)
    # Anything that requires grad, in grad mode, goes to the op (with its autograd; the
    # public functions refuse such caches before, torch.ops and adapters may not).
    graded = ts.clone().requires_grad_()
    assert numba_rope.torch._direct((tx, tk, tc, ts, None, 2))
    assert not numba_rope.torch._direct((tx, tk, tc, graded, None, 2))
    with torch.no_grad():
        assert numba_rope.torch._direct((tx, tk, tc, graded, None, 2))

    class Mine(torch.Tensor):
        pass

    assert not numba_rope.torch._direct((tx.as_subclass(Mine), tc, ts))


def test_read_only_numpy_caches_and_positions(rng):
    """Read-only NumPy caches and positions (``np.broadcast_to`` views, a read-only
    memmap, ``rope_cache``'s arrays made immutable) are only read: they are taken as
    they are, with no warning (torch warns when it wraps a non-writable array), and
    give the reference's float32 contract."""
    import torch

    cos, sin = numba_rope.rope_cache(16, 8)
    cos.flags.writeable = False
    sin.flags.writeable = False
    ids = np.broadcast_to(np.array([[3, 1, 4]]), (2, 3))
    x = rng.standard_normal((2, 2, 3, 8)).astype(np.float32)
    got = numba_rope.torch.rotary_embedding(torch.from_numpy(x), cos, sin, ids)
    np.testing.assert_array_equal(
        got.numpy(), reference.rotary_embedding(x, cos, sin, ids, precision="contract")
    )
