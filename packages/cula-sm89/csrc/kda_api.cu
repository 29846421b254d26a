// kda_api.cu: the C ABI of libcula_sm89.so (declared in cula_sm89.h): checks a KdaPrefillIO, lays out the
// workspace, and launches the kernels on the caller's stream: [varlen: chunk offsets] -> intra -> inter.
// Host code only; no synchronisation, no allocation.
#include <atomic>
#include <cstring>
#include <string>

#include "cula_sm89.h"
#include "kda_launch.h"

namespace {

using cula_sm89::KdaParams;
using cula_sm89::LaunchError;

thread_local std::string g_last_error;

int fail(int code, const std::string& message) {
    g_last_error = message;
    return code;
}

int sm_count() {  // of the current device, cached per device (0 if unknown)
    static std::atomic<int> cache[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        cudaGetLastError();
        return 0;
    }
    int n = cache[dev].load(std::memory_order_relaxed);
    if (n == 0) {
        if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
            cudaGetLastError();
            return 0;
        }
        cache[dev].store(n, std::memory_order_relaxed);
    }
    return n;
}

// Columns of the state per inter-chunk block: 16 when the 32-column grid would leave SMs idle (few sequences
// x heads), else 32 (less re-reading of w, qw, kgT). `forced` (16 or 32) overrides it (tests).
int state_tile(const KdaPrefillIO* io, int forced) {
    if (forced == 16 || forced == 32) return forced;
    const int64_t blocks32 = io->N * io->HV * (io->V / 32);
    const int sms = sm_count();
    return (sms > 0 && blocks32 < sms) ? 16 : 32;
}

// Default chunk size: 32 for both head dims. On the H100 (docs/sm89.md) it beat 64 on every shape measured:
// a quarter of the intra-chunk score work per token and half of the solve, and shorter sequential
// inter-chunk steps (whose latency the next-chunk L2 prefetch hides).
int default_chunk(const KdaPrefillIO*) { return 32; }

constexpr size_t kAlign = 256;
size_t round_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

struct Plan {
    int C = 0;
    int64_t rows = 0, slots = 0;
    size_t w = 0, u = 0, qw = 0, ou = 0, kgT = 0, gl = 0, offs = 0;  // byte offsets in the workspace
    size_t bytes = 0;
    bool w_in_ws = false, u_in_ws = false;
};

bool aligned(const void* p, size_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }
bool strides_multiple(const int64_t* s, int64_t m) { return s[0] % m == 0 && s[1] % m == 0 && s[2] % m == 0; }

// Checks sizes and lays out the workspace; pointers are checked by check_pointers.
int plan(const KdaPrefillIO* io, Plan& pl) {
    if (io == nullptr) return fail(CULA_SM89_INVALID_ARGUMENT, "io is NULL");
    if (io->K != io->V || (io->K != 64 && io->K != 128))
        return fail(CULA_SM89_INVALID_ARGUMENT, "cula-sm89 serves K == V in (64, 128), got K = " + std::to_string(io->K) +
                                                   ", V = " + std::to_string(io->V));
    pl.C = io->chunk_size == 0 ? default_chunk(io) : io->chunk_size;
    if (pl.C != 32 && pl.C != 64)
        return fail(CULA_SM89_INVALID_ARGUMENT, "chunk_size must be 0, 32 or 64, got " + std::to_string(io->chunk_size));
    if (io->B < 0 || io->T < 0 || io->HQK < 1 || io->HV < 1 || io->HV % io->HQK != 0)
        return fail(CULA_SM89_INVALID_ARGUMENT, "need B >= 0, T >= 0, HQK >= 1 and HV a multiple of HQK; got B = " +
                                                   std::to_string(io->B) + ", T = " + std::to_string(io->T) + ", HQK = " +
                                                   std::to_string(io->HQK) + ", HV = " + std::to_string(io->HV));
    const int64_t C = pl.C, nc = (io->T + C - 1) / C;
    if (io->cu_seqlens != nullptr) {
        if (io->B != 1) return fail(CULA_SM89_INVALID_ARGUMENT, "cu_seqlens needs B == 1, got B = " + std::to_string(io->B));
        if (io->N < 1) return fail(CULA_SM89_INVALID_ARGUMENT, "cu_seqlens needs N >= 1, got N = " + std::to_string(io->N));
        pl.rows = 1;
        pl.slots = nc + io->N;  // each sequence adds at most one partial chunk
    } else {
        if (io->N != io->B)
            return fail(CULA_SM89_INVALID_ARGUMENT, "without cu_seqlens N must equal B, got N = " + std::to_string(io->N) +
                                                       ", B = " + std::to_string(io->B));
        pl.rows = io->B;
        pl.slots = nc;
    }
    const int64_t heads = pl.rows * io->HV;
    const int64_t intra_blocks = heads * pl.slots, inter_blocks = io->N * io->HV * (io->V / 32);
    if (intra_blocks > INT32_MAX || inter_blocks > INT32_MAX)
        return fail(CULA_SM89_INVALID_ARGUMENT, "problem too large for one launch: split the batch");
    const size_t f = sizeof(float), per_slot = size_t(heads) * size_t(pl.slots);
    const size_t ck = per_slot * size_t(C) * size_t(io->K) * f, cv = per_slot * size_t(C) * size_t(io->V) * f;
    size_t off = 0;
    pl.w_in_ws = io->w == nullptr;
    pl.u_in_ws = io->u == nullptr;
    if (pl.w_in_ws) { pl.w = off; off = round_up(off + ck); }
    if (pl.u_in_ws) { pl.u = off; off = round_up(off + cv); }
    pl.qw = off; off = round_up(off + ck);
    pl.ou = off; off = round_up(off + cv);
    pl.kgT = off; off = round_up(off + ck);
    pl.gl = off; off = round_up(off + per_slot * size_t(io->K) * f);
    if (io->cu_seqlens != nullptr) { pl.offs = off; off = round_up(off + size_t(io->N + 1) * sizeof(int32_t)); }
    pl.bytes = off;
    return CULA_SM89_OK;
}

