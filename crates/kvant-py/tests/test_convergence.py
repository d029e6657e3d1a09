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


def _family(name):
    import transformers

    if name == "qwen3":
        from transformers.models.qwen3 import modeling_qwen3 as m

        cfg = transformers.Qwen3Config(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        )
        return m, "Qwen3", transformers.Qwen3ForCausalLM, cfg
    from transformers.models.gemma3 import modeling_gemma3 as m

    cfg = transformers.Gemma3TextConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        final_logit_softcapping=30.0,
    )
    return m, "Gemma3", transformers.Gemma3ForCausalLM, cfg


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_patched_families_match(name):
    import kvant

    m, prefix, cls, cfg = _family(name)
    saved = {k: getattr(m, k) for k in ("apply_rotary_pos_emb", f"{prefix}RMSNorm", f"{prefix}MLP")}
    saved_fwd = getattr(m, f"{prefix}ForCausalLM").forward
    try:
        torch.manual_seed(0)
        ref = cls(cfg).train()
        model = cls(cfg).train()
        model.load_state_dict(ref.state_dict())
        getattr(kvant.patch, f"apply_kvant_kernel_to_{name}")(model=model)
        ids = torch.randint(0, 1000, (2, 24))
        l0 = ref(input_ids=ids, labels=ids).loss
        l1 = model(input_ids=ids, labels=ids).loss
        l0.backward()
        l1.backward()
        torch.testing.assert_close(l1, l0, rtol=2e-5, atol=0)
        for (n, p0), (_, p1) in zip(ref.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(p1.grad, p0.grad, atol=1e-5, rtol=1e-4, msg=n)
    finally:
        for k, v in saved.items():
            setattr(m, k, v)
        getattr(m, f"{prefix}ForCausalLM").forward = saved_fwd


def test_patched_bf16_forward_matches_hugging_face_outputs(restore_llama, monkeypatch):
    """A bfloat16 model's training loss comes back in float32, as Hugging
    Face's (computed from logits upcast to float32), close to it; an
    inference forward returns the KV cache under the output's own field
    name, and no forward logs transformers' deprecation of the old one."""
    from transformers.utils import generic

    logged = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda *a, **k: logged.append(a))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    ref = LlamaForCausalLM(cfg).to(torch.bfloat16).train()
    ids = torch.randint(0, 1000, (2, 24))
    # Hugging Face's own outputs first: the patch replaces the class's forward.
    want = ref(input_ids=ids, labels=ids).loss
    with torch.no_grad():
        base = ref.eval()(input_ids=ids, use_cache=True)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).train()
    model.load_state_dict(ref.state_dict())
    apply_kvant_kernel_to_llama(model=model)
    logged.clear()
    got = model(input_ids=ids, labels=ids).loss
    assert want.dtype == torch.float32 and got.dtype == torch.float32
    # kvant's logits are float32 sums of the bf16 products, Hugging Face's
    # are rounded to bf16 first (2^-8 relative per logit).
    torch.testing.assert_close(got, want, rtol=1e-2, atol=0)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    field = "cache" if "cache" in type(out).__dataclass_fields__ else "past_key_values"
    assert getattr(out, field) is not None
    assert type(getattr(out, field)) is type(getattr(base, field))
    assert not any("deprecated" in str(a) for a in logged), logged
