"""Helpers of the cula-sm100 backward tests: fp64 autograd oracles built from small reference pieces, the
reference's intermediates in the backward's layout, and the kernel compile list.

    CUTE_DSL_ARCH=sm_100a python tests/sm100/backward_cases.py     # compiles the backward kernels, one line each
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from cula_core import reference as ref

BT = 64


def flat(x):
    """[B, T, H, D] -> [B T, H, D]; [B, NT, HV, K, V] -> [B NT, HV, K, V]."""
    return x.reshape(-1, *x.shape[2:])


def wy_dqkg_expected(q, k, v, v_new, G, beta, Akk, h, do, dh, dv, ch, *, scale):
    """What chunk_wy_dqkg must return, by fp64 autograd of the terms it differentiates, per chunk:

        loss = <do, scale (q e^G) h> + <dh, e^{G_last} h + (k e^{G_last - G})^T v_new>
             + <dv, A (beta v) - A (beta k e^G) h>,        A = (I + L)^-1, L strictly lower (a leaf)

    with q, k shared by the group's value heads (so their gradients are the group sums). Arguments as the
    kernel's (token layouts, `ch` a `torch_stages.Chunks`); returns (dq, dk, dv, dbeta, dG, dL) in fp64."""
    d = torch.float64
    HQK, HV = q.shape[1], v.shape[1]
    grp = HV // HQK
    leaves = [x.detach().to(d).requires_grad_() for x in (q, k, v, G, beta)]
    qL, kL, vL, GL, bL = leaves
    Ac = ch.chunk(Akk.to(d)).permute(0, 2, 1, 3)                        # [C, HV, i, j]
    eye = torch.eye(BT, dtype=d, device=q.device)
    absent = ~ch.mask                                                    # [C, 64]
    Ac = Ac + torch.diag_embed(absent.to(d)).unsqueeze(1)               # unit diagonal on absent rows
    strict = torch.ones(BT, BT, dtype=torch.bool, device=q.device).tril(-1)
    L0 = ((torch.linalg.inv(Ac) - eye) * strict).detach().requires_grad_()
    A = torch.linalg.solve_triangular(eye + L0, eye.expand_as(L0), upper=False, unitriangular=True)

    def heads(x, g=1):  # tokens [TT, H, D] -> chunks [C, HV, 64, D]
        return ch.chunk(x.repeat_interleave(g, dim=1) if g > 1 else x).permute(0, 2, 1, 3)

    qc, kc = heads(qL, grp), heads(kL, grp)
    Gc = ch.chunk(GL, g_rows=True).permute(0, 2, 1, 3)
    Gl = Gc[:, :, -1:, :]
    bc = ch.chunk(bL.unsqueeze(-1)).permute(0, 2, 1, 3)                 # [C, HV, 64, 1]
    vc = heads(vL)
    vnc, doc, dvc = (heads(x.to(d)) for x in (v_new, do, dv))
    C = Ac.shape[0]
    hc = torch.cat([h.to(d), h.new_zeros(1, *h.shape[1:]).to(d)])[:C]
    dhc = torch.cat([dh.to(d), dh.new_zeros(1, *dh.shape[1:]).to(d)])[:C]
    qg = qc * torch.exp(Gc)
    kd = kc * torch.exp(Gl - Gc) * ch.mask[:, None, :, None]
    loss = (doc * (scale * qg @ hc)).sum()
    loss = loss + (dhc * (torch.exp(Gl).transpose(-1, -2) * hc + kd.transpose(-1, -2) @ vnc)).sum()
    u = A @ (bc * vc)
    w = A @ (bc * kc * torch.exp(Gc))
    loss = loss + (dvc * (u - w @ hc)).sum()
    grads = torch.autograd.grad(loss, leaves + [L0])
    dq, dk, dvv, dG, db = grads[:5]
    dL = ch.unchunk((grads[5] * strict).permute(0, 2, 1, 3))
    return dq, dk, dvv, db, dG, dL


def reference_intermediates(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *, scale,
                            use_qk_l2norm_in_kernel, gate, lower_bound, beta_activation, dtype=torch.float64):
    """The forward's intermediates (the fields `torch_stages.backward` reads) from `cula_core.reference`, in
    `dtype`, over packed tokens."""
    qp, kp = q.to(dtype), k.to(dtype)
    if use_qk_l2norm_in_kernel:
        qp, kp = ref.l2norm(qp), ref.l2norm(kp)
    ld = ref.log_decay(g.to(dtype), A_log.to(dtype) if A_log is not None else None,
                       dt_bias.to(dtype) if dt_bias is not None else None, gate, lower_bound)
    bp = ref.activate_beta(beta.to(dtype), beta_activation)
    h0 = initial_state.to(dtype) if initial_state is not None else None
    _, _, it = ref.chunk_kda_reference(qp, kp, v.to(dtype), ld, bp, scale=scale, initial_state=h0,
                                       cu_seqlens=cu_seqlens, return_intermediates=True)
    return SimpleNamespace(q=flat(qp), k=flat(kp), g_cumsum=flat(it.g_cumsum), Aqk=flat(it.Aqk), Akk=flat(it.Akk),
                           w=flat(it.w), kg=flat(it.kg), h=flat(it.h), v_new=flat(it.v_new))


def kernels():
    from cula_sm100.backward import launch

    return {"chunk_wy_dqkg": launch.wy_dqkg_kernel}


if __name__ == "__main__":
    for name, build in kernels().items():
        t = time.perf_counter()
        build()
        print(f"compiled {name} in {time.perf_counter() - t:.1f} s", flush=True)
