"""Context parallelism across ranks (`cula_core.context_parallel`) on CPU: gloo process groups of 2 and 4 ranks
(torch.multiprocessing spawn), reference backend, fp64, against single-process `cula_core.chunk_kda` runs.

The single-process comparison is the global call run slot by slot in one process: each slot's tokens go
through `chunk_kda` from the previous slot's final state (checked equal to the unsplit global call), which
also yields the boundary states a rank returns for sequences that go on, so a loss on every output a rank
returns (o and all its final-state rows) has an exact single-process counterpart. Every rank compares its
outputs, final states and the gradients of q, k, v, g, beta, A_log, dt_bias and initial_state.

With the test-only backend `cpusaver` (tests/fixtures/cula-testbackend: the reference math, residuals saved by its
forward and recorded by its backward) the same checks run on a backend that hands residuals over, as the GPU
training backend does, and each rank's CP call is also held to its plan: one chunk_kda forward (the local run,
asking for residuals), the identity run as a kda_prefill call (`cpuecho` serves that op there: a kernel serves it,
so CP takes it, as it takes the sm90 prefill with its intra-card CP on Hopper) and one backward, which receives the
local run's residuals.
"""

from __future__ import annotations

import importlib
import itertools
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cula_core
from cula_core.context_parallel import CPContext, build_cp_context, chunk_kda_cp
from cula_core.reference import chunk_kda_reference, piece_affine_map
from cula_core.reference.context_parallel import (
    apply_state_maps,
    apply_state_maps_adjoint,
    initial_state_response,
)

TOL = 1e-9  # fp64 throughout: any algebra error shows far above this


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _global_inputs(lengths, HQK, HV, K, V, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * s)

    x = dict(q=r(1, T, HQK, K), k=r(1, T, HQK, K), v=r(1, T, HV, V), g=r(1, T, HV, K), beta=r(1, T, HV),
             A_log=r(HV, s=0.5), dt_bias=r(HV * K), h0=r(len(lengths), HV, K, V, s=0.3))
    weights = dict(o=r(1, T, HV, V), ht=r(len(lengths), HV, K, V))
    return x, weights


OPTS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def _slot_ranges(total, world, layout):
    n = world if layout == "contiguous" else 2 * world
    part = total // n
    return [(i * part, (i + 1) * part) for i in range(n)]


def _rank_slots(rank, world, layout):
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def _chained_single_process(x, lengths, world, layout):
    """The global call, slot by slot in one process; returns per slot (o, final states, sequence ids)."""
    bounds = [0, *itertools.accumulate(lengths)]
    carry = {}
    per_slot = []
    for a, b in _slot_ranges(bounds[-1], world, layout):
        seqs = [i for i in range(len(lengths)) if bounds[i] < b and bounds[i + 1] > a]
        local = [0] + [min(bounds[i + 1], b) - a for i in seqs]
        h0 = torch.stack([carry[i] if bounds[i] < a else x["h0"][i] for i in seqs])
        cu = torch.tensor(local, dtype=torch.int32)
        o, ht = cula_core.chunk_kda(*(x[n][:, a:b] for n in ("q", "k", "v", "g", "beta")), initial_state=h0,
                                    output_final_state=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
                                    cu_seqlens=cu, cu_seqlens_cpu=cu, **OPTS)
        carry.update({i: ht[j] for j, i in enumerate(seqs)})
        per_slot.append((o, ht, seqs))
    return per_slot


def _leaves(x):
    return {n: t.clone().requires_grad_(True) for n, t in x.items()}


def _worker(rank, world, port, lengths, layout, HQK, HV, K, V, check_no_grad, result_dir, saver_dir, block):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    if block is not None:  # R S_in and R^T do formed a few tokens at a time: several slices per boundary sequence
        cula_core.context_parallel.RESPONSE_BLOCK = block
    saver = None
    if saver_dir is not None:  # the test-only backends on this process's path, found by the registry
        sys.path.insert(0, saver_dir)
        importlib.invalidate_caches()
        cula_core.registry.reload()
        from cula_testbackend.backends import CpuEcho, CpuSaver as saver
        saver.prefill_backend = CpuEcho
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _check_rank(rank, world, lengths, layout, HQK, HV, K, V, check_no_grad, saver)
        dist.barrier()  # no rank tears down its connections while a peer still uses them
    finally:
        dist.destroy_process_group()
    open(os.path.join(result_dir, f"rank{rank}.ok"), "w").close()
    # every check passed: leave without the interpreter's teardown, where gloo's threads now and then abort the
    # process ("terminate called without an active exception", SIGABRT) after the work is done
    os._exit(0)


