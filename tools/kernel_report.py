"""Static resource report of the CuTe DSL kernels (cula-sm90 decode / prefill, cula-sm100 forward / backward),
with no GPU: each kernel is compiled on the CPU at its main configuration (K = V = 128, bf16, default tiling)
through the same compile paths the CPU compile tests use, and its cubin is read.

    python -m tools.kernel_report                              # markdown table for sm_90a on stdout
    python -m tools.kernel_report --arch sm_100a --out docs/x.md
    python -m tools.kernel_report --kernel decode.recurrent[final,T=4] --json

Where each number comes from:
  cubin, PTX       CUTE_DSL_KEEP=cubin,ptx with CUTE_DSL_DUMP_DIR (set before cutlass is imported): the compiled
                   function then carries them (`__cubin__`, `__ptx__`); keeping artifacts also turns the DSL's
                   compile cache off, so every kernel is really compiled.
  regs, stack,     `cuobjdump -res-usage` of the DSL's own cubin. "static smem" is the cubin's .nv.shared section
  static smem      (1 KiB on every kernel here: the padding that aligns the 1024-aligned dynamic region).
  dynamic smem     the launch's dynamic shared memory: the constant stored into the launch config in the
                   compiled function's lowered host IR (`ir_module`); the DSL resolves `smem=None` launches to
                   the kernel's allocator total there.
  threads / CTA    the kernel's .reqntid (EIATTR_REQNTID in the cubin).
  spills           `ptxas -v` on the DSL's PTX for the same arch (the local ptxas; the cubin records no spill
                   counts); its register count is shown beside the cubin's when they differ. LDL/STL below are
                   counted in the DSL's SASS.
  CTAs / SM        the CUDA occupancy calculator's rules on an H100 / B200 SM: 65536 registers (allocated per
                   warp in units of 256, per quarter SM), 228 KiB shared memory (1 KiB reserved per CTA, 128 B
                   granularity, at most 227 KiB per CTA), 2048 threads, 32 CTAs. The shared memory counted is
                   the dynamic size: the DSL's 1 KiB .nv.shared padding is not allocated at launch (ncu on an
                   H100 / H200: 0 B static shared memory per block, and three CTAs per SM of the prefill's stage 1
                   at 75 KiB dynamic, which would not fit with that padding added).
  instruction mix  `cuobjdump -sass`: STATIC counts of instructions in the code (an unrolled loop counts every
                   copy, a rolled loop once): they show what kind of code it is, not how often it runs.

Tools: cuobjdump from PATH, $CUDA_HOME/bin, /usr/local/cuda/bin or the `nvidia-cuda-cuobjdump` wheel; ptxas from
the same places (optional: without it the spill columns read "n/a").
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("sm_90a", "sm_100a")

# One SM of an H100 (sm_90) or a B200 (sm_100): the same numbers for both.
SM_REGS = 65536
SM_SMEM = 228 * 1024
CTA_SMEM_MAX = 227 * 1024
SMEM_RESERVED_PER_CTA = 1024
SMEM_GRANULE = 128
SM_THREADS = 2048
SM_CTAS = 32
REG_UNIT = 256  # registers are allocated per warp, in units of 256


# ------------------------------------------------------------------------------------------------- the kernels

def _decode_inputs():
    """(q/k/v dtype, g dtype, beta dtype, A_log?, dt_bias?, safe, l2norm) of the decode kernels' configurations,
    the benchmark's: bf16 q/k/v/g/beta, fp32 A_log and dt_bias, the softplus gate, q/k L2 norm."""
    import torch

    bf = torch.bfloat16
    return bf, bf, bf, True, True, False, True


def _decode_recurrent(mode: str, T: int):
    def build():
        from cula_core import cute_runtime
        from cula_sm90.decode import configs, launch

        tiling = configs.recurrent_tiling(1, T, 8)
        config = launch.recurrent_config(mode, T, 128, 128, *_decode_inputs(), tiling)
        return cute_runtime.compile_kernel(launch.RECURRENT, config)
    return build


def _decode_stream(pool: str, v_first: bool = False):
    def build():
        import torch

        from cula_core import cute_runtime
        from cula_sm90.decode import launch

        dtype = torch.bfloat16 if pool == "bf16" else torch.float32
        config = launch.stream_config(128, 128, *_decode_inputs(), dtype, v_first)
        return cute_runtime.compile_kernel(launch.STREAM, config)
    return build