int check_pointers(const KdaPrefillIO* io, const Plan& pl) {
    const bool tokens = io->B * io->T > 0;
    struct In { const char* name; const float* p; const int64_t* s; };
    const In vec4[] = {{"q", io->q, io->q_stride}, {"k", io->k, io->k_stride}, {"v", io->v, io->v_stride}, {"g", io->g, io->g_stride}};
    for (const In& x : vec4) {
        if (tokens && x.p == nullptr) return fail(CULA_SM89_INVALID_ARGUMENT, std::string(x.name) + " is NULL");
        if (!aligned(x.p, 16) || !strides_multiple(x.s, 4))
            return fail(CULA_SM89_INVALID_ARGUMENT, std::string(x.name) + " must be 16-byte aligned with strides that are multiples of 4 elements");
    }
    if (tokens && (io->beta == nullptr || io->o == nullptr)) return fail(CULA_SM89_INVALID_ARGUMENT, "beta and o must not be NULL");
    if (!aligned(io->o, 8) || !strides_multiple(io->o_stride, 2))
        return fail(CULA_SM89_INVALID_ARGUMENT, "o must be 8-byte aligned with strides that are multiples of 2 elements");
    if (!aligned(io->initial_state, 8) || !aligned(io->final_state, 8))
        return fail(CULA_SM89_INVALID_ARGUMENT, "initial_state and final_state must be 8-byte aligned");
    if (!aligned(io->w, 16) || !aligned(io->u, 16)) return fail(CULA_SM89_INVALID_ARGUMENT, "w and u must be 16-byte aligned");
    if (pl.bytes > 0) {
        if (io->workspace == nullptr || io->workspace_bytes < pl.bytes)
            return fail(CULA_SM89_INVALID_ARGUMENT, "workspace too small: need " + std::to_string(pl.bytes) + " bytes, got " +
                                                       std::to_string(io->workspace == nullptr ? 0 : io->workspace_bytes));
        if (!aligned(io->workspace, kAlign)) return fail(CULA_SM89_INVALID_ARGUMENT, "workspace must be 256-byte aligned");
    }
    return CULA_SM89_OK;
}

template <int K, int C>
cudaError_t launch_all(const KdaParams& p, int tile, cudaStream_t stream, LaunchError& err) {
    cudaError_t e = cudaSuccess;
    if (p.cu_seqlens != nullptr) {
        e = cula_sm89::launch_chunk_offsets(p, C, stream, err);
        if (e != cudaSuccess) return e;
    }
    e = cula_sm89::launch_intra<K, C>(p, stream, err);
    if (e != cudaSuccess) return e;
    return cula_sm89::launch_inter<K, C>(p, tile, stream, err);
}

