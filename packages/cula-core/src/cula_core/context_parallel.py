"""Context parallelism across ranks for `chunk_kda`: long sequences split over a torch.distributed group.

The layout is FLA 0.6.0's (`fla.ops.cp`). The global packed batch (``cu_seqlens`` over all tokens of all ranks)
is cut into equal token intervals, the *slots* of a chain: with ``layout='contiguous'`` rank ``r`` holds slot
``r`` (``T / world_size`` tokens); with ``'zigzag'`` rank ``r`` holds slots ``r`` and ``2 * world_size - 1 - r``
(``T / (2 * world_size)`` tokens each), concatenated as ``[front; back]`` in its buffer. Each rank passes its
own tokens and the context; the context's ``cu_seqlens`` are the local offsets of its slots. A sequence cut by
a slot boundary goes on in the next slot, so only a slot's *first* sequence can come from the previous slot,
and only its *last* can go on into the next; ``pre_num_ranks`` / ``post_num_ranks`` (per part for zigzag)
count the slots they span before and after.

The KDA state map over a piece of tokens is affine, ``S_out = M S_in + c`` (`cula_core.reference.context_parallel`),
and so are the outputs, ``o = o(0) + R S_in``. Forward:

1. the local run: all local tokens through the `chunk_kda` op body (the fastest installed backend) from the local
   initial states (zero for a first sequence that comes from before): ``o(0)``, the final states (``c`` of the
   last sequence that goes on) and the backend's residuals when training;
2. the identity run over each boundary sequence, with zero values from the identity state (``V = K``): its final
   state is ``M``, its outputs ``R`` (no graph: `kda_prefill` without intra-card CP where a kernel serves it);
   on a GPU it is enqueued first, on a side stream, and runs beside the local run (whose serial state pass leaves
   most SMs idle on long sequences with few heads);
3. one all-gather of ``[M | c]`` (``HV * K * (K + V)`` fp32 per slot); each slot folds the maps of the slots its
   first sequence came through (fp64, at most ``world_size - 1`` small matmuls) into its true initial state
   ``S_in``, and that sequence's outputs get ``R S_in``, its final state ``M S_in``;
4. when training, the outputs are attached to the local call from the true initial states (`_LocalOutputs`):
   the backward is that call's, with no second forward.

Backward: the gradient of the state entering a slot is ``D_p = e_p + M_p^T D_{p+1}``, where ``e_p = R^T do +
M^T dht`` is what slot ``p``'s own first sequence contributes. ``R`` (the outputs of the identity run above,
made in the forward for each slot whose first sequence came from before) turns ``do`` into ``e_p`` with one
matmul, so no backward pass is needed to get it; one all-gather of ``e`` (``HV * K * V`` per slot), a fold
over the next slots, and the local call's backward runs with the gradient of the boundary state added to its
last sequence's ``dht``. Every gradient (q, k, v, g, beta, A_log, dt_bias, initial_state) comes from that
local backward. Why all-gather and not a ring, and what it all costs: docs/context_parallel.md.

Collectives run in the forward (always) and in the backward (when the call tracks gradients): every rank of
the group must call with the same grad mode and back-propagate through the outputs.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from cula_core import dispatch
from cula_core.cute_runtime.convert import device_int32
from cula_core.fla_args import resolve_chunk_call, state_v_first_from
from cula_core.ops.chunk_kda import _backward, _chunk_kda, _setup_context
from cula_core.reference.context_parallel import apply_state_maps, apply_state_maps_adjoint

__all__ = ["CPContext", "add_response", "build_cp_context", "chunk_kda_cp", "response_transpose"]

#: Tokens per slice when R S_in (forward) and R^T do (backward) are formed: it bounds the fp32 products (and, off
#: the tensor-core path, the fp32 copies of R and do): a few hundred MiB at HV = 32, where whole-sequence ones at
#: 128K tokens per rank take GiBs. Results do not depend on it beyond rounding.
RESPONSE_BLOCK = 16384


@dataclass
class CPContext:
    """Sequence partition and rank metadata of one rank, with the fields of FLA 0.6.0's ``FLACPContext``.

    `chunk_kda_cp` reads these fields from any object that has them, so FLA's own context works as well.
    ``cu_seqlens`` / ``cu_seqlens_cpu`` are the LOCAL offsets ``[N_local + 1]`` (int32, device and host).
    Contiguous layout: ``pre_num_ranks`` slots before this one hold earlier tokens of the first local sequence
    (``is_first_rank``: none), ``post_num_ranks`` slots after hold later tokens of the last one
    (``is_last_rank``: none). Zigzag: the same per part, in the ``*_by_part`` pairs (front, back), the first
    ``front_num_seqs`` local sequences in the front part, ``part_len`` tokens per part. ``conv1d_kernel_size``
    and ``pre_num_conv_tokens`` serve FLA's short-convolution layers (tokens of the first sequence before
    this slot); chunk_kda does not read them.
    """

    group: dist.ProcessGroup | None = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None
    is_last_rank: bool | None = None
    pre_num_ranks: int | None = None
    is_first_rank: bool | None = None
    post_num_ranks: int | None = None
    conv1d_kernel_size: int | None = None
    pre_num_conv_tokens: int | None = None
    pre_num_ranks_dev: torch.Tensor | None = None
    post_num_ranks_dev: torch.Tensor | None = None
    layout: str = "contiguous"
    part_len: int | None = None
    front_num_seqs: int | None = None
    pre_num_ranks_by_part: tuple[int, int] | None = None
    post_num_ranks_by_part: tuple[int, int] | None = None
    is_first_by_part: tuple[bool, bool] | None = None
    is_last_by_part: tuple[bool, bool] | None = None
    pre_num_conv_tokens_by_part: tuple[int, int] | None = None

    @property
    def num_seqs(self) -> int:
        """Number of local sequences."""
        return 0 if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    @property
    def is_cp_enabled(self) -> bool:
        return self.group is not None

    def copy_for_backward(self) -> CPContext:
        """A copy with its own offset tensors (for pipeline schedules that rebuild the forward's inputs)."""
        return replace(
            self,
            cu_seqlens=None if self.cu_seqlens is None else self.cu_seqlens.clone(),
            cu_seqlens_cpu=None if self.cu_seqlens_cpu is None else self.cu_seqlens_cpu.clone(),
        )


def _interval(bounds: list[int], start: int, end: int, pos: int, part_len: int):
    """Local offsets and chain metadata of the token interval ``[start, end)`` (slot ``pos`` of the chain)."""
    first = bisect.bisect_right(bounds, start, 1) - 1          # sequence holding token `start`
    last = bisect.bisect_right(bounds, end - 1, 1) - 1         # sequence holding token `end - 1`
    local = [0]
    for b in bounds[first + 1:last + 2]:
        b = min(max(b, start), end) - start
        if b != local[-1]:                                     # zero-length sequences inside the slot vanish
            local.append(b)
    pre = pos - bounds[first] // part_len
    post = (bounds[last + 1] - 1) // part_len - pos
    return local, start - bounds[first], pre, post


def build_cp_context(
    cu_seqlens: torch.Tensor,
    group: dist.ProcessGroup | None,
    conv1d_kernel_size: int | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    layout: str = "contiguous",
    *,
    rank: int | None = None,
    world_size: int | None = None,
) -> CPContext:
    """This rank's `CPContext` from the GLOBAL ``cu_seqlens``; FLA 0.6.0's ``build_cp_context`` semantics.

    Args:
        cu_seqlens: ``[N + 1]`` global offsets (before partitioning), int32/int64; its device is where the
            local offsets are put.
        group: the CP process group (rank and size come from it unless given).
        conv1d_kernel_size: stored for FLA's short-convolution layers.
        cu_seqlens_cpu: the same offsets on the host; without it ``cu_seqlens`` is copied to the host once.
        layout: ``'contiguous'`` (rank r holds tokens ``[r T/W, (r+1) T/W)``) or ``'zigzag'`` (rank r holds
            intervals ``r`` and ``2W - 1 - r`` of ``T / 2W`` tokens, as ``[front; back]``).
        rank, world_size: this rank and the group size, for planning without a process group.

    Returns:
        The rank's `CPContext`. The total token count must be divisible by ``W`` (contiguous) or ``2W``.
    """
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")
    if (rank is None) != (world_size is None):
        raise ValueError(f"rank and world_size: give both or neither, got rank={rank}, world_size={world_size}")
    if rank is None:
        if group is None:
            raise ValueError("group: a process group is needed when rank and world_size are not given, got None")
        rank, world_size = dist.get_rank(group=group), dist.get_world_size(group=group)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) = [0, {world_size}), got {rank}")
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
    bounds = [int(b) for b in host.tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or any(b1 < b0 for b0, b1 in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 with at least one sequence, "
                         f"got {bounds}")
    total = bounds[-1]
    num_slots = world_size if layout == "contiguous" else 2 * world_size
    if total < num_slots or total % num_slots:
        raise ValueError(f"cu_seqlens: the total token count {total} must be a positive multiple of the "
                         f"{num_slots} slots of a {layout} layout over {world_size} ranks")
    part_len = total // num_slots

    def local_offsets(offsets):
        as_int = torch.tensor(offsets, dtype=torch.int32)
        return device_int32(as_int, cu_seqlens.device), as_int

    if layout == "contiguous":
        offsets, conv, pre, post = _interval(bounds, rank * part_len, (rank + 1) * part_len, rank, part_len)
        dev, cpu = local_offsets(offsets)
        return CPContext(group=group, cu_seqlens=dev, cu_seqlens_cpu=cpu, is_last_rank=post == 0,
                         pre_num_ranks=pre, is_first_rank=pre == 0, post_num_ranks=post,
                         conv1d_kernel_size=conv1d_kernel_size, pre_num_conv_tokens=conv)
    back_pos = 2 * world_size - 1 - rank
    front = _interval(bounds, rank * part_len, (rank + 1) * part_len, rank, part_len)
    back = _interval(bounds, back_pos * part_len, (back_pos + 1) * part_len, back_pos, part_len)
    dev, cpu = local_offsets(front[0] + [b + part_len for b in back[0][1:]])
    return CPContext(
        group=group, cu_seqlens=dev, cu_seqlens_cpu=cpu, conv1d_kernel_size=conv1d_kernel_size, layout="zigzag",
        part_len=part_len, front_num_seqs=len(front[0]) - 1,
        pre_num_ranks_by_part=(front[2], back[2]), post_num_ranks_by_part=(front[3], back[3]),
        is_first_by_part=(front[2] == 0, back[2] == 0), is_last_by_part=(front[3] == 0, back[3] == 0),
        pre_num_conv_tokens_by_part=(front[1], back[1]),
    )


@dataclass(frozen=True)
class _Slot:
    """One chain slot held by this rank: its place in the chain and its boundary sequences."""

    pos: int                       # position in the chain of slots
    first_seq: int                 # local index of the slot's first sequence
    last_seq: int                  # local index of its last sequence
    first_range: tuple[int, int]   # local token range of the first sequence
    last_range: tuple[int, int]
    pre: int                       # earlier slots the first sequence spans (0: it starts here)
    post: int                      # later slots the last sequence spans (0: it ends here)


def _need_int(ctx, name: str):
    value = getattr(ctx, name, None)
    if value is None:
        raise ValueError(f"cp_context.{name} is None; build the context with build_cp_context")
    return value


def _plan(ctx, bounds: list[int], rank: int, world: int) -> tuple[int, list[_Slot]]:
    """The chain length and this rank's slots, from the context's metadata."""
    n = len(bounds) - 1
    layout = getattr(ctx, "layout", "contiguous")
    if layout == "contiguous":
        chain, parts = world, [(rank, 0, n, _need_int(ctx, "pre_num_ranks"), _need_int(ctx, "post_num_ranks"))]
    elif layout == "zigzag":
        front = _need_int(ctx, "front_num_seqs")
        if not 1 <= front < n:
            raise ValueError(f"cp_context.front_num_seqs must be in [1, {n - 1}] for {n} local sequences, got {front}")
        pre, post = _need_int(ctx, "pre_num_ranks_by_part"), _need_int(ctx, "post_num_ranks_by_part")
        chain = 2 * world
        parts = [(rank, 0, front, pre[0], post[0]), (chain - 1 - rank, front, n, pre[1], post[1])]
    else:
        raise ValueError(f"cp_context.layout must be 'contiguous' or 'zigzag', got {layout!r}")
    slots = []
    for pos, s0, s1, pre, post in parts:
        if not (0 <= int(pre) <= pos and 0 <= int(post) < chain - pos):
            raise ValueError(f"cp_context: slot {pos} of a chain of {chain} cannot span {pre} slots before and "
                             f"{post} after")
        if s1 <= s0:
            raise ValueError(f"cp_context.cu_seqlens: slot {pos} holds no sequence ({bounds})")
        slots.append(_Slot(pos, s0, s1 - 1, (bounds[s0], bounds[s0 + 1]), (bounds[s1 - 1], bounds[s1]),
                           int(pre), int(post)))
    return chain, slots


def _take(x: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Tokens ``ranges`` of ``x [1, T, ...]``, packed along T (a view when there is one range)."""
    if len(ranges) == 1:
        return x[:, ranges[0][0]:ranges[0][1]]
    return torch.cat([x[:, a:b] for a, b in ranges], dim=1)


def _offsets(ranges: list[tuple[int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(device, host) int32 offsets of `ranges` packed one after the other (the device copy queued, no stream
    synchronisation)."""
    host = torch.tensor([0, *itertools.accumulate(b - a for a, b in ranges)], dtype=torch.int32)
    return device_int32(host, device), host


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """``[world, *x.shape]``: every rank's ``x``."""
    world = dist.get_world_size(group=group)
    flat = x.contiguous().reshape(-1)
    out = flat.new_empty(world * flat.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, flat, group=group)
    return out.reshape(world, *x.shape)


def _chain_order(gathered: torch.Tensor, layout: str) -> torch.Tensor:
    """``[world, parts, ...]`` per rank -> ``[chain, ...]`` per slot (zigzag: fronts up, then backs down)."""
    if layout == "contiguous":
        return gathered[:, 0]
    return torch.cat([gathered[:, 0], gathered[:, 1].flip(0)])


_HAS_OUT_DTYPE = hasattr(torch.ops.aten.baddbmm, "dtype")  # baddbmm(..., out_dtype=): torch 2.8 and later


def add_response(o: torch.Tensor, R: torch.Tensor, S: torch.Tensor) -> None:
    """``o += R S`` per head, in place: ``o [T, HV, V]``, the response ``R [T, HV, K]`` (the identity run's outputs,
    in the input dtype) and the entering state ``S [HV, K, V]`` (fp32, or fp64 for fp64 inputs), a block of
    `RESPONSE_BLOCK` tokens at a time.

    With bf16 o and R on CUDA each block is one tensor-core GEMM accumulating into o in place: S split into bf16
    high and low parts (S to about 16 bits, as the kernels carry the state into their state products; fp16 parts
    could overflow where |S| passes 65504, so fp16 takes the fp32 path), ``[R | R] @ [S_hi ; S_lo]`` with fp32
    accumulation, o added in the GEMM; the result is within two roundings to o's dtype of the exact sum (cuBLAS may
    round the product before adding o: 4.0e-3 of max |o| against 2.0e-3 for one rounding, H200), where an fp32
    product and a separate add (one rounding) cost a strided elementwise pass over o per block. Otherwise R is
    converted to S's dtype, multiplied in it and added to o (one rounding)."""
    tensor_cores = R.is_cuda and R.dtype == torch.bfloat16 and o.dtype == R.dtype
    if tensor_cores:
        hi = S.to(R.dtype)
        stacked = torch.cat([hi, (S - hi.to(S.dtype)).to(R.dtype)], dim=1)  # [HV, 2K, V]
    for t0 in range(0, R.shape[0], RESPONSE_BLOCK):
        r, out = R[t0:t0 + RESPONSE_BLOCK], o[t0:t0 + RESPONSE_BLOCK].transpose(0, 1)  # out: [HV, t, V] view
        if tensor_cores:
            out.baddbmm_(torch.cat([r, r], dim=-1).transpose(0, 1), stacked)
        else:
            out.add_(torch.bmm(r.transpose(0, 1).to(S.dtype), S))


def response_transpose(R: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """``R^T do`` per head: ``R [T, HV, K]``, ``do [T, HV, V]`` -> ``[HV, K, V]`` in fp32 (fp64 for fp64 inputs),
    summed over blocks of `RESPONSE_BLOCK` tokens. With 16-bit R and do on CUDA (and torch 2.8 or later, whose
    baddbmm takes ``out_dtype``) each block is one tensor-core GEMM with fp32 accumulation and result (both
    operands are exact in 16 bits); otherwise the operands are converted to fp32 / fp64 and multiplied in it."""
    dtype = torch.promote_types(torch.promote_types(R.dtype, do.dtype), torch.float32)
    out = R.new_zeros(R.shape[1], R.shape[2], do.shape[2], dtype=dtype)
    tensor_cores = R.is_cuda and R.dtype in (torch.bfloat16, torch.float16) and do.dtype == R.dtype and _HAS_OUT_DTYPE
    for s in range(0, R.shape[0], RESPONSE_BLOCK):
        r, d = R[s:s + RESPONSE_BLOCK].permute(1, 2, 0), do[s:s + RESPONSE_BLOCK].transpose(0, 1)
        if tensor_cores:
            out = torch.baddbmm(out, r, d, out_dtype=torch.float32)   # [HV, K, t] @ [HV, t, V], summed into out
        else:
            out.baddbmm_(r.to(dtype), d.to(dtype))
    return out


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream the identity runs of `device` are enqueued on beside the local run (one per device, made on first
    use); None off CUDA, where everything runs in order."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return stream


def _identity_run(q, k, zeros, g, beta, eye, cu, cu_host, call, opts: dict):
    """The identity run over the boundary sequences (q, k, g, beta: their tokens; zero values; the identity state
    `eye`): ``(R, M)``, its outputs and final states. As `kda_prefill` where a kernel serves that op here, else as
    the no-grad `chunk_kda` (cula-sm100 on Blackwell serves chunk_kda only); both compute the same map.

    Without intra-card CP: the run goes beside the local run (`chunk_kda_cp`, step 1), whose serial state pass
    holds a few SMs per head; the identity run's own state pass takes as many other SMs and walks the tokens in
    the same time, while intra-card CP's extra passes over the tokens would compete with the local run for every
    SM (4 x H200: scaling at 512K tokens 81% with it, 85-86% without; docs/benchmarks/multi_gpu_cp.md)."""
    from cula_core.ops.chunk_kda import chunk_kda
    from cula_core.ops.prefill import _prefill_call, kda_prefill

    config = _prefill_call("kda_prefill", q, zeros, cu, gate=call.gate,
                           use_qk_l2norm_in_kernel=bool(opts["use_qk_l2norm_in_kernel"]),
                           beta_activation=call.beta_activation, initial_state=eye, output_final_state=True,
                           state_v_first=False, intracard_cp="off")
    if dispatch.kernel_backend_for(config)[0] is None:
        return chunk_kda(q, k, zeros, g, beta, initial_state=eye, output_final_state=True, cu_seqlens=cu,
                         cu_seqlens_cpu=cu_host, **opts)
    prefill_opts = {name: value for name, value in opts.items() if name != "chunk_size"}  # per-chunk states only
    return kda_prefill(q, k, zeros, g, beta, initial_state=eye, output_final_state=True, cu_seqlens=cu,
                       cu_seqlens_cpu=cu_host, intracard_cp=False, **prefill_opts)


@dataclass
class _BackwardPlan:
    group: dist.ProcessGroup
    layout: str
    slots: list[_Slot]
    chain_M: torch.Tensor                      # [chain, HV, K, K]: each slot's last-sequence map
    response: dict[int, torch.Tensor]          # slot pos -> R [T_first, HV, K] of its first sequence
    first_map: dict[int, torch.Tensor]         # slot pos -> M [HV, K, K] of its first sequence


class _BoundaryGradients(torch.autograd.Function):
    """Identity on ``(o, final_state)``; its backward adds to ``dht`` of each last sequence that goes on into
    later slots the gradient of that boundary state, gathered from the slots that hold the rest."""

    @staticmethod
    def forward(ctx, o, final_state, plan: _BackwardPlan):
        ctx.plan = plan
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        plan = ctx.plan
        HV, K, V = dht.shape[1], dht.shape[2], dht.shape[3]
        own = dht.new_zeros(len(plan.slots), HV, K, V)
        for p, slot in enumerate(plan.slots):
            if slot.pre:
                a, b = slot.first_range
                own[p] = (response_transpose(plan.response[slot.pos], do[0, a:b])
                          + plan.first_map[slot.pos].transpose(-1, -2).to(dht.dtype) @ dht[slot.first_seq])
        chain_e = _chain_order(_all_gather(own, plan.group), plan.layout)
        dht = dht.clone()
        for slot in plan.slots:
            if slot.post:
                later = range(slot.pos + 1, slot.pos + slot.post + 1)
                D = apply_state_maps_adjoint([plan.chain_M[j].double() for j in later],
                                             [chain_e[j].double() for j in later])
                dht[slot.last_seq] += D.to(dht.dtype)
        return do, dht, None


class _LocalOutputs(torch.autograd.Function):
    """The local `chunk_kda` call's outputs, computed without autograd (the local run plus the entering states'
    linear parts), attached to the inputs of the call from the true initial states: its backward is that call's
    (`cula::chunk_kda`'s autograd formula). Arguments: the 18 inputs of `cula::chunk_kda`, then the outputs
    o, final_state and the residuals Aqk, Akk (state-independent: the local run's serve)."""

    @staticmethod
    def forward(ctx, *args):
        inputs, (o, final_state, Aqk, Akk) = args[:18], args[18:]
        _setup_context(ctx, inputs, (o, final_state, Aqk, Akk))
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        return (*_backward(ctx, do, dht, None, None), None, None, None, None)


def chunk_kda_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cp_context,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    **fla_kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_kda` over this rank's part of sequences split across the ranks of ``cp_context.group``.

    Same arguments and results as `cula_core.chunk_kda`, for the local tokens, with these differences:

    Args:
        q, k, v, g, beta: this rank's tokens, ``B == 1`` (``[1, T_local, ...]``), laid out as the context says.
        cp_context: a `CPContext` or FLA 0.6.0's ``FLACPContext`` (read by field name). Its ``cu_seqlens`` and
            ``cu_seqlens_cpu`` (both required) are the local offsets and replace the arguments of those names,
            which are ignored (as in FLA).
        initial_state: ``[N_local, HV, K, V]`` or None. Row ``i`` is the state sequence ``i`` starts from
            when it starts on this rank; the row of a first sequence that comes from an earlier slot is not
            read (its state comes from that slot) and gets a zero gradient. FLA accepts only None here.
        output_final_state: return ``[N_local, HV, K, V]``: row ``i`` is the state after sequence ``i``'s
            last token on this rank; for a last sequence that goes on, the state entering the next slot.
            Gradients given to it are honoured. FLA accepts only False here.
        **fla_kwargs: as `chunk_kda` (``cp_context`` excluded).

    Returns:
        ``(o [1, T_local, HV, V], final_state or None)``, equal to the rows of the single-process call
        over the global batch.

    Every rank must call with the same grad mode; when gradients are tracked, every rank must
    back-propagate through ``o`` (the backward holds a collective).
    """

    group = getattr(cp_context, "group", None)
    if group is None:
        raise ValueError("cp_context.group is None: context parallelism needs the process group of the ranks")
    cu, cu_host = getattr(cp_context, "cu_seqlens", None), getattr(cp_context, "cu_seqlens_cpu", None)
    if cu is None or cu_host is None:
        raise ValueError("cp_context.cu_seqlens and cp_context.cu_seqlens_cpu (the local offsets on the device "
                         "and the host) are both required; build the context with build_cp_context")
    fla_kwargs = dict(fla_kwargs)
    state_v_first = state_v_first_from(fla_kwargs.pop("state_v_first", False), fla_kwargs)
    if fla_kwargs.pop("return_intermediate_states", False):
        raise NotImplementedError("chunk_kda: return_intermediate_states=True is not implemented with cp_context")
    flags = {name: bool(fla_kwargs.pop(name, False))
             for name in ("use_beta_sigmoid_in_kernel", "allow_neg_eigval", "disable_recompute", "use_graph")}
    max_num_seqs = fla_kwargs.pop("max_num_seqs", None)
    call = resolve_chunk_call(
        "chunk_kda", q, k, v, g, beta, scale=scale, initial_state=initial_state,
        use_gate_in_kernel=use_gate_in_kernel, safe_gate=safe_gate, lower_bound=lower_bound,
        return_intermediate_states=False, state_v_first=state_v_first, cu_seqlens=cu, cu_seqlens_cpu=cu_host,
        cp_context=None, max_num_seqs=max_num_seqs, A_log=A_log, dt_bias=dt_bias, kwargs=fla_kwargs, **flags,
    )
    q, k, v, g, beta, A_log, dt_bias, initial_state = call.tensors
    if state_v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)   # computed K-first; final states go back V-first
    HV, K, V, N = v.shape[2], q.shape[3], v.shape[3], call.N
    rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
    bounds = [int(b) for b in cu_host.tolist()]
    _, slots = _plan(cp_context, bounds, rank, world)
    layout = getattr(cp_context, "layout", "contiguous")
    opts = dict(scale=call.scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, safe_gate=safe_gate,
                lower_bound=lower_bound, chunk_size=call.chunk_size,
                **{n: flags[n] for n in ("use_beta_sigmoid_in_kernel", "allow_neg_eigval", "disable_recompute")})
    tracked = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tracked)
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    device = q.device

    # the local run's initial states: the caller's rows, zero for first sequences that come from an earlier slot
    # (their true state is known after the gather); present whenever the true call has one, so that both calls
    # are served by the same backend (whose residuals the backward then reuses)
    from_before = sorted(s.first_seq for s in slots if s.pre)  # at most one per slot: rows set one by one
    h0_local = initial_state
    if from_before:
        # the rows every state of this call starts from (the caller's, or zeros), and the rows that come from before
        base = initial_state if initial_state is not None else q.new_zeros(N, HV, K, V, dtype=state_dtype)
        h0_local = base.detach().clone()
        for i in from_before:
            h0_local[i] = 0.0
    local_args = (q, k, v, g, beta, A_log, dt_bias, h0_local, cu, cu_host, call.scale, True,
                  bool(use_qk_l2norm_in_kernel), call.gate, call.lower_bound, call.beta_activation, needs_grad, False)

    with torch.no_grad():
        # -- step 1, enqueued first: identity runs over each distinct boundary sequence: its map M (the final state
        # from the identity with zero values) and its response R (the outputs: o = o(0) + R S_in). On a GPU they
        # run on a side stream beside the local run below: the local run's serial state pass occupies a few SMs
        # per head for most of its time, and the identity run's own state pass runs on as many others. eye, zeros
        # and dev, made on the current stream, stay referenced here until the current stream has waited for the
        # side stream, so their memory is not reused under the identity run
        going_on = [(p, s) for p, s in enumerate(slots) if s.post]
        wanted = {s.last_seq: s.last_range for _, s in going_on}
        wanted.update({s.first_seq: s.first_range for s in slots if s.pre})
        side = _side_stream(device) if wanted else None
        if wanted:
            seqs = sorted(wanted)
            ranges = [wanted[i] for i in seqs]
            dev, host = _offsets(ranges, device)
            eye = torch.eye(K, dtype=state_dtype, device=device).expand(len(seqs), HV, K, K).contiguous()
            zeros = v.new_zeros(1, sum(b - a for a, b in ranges), HV, K)
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(device))  # its inputs, made on the current stream
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                R, M = _identity_run(_take(q, ranges), _take(k, ranges), zeros, _take(g, ranges),
                                     _take(beta, ranges), eye, dev, host, call, opts)
            row = {i: j for j, i in enumerate(seqs)}
            start = dict(zip(seqs, host[:-1].tolist(), strict=True))
        # -- step 1': all local tokens from the local initial states: the outputs o(0), every final state (c of
        # each going-on last sequence) and, when training, the residuals the backward reuses
        o, final_state, Aqk, Akk = _chunk_kda(*(x.detach() if isinstance(x, torch.Tensor) else x for x in local_args))
        if side is not None:
            current = torch.cuda.current_stream(device)
            current.wait_stream(side)
            for t in (R, M):  # made on the side stream, read on the current one: their memory waits for both
                t.record_stream(current)
        summary = torch.zeros(len(slots), HV, K, K + V, dtype=state_dtype, device=device)
        for p, s in going_on:
            summary[p, ..., K:] = final_state[s.last_seq]
            summary[p, ..., :K] = M[row[s.last_seq]]

        # -- step 2: gather every slot's [M | c]; fold the maps in front of each first sequence from before
        chain_maps = _chain_order(_all_gather(summary, group), layout)
        entering = {}
        for s in slots:
            if s.pre:
                before = chain_maps[s.pos - s.pre:s.pos].double()
                entering[s.first_seq] = apply_state_maps([(m[..., :K], m[..., K:]) for m in before])

        # -- step 3: the state entering each such sequence, added through its linear parts: o += R S_in on its
        # tokens, final state += M S_in (the local run started it from zero). The product is taken per head in
        # the state's precision, a block of tokens at a time, and added in place: the sum is formed in that
        # precision and rounded to o's dtype once, without an fp32 copy of o
        for s in slots:
            if s.pre:
                S_in = entering[s.first_seq].to(state_dtype)
                a, b = s.first_range
                r0 = start[s.first_seq] - a  # R's row of local token t is r0 + t
                add_response(o[0, a:b], R[0, r0 + a:r0 + b], S_in)
                final_state[s.first_seq] += M[row[s.first_seq]].to(state_dtype) @ S_in

    if needs_grad:
        # the backward of the local call from the true initial states (the backend recomputes what it needs from
        # the inputs and the residuals, which do not depend on the state)
        h0 = initial_state
        if from_before:
            h0 = base.clone()  # differentiable: the rows set below pass no gradient back to the caller's
            for i in from_before:
                h0[i] = entering[i].to(base.dtype)
        o, final_state = _LocalOutputs.apply(*local_args[:7], h0, *local_args[8:], o, final_state, Aqk, Akk)
        response, first_map = {}, {}
        for s in slots:
            if s.pre:
                a = start[s.first_seq]
                response[s.pos] = R[0, a:a + s.first_range[1] - s.first_range[0]]
                first_map[s.pos] = M[row[s.first_seq]]
        plan = _BackwardPlan(group, layout, slots, chain_maps[..., :K].contiguous(), response, first_map)
        o, final_state = _BoundaryGradients.apply(o, final_state, plan)
    if not output_final_state:
        return o, None
    return o, (final_state.transpose(-1, -2) if state_v_first else final_state)