def _decode_flush(T: int):
    def build():
        from cula_core import cute_runtime
        from cula_sm90.decode import launch

        return cute_runtime.compile_kernel(launch.FLUSH, launch.flush_config(T, 128, 128, 1, True))
    return build


def _decode_verify(T: int, tensor_cores: bool):
    def build():
        from cula_core import cute_runtime
        from cula_sm90.decode import launch

        config = launch.verify_config(T, 128, 128, *_decode_inputs(), tensor_cores)
        return cute_runtime.compile_kernel(launch.VERIFY, config)
    return build


def _prefill_intra(kind: str, store_akk: bool = False, packed: bool = False):
    def build():
        import torch

        from cula_core import cute_runtime
        from cula_sm90.prefill import forward

        bf = torch.bfloat16  # the benchmark's: safe gate with A_log and dt_bias, q/k L2 norm, beta as given
        config = forward.intra_config("safe", "none", True, True, True, bf, bf, bf, kind, store_akk, packed)
        return cute_runtime.compile_kernel(forward.INTRA, config)
    return build


def _prefill_state(affine: bool, cols: int):
    def build():
        import torch

        from cula_core import cute_runtime
        from cula_sm90.prefill import forward

        return cute_runtime.compile_kernel(forward.STATE, forward.state_config(affine, torch.bfloat16, cols))
    return build


def _tests_helper(module: str, attr: str, name: str):
    """A kernel of the sm100 CPU compile tests' lists (tests/sm100/sm100_compile_check.py, backward_cases.py)."""
    def build():
        here = str(ROOT / "tests" / "sm100")
        if here not in sys.path:
            sys.path.insert(0, here)
        from cula_sm100 import runtime

        mod = __import__(module)
        table = getattr(mod, attr)
        # the lists give (kernel name, configuration); the report reads the sm_90a build (the Hopper GPU here)
        return runtime.compile_kernel((table() if callable(table) else table)[name](), "sm_90a")
    return build


def _sm100_forward(name: str):
    return _tests_helper("sm100_compile_check", "KERNELS", name)


def _sm100_backward(name: str):
    return _tests_helper("backward_cases", "kernels", name)