def _check_rank(rank, world, lengths, layout, HQK, HV, K, V, check_no_grad, saver):
    x, w = _global_inputs(lengths, HQK, HV, K, V, seed=7)
    bounds = [0, *itertools.accumulate(lengths)]
    # -- single process: the unsplit call, and the same call slot by slot
    ref = _leaves(x)
    per_slot = _chained_single_process(ref, lengths, world, layout)
    o_whole, ht_whole = cula_core.chunk_kda(
        *(ref[n] for n in ("q", "k", "v", "g", "beta")), initial_state=ref["h0"], output_final_state=True,
        A_log=ref["A_log"], dt_bias=ref["dt_bias"], cu_seqlens=torch.tensor(bounds, dtype=torch.int32), **OPTS)
    torch.testing.assert_close(torch.cat([o for o, _, _ in per_slot], 1), o_whole, rtol=TOL, atol=TOL)
    slots = _rank_slots(rank, world, layout)
    ranges = _slot_ranges(bounds[-1], world, layout)
    mine = [per_slot[s] for s in slots]
    o_ref = torch.cat([o for o, _, _ in mine], 1)
    ht_ref = torch.cat([ht for _, ht, _ in mine])
    seq_ids = [i for _, _, seqs in mine for i in seqs]

    def local_loss(o, ht, held):
        w_o = torch.cat([w["o"][:, ranges[s][0]:ranges[s][1]] for s in held], 1)
        w_ht = w["ht"][[i for s in held for i in per_slot[s][2]]]
        return (o * w_o).sum() + (ht * w_ht).sum()

    # the single-process loss is the sum of every rank's local loss
    total = 0
    for r in range(world):
        held = _rank_slots(r, world, layout)
        total = total + local_loss(torch.cat([per_slot[s][0] for s in held], 1),
                                   torch.cat([per_slot[s][1] for s in held]), held)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")
    ref_grads = dict(zip(names, torch.autograd.grad(total, [ref[n] for n in names]), strict=True))

    # -- this rank: its tokens and the context built from the global offsets
    ctx = build_cp_context(torch.tensor(bounds, dtype=torch.int32), dist.group.WORLD, layout=layout)
    cpu = ctx.cu_seqlens_cpu.tolist()
    assert cpu[-1] == sum(b - a for a, b in (ranges[s] for s in slots))
    loc = _leaves({n: torch.cat([x[n][:, a:b] for a, b in (ranges[s] for s in slots)], 1)
                   for n in ("q", "k", "v", "g", "beta")})
    loc["A_log"], loc["dt_bias"] = (x[n].clone().requires_grad_(True) for n in ("A_log", "dt_bias"))
    # rows of sequences that come from an earlier slot are garbage: they must be ignored
    starts_here = [bounds[i] >= ranges[s][0] for s, (_, _, seqs) in zip(slots, mine, strict=True) for i in seqs]
    h0_local = torch.stack([x["h0"][i] if fresh else torch.full_like(x["h0"][i], 1e3)
                            for i, fresh in zip(seq_ids, starts_here, strict=True)])
    loc["h0"] = h0_local.requires_grad_(True)

    def call():
        # through the public op, as a training script calls it: chunk_kda hands cp_context calls to chunk_kda_cp
        return cula_core.chunk_kda(*(loc[n] for n in ("q", "k", "v", "g", "beta")), cp_context=ctx,
                                   initial_state=loc["h0"], output_final_state=True, A_log=loc["A_log"],
                                   dt_bias=loc["dt_bias"], **OPTS)

    if check_no_grad:  # inference: forward collectives only
        with torch.no_grad():
            o, ht = call()
        torch.testing.assert_close(o, o_ref.detach(), rtol=TOL, atol=TOL)
        torch.testing.assert_close(ht, ht_ref.detach(), rtol=TOL, atol=TOL)
    if saver is not None:
        saver.forwards, saver.seen = [], []
        prefills = saver.prefill_backend.calls
    o, ht = call()
    torch.testing.assert_close(o, o_ref.detach(), rtol=TOL, atol=TOL)
    torch.testing.assert_close(ht, ht_ref.detach(), rtol=TOL, atol=TOL)
    loss = local_loss(o, ht, slots)
    grads = dict(zip(names, torch.autograd.grad(loss, [loc[n] for n in names]), strict=True))
    if saver is not None:
        # the local run (residuals asked), the identity run as a kda_prefill call without intra-card CP (it runs
        # beside the local run), no rerun; the one backward gets the local run's residuals (cpusaver fills Aqk
        # with the sum of the q it was given: this rank's q)
        assert saver.forwards == [True], saver.forwards
        assert saver.prefill_backend.calls == prefills + 1
        assert saver.prefill_backend.last_intracard_cp == "off", saver.prefill_backend.last_intracard_cp
        assert len(saver.seen) == 1 and saver.seen[0] is not None, saver.seen
        assert torch.all(saver.seen[0][0] == float(loc["q"].detach().sum()))
    for n in ("q", "k", "v", "g", "beta"):
        expect = torch.cat([ref_grads[n][:, a:b] for a, b in (ranges[s] for s in slots)], 1)
        torch.testing.assert_close(grads[n], expect, rtol=TOL, atol=TOL, msg=lambda m, n=n: f"d{n}: {m}")
    # per-head parameters: each rank holds the gradient of its own tokens; their sum is the global one
    for n in ("A_log", "dt_bias"):
        summed = grads[n].clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(summed, ref_grads[n], rtol=TOL, atol=TOL, msg=lambda m, n=n: f"d{n}: {m}")
    expect_h0 = torch.stack([ref_grads["h0"][i] if fresh else torch.zeros_like(ref_grads["h0"][i])
                             for i, fresh in zip(seq_ids, starts_here, strict=True)])
    torch.testing.assert_close(grads["h0"], expect_h0, rtol=TOL, atol=TOL)


