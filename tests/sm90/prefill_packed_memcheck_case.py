"""Run under compute-sanitizer by test_prefill_packed_gpu.py::test_memcheck_clean_on_packed_tiles: the packed stage 1
(forward.prefill with pack_stage1=True) on batches of short sequences with empty ones, a single sequence, lengths at
multiples of 16 and 64 and a mix with long sequences, GVA, initial / final states; and the plain kda_prefill of 64
random lengths in 4096 tokens, which packs by the dispatch rule. Prints "cases ok" at the end; memcheck reports any
out-of-bounds access."""

import os

import torch

from prefill_cases import gate_kwargs, make_raw


def main():
    os.environ["CULA_BACKEND"] = "sm90"
    import cula
    from cula_sm90.prefill import forward

    n = 0
    for lens in ([1, 2, 15, 0, 3, 16, 0], [37], [16, 32, 48, 64, 80, 128, 5], [3000, 5, 70, 1, 129, 0, 63, 49]):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v, g, beta, A_log, dt_bias = make_raw(1, sum(lens), 2, 4, gate="safe", seed=n)
        h0 = torch.randn(len(lens), 4, 128, 128, device="cuda")
        forward.prefill(q, k, v, g, beta, A_log, dt_bias, h0, cu.cuda(), cu, scale=128 ** -0.5,
                        output_final_state=True, use_qk_l2norm_in_kernel=True, gate="safe", lower_bound=-5.0,
                        beta_activation="sigmoid", pack_stage1=True)
        n += 1
    gen = torch.Generator().manual_seed(64)
    cuts = torch.randperm(4095, generator=gen)[:63].add(1).sort().values.tolist()
    cu = torch.tensor([0, *cuts, 4096], dtype=torch.int32)
    assert forward.packing_pays(tuple((cu[1:] - cu[:-1]).tolist()))
    q, k, v, g, beta, A_log, dt_bias = make_raw(1, 4096, 2, 2, gate="safe", seed=9)
    cula.kda_prefill(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu,
                     use_qk_l2norm_in_kernel=True, **gate_kwargs("safe", A_log, dt_bias))
    n += 1
    torch.cuda.synchronize()
    print(f"{n} cases ok")


if __name__ == "__main__":
    main()
