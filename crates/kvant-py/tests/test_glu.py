"""SwiGLU and GeGLU (tanh) against torch. Liger's GeGLU tolerances: fp32
(1e-5, 1e-5), bf16 (1e-2, 1e-2); the same are used for SwiGLU (Liger only
tests it inside a whole MLP). kvant's exp/tanh are polynomial (~2e-7
relative), so fp32 uses (2e-5, 1e-5)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, check

from kvant import ops

TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 16, 128), (5, 7, 123), (1, 31), (4096,)])
@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
def test_glu(dtype, shape, kind):
    a = (torch.randn(shape) * 3).to(dtype).requires_grad_()
    b = torch.randn(shape, dtype=dtype, requires_grad=True)
    kfn = ops.swiglu if kind == "swiglu" else ops.geglu

    def tfn(a, b):
        return (F.silu(a) if kind == "swiglu" else F.gelu(a, approximate="tanh")) * b

    # The backward overwrites a and b: give kvant its own copies.
    check(lambda a, b: kfn(a.clone(), b.clone()), tfn, [a, b], *TOL[dtype], name=kind)


def test_mlp_module_matches_hf():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    import kvant

    cfg = LlamaConfig(hidden_size=48, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2)
    hf = LlamaMLP(cfg)
    k = kvant.nn.SwiGLUMLP(cfg)
    k.load_state_dict(hf.state_dict())
    x = torch.randn(2, 3, 48, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    yk, yh = k(x), hf(x2)
    torch.testing.assert_close(yk, yh, atol=1e-5, rtol=1e-5)
    yk.sum().backward()
    yh.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-5)
    for (n, p), (_, q) in zip(k.named_parameters(), hf.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-5, msg=n)