def _spawn(world, lengths, layout, tmp_path, HQK=1, HV=2, K=8, V=8, check_no_grad=False, saver_dir=None,
           block=None):
    mp.spawn(_worker, args=(world, _free_port(), lengths, layout, HQK, HV, K, V, check_no_grad, str(tmp_path),
                            saver_dir, block), nprocs=world, join=True)
    assert sorted(os.listdir(tmp_path)) == [f"rank{r}.ok" for r in range(world)]


def test_two_ranks_varlen_sequences_crossing(tmp_path):
    # slots of 96 tokens: rank 0 holds sequence 0 and the start of 1; rank 1 the rest of 1 and sequence 2
    _spawn(2, [40, 100, 52], "contiguous", tmp_path, check_no_grad=True)


def test_four_ranks_one_sequence_through_a_middle_rank(tmp_path):
    # slots of 96: sequence 1 ([10, 260)) covers all of rank 1 and goes on into rank 2; sequence 2 crosses 2 -> 3
    _spawn(4, [10, 250, 60, 64], "contiguous", tmp_path, HQK=2, HV=4, K=8, V=4)


def test_two_ranks_zigzag(tmp_path):
    # slots of 32: sequence 0 runs through slots 0, 1, 2 (ranks 0, 1, 1) and ends in slot 3 (rank 0's back part)
    _spawn(2, [100, 28], "zigzag", tmp_path)


def test_four_ranks_response_in_slices(tmp_path):
    # as the middle-rank case, with R S_in and R^T do formed 7 tokens at a time (a last slice shorter than the
    # others); inference checked as well
    _spawn(4, [10, 250, 60, 64], "contiguous", tmp_path, HQK=2, HV=4, K=8, V=4, check_no_grad=True, block=7)


def test_ranks_on_a_backend_that_saves_residuals(tmp_path_factory):
    # K = 8: served by cpusaver; rank 1 holds only the middle of sequence 1, which goes on into rank 2
    target = tmp_path_factory.mktemp("testbackend")
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "cula-testbackend"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "--target",
                    str(target), str(fixture)], check=True)
    result_dir = tmp_path_factory.mktemp("ranks")
    _spawn(4, [10, 250, 60, 64], "contiguous", result_dir, saver_dir=str(target))


# ---------------------------------------------------------------------------------------------------------
# single-process checks: the context's metadata, argument errors, the reference identities used above
# ---------------------------------------------------------------------------------------------------------


