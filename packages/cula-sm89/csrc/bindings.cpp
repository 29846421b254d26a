// bindings.cpp: the pybind11 module cula_sm89._C, a thin layer over the C ABI of libcula_sm89.so (cula_sm89.h).
// It takes raw device pointers (ints), element strides and the CUDA stream handle from Python, so it is
// independent of any torch version's C++ ABI and links against libcula_sm89.so only.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cula_sm89.h"

extern "C" int cula_sm89_prefill_debug(const KdaPrefillIO* io, float* aqk, float* akk, int state_tile,
                                       cudaStream_t stream);

namespace py = pybind11;

namespace {

using Strides = std::array<int64_t, 3>;

void check(int rc) {
    if (rc == CULA_SM89_OK) return;
    const std::string what = kda_prefill_f32_last_error();
    if (rc == CULA_SM89_INVALID_ARGUMENT) throw py::value_error(what);
    throw std::runtime_error(what);
}

template <class T>
uintptr_t addr(T* p) { return reinterpret_cast<uintptr_t>(p); }

Strides get3(const int64_t (&s)[3]) { return {s[0], s[1], s[2]}; }
void set3(int64_t (&s)[3], const Strides& v) { std::memcpy(s, v.data(), sizeof(s)); }

}  // namespace

#define PTR_FIELD(name, type)                                                              \
    def_property(                                                                          \
        #name, [](const KdaPrefillIO& io) { return addr(io.name); },                      \
        [](KdaPrefillIO& io, uintptr_t p) { io.name = reinterpret_cast<type>(p); })
#define STRIDE_FIELD(name)                                                                 \
    def_property(                                                                          \
        #name, [](const KdaPrefillIO& io) { return get3(io.name); },                      \
        [](KdaPrefillIO& io, const Strides& s) { set3(io.name, s); })

PYBIND11_MODULE(_C, m) {
    m.doc() = "cula-sm89: the fp32 KDA prefill kernels (pybind11 layer over the C ABI of libcula_sm89.so)";
    m.attr("ABI_VERSION") = kda_prefill_f32_abi_version();

    py::class_<KdaPrefillIO>(m, "KdaPrefillIO", "The C struct KdaPrefillIO of cula_sm89.h; pointers are ints.")
        .def(py::init([]() {
            KdaPrefillIO io;
            std::memset(&io, 0, sizeof(io));
            return io;
        }))
        .def_readwrite("B", &KdaPrefillIO::B)
        .def_readwrite("T", &KdaPrefillIO::T)
        .def_readwrite("HQK", &KdaPrefillIO::HQK)
        .def_readwrite("HV", &KdaPrefillIO::HV)
        .def_readwrite("K", &KdaPrefillIO::K)
        .def_readwrite("V", &KdaPrefillIO::V)
        .def_readwrite("N", &KdaPrefillIO::N)
        .def_readwrite("chunk_size", &KdaPrefillIO::chunk_size)
        .def_readwrite("scale", &KdaPrefillIO::scale)
        .PTR_FIELD(q, const float*)
        .STRIDE_FIELD(q_stride)
        .PTR_FIELD(k, const float*)
        .STRIDE_FIELD(k_stride)
        .PTR_FIELD(v, const float*)
        .STRIDE_FIELD(v_stride)
        .PTR_FIELD(g, const float*)
        .STRIDE_FIELD(g_stride)
        .PTR_FIELD(beta, const float*)
        .STRIDE_FIELD(beta_stride)
        .PTR_FIELD(initial_state, const float*)
        .PTR_FIELD(cu_seqlens, const int32_t*)
        .PTR_FIELD(o, float*)
        .STRIDE_FIELD(o_stride)
        .PTR_FIELD(final_state, float*)
        .PTR_FIELD(w, float*)
        .PTR_FIELD(u, float*)
        .PTR_FIELD(workspace, void*)
        .def_readwrite("workspace_bytes", &KdaPrefillIO::workspace_bytes);

    m.def("chunk_size", [](const KdaPrefillIO& io) { return kda_prefill_f32_chunk_size(&io); },
          "The chunk size the call would use (resolves chunk_size=0), 0 if K is not served.");
    m.def(
        "chunk_slots",
        [](const KdaPrefillIO& io) {
            int64_t slots = 0;
            check(kda_prefill_f32_chunk_slots(&io, &slots));
            return slots;
        },
        "NC: chunk slots per (row, head) of w and u.");
    m.def(
        "workspace_bytes",
        [](const KdaPrefillIO& io) {
            size_t bytes = 0;
            check(kda_prefill_f32_workspace_bytes(&io, &bytes));
            return bytes;
        },
        "Bytes of device workspace the call needs.");
    m.def(
        "run",
        [](const KdaPrefillIO& io, uintptr_t stream, uintptr_t aqk, uintptr_t akk, int state_tile) {
            int rc;
            {
                py::gil_scoped_release nogil;
                rc = cula_sm89_prefill_debug(&io, reinterpret_cast<float*>(aqk), reinterpret_cast<float*>(akk),
                                             state_tile, reinterpret_cast<cudaStream_t>(stream));
            }
            check(rc);
        },
        py::arg("io"), py::arg("stream"), py::arg("aqk") = 0, py::arg("akk") = 0, py::arg("state_tile") = 0,
        "Launch the prefill on `stream` (a cudaStream_t as int). aqk / akk: optional device buffers [R, HV, NC, C, C] "
        "that receive the scaled causal scores and (I + L)^-1; state_tile: 0 (automatic), 16 or 32 columns of the "
        "state per inter-chunk block (tests).");
}
