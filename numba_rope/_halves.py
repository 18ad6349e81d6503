"""Full-width cos/sin caches (Hugging Face's ``cat(freqs, freqs)``) as the operator
takes them: their first half, once the two halves are checked equal.

The operator rotates the pair ``(x[i], x[i + rotary_dim/2])`` by one angle, whose
cosine and sine are ``cos[..., i]`` and ``sin[..., i]``. Hugging Face's rotary modules
produce ``[.., rotary_dim]`` caches whose halves repeat each other; a cache whose
halves differ describes a computation the operator cannot represent, and is refused
with the first place they differ.

The check works on NumPy arrays and torch tensors alike (``!=``, ``==``, ``any``,
``nonzero``); torch is never imported here (a tensor's own module gives its dtypes).
Halves equal bit for bit, as transformers' caches are, pass one comparison of their
bits (``numpy.array_equal``, ``torch.equal``): in a Hugging Face decode step the
element-wise check, five torch operations a cache, had cost 55 of the adapter's
120-140 µs on the Intel VM (docs/performance.md, "Thirty-third session").
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

#: torch's integer dtypes by item size (signed: torch's unsigned ones beyond uint8 are
#: recent), for comparing elements bit for bit.
_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


#: NumPy halves up to this size are compared as the bytes of their copies: one
#: ``bytes`` comparison, 0.14 us for a decode step of one sequence against 1.35 for
#: ``numpy.array_equal``, 3.2 against 4.7 us at 32 KiB, 10.5 against 13.2 at 128 KiB;
#: 58 against 49 at 512 KiB ("Thirty-fourth session").
_BYTES_COMPARED_AS_BYTES = 128 << 10


def _same_bits(first: Any, second: Any) -> bool:
    """Whether two views of one array's elements (of any strides) hold the same bits:
    NumPy arrays compared as bytes (:data:`_BYTES_COMPARED_AS_BYTES`) or as unsigned
    integers, torch tensors as signed ones (torch's ``view(dtype)`` keeps the strides
    for types of one size); False for anything else (a tensor with torch's negative bit
    among them), which the element-wise check then decides."""
    if isinstance(first, np.ndarray):
        if first.nbytes <= _BYTES_COMPARED_AS_BYTES:
            return first.tobytes() == second.tobytes()  # (the bits, in C order)
        bits = np.dtype(f"u{first.dtype.itemsize}")
        return bool(np.array_equal(first.view(bits), second.view(bits)))
    module = sys.modules.get("torch")
    if module is not None and isinstance(first, module.Tensor):
        integers = getattr(module, _BITS.get(first.element_size(), ""), None)
        if integers is None or first.is_complex() or first.is_neg():
            return False  # (torch views no tensor with its negative bit as integers)
        return bool(module.equal(first.view(integers), second.view(integers)))
    return False


def first_half(cache: Any, name: str) -> Any:
    """The first half of ``cache``'s last axis (a view), after checking that the second
    half equals it (NaN equals NaN here; +0 equals -0); else ``ValueError`` naming the
    first place where they differ.

    Examples
    --------
    >>> import numpy as np
    >>> freqs = np.array([[0.0, 0.5], [1.0, 1.5]], np.float32)
    >>> first_half(np.cos(np.concatenate([freqs, freqs], axis=-1)), "cos").shape
    (2, 2)
    >>> first_half(np.ones((2, 3, 4), np.float32), "cos").base is not None
    True
    """
    width = int(cache.shape[-1]) if len(cache.shape) else 0
    if len(cache.shape) == 0 or width % 2:
        raise ValueError(
            f"{name} has shape {tuple(cache.shape)}; a full-width cache (Hugging Face's "
            f"cat(freqs, freqs)) has an even number of channels in its last axis, two "
            f"equal halves"
        )
    half = width // 2
    first, second = cache[..., :half], cache[..., half:]
    if _same_bits(first, second):
        return first
    differ = (first != second) & ((first == first) | (second == second))
    if bool(differ.any()):
        found = differ.nonzero()
        if isinstance(found, tuple):  # NumPy: one index array per axis
            place = tuple(int(axis[0]) for axis in found)
        else:  # torch: [n, ndim]
            place = tuple(int(i) for i in found[0])
        other = (*place[:-1], place[-1] + half)
        raise ValueError(
            f"the halves of {name} differ: {name}[{', '.join(map(str, place))}] = "
            f"{float(first[place])!r} but {name}[{', '.join(map(str, other))}] = "
            f"{float(cache[other])!r}. numba_rope rotates the pair (x[i], x[i + {half}]) "
            f"by one angle, so a full-width cache (Hugging Face's cat(freqs, freqs)) "
            f"must repeat its first half; pass caches whose halves are equal, or call "
            f"numba_rope.rotary_embedding with caches of width {half}"
        )
    return first