# (report name, family, builder): the main configuration of every kernel
KERNELS: list[tuple[str, str, object]] = [
    ("decode.stream[T=1]", "sm90 decode", _decode_stream("fp32")),
    ("decode.stream[T=1,bf16 pool]", "sm90 decode", _decode_stream("bf16")),
    ("decode.stream[T=1,bf16 pool,V-first]", "sm90 decode", _decode_stream("bf16", True)),
    ("decode.recurrent[final,T=1]", "sm90 decode", _decode_recurrent("final", 1)),
    ("decode.recurrent[final,T=4]", "sm90 decode", _decode_recurrent("final", 4)),
    ("decode.recurrent[states,T=4]", "sm90 decode", _decode_recurrent("states", 4)),
    ("decode.recurrent[kvbuffer,T=4]", "sm90 decode", _decode_recurrent("kvbuffer", 4)),
    ("decode.verify[simt,T=4]", "sm90 decode", _decode_verify(4, False)),
    ("decode.verify[tc,T=4]", "sm90 decode", _decode_verify(4, True)),
    ("decode.flush[T=4]", "sm90 decode", _decode_flush(4)),
    ("prefill.chunk_intra_tc (stage 1)", "sm90 prefill", _prefill_intra("tc")),
    ("prefill.chunk_intra_tc[store_akk] (stage 1, training)", "sm90 prefill", _prefill_intra("tc", True)),
    ("prefill.chunk_intra_tc_packed (stage 1, packed tiles)", "sm90 prefill", _prefill_intra("tc", packed=True)),
    ("prefill.chunk_intra[simt] (stage 1, any gate)", "sm90 prefill", _prefill_intra("simt")),
    ("prefill.chunk_state_wg[128 cols] (stage 2)", "sm90 prefill", _prefill_state(False, 128)),
    ("prefill.chunk_state_wg[64 cols] (stage 2)", "sm90 prefill", _prefill_state(False, 64)),
    ("prefill.chunk_state_wg[affine, 64 cols] (CP maps)", "sm90 prefill", _prefill_state(True, 64)),
    ("fwd.l2norm", "sm100 forward", _sm100_forward("l2norm")),
    ("fwd.gate_cumsum[softplus]", "sm100 forward", _sm100_forward("gate_cumsum[softplus]")),
    ("fwd.chunk_intra", "sm100 forward", _sm100_forward("chunk_intra")),
    ("fwd.recompute_w_u", "sm100 forward", _sm100_forward("recompute_w_u")),
    ("fwd.chunk_intra_wu", "sm100 forward", _sm100_forward("chunk_intra_wu")),
    ("fwd.chunk_intra_wu_gate[softplus]", "sm100 forward", _sm100_forward("chunk_intra_wu_gate[softplus]")),
    ("fwd.chunk_intra_wu_gate[softplus, qg_out]", "sm100 forward",
     _sm100_forward("chunk_intra_wu_gate[softplus, qg_out]")),
    ("fwd.chunk_delta_h", "sm100 forward", _sm100_forward("chunk_delta_h")),
    ("fwd.chunk_delta_h[2 stages]", "sm100 forward", _sm100_forward("chunk_delta_h[2 stages]")),
    ("fwd.fwd_o", "sm100 forward", _sm100_forward("fwd_o")),
    ("fwd.fwd_o[qg_in]", "sm100 forward", _sm100_forward("fwd_o[qg_in]")),
    ("bwd.chunk_wy_dqkg", "sm100 backward", _sm100_backward("chunk_wy_dqkg")),
    ("bwd.chunk_bwd_dav", "sm100 backward", _sm100_backward("chunk_bwd_dav")),
    ("bwd.chunk_bwd_intra_tc", "sm100 backward", _sm100_backward("chunk_bwd_intra_tc")),
    ("bwd.chunk_bwd_intra", "sm100 backward", _sm100_backward("chunk_bwd_intra")),
    ("bwd.chunk_bwd_dhu[dht,dh0]", "sm100 backward", _sm100_backward("chunk_bwd_dhu[dht, dh0]")),
    ("bwd.chunk_bwd_dhu[dht,dh0,BV=32,2 stages]", "sm100 backward",
     _sm100_backward("chunk_bwd_dhu[dht, dh0, BV=32, 2 stages]")),
    ("bwd.gate_bwd[softplus]", "sm100 backward",
     _sm100_backward("gate_bwd[softplus, A_log, dt_bias, fp32 g, bf16 beta]")),
    ("bwd.l2norm_bwd", "sm100 backward", _sm100_backward("l2norm_bwd")),
]


# ------------------------------------------------------------------------------------------------- tools

_WHEELS = {"cuobjdump": "nvidia-cuda-cuobjdump", "nvdisasm": "nvidia-cuda-nvdisasm"}


def find_tool(name: str) -> str | None:
    """A CUDA binary tool: PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, or the NVIDIA wheel that ships it."""
    hit = shutil.which(name)
    if hit:
        return hit
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / name).is_file():
            return str(Path(root) / "bin" / name)
    if name in _WHEELS:
        try:
            dist = importlib.metadata.distribution(_WHEELS[name])
        except importlib.metadata.PackageNotFoundError:
            return None
        for f in dist.files or ():
            if f.name == name and Path(dist.locate_file(f)).is_file():
                return str(dist.locate_file(f))
    return None


def missing_tools() -> str | None:
    """Why the report cannot run here (None if it can)."""
    if find_tool("cuobjdump") is None:
        return ("cuobjdump not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, or `pip install "
                "nvidia-cuda-cuobjdump`)")
    return None


# ------------------------------------------------------------------------------------------------- parsing

@dataclass
class Report:
    name: str
    family: str
    arch: str = ""
    kernel_symbol: str = ""
    threads: int = 0
    regs: int = 0
    stack: int = 0
    local: int = 0
    static_smem: int = 0
    dynamic_smem: int | None = None
    ptxas_regs: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    ctas_per_sm: int = 0
    limiter: str = ""
    sass_total: int = 0
    mix: dict = field(default_factory=dict)
    ldg: dict = field(default_factory=dict)  # width in bits -> count
    stg: dict = field(default_factory=dict)
    lds: dict = field(default_factory=dict)
    sts: dict = field(default_factory=dict)
    ldl_bytes: int = 0
    stl_bytes: int = 0
    error: str = ""


