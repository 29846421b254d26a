"""Host overhead per kernel launch and per public op call: the wall time of 1000 back-to-back calls of a tiny shape,
minus the GPU time of the same calls (replayed from a CUDA graph), per call, in microseconds.

    python -m tools.bench.host_overhead [--calls 1000] [--passes 3]

Rows: one decode kernel called alone (the configuration's TVM-FFI function from cula_core.cute_runtime, with the
addresses and scalars prepared once, torch's current stream read per call: what the launch layer costs per kernel
launch), the same kernel launched through cula-sm90's Python launcher (`launch.run_recurrent`: configuration lookup,
the output's allocation, the addresses and the current stream on every call), and the public ops (validation,
dispatch (a repeated call runs its plan: cula_core.plans), the launches): the decode ops, fused_recurrent_kda on a
pool (FLA's signature, as vLLM calls it), kda_prefill (softplus gate: the SIMT stage 1; safe gate: the tensor-core
one) and chunk_kda under no_grad (the sm90 prefill's two launches). Tiny shapes keep the GPU idle most of the time,
so that wall minus GPU is the host's share; the enqueue column times the calls alone without waiting for the GPU
(the B = 1, T = 512, H = 64 prefill row: its GPU part is the longer one). The last column counts the row's calls
that reached the compiled plan table and how many of them it served (`plan_table.stats`): a row whose calls are not
all served ran some through the Python plan.
"""

from __future__ import annotations

import argparse
import sys
import time


