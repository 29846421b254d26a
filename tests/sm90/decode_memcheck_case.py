"""Run under compute-sanitizer by test_decode_gpu.py::test_memcheck_clean_on_odd_batches: every decode kernel (final
state, per-token states, verify, flush with a per-request and a broadcast m, all-layers flush) on odd batches N in
{1, 5} with padded slots (-1) and an out-of-range slot (= P), T in {1, 3}, K = V in {64, 128}, GVA 2; every tiling
the dispatch can pick and the chunk-form verify (every chunk variant, T in {1, 3, 9}), each named through the sm90
kernels' `tiling` / `verify_variant` keywords (K = V = 64 through the kernels directly as well); the streamed
single-token decode on K-first fp32 / bf16 and V-first bf16 pools at HV = 8 and the first N past the pool form's
threshold (configs.stream_min_heads: a batch it serves, many work items per CTA; V-first fp32 pools run it at any
size); fused_recurrent_kda's slot mode (a slot per token, with and without
num_accepted_tokens, padded rows, negative and out-of-range write slots, counts outside [1, T_idx]) on fp32 / bf16,
K-first / V-first pools.
Prints "cases ok" at the end; memcheck reports any out-of-bounds or misaligned access."""

import sys

import torch

from decode_cases import backend, kernel_call, make_case, serving_pool

import cula_core
from cula_sm90.decode import configs
from cula_sm90.decode.ops import KERNELS


def run_case(kw, T, N, public: bool):
    """Every kernel once: through the public ops (K = V = 128, served) or the kernels directly (K = V = 64)."""
    m = torch.arange(N, dtype=torch.int32, device="cuda") % (T + 1)
    pools = [kw["state_pool"], kw["state_pool"].clone()]
    if public:
        cula_core.kda_decode_mtp(**kw)
        cula_core.kda_decode_mtp(**kw, output_per_token_states=True)
        _, buf = cula_core.kda_decode_mtp_kvbuffer(**kw)
        pool_kw = {name: kw[name] for name in ("state_v_first", "null_slot") if name in kw}
        cula_core.kda_flush_kvbuffer(kw["state_pool"], kw["cache_idx"], buf, m, **pool_kw)
        cula_core.kda_flush_kvbuffer(kw["state_pool"], kw["cache_idx"], buf, T, **pool_kw)
        cula_core.kda_flush_kvbuffer_all_layers(pools, kw["cache_idx"], [buf, buf.clone()], m, **pool_kw)
    else:
        kernel_call("kda_decode_mtp", kw, output_per_token_states=False)
        kernel_call("kda_decode_mtp", kw, output_per_token_states=True)
        _, buf = kernel_call("kda_decode_mtp_kvbuffer", kw)
        KERNELS["kda_flush_kvbuffer"](kw["state_pool"], kw["cache_idx"], buf, m, 0)
        KERNELS["kda_flush_kvbuffer"](kw["state_pool"], kw["cache_idx"], buf, None, T)
        KERNELS["kda_flush_kvbuffer_all_layers"](pools, kw["cache_idx"], [buf, buf.clone()], m, 0)


def run_slots(N, T, pool_dtype, v_first, seed):
    """fused_recurrent_kda with a slot table [N, T + 1] on a pool of N (T + 1) + 1 slots: row 1 padded (its read
    slot -1), a negative and an out-of-range (= P) write slot, counts 0 and T + 2 (clamped by the kernel: device
    values are not checked on the host), with the counts and without."""
    gen = torch.Generator().manual_seed(seed)
    HQK, HV, K = 1, 2, 128
    r = lambda *s: torch.randn(*s, generator=gen).cuda()  # noqa: E731
    cols = T + 1
    P = N * cols + 1
    pool = (r(P, HV, K, K) * 0.1).to(pool_dtype)
    table = torch.arange(N * cols, dtype=torch.int32).reshape(N, cols)
    table[1 % N, :] = -1
    table[0, T - 1] = P
    table[N - 1, 0] = -1
    counts = (torch.arange(N, dtype=torch.int32) + cols + 1) % (cols + 2)   # cols + 1, 0, 1, 2, ...
    kw = dict(q=r(N, T, HQK, K), k=r(N, T, HQK, K), v=r(N, T, HV, K), g=r(N, T, HV, K), beta=r(N, T, HV).sigmoid(),
              A_log=r(HV), dt_bias=r(HV * K), use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
              initial_state=pool, ssm_state_indices=table.cuda(), state_v_first=v_first)
    cula_core.fused_recurrent_kda(**kw)
    cula_core.fused_recurrent_kda(**kw, num_accepted_tokens=counts.cuda())


