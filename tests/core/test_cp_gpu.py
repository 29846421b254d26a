"""Context parallelism across GPUs (`cula_core.context_parallel`) on the installed GPU backends: two ranks, one GPU
each, NCCL (``NCCL_NVLS_ENABLE=0``), a varlen batch whose long sequence runs through both ranks among short ones.
Each rank also runs the single-GPU `chunk_kda` of the whole batch on its own GPU and compares its rows: outputs and
final states without grad (also with the call on a stream of the caller's), outputs and every gradient with grad
(A_log / dt_bias summed over the ranks).

Bound: CP_TOL on max |cp - single| / max |single|, bf16 (the 4 x H200 bench measured at most 1.1e-2 with the safe
gate: docs/benchmarks/multi_gpu_cp.md). Two gates: the benchmark's safe gate (lower_bound = -5: the state maps
nearly vanish across a rank), and a mild precomputed gate, under which the state carried across the ranks matters.
Needs two CUDA devices."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

CP_TOL = 3e-2
H, K = 4, 128
PART = 4096  # tokens per rank
LENGTHS = [300, 2 * PART - 300 - 3 * 500, 500, 500, 500]  # sequence 1 runs through both ranks
NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(device, gate):
    gen = torch.Generator(device="cpu").manual_seed(7)

    def r(*shape, dtype=torch.bfloat16, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(device=device, dtype=dtype)

    T = sum(LENGTHS)
    x = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, K), beta=r(1, T, H).sigmoid(),
             A_log=r(H, dtype=torch.float32, s=0.5), dt_bias=r(H * K, dtype=torch.float32, s=0.5))
    if gate == "safe":
        x["g"] = r(1, T, H, K)
        opts = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)
    else:  # a precomputed log decay of about -1e-3 per token: the state lives across thousands of tokens
        x["g"] = (-1e-3 * torch.rand(1, T, H, K, generator=gen)).to(device=device, dtype=torch.bfloat16)
        opts = dict(use_gate_in_kernel=False)
    return x, dict(use_qk_l2norm_in_kernel=True, **opts)


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _worker(rank, world, port, gate, result_dir):
    import torch.distributed as dist

    import cula_core
    from cula_core.context_parallel import build_cp_context

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0", CULA_STRICT="1")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        x, opts = _inputs(device, gate)
        bounds = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
        gen = torch.Generator(device="cpu").manual_seed(8)
        do = torch.randn(1, sum(LENGTHS), H, K, generator=gen).to(device, torch.bfloat16)
        a, b = rank * PART, (rank + 1) * PART
        ctx = build_cp_context(bounds.to(device), dist.group.WORLD, cu_seqlens_cpu=bounds)

        def call(t, **kw):
            return cula_core.chunk_kda(*(t[n] for n in NAMES[:5]), A_log=t["A_log"], dt_bias=t["dt_bias"], **opts,
                                       **kw)

        errs = {}
        # inference: outputs and the final states of the sequences this rank holds
        with torch.no_grad():
            o_ref, ht_ref = call(x, cu_seqlens=bounds.to(device), cu_seqlens_cpu=bounds, output_final_state=True)
            loc = {n: (x[n][:, a:b] if n in NAMES[:5] else x[n]) for n in NAMES}
            o, ht = call(loc, cp_context=ctx, output_final_state=True)
        errs["o (no grad)"] = _rel(o, o_ref[:, a:b])
        # rank 0 holds sequence 0 and the head of sequence 1 (its row there is the state entering rank 1); rank 1
        # the tail of sequence 1 and sequences 2-4: those rows are the single call's final states
        errs["final states"] = _rel(ht[:1], ht_ref[:1]) if rank == 0 else _rel(ht, ht_ref[1:])
        # the same call on a stream of the caller's, its inputs copied on that stream just before: the identity
        # run (on cula's side stream) must wait for the caller's stream, not the default one
        caller = torch.cuda.Stream(device)
        caller.wait_stream(torch.cuda.current_stream(device))
        with torch.no_grad(), torch.cuda.stream(caller):
            fresh = {n: t.clone() for n, t in loc.items()}
            o_caller, _ = call(fresh, cp_context=ctx, output_final_state=True)
        torch.cuda.current_stream(device).wait_stream(caller)
        errs["o (no grad, caller's stream)"] = _rel(o_caller, o_ref[:, a:b])
        # training: outputs and gradients
        wrt = NAMES if gate == "safe" else NAMES[:5]  # A_log / dt_bias are not read with a precomputed gate
        leaves = {n: x[n].detach().clone().requires_grad_() for n in NAMES}
        o_ref = call(leaves, cu_seqlens=bounds.to(device), cu_seqlens_cpu=bounds)[0]
        ref = dict(zip(wrt, torch.autograd.grad(o_ref, [leaves[n] for n in wrt], do), strict=True))
        loc = {n: (x[n][:, a:b] if n in NAMES[:5] else x[n]).detach().clone().requires_grad_() for n in NAMES}
        o = call(loc, cp_context=ctx)[0]
        grads = dict(zip(wrt, torch.autograd.grad(o, [loc[n] for n in wrt], do[:, a:b]), strict=True))
        errs["o"] = _rel(o, o_ref[:, a:b])
        for n in wrt:
            if n in NAMES[:5]:
                errs["d" + n] = _rel(grads[n], ref[n][:, a:b])
            else:  # each rank holds the gradient of its own tokens: their sum is the single call's
                summed = grads[n].clone()
                dist.all_reduce(summed)
                errs["d" + n] = _rel(summed, ref[n])
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(errs, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("gate", ["safe", "mild precomputed"])
def test_cp_over_two_gpus_matches_the_single_gpu_call(gate, tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), gate, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        errs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        print(f"CP_GPU_ERR {gate} rank {rank}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
        assert all(e <= CP_TOL for e in errs.values()), (rank, errs)
