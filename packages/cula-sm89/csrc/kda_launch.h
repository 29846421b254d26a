// kda_launch.h: host-side declarations shared by the kernel files and the C ABI (kda_api.cu): the kernel
// launchers (one explicit instantiation per served (K, C)), the checked dynamic-shared-memory opt-in and
// the launch-error check.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>
#include <string>

#include "kda_common.cuh"

namespace cula_sm89 {

// Where a failed CUDA call leaves its message for kda_prefill_f32_last_error().
struct LaunchError {
    std::string message;
};

template <int K, int C>
inline std::string kernel_name(const char* base) {
    return std::string(base) + "<K=" + std::to_string(K) + ",V=" + std::to_string(K) + ",C=" + std::to_string(C) + ">";
}

// Raises the kernel's dynamic shared-memory limit to `bytes` on the current device (needed above 48 KiB, harmless
// below), once per device: `done` holds a bit per device index already set (so a CUDA-graph capture after the
// first call makes no attribute call). On failure the message names the kernel, the bytes asked for and the
// device's per-block limit.
inline cudaError_t set_dynamic_smem(const void* kernel, size_t bytes, const std::string& name, std::atomic<uint64_t>& done,
                                    LaunchError& err) {
    int device = -1;
    cudaError_t e = cudaGetDevice(&device);
    if (e != cudaSuccess) {
        err.message = name + ": cudaGetDevice failed: " + cudaGetErrorString(e);
        return e;
    }
    const uint64_t bit = device < 64 ? (uint64_t(1) << device) : 0;
    if (bit != 0 && (done.load(std::memory_order_acquire) & bit)) return cudaSuccess;
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (e == cudaSuccess) {
        done.fetch_or(bit, std::memory_order_release);
        return e;
    }
    int limit = -1;
    cudaGetLastError();  // the failed attribute call leaves a (non-sticky) error behind
    if (cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
        cudaGetLastError();
        limit = -1;
    }
    err.message = name + ": cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize, " + std::to_string(bytes) +
                  " bytes) failed: " + cudaGetErrorString(e) + " (device " + std::to_string(device) +
                  " allows at most " + std::to_string(limit) + " bytes of shared memory per block)";
    return e;
}

inline cudaError_t check_launch(const std::string& name, LaunchError& err) {
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) err.message = name + ": launch failed: " + cudaGetErrorString(e);
    return e;
}

template <int K, int C>
cudaError_t launch_intra(const KdaParams& p, cudaStream_t stream, LaunchError& err);
// state_tile: the columns of the state per block, 32 (8 warps) or 16 (4 warps; see kda_inter.cu).
template <int K, int C>
cudaError_t launch_inter(const KdaParams& p, int state_tile, cudaStream_t stream, LaunchError& err);
cudaError_t launch_chunk_offsets(const KdaParams& p, int C, cudaStream_t stream, LaunchError& err);

}  // namespace cula_sm89