def main(parts=("all", "tilings", "verify", "pools", "stream", "slots")):
    """parts: "all" (every kernel on odd batches), "tilings" (every dispatched tiling), "verify" (the chunk-form
    verify, every chunk variant), "pools" (bf16 / V-first pools with a null slot), "stream" (the streamed
    single-token decode on a batch it serves), "slots" (fused_recurrent_kda's slot mode); the test runs all six, a
    quick check may name some
    (python decode_memcheck_case.py verify)."""
    n = 0
    with backend():
        for K in ((64, 128) if "all" in parts else ()):
            for N in (1, 5):
                for T in (1, 3):
                    kw = make_case(N, T, 1, 2, K=K, V=K, safe=bool(T % 2), out_of_range=True, extra_slots=1,
                                   seed=N * 10 + T)
                    run_case(kw, T, N, public=K == 128)
                    n += 1
        # every tiling the dispatch can pick (the loop above ran the one for these sizes), on an odd batch
        for tiling in (configs.dispatched_tilings() if "tilings" in parts else ()):
            for T in (1, 3):
                kw = make_case(5, T, 1, 2, out_of_range=True, extra_slots=1, seed=70 + T)
                kernel_call("kda_decode_mtp", kw, output_per_token_states=False, tiling=tiling)
                kernel_call("kda_decode_mtp", kw, output_per_token_states=True, tiling=tiling)
                kernel_call("kda_decode_mtp_kvbuffer", kw, tiling=tiling)
                n += 1
        # the chunk-form verify, every chunk variant, K = V = 128 and 64
        for name in (configs.VERIFY_VARIANTS[1:] if "verify" in parts else ()):
            for K in (64, 128):
                for N, T in ((1, 1), (5, 3), (5, 9)):
                    kw = make_case(N, T, 1, 2, K=K, V=K, out_of_range=True, extra_slots=1, seed=90 + T)
                    kernel_call("kda_decode_mtp_kvbuffer", kw, verify_variant=name)
                    n += 1
        # serving pools: bf16 and V-first, padded through a null slot (every kernel, public ops)
        for dtype, v_first in ((torch.bfloat16, False), (torch.float32, True), (torch.bfloat16, True)):
            for N, T in ((1, 1), (5, 3), (5, 9)) if "pools" in parts else ():
                kw = make_case(N, T, 1, 2, extra_slots=2, seed=110 + T)
                free = sorted(set(range(kw["state_pool"].shape[0])) - set(kw["cache_idx"].tolist()))[0]
                kw = serving_pool(kw, dtype, v_first, null_slot=free)
                run_case(kw, T, N, public=True)
                n += 1
        # the streamed single-token decode at a batch it serves (N * HV >= stream_min_heads) on the pool forms with
        # a threshold (the V-first fp32 pools above run it at any size), padded and out-of-range slots, K = V = 128
        # (public op) and 64
        for dtype, v_first in (((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True))
                               if "stream" in parts else ()):
            N = configs.stream_min_heads(dtype.itemsize, v_first) // 8 + 1
            for K in (64, 128):
                kw = serving_pool(make_case(N, 1, 2, 8, K=K, V=K, out_of_range=True, extra_slots=1, seed=150), dtype,
                                  v_first)
                assert configs.streams(configs.MODE_FINAL, 1, N, 8, v_first, dtype.itemsize)
                if K == 128:
                    cula_core.kda_decode_mtp(**kw)
                else:
                    kernel_call("kda_decode_mtp", kw, output_per_token_states=False)
                n += 1
        # fused_recurrent_kda's slot mode, every pool variant, on odd batches
        for dtype, v_first in ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True),
                               (torch.bfloat16, True)):
            for N, T in ((1, 1), (5, 3)) if "slots" in parts else ():
                run_slots(N, T, dtype, v_first, seed=130 + T)
                n += 1
    torch.cuda.synchronize()
    print(f"{n} cases ok")


if __name__ == "__main__":
    main(tuple(sys.argv[1:]) or ("all", "tilings", "verify", "pools", "stream", "slots"))
