"""Run under compute-sanitizer by test_train_forward_gpu.py::test_memcheck_clean_with_residuals: the sm90 chunk_kda
kernel with save_residuals (stage 1 compiled with store_akk: Akk's 16-byte row stores) on odd lengths (1, 63, 65)
with GVA, a varlen batch with empty and 1-token sequences (host and device-only lengths) and 32 value heads. Prints
"cases ok" at the end; memcheck reports any out-of-bounds access."""

import torch

from prefill_cases import make_raw


def main():
    from cula_sm90.backend import backend

    run = backend.kernel("chunk_kda")
    kw = dict(scale=128 ** -0.5, use_qk_l2norm_in_kernel=True, gate="safe", lower_bound=-5.0,
              beta_activation="sigmoid", save_residuals=True)
    n = 0
    for T in (1, 63, 65):
        q, k, v, g, beta, A_log, dt_bias = make_raw(2, T, 1, 2, gate="safe", seed=T)
        h0 = torch.randn(2, 2, 128, 128, device="cuda")
        run(q, k, v, g, beta, A_log, dt_bias, h0, None, None, output_final_state=True, **kw)
        n += 1
    for lens, HQK, HV in (([0, 1, 63, 0, 65, 130], 2, 4), ([0, 1, 63, 0, 65, 130], 8, 32)):
        cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v, g, beta, A_log, dt_bias = make_raw(1, sum(lens), HQK, HV, gate="safe", seed=HV)
        for host in (cu_cpu, None):
            run(q, k, v, g, beta, A_log, dt_bias, None, cu_cpu.cuda(), host, output_final_state=True, **kw)
            n += 1
    torch.cuda.synchronize()
    print(f"{n} cases ok")


if __name__ == "__main__":
    main()
