"""The kernel registry: (kernel name, compile-time configuration) -> a loaded TVM-FFI function.

An arch package registers each of its kernels once (`register(KernelDef(...))`, at import of its launch module):
the name, the wheel that ships it, the arch it is compiled for, a `build(config)` giving the @cute.jit callable and
its compile-time arguments for a configuration, and the modules whose source defines the kernel. A configuration
is a tuple of str / int / float / bool / None / torch.dtype / nested tuples (what changes the code: head dims,
dtypes, gate mode, tiling ...); runtime sizes are never part of it.

Artifacts. An artifact is identified by `artifact_id(name, config)` (the name and a hash of the configuration)
and holds the exported function under `symbol(artifact_id)`. Shipped artifacts: `<package>/_aot/manifest.json`
(DSL version, arch, package version, and per artifact its name, configuration and source hash) beside one linked
library `kernels.so`. Cached artifacts: `<cache_dir>/cutedsl-<DSL version>/<arch>/<dist>-<version>/<source hash>/`
`<artifact id>.so` (or `.o` where no C compiler was found), with a `.json` sidecar naming the configuration. A
shipped artifact is used only when its manifest's DSL version and package version and its kernel's source hash
match what is installed now; otherwise the kernel is compiled just in time.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: folder of an arch package that holds its shipped artifacts
AOT_FOLDER = "_aot"
MANIFEST = "manifest.json"
LIBRARY = "kernels.so"
MANIFEST_FORMAT = 1


class JitCompileWarning(UserWarning):
    """Issued once per process, at the first kernel compiled just in time (no shipped or cached artifact)."""


@dataclass(frozen=True)
class KernelDef:
    """One kernel of an arch package.

    name: unique, dotted ("sm90.decode.recurrent"); distribution: the wheel shipping it ("cula-sm90"); package:
    its import package ("cula_sm90", where `_aot/` lives); arch: the compile target ("sm_90a"); build: config ->
    (the @cute.jit callable, its compile-time arguments, as `cute.compile` takes them); sources: modules whose
    source text defines the kernel (their hash keys the cache and validates shipped artifacts)."""

    name: str
    distribution: str
    package: str
    arch: str
    build: Callable[[tuple], tuple[Any, tuple]]
    sources: tuple[str, ...]


@dataclass(frozen=True)
class Artifact:
    """Where a (kernel, configuration) is found: origin "shipped" (in the wheel) or "cached" (compiled before, on
    disk); path of the library or object holding `symbol`."""

    name: str
    config: str
    origin: str
    path: str
    symbol: str


_DEFS: dict[str, KernelDef] = {}
_LOADED: dict[tuple, Any] = {}
_LOCK = threading.RLock()
_warned = False


def register(kdef: KernelDef) -> KernelDef:
    """Register (or re-register, e.g. on a module reload) a kernel definition under its name."""
    _DEFS[kdef.name] = kdef
    return kdef


def kernel_def(name: str) -> KernelDef:
    try:
        return _DEFS[name]
    except KeyError:
        raise KeyError(f"no CuTe DSL kernel registered as {name!r} (registered: {', '.join(sorted(_DEFS))})") \
            from None


# ------------------------------------------------------------------------------------------ identities and keys

def _canon(value):
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_canon(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a kernel configuration holds str, int, float, bool, None, torch.dtype and tuples of them, "
                    f"got {type(value).__name__}: {value!r}")


def config_text(config: tuple) -> str:
    """The canonical text of a configuration (what its hash is taken of)."""
    return json.dumps(_canon(config), separators=(",", ":"))


def artifact_id(name: str, config: tuple) -> str:
    return f"{name}-{hashlib.sha256(config_text(config).encode()).hexdigest()[:16]}"


def symbol(aid: str) -> str:
    """The exported function's name: a C identifier made of the artifact id."""
    return "cula_" + re.sub(r"[^A-Za-z0-9]", "_", aid)


def dsl_version() -> str:
    return importlib.metadata.version("nvidia-cutlass-dsl")


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


@functools.cache
def source_hash(name: str) -> str:
    """sha256 over the source text of the kernel's `sources` modules (read, not imported)."""
    h = hashlib.sha256()
    for module in kernel_def(name).sources:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"kernel {name}: source module {module} not found")
        h.update(module.encode() + b"\0" + Path(spec.origin).read_bytes() + b"\0")
    return h.hexdigest()


def cache_dir() -> Path:
    """Root of the JIT disk cache: $CULA_CACHE_DIR, else ~/.cache/cula."""
    return Path(os.environ.get("CULA_CACHE_DIR") or Path.home() / ".cache" / "cula")


def _cache_folder(kdef: KernelDef) -> Path:
    return (cache_dir() / f"cutedsl-{dsl_version()}" / kdef.arch / f"{kdef.distribution}-"
            f"{_dist_version(kdef.distribution)}" / source_hash(kdef.name)[:16])