_WIDTH = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}


def access_width(opcode: str) -> int:
    """Bits moved by one LDG/STG/LDS/STS/LDL/STL opcode: 32 unless a size suffix says otherwise."""
    for part in opcode.split(".")[1:]:
        if part in _WIDTH:
            return _WIDTH[part]
    return 32


_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")

# the mix columns: name -> opcode base names that count for it
MIX = {
    "HMMA": ("HMMA",), "HGMMA": ("HGMMA",), "UTC*MMA": ("UTCHMMA", "UTCQMMA", "UTCIMMA", "UTCOMMA"),
    "LDG": ("LDG",), "STG": ("STG",), "LDGSTS": ("LDGSTS",), "TMA": ("UTMALDG", "UTMASTG", "UBLKCP"),
    "LDS": ("LDS",), "STS": ("STS",), "LDSM": ("LDSM",), "STSM": ("STSM",), "LDL": ("LDL",), "STL": ("STL",),
    "MUFU": ("MUFU",), "BAR": ("BAR",), "SHFL": ("SHFL",), "FFMA": ("FFMA",), "SYNCS": ("SYNCS",),
}


def parse_sass(sass: str, rep: Report) -> None:
    base = Counter()
    for line in sass.splitlines():
        m = _SASS_LINE.match(line)
        if not m:
            continue
        op = m.group(1)
        if op == "NOP":
            continue
        rep.sass_total += 1
        head = op.split(".")[0]
        base[head] += 1
        w = access_width(op)
        for key, table in (("LDG", rep.ldg), ("STG", rep.stg), ("LDS", rep.lds), ("STS", rep.sts)):
            if head == key:
                table[w] = table.get(w, 0) + 1
        if head == "LDL":
            rep.ldl_bytes += w // 8
        if head == "STL":
            rep.stl_bytes += w // 8
        if head == "MUFU":
            fn = op.split(".")[1] if "." in op else "?"
            rep.mix[f"MUFU.{fn}"] = rep.mix.get(f"MUFU.{fn}", 0) + 1
    for col, heads in MIX.items():
        rep.mix[col] = sum(base[h] for h in heads)


def parse_res_usage(text: str, rep: Report) -> None:
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", text)
    if not m:
        raise RuntimeError(f"no resource line in cuobjdump -res-usage output: {text[-500:]!r}")
    rep.regs, rep.stack, rep.static_smem, rep.local = (int(x) for x in m.groups())
    f = re.search(r"Function (\S+):", text)
    rep.kernel_symbol = f.group(1) if f else ""


def parse_reqntid(elf: str) -> int:
    m = re.search(r"EIATTR_REQNTID\s+Format:\s+\S+\s+Value:\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)", elf)
    if not m:
        m = re.search(r"EIATTR_MAX_THREADS\s+Format:\s+\S+\s+Value:\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+"
                      r"(0x[0-9a-f]+)", elf)
    if not m:
        return 0
    x, y, z = (int(v, 16) for v in m.groups())
    return x * y * z


_LAUNCH_CFG = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"


def dynamic_smem_from_host_ir(ir: str) -> list[int | None]:
    """The dynamic shared memory of each launch in the lowered host IR: the value stored into field 2 (the i64
    sharedMemBytes) of a launch config struct, when it is a constant (None when it is computed at run time)."""
    consts = dict(re.findall(r"(%\d+) = llvm\.mlir\.constant\((-?\d+) : i64\) : i64", ir))
    geps = set(re.findall(r"(%\d+) = llvm\.getelementptr %\d+\[0, 2\] : \(!llvm\.ptr\) -> !llvm\.ptr, "
                          + re.escape(_LAUNCH_CFG), ir))
    out = []
    for val, ptr in re.findall(r"llvm\.store (%\d+), (%\d+) : i64, !llvm\.ptr", ir):
        if ptr in geps:
            out.append(int(consts[val]) if val in consts else None)
    return out


