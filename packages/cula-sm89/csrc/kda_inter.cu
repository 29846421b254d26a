// kda_inter.cu: the inter-chunk kernel of the fp32 KDA prefill (the state recurrence and the output), and the
// small kernel that lays out varlen chunk slots. Per chunk, with the intra-chunk products of kda_intra.cu:
//
//   v_new = u - w h          o = qw h + ou          h' = diag(gl) h + kgT v_new
//
// Tiling: one block of NW warps per (sequence, value head, BV-column tile of the state); the block walks its
// sequence's chunks in order and keeps its [K, BV] slice of the state in registers (fp32), mirrored in shared
// memory as the B operand of the next chunk. Columns of the state are independent, so the V / BV blocks of a
// head run concurrently; they share w, qw and kgT through L2. The per-chunk work is a dependent chain (the
// state), so it is spread over several warps to keep each chunk short. Two variants: BV = 32 with 8 warps
// (the default), and BV = 16 with 4 warps when the BV = 32 grid would not fill the GPU (long sequences, few
// heads): twice the blocks, each with half the work per sequential chunk step.
//   phase 1: warps tile the [C, BV] outputs in 16 x 8*NTW pieces; A = rows of w and qw straight from global
//            memory (16-byte loads, k-permuted fragments; warps sharing rows hit L1), B = h from shared memory;
//            v_new goes to shared memory (as [BV][C]), o to global memory (rows past the sequence's end are
//            not written).
//   phase 2: each warp updates its 16 x 8*NTBW tiles of the state: h = gl h + kgT v_new (A = rows of kgT from
//            global memory, B = v_new from shared memory), then mirrors them into shared memory.
// Two barriers per chunk. All products 3xTF32 (see kda_common.cuh), each term in its own accumulator so that
// no long chain of dependent MMAs forms. Latency: u, ou, kgT and gl do not depend on the state and are loaded
// before phase 1; the next chunk's data is prefetched into L2 during the current chunk.
#include "kda_common.cuh"
#ifndef CULA_SM89_EMULATE
#include "kda_launch.h"
#endif

