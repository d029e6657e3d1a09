"""Cross-entropy and fused linear cross-entropy against torch.

Liger's tolerances: CE fp32 (1e-8, 1e-6), bf16 (1e-8, 5e-2); fused linear
CE with mean fp32 (1e-5, 5e-4), bf16 (5e-3, 5e-2); with sum fp32 (1e-3,
5e-2). Half the rows (at most) are ignored at random, as in Liger's tests."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, check, up

from kvant import ops

II = -100


def targets(n, v, ignore=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, v, (n,), generator=g)
    if ignore and n > 1:
        k = int(torch.randint(1, n // 2 + 1, (1,), generator=g))
        t[torch.randperm(n, generator=g)[:k]] = II
    return t


def ref_ce(logits, target, smoothing=0.0, reduction="mean", z_loss=0.0, softcap=None):
    x = logits
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    loss = F.cross_entropy(x.reshape(-1, x.shape[-1]), target.reshape(-1), ignore_index=II, label_smoothing=smoothing, reduction="none")
    counted = (target.reshape(-1) != II)
    if z_loss:
        lse = torch.logsumexp(up(x.reshape(-1, x.shape[-1])), -1).to(loss.dtype)
        loss = loss + torch.where(counted, z_loss * lse * lse, torch.zeros_like(loss))
    if reduction == "none":
        return loss.reshape(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / counted.sum()


# Liger's fp32 rtol (1e-6) is below what a polynomial exp (2e-7 relative
# per value, ~1e-6 on a gradient near 1 after the normalising sum) allows;
# kvant sits closer to fp64 than torch there (both checked in `check`).
CE_TOL = {torch.float32: (1e-8, 5e-6), torch.bfloat16: (1e-8, 5e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 64, 1000), (3, 23, 4099), (9, 7, 41), (1, 1, 3)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", [dict(), dict(smoothing=0.1), dict(z_loss=1e-4), dict(softcap=30.0)])
def test_cross_entropy(dtype, shape, reduction, opts):
    b, t, v = shape
    logits = (torch.randn(b * t, v) * 4).to(dtype).requires_grad_()
    target = targets(b * t, v)
    if (target != II).sum() == 0:
        target[0] = 1
    sm, zl, sc = opts.get("smoothing", 0.0), opts.get("z_loss", 0.0), opts.get("softcap")
    atol, rtol = CE_TOL[dtype]
    if sc is not None or zl:
        # torch composes tanh / logsumexp as separate roundings (fp32: a
        # few ulps of the logit scale in the gradient).
        atol = max(atol, 1e-6 if dtype == torch.float32 else 1e-2)
    check(
        lambda x: ops.cross_entropy(x, target, II, sm, reduction, zl, sc),
        lambda x: ref_ce(x, target, sm, reduction, zl, sc),
        [logits],
        atol,
        rtol,
        name="cross_entropy",
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-4])
def test_masked_logits_give_torchs_finite_loss(dtype, reduction, z_loss):
    """-inf logits (a masked vocabulary, a -inf bias) leave the loss
    finite, as torch's (it was NaN: 0 times an infinite sum); the first
    300 logits of row 0 masked start a row with whole blocks of -inf."""
    n, v = 33, 1001
    logits = torch.randn(n, v) * 4
    target = targets(n, v)
    if (target != II).sum() == 0:
        target[0] = 1
    target[0] = v - 1
    mask = torch.rand(n, v) < 0.2
    mask[0, :300] = True
    mask[torch.arange(n)[target != II], target[target != II]] = False
    logits = logits.masked_fill(mask, float("-inf")).to(dtype).requires_grad_()
    atol, rtol = CE_TOL[dtype]
    if z_loss:
        atol = max(atol, 1e-6 if dtype == torch.float32 else 1e-2)
    kf = lambda x: ops.cross_entropy(x, target, II, 0.0, reduction, z_loss)
    assert torch.isfinite(kf(logits)).all()
    check(kf, lambda x: ref_ce(x, target, 0.0, reduction, z_loss), [logits], atol, rtol, name="cross_entropy")
    # With label smoothing the loss is +inf in both (the mean of -log p
    # takes the masked logits).
    got = ops.cross_entropy(logits.detach(), target, II, 0.1, reduction, z_loss)
    want = ref_ce(logits.detach(), target, 0.1, reduction, z_loss)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.isinf(want).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cross_entropy_with_a_masking_bias(dtype):
    """A -inf bias entry masks a vocabulary column: a finite loss and
    torch's gradients for x and the weight."""
    n, h, v = 33, 48, 1001
    x = torch.randn(n, h).to(dtype).requires_grad_()
    w = (torch.randn(v, h) / h**0.5).to(dtype).requires_grad_()
    bias = torch.zeros(v)
    bias[torch.randperm(v)[:200]] = float("-inf")
    target = targets(n, v, seed=3)
    target[target != II] = torch.nonzero(bias == 0).flatten()[: int((target != II).sum())]
    bias = bias.to(dtype)
    loss = ops.linear_cross_entropy(x, w, target, bias)
    assert torch.isfinite(loss)

    def tf(x, w):
        return ref_ce(up(F.linear(x, w, bias.to(x.dtype))), target).to(x.dtype)

    check(lambda x, w: ops.linear_cross_entropy(x, w, target, bias), tf, [x, w], *LCE_TOL[("mean", dtype)],
          name="linear_cross_entropy")


