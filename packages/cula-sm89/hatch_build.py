"""Hatchling build hook of cula-sm89: compiles the CUDA C++ sources in csrc/ with nvcc.

It builds, for every wheel (regular and editable):
  libcula_sm89.so          the kernels and the C ABI (csrc/cula_sm89.h), linked against libcudart.so
  _C<EXT_SUFFIX>           the pybind11 module, linked against libcula_sm89.so only (RUNPATH $ORIGIN)
and ships them in the package with the header (cula_sm89/include/cula_sm89.h). A regular wheel gets them from
a build folder (build/cuda-*, git-ignored) through force-include; an editable install writes them into
src/cula_sm89/ (git-ignored), where the source package imports them. An editable rebuild is skipped when the
outputs are newer than every source and were built with the same flags.

Environment:
  CUDA_HOME / CUDA_PATH   where nvcc is looked for first ($CUDA_HOME/bin/nvcc), then PATH
  CULA_SM89_ARCHS         SASS targets, ';'-separated (default "89;90"); PTX is added for the lowest one, so
                          the wheel also runs (JIT-compiled) on later GPUs
  CULA_SM89_NVCC_FLAGS    extra nvcc flags (e.g. "-lineinfo" for compute-sanitizer line numbers)
  CULA_SM89_JOBS          parallel compiler processes (default: the CPU count)
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
PACKAGE = ROOT / "src" / "cula_sm89"
KERNEL_SOURCES = ("kda_intra.cu", "kda_inter.cu", "kda_api.cu")
BINDING_SOURCE = "bindings.cpp"
HEADER = "cula_sm89.h"
LIBRARY = "libcula_sm89.so"
DEFAULT_ARCHS = "89;90"
# Where pip's CUDA runtime wheels put libcudart next to this package (site-packages/nvidia/...), for processes
# that load the library before torch has loaded its own libcudart.
CUDART_RUNPATH = "$ORIGIN:$ORIGIN/../nvidia/cu13/lib:$ORIGIN/../nvidia/cuda_runtime/lib"


class CudaBuildError(RuntimeError):
    pass


def find_nvcc() -> str:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            candidate = Path(home) / "bin" / "nvcc"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    found = shutil.which("nvcc")
    if found:
        return found
    raise CudaBuildError(
        "cula-sm89: nvcc (the CUDA compiler) was not found: looked for $CUDA_HOME/bin/nvcc, $CUDA_PATH/bin/nvcc "
        "and nvcc on PATH. Install the CUDA toolkit (tested with 13.0) and set CUDA_HOME, or install cula without "
        "the [sm89] extra."
    )


def gencode_flags(archs: str) -> list[str]:
    values = sorted({int(a) for a in archs.replace(",", ";").split(";") if a.strip()})
    if not values or min(values) < 89:
        raise CudaBuildError(f"cula-sm89: CULA_SM89_ARCHS must name compute capabilities >= 89, got {archs!r}")
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in values]
    flags.append(f"-gencode=arch=compute_{values[0]},code=compute_{values[0]}")
    return flags


def pybind11_includes() -> list[str]:
    try:
        import pybind11
    except ImportError as exc:
        raise CudaBuildError("cula-sm89: the build needs pybind11 (pip install pybind11)") from exc
    paths = [pybind11.get_include(), sysconfig.get_paths()["include"]]
    return [f"-I{p}" for p in dict.fromkeys(paths)]


class CudaBuildHook(BuildHookInterface):
    PLUGIN_NAME = "cula-sm89-cuda"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return
        editable = version == "editable"
        nvcc = find_nvcc()
        common = ["-O3", "-DNDEBUG", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
                  "--threads", "0", f"-I{CSRC}"]
        common += shlex.split(os.environ.get("CULA_SM89_NVCC_FLAGS", ""))
        device = gencode_flags(os.environ.get("CULA_SM89_ARCHS", DEFAULT_ARCHS))
        includes = pybind11_includes()
        ext_name = "_C" + sysconfig.get_config_var("EXT_SUFFIX")
        config = repr((nvcc, common, device, includes, ext_name, sys.version))
        digest = hashlib.sha256(config.encode()).hexdigest()[:12]
        build_dir = ROOT / "build" / f"cuda-{digest}"
        out_dir = PACKAGE if editable else build_dir
        lib, ext = out_dir / LIBRARY, out_dir / ext_name
        stamp = out_dir / ".cula_sm89_build" if editable else build_dir / "stamp"

        sources = [CSRC / s for s in os.listdir(CSRC)] + [Path(__file__)]
        newest = max(p.stat().st_mtime for p in sources)
        fresh = (lib.is_file() and ext.is_file() and stamp.is_file() and stamp.read_text() == config
                 and min(lib.stat().st_mtime, ext.stat().st_mtime) >= newest)
        if fresh:
            self.app.display_info(f"cula-sm89: CUDA build up to date ({out_dir})")
        else:
            self._build(nvcc, common, device, includes, build_dir, lib, ext)
            stamp.write_text(config)

        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if not editable:
            force = build_data.setdefault("force_include", {})
            force[str(lib)] = f"cula_sm89/{LIBRARY}"
            force[str(ext)] = f"cula_sm89/{ext_name}"
            force[str(CSRC / HEADER)] = f"cula_sm89/include/{HEADER}"

    def _run(self, cmd: list[str]) -> None:
        self.app.display_info("  " + " ".join(shlex.quote(c) for c in cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CudaBuildError(f"cula-sm89: command failed ({proc.returncode}):\n{' '.join(cmd)}\n"
                                 f"{proc.stdout[-8000:]}\n{proc.stderr[-8000:]}")

    def _build(self, nvcc, common, device, includes, build_dir: Path, lib: Path, ext: Path) -> None:
        build_dir.mkdir(parents=True, exist_ok=True)
        lib.parent.mkdir(parents=True, exist_ok=True)
        self.app.display_info(f"cula-sm89: compiling the CUDA sources with {nvcc} ({' '.join(device)})")
        jobs = []
        for src in KERNEL_SOURCES:
            jobs.append([nvcc, *common, *device, "-c", str(CSRC / src), "-o", str(build_dir / (src + ".o"))])
        jobs.append([nvcc, *common, *includes, "-c", str(CSRC / BINDING_SOURCE), "-o",
                     str(build_dir / (BINDING_SOURCE + ".o"))])
        workers = int(os.environ.get("CULA_SM89_JOBS", 0)) or os.cpu_count() or 2
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for future in [pool.submit(self._run, cmd) for cmd in jobs]:
                future.result()
        tmp_lib = build_dir / LIBRARY
        self._run([nvcc, "-shared", *device, "--cudart", "shared", "-o", str(tmp_lib),
                   *(str(build_dir / (s + ".o")) for s in KERNEL_SOURCES),
                   f"-Xlinker=-soname={LIBRARY}", f"-Xlinker=-rpath={CUDART_RUNPATH}"])
        tmp_ext = build_dir / ext.name
        self._run([nvcc, "-shared", "--cudart", "none", "-o", str(tmp_ext), str(build_dir / (BINDING_SOURCE + ".o")),
                   f"-L{build_dir}", "-lcula_sm89", "-Xlinker=-rpath=$ORIGIN"])
        if lib != tmp_lib:
            shutil.copy2(tmp_lib, lib)
            shutil.copy2(tmp_ext, ext)