def ptxas_usage(ptx: str, arch: str) -> tuple[int | None, int | None, int | None]:
    """(registers, spill store bytes, spill load bytes) from `ptxas -v` on the PTX (None where unavailable)."""
    ptxas = find_tool("ptxas")
    if ptxas is None or not ptx:
        return None, None, None
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([ptxas, f"-arch={arch}", "-v", "-o", str(Path(d) / "k.cubin"), str(src)],
                              capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    r = re.search(r"Used (\d+) registers", text)
    s = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (int(r.group(1)) if r else None, int(s.group(1)) if s else None, int(s.group(2)) if s else None)


def occupancy(rep: Report) -> None:
    """Theoretical CTAs per SM and what limits them (the CUDA occupancy calculator's rules)."""
    warps = -(-rep.threads // 32) if rep.threads else 0
    limits = {"threads": SM_THREADS // rep.threads if rep.threads else 0, "CTA slots": SM_CTAS}
    if rep.regs and warps:
        per_warp = -(-rep.regs * 32 // REG_UNIT) * REG_UNIT
        limits["registers"] = ((SM_REGS // 4) // per_warp) * 4 // warps
    smem = rep.dynamic_smem or 0  # the static section is the dynamic region's alignment padding (module docstring)
    if smem > CTA_SMEM_MAX:
        limits["smem"] = 0
    else:
        per_cta = -(-(smem + SMEM_RESERVED_PER_CTA) // SMEM_GRANULE) * SMEM_GRANULE
        limits["smem"] = SM_SMEM // per_cta
    rep.ctas_per_sm = min(limits.values())
    rep.limiter = "/".join(k for k, v in limits.items() if v == rep.ctas_per_sm)


# ------------------------------------------------------------------------------------------------- running

def _artifact_text(value) -> str:
    """A DSL artifact as text: the artifact itself, or the file it names."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, str) and "\n" not in value and os.path.isfile(value):
        return Path(value).read_text()
    return str(value)


def _cubin_bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str) and os.path.isfile(value):
        return Path(value).read_bytes()
    raise RuntimeError(f"the compiled function carries no cubin (got {type(value).__name__}); was CUTE_DSL_KEEP "
                       "set before cutlass was imported?")


def analyse(name: str, family: str, compiled, arch: str, workdir: Path) -> Report:
    rep = Report(name=name, family=family)
    cuobjdump = find_tool("cuobjdump")
    cubin = workdir / (re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".cubin")
    cubin.write_bytes(_cubin_bytes(compiled.__cubin__))

    def run(*args):
        return subprocess.run([cuobjdump, *args, str(cubin)], capture_output=True, text=True, check=True).stdout

    parse_res_usage(run("-res-usage"), rep)
    rep.threads = parse_reqntid(run("-elf"))
    sass = run("-sass")
    m = re.search(r"code for (sm_\w+)", sass)
    rep.arch = m.group(1) if m else arch
    parse_sass(sass, rep)
    launches = dynamic_smem_from_host_ir(str(compiled.ir_module))
    rep.dynamic_smem = launches[0] if len(launches) == 1 else None
    rep.ptxas_regs, rep.spill_stores, rep.spill_loads = ptxas_usage(_artifact_text(compiled.__ptx__), rep.arch)
    occupancy(rep)
    return rep


def collect(names: list[str] | None, arch: str) -> list[Report]:
    """Compile and analyse the named kernels (all when None). CUTE_DSL_* must be set before this (see main)."""
    wanted = [k for k in KERNELS if names is None or k[0] in names]
    unknown = set(names or ()) - {k[0] for k in KERNELS}
    if unknown:
        raise SystemExit(f"unknown kernel(s): {sorted(unknown)}; known: {[k[0] for k in KERNELS]}")
    reports = []
    with tempfile.TemporaryDirectory() as d:
        for name, family, build in wanted:
            try:
                reports.append(analyse(name, family, build(), arch, Path(d)))
            except Exception as e:  # one kernel's failure is a row, not the end of the report
                reports.append(Report(name=name, family=family, error=f"{type(e).__name__}: {e}"[:300]))
            print(f"analysed {name}", file=sys.stderr, flush=True)
    return reports


# ------------------------------------------------------------------------------------------------- output

def _kb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1024:.1f}"


def _widths(t: dict) -> str:
    return " ".join(f"{w}b:{t[w]}" for w in sorted(t)) or "0"


def markdown(reports: list[Report]) -> str:
    res = ["| kernel | arch | threads | regs | spill st/ld B (ptxas) | stack B | smem static+dyn KiB | CTAs/SM (limit) "
           "| warps/SM |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    mix = ["| kernel | SASS | HMMA | HGMMA | LDG by width | STG by width | LDS / STS | LDSM | LDGSTS | LDL/STL B "
           "| MUFU (EX2) | BAR | SHFL |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in reports:
        if r.error:
            res.append(f"| {r.name} | failed: {r.error} | | | | | | | |")
            continue
        regs = str(r.regs) + (f" (ptxas {r.ptxas_regs})" if r.ptxas_regs not in (None, r.regs) else "")
        spill = "n/a" if r.spill_stores is None else f"{r.spill_stores} / {r.spill_loads}"
        smem = f"{_kb(r.static_smem)} + {_kb(r.dynamic_smem)}"
        warps = r.ctas_per_sm * (-(-r.threads // 32))
        res.append(f"| {r.name} | {r.arch} | {r.threads} | {regs} | {spill} | {r.stack} | {smem} "
                   f"| {r.ctas_per_sm} ({r.limiter}) | {warps} |")
        m = r.mix
        mix.append(f"| {r.name} | {r.sass_total} | {m['HMMA']} | {m['HGMMA']} | {_widths(r.ldg)} | {_widths(r.stg)} "
                   f"| {m['LDS']} / {m['STS']} | {m['LDSM']} | {m['LDGSTS']} | {r.ldl_bytes} / {r.stl_bytes} "
                   f"| {m['MUFU']} ({m.get('MUFU.EX2', 0)}) | {m['BAR']} | {m['SHFL']} |")
    return "\n".join(res) + "\n\nInstruction mix (static counts in the SASS):\n\n" + "\n".join(mix) + "\n"


BEGIN, END = "<!-- kernel_report:begin -->", "<!-- kernel_report:end -->"


def write_out(path: Path, table: str, arch: str) -> None:
    """Write the table to `path`; in a file that already holds the BEGIN / END markers, replace only what is
    between them (so a document's prose around the table survives a rerun)."""
    block = f"{BEGIN}\n<!-- python -m tools.kernel_report --arch {arch} --out {path} -->\n\n{table}\n{END}"
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        path.write_text(head + block + rest.split(END, 1)[1])
    else:
        path.write_text(block + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.kernel_report",
        description="Compile every CuTe DSL kernel on the CPU (fake pointers, main configuration) and report "
                    "registers, spills, stack, shared memory, threads, theoretical CTAs per SM and a SASS "
                    "instruction mix (static counts: each instruction as often as it stands in the code, not as "
                    "often as it runs), as a markdown table.")
    ap.add_argument("--arch", choices=ARCHS, default="sm_90a",
                    help="CUTE_DSL_ARCH for the kernels that take it from the environment (default sm_90a; the "
                         "decode kernels always compile for sm_90a)")
    ap.add_argument("--out", type=Path,
                    help="also write the markdown table to this file; where the file already has the markers "
                         f"{BEGIN} / {END}, only the text between them is replaced")
    ap.add_argument("--kernel", action="append", metavar="NAME",
                    help="only this kernel (repeatable); --list shows the names")
    ap.add_argument("--list", action="store_true", help="list the kernel names and exit")
    ap.add_argument("--json", action="store_true", help="print the parsed fields as JSON instead of markdown")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(k[0] for k in KERNELS))
        return 0
    why = missing_tools()
    if why:
        print(f"kernel_report: {why}", file=sys.stderr)
        return 2
    if "cutlass" in sys.modules:
        raise SystemExit("kernel_report must set CUTE_DSL_KEEP before cutlass is imported: run it as a program")
    dump = tempfile.mkdtemp(prefix="kernel_report_")
    os.environ.update(CUTE_DSL_ARCH=args.arch, CUTE_DSL_KEEP="cubin,ptx", CUTE_DSL_DUMP_DIR=dump)
    try:
        reports = collect(args.kernel, args.arch)
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=1))
    else:
        text = markdown(reports)
        print(text)
        if args.out:
            write_out(args.out, text, args.arch)
    return 1 if any(r.error for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
