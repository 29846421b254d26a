// kda_launch.h: host-side declarations shared by the kernel files and the C ABI (kda_api.cu): the kernel
// launchers (one explicit instantiation per served (K, C)), the checked dynamic-shared-memory opt-in and
// the launch-error check.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <cstdio>
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

// Raises the kernel's dynamic shared-memory limit to `bytes` (needed above 48 KiB, harmless below): on failure
// the message names the kernel, the bytes asked for and the device's per-block limit.
inline cudaError_t set_dynamic_smem(const void* kernel, size_t bytes, const std::string& name, LaunchError& err) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (e == cudaSuccess) return e;
    int device = -1, limit = -1;
    cudaGetLastError();  // clear the sticky-free error of the failed attribute call
    if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
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
template <int K, int C>
cudaError_t launch_inter(const KdaParams& p, cudaStream_t stream, LaunchError& err);
cudaError_t launch_chunk_offsets(const KdaParams& p, int C, cudaStream_t stream, LaunchError& err);

}  // namespace cula_sm89
