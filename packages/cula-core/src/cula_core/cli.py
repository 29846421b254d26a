"""`python -m cula info` and `python -m cula demo` (also the `cula` console script).

info: versions of cula's packages, torch and CUDA; each visible GPU and its compute capability; each
      installed backend and whether it loaded; and which backend each public op would use here.
demo: a small KDA workload (prefill, a decode step, forward + backward of chunk_kda) on the best backend
      of this machine, printing the backend, shapes, time and max error against the reference.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings
from importlib import metadata

import torch

from cula_core import dispatch, registry
from cula_core.backend import CallConfig, DeviceInfo

PACKAGES = ("cula", "cula-core", "cula-sm89", "cula-sm90", "cula-sm100")

# The configuration `info` asks about for each op: what a typical KDA model layer runs.
TYPICAL = dict(dtype=torch.bfloat16, K=128, V=128, HQK=32, HV=32)
OP_EXAMPLES = {
    "chunk_kda": dict(T=4096, gate="softplus", requires_grad=True),
    "chunk_kda_backward": dict(T=4096, gate="softplus", requires_grad=True),
    "kda_prefill": dict(T=4096, gate="softplus"),
    "kda_decode": dict(T=1, gate="softplus"),
    "kda_decode_mtp": dict(T=4, gate="softplus"),
    "kda_decode_mtp_kvbuffer": dict(T=4, gate="softplus"),
    "kda_flush_kvbuffer": dict(T=4, gate="precomputed", dtype=torch.float32),
    "kda_flush_kvbuffer_all_layers": dict(T=4, gate="precomputed", dtype=torch.float32),
}


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _devices() -> list[DeviceInfo]:
    if not torch.cuda.is_available():
        return [DeviceInfo(type="cpu")]
    return [DeviceInfo.of(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]


def info(out=sys.stdout) -> int:
    p = lambda *a: print(*a, file=out)
    p("cula packages:")
    for dist in PACKAGES:
        p(f"  {dist:<12} {_version(dist)}")
    p(f"python {platform.python_version()}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda or 'none (CPU build)'}")
    devices = _devices()
    p("devices:")
    if devices[0].type == "cpu":
        p("  no CUDA device visible: ops run on the reference (CPU)")
    for d in devices:
        if d.type == "cuda":
            p(f"  cuda:{d.index}  {d.name}  compute capability {d.capability[0]}.{d.capability[1]}")
    p("backends (entry-point group cula.backends):")
    entries = registry.entries()
    if not entries:
        p("  none installed: pip install cula[sm90] (Hopper), cula[sm100] (Blackwell) or cula[sm89] (Ada)")
    for e in entries:
        origin = f"{e.distribution} {e.version}" if e.distribution else e.value
        if e.loaded:
            p(f"  {e.entry_name:<8} loaded   ({origin}): {e.backend.describe()}")
        else:
            p(f"  {e.entry_name:<8} FAILED   ({origin}): {e.error}")
    p("dispatch (bf16, K=V=128, HQK=HV=32; flush: fp32 states):")
    for d in devices:
        p(f"  on {d}:")
        for op, example in OP_EXAMPLES.items():
            call = CallConfig(op=op, device=d, **{**TYPICAL, **example})
            try:
                sel = dispatch.choose(call)
            except dispatch.BackendUnavailableError as exc:
                p(f"    {op:<30} error: {exc}")
                continue
            where = sel.backend.name if sel.fallback_reason is None else f"reference ({sel.fallback_reason})"
            p(f"    {op:<30} {where}")
    p("CuTe DSL kernels (cula_core.cute_runtime):")
    p(f"  {kernel_artifacts_line()}")
    return 0


def kernel_artifacts_line() -> str:
    """How many compiled CuTe DSL kernels the installed wheels ship and the disk cache holds, and what happens to
    a configuration with neither (it compiles on its first call, once)."""
    from cula_core import cute_runtime

    try:
        artifacts = cute_runtime.listing()
    except metadata.PackageNotFoundError:
        return "CuTe DSL (nvidia-cutlass-dsl) is not installed: no kernel can compile or load"
    count = {origin: sum(a.origin == origin for a in artifacts) for origin in ("shipped", "stale", "cached")}
    stale = f" ({count['stale']} more built for another DSL or package version, unused)" if count["stale"] else ""
    return (f"{count['shipped']} shipped in the wheels{stale}, {count['cached']} in the disk cache "
            f"{cute_runtime.cache_dir()}; any other configuration compiles just in time on its first call "
            "(once: then it is cached)")


def _time(fn, device: torch.device) -> tuple[object, float]:
    """Run fn once to warm up, then time one call (CUDA events on a GPU)."""
    fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        torch.cuda.synchronize(device)
        return result, start.elapsed_time(end)
    t0 = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - t0) * 1e3


def demo_device(name: str | None) -> torch.device:
    """The demo's device: `name` (a torch device string: "cpu", "cuda", "cuda:1"), or cuda when available and cpu
    otherwise. ValueError, saying why, for a device this machine does not have."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r} is not a torch device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"--device {name}: no CUDA device is available here (torch {torch.__version__}, {build}); "
                             "leave --device out to run the demo on the CPU reference")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"--device {name}: the demo runs on cpu or cuda, got {dev.type}")
    return dev


