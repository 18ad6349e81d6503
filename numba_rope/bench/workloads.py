"""The workload table and the data: one case maker for the bench, asv, the GPU check
and the tests.

:func:`make_arrays` draws the arrays of one call (input, cos and sin caches, position
ids) from a random generator; :func:`make_case` turns a named :class:`Workload` into its
:class:`Case` through it, from a fixed seed, so that ``bench`` and the asv suite time
the same data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

#: Seed of every random array of the benchmarks.
SEED = 20261129

#: Base of the rotary frequencies (Llama, GPT-NeoX): ``inv_freq[i] = BASE ** (-2i / rotary_dim)``.
ROPE_BASE = 10000.0

#: The specification's example position ids (input (2, 8, 4, 512), caches (100, 256)).
SEED_POSITION_IDS = ((6, 2, 1, 7), (2, 8, 3, 6))

DTYPES = ("float32", "float16", "bfloat16")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Workload:
    """One benchmark shape.

    ``position_ids`` says how ids are made: ``"seed"`` (the specification's), ``"arange"``
    (positions ``0..seq_len-1`` of every sequence), ``"random"`` (uniform in
    ``[0, cache_rows)``) or ``"none"`` (no ids: caches of shape ``[batch, seq_len,
    rotary_dim/2]``, sequence positions ``0..seq_len-1``).
    """

    name: str
    shape: tuple[int, int, int, int]  # [batch, num_heads, seq_len, head_size]
    position_ids: str
    cache_rows: int | None  # rows of the 2-D caches indexed by position ids
    rotary_dim: int = 0  # 0: the whole head
    interleaved: bool = False
    batched: bool = False  # small calls: time batches of calls
    description: str = ""
    #: True: the input is ONNX's 3-D form ``[batch, seq_len, num_heads * head_size]``
    #: (``num_heads=``), heads inside tokens as in Hugging Face's and vLLM's bshd.
    three_d: bool = False

    @property
    def half(self) -> int:
        return (self.rotary_dim or self.shape[3]) // 2

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of the input array: :attr:`shape`, or its 3-D form."""
        batch, heads, seq_len, head_size = self.shape
        return (batch, seq_len, heads * head_size) if self.three_d else self.shape

    @property
    def cache_shape(self) -> tuple[int, ...]:
        batch, _, seq_len, _ = self.shape
        if self.cache_rows is None:
            return (batch, seq_len, self.half)
        return (self.cache_rows, self.half)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "seed",
            (2, 8, 4, 512),
            "seed",
            100,
            batched=True,
            description="the specification's example",
        ),
        Workload(
            "prefill",
            (1, 32, 4096, 128),
            "arange",
            8192,
            description="one 4096-token prompt, position ids arange(4096)",
        ),
        Workload(
            "prefill_3d",
            (1, 32, 4096, 128),
            "arange",
            8192,
            three_d=True,
            description="the prefill as ONNX's 3-D input [1, 4096, 32*128], num_heads=32: "
            "heads inside tokens, the memory of Hugging Face's and vLLM's bshd",
        ),
        Workload(
            "batch_prefill",
            (8, 32, 1024, 128),
            "none",
            None,
            description="eight 1024-token prompts, per-token caches, no position ids",
        ),
        Workload(
            "decode",
            (64, 32, 1, 128),
            "random",
            8192,
            batched=True,
            description="one new token for each of 64 sequences, random positions",
        ),
        Workload(
            "partial",
            (4, 16, 2048, 128),
            "arange",
            8192,
            rotary_dim=64,
            interleaved=True,
            description="rotary_dim 64 of 128, interleaved pairs, position ids",
        ),
    )
}


def workload_table() -> str:
    """The workloads as a text table (for ``--help`` and the README)."""
    lines = [
        f"{'name':<14} {'input':<20} {'caches':<16} {'position ids':<13} {'rotary dim':<11} interleaved"
    ]
    for w in WORKLOADS.values():
        ids = "none" if w.position_ids == "none" else w.position_ids
        lines.append(
            f"{w.name:<14} {w.input_shape!s:<20} {w.cache_shape!s:<16} {ids:<13} "
            f"{w.rotary_dim or w.shape[3]:<11} {w.interleaved}"
        )
    return "\n".join(lines)


