// emu_cuda.h: a host emulation of the slice of CUDA the cula-sm89 kernels use, so that their source can be run
// and checked on a machine without a GPU (see run_emu.py). One block at a time; each CUDA thread is a
// std::thread; __syncthreads / __syncwarp are barriers; the warp-level primitives (mma.sync m16n8k8 tf32,
// __reduce_max_sync, __shfl_up_sync) exchange through per-warp storage between two warp barriers. The tensor
// core is modelled as truncating its operands to tf32 (top 19 bits) and accumulating in fp32.
// Not a product file: only the kernels' logic (indexing, fragment layouts, barriers) is checked this way.
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__

struct float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct EmuDim { unsigned x = 0, y = 0, z = 0; };

namespace emu {

struct WarpData {
    float A[16][8], B[8][8];
    uint32_t red[32];
    std::unique_ptr<std::barrier<>> bar;
};

struct BlockCtx {
    std::unique_ptr<std::barrier<>> bar;
    std::vector<WarpData> warps;
    std::vector<float4> smem;
    unsigned nthreads = 0, bid = 0;
};

inline thread_local BlockCtx* ctx = nullptr;
inline thread_local unsigned tid = 0;

inline float4* smem() { return ctx->smem.data(); }
inline WarpData& warp() { return ctx->warps[tid / 32]; }

inline uint32_t bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float from_bits(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
inline float tf32(uint32_t u) { return from_bits(u & 0xffffe000u); }

inline float ex2(float x) {
    const float y = std::exp2(x);
    return std::fabs(y) < 1.17549435e-38f ? 0.f : y;  // .ftz
}

inline void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    WarpData& W = warp();
    const int lane = tid & 31, g = lane >> 2, t = lane & 3;
    W.A[g][t] = tf32(a[0]);
    W.A[g + 8][t] = tf32(a[1]);
    W.A[g][t + 4] = tf32(a[2]);
    W.A[g + 8][t + 4] = tf32(a[3]);
    W.B[t][g] = tf32(b[0]);
    W.B[t + 4][g] = tf32(b[1]);
    W.bar->arrive_and_wait();
    float out[4];
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float acc = d[e];
        for (int k = 0; k < 8; ++k) acc += W.A[row][k] * W.B[k][col];
        out[e] = acc;
    }
    W.bar->arrive_and_wait();
    for (int e = 0; e < 4; ++e) d[e] = out[e];
}

inline void cp_async16(float* dst, const float* src, bool valid) {
    for (int i = 0; i < 4; ++i) dst[i] = valid ? src[i] : 0.f;
}

// Runs `body` as one block of `nthreads` threads with `smem_bytes` of dynamic shared memory (NaN-filled, so
// that a read of something never written shows).
inline void run_block(unsigned nthreads, unsigned bid, size_t smem_bytes, const std::function<void()>& body) {
    BlockCtx b;
    b.nthreads = nthreads;
    b.bid = bid;
    b.bar = std::make_unique<std::barrier<>>(nthreads);
    b.warps.resize((nthreads + 31) / 32);
    for (auto& w : b.warps) w.bar = std::make_unique<std::barrier<>>(32);
    const float nan = std::nanf("");
    b.smem.assign(smem_bytes / sizeof(float4) + 1, float4{nan, nan, nan, nan});
    std::vector<std::thread> threads;
    threads.reserve(nthreads);
    for (unsigned i = 0; i < nthreads; ++i)
        threads.emplace_back([&b, &body, i] {
            ctx = &b;
            tid = i;
            body();
        });
    for (auto& th : threads) th.join();
}

}  // namespace emu

// The CUDA names the kernels use.
#define threadIdx (EmuDim{emu::tid, 0, 0})
#define blockIdx (EmuDim{emu::ctx->bid, 0, 0})
#define blockDim (EmuDim{emu::ctx->nthreads, 1, 1})
#define CULA_DYNAMIC_SMEM(name) float4* name = emu::smem()

inline void __syncthreads() { emu::ctx->bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp().bar->arrive_and_wait(); }
inline uint32_t __float_as_uint(float x) { return emu::bits(x); }
inline float __uint_as_float(uint32_t u) { return emu::from_bits(u); }
inline unsigned __reduce_max_sync(unsigned, unsigned v) {
    emu::WarpData& W = emu::warp();
    W.red[emu::tid & 31] = v;
    W.bar->arrive_and_wait();
    unsigned m = 0;
    for (int i = 0; i < 32; ++i) m = W.red[i] > m ? W.red[i] : m;
    W.bar->arrive_and_wait();
    return m;
}
inline int __shfl_up_sync(unsigned, int v, int d) {
    emu::WarpData& W = emu::warp();
    const int lane = emu::tid & 31;
    W.red[lane] = uint32_t(v);
    W.bar->arrive_and_wait();
    const int r = lane >= d ? int(W.red[lane - d]) : v;
    W.bar->arrive_and_wait();
    return r;
}
template <class T>
inline T __ldg(const T* p) { return *p; }
