"""Every public op runs with its inputs' CUDA device current (`cula_core.dispatch.on_input_device`): CUDA refuses a
kernel launch into a stream of another device, and a model spread over several GPUs in one process calls its layers
with another device current. On the CPU the device is simulated: tensors report device 1 (`Tensor.get_device`),
the current device is 0 (`dispatch.current_device`), and `torch.cuda.device` is a recorder that, once entered,
lets the tensors be host tensors again; the op then runs on the reference and must give what it gives unguarded."""

from __future__ import annotations

import pytest
import torch

import cula
from cula_core import dispatch

N, T, H, K, P = 2, 3, 2, 8, 4


def _inputs():
    """Fresh inputs of every op (the flushes' KVBuffer made here, by the verify op, before any device is
    simulated)."""
    gen = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    q, k = (torch.nn.functional.normalize(r(N, T, H, K), dim=-1) for _ in range(2))
    x = dict(q=q, k=k, v=r(N, T, H, K), g=-torch.rand(N, T, H, K, generator=gen, dtype=torch.float64),
             beta=torch.rand(N, T, H, generator=gen, dtype=torch.float64), pool=0.1 * r(P, H, K, K),
             idx=torch.tensor([2, 0], dtype=torch.int32), A_log=r(H), dt_bias=r(H * K))
    x["kvbuffer"] = cula.kda_decode_mtp_kvbuffer(*_decode_args(x))[1]
    return x


def _decode_args(x, t=slice(None)):
    """The decode ops' arguments (raw g: the gate is applied in the op) for tokens t."""
    return (x["q"][:, t], x["k"][:, t], x["v"][:, t], x["g"][:, t], x["beta"][:, t], x["pool"], x["idx"], x["A_log"],
            x["dt_bias"])


def _flush(x, all_layers):
    kvbuffer = x["kvbuffer"]
    if all_layers:
        cula.kda_flush_kvbuffer_all_layers([x["pool"]], x["idx"], [kvbuffer], 2)
    else:
        cula.kda_flush_kvbuffer(x["pool"], x["idx"], kvbuffer, 2)
    return (x["pool"],)


#: each public op on x (fresh inputs per call), returning what it returns and the pool it updates
CALLS = {
    "chunk_kda": lambda x: cula.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True),
    "kda_prefill": lambda x: cula.kda_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True),
    "kda_decode": lambda x: (cula.kda_decode(*_decode_args(x, slice(0, 1))), x["pool"]),
    "kda_decode_mtp": lambda x: (*cula.kda_decode_mtp(*_decode_args(x), output_per_token_states=True), x["pool"]),
    "kda_decode_mtp_kvbuffer": lambda x: cula.kda_decode_mtp_kvbuffer(*_decode_args(x)),
    "kda_flush_kvbuffer": lambda x: _flush(x, all_layers=False),
    "kda_flush_kvbuffer_all_layers": lambda x: _flush(x, all_layers=True),
    "fused_recurrent_kda": lambda x: cula.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                              initial_state=x["pool"][:N].clone(),
                                                              output_final_state=True),
}


def _simulate_other_device(monkeypatch) -> list[int]:
    """Tensors on device 1 while device 0 is current; returns the devices the recorder entered."""
    entered = []
    host_get_device = torch.Tensor.get_device

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)
            monkeypatch.setattr(torch.Tensor, "get_device", host_get_device)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 1)
    monkeypatch.setattr(dispatch, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", Device)
    return entered


def test_every_public_op_is_called_here():
    """CALLS holds every op cula exports (so the test below checks each one's guard)."""
    ops = {n for n in cula.__all__ if n.startswith(("kda_", "chunk_kda", "fused_recurrent_kda"))}
    assert ops == set(CALLS), ops ^ set(CALLS)


@pytest.mark.parametrize("name", CALLS)
def test_a_call_on_another_device_runs_with_that_device_current(name, monkeypatch):
    expected = CALLS[name](_inputs())
    x = _inputs()
    entered = _simulate_other_device(monkeypatch)
    got = CALLS[name](x)
    assert entered == [1]  # switched once, to the inputs' device; the op then gave the unswitched call's results
    for a, b in zip(got, expected, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("name", ["kda_decode", "chunk_kda"])
def test_a_call_on_the_current_device_or_the_host_is_not_switched(name, monkeypatch):
    entered = []
    monkeypatch.setattr(torch.cuda, "device", lambda index: entered.append(index))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 1)
    monkeypatch.setattr(dispatch, "current_device", lambda: 1)
    x = _inputs()  # (the verify op inside is not switched either)
    CALLS[name](x)  # device 1 is current already
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "device", lambda index: entered.append(index))
    monkeypatch.setattr(dispatch, "current_device", lambda: pytest.fail("read for host tensors"))
    CALLS[name](_inputs())
    assert entered == []