def _per_call(fn, calls: int, passes: int = 3) -> tuple[float, float, float]:
    """(wall us, GPU us, enqueue us) per call of fn. Enqueue: the host time of 200 calls issued on an idle GPU, without
    waiting for them (the launch queue does not fill up at a few launches per call), i.e. the host's time alone even
    where the GPU part is the longer one and wall - GPU reads ~0; the best of `passes` such passes, each after the
    GPU has drained."""
    import torch

    for _ in range(20):
        fn()
    enqueue = float("inf")
    for _ in range(passes):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        enqueue = min(enqueue, (time.perf_counter() - t0) / 200 * 1e6)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / calls * 1e6
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(100):
                fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls // 100):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    gpu = start.elapsed_time(end) * 1e3 / (calls // 100 * 100)
    return wall, gpu, enqueue


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--passes", type=int, default=3, help="enqueue passes of 200 calls; the best is reported")
    args = ap.parse_args(argv)
    import torch

    import cula
    from cula_core import cute_runtime as rt
    from cula_core.cute_runtime import plan_table
    from cula_sm90.decode import configs, launch

    dev, bf, H, K, N = "cuda", torch.bfloat16, 4, 128, 1
    q, k, v, g = (torch.randn(N, 1, H, K, device=dev, dtype=bf) * 0.1 for _ in range(4))
    beta = torch.rand(N, 1, H, device=dev, dtype=bf)
    pool = torch.zeros(4, H, K, K, device=dev)
    idx = torch.arange(N, dtype=torch.int32, device=dev)
    A_log, dt_bias = torch.zeros(H, device=dev), torch.zeros(H * K, device=dev)
    gate = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True)

    def kernel_launch():  # one decode kernel through launch.run_recurrent: configuration lookup, addresses, sizes,
        # stream and the TVM-FFI call (what a decode op adds on top is the next row)
        launch.run_recurrent(configs.MODE_FINAL, q, k, v, g, beta, pool, idx, A_log, dt_bias, scale=K ** -0.5,
                             lower_bound=None, use_qk_l2norm_in_kernel=True)

    # the same kernel called alone: the TVM-FFI function the runtime layer loaded (cula_core.cute_runtime) with the
    # addresses and scalars prepared once, as run_recurrent passes them for this batch (MODE_FINAL, softplus gate with
    # A_log and dt_bias, L2 norm, fp32 [K, V] pool, beta as given): what the launch layer itself costs per launch
    assert launch.gate_read_dtype(bf) is bf, "bf16 g / beta are read as they are (no conversion before the launch)"
    kernel = launch.recurrent_function(configs.MODE_FINAL, N, 1, K, K, H, bf, bf, bf, True, True, False, True,
                                       torch.float32, False)
    o_alone = torch.empty_like(v)
    alone_args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), A_log.data_ptr(),
                  dt_bias.data_ptr(), pool.data_ptr(), idx.data_ptr(), o_alone.data_ptr(), pool.data_ptr(),
                  N, H, H, pool.shape[0], K ** -0.5, 0.0, -1, 0, configs.BETA_SIGMOID["none"])

    def kernel_alone():  # the launch and torch's current stream (which every launch reads)
        kernel(*alone_args, rt.current_stream(0))

    # the row times the kernel run_recurrent launches, with its arguments: the same output from the same pool
    kernel_alone()
    o_ref, _ = launch.run_recurrent(configs.MODE_FINAL, q, k, v, g, beta, pool.zero_(), idx, A_log, dt_bias,
                                    scale=K ** -0.5, lower_bound=None, use_qk_l2norm_in_kernel=True)
    if not torch.equal(o_ref, o_alone):
        raise RuntimeError("host_overhead: the kernel called alone disagrees with launch.run_recurrent")

    qm, km, vm, gm = (torch.randn(N, 4, H, K, device=dev, dtype=bf) * 0.1 for _ in range(4))
    bm = torch.rand(N, 4, H, device=dev, dtype=bf)
    qp, kp, vp, gp = (torch.randn(1, 64, H, K, device=dev, dtype=bf) * 0.1 for _ in range(4))
    bp = torch.rand(1, 64, H, device=dev, dtype=bf)
    # the host-time shape of docs/sm90_prefill.md: B = 1, T = 512, H = 64 (its GPU part is the longer one: read
    # the enqueue column)
    HL = 64
    ql, kl, vl, gl = (torch.randn(1, 512, HL, K, device=dev, dtype=bf) * 0.1 for _ in range(4))
    bl = torch.rand(1, 512, HL, device=dev, dtype=bf)
    gate_l = dict(A_log=torch.zeros(HL, device=dev), dt_bias=torch.zeros(HL * K, device=dev),
                  use_qk_l2norm_in_kernel=True)

    rows = {
        "kernel launch alone: the compiled decode kernel (TVM-FFI function, arguments prepared once)": kernel_alone,
        "kernel launch: sm90 decode recurrent (launch.run_recurrent, TVM-FFI)": kernel_launch,
        "op: kda_decode (N=1, H=4)": lambda: cula.kda_decode(q, k, v, g, beta, pool, idx, **gate),
        "op: kda_decode_mtp (N=1, T=4)": lambda: cula.kda_decode_mtp(qm, km, vm, gm, bm, pool, idx, **gate),
        "op: kda_decode_mtp_kvbuffer (N=1, T=4)": lambda: cula.kda_decode_mtp_kvbuffer(qm, km, vm, gm, bm, pool, idx,
                                                                                       **gate),
        # FLA's signature as vLLM calls it (the pool in place through ssm_state_indices, int32 slots): a plan whose
        # program the compiled plan table runs
        "op: fused_recurrent_kda pool (N=1, H=4)": lambda: cula.fused_recurrent_kda(
            q, k, v, g, beta, A_log, dt_bias, initial_state=pool, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, ssm_state_indices=idx),
        "op: kda_prefill (T=64, 2 kernels)": lambda: cula.kda_prefill(qp, kp, vp, gp, bp, use_gate_in_kernel=True,
                                                                      **gate),
        # the safe gate (FlashKDA's configuration, issue 18's calls): the tensor-core stage 1, whose GPU part at this
        # size is short enough for wall - GPU to show the host's share
        "op: kda_prefill safe gate (T=64, 2 kernels)": lambda: cula.kda_prefill(
            qp, kp, vp, gp, bp, use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, **gate),
        # no input requires grad: the inference forward (the sm90 prefill's), no graph recorded
        "op: chunk_kda no grad (T=64, 2 kernels)": lambda: cula.chunk_kda(qp, kp, vp, gp, bp, use_gate_in_kernel=True,
                                                                          **gate),
        "op: kda_prefill (B=1, T=512, H=64)": lambda: cula.kda_prefill(ql, kl, vl, gl, bl, use_gate_in_kernel=True,
                                                                       **gate_l),
    }
    print(f"Card: {torch.cuda.get_device_name(0)}; {args.calls} back-to-back calls each\n")
    print("| call | wall us | GPU us | host overhead us (wall - GPU) | enqueue us | plan table: served / reached |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for name, f in rows.items():
        try:
            served, declined = plan_table.stats()
            wall, gpu, enqueue = _per_call(f, args.calls, args.passes)
            served, declined = (now - before for now, before in zip(plan_table.stats(), (served, declined)))
            print(f"| {name} | {wall:.1f} | {gpu:.1f} | {max(wall - gpu, 0.0):.1f} | {enqueue:.1f} | "
                  f"{served} / {served + declined} |", flush=True)
        except Exception as e:  # report the row and go on: the others still measure
            print(f"| {name} | error: {type(e).__name__}: {e} | | | | |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
