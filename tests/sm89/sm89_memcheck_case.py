"""Run under compute-sanitizer by test_sm89_prefill_gpu.py::test_memcheck_clean_on_odd_shapes: every (K, C) on the
odd lengths T = 1, 63, 65 (fixed length, with initial and final states) and a varlen batch with an empty
sequence. Prints "cases ok" at the end; memcheck reports any out-of-bounds or misaligned access."""

import torch

from sm89_cases import CONFIGS, make_inputs

from cula_sm89.ops import prefill


def main():
    n = 0
    for K, C in CONFIGS:
        for T in (1, 63, 65):
            q, k, v, g, beta = make_inputs(2, T, 1, 2, K, seed=T)
            h0 = torch.randn(2, 2, K, K, device="cuda")
            for tile in (16, 32):
                prefill(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=C,
                        return_intermediates=True, debug_scores=True, state_tile=tile)
                n += 1
        cu = torch.tensor([0, 1, 1, 64, 129], dtype=torch.int32, device="cuda")
        q, k, v, g, beta = make_inputs(1, 129, 1, 2, K, seed=C)
        prefill(q, k, v, g, beta, initial_state=torch.randn(4, 2, K, K, device="cuda"), output_final_state=True,
                cu_seqlens=cu, chunk_size=C)
        n += 1
    torch.cuda.synchronize()
    print(f"{n} cases ok")


if __name__ == "__main__":
    main()