def demo(out=sys.stdout, device: str | None = None) -> int:
    """A small workload on the best backend here; every number printed is computed in this run. ValueError for a
    device this machine does not have (demo_device)."""
    from cula_core import chunk_kda, kda_decode, kda_prefill
    from cula_core import reference_backend as ref

    p = lambda *a: print(*a, file=out)
    dev = demo_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    B, T, HQK, HV, K, V = 1, 256, 2, 4, 64, 64
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dev)
    q, k, v = rnd(B, T, HQK, K).to(dtype), rnd(B, T, HQK, K).to(dtype), rnd(B, T, HV, V).to(dtype)
    g, beta = rnd(B, T, HV, K), torch.rand(B, T, HV, generator=gen).to(dev)
    A_log, dt_bias = rnd(HV) * 0.5, rnd(HV * K) * 0.1
    gate_kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    p(f"cula demo on {DeviceInfo.of(dev)}; q/k [B, T, HQK, K] = {list(q.shape)}, v {list(v.shape)}, {dtype}")

    def backend_of(op, **example):
        call = CallConfig(op=op, device=DeviceInfo.of(dev), dtype=dtype, K=K, V=V, HQK=HQK, HV=HV, **example)
        return dispatch.choose(call).backend.name

    def reference_forward():
        return ref.chunk_kda(q, k, v, g, beta, A_log, dt_bias, None, None, None, scale=K**-0.5,
                             output_final_state=True, use_qk_l2norm_in_kernel=True, gate="softplus",
                             lower_bound=None, beta_activation="none")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dispatch.CulaFallbackWarning)
        o_ref, ht_ref = reference_forward()
        (o, ht), ms = _time(lambda: kda_prefill(q, k, v, g, beta, output_final_state=True, **gate_kw), dev)
        err = max((o.float() - o_ref.float()).abs().max().item(), (ht - ht_ref).abs().max().item())
        p(f"  kda_prefill   backend {backend_of('kda_prefill', T=T, gate='softplus'):<9} "
          f"o {list(o.shape)}  {ms:8.3f} ms  max |err| vs reference {err:.2e}")

        pool = torch.zeros(4, HV, K, V, device=dev)
        pool[2] = ht
        idx = torch.tensor([2, -1], dtype=torch.int32, device=dev)
        step = [rnd(2, 1, HQK, K).to(dtype), rnd(2, 1, HQK, K).to(dtype), rnd(2, 1, HV, V).to(dtype),
                rnd(2, 1, HV, K), torch.rand(2, 1, HV, generator=gen).to(dev)]
        pool_ref = pool.clone()
        o_dec_ref = ref.kda_decode(*step, pool_ref, idx, A_log, dt_bias, scale=K**-0.5, lower_bound=None,
                                   use_qk_l2norm_in_kernel=True)
        t0 = time.perf_counter()
        o_dec = kda_decode(*step, pool, idx, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        ms = (time.perf_counter() - t0) * 1e3
        err = max((o_dec.float() - o_dec_ref.float()).abs().max().item(), (pool - pool_ref).abs().max().item())
        p(f"  kda_decode    backend {backend_of('kda_decode', T=1, gate='softplus'):<9} "
          f"o {list(o_dec.shape)}  {ms:8.3f} ms  max |err| vs reference {err:.2e} (one step, slot 2 and a padded slot)")

        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

        def train_step():
            o, _ = chunk_kda(*leaves, g, beta, **gate_kw)
            o.float().square().mean().backward()
            return o

        _, ms = _time(train_step, dev)
        refs = [t.detach().clone().double().requires_grad_(True) for t in (q, k, v)]
        o64, _ = chunk_kda(*refs, g.double(), beta.double(), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                           A_log=A_log.double(), dt_bias=dt_bias.double())
        o64.square().mean().backward()
        # The timed step ran twice (warm-up + timed): gradients accumulated twice.
        err = max(((a.grad.double() / 2) - b.grad).abs().max().item() / b.grad.abs().max().item()
                  for a, b in zip(leaves, refs, strict=True))
        p(f"  chunk_kda fwd+bwd backend {backend_of('chunk_kda', T=T, gate='softplus', requires_grad=True):<9} "
          f"{ms:8.3f} ms  max |grad err| / max |grad| (q, k, v) vs fp64 reference {err:.2e}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cula", description="cula: fast KDA kernels with FLA's API")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, GPUs, installed backends and the backend each op uses here")
    demo_p = sub.add_parser("demo", help="run a small KDA workload on the best backend here and check it")
    demo_p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    try:
        demo_device(args.device)
    except ValueError as e:
        demo_p.error(str(e))  # exits with status 2, the message on stderr
    return demo(device=args.device)
