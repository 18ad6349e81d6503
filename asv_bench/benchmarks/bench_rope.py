"""asv benchmarks of ``numba_rope.rotary_embedding``.

The workloads, their data and the copy floor come from :mod:`numba_rope.bench` (the
package behind ``python -m numba_rope bench``), imported from the installed package, so
the suite and the command always measure the same thing. Parameters: device (cpu,
cuda), dtype (float32, float16, bfloat16) and workload (see ``bench.WORKLOADS``).

CUDA combinations are skipped (``NotImplementedError`` in ``setup``, shown as n/a)
where no GPU is present or where the installed numba_rope does not accept device
arrays; ``numba.cuda`` is imported only for them. Every timed GPU call synchronizes.
"""

import numpy as np

import numba_rope
from numba_rope import bench


class _Rope:
    params = (list(bench.DEVICES), list(bench.DTYPES), list(bench.WORKLOADS))
    param_names = ("device", "dtype", "workload")
    timeout = 300
    #: The caches' dtype when not the input's (None: the workload's own).
    cache_dtype = None

    def setup(self, device, dtype, workload):
        try:
            self.target = bench.target(device)  # before the data: skipping costs nothing
        except bench.Unavailable as why:
            raise NotImplementedError(str(why)) from None
        self.case = case = bench.make_case(workload, dtype)
        put = self.target.put
        cos, sin = case.cos_cache, case.sin_cache
        if self.cache_dtype is not None:
            cos, sin = cos.astype(self.cache_dtype), sin.astype(self.cache_dtype)
        try:
            self.arguments = (
                put(case.input),
                put(cos),
                put(sin),
                put(case.position_ids),
            )
        except bench.Unavailable as why:
            raise NotImplementedError(str(why)) from None
        self.options = case.options
        self.out = self.target.empty_like(self.arguments[0])
        try:
            self.rope_out()  # compiles, or loads the compiled kernel from numba's cache
        except TypeError as error:
            if device == "cpu":
                raise
            raise NotImplementedError(
                f"numba_rope does not accept {device} arrays: {error}"
            ) from None

    def rope_out(self):
        numba_rope.rotary_embedding(*self.arguments, out=self.out, **self.options)
        self.target.synchronize()

    def rope_alloc(self):
        result = numba_rope.rotary_embedding(*self.arguments, **self.options)
        self.target.synchronize()
        return result


class Time(_Rope):
    """Wall time of one call: into a preallocated ``out``, allocating the result, in
    place (``out`` is the input), and ``rotary_embedding_qk`` with q in place and k (a
    quarter of the heads, at least one) written elsewhere, as a decode step writes k
    into its KV cache. In place has its own kernel path (a regression there once cost
    4-15x unseen by the ``out=`` timings)."""

    def setup(self, device, dtype, workload):
        super().setup(device, dtype, workload)
        put, host = self.target.put, self.case.input
        self.k = put(np.ascontiguousarray(host[:, : max(1, host.shape[1] // 4)]))
        self.k_out = self.target.empty_like(self.k)
        self.work = put(host)
        self.rope_in_place()  # compile (or load) the in-place kernels here, not timed
        self.rope_qk_q_in_place()
        self.work = put(host)  # and start again from the input

    def rope_in_place(self):
        numba_rope.rotary_embedding(self.work, *self.arguments[1:], out=self.work, **self.options)
        self.target.synchronize()

    def rope_qk_q_in_place(self):
        numba_rope.rotary_embedding_qk(
            self.work,
            self.k,
            *self.arguments[1:],
            out_q=self.work,
            out_k=self.k_out,
            **self.options,
        )
        self.target.synchronize()

    def time_rope_out(self, device, dtype, workload):
        self.rope_out()

    def time_rope_alloc(self, device, dtype, workload):
        self.rope_alloc()

    def time_rope_in_place(self, device, dtype, workload):
        self.rope_in_place()

    def time_rope_qk_q_in_place(self, device, dtype, workload):
        self.rope_qk_q_in_place()


class TimeFloat32Caches(_Rope):
    """Wall time of one call into a preallocated ``out``, 16-bit inputs with float32
    caches (the more precise caches the operator accepts for them): their own kernels
    (bfloat16 rows of elements, not words), whose streamed rows once took 20x the
    time of bfloat16 caches on AVX-512 CPUs unseen by the other timings."""

    params = (list(bench.DEVICES), ["float16", "bfloat16"], list(bench.WORKLOADS))
    cache_dtype = "float32"

    def time_rope_out(self, device, dtype, workload):
        self.rope_out()


class Memory(_Rope):
    """Peak resident memory of the process around the allocating call (host only)."""

    def setup(self, device, dtype, workload):
        if device != "cpu":
            raise NotImplementedError("peakmem measures host memory, not device memory")
        super().setup(device, dtype, workload)

    def peakmem_rope_alloc(self, device, dtype, workload):
        self.rope_alloc()


class Bandwidth(_Rope):
    """Fraction of the copy bandwidth reached: copy time / RoPE time (1.0 = copy speed).

    Both are medians measured here, in the same process and setup: the copy floor is
    a copy of the input into an array of its shape (numba parallel with numba_rope's
    threads, or ``np.copyto`` if faster; device to device on the GPU).
    """

    def track_bandwidth_fraction(self, device, dtype, workload):
        fraction = bench.bandwidth_fraction(self.case, self.target, self.rope_out, repeats=15)
        return round(fraction, 4)

    track_bandwidth_fraction.unit = "copy time / RoPE time"
