// kda_common.cuh: what the two prefill kernels share: the launch parameters (KdaParams), the sequence and
// chunk-slot bookkeeping, and the warp-level 3xTF32 tensor-core helpers.
//
// Tensor cores: mma.sync.m16n8k8 with tf32 operands and fp32 accumulators (sm_80+, so Ada and Hopper). An fp32
// operand x is split as hi = x with its low 13 mantissa bits cleared (exactly a tf32) and lo = x - hi (exact
// in fp32; the tensor core reads the top 19 bits of lo), and A * B is accumulated as lo*hi + hi*lo + hi*hi.
// The dropped lo*lo term and the truncation of lo are below 2^-20 relative: the products are fp32-accurate
// (plain tf32 would be ~3e-4, above the 1e-4 this backend promises).
//
// Fragment layout used everywhere ("k-permuted"): a k-step of 16 runs as two m16n8k8 MMAs, and lane
// (g = lane / 4, t = lane % 4) holds the four consecutive k = 4t..4t+3 of its rows / column, read with one
// 16-byte load: k = 4t, 4t+1 feed the first MMA (its k slots t and t+4), k = 4t+2, 4t+3 the second. A and B
// use the same permutation, so the sum over k is unchanged. A is row-major [M][k]; B is stored [N][k]
// (k contiguous). Shared-memory row strides are 16 (mod 32) floats, so the eight 16-byte reads of a
// quarter warp (two rows x four lanes) fall in distinct banks.
#pragma once

#include <stdint.h>

#ifdef CULA_SM89_EMULATE
// Host emulation of the CUDA execution model for checking the kernels on a machine without a GPU
// (packages/cula-sm89/emu/): threads are std::threads, the warp-level primitives are emulated there.
#include "emu_cuda.h"
#else
#include <cuda_runtime.h>
#define CULA_DYNAMIC_SMEM(name) extern __shared__ float4 name[]
#endif

