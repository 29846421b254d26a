"""Device-side CuTe DSL building blocks shared by the kernels of the arch packages (cula-sm90, cula-sm100): the
warp-level tensor-core GEMM (mma.sync m16n8k16, bf16 in, fp32 accumulate, operands read from shared memory with
ldmatrix) in `warp_mma`, and the row copies between global and shared memory (cp.async in, 16-byte vector stores
out) in `copies`.

Only kernel modules import these modules: they import CuTe DSL (`cutlass`) at module level, and `import cula_core`
(and this package's own init, which imports nothing) must not. The host side of the kernels (loading, launching,
ahead-of-time builds) is `cula_core.cute_runtime`.
"""
