"""What the drop-ins for other libraries' call forms (:mod:`numba_rope.vllm`,
:mod:`numba_rope.flash_attn`) need from the caller's arrays, for every kind of array
numba_rope accepts, without importing a library the caller did not use:

* :func:`add_leading_axis`: ``array[None]`` as a view (never a copy: results are
  written through it in place);
* :func:`to_host`: a small integer array (``cu_seqlens``, offsets) read as NumPy;
* :func:`like`: a NumPy array moved to where another array lives, as that array's
  library would hold it (NumPy, torch, CuPy, or a Numba device array).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from numba_rope._autograd import below_transforms, transformed


def _module(array: Any) -> str:
    return type(array).__module__ or ""


def is_torch(array: Any) -> bool:
    """Whether ``array`` is a torch tensor (read from its type's module; torch is not
    imported)."""
    module = _module(array)
    return module == "torch" or module.startswith("torch.")


def _is_cupy(array: Any) -> bool:
    return _module(array).startswith("cupy")


def add_leading_axis(array: Any) -> Any:
    """``array[None]``: a view with a new leading axis of length 1.

    NumPy, torch, CuPy and the CUDA simulator's arrays index with ``None``; Numba's
    device arrays do not, so their view is made over the same device memory (another
    ``__cuda_array_interface__`` exporter is first seen through Numba, without a copy).

    >>> import numpy as np
    >>> x = np.arange(6.0).reshape(2, 3)[:, :2]
    >>> view = add_leading_axis(x)
    >>> view.shape, bool(np.shares_memory(view, x))
    ((1, 2, 2), True)
    """
    try:
        return array[None]
    except (TypeError, IndexError):  # numba's DeviceNDArray: no None in its indexing
        pass
    from numba import cuda  # pragma: no cover - real Numba device arrays (needs a GPU)

    if not hasattr(array, "gpu_data"):  # pragma: no cover
        array = cuda.as_cuda_array(array)
    # The new axis has length 1: its stride is never stepped; the array's extent is a
    # stride that no overlap test can mistake for elements sharing memory.
    extent = max(array.dtype.itemsize, array.size * array.dtype.itemsize)  # pragma: no cover
    return type(array)(  # pragma: no cover
        shape=(1, *array.shape),
        strides=(extent, *array.strides),
        dtype=array.dtype,
        stream=array.stream,
        gpu_data=array.gpu_data,
    )


#: torch's integer dtypes, by name (torch is not imported here).
_TORCH_INTEGERS = frozenset(
    f"torch.{name}" for name in "int8 int16 int32 int64 uint8 uint16 uint32 uint64".split()
)


def host_tensor(array: Any) -> bool:
    """Whether ``array`` is a plain torch tensor in CPU memory: ``torch.Tensor`` itself
    (no subclass), strided, not a ``torch.func`` transform's wrapper
    (:func:`~numba_rope._autograd.transformed`), without torch's negative bit. False
    for anything else (torch is imported only for a torch object)."""
    if not is_torch(array):
        return False
    import torch

    return (
        type(array) is torch.Tensor
        and array.is_cpu
        and array.layout is torch.strided
        and not array.is_neg()
        and not transformed(array)
    )


def host_integers(array: Any) -> bool:
    """Whether ``array`` is an integer array in host memory that the CPU operator reads
    as it is: a NumPy array of kind ``i`` or ``u``, or a :func:`host_tensor` of an
    integer dtype.

    >>> import numpy as np
    >>> host_integers(np.arange(3)), host_integers(np.ones(3)), host_integers([1, 2])
    (True, False, False)
    """
    if type(array) is np.ndarray:
        return array.dtype.kind in "iu"
    return host_tensor(array) and str(array.dtype) in _TORCH_INTEGERS


def read_only_error(array: Any, name: str, why: str, instead: str = "") -> ValueError | None:
    """The ``ValueError`` for a read-only NumPy ``array`` that a caller's form rotates in
    place, in its own words (the operator names its ``out`` argument, which such a form
    does not have): ``why`` it is written, what else to do ``instead``; else None. Looked
    for only where the operator has refused the call (the error path), and raised by the
    caller ``from None``."""
    if isinstance(array, np.ndarray) and not array.flags.writeable:
        return ValueError(
            f"{name} is a read-only array, and {why}: pass a writeable one (e.g. "
            f"np.array({name}))" + (f", or {instead}" if instead else "")
        )
    return None


def over_batch(cos: Any, sin: Any, batch: int | None) -> tuple[Any, Any]:
    """One-row caches ``[1, seq_len, half]`` broadcast over ``batch`` sequences (views:
    ``expand`` for torch tensors, ``numpy.broadcast_to`` for NumPy arrays), or the
    caches as they are (``batch`` None).

    >>> import numpy as np
    >>> over_batch(np.ones((1, 5, 4)), np.zeros((1, 5, 4)), 3)[0].shape
    (3, 5, 4)
    """
    if batch is None:
        return cos, sin
    shape = (batch, *cos.shape[1:])
    if is_torch(cos):
        return cos.expand(shape), sin.expand(shape)
    return np.broadcast_to(cos, shape), np.broadcast_to(sin, shape)


def to_host(array: Any) -> np.ndarray:
    """``array`` as a NumPy array (a copy to the host for GPU arrays: the call waits for
    the GPU's work on it). Python ints, lists and NumPy scalars pass through
    ``numpy.asarray``.

    >>> to_host([0, 3, 5])
    array([0, 3, 5])
    """
    if isinstance(array, np.ndarray):
        return array
    if is_torch(array):
        import torch

        if getattr(torch._C._functorch, "is_batchedtensor", bool)(array):
            raise TypeError(
                "an integer tensor that numba_rope reads on the host (cu_seqlens, "
                "seqlen_offsets, positions) is mapped by torch.func.vmap; pass it "
                "unmapped (one for every sample) and map the input instead"
            )
        # Under a torch.func transform (vmap, grad, jvp) even a tensor it does not
        # transform reads as a wrapper without storage: read it below the transforms.
        with below_transforms():
            # resolve_neg: an integer tensor with torch's negative bit (a view made by
            # torch._neg_view) refuses .numpy() until its values are written out.
            return array.detach().resolve_neg().cpu().numpy()
    if _is_cupy(array):  # pragma: no cover - needs CuPy and a GPU
        return array.get()
    if hasattr(array, "copy_to_host"):  # Numba device arrays, real or simulated
        return array.copy_to_host()
    if hasattr(type(array), "__cuda_array_interface__"):  # pragma: no cover - needs a GPU
        from numba import cuda

        return cuda.as_cuda_array(array).copy_to_host()
    return np.asarray(array)


def like(host: np.ndarray, reference: Any) -> Any:
    """``host`` where ``reference`` lives, of ``reference``'s library: NumPy as it is,
    a torch tensor on ``reference.device``, a CuPy array on ``reference``'s GPU, else a
    Numba device array (on the current CUDA context).

    >>> import numpy as np
    >>> ids = np.arange(3)
    >>> like(ids, np.zeros(2)) is ids  # NumPy stays NumPy
    True
    """
    if isinstance(reference, np.ndarray):
        return host
    if is_torch(reference):
        import torch

        with warnings.catch_warnings():
            # A read-only array (np.broadcast_to) is only read: torch warns that it
            # cannot guard it against writes.
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            return torch.as_tensor(host, device=reference.device)
    if _is_cupy(reference):  # pragma: no cover - needs CuPy and a GPU
        import cupy

        with cupy.cuda.Device(reference.device.id):
            return cupy.asarray(host)
    from numba import cuda

    return cuda.to_device(np.ascontiguousarray(host))