namespace cula_sm89 {

// Decay exponents are kept in log2 units (G2 = G * log2(e)) so that every decay is one ex2.
constexpr float kLog2e = 1.4426950408889634f;

struct KdaParams {
    // inputs (FLA layout), element strides of (batch, token, head)
    const float* q;
    const float* k;
    const float* v;
    const float* g;
    const float* beta;
    int64_t q_sb, q_st, q_sh;
    int64_t k_sb, k_st, k_sh;
    int64_t v_sb, v_st, v_sh;
    int64_t g_sb, g_st, g_sh;
    int64_t b_sb, b_st, b_sh;
    const float* h0;            // [N, HV, K, V] or nullptr
    const int32_t* cu_seqlens;  // [N + 1] or nullptr
    // outputs
    float* o;
    int64_t o_sb, o_st, o_sh;
    float* ht;  // [N, HV, K, V] or nullptr
    // intra-chunk products, one slot of C rows per (row, head, chunk): slot = (row * HV + hv) * slots + chunk
    float* w;    // [.., C, K]  Akk (beta k exp(G))
    float* u;    // [.., C, V]  Akk (beta v)
    float* qw;   // [.., C, K]  scale q exp(G) - Aqk w       (so that o = qw h + ou)
    float* ou;   // [.., C, V]  Aqk u
    float* kgT;  // [.., K, C]  (k exp(G_last - G))^T
    float* gl;   // [.., K]     exp(G_last)
    int32_t* chunk_offsets;  // varlen: [N + 1] first slot of each sequence (written by kda_chunk_offsets_kernel)
    float* dbg_aqk;          // optional [.., C, C]: scaled causal q-k scores (tests only)
    float* dbg_akk;          // optional [.., C, C]: (I + L)^-1 (tests only)
    int64_t T;               // tokens per batch row
    int64_t HV;
    int64_t N;               // sequences
    int64_t rows;            // B, or 1 with varlen
    int64_t slots;           // chunk slots per (row, head)
    int32_t group;           // HV / HQK
    float scale;
};

// ----------------------------------------------------------------------------------- sequences

// Token range [s, e) of sequence n within its batch row, clamped to [0, T] and non-decreasing (validation
// rejects bad cu_seqlens when it can read them; this keeps a bad one from reaching out of bounds).
__device__ __forceinline__ void seq_range(const KdaParams& p, int64_t n, int64_t& s, int64_t& e) {
    if (p.cu_seqlens == nullptr) {
        s = 0;
        e = p.T;
        return;
    }
    int64_t a = p.cu_seqlens[n], b = p.cu_seqlens[n + 1];
    s = a < 0 ? 0 : (a > p.T ? p.T : a);
    e = b < s ? s : (b > p.T ? p.T : b);
}

// ----------------------------------------------------------------------------------- math helpers

__device__ __forceinline__ float ex2(float x) {
#ifdef CULA_SM89_EMULATE
    return emu::ex2(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

__device__ __forceinline__ float4 ex2(float4 x) { return make_float4(ex2(x.x), ex2(x.y), ex2(x.z), ex2(x.w)); }
__device__ __forceinline__ float4 operator-(float4 a, float4 b) {
    return make_float4(a.x - b.x, a.y - b.y, a.z - b.z, a.w - b.w);
}
__device__ __forceinline__ float4 operator*(float4 a, float4 b) {
    return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
}
__device__ __forceinline__ float4 operator*(float s, float4 a) { return make_float4(s * a.x, s * a.y, s * a.z, s * a.w); }

__device__ __forceinline__ float4 lds4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void sts4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ float4 ldg4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ float2 ldg2(const float* p) { return __ldg(reinterpret_cast<const float2*>(p)); }
__device__ __forceinline__ void stg2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ void stg4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

// Brings the 128-byte line holding p into L2 (no register, no wait).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifndef CULA_SM89_EMULATE
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// ----------------------------------------------------------------------------------- async copies (sm_80+)

// 16 bytes global -> shared without a register round trip; `valid == false` writes zeros (reads nothing).
__device__ __forceinline__ void cp_async16(float* smem_dst, const float* gmem_src, bool valid) {
#ifdef CULA_SM89_EMULATE
    emu::cp_async16(smem_dst, gmem_src, valid);
#else
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(valid ? 16 : 0));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifndef CULA_SM89_EMULATE
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifndef CULA_SM89_EMULATE
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// ----------------------------------------------------------------------------------- 3xTF32 MMA

struct FragA {  // a0 (row g, k slot t), a1 (row g+8, t), a2 (row g, t+4), a3 (row g+8, t+4)
    uint32_t hi[4], lo[4];
};
struct FragB {  // b0 (k slot t, col g), b1 (k slot t+4, col g)
    uint32_t hi[2], lo[2];
};

__device__ __forceinline__ void split(float x, uint32_t& hi, uint32_t& lo) {
    const uint32_t h = __float_as_uint(x) & 0xffffe000u;
    hi = h;
    lo = __float_as_uint(x - __uint_as_float(h));
}

__device__ __forceinline__ FragA make_a(float a0, float a1, float a2, float a3) {
    FragA f;
    split(a0, f.hi[0], f.lo[0]);
    split(a1, f.hi[1], f.lo[1]);
    split(a2, f.hi[2], f.lo[2]);
    split(a3, f.hi[3], f.lo[3]);
    return f;
}

__device__ __forceinline__ FragB make_b(float b0, float b1) {
    FragB f;
    split(b0, f.hi[0], f.lo[0]);
    split(b1, f.hi[1], f.lo[1]);
    return f;
}

// The two A fragments of a 16-wide k-step from the 4-float rows r0 (row g) and r1 (row g + 8).
__device__ __forceinline__ void make_a2(float4 r0, float4 r1, FragA& a0, FragA& a1) {
    a0 = make_a(r0.x, r1.x, r0.y, r1.y);
    a1 = make_a(r0.z, r1.z, r0.w, r1.w);
}
// The two B fragments of a 16-wide k-step from the 4-float column piece c (column g).
__device__ __forceinline__ void make_b2(float4 c, FragB& b0, FragB& b1) {
    b0 = make_b(c.x, c.y);
    b1 = make_b(c.z, c.w);
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef CULA_SM89_EMULATE
    emu::mma_m16n8k8_tf32(d, a, b);
#else
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// d += a * b in 3xTF32 (small terms first).
__device__ __forceinline__ void mma3(float (&d)[4], const FragA& a, const FragB& b) {
    mma_tf32(d, a.lo, b.hi);
    mma_tf32(d, a.hi, b.lo);
    mma_tf32(d, a.hi, b.hi);
}

// The three terms into three accumulators: independent chains, so a long k loop is not one chain of
// dependent MMAs (the caller sums d0 + d1 + d2 at the end).
__device__ __forceinline__ void mma3_split(float (&d0)[4], float (&d1)[4], float (&d2)[4], const FragA& a, const FragB& b) {
    mma_tf32(d1, a.lo, b.hi);
    mma_tf32(d2, a.hi, b.lo);
    mma_tf32(d0, a.hi, b.hi);
}

// d += (16 x 16 k-step of A) * (16 x 8 k-step of B), both given as the k-permuted 4-float pieces.
__device__ __forceinline__ void mma3_k16(float (&d)[4], const FragA& a0, const FragA& a1, float4 bcol) {
    FragB b0, b1;
    make_b2(bcol, b0, b1);
    mma3(d, a0, b0);
    mma3(d, a1, b1);
}

}  // namespace cula_sm89
