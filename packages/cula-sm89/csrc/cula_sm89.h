/* cula_sm89.h: the C ABI of cula-sm89, the fp32 KDA (Kimi Delta Attention) prefill for Ada (sm_89) and
 * newer NVIDIA GPUs. Link against libcula_sm89.so (shipped in the cula-sm89 wheel next to this header,
 * `python -c "import cula_sm89; print(cula_sm89.library_path())"`) and the CUDA runtime (libcudart.so.13).
 *
 * The computation, per sequence n and value head hv (q/k head h = hv / (HV / HQK)), state S [K, V] fp32:
 *     S   = diag(exp(g_t)) S
 *     S   = S + beta_t * k_t (v_t - S^T k_t)^T
 *     o_t = S^T (scale * q_t)
 * Inputs are final: q/k already L2-normalised if wanted, g the per-channel log decay (<= 0), beta already
 * activated. Everything is float32; the matrix products run on tensor cores in 3xTF32 (split-precision)
 * form, so the result is fp32-accurate (relative error ~1e-6), not tf32-accurate.
 *
 * Layouts (FLA's): q, k [B, T, HQK, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; o [B, T, HV, V];
 * given through a base pointer and the element strides of the batch, token and head dimensions (the last
 * dimension must be contiguous). Varlen: cu_seqlens [N + 1] int32 on the device, B == 1, sequence n spans
 * tokens [cu_seqlens[n], cu_seqlens[n + 1]). States are [N, HV, K, V] contiguous (N = B without varlen).
 *
 * Supported: K == V in {64, 128}, chunk_size in {32, 64} (0 picks the library's default, 32: faster on every
 * shape measured on an H100, see docs/sm89.md).
 * Alignment: q, k, v, g must be 16-byte aligned with strides that are multiples of 4 elements; o, the states,
 * w and u 8-byte aligned with o's strides multiples of 2; workspace 256-byte aligned.
 *
 * Intra-chunk buffers: w [R, HV, NC, C, K] and u [R, HV, NC, C, V] (C = chunk size), R = B and
 * NC = ceil(T / C) without varlen; R = 1 and NC = ceil(T / C) + N with varlen (chunk c of sequence n is at
 * index chunk_offset(n) + c, chunk_offset(n) = sum over m < n of ceil(len_m / C); the last slots are unused).
 * Pass NULL for w / u to keep them inside the workspace. Padded rows of a sequence's last chunk are zero.
 *
 * Every call is asynchronous on `stream`, captures into CUDA graphs and never synchronises the host.
 */
#ifndef CULA_SM89_H
#define CULA_SM89_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CULA_SM89_ABI_VERSION 1

#if defined(_WIN32)
#define CULA_SM89_API
#else
#define CULA_SM89_API __attribute__((visibility("default")))
#endif

/* Return codes. */
#define CULA_SM89_OK 0
#define CULA_SM89_INVALID_ARGUMENT 1 /* a size, pointer, alignment or workspace size is not served */
#define CULA_SM89_CUDA_ERROR 2       /* a CUDA runtime call failed */

typedef struct KdaPrefillIO {
    /* sizes */
    int64_t B, T, HQK, HV, K, V;
    int64_t N;          /* number of sequences: B, or (entries of cu_seqlens) - 1 with varlen */
    int32_t chunk_size; /* 32 or 64; 0: the library's default (32) */
    float scale;        /* multiplies q (FLA's default is K ** -0.5) */

    /* inputs (device pointers, float32); strides in elements for the (batch, token, head) dimensions */
    const float* q;
    int64_t q_stride[3];
    const float* k;
    int64_t k_stride[3];
    const float* v;
    int64_t v_stride[3];
    const float* g;
    int64_t g_stride[3];
    const float* beta;
    int64_t beta_stride[3];
    const float* initial_state; /* [N, HV, K, V] contiguous, or NULL for a zero state */
    const int32_t* cu_seqlens;  /* [N + 1], or NULL */

    /* outputs */
    float* o;
    int64_t o_stride[3];
    float* final_state; /* [N, HV, K, V] contiguous, or NULL */
    float* w;           /* [R, HV, NC, C, K], or NULL: kept in the workspace */
    float* u;           /* [R, HV, NC, C, V], or NULL: kept in the workspace */

    /* scratch: at least kda_prefill_f32_workspace_bytes(io) bytes of device memory */
    void* workspace;
    size_t workspace_bytes;
} KdaPrefillIO;

/* The ABI version this library was built with (CULA_SM89_ABI_VERSION). */
CULA_SM89_API int kda_prefill_f32_abi_version(void);

/* The chunk size a call with io->chunk_size would use (resolves 0), or 0 if K is not served. */
CULA_SM89_API int kda_prefill_f32_chunk_size(const KdaPrefillIO* io);

/* NC, the number of chunk slots per (row, head) of w and u (see above). */
CULA_SM89_API int kda_prefill_f32_chunk_slots(const KdaPrefillIO* io, int64_t* slots);

/* Bytes of workspace the call needs (depends on whether io->w and io->u are NULL). */
CULA_SM89_API int kda_prefill_f32_workspace_bytes(const KdaPrefillIO* io, size_t* bytes);

/* Runs the prefill on `stream`: writes o, final_state (if not NULL), w and u. */
CULA_SM89_API int kda_prefill_f32(const KdaPrefillIO* io, cudaStream_t stream);

/* The message of the last failed call on this thread ("" if none). */
CULA_SM89_API const char* kda_prefill_f32_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* CULA_SM89_H */
