"""RMSNorm (Llama and Gemma casting), fused add + RMSNorm and LayerNorm
against Hugging Face's and torch's definitions.

Liger's tolerances (atol, rtol): RMSNorm fp32 (1e-4, 1e-6), bf16 (2e-1,
2e-2); LayerNorm fp32 (1e-5, 1e-5), bf16 (2e-2, 2e-2). The weight
gradient sums over every row, so its absolute error grows with the row
count; fp32 here uses Liger's RMSNorm pair for both."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, check

import kvant
from kvant import ops

SHAPES = [(2, 16, 64), (5, 7, 123), (1, 1, 31), (3, 41)]
TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-1, 2e-2)}


def hf_llama_rms(x, w, eps):
    dt = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dt)


def hf_gemma_rms(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).type_as(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_rms_norm(dtype, shape, casting):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = (torch.randn(shape[-1]) * 0.5 + (0.0 if casting == "gemma" else 1.0)).to(dtype).requires_grad_()
    eps = 1e-6
    offset = 1.0 if casting == "gemma" else 0.0
    ref = hf_gemma_rms if casting == "gemma" else hf_llama_rms
    check(
        lambda x, w: ops.rms_norm(x, w, eps, offset, casting),
        lambda x, w: ref(x, w, eps),
        [x, w],
        *TOL[dtype],
        name=f"rms_norm/{casting}",
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm(dtype, shape):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    r = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = (torch.randn(shape[-1]) * 0.5 + 1).to(dtype).requires_grad_()

    def ref(x, r, w):
        s = x + r
        return hf_llama_rms(s, w, 1e-6), s

    check(lambda x, r, w: ops.add_rms_norm(x, r, w, 1e-6), ref, [x, r, w], *TOL[dtype], name="add_rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm(dtype, shape):
    x = (torch.randn(shape) * 2 + 0.5).to(dtype).requires_grad_()
    w = torch.randn(shape[-1], dtype=dtype, requires_grad=True)
    b = torch.randn(shape[-1], dtype=dtype, requires_grad=True)
    tol = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2)}[dtype]
    check(
        lambda x, w, b: ops.layer_norm(x, w, b, 1e-5),
        lambda x, w, b: F.layer_norm(x, (shape[-1],), w, b, 1e-5),
        [x, w, b],
        *tol,
        name="layer_norm",
    )


def test_modules_match_hf():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        hf.weight.normal_()
    k = kvant.nn.LlamaRMSNorm(48, eps=1e-5)
    k.load_state_dict(hf.state_dict())
    x = torch.randn(3, 5, 48)
    torch.testing.assert_close(k(x), hf(x), atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:Input #")
def test_gradcheck_tiny():
    x = torch.randn(3, 5, requires_grad=True)
    w = torch.randn(5, requires_grad=True)
    # float32 finite differences: eps 1e-3 leaves ~1e-3 relative truncation error.
    assert torch.autograd.gradcheck(lambda x, w: ops.rms_norm(x, w, 1e-6), (x, w), eps=1e-3, atol=2e-2, rtol=2e-2)
    b = torch.randn(5, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: ops.layer_norm(x, w, b), (x, w, b), eps=1e-3, atol=2e-2, rtol=2e-2)