namespace cula_sm89 {

template <int K_, int C_, int BV_, int NW_>
struct InterTiling {
    static constexpr int K = K_, V = K_, C = C_, BV = BV_;
    static constexpr int NW = NW_, NT = 32 * NW;
    // phase 1, [C, BV]: 16-row tiles, warps per tile (split over columns), 8-column tiles per warp
    static constexpr int MTC = C / 16;
    static constexpr int WPM = NW / MTC;
    static constexpr int NTW = BV / 8 / WPM;
    // phase 2, [K, BV]: 16-row tiles per warp, warps per tile, 8-column tiles per warp
    static constexpr int MTK = K / 16;
    static constexpr int MPW = MTK >= NW ? MTK / NW : 1;
    static constexpr int WPK = MTK >= NW ? 1 : NW / MTK;
    static constexpr int NTBW = BV / 8 / WPK;
    static constexpr int LDH = K + 16;  // hT [BV][K]   (16 mod 32: conflict-free 16-byte fragment reads)
    static constexpr int LDV = C + 16;  // vnT [BV][C]
    static constexpr size_t SMEM_BYTES = size_t(BV * LDH + BV * LDV) * sizeof(float);
    static_assert(NW % MTC == 0 && NTW >= 1 && NTBW >= 1 && V % BV == 0, "tiling");
    static_assert(MPW * NW * NTBW == MTK * (BV / 8), "phase 2 covers the state once");
};

// Phase-2 ownership of warp `warp`: state rows 16 * (m0 + mi) + .., columns 8 * (n0 + nt) + ..
template <class Tl>
__device__ __forceinline__ void state_tiles(int warp, int& m0, int& n0) {
    m0 = (warp / Tl::WPK) * Tl::MPW;
    n0 = (warp % Tl::WPK) * Tl::NTBW;
}

// The state tiles in registers -> shared memory as hT[column][row].
template <class Tl>
__device__ __forceinline__ void mirror_state(float* hT, const float (&h)[Tl::MPW][Tl::NTBW][4], int m0, int n0, int g,
                                             int t) {
#pragma unroll
    for (int mi = 0; mi < Tl::MPW; ++mi)
#pragma unroll
        for (int nt = 0; nt < Tl::NTBW; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int k = 16 * (m0 + mi) + g + 8 * (e >> 1), c = 8 * (n0 + nt) + 2 * t + (e & 1);
                hT[c * Tl::LDH + k] = h[mi][nt][e];
            }
}

template <int K_, int C_, int BV_, int NW_>
__global__ void __launch_bounds__(32 * NW_, 2) kda_inter_kernel(const KdaParams p) {
    using Tl = InterTiling<K_, C_, BV_, NW_>;
    constexpr int C = Tl::C, K = Tl::K, V = Tl::V, BV = Tl::BV, LDH = Tl::LDH, LDV = Tl::LDV;

    CULA_DYNAMIC_SMEM(smem4);
    float* hT = reinterpret_cast<float*>(smem4);
    float* vnT = hT + BV * LDH;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;

    constexpr int NVT = V / BV;
    const int64_t bid = blockIdx.x;
    const int v0 = int(bid % NVT) * BV;
    const int64_t hv = (bid / NVT) % p.HV;
    const int64_t n = bid / (NVT * p.HV);

    int64_t row, s, e, cr0 = 0;
    seq_range(p, n, s, e);
    if (p.cu_seqlens != nullptr) {
        row = 0;
        cr0 = p.chunk_offsets[n];
    } else {
        row = n;
    }
    int64_t nch = (e - s + C - 1) / C;
    if (cr0 + nch > p.slots) nch = p.slots > cr0 ? p.slots - cr0 : 0;  // only for inconsistent cu_seqlens
    const int64_t slot0 = (row * p.HV + hv) * p.slots + cr0;
    float* o_base = p.o + row * p.o_sb + hv * p.o_sh + v0;

    // ---- initial state
    int m0, nb;
    state_tiles<Tl>(warp, m0, nb);
    float h[Tl::MPW][Tl::NTBW][4];
    const float* h0 = p.h0 != nullptr ? p.h0 + (n * p.HV + hv) * K * V + v0 : nullptr;
#pragma unroll
    for (int mi = 0; mi < Tl::MPW; ++mi)
#pragma unroll
        for (int nt = 0; nt < Tl::NTBW; ++nt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int k = 16 * (m0 + mi) + g + 8 * hh, c = 8 * (nb + nt) + 2 * t;
                const float2 x = h0 != nullptr ? ldg2(h0 + k * V + c) : make_float2(0.f, 0.f);
                h[mi][nt][2 * hh] = x.x;
                h[mi][nt][2 * hh + 1] = x.y;
            }
    mirror_state<Tl>(hT, h, m0, nb, g, t);
    __syncthreads();

    const int mt = warp % Tl::MTC, i0 = 16 * mt;
    const int n0 = (warp / Tl::MTC) * Tl::NTW * 8;
    for (int64_t c = 0; c < nch; ++c) {
        const int64_t slot = slot0 + c;
        const float* wc = p.w + slot * C * K;
        const float* qwc = p.qw + slot * C * K;
        const float* uc = p.u + slot * C * V + v0;
        const float* ouc = p.ou + slot * C * V + v0;
        const float* kgc = p.kgT + slot * K * C;
        const float* glc = p.gl + slot * K;
        if (c + 1 < nch) {
            // The next chunk's inputs into L2 now: they were written by the intra-chunk kernel long ago and are
            // usually in DRAM; one chunk step is longer than a DRAM round trip.
            constexpr int LINES_CK = C * K / 32;  // 128-byte lines of a [C, K] slot; u and ou: one line per row
            for (int l = tid; l < 3 * LINES_CK + 2 * C + K / 32; l += Tl::NT) {
                const float* a;
                if (l < LINES_CK) a = wc + C * K + 32 * l;
                else if (l < 2 * LINES_CK) a = qwc + C * K + 32 * (l - LINES_CK);
                else if (l < 3 * LINES_CK) a = kgc + K * C + 32 * (l - 2 * LINES_CK);
                else if (l < 3 * LINES_CK + C) a = uc + C * V + (l - 3 * LINES_CK) * V;
                else if (l < 3 * LINES_CK + 2 * C) a = ouc + C * V + (l - 3 * LINES_CK - C) * V;
                else a = glc + K + 32 * (l - 3 * LINES_CK - 2 * C);
                prefetch_l2(a);
            }
        }

        // Loads that do not depend on the state go first, so their latency overlaps phase 1.
        float2 uu[Tl::NTW][2], oo[Tl::NTW][2];
#pragma unroll
        for (int j = 0; j < Tl::NTW; ++j)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int i = i0 + g + 8 * hh, col = n0 + 8 * j + 2 * t;
                uu[j][hh] = ldg2(uc + i * V + col);
                oo[j][hh] = ldg2(ouc + i * V + col);
            }
        float gla[Tl::MPW][2];
        float4 kga[Tl::MPW][C / 16][2];
#pragma unroll
        for (int mi = 0; mi < Tl::MPW; ++mi) {
            const int k0 = 16 * (m0 + mi);
            gla[mi][0] = __ldg(glc + k0 + g);
            gla[mi][1] = __ldg(glc + k0 + g + 8);
#pragma unroll
            for (int ks = 0; ks < C / 16; ++ks) {
                kga[mi][ks][0] = ldg4(kgc + (k0 + g) * C + 16 * ks + 4 * t);
                kga[mi][ks][1] = ldg4(kgc + (k0 + g + 8) * C + 16 * ks + 4 * t);
            }
        }

        // ---- phase 1: P = w h, R = qw h on rows [i0, i0 + 16), columns [n0, n0 + 8 NTW); each 3xTF32 term in
        // its own accumulator (three short dependent chains instead of one long one)
        float P[3][Tl::NTW][4], R[3][Tl::NTW][4];
#pragma unroll
        for (int x = 0; x < 3; ++x)
#pragma unroll
            for (int j = 0; j < Tl::NTW; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) P[x][j][q] = R[x][j][q] = 0.f;
#pragma unroll
        for (int ks = 0; ks < K / 16; ++ks) {
            const int kc = 16 * ks + 4 * t;
            FragA w0, w1, q0, q1;
            make_a2(ldg4(wc + (i0 + g) * K + kc), ldg4(wc + (i0 + g + 8) * K + kc), w0, w1);
            make_a2(ldg4(qwc + (i0 + g) * K + kc), ldg4(qwc + (i0 + g + 8) * K + kc), q0, q1);
#pragma unroll
            for (int j = 0; j < Tl::NTW; ++j) {
                FragB b0, b1;
                make_b2(lds4(hT + (n0 + 8 * j + g) * LDH + kc), b0, b1);
                mma3_split(P[0][j], P[1][j], P[2][j], w0, b0);
                mma3_split(P[0][j], P[1][j], P[2][j], w1, b1);
                mma3_split(R[0][j], R[1][j], R[2][j], q0, b0);
                mma3_split(R[0][j], R[1][j], R[2][j], q1, b1);
            }
        }
        const int64_t tok = s + c * C;  // the chunk's first token
#pragma unroll
        for (int j = 0; j < Tl::NTW; ++j) {
            const int col = n0 + 8 * j + 2 * t;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int i = i0 + g + 8 * hh;
                const float p0 = P[1][j][2 * hh] + P[2][j][2 * hh] + P[0][j][2 * hh];
                const float p1 = P[1][j][2 * hh + 1] + P[2][j][2 * hh + 1] + P[0][j][2 * hh + 1];
                const float r0 = R[1][j][2 * hh] + R[2][j][2 * hh] + R[0][j][2 * hh];
                const float r1 = R[1][j][2 * hh + 1] + R[2][j][2 * hh + 1] + R[0][j][2 * hh + 1];
                vnT[col * LDV + i] = uu[j][hh].x - p0;
                vnT[(col + 1) * LDV + i] = uu[j][hh].y - p1;
                if (tok + i < e) stg2(o_base + (tok + i) * p.o_st + col, oo[j][hh].x + r0, oo[j][hh].y + r1);
            }
        }
        __syncthreads();  // v_new complete; every warp is done reading hT

