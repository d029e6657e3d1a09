"""torch.autograd.gradcheck on tiny shapes for the losses, RoPE and
FlashAttention (the norms' are in test_norms.py). The kernels take float32
at most, so finite differences run in float32: eps 1e-3 leaves ~1e-3
relative truncation error, hence (atol, rtol) = (2e-2, 2e-2), as for the
norms. gradcheck also feeds undefined output gradients (None), which every
op must take as zeros. SwiGLU/GeGLU are left out by design: their backward
writes the gradients over the saved inputs (Liger's trick), which
gradcheck's repeated backward calls on the same inputs cannot allow."""

import torch

from kvant import ops


def gc(f, inputs):
    assert torch.autograd.gradcheck(f, inputs, eps=1e-3, atol=2e-2, rtol=2e-2)


def test_cross_entropy_and_fused_linear():
    torch.manual_seed(0)
    t = torch.tensor([1, -100, 6, 0])
    x = torch.randn(4, 7, requires_grad=True)
    gc(lambda x: ops.cross_entropy(x, t, label_smoothing=0.1, z_loss=1e-2), (x,))
    gc(lambda x: ops.cross_entropy(x, t, reduction="none", softcap=3.0), (x,))
    h = torch.randn(4, 5, requires_grad=True)
    w = torch.randn(7, 5, requires_grad=True)
    gc(lambda h, w: ops.linear_cross_entropy(h, w, t), (h, w))
    gc(lambda h, w: ops.linear_cross_entropy(h, w, t, reduction="none"), (h, w))


def test_distillation():
    torch.manual_seed(1)
    q = torch.randn(3, 6).log_softmax(-1).requires_grad_()
    p = torch.randn(3, 6).log_softmax(-1)
    gc(lambda q: ops.jsd(q, p, beta=0.3), (q,))
    gc(lambda q: ops.kl_div(q, p, log_target=True), (q,))
    xs = torch.randn(3, 4, requires_grad=True)
    ws = torch.randn(6, 4, requires_grad=True)
    xt, wt = torch.randn(3, 5), torch.randn(6, 5)
    gc(lambda xs, ws: ops.linear_jsd(xs, ws, xt, wt), (xs, ws))


def test_rope_and_flash_attention():
    torch.manual_seed(2)
    q = torch.randn(1, 2, 5, 4, requires_grad=True)
    k = torch.randn(1, 1, 5, 4, requires_grad=True)
    v = torch.randn(1, 1, 5, 4, requires_grad=True)
    ang = torch.arange(5.0)[:, None] * torch.tensor([1.0, 0.1])
    cos, sin = torch.cat([ang, ang], -1).cos()[None], torch.cat([ang, ang], -1).sin()[None]
    gc(lambda q, k: ops.rope(q, k, cos, sin), (q, k))
    gc(lambda q, k, v: ops.flash_attn(q, k, v, causal=True), (q, k, v))
    gc(lambda q, k, v: ops.flash_attn(q, k, v, window=2), (q, k, v))
