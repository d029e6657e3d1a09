"""KL divergence, Liger's generalised JSD and the fused linear JSD against
torch. Liger's tolerances: KLDiv fp32 (1e-8, 1e-6)... applied as (1e-6,
1e-5) here: kvant's exp/log are polynomial (~2e-7 relative); JSD fp32
(1e-6, 1e-5); bf16 (1e-2, 5e-2) as Liger's bf16 distillation tests."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, check, up

from kvant import ops

II = -100
TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-2, 5e-2)}


def ref_jsd(log_q, log_p, labels=None, beta=0.5):
    """Liger's torch reference: KL(P||Q) at beta 0, KL(Q||P) at 1, else
    beta KL(P||M) + (1-beta) KL(Q||M) with M = (1-beta) Q + beta P."""
    dt = log_q.dtype
    q = up(log_q)
    p = up(log_p).to(q.dtype)
    kl = lambda inp, tgt: F.kl_div(inp, tgt, reduction="none", log_target=True).sum(-1)  # noqa: E731
    if beta == 0.0:
        loss = kl(q, p)
    elif beta == 1.0:
        loss = kl(p, q)
    else:
        m = torch.lerp(q.exp(), p.exp(), beta).log()
        loss = beta * kl(m, p) + (1 - beta) * kl(m, q)
    if labels is not None:
        keep = labels != II
        loss = torch.where(keep, loss, torch.zeros_like(loss))
        return (loss.sum() / keep.sum()).to(dt)
    return (loss.sum() / q.shape[0]).to(dt)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 1000), (7, 123), (1, 3)])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div(dtype, shape, reduction, log_target):
    inp = torch.randn(shape).log_softmax(-1).to(dtype).requires_grad_()
    tgt = torch.randn(shape).log_softmax(-1)
    tgt = (tgt if log_target else tgt.exp()).to(dtype)
    check(
        lambda i: ops.kl_div(i, tgt, reduction, log_target),
        lambda i: F.kl_div(i, tgt, reduction=reduction, log_target=log_target),
        [inp],
        *TOL[dtype],
        name="kl_div",
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 1000), (7, 123), (2, 5)])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("labels", [False, True])
def test_jsd(dtype, shape, beta, labels):
    q = (torch.randn(shape) * 2).log_softmax(-1).to(dtype).requires_grad_()
    p = (torch.randn(shape) * 2).log_softmax(-1).to(dtype)
    lab = None
    if labels:
        lab = torch.randint(0, shape[1], (shape[0],))
        lab[::2] = II
    check(lambda q: ops.jsd(q, p, lab, beta, II), lambda q: ref_jsd(q, p, lab, beta), [q], *TOL[dtype], name="jsd")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", [(24, 32, 48, 500), (7, 31, 17, 123)])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_linear_jsd(dtype, dims, beta, temperature):
    n, hs, ht, v = dims
    xs = torch.randn(n, hs, dtype=dtype, requires_grad=True)
    ws = (torch.randn(v, hs) / hs**0.5).to(dtype).requires_grad_()
    xt = torch.randn(n, ht, dtype=dtype)
    wt = (torch.randn(v, ht) / ht**0.5).to(dtype)
    lab = torch.randint(0, v, (n,))
    lab[::3] = II

    def tf(xs, ws):
        sl = (up(F.linear(xs, ws)) / temperature).log_softmax(-1)
        tl = (up(F.linear(xt.to(xs.dtype), wt.to(xs.dtype))) / temperature).log_softmax(-1)
        return ref_jsd(sl, tl, lab, beta).to(dtype)

    tol = {torch.float32: (1e-5, 5e-4), torch.bfloat16: (5e-3, 5e-2)}[dtype]
    check(lambda xs, ws: ops.linear_jsd(xs, ws, xt, wt, lab, beta, II, temperature), tf, [xs, ws], *tol, name="linear_jsd")