# ------------------------------------------------------------------------------------------ shipped artifacts

def package_dir(package: str) -> Path | None:
    """The folder of installed import package `package`, or None."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _manifest(package: str) -> dict | None:
    """The package's shipped manifest, or None (none shipped, or built for another DSL / package version)."""
    return _manifests().get(package)


@functools.cache
def _manifests() -> dict[str, dict]:
    found = {}
    for package in arch_packages():
        root = package_dir(package)
        path = root / AOT_FOLDER / MANIFEST if root is not None else None
        if path is None or not path.is_file():
            continue
        data = json.loads(path.read_text())
        data["_dir"] = str(path.parent)
        data["_current"] = (data.get("format") == MANIFEST_FORMAT and data.get("dsl_version") == dsl_version()
                            and data.get("version") == _dist_version(data.get("distribution", "")))
        found[package] = data
    return found


def arch_packages() -> list[str]:
    """Import packages of the installed backends (entry points of `cula.backends`) and of registered kernels."""
    names = {kdef.package for kdef in _DEFS.values()}
    for ep in importlib.metadata.entry_points(group="cula.backends"):
        names.add(ep.value.split(":")[0].split(".")[0])
    return sorted(names)


def _shipped(kdef: KernelDef, aid: str) -> Artifact | None:
    manifest = _manifest(kdef.package)
    if manifest is None or not manifest["_current"]:
        return None
    entry = manifest["kernels"].get(aid)
    if entry is None or entry["source_hash"] != source_hash(kdef.name):
        return None
    return Artifact(kdef.name, entry["config"], "shipped", str(Path(manifest["_dir"]) / manifest["library"]),
                    entry["symbol"])


def _cached(kdef: KernelDef, aid: str, config: tuple) -> Artifact | None:
    folder = _cache_folder(kdef)
    for suffix in (".so", ".o"):
        path = folder / (aid + suffix)
        if path.is_file():
            return Artifact(kdef.name, config_text(config), "cached", str(path), symbol(aid))
    return None


def resolve(name: str, config: tuple) -> Artifact | None:
    """Where (name, config) would be loaded from now, without loading or compiling: the shipped artifact, else
    the cached one, else None (a call would compile it)."""
    kdef = kernel_def(name)
    aid = artifact_id(name, config)
    return _shipped(kdef, aid) or _cached(kdef, aid, config)


def listing() -> list[Artifact]:
    """Every artifact the installed wheels ship (origin "shipped"; "stale" when built for another DSL or package
    version) and every one in the disk cache for this DSL version (origin "cached")."""
    out = []
    for manifest in _manifests().values():
        origin = "shipped" if manifest["_current"] else "stale"
        lib = str(Path(manifest["_dir"]) / manifest["library"])
        out.extend(Artifact(e["name"], e["config"], origin, lib, e["symbol"]) for e in manifest["kernels"].values())
    root = cache_dir() / f"cutedsl-{dsl_version()}"
    if root.is_dir():
        for side in sorted(root.glob("*/*/*/*.json")):
            meta = json.loads(side.read_text())
            out.append(Artifact(meta["name"], meta["config"], "cached", str(side.with_suffix(meta["suffix"])),
                                meta["symbol"]))
    return out


# ------------------------------------------------------------------------------------------ compiling and linking

def compile_kernel(name: str, config: tuple):
    """The DSL's compiled function (TVM-FFI ABI) of (name, config), compiled now for the kernel's arch (no GPU
    needed). The tools that read a kernel's cubin / PTX use this; launches go through `get`."""
    import cutlass.cute as cute

    kdef = kernel_def(name)
    kernel, args = kdef.build(config)
    # the arch as a compile option also reaches the trace: arch-specific atoms (wgmma) check it there, and the
    # environment (CUTE_DSL_ARCH, the GPU present) may name another
    return cute.compile[cute.GPUArch(kdef.arch)](kernel, *args, options=f"--enable-tvm-ffi --gpu-arch {kdef.arch}")


def _export_object(name: str, config: tuple, path: Path) -> None:
    compiled = compile_kernel(name, config)
    compiled.export_to_c(str(path), function_name=symbol(artifact_id(name, config)),
                         export_only_tvm_ffi_symbols=True)


def _link_flags() -> list[str]:
    import tvm_ffi
    from cutlass.cute.export.aot_config import get_ldflags, get_libs

    tvm_dir = os.path.dirname(tvm_ffi.libinfo.find_libtvm_ffi())
    return [*shlex.split(get_ldflags()), f"-L{tvm_dir}", *shlex.split(get_libs(enable_tvm_ffi=True))]


