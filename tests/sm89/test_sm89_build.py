"""CPU tests of the cula-sm89 build: the CUDA sources compile with nvcc for sm_89, the hatchling hook produces a
wheel holding the extension, the C library and its header (and nothing from the source tree), the public header
is valid C, and a missing nvcc is a clear error. They skip, saying so, where nvcc is absent."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "packages" / "cula-sm89"
CSRC = PKG / "csrc"
NVCC = shutil.which("nvcc") or (str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")
                                if os.environ.get("CUDA_HOME") else None)
needs_nvcc = pytest.mark.skipif(NVCC is None or not Path(NVCC).exists(),
                                reason="nvcc not found (PATH, $CUDA_HOME/bin): the CUDA build cannot be tested here")


def load_hook():
    spec = importlib.util.spec_from_file_location("cula_sm89_hatch_build", PKG / "hatch_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_nvcc
def test_kernels_compile_for_sm89(tmp_path):
    def compile_one(src):
        cmd = [NVCC, "-std=c++17", "-O3", "-gencode=arch=compute_89,code=sm_89", "-Xptxas", "-warn-spills",
               "-c", str(CSRC / src), "-o", str(tmp_path / (src + ".o"))]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = dict(zip(("kda_intra.cu", "kda_inter.cu", "kda_api.cu"),
                           pool.map(compile_one, ("kda_intra.cu", "kda_inter.cu", "kda_api.cu")), strict=True))
    for src, proc in results.items():
        assert proc.returncode == 0, f"{src}:\n{proc.stderr[-4000:]}"


@needs_nvcc
def test_public_header_is_c(tmp_path):
    src = tmp_path / "use_header.c"
    src.write_text('#include "cula_sm89.h"\n'
                   "int main(void) {\n"
                   "  KdaPrefillIO io = {0};\n"
                   "  io.K = io.V = 128;\n"
                   "  return kda_prefill_f32_chunk_size(&io) == 0;\n"
                   "}\n")
    proc = subprocess.run([NVCC, "-x", "c", "-c", f"-I{CSRC}", str(src), "-o", str(tmp_path / "use_header.o")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


@needs_nvcc
@pytest.mark.slow
def test_wheel_holds_the_built_extension_and_nothing_from_the_tree(tmp_path):
    env = dict(os.environ, CULA_SM89_ARCHS="89")  # one target: the content is what is checked, not the targets
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
                           "-w", str(tmp_path), str(PKG)], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (wheel,) = tmp_path.glob("cula_sm89-*.whl")
    assert "-cp3" in wheel.name and "linux" in wheel.name, wheel.name  # platform wheel, not py3-none-any
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert all(n.startswith(("cula_sm89/", "cula_sm89-")) for n in names), names
    assert not [n for n in names if any(p in n for p in ("csrc/", "src/", "build/", "emu/"))], names
    for required in ("cula_sm89/libcula_sm89.so", "cula_sm89/include/cula_sm89.h", "cula_sm89/ops.py",
                     "cula_sm89/backend.py", "cula_sm89/__init__.py"):
        assert required in names, f"{required} missing from {names}"
    assert [n for n in names if n.startswith("cula_sm89/_C.") and n.endswith(".so")], names
    if shutil.which("readelf"):
        out = tmp_path / "x"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(out)
        for so in (out / "cula_sm89").glob("*.so"):
            dyn = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True).stdout
            runpath = [line for line in dyn.splitlines() if "RUNPATH" in line or "RPATH" in line]
            assert runpath and all("$ORIGIN" in line and str(PKG) not in line for line in runpath), dyn
            assert "libtorch" not in dyn and "libc10" not in dyn, dyn  # no torch ABI dependency


def test_missing_nvcc_is_a_clear_build_error(monkeypatch, tmp_path):
    hook = load_hook()
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvcc anywhere
    with pytest.raises(hook.CudaBuildError, match=r"nvcc \(the CUDA compiler\) was not found"):
        hook.find_nvcc()


def test_cuda_home_is_looked_at_first(monkeypatch, tmp_path):
    hook = load_hook()
    fake = tmp_path / "bin" / "nvcc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert hook.find_nvcc() == str(fake)


def test_gencode_targets():
    hook = load_hook()
    flags = hook.gencode_flags(hook.DEFAULT_ARCHS)
    assert flags == ["-gencode=arch=compute_89,code=sm_89", "-gencode=arch=compute_90,code=sm_90",
                     "-gencode=arch=compute_89,code=compute_89"]
    with pytest.raises(hook.CudaBuildError):
        hook.gencode_flags("80")
