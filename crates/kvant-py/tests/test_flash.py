"""FlashAttention forward and backward against torch's
scaled_dot_product_attention with an explicit mask (causal bottom-right,
grouped-query heads, sliding windows). Tolerances: fp32 (1e-5, 1e-4): a
softmax over at most a few hundred keys in float32 with a polynomial exp
(~2e-7 relative); bf16 (2e-2, 2e-2), one bf16 rounding of values of
order 1, plus the fp64 oracle."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, check

from kvant import ops

TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


def mask(sq, sk, causal, window):
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    m = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        m &= j <= i
    if window is not None:
        m &= (i - j) < window
        if not causal:
            m &= (j - i) < window
    return m


def ref(q, k, v, causal, window, scale):
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, 1)
    v = v.repeat_interleave(rep, 1)
    m = mask(q.shape[2], k.shape[2], causal, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)


CASES = [
    # b, hq, hk, sq, sk, d, dv, causal, window
    (1, 2, 2, 7, 7, 31, 31, True, None),
    (2, 4, 2, 65, 65, 64, 64, True, None),
    (1, 6, 1, 33, 33, 16, 16, True, 5),
    (1, 2, 1, 130, 130, 64, 64, True, 100),
    (1, 2, 2, 9, 20, 32, 32, True, None),
    (2, 2, 1, 17, 17, 32, 32, False, None),
    (1, 1, 1, 1, 1, 8, 8, True, None),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_flash(dtype, case):
    b, hq, hk, sq, sk, d, dv, causal, window = case
    q = torch.randn(b, hq, sq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hk, sk, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hk, sk, dv, dtype=dtype, requires_grad=True)
    scale = d**-0.5
    check(
        lambda q, k, v: ops.flash_attn(q, k, v, causal=causal, scale=scale, window=window),
        lambda q, k, v: ref(q, k, v, causal, window, scale),
        [q, k, v],
        *TOL[dtype],
        name="flash_attn",
    )


def test_flash_is_deterministic():
    q, k, v = (torch.randn(1, 4, 100, 32, requires_grad=True) for _ in range(3))
    grads = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        ops.flash_attn(q, k, v).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_fully_masked_rows_are_zero():
    # Key count below query count with a causal mask: the first rows see no key.
    q = torch.randn(1, 1, 5, 8)
    k, v = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
    out = ops.flash_attn(q, k, v, causal=True)
    assert torch.all(out[0, 0, :2] == 0)