def find_compiler(variable: str, names: Sequence[str]) -> str | None:
    """The compiler command in environment variable `variable` (CC, CXX), else the first of `names` on PATH, else
    None."""
    return os.environ.get(variable) or next((c for c in names if shutil.which(c)), None)


def build_file(out: Path | str, command: Callable[[Path], list[str]], what: str) -> Path:
    """Run the compiler command `command(tmp)`, which writes the file `tmp`, and move it onto `out` (atomic: a
    concurrent reader never sees a partial file). RuntimeError naming `what` (e.g. "linking"), the command and the
    compiler's output when it fails. Returns `out`."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = command(tmp)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} {out.name} failed ({shlex.join(cmd)}):\n{proc.stderr}")
    os.replace(tmp, out)
    return out


def link_library(objects: Iterable[Path | str], out: Path | str) -> None:
    """Link exported objects into one shared library (the C compiler of $CC or PATH), written atomically."""
    cc = find_compiler("CC", ("cc", "gcc", "clang", "c++", "g++"))
    if cc is None:
        raise RuntimeError("no C compiler found to link CuTe DSL objects (set CC, or install cc / gcc / clang)")
    build_file(out, lambda tmp: [*shlex.split(cc), "-shared", "-o", str(tmp), *map(str, objects), *_link_flags()],
               "linking")


def export_one(module: str, name: str, config: tuple, out_dir: Path | str) -> Path:
    """Import `module` (which registers kernel `name` in this process), then compile and export (name, config) to
    `<out_dir>/<artifact id>.o`. Returns that path."""
    importlib.import_module(module)
    path = Path(out_dir) / (artifact_id(name, config) + ".o")
    _export_object(name, config, path)
    return path


def build_objects(items: list[tuple[str, tuple]], out_dir: Path | str, *, jobs: int = 1,
                  progress: Callable[[int, int], None] | None = None) -> list[Path]:
    """Compile and export every (name, config) of `items` to `<out_dir>/<artifact id>.o`; returns the object paths
    in the order of `items`.

    jobs 1: in this process (kernels registered only here, e.g. by a test, are found). jobs > 1: that many worker
    interpreters (`python -m cula_core.cute_runtime.aot_worker`, this process's sys.path), each compiling one
    configuration at a time on one core and handed the next one as soon as it is done, so a slow configuration
    never holds up a fixed share of the others; peak memory is `jobs` compiler processes. The first failure stops
    the other workers and raises RuntimeError with the failing configuration and the worker's error output.
    `progress(done, total)` is called after each configuration."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = [(kernel_def(n).build.__module__, n, c, str(out_dir)) for n, c in items]
    paths = [out_dir / (artifact_id(n, c) + ".o") for n, c in items]
    jobs = max(1, min(jobs, len(work)))
    if jobs == 1:
        for done, job in enumerate(work, 1):
            export_one(*job)
            if progress:
                progress(done, len(work))
        return paths
    with tempfile.TemporaryDirectory() as tmp:
        _run_workers(work, jobs, Path(tmp), progress)
    return paths


def _run_workers(work: list[tuple], jobs: int, tmp: Path, progress: Callable[[int, int], None] | None) -> None:
    """Hand the indices of `work` to `jobs` aot_worker processes one at a time (a line on a worker's stdin; the
    worker answers with the same line on its stdout when the object is written, and exits at end of input)."""
    import selectors

    job_file = tmp / "jobs.pickle"
    job_file.write_bytes(pickle.dumps(work))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    pending = iter(range(len(work)))
    workers, running, logs = [], {}, []
    sel = selectors.DefaultSelector()

    def hand_next(proc) -> None:
        index = next(pending, None)
        if index is None:
            proc.stdin.close()
        else:
            running[proc.pid] = index
            proc.stdin.write(f"{index}\n")
            proc.stdin.flush()

    try:
        for w in range(jobs):
            log = open(tmp / f"worker{w}.log", "w+")  # a file, so a chatty compiler never blocks on a full pipe
            logs.append(log)
            proc = subprocess.Popen([sys.executable, "-m", "cula_core.cute_runtime.aot_worker", str(job_file)],
                                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                    bufsize=1)
            workers.append(proc)
            sel.register(proc.stdout, selectors.EVENT_READ, (proc, log))
            hand_next(proc)
        done = 0
        while sel.get_map():
            for key, _ in sel.select():
                proc, log = key.data
                line = proc.stdout.readline()
                if line:
                    running.pop(proc.pid, None)
                    done += 1
                    if progress:
                        progress(done, len(work))
                    hand_next(proc)
                    continue
                sel.unregister(proc.stdout)
                if proc.wait() != 0 or proc.pid in running:
                    log.seek(0)
                    index = running.get(proc.pid)
                    what = (f" {work[index][1]} {config_text(work[index][2])}" if index is not None else "")
                    raise RuntimeError(f"compiling CuTe DSL kernel{what} failed (worker exit status "
                                       f"{proc.returncode}):\n{log.read()[-6000:]}")
        if done != len(work):
            raise RuntimeError(f"CuTe DSL workers ended after {done} of {len(work)} configurations")
    finally:
        sel.close()
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream and not stream.closed:
                    try:
                        stream.close()
                    except BrokenPipeError:
                        pass
        for log in logs:
            log.close()


def write_manifest(out_dir: Path | str, distribution: str, version: str, arch: str,
                   items: list[tuple[str, tuple]]) -> Path:
    """`<out_dir>/manifest.json` describing the artifacts of `items`, linked into `<out_dir>/kernels.so`."""
    kernels = {}
    for name, config in items:
        aid = artifact_id(name, config)
        kernels[aid] = {"name": name, "config": config_text(config), "symbol": symbol(aid),
                        "source_hash": source_hash(name)}
    data = {"format": MANIFEST_FORMAT, "distribution": distribution, "version": version, "arch": arch,
            "dsl_version": dsl_version(), "library": LIBRARY, "kernels": kernels}
    path = Path(out_dir) / MANIFEST
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


# ------------------------------------------------------------------------------------------ loading

@functools.cache
def _tvm_ffi():
    """tvm_ffi, with CuTe DSL's runtime library loaded first (the exported kernels link against it; found in the
    installed nvidia-cutlass-dsl without importing the DSL)."""
    root = package_dir("nvidia_cutlass_dsl")
    libs = sorted(glob.glob(str(root / "*" / "lib" / "libcute_dsl_runtime.so"))) if root is not None else []
    if not libs:
        raise RuntimeError("libcute_dsl_runtime.so not found in the installed nvidia-cutlass-dsl")
    ctypes.CDLL(libs[0], mode=ctypes.RTLD_GLOBAL)
    import tvm_ffi

    return tvm_ffi


@functools.cache
def _library(path: str):
    return _tvm_ffi().load_module(path)


def _load(art: Artifact):
    if art.path.endswith(".so"):
        return _library(art.path)[art.symbol]
    from cutlass.runtime import load_module  # an object file: the DSL links it in memory

    _tvm_ffi()
    return load_module(art.path, enable_tvm_ffi=True)[art.symbol]


def _compile_into_cache(kdef: KernelDef, aid: str, config: tuple) -> Artifact:
    global _warned
    folder = _cache_folder(kdef)
    if not _warned:
        _warned = True
        warnings.warn(f"cula: compiling CuTe DSL kernel {kdef.name} {config_text(config)} just in time (not "
                      f"shipped in the {kdef.distribution} wheel); compiled kernels are cached in {cache_dir()}",
                      JitCompileWarning, stacklevel=4)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        obj = Path(tmp) / (aid + ".o")
        _export_object(kdef.name, config, obj)
        try:
            link_library([obj], Path(tmp) / (aid + ".so"))
            suffix = ".so"
        except RuntimeError:
            suffix = ".o"  # no C compiler: the object is loaded through the DSL
        side = {"name": kdef.name, "config": config_text(config), "symbol": symbol(aid), "suffix": suffix}
        (folder / (aid + ".json")).write_text(json.dumps(side))
        os.replace(Path(tmp) / (aid + suffix), folder / (aid + suffix))
    return Artifact(kdef.name, config_text(config), "cached", str(folder / (aid + suffix)), symbol(aid))


def get(name: str, config: tuple):
    """The loaded function of (name, config): shipped, else cached, else compiled now (and cached). Call it with
    the kernel's arguments in order: pointers as integer addresses, scalars as ints / floats, the stream as its
    raw handle. Loading never touches the GPU; the function loads its cubin on its first call."""
    key = (name, config)
    fn = _LOADED.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _LOADED.get(key)
        if fn is None:
            kdef = kernel_def(name)
            aid = artifact_id(name, config)
            art = _shipped(kdef, aid) or _cached(kdef, aid, config) or _compile_into_cache(kdef, aid, config)
            fn = _LOADED[key] = _load(art)
    return fn


def loaded() -> list[tuple[str, tuple]]:
    """(name, config) of every function loaded in this process."""
    return list(_LOADED)


def reset() -> None:
    """Forget loaded functions, read manifests and the JIT notice (after CULA_CACHE_DIR changed or artifacts were
    installed in this process); libraries already loaded stay loaded."""
    global _warned
    _LOADED.clear()
    _manifests.cache_clear()
    _warned = False


__all__ = ["Artifact", "JitCompileWarning", "KernelDef", "artifact_id", "build_objects", "cache_dir",
           "compile_kernel", "config_text", "dsl_version", "get", "kernel_def", "link_library", "listing", "loaded",
           "register", "reset", "resolve", "source_hash", "symbol", "write_manifest"]
