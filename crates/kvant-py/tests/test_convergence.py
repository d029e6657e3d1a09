"""A mini Llama (2 layers, vocabulary 32000) trained 32 steps with and
without kvant's patch gives the same losses within fp32 rtol 2e-5 (Liger's
convergence test's loss tolerance)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama as ml

from kvant.patch import apply_kvant_kernel_to_llama

STEPS = 32


def config():
    return LlamaConfig(
        vocab_size=32000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def train(patch=None):
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    if patch is not None:
        patch(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 32000, (2, 64), generator=g)
        labels = ids.clone()
        labels[:, :5] = -100
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.fixture
def restore_llama():
    saved = (ml.apply_rotary_pos_emb, ml.LlamaRMSNorm, ml.LlamaMLP, ml.LlamaForCausalLM.forward)
    yield
    ml.apply_rotary_pos_emb, ml.LlamaRMSNorm, ml.LlamaMLP, ml.LlamaForCausalLM.forward = saved


@pytest.mark.parametrize("attention", [False, True])
def test_mini_llama_converges_the_same(restore_llama, attention):
    base, m0 = train()
    patched, m1 = train(lambda m: apply_kvant_kernel_to_llama(attention=attention, model=m))
    assert type(m1.model.norm).__module__ == "kvant.nn"
    torch.testing.assert_close(torch.tensor(patched), torch.tensor(base), rtol=2e-5, atol=0)
    # The weights after training (Liger: 5e-3, 1e-5).
    for (n, p0), (_, p1) in zip(m0.named_parameters(), m1.named_parameters()):
        torch.testing.assert_close(p1, p0, atol=5e-3, rtol=1e-5, msg=n)
