"""Shared checks: kvant against torch autograd on identical inputs, with an
fp64 torch run as a second oracle.

Tolerances against torch are Liger-Kernel's per op (its test suite's
table, quoted in each test file), widened per element by torch's own error
against fp64 there. Against fp64, kvant's largest error must be no worse
than torch's own at the same dtype plus a floor in units of the largest
value's ulp (``ulp``): in bfloat16 two roundings (the kernel's store, and
the backward's scaling of a stored gradient by grad_output, as Liger does);
in float32 32 ulps (3.8e-6 relative), the polynomial exp/log/tanh (~2e-7
relative each) compounded through a softmax's normalisation and a log.
"""

import os

import pytest
import torch

torch.manual_seed(42)
torch.use_deterministic_algorithms(True)

DTYPES = [torch.float32, torch.bfloat16]


def up(x):
    """x in float32, or float64 when it is already (the fp64 oracle's run)."""
    return x if x.dtype == torch.float64 else x.float()


def ulp(dtype, scale):
    eps = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8}[dtype]
    return eps * max(float(scale), 1e-30)


def run(fn, inputs, grad_seed=0):
    """Outputs of fn(*inputs) and the gradients of every input that
    requires grad under a seeded random upstream gradient."""
    ins = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs]
    out = fn(*ins)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    g = torch.Generator().manual_seed(grad_seed)
    total = 0
    for o in outs:
        if o.requires_grad:
            up = torch.randn(o.shape, generator=g, dtype=torch.float32).to(o.dtype)
            total = total + (o.float() * up.float()).sum()
    grads = []
    if isinstance(total, torch.Tensor):
        total.backward()
        grads = [x.grad for x in ins if isinstance(x, torch.Tensor) and x.requires_grad]
    return [o.detach() for o in outs], grads


def to64(inputs):
    return [
        x.detach().double().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        for x in inputs
    ]


def check(kvant_fn, torch_fn, inputs, atol, rtol, torch64_fn=None, name=""):
    """kvant vs torch at the inputs' dtype within (atol, rtol) elementwise,
    where torch's own error against fp64 at that element widens the bound
    (torch's bfloat16 norms round their weight gradients several times and
    sit up to 15% from fp64 where kvant, rounding once, sits within 1%);
    then both against torch in fp64."""
    k_out, k_grads = run(kvant_fn, inputs)
    t_out, t_grads = run(torch_fn, inputs)
    r_out, r_grads = run(torch64_fn or torch_fn, to64(inputs))
    assert len(k_out) == len(t_out) and len(k_grads) == len(t_grads)
    for i, (a, b, r) in enumerate(zip(k_out + k_grads, t_out + t_grads, r_out + r_grads)):
        assert a.shape == b.shape, f"{name}[{i}] shape {a.shape} vs {b.shape}"
        assert a.dtype == b.dtype, f"{name}[{i}] dtype {a.dtype} vs {b.dtype}"
        a64, b64 = a.double(), b.double()
        both_nan = torch.isnan(a64) & torch.isnan(b64)
        bound = atol + rtol * b64.abs() + (b64 - r).abs()
        bad = ~both_nan & ~((a64 - b64).abs() <= bound)
        if bad.any():
            j = int(torch.nonzero(bad.flatten())[0])
            raise AssertionError(
                f"{name}[{i}] {a.dtype}: {int(bad.sum())}/{a.numel()} elements off; first at flat index {j}: "
                f"kvant {a.flatten()[j].item():.6g}, torch {b.flatten()[j].item():.6g}, fp64 {r.flatten()[j].item():.6g} "
                f"(atol {atol}, rtol {rtol})"
            )
    for i, (a, b, r) in enumerate(zip(k_out + k_grads, t_out + t_grads, r_out + r_grads)):
        ek = (a.double() - r).abs().max().item() if r.numel() else 0.0
        et = (b.double() - r).abs().max().item() if r.numel() else 0.0
        floor = 2 if a.dtype == torch.bfloat16 else 32
        bound = et + floor * ulp(a.dtype, r.abs().max().item() if r.numel() else 0.0)
        assert ek <= bound, f"{name}[{i}] {a.dtype}: kvant error {ek:.3g} vs fp64 exceeds torch's {et:.3g}"


@pytest.fixture(autouse=True)
def _seed(request):
    """Each test draws the same inputs whatever runs before it."""
    import zlib

    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def repo_root():
    return os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
