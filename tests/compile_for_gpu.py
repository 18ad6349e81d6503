"""Compile every CUDA kernel variant to PTX for a real GPU, without a GPU.

The CUDA simulator runs kernels as Python, so it never type-checks them the way
numba-cuda does for a device. This script does, with NVVM alone (a CUDA toolkit's
libnvvm and libdevice; no driver, no GPU): it compiles each specialisation that
``rotary_embedding`` can launch for compute capability 9.0, and checks that the rope
kernels' PTX rounds each product on its own (no FMA: the CPU's bits). Run by
``tests/test_rotary_cuda.py`` in a subprocess (the simulator must be off); exit code 77
means the toolkit is missing.

Three numba-cuda internals that otherwise ask the driver are replaced, for this process
only: the current device's compute capability (for device functions), the architecture
lookup through NVRTC, and NVRTC's path.
"""

from __future__ import annotations

import os
import sys
import types as builtin_types

SKIP = 77


def _patch_numba_cuda() -> None:
    import numba.cuda.cuda_paths as cuda_paths
    import numba.cuda.cudadrv.nvrtc as nvrtc
    import numba.cuda.dispatcher as dispatcher

    device = builtin_types.SimpleNamespace(compute_capability=(9, 0))
    dispatcher.get_current_device = lambda: device
    nvrtc.get_arch_option = lambda major, minor: f"compute_{major}{minor}"
    cuda_paths._get_nvrtc_path = lambda: cuda_paths._env_path_tuple("none", None)


def _check_no_contraction(ptx: str, name: str) -> None:
    """The kernel's products are rounded on their own, as on the CPU: no FMA, and every
    floating-point multiplication carries ``.rn``, which ptxas does not contract (a bare
    ``mul.f32`` next to an ``add.f32`` may become an FFMA in the machine code)."""
    fused = [line.strip() for line in ptx.splitlines() if line.strip().startswith("fma.")]
    bare = [
        line.strip()
        for line in ptx.splitlines()
        if line.strip().startswith(("mul.f32", "mul.f64", "mul.ftz.f32"))
    ]
    rounded = sum(
        line.strip().startswith(("mul.rn.f32", "mul.rn.f64")) for line in ptx.splitlines()
    )
    if fused or bare or rounded < 4:
        raise AssertionError(
            f"{name}: {len(fused)} FMA ({fused[:2]}), {len(bare)} contractible products "
            f"({bare[:2]}), {rounded} products rounded on their own (4 or more wanted)"
        )


def main() -> int:
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") != "0":
        print("the CUDA simulator is on: nothing to compile")
        return SKIP
    from numba import cuda, types

    _patch_numba_cuda()
    from numba_rope._cuda import kernels as _cuda_kernels

    storage = {
        "float32": types.float32,
        "float16": types.float16,
        "bfloat16": types.uint16,
        "float64": types.float64,
    }
    pairs = [
        ("float32", "float32"),
        ("float16", "float16"),
        ("float16", "float32"),
        ("bfloat16", "bfloat16"),
        ("bfloat16", "float32"),
        ("float64", "float64"),
        ("float64", "float32"),
    ]
    compiled = 0
    try:
        # (dtype pair, kind of positions, numba type of the positions argument)
        kinds = [
            ("ids", types.Array(types.int64, 2, "A")),
            ("token", None),
            ("offsets", types.Array(types.int64, 1, "A")),
            ("offset", types.int64),
        ]
        variants = [(pair, kind, positions) for pair in pairs for kind, positions in kinds]
        variants += [
            (("float32", "float32"), "ids", types.Array(types.int32, 2, "A")),
            (("bfloat16", "float32"), "ids", types.Array(types.uint8, 2, "A")),
            # offsets of other integer types: signed (negative ones) and unsigned
            (("float32", "float32"), "offsets", types.Array(types.uint64, 1, "A")),
            (("float16", "float16"), "offsets", types.Array(types.int32, 1, "A")),
        ]
        for (input_dtype, cache_dtype), kind, positions in variants:
            compute = types.float64 if input_dtype == "float64" else types.float32
            x = types.Array(storage[input_dtype], 4, "A")
            cache = types.Array(storage[cache_dtype], 3 if kind == "token" else 2, "A")
            positions = cache if positions is None else positions
            # One kernel for one tensor or two (q and k): q, k, cos, sin, positions,
            # out_q, out_k, interleaved, rotary_dim, slots_q, slots_k, n_groups, sign.
            kernel = _cuda_kernels._make_rope_kernel(input_dtype, cache_dtype, kind, 4)
            signature = (
                x,
                x,
                cache,
                cache,
                positions,
                x,
                x,
                types.boolean,
                types.int64,
                types.int64,
                types.int64,
                types.int64,
                compute,
            )
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
            _check_no_contraction(ptx, f"{input_dtype}/{cache_dtype}/{kind}")
            compiled += 1
        for ids in (types.int64, types.uint64, types.int32):
            flag = types.Array(types.int64, 1, "C")
            cuda.compile_ptx(
                _cuda_kernels.first_bad_position_cuda.py_func,
                (types.Array(ids, 2, "A"), types.int64, flag),
                cc=(9, 0),
            )
            compiled += 1
        for dtype in storage.values():
            array = types.Array(dtype, 4, "A")
            cuda.compile_ptx(_cuda_kernels.copy_cuda.py_func, (array, array), cc=(9, 0))
            compiled += 1
    except Exception as error:
        text = f"{type(error).__name__}: {error}"
        if compiled == 0 and any(
            word in text.lower() for word in ("nvvm", "libdevice", "cuda_home")
        ):
            print(f"no CUDA toolkit to compile with: {text}")
            return SKIP
        raise
    print(f"compiled {compiled} kernels for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
