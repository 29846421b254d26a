"""Run under compute-sanitizer by test_prefill_gpu.py::test_memcheck_clean_on_odd_shapes: odd lengths (1, 63, 65)
with GVA and states, a varlen batch with empty and 1-token sequences (host and device-only lengths), and a CP
run with an uneven split; a varlen batch and a CP run with 32 value heads (128-column stage-2 CTAs); 300 short
sequences (more stage-2 items than SMs); V-first states, serial and with CP. Prints
"cases ok" at the end; memcheck reports any out-of-bounds access."""

import os

import torch

from prefill_cases import gate_kwargs, make_raw


def main():
    os.environ["CULA_BACKEND"] = "sm90"
    import cula

    n = 0
    for T in (1, 63, 65):
        q, k, v, g, beta, A_log, dt_bias = make_raw(2, T, 1, 2, gate="safe", seed=T)
        cula.kda_prefill(q, k, v, g, beta, initial_state=torch.randn(2, 2, 128, 128, device="cuda"),
                         output_final_state=True, use_qk_l2norm_in_kernel=True, **gate_kwargs("safe", A_log, dt_bias))
        n += 1
    lens = [0, 1, 63, 0, 65, 130]
    cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, g, beta, A_log, dt_bias = make_raw(1, sum(lens), 2, 4, gate="softplus", seed=1)
    for host in (cu_cpu, None):
        cula.kda_prefill(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_cpu.cuda(), cu_seqlens_cpu=host,
                         use_qk_l2norm_in_kernel=True, **gate_kwargs("softplus", A_log, dt_bias))
        n += 1
    lens = [0, 1, 63, 0, 65, 130]  # the same batch through the tensor-core stage 1 (safe gate)
    cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, g, beta, A_log, dt_bias = make_raw(1, sum(lens), 2, 4, gate="safe", seed=3)
    cula.kda_prefill(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_cpu.cuda(), cu_seqlens_cpu=cu_cpu,
                     use_qk_l2norm_in_kernel=True, **gate_kwargs("safe", A_log, dt_bias))
    n += 1
    lens = [3000, 1, 0]
    cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, g, beta, A_log, dt_bias = make_raw(1, sum(lens), 2, 2, gate="safe", seed=2)
    cula.kda_prefill(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_cpu.cuda(), cu_seqlens_cpu=cu_cpu,
                     intracard_cp=True, use_qk_l2norm_in_kernel=True, **gate_kwargs("safe", A_log, dt_bias))
    n += 1
    # enough (sequence, head) pairs for 128-column stage-2 CTAs (forward.state_cols), serial and with CP
    for lens, cp in (([0, 1, 63, 0, 65, 130], False), ([3000, 1, 0], True)):
        cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v, g, beta, A_log, dt_bias = make_raw(1, sum(lens), 8, 32, gate="safe", seed=4)
        cula.kda_prefill(q, k, v, g, beta, initial_state=torch.randn(len(lens), 32, 128, 128, device="cuda"),
                         output_final_state=True, cu_seqlens=cu_cpu.cuda(), cu_seqlens_cpu=cu_cpu, intracard_cp=cp,
                         use_qk_l2norm_in_kernel=True, **gate_kwargs("safe", A_log, dt_bias))
        n += 1
    # more stage-2 items than SMs (1200 at HV = 4): persistent CTAs walk several, loading each next one ahead
    lens = [(29 * n) % 140 if n % 7 else 0 for n in range(300)]
    cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, g, beta, A_log, dt_bias = make_raw(1, sum(lens), 2, 4, gate="safe", seed=6)
    cula.kda_prefill(q, k, v, g, beta, initial_state=torch.randn(len(lens), 4, 128, 128, device="cuda"),
                     output_final_state=True, cu_seqlens=cu_cpu.cuda(), cu_seqlens_cpu=cu_cpu,
                     use_qk_l2norm_in_kernel=True, **gate_kwargs("safe", A_log, dt_bias))
    n += 1
    # V-first initial / final states (FLA's layout) indexed by stage 2 itself, serial and with CP
    for cp in (False, True):
        lens = [3000, 1, 0, 65]
        cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v, g, beta, A_log, dt_bias = make_raw(1, sum(lens), 2, 4, gate="safe", seed=5)
        cula.kda_prefill(q, k, v, g, beta, initial_state=torch.randn(len(lens), 4, 128, 128, device="cuda"),
                         output_final_state=True, cu_seqlens=cu_cpu.cuda(), cu_seqlens_cpu=cu_cpu, intracard_cp=cp,
                         state_v_first=True, use_qk_l2norm_in_kernel=True, **gate_kwargs("safe", A_log, dt_bias))
        n += 1
    torch.cuda.synchronize()
    print(f"{n} cases ok")


if __name__ == "__main__":
    main()
