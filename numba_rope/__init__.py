"""numba_rope: the RotaryEmbedding operator (TensorRT / ONNX opset 23), exact and fast,
on the CPU and on NVIDIA GPUs, with Numba.

``numba_rope.rotary_embedding`` is the operator; ``numba_rope.reference.rotary_embedding``
is its plain NumPy float64 oracle; ``numba_rope.typing`` holds the static types of the
array arguments.
"""

from numba_rope import reference
from numba_rope import typing as typing  # not in __all__: it would shadow the standard module
from numba_rope.cache import rope_cache
from numba_rope.rotary import rotary_embedding, rotary_embedding_qk

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "reference",
    "rope_cache",
    "rotary_embedding",
    "rotary_embedding_qk",
]