def test_context_metadata_of_each_rank():
    cu = torch.tensor([0, 10, 260, 320, 384], dtype=torch.int32)
    got = [build_cp_context(cu, None, rank=r, world_size=4) for r in range(4)]
    assert [c.cu_seqlens_cpu.tolist() for c in got] == [[0, 10, 96], [0, 96], [0, 68, 96], [0, 32, 96]]
    assert [(c.pre_num_ranks, c.post_num_ranks) for c in got] == [(0, 2), (1, 1), (2, 1), (1, 0)]
    assert [(c.is_first_rank, c.is_last_rank) for c in got] == [(True, False), (False, False), (False, False),
                                                               (False, True)]
    assert [c.pre_num_conv_tokens for c in got] == [0, 86, 182, 28]
    zig = [build_cp_context(torch.tensor([0, 100, 128]), None, layout="zigzag", rank=r, world_size=2)
           for r in range(2)]
    assert zig[0].cu_seqlens_cpu.tolist() == [0, 32, 36, 64] and zig[0].front_num_seqs == 1
    assert zig[0].pre_num_ranks_by_part == (0, 3) and zig[0].post_num_ranks_by_part == (3, 0)
    assert zig[1].cu_seqlens_cpu.tolist() == [0, 32, 64] and zig[1].pre_num_ranks_by_part == (1, 2)


def test_context_rejects_bad_partitions():
    with pytest.raises(ValueError, match="total token count 10 must be a positive multiple of the 4 slots"):
        build_cp_context(torch.tensor([0, 10]), None, rank=0, world_size=4)
    with pytest.raises(ValueError, match="layout must be 'contiguous' or 'zigzag', got 'ring'"):
        build_cp_context(torch.tensor([0, 8]), None, layout="ring", rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size\) = \[0, 2\), got 2"):
        build_cp_context(torch.tensor([0, 8]), None, rank=2, world_size=2)


def test_chunk_kda_cp_rejects_context_without_group_or_host_offsets():
    x, _ = _global_inputs([8], 1, 1, 4, 4, seed=0)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="cp_context.group is None"):
        chunk_kda_cp(*args, cp_context=CPContext(cu_seqlens=cu, cu_seqlens_cpu=cu))
    with pytest.raises(ValueError, match="cp_context.cu_seqlens_cpu .* are both required"):
        chunk_kda_cp(*args, cp_context=CPContext(group=object(), cu_seqlens=cu))


def test_initial_state_response_is_the_outputs_linear_part():
    x, _ = _global_inputs([37], 2, 4, 8, 5, seed=3)
    q, k, v, beta = x["q"], x["k"], x["v"], torch.sigmoid(x["beta"])
    g = -torch.nn.functional.softplus(x["g"])
    S = x["h0"][:, :, :, :5]
    o_S, _ = chunk_kda_reference(q, k, v, g, beta, initial_state=S)
    o_0, _ = chunk_kda_reference(q, k, v, g, beta)
    R = initial_state_response(q, k, g, beta)
    torch.testing.assert_close(o_S - o_0, torch.einsum("bthk,bhkv->bthv", R, S), rtol=1e-10, atol=1e-10)


def test_state_maps_and_their_adjoint_match_autograd():
    x, _ = _global_inputs([48], 1, 2, 6, 3, seed=5)
    k, v, beta = x["k"], x["v"], torch.sigmoid(x["beta"])
    g = -torch.nn.functional.softplus(x["g"])
    cuts = [0, 13, 30, 48]
    maps = [piece_affine_map(k, v, g, beta, a, b) for a, b in itertools.pairwise(cuts)]
    S0 = x["h0"][:1, :, :, :3].clone().requires_grad_(True)
    _, whole = chunk_kda_reference(k, k, v, g, beta, initial_state=S0, output_final_state=True)
    torch.testing.assert_close(apply_state_maps(maps, S0), whole, rtol=1e-10, atol=1e-10)
    # loss = sum_p <w_p, state after piece p>: its gradient on S0 is the adjoint fold with e_p = M_p^T w_p
    ws = [torch.randn_like(whole) for _ in maps]
    states, S = [], S0
    for M, c in maps:
        S = M @ S + c
        states.append(S)
    (expect,) = torch.autograd.grad(sum((w_ * s).sum() for w_, s in zip(ws, states, strict=True)), S0)
    got = apply_state_maps_adjoint([M for M, _ in maps], [M.transpose(-1, -2) @ w_ for (M, _), w_ in
                                                          zip(maps, ws, strict=True)])
    torch.testing.assert_close(got, expect, rtol=1e-10, atol=1e-10)
