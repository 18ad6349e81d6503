"""numba_rope on a GPU with torch CUDA tensors, bfloat16 included.

The same ``numba_rope.rotary_embedding``: given CUDA tensors it runs on their device and
returns a tensor. Here q and k of a fused qkv projection are rotated in place as views.
Without torch or a GPU this script says so and exits successfully.

Run: python examples/gpu_torch.py
"""

import importlib.util
import sys


def torch_or_skip():
    """torch, if it is installed and sees a GPU; else say why and exit 0."""
    if importlib.util.find_spec("torch") is None:
        print("skipping: torch is not installed")
        sys.exit(0)
    import torch

    if not torch.cuda.is_available():
        print("no GPU, skipping: torch.cuda.is_available() is False")
        sys.exit(0)
    return torch


torch = torch_or_skip()

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import numba_rope  # noqa: E402
from numba_rope import reference  # noqa: E402


def to_numpy(tensor):
    """A CUDA tensor on the host as NumPy (bfloat16 as ml_dtypes.bfloat16)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


batch, seq_len, num_heads, head_dim = 2, 256, 16, 128
device = torch.device("cuda")
torch.manual_seed(0)

# float32 caches of real angles; the input is bfloat16.
inverse_frequency = 10000.0 ** (-torch.arange(0, head_dim, 2, device=device) / head_dim)
angles = torch.arange(2048, device=device)[:, None] * inverse_frequency
cos_cache, sin_cache = torch.cos(angles).float(), torch.sin(angles).float()
offset = 100  # tokens already in the KV cache
positions = (offset + torch.arange(seq_len, device=device)).repeat(batch, 1)  # [batch, seq_len]

qkv = torch.randn(batch, seq_len, 3 * num_heads, head_dim, device=device, dtype=torch.bfloat16)
heads = qkv.transpose(1, 2)  # [batch, 3 * num_heads, seq_len, head_dim], a view
q, k = heads[:, :num_heads], heads[:, num_heads : 2 * num_heads]
q_before, k_before = to_numpy(q), to_numpy(k)

# Without out=, the result is a new tensor on the input's device.
q_rotated = numba_rope.rotary_embedding(q, cos_cache, sin_cache, positions)
assert isinstance(q_rotated, torch.Tensor) and q_rotated.device == q.device
assert q_rotated.dtype == torch.bfloat16

# With out=, in place: q and k are rotated inside qkv.
numba_rope.rotary_embedding(q, cos_cache, sin_cache, positions, out=q)
numba_rope.rotary_embedding(k, cos_cache, sin_cache, positions, out=k)
torch.cuda.synchronize()  # kernels are asynchronous: wait before timing or reading
assert torch.equal(q, q_rotated)

# Check on the host against the float64 oracle. Rounding errors scale with the terms
# x*cos and x*sin (|cos| + |sin| <= sqrt(2)); bfloat16 keeps 8 significant bits.
eps = float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps)
cos_host, sin_host, ids_host = to_numpy(cos_cache), to_numpy(sin_cache), to_numpy(positions)
for rotated, before in ((q, q_before), (k, k_before)):
    want = reference.rotary_embedding(before, cos_host, sin_host, ids_host).astype(np.float64)
    error = np.abs(to_numpy(rotated).astype(np.float64) - want)
    tolerance = 4 * eps * float(np.abs(before.astype(np.float64)).max()) * np.sqrt(2)
    assert error.max() <= tolerance, (error.max(), tolerance)

print(f"torch bfloat16: q {tuple(q.shape)} and k rotated in place on {q.device}, checked: ok")