        // ---- phase 2: h = diag(gl) h + kgT v_new on this warp's tiles (the low-order terms in two side
        // accumulators)
#pragma unroll
        for (int mi = 0; mi < Tl::MPW; ++mi) {
            float d1[Tl::NTBW][4], d2[Tl::NTBW][4];
#pragma unroll
            for (int nt = 0; nt < Tl::NTBW; ++nt) {
                h[mi][nt][0] *= gla[mi][0];
                h[mi][nt][1] *= gla[mi][0];
                h[mi][nt][2] *= gla[mi][1];
                h[mi][nt][3] *= gla[mi][1];
#pragma unroll
                for (int q = 0; q < 4; ++q) d1[nt][q] = d2[nt][q] = 0.f;
            }
#pragma unroll
            for (int ks = 0; ks < C / 16; ++ks) {
                const int kc = 16 * ks + 4 * t;
                FragA a0, a1;
                make_a2(kga[mi][ks][0], kga[mi][ks][1], a0, a1);
#pragma unroll
                for (int nt = 0; nt < Tl::NTBW; ++nt) {
                    FragB b0, b1;
                    make_b2(lds4(vnT + (8 * (nb + nt) + g) * LDV + kc), b0, b1);
                    mma3_split(h[mi][nt], d1[nt], d2[nt], a0, b0);
                    mma3_split(h[mi][nt], d1[nt], d2[nt], a1, b1);
                }
            }
#pragma unroll
            for (int nt = 0; nt < Tl::NTBW; ++nt)
#pragma unroll
                for (int q = 0; q < 4; ++q) h[mi][nt][q] += d1[nt][q] + d2[nt][q];
        }
        mirror_state<Tl>(hT, h, m0, nb, g, t);
        __syncthreads();  // hT complete for the next chunk; every warp is done reading vnT
    }

    if (p.ht != nullptr) {
        float* ht = p.ht + (n * p.HV + hv) * K * V + v0;
#pragma unroll
        for (int mi = 0; mi < Tl::MPW; ++mi)
#pragma unroll
            for (int nt = 0; nt < Tl::NTBW; ++nt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int k = 16 * (m0 + mi) + g + 8 * hh, c = 8 * (nb + nt) + 2 * t;
                    stg2(ht + k * V + c, h[mi][nt][2 * hh], h[mi][nt][2 * hh + 1]);
                }
    }
}

