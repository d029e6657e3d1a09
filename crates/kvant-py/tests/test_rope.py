"""RoPE against Hugging Face's apply_rotary_pos_emb (half-split), GPT-J's
interleaved layout, partial rotary and strided q/k. Liger's tolerances:
fp32 (1e-5, 1e-5), bf16 (1e-1, 1e-5)."""

import pytest
import torch
from conftest import DTYPES, check

from kvant import ops
from kvant.patch import kvant_rotary_pos_emb

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-1, 1e-5)}


def tables(b, s, rot, dtype, interleaved=False, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    pos = torch.arange(s, dtype=torch.float32)[None, :].expand(b, s) + torch.arange(b)[:, None] * 3
    f = pos[..., None] * inv
    emb = torch.repeat_interleave(f, 2, dim=-1) if interleaved else torch.cat([f, f], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def rotate_interleaved(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([-x2, x1], dim=-1).flatten(-2)


def ref_rope(q, k, cos, sin, interleaved):
    rot = cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    rf = rotate_interleaved if interleaved else rotate_half

    def one(x):
        xr, xp = x[..., :rot], x[..., rot:]
        return torch.cat([xr * c + rf(xr) * s, xp], dim=-1)

    return one(q), one(k)


CASES = [
    # b, hq, hk, s, d, rot
    (1, 4, 2, 7, 64, 64),
    (2, 3, 1, 5, 32, 16),
    (2, 6, 6, 33, 128, 128),
    (1, 1, 1, 1, 8, 8),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope(dtype, case, interleaved):
    b, hq, hk, s, d, rot = case
    q = torch.randn(b, hq, s, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hk, s, d, dtype=dtype, requires_grad=True)
    cos, sin = tables(b, s, rot, dtype, interleaved)
    check(
        lambda q, k: ops.rope(q, k, cos, sin, interleaved),
        lambda q, k: ref_rope(q, k, cos, sin, interleaved),
        [q, k],
        *TOL[dtype],
        name="rope",
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_strided_like_hf(dtype):
    # Hugging Face rotates q.view(b, s, h, d).transpose(1, 2): strided memory.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, s, h, d = 2, 9, 4, 32
    q = torch.randn(b, s, h, d, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, 2, d, dtype=dtype).transpose(1, 2).requires_grad_()
    cos, sin = tables(1, s, d, dtype)
    check(
        lambda q, k: kvant_rotary_pos_emb(q, k, cos, sin),
        lambda q, k: apply_rotary_pos_emb(q, k, cos, sin),
        [q, k],
        *TOL[dtype],
        name="rope/hf",
    )


def test_rope_unsqueeze_dim_2():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = torch.randn(2, 5, 3, 16), torch.randn(2, 5, 1, 16)
    cos, sin = tables(2, 5, 16, torch.float32)
    got = kvant_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    want = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
