"""The sm90 prefill's plan path on a GPU (cula_core.plans; cula_sm90.prefill.forward.planned): a repeated
kda_prefill / chunk_kda call resolves its launch once and reads its tensors' addresses and the current stream on
every call; the compiled plan table (cula_core.cute_runtime.plan_table) serves the repeats from C++. Checked here:
bitwise the full path's results (forced by a non-contiguous view, which never gets a signature) on new inputs, on
another stream, on two streams at once, inside a CUDA graph replayed with new inputs, and for a misaligned input
(which the table declines and the Python plan copies)."""

from __future__ import annotations

import pytest
import torch

from prefill_cases import gate_kwargs, make_raw, require_gpu

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _gpu(monkeypatch):
    require_gpu()
    monkeypatch.setenv("CULA_BACKEND", "sm90")


def _strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a non-contiguous view: the call takes the full path."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def _case(seed, B=2, T=200, HV=4, gate="safe"):
    q, k, v, g, beta, A_log, dt_bias = make_raw(B, T, HV, HV, gate=gate, seed=seed)
    h0 = 0.1 * torch.randn(B, HV, 128, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    return [q, k, v, g, beta], dict(gate_kwargs(gate, A_log, dt_bias), initial_state=h0, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def _call(op, x, kw, q=None):
    import cula

    return getattr(cula, op)(x[0] if q is None else q, *x[1:], **kw)


@pytest.mark.parametrize("op", ["kda_prefill", "chunk_kda"])
def test_plan_on_new_inputs_and_another_stream_matches_the_full_path(op):
    from cula_core import plans

    from cula_core.cute_runtime import plan_table

    plans.forget()
    x, kw = _case(1)
    _call(op, x, kw)  # makes the plan and registers its program
    assert plans.count() == 1 and plan_table.count() == 1
    for seed, on_side_stream in ((2, False), (3, True)):
        new, _ = _case(seed)
        for t, n in zip(x, new, strict=True):
            t.copy_(n)
        kw["initial_state"].copy_(_case(seed)[1]["initial_state"])
        o_full, s_full = _call(op, x, kw, q=_strided(x[0]))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side if on_side_stream else torch.cuda.current_stream()):
            o, s = _call(op, x, kw)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        assert plans.count() == 1
        assert torch.equal(o, o_full) and torch.equal(s, s_full)


def test_plan_on_two_streams_at_once_keeps_the_calls_apart():
    """Two calls of one plan in flight on two streams, each with its own inputs: each returns its own results
    (scratch, o and final state are per call)."""
    from cula_core import plans

    plans.forget()
    xa, kwa = _case(4)
    xb, kwb = _case(5)
    _call("kda_prefill", xa, kwa)
    want_a = _call("kda_prefill", xa, kwa, q=_strided(xa[0]))
    want_b = _call("kda_prefill", xb, kwb, q=_strided(xb[0]))
    torch.cuda.synchronize()
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    got = []
    for _ in range(3):
        with torch.cuda.stream(sa):
            ra = _call("kda_prefill", xa, kwa)
        with torch.cuda.stream(sb):
            rb = _call("kda_prefill", xb, kwb)
        got.append((ra, rb))
    torch.cuda.synchronize()
    assert plans.count() == 1
    for ra, rb in got:
        for a, b in zip(ra + rb, want_a + want_b, strict=True):
            assert torch.equal(a, b)


def test_plan_under_cuda_graph_capture_replays_with_new_inputs():
    """A call captured in a CUDA graph through its plan (made by an eager call before), replayed after new values
    are copied into the captured inputs: the eager results for those values."""
    from cula_core import plans

    plans.forget()
    x, kw = _case(6)
    _call("kda_prefill", x, kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        o_g, s_g = _call("kda_prefill", x, kw)
    torch.cuda.current_stream().wait_stream(s)
    assert plans.count() == 1
    new, new_kw = _case(7)
    for t, n in zip(x, new, strict=True):
        t.copy_(n)
    kw["initial_state"].copy_(new_kw["initial_state"])
    graph.replay()
    torch.cuda.synchronize()
    o_e, s_e = _call("kda_prefill", x, kw, q=_strided(x[0]))
    torch.cuda.synchronize()
    assert torch.equal(o_g, o_e) and torch.equal(s_g, s_e)


def test_misaligned_input_is_declined_by_the_table_and_copied_by_the_python_plan():
    """q as a view 2 bytes into a buffer: the stage-1 kernel reads 16-byte vectors, so the compiled table declines
    the call and the Python plan runs it on an aligned copy; results bitwise the aligned call's."""
    from cula_core import plans
    from cula_core.cute_runtime import plan_table

    plans.forget()
    x, kw = _case(8)
    want = _call("kda_prefill", x, kw)
    buffer = torch.empty(x[0].numel() + 1, dtype=x[0].dtype, device="cuda")
    shifted = buffer[1:].view(x[0].shape)
    shifted.copy_(x[0])
    assert shifted.data_ptr() % 16 != 0
    got = _call("kda_prefill", x, kw, q=shifted)
    torch.cuda.synchronize()
    assert plans.count() == 1 and plan_table.count() == 1
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