// Varlen: chunk_offsets[n] = sum over m < n of ceil(len_m / C) (one block; a scan in tiles of its threads).
__global__ void __launch_bounds__(256) kda_chunk_offsets_kernel(const KdaParams p, int C) {
    __shared__ int32_t warp_sum[8];
    __shared__ int32_t carry;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) {
        carry = 0;
        p.chunk_offsets[0] = 0;
    }
    __syncthreads();
    for (int64_t base = 0; base < p.N; base += blockDim.x) {
        const int64_t n = base + tid;
        int32_t x = 0;
        if (n < p.N) {
            int64_t s, e;
            seq_range(p, n, s, e);
            x = int32_t((e - s + C - 1) / C);
        }
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int32_t y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += y;
        }
        if (lane == 31) warp_sum[warp] = x;
        __syncthreads();
        int32_t before = carry;
        for (int w = 0; w < warp; ++w) before += warp_sum[w];
        if (n < p.N) p.chunk_offsets[n + 1] = before + x;
        __syncthreads();
        if (tid == blockDim.x - 1) carry = before + x;
        __syncthreads();
    }
}

#ifndef CULA_SM89_EMULATE
cudaError_t launch_chunk_offsets(const KdaParams& p, int C, cudaStream_t stream, LaunchError& err) {
    kda_chunk_offsets_kernel<<<1, 256, 0, stream>>>(p, C);
    return check_launch("kda_chunk_offsets", err);
}

template <int K, int C, int BV, int NW>
cudaError_t launch_inter_tiled(const KdaParams& p, cudaStream_t stream, LaunchError& err) {
    using Tl = InterTiling<K, C, BV, NW>;
    auto kernel = kda_inter_kernel<K, C, BV, NW>;
    const int64_t blocks = p.N * p.HV * (K / BV);
    if (blocks == 0) return cudaSuccess;
    static std::atomic<uint64_t> attribute_set{0};
    const std::string name = kernel_name<K, C>("kda_inter") + "[BV=" + std::to_string(BV) + "]";
    cudaError_t e = set_dynamic_smem(reinterpret_cast<const void*>(kernel), Tl::SMEM_BYTES, name, attribute_set, err);
    if (e != cudaSuccess) return e;
    kernel<<<dim3(unsigned(blocks)), dim3(Tl::NT), Tl::SMEM_BYTES, stream>>>(p);
    return check_launch(name, err);
}

template <int K, int C>
cudaError_t launch_inter(const KdaParams& p, int state_tile, cudaStream_t stream, LaunchError& err) {
    return state_tile == 16 ? launch_inter_tiled<K, C, 16, 4>(p, stream, err)
                            : launch_inter_tiled<K, C, 32, 8>(p, stream, err);
}

#define CULA_SM89_INTER(K, C) \
    template cudaError_t launch_inter<K, C>(const KdaParams&, int, cudaStream_t, LaunchError&);
CULA_SM89_INTER(64, 32)
CULA_SM89_INTER(64, 64)
CULA_SM89_INTER(128, 32)
CULA_SM89_INTER(128, 64)
#undef CULA_SM89_INTER
#endif  // CULA_SM89_EMULATE

}  // namespace cula_sm89