def test_linear_cross_entropy_loss_dtype():
    """``loss_dtype=torch.float32`` gives the float32 sum of a bfloat16
    run (as Hugging Face's loss), of which the default is the rounding."""
    x = torch.randn(9, 16, dtype=torch.bfloat16)
    w = torch.randn(40, 16, dtype=torch.bfloat16)
    t = torch.randint(0, 40, (9,))
    full = ops.linear_cross_entropy(x, w, t, loss_dtype=torch.float32)
    assert full.dtype == torch.float32
    assert ops.linear_cross_entropy(x, w, t).dtype == torch.bfloat16
    assert ops.linear_cross_entropy(x, w, t) == full.to(torch.bfloat16)
    with pytest.raises(ValueError, match="loss_dtype"):
        ops.linear_cross_entropy(x, w, t, loss_dtype=torch.int64)


def test_cross_entropy_bad_target():
    logits = torch.randn(3, 5)
    with pytest.raises(ValueError):
        ops.cross_entropy(logits, torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError):
        ops.cross_entropy(logits, torch.tensor([0, -3, 1]))


LCE_TOL = {
    ("mean", torch.float32): (1e-5, 5e-4),
    ("mean", torch.bfloat16): (5e-3, 5e-2),
    ("sum", torch.float32): (1e-3, 5e-2),
    ("sum", torch.bfloat16): (5e-2, 5e-2),
    ("none", torch.float32): (1e-5, 5e-4),
    ("none", torch.bfloat16): (5e-3, 5e-2),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bthv", [(2, 16, 64, 500), (4, 47, 31, 123), (1, 3, 123, 4099)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("opts", [dict(), dict(smoothing=0.1, z_loss=1e-4, softcap=30.0)])
def test_linear_cross_entropy(dtype, bthv, reduction, bias, opts):
    b, t, h, v = bthv
    x = torch.randn(b * t, h, dtype=dtype, requires_grad=True)
    w = (torch.randn(v, h) / h**0.5).to(dtype).requires_grad_()
    bb = (torch.randn(v) * 0.1).to(dtype).requires_grad_() if bias else None
    target = targets(b * t, v, seed=1)
    if (target != II).sum() == 0:
        target[0] = 1
    sm, zl, sc = opts.get("smoothing", 0.0), opts.get("z_loss", 0.0), opts.get("softcap")
    inputs = [x, w] + ([bb] if bias else [])

    def kf(x, w, *bb):
        return ops.linear_cross_entropy(x, w, target, bb[0] if bb else None, II, sm, reduction, zl, sc)

    def tf(x, w, *bb):
        # The eager peer as Hugging Face runs it: logits upcast to float32.
        logits = up(F.linear(x, w, bb[0] if bb else None))
        return ref_ce(logits, target, sm, reduction, zl, sc).to(x.dtype)

    check(kf, tf, inputs, *LCE_TOL[(reduction, dtype)], name="linear_cross_entropy")


def test_linear_cross_entropy_no_grad_and_3d():
    x = torch.randn(2, 5, 16)
    w = torch.randn(40, 16)
    t = torch.randint(0, 40, (2, 5))
    with torch.no_grad():
        got = ops.linear_cross_entropy(x, w, t)
    want = F.cross_entropy(F.linear(x, w).reshape(-1, 40), t.reshape(-1))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_backward_and_retain_graph(dtype):
    """``loss.backward()`` hands the gradient computed in the forward pass
    over as it is (no scaling pass when the upstream gradient is 1):
    gradients as torch's; a second backward with the graph retained adds
    the same gradient again, and a scaled loss scales it. (A third backward
    into the same leaf raises torch's in-place modification error: the leaf
    took the saved buffer as its .grad, as with Liger's kernels.)"""
    n, h, v = 37, 24, 501
    logits = (torch.randn(n, v) * 4).to(dtype)
    x = torch.randn(n, h).to(dtype)
    w = (torch.randn(v, h) * 0.2).to(dtype)
    t = targets(n, v)
    atol, rtol = (1e-5, 5e-4) if dtype == torch.float32 else (5e-3, 5e-2)
    cases = [
        ("ce", (logits,), lambda a: ops.cross_entropy(a, t), lambda a: F.cross_entropy(up(a), t, ignore_index=II)),
        (
            "lce",
            (x, w),
            lambda a, b: ops.linear_cross_entropy(a, b, t),
            lambda a, b: F.cross_entropy(up(a) @ up(b).T, t, ignore_index=II),
        ),
    ]
    for name, ins, kf, tf in cases:
        ka = [i.clone().requires_grad_() for i in ins]
        ta = [i.clone().requires_grad_() for i in ins]
        kl, tl = kf(*ka), tf(*ta)
        kl.backward(retain_graph=True)
        tl.backward(retain_graph=True)
        first = [a.grad.clone() for a in ka]
        for a, b in zip(ka, ta):
            torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=atol, rtol=rtol, msg=name)
        kl.backward()
        for a, f in zip(ka, first):
            torch.testing.assert_close(a.grad, 2 * f, atol=0, rtol=0, msg=name)
        ka = [i.clone().requires_grad_() for i in ins]
        (kf(*ka) * 0.5).backward()
        for a, f in zip(ka, first):
            torch.testing.assert_close(a.grad, (0.5 * f.float()).to(dtype), atol=0, rtol=0, msg=name)
