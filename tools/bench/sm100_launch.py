"""Host cost of cula-sm100's kernel launches through cula_core.cute_runtime (TVM-FFI functions called with integer
addresses, the scalars and the raw stream handle).

    python -m tools.bench.sm100_launch [--out docs/benchmarks/sm100_launch.md]

Rows: chunk_wy_dqkg alone at B=1 T=256 HV=64 and B=2 T=256 HV=32 (H = 32 q/k heads; issue 8's host-bound rows), the
forward (`forward.launch.forward`: l2norm of q and of k, chunk_intra_wu_gate, chunk_delta_h, fwd_o) and the backward
(`backward.launch.chunk_kda_backward` with the forward's residuals) at B=1 T=1024 H=32 HV=32 (softplus gate in the
kernel, L2 norm), and the launch's own host cost per kernel (`runtime.launch` of chunk_wy_dqkg: 18 pointers, 5
scalars, the stream). Per call (microseconds):
  * host: time.perf_counter over a row's calls (200 launches or chunk_wy_dqkg calls, 40 forwards, 16 backwards: few
    enough that their launches stay under the CUDA launch queue's depth, so the host never waits for a free slot)
    queued behind a `torch.cuda._sleep` long enough to cover them, so the GPU is busy and the figure is the host's
    own time to issue a call (kernel launches and the torch ops between them), not the GPU's;
  * GPU: CUDA events around the same calls queued behind the sleep (the host ran ahead, so the GPU runs them back
    to back: the device time per call);
  * wall: the same number of calls then one synchronize, nothing queued before (what a training loop sees: about
    the larger of host and GPU time per call);
  * host idle: perf_counter around one call issued on an idle GPU (a synchronize before each, outside the timed
    part), over up to 50 calls: the host's time when nothing is queued, which the host column (many launches
    pending behind the sleep) may exceed.
Median over 5 repeats after 2 warm-ups.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench.harness import environment  # noqa: E402
from tools.bench.train_bwd import K, e2e_inputs, kernel_inputs  # noqa: E402

KW = dict(use_qk_l2norm_in_kernel=True, gate="softplus", lower_bound=None, beta_activation="none")


def wy_case(shape):
    from cula_sm100.backward import launch

    x, ctab, _ = kernel_inputs(shape)

    def call():
        launch.chunk_wy_dqkg(x["q"], x["k"], x["v"], x["v_new"], x["G"], x["beta"], x["A"], x["h"], x["do"], x["dh"],
                             x["dv"], ctab, scale=K ** -0.5)
    return call


def _e2e_args(shape):
    x = e2e_inputs(shape)
    return x, (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], None, x["cu"], x["cu_cpu"])


def forward_case(shape):
    from cula_sm100.forward import launch

    _, args = _e2e_args(shape)

    def call():
        launch.forward(*args, scale=K ** -0.5, output_final_state=False, **KW)
    return call


def backward_case(shape):
    from cula_sm100.backward import launch
    from cula_sm100.forward import launch as fwd

    x, args = _e2e_args(shape)
    _o, _ht, res = fwd.chunk_kda(*args, scale=K ** -0.5, output_final_state=False, save_residuals=True, **KW)

    def call():
        launch.chunk_kda_backward(x["do"], None, *args, scale=K ** -0.5, residuals=res, **KW)
    return call


def launch_case(shape):
    """chunk_wy_dqkg's launch alone (runtime.launch: the kernel resolved for the device's arch, the addresses
    checked, the TVM-FFI call), without the stage function's output allocations."""
    from cula_sm100 import runtime
    from cula_sm100.backward import launch

    x, ctab, _ = kernel_inputs(shape)
    TT, HQK, HV = x["q"].shape[0], x["q"].shape[1], x["v"].shape[1]
    dq, dk = (torch.empty(TT, HQK, K, device="cuda") for _ in range(2))
    outs = (dq, dk, torch.empty_like(x["v"]), torch.empty(TT, HV, K, device="cuda"), torch.empty(TT, HV, device="cuda"),
            torch.empty(TT, HV, 64, device="cuda"))
    tensors = (x["q"], x["k"], x["v"], x["v_new"], x["G"], x["beta"], x["A"], x["h"], x["do"], x["dh"], x["dv"], *outs,
               ctab)
    scalars = (TT, ctab.shape[0], HQK, HV, K ** -0.5)
    kernel = launch.wy_dqkg_kernel()

    def call():
        runtime.launch(kernel, launch.WY_DTYPES, tensors, scalars)
    return call


# (call, shape, inputs and callable, calls per timed loop)
ROWS = [("launch (chunk_wy_dqkg)", dict(B=1, T=256, HV=64), launch_case, 200),
        ("chunk_wy_dqkg", dict(B=1, T=256, HV=64), wy_case, 200),
        ("chunk_wy_dqkg", dict(B=2, T=256, HV=32), wy_case, 200),
        ("forward", dict(B=1, T=1024, HV=32), forward_case, 40),
        ("backward", dict(B=1, T=1024, HV=32), backward_case, 16)]


def _sleep_for(seconds: float) -> None:
    """Keep the GPU busy for at least about `seconds`: torch.cuda._sleep spins a number of cycles, counted here at
    2 GHz (above the H100's and H200's clocks, so the sleep only lasts longer)."""
    torch.cuda._sleep(int(seconds * 2e9))


def measure(call, calls: int):
    """(host us, GPU us, wall us, host idle us) per call, medians of 5 after 2 warm-up repeats."""
    host, gpu, wall, idle = [], [], [], []
    for rep in range(7):
        # host and GPU: calls queued behind a sleep that outlasts issuing them
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        one = time.perf_counter() - t0  # a single call's wall time bounds its host time
        _sleep_for(2.0 * one * calls + 0.005)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        # wall: a loop of calls and one synchronize
        t2 = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        # host idle: one call at a time on an idle GPU, the synchronize outside the timed part
        alone = 0.0
        for _ in range(min(calls, 50)):
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            call()
            alone += time.perf_counter() - t4
        torch.cuda.synchronize()
        if rep >= 2:
            host.append((t1 - t0) / calls * 1e6)
            gpu.append(start.elapsed_time(end) / calls * 1e3)
            wall.append((t3 - t2) / calls * 1e6)
            idle.append(alone / min(calls, 50) * 1e6)
    return tuple(statistics.median(x) for x in (host, gpu, wall, idle))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    a = ap.parse_args(argv)

    env = environment("cuda")
    lines = [f"Device: {env.get('gpu', '?')} (torch {env['torch']}, cula-sm100 {env.get('cula-sm100', '?')}).",
             f"Command: `python -m tools.bench.sm100_launch {' '.join(argv if argv is not None else sys.argv[1:])}`",
             "", "Microseconds per call. host: perf_counter over calls queued behind a GPU sleep (the host's own "
             "time); GPU: CUDA events over the same calls (device time); wall: a loop of calls and one synchronize; "
             "host idle: one call at a time on an idle GPU. Median of 5.", "",
             "| call | shape | host | GPU | wall | host idle |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    print("\n".join(lines), flush=True)
    for name, shape, make, calls in ROWS:
        call = make(shape)
        call()  # loads (or compiles) the kernels outside the timed loops
        host, gpu, wall, idle = measure(call, calls)
        row = (f"| {name} | B={shape['B']} T={shape['T']} H=32 HV={shape['HV']} | {host:.1f} | {gpu:.1f} | {wall:.1f} "
               f"| {idle:.1f} |")
        lines.append(row)
        print(row, flush=True)
    if a.out is not None:
        a.out.write_text("# sm100 kernel launches through cula_core.cute_runtime\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