int run(const KdaPrefillIO* io, float* dbg_aqk, float* dbg_akk, int forced_tile, cudaStream_t stream) {
    Plan pl;
    int rc = plan(io, pl);
    if (rc != CULA_SM89_OK) return rc;
    rc = check_pointers(io, pl);
    if (rc != CULA_SM89_OK) return rc;

    char* ws = static_cast<char*>(io->workspace);
    KdaParams p;
    std::memset(&p, 0, sizeof(p));
    p.q = io->q; p.k = io->k; p.v = io->v; p.g = io->g; p.beta = io->beta;
    p.q_sb = io->q_stride[0]; p.q_st = io->q_stride[1]; p.q_sh = io->q_stride[2];
    p.k_sb = io->k_stride[0]; p.k_st = io->k_stride[1]; p.k_sh = io->k_stride[2];
    p.v_sb = io->v_stride[0]; p.v_st = io->v_stride[1]; p.v_sh = io->v_stride[2];
    p.g_sb = io->g_stride[0]; p.g_st = io->g_stride[1]; p.g_sh = io->g_stride[2];
    p.b_sb = io->beta_stride[0]; p.b_st = io->beta_stride[1]; p.b_sh = io->beta_stride[2];
    p.o_sb = io->o_stride[0]; p.o_st = io->o_stride[1]; p.o_sh = io->o_stride[2];
    p.h0 = io->initial_state;
    p.cu_seqlens = io->cu_seqlens;
    p.o = io->o;
    p.ht = io->final_state;
    p.w = pl.w_in_ws ? reinterpret_cast<float*>(ws + pl.w) : io->w;
    p.u = pl.u_in_ws ? reinterpret_cast<float*>(ws + pl.u) : io->u;
    p.qw = reinterpret_cast<float*>(ws + pl.qw);
    p.ou = reinterpret_cast<float*>(ws + pl.ou);
    p.kgT = reinterpret_cast<float*>(ws + pl.kgT);
    p.gl = reinterpret_cast<float*>(ws + pl.gl);
    p.chunk_offsets = io->cu_seqlens != nullptr ? reinterpret_cast<int32_t*>(ws + pl.offs) : nullptr;
    p.dbg_aqk = dbg_aqk;
    p.dbg_akk = dbg_akk;
    p.T = io->T;
    p.HV = io->HV;
    p.N = io->N;
    p.rows = pl.rows;
    p.slots = pl.slots;
    p.group = int32_t(io->HV / io->HQK);
    p.scale = io->scale;

    if (p.N * p.HV == 0) return CULA_SM89_OK;
    LaunchError err;
    cudaError_t e = cudaSuccess;
    const int tile = state_tile(io, forced_tile);
    switch (io->K * 1000 + pl.C) {
        case 64032: e = launch_all<64, 32>(p, tile, stream, err); break;
        case 64064: e = launch_all<64, 64>(p, tile, stream, err); break;
        case 128032: e = launch_all<128, 32>(p, tile, stream, err); break;
        case 128064: e = launch_all<128, 64>(p, tile, stream, err); break;
        default: return fail(CULA_SM89_INVALID_ARGUMENT, "unreachable configuration");
    }
    if (e != cudaSuccess) return fail(CULA_SM89_CUDA_ERROR, err.message.empty() ? cudaGetErrorString(e) : err.message);
    return CULA_SM89_OK;
}

}  // namespace

extern "C" {

CULA_SM89_API int kda_prefill_f32_abi_version(void) { return CULA_SM89_ABI_VERSION; }

CULA_SM89_API int kda_prefill_f32_chunk_size(const KdaPrefillIO* io) {
    if (io == nullptr || io->K != io->V || (io->K != 64 && io->K != 128)) return 0;
    return io->chunk_size == 0 ? default_chunk(io) : io->chunk_size;
}

CULA_SM89_API int kda_prefill_f32_chunk_slots(const KdaPrefillIO* io, int64_t* slots) {
    Plan pl;
    const int rc = plan(io, pl);
    if (rc == CULA_SM89_OK && slots != nullptr) *slots = pl.slots;
    return rc;
}

CULA_SM89_API int kda_prefill_f32_workspace_bytes(const KdaPrefillIO* io, size_t* bytes) {
    Plan pl;
    const int rc = plan(io, pl);
    if (rc == CULA_SM89_OK && bytes != nullptr) *bytes = pl.bytes;
    return rc;
}

CULA_SM89_API int kda_prefill_f32(const KdaPrefillIO* io, cudaStream_t stream) { return run(io, nullptr, nullptr, 0, stream); }

CULA_SM89_API const char* kda_prefill_f32_last_error(void) { return g_last_error.c_str(); }

// Not part of the public header: the same call that also writes the scaled causal scores Aqk and the inverse
// Akk ([R, HV, NC, C, C] each, either may be NULL) and can force the state tile (0: automatic, 16 or 32), for
// the tests of the Python binding.
CULA_SM89_API int cula_sm89_prefill_debug(const KdaPrefillIO* io, float* aqk, float* akk, int state_tile,
                                          cudaStream_t stream) {
    return run(io, aqk, akk, state_tile, stream);
}

}  // extern "C"
