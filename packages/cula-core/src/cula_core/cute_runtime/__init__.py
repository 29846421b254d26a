"""One runtime for cula's CuTe DSL kernels (cula-sm90 and cula-sm100): loading, launching, argument conversion,
chunk tables.

Why it lives in cula_core. Both arch packages depend on cula_core already and must not import each other; a
runtime in core needs no extra wheel and keeps the import graph a tree (arch package -> core). Core stays pure
Python and cheap to import: this package imports neither CuTe DSL nor apache-tvm-ffi at import time; the DSL is
imported only to compile (a configuration with no prebuilt artifact, or the wheel's build step), tvm_ffi only
when the first kernel is loaded.

The path a kernel takes (all through CuTe DSL's supported export and TVM-FFI ABI, no private DSL attribute):

    compile   cute.compile(kernel, *fake args, options="--enable-tvm-ffi") for the package's arch
    export    compiled.export_to_c(<id>.o, function_name=<symbol>)   (an object file: host code + cubin)
    link      cc -shared: the objects of one wheel into one library, or one cached kernel into its own, against
              libcute_dsl_runtime and libtvm_ffi (cutlass.cute.export.aot_config's flags)
    load      tvm_ffi.load_module(library)[symbol]: a tvm_ffi.Function; without a C compiler the cached object is
              loaded through cutlass.runtime.load_module(<id>.o, enable_tvm_ffi=True) instead
    launch    function(addresses..., ints..., floats..., stream): pointers travel as integer addresses, the
              stream as its raw handle (`current_stream`)

`get(name, config)` resolves a (kernel name, compile-time configuration) to its function: the artifact shipped in
the arch wheel (`<package>/_aot/`, built by the wheel's build hook from the package's `aot_configurations()`),
else the disk cache (`CULA_CACHE_DIR`, default ~/.cache/cula; keyed by DSL version, arch, package version and a
hash of the kernel's source files), else a just-in-time compile that fills the cache (and says so once per
process, `JitCompileWarning`). `listing()` tells what is shipped and cached (`cula info`, the kernel report).
"""

from cula_core.cute_runtime.chunks import chunk_offsets, chunk_table, sequence_bounds, sequence_table
from cula_core.cute_runtime.convert import (aligned16, current_stream, data_ptr, device_int32, dsl_dtype, fake_ptr,
                                           fake_stream, sm_count)
from cula_core.cute_runtime.registry import (
    Artifact,
    JitCompileWarning,
    KernelDef,
    artifact_id,
    build_objects,
    cache_dir,
    compile_kernel,
    get,
    kernel_def,
    link_library,
    listing,
    loaded,
    register,
    reset,
    resolve,
    write_manifest,
)

__all__ = [
    "Artifact",
    "JitCompileWarning",
    "KernelDef",
    "aligned16",
    "artifact_id",
    "build_objects",
    "cache_dir",
    "chunk_offsets",
    "chunk_table",
    "compile_kernel",
    "current_stream",
    "data_ptr",
    "device_int32",
    "dsl_dtype",
    "fake_ptr",
    "fake_stream",
    "get",
    "kernel_def",
    "link_library",
    "listing",
    "loaded",
    "register",
    "reset",
    "resolve",
    "sequence_bounds",
    "sequence_table",
    "sm_count",
    "write_manifest",
]