def as_dtype(dtype: Any) -> np.dtype:
    """``"bfloat16"`` -> ``ml_dtypes.bfloat16``; any other name or dtype as NumPy reads it.

    >>> as_dtype("bfloat16").name, as_dtype("float16").name
    ('bfloat16', 'float16')
    """
    if isinstance(dtype, str) and dtype == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def rope_caches(positions: np.ndarray, rotary_dim: int, dtype: Any = np.float32):
    """cos and sin caches of real angles: ``position * ROPE_BASE ** (-2i / rotary_dim)``.

    ``positions`` of shape ``S`` give caches of shape ``S + (rotary_dim // 2,)``.
    """
    inverse_frequency = ROPE_BASE ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angles = np.asarray(positions, dtype=np.float64)[..., np.newaxis] * inverse_frequency
    dtype = as_dtype(dtype)
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def make_arrays(
    rng: np.random.Generator,
    shape: tuple[int, int, int, int],
    dtype: Any,
    *,
    position_ids: bool | str | Any = True,
    rotary_dim: int = 0,
    n_positions: int | None = None,
    cache_dtype: Any = None,
    angles: str = "random",
):
    """Random input, cos and sin caches and position ids of one 4-D call: the case maker.

    Parameters
    ----------
    rng : numpy.random.Generator
        Draws, in this order: the input (standard normal, drawn in float64), the ids
        (``"random"`` only), the angles (``"random"`` only).
    shape : tuple of int
        ``[batch, num_heads, seq_len, head_size]``.
    dtype, cache_dtype : dtype or name
        Of the input, and of the caches (default: the input's).
    position_ids : bool, str or array_like
        ``True`` or ``"random"``: uniform in ``[0, n_positions)``; ``"arange"``: positions
        ``0..seq_len-1`` of every sequence; ``False`` or ``"none"``: no ids, caches of
        shape ``[batch, seq_len, half]``; an array: these ids.
    rotary_dim : int
        Channels rotated (0: the whole head); the caches hold half of them.
    n_positions : int, optional
        Rows of the 2-D caches (default ``seq_len + 7``).
    angles : {"random", "rope"}
        ``"random"``: uniform in ``[-pi, pi)``; ``"rope"``: real angles of the rows'
        positions (:func:`rope_caches`).

    Returns
    -------
    tuple
        ``(input, cos_cache, sin_cache, position_ids or None)``.
    """
    dtype = as_dtype(dtype)
    cache_dtype = as_dtype(cache_dtype or dtype)
    batch, _, seq_len, head_size = shape
    half = (rotary_dim or head_size) // 2
    x = rng.standard_normal(shape).astype(dtype)
    if position_ids is None or isinstance(position_ids, (bool, np.bool_)):
        position_ids = "random" if position_ids else "none"
    ids: np.ndarray | None
    if isinstance(position_ids, str) and position_ids == "none":
        ids = None
        positions = np.broadcast_to(np.arange(seq_len), (batch, seq_len))
    else:
        n_positions = n_positions or seq_len + 7
        positions = np.arange(n_positions)
        if isinstance(position_ids, str) and position_ids == "random":
            ids = rng.integers(0, n_positions, size=(batch, seq_len), dtype=np.int64)
        elif isinstance(position_ids, str) and position_ids == "arange":
            ids = np.ascontiguousarray(
                np.broadcast_to(np.arange(seq_len, dtype=np.int64), (batch, seq_len))
            )
        elif isinstance(position_ids, str):
            raise ValueError(
                "position_ids must be True, False, 'random', 'arange', 'none' or an array "
                f"of ids, got {position_ids!r}"
            )
        else:
            ids = np.array(position_ids, dtype=np.int64)
    if angles == "rope":
        cos, sin = rope_caches(positions, 2 * half, cache_dtype)
    elif angles == "random":
        drawn = rng.uniform(-np.pi, np.pi, size=(*positions.shape, half))
        cos, sin = np.cos(drawn).astype(cache_dtype), np.sin(drawn).astype(cache_dtype)
    else:
        raise ValueError(f"angles must be 'random' or 'rope', got {angles!r}")
    return x, cos, sin, ids


@dataclass
class Case:
    """The arrays of one workload in one dtype, on the host."""

    workload: Workload
    dtype: np.dtype
    input: np.ndarray
    cos_cache: np.ndarray
    sin_cache: np.ndarray
    position_ids: np.ndarray | None

    @property
    def options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "interleaved": self.workload.interleaved,
            "rotary_embedding_dim": self.workload.rotary_dim,
        }
        if self.workload.three_d:
            options["num_heads"] = self.workload.shape[1]
        return options

    def as_bhsd(self, array: Any) -> Any:
        """An input or output of this case (NumPy or torch) as a ``[batch, num_heads,
        seq_len, head_size]`` view, for peers that take that form only."""
        if not self.workload.three_d:
            return array
        batch, heads, seq_len, head_size = self.workload.shape
        return array.reshape(batch, seq_len, heads, head_size).swapaxes(1, 2)

    def from_bhsd(self, array: Any) -> Any:
        """A peer's ``[batch, num_heads, seq_len, head_size]`` result in the input's
        form (a copy for the 3-D form, as the peer would have to make)."""
        if not self.workload.three_d:
            return array
        return array.swapaxes(1, 2).reshape(self.workload.input_shape)

    @property
    def distinct_cache_rows(self) -> int:
        if self.position_ids is None:
            return self.workload.shape[0] * self.workload.shape[2]
        return int(np.unique(self.position_ids).size)

    @property
    def rope_bytes(self) -> int:
        """Bytes RoPE must move: input read, output written, distinct cos and sin rows read."""
        row_bytes = 2 * self.workload.half * self.cos_cache.dtype.itemsize
        return 2 * self.input.nbytes + self.distinct_cache_rows * row_bytes

    @property
    def copy_bytes(self) -> int:
        """Bytes a copy of the input moves: read once, written once."""
        return 2 * self.input.nbytes


def make_case(workload: Workload | str, dtype: Any, seed: int = SEED) -> Case:
    """A workload's input, caches (real angles) and position ids, from a fixed seed.

    >>> case = make_case("seed", "float16")
    >>> case.input.shape, case.cos_cache.shape, case.position_ids.tolist()[0]
    ((2, 8, 4, 512), (100, 256), [6, 2, 1, 7])
    """
    if isinstance(workload, str):
        workload = WORKLOADS[workload]
    kind = workload.position_ids
    if kind not in ("seed", "arange", "random", "none"):
        raise ValueError(f"unknown position_ids kind {kind!r}")
    x, cos, sin, ids = make_arrays(
        np.random.default_rng(seed),
        workload.shape,
        dtype,
        position_ids=SEED_POSITION_IDS if kind == "seed" else kind,
        rotary_dim=workload.rotary_dim,
        n_positions=workload.cache_rows,
        angles="rope",
    )
    if workload.three_d:  # the same tensor with heads inside tokens
        x = np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(workload.input_shape)
    return Case(workload, as_dtype(dtype), x, cos, sin, ids)
