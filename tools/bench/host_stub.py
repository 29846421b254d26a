"""The Python host path of cula's public ops on the CPU, with every kernel launch stubbed out. NOT a GPU measurement.

    python -m tools.bench.host_stub [--calls 2000] [--runs 5] [--launch nop|check]

What runs: the repeated call of each public op on small host tensors (the compiled plan table's program where the
backend states one, cula_core.cute_runtime.plan_table; else its Python plan, cula_core.plans: signature, lookup, the
backend's launch code, the allocations), exactly as on the GPU machine but for what cannot run without a GPU:

  * the kernels: `cula_core.cute_runtime.get` hands out a stand-in for every (kernel, configuration). `--launch nop`
    (default): TVM-FFI's own no-op function (``testing.nop``), so each launch still pays TVM-FFI's conversion of its
    Python arguments, only not the kernel's launch code or the driver. `--launch check`: a Python function that
    counts the launches and checks each one's argument count against the compile-time arguments of the kernel's
    definition (`KernelDef.build`); a mismatch raises;
  * the device: `DeviceInfo.of` describes a host device as an sm_90 card (so the dispatch picks cula-sm90), the
    current stream is 0 (`cula_core.cute_runtime.current_stream` is the builtin `int`), the SM count 132, and
    `cula_core.plans.MIN_DEVICE` is lowered to -1 so that host tensors get a plan signature (it keeps every other
    rule).

So the figures are the Python work of a call, on this machine's CPU, with the CPU allocator in place of the CUDA
caching allocator: what the host path's own code costs and what a change to it saves, not what a call costs on a GPU
machine (`python -m tools.bench.host_overhead` measures that). The table gives microseconds per call, the best of
`--runs` runs of `--calls` calls, for each op and for pieces of the path: the plan signature, the backend's launch
code called directly, one allocation, one TVM-FFI call.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

#: value heads, head dim, decode batch, MTP tokens, prefill tokens: the shapes of tools/bench/host_overhead.py
H, K, N, T_MTP, T_PREFILL = 4, 128, 1, 4, 64
#: the SM count the stubbed device reports (an H100 SXM's)
SM_COUNT = 132


class Launches:
    """The stand-ins `cula_core.cute_runtime.get` returns while the stubs are installed, and the launches seen."""

    def __init__(self, mode: str):
        if mode not in ("nop", "check"):
            raise ValueError(f"launch mode must be 'nop' or 'check', got {mode!r}")
        self.mode = mode
        self.count = 0                      # launches made (mode "check")
        self.arity: dict[str, int] = {}     # argument count of each kernel handed out, by name
        self._nop = None

    def get(self, name: str, config: tuple) -> Callable:
        from cula_core import cute_runtime as rt

        arity = len(rt.kernel_def(name).build(config)[1])
        self.arity[name] = arity
        if self.mode == "nop":
            if self._nop is None:
                import tvm_ffi

                self._nop = tvm_ffi.get_global_func("testing.nop")
            return self._nop

        def launch(*args):
            if len(args) != arity:
                raise TypeError(f"{name} takes {arity} arguments (its KernelDef's compile-time ones), the launch "
                                f"passed {len(args)}")
            self.count += 1

        return launch


def install(launch_mode: str = "nop") -> tuple[Launches, Callable[[], None]]:
    """Install the stubs of the module docstring; returns (the launch stand-ins, a function that removes them)."""
    from cula_core import cute_runtime as rt
    from cula_core import plans
    from cula_core.backend import DeviceInfo

    launches = Launches(launch_mode)
    hopper = DeviceInfo(type="cuda", index=0, capability=(9, 0), name="host stub (sm_90)")
    of = DeviceInfo.__dict__["of"]

    def device_info(device):
        return hopper if device.type == "cpu" else of.__func__(device)

    saved = [(rt, "get", rt.get), (rt, "current_stream", rt.current_stream), (rt, "sm_count", rt.sm_count),
             (plans, "MIN_DEVICE", plans.MIN_DEVICE)]
    rt.get = launches.get
    rt.current_stream = int  # int() == 0, int(index) == index: a C builtin, as cheap as a stream read gets
    rt.sm_count = lambda index: SM_COUNT
    plans.MIN_DEVICE = -1
    DeviceInfo.of = staticmethod(device_info)

    def remove():
        for module, name, value in saved:
            setattr(module, name, value)
        DeviceInfo.of = of
        plans.forget()

    return launches, remove


def _best_us(fn: Callable[[], object], calls: int, runs: int) -> float:
    """Microseconds per call of fn: the best of `runs` runs of `calls` calls, after a warm-up."""
    for _ in range(min(calls, 200)):
        fn()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def rows() -> dict[str, Callable[[], object]]:
    """name -> a call, for each op row and each piece (the stubs installed)."""
    import torch

    import cula
    from cula_core import plans
    from cula_sm90.decode import configs, launch
    from cula_sm90.prefill import planned_kernel

    bf = torch.bfloat16
    q, k, v, g = (torch.randn(N, 1, H, K, dtype=bf) * 0.1 for _ in range(4))
    beta = torch.rand(N, 1, H, dtype=bf)
    pool = torch.zeros(4, H, K, K)
    idx = torch.arange(N, dtype=torch.int32)
    A_log, dt_bias = torch.zeros(H), torch.zeros(H * K)
    gate = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True)
    qm, km, vm, gm = (torch.randn(N, T_MTP, H, K, dtype=bf) * 0.1 for _ in range(4))
    bm = torch.rand(N, T_MTP, H, dtype=bf)
    qp, kp, vp, gp = (torch.randn(1, T_PREFILL, H, K, dtype=bf) * 0.1 for _ in range(4))
    bp = torch.rand(1, T_PREFILL, H, dtype=bf)
    # the host-time shape of host_overhead.py's last row (its scratch, ~38 MB, comes from the CPU allocator here)
    HL, TL = 64, 512
    ql, kl, vl, gl = (torch.randn(1, TL, HL, K, dtype=bf) * 0.1 for _ in range(4))
    bl = torch.rand(1, TL, HL, dtype=bf)
    gate_l = dict(A_log=torch.zeros(HL), dt_bias=torch.zeros(HL * K), use_qk_l2norm_in_kernel=True)
    prefill_args = (qp, kp, vp, gp, bp, A_log, dt_bias, None, None, None)
    prefill_flags = dict(scale=K ** -0.5, output_final_state=False, use_qk_l2norm_in_kernel=True, gate="softplus",
                         lower_bound=None, beta_activation="none")
    launcher = planned_kernel("kda_prefill", prefill_args, **prefill_flags, intracard_cp="auto")
    prefill_scalars = (None, False, True, True, False, False, False, None, False, False, True, False, None, "auto")
    decode_scalars = (None, None, True, False, None)
    nop_args = tuple(range(25))

    return {
        "op: kda_decode (N=1, H=4)": lambda: cula.kda_decode(q, k, v, g, beta, pool, idx, **gate),
        "op: kda_decode_mtp (N=1, T=4)": lambda: cula.kda_decode_mtp(qm, km, vm, gm, bm, pool, idx, **gate),
        "op: kda_decode_mtp_kvbuffer (N=1, T=4)": lambda: cula.kda_decode_mtp_kvbuffer(qm, km, vm, gm, bm, pool, idx,
                                                                                       **gate),
        "op: fused_recurrent_kda pool (N=1, H=4)": lambda: cula.fused_recurrent_kda(
            q, k, v, g, beta, A_log, dt_bias, initial_state=pool, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, ssm_state_indices=idx),
        "op: kda_prefill (T=64)": lambda: cula.kda_prefill(qp, kp, vp, gp, bp, use_gate_in_kernel=True, **gate),
        "op: kda_prefill (T=64), final state": lambda: cula.kda_prefill(qp, kp, vp, gp, bp, use_gate_in_kernel=True,
                                                                        output_final_state=True, **gate),
        "op: chunk_kda no grad (T=64)": lambda: cula.chunk_kda(qp, kp, vp, gp, bp, use_gate_in_kernel=True, **gate),
        "op: kda_prefill (B=1, T=512, H=64)": lambda: cula.kda_prefill(ql, kl, vl, gl, bl, use_gate_in_kernel=True,
                                                                       **gate_l),
        "piece: plan signature, kda_prefill (9 tensors, 14 scalars)": lambda: plans.signature(
            "kda_prefill", (qp, kp, vp, gp, bp, A_log, dt_bias, None, None), prefill_scalars),
        "piece: plan signature, kda_decode (9 tensors, 5 scalars)": lambda: plans.signature(
            "kda_decode", (q, k, v, g, beta, pool, idx, A_log, dt_bias), decode_scalars),
        "piece: launch.run_recurrent (one decode launch)": lambda: launch.run_recurrent(
            configs.MODE_FINAL, q, k, v, g, beta, pool, idx, A_log, dt_bias, scale=K ** -0.5, lower_bound=None,
            use_qk_l2norm_in_kernel=True),
        "piece: cula_sm90 prefill launcher of a plan (two launches)": lambda: launcher(*prefill_args),
        "piece: torch.empty_like(v) (T=64)": lambda: torch.empty_like(vp),
        "piece: TVM-FFI testing.nop, 25 int arguments": _nop_call(nop_args),
    }


def _nop_call(args: tuple) -> Callable[[], object]:
    import tvm_ffi

    nop = tvm_ffi.get_global_func("testing.nop")
    return lambda: nop(*args)


def measure(calls: int, runs: int, launch_mode: str = "nop") -> tuple[dict[str, float], Launches]:
    """(row name -> us per call, the launch stand-ins) with the stubs installed for the duration."""
    import warnings

    launches, remove = install(launch_mode)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a JIT notice or the like: not what this measures
            return {name: _best_us(fn, calls, runs) for name, fn in rows().items()}, launches
    finally:
        remove()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per run")
    ap.add_argument("--runs", type=int, default=5, help="runs per row; the best one is reported")
    ap.add_argument("--launch", choices=("nop", "check"), default="nop",
                    help="kernel stand-in: TVM-FFI's no-op (default) or a Python function that checks the argument "
                         "count")
    args = ap.parse_args(argv)
    import platform

    import torch

    torch.set_num_threads(1)
    times, launches = measure(args.calls, args.runs, args.launch)
    print(f"CPU host path, kernels stubbed ({args.launch}): NOT a GPU measurement. {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}; best of {args.runs} x {args.calls} calls\n")
    print("| call or piece | us per call |\n| --- | --- |")
    for name, us in times.items():
        print(f"| {name} | {us:.2f} |")
    print("\nkernels: " + ", ".join(f"{name} ({n} arguments)" for name, n in sorted(launches.arity.items())))
    if args.launch == "check":
        print(f"launches checked: {launches.count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
