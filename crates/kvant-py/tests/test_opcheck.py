"""torch.library.opcheck on every op: schema, fake (meta) implementation,
autograd registration and torch.compile's requirements."""

import pytest
import torch

import kvant  # noqa: F401  (registers the ops)

x = torch.randn(3, 5, 16, requires_grad=True)
w = torch.randn(16, requires_grad=True)
b = torch.randn(16, requires_grad=True)
q = torch.randn(1, 4, 9, 16, requires_grad=True)
k = torch.randn(1, 2, 9, 16, requires_grad=True)
v = torch.randn(1, 2, 9, 16, requires_grad=True)
cos = torch.randn(1, 9, 8)
sin = torch.randn(1, 9, 8)
logits = torch.randn(6, 50, requires_grad=True)
tgt = torch.tensor([1, 2, -100, 4, 5, 49])
head = torch.randn(50, 16, requires_grad=True)
lp = torch.randn(6, 50).log_softmax(-1)

CASES = {
    "rms_norm": (torch.ops.kvant.rms_norm, (x, w, 1e-6, 0.0, "llama")),
    "add_rms_norm": (torch.ops.kvant.add_rms_norm, (x, x.detach().clone().requires_grad_(), w, 1e-6, 1.0, "gemma")),
    "layer_norm": (torch.ops.kvant.layer_norm, (x, w, b, 1e-5)),
    "rope": (torch.ops.kvant.rope, (q, k, cos, sin, False, False)),
    "glu": (torch.ops.kvant.glu, (x, x.detach().clone().requires_grad_(), "swiglu")),
    "cross_entropy": (torch.ops.kvant.cross_entropy, (logits, tgt, -100, 0.1, 1e-4, 30.0, "mean", True)),
    "linear_cross_entropy": (
        torch.ops.kvant.linear_cross_entropy,
        (torch.randn(6, 16, requires_grad=True), head, tgt, None, -100, 0.0, 0.0, None, "mean", True),
    ),
    "kl_div": (torch.ops.kvant.kl_div, (logits.detach().log_softmax(-1).requires_grad_(), lp.exp(), "batchmean", False)),
    "jsd": (torch.ops.kvant.jsd, (logits.detach().log_softmax(-1).requires_grad_(), lp, tgt, 0.5, -100)),
    "flash_attn": (torch.ops.kvant.flash_attn, (q, k, v, 0.25, True, None)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name):
    op, args = CASES[name]
    # The glu backward overwrites its saved inputs (by design): skip the
    # repeated-backward autograd check for it.
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    if name != "glu":
        tests = tests + ("test_autograd_registration",)
    torch.library.opcheck(op, args, test_utils=tests)


def test_compile_matches_eager():
    def f(x, w):
        return kvant.ops.rms_norm(x, w).sum()

    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(cf(x, w), f(x, w))
