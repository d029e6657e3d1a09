"""One call swaps kvant's kernels into Hugging Face models, as Liger's
``apply_liger_kernel_to_llama()`` does.

Called before the model is built, a patch replaces the classes and
functions of the model's ``modeling_*`` module; given ``model=``, it also
converts the modules of a model already built (weights kept). The causal-LM
forward computes the training loss with the fused linear cross-entropy, so
the [tokens x vocabulary] logits never exist (logits are returned only
when no loss is computed, as in Liger).
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch
from torch import Tensor

from . import nn as knn
from . import ops

__all__ = [
    "apply_kvant_kernel_to_llama",
    "apply_kvant_kernel_to_qwen2",
    "apply_kvant_kernel_to_qwen3",
    "apply_kvant_kernel_to_gemma3",
    "kvant_rotary_pos_emb",
    "kvant_attention_forward",
]


def kvant_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids=None, unsqueeze_dim: int = 1):
    """Hugging Face's ``apply_rotary_pos_emb`` on kvant's kernel."""
    if unsqueeze_dim == 2:  # q, k as [b, s, h, d]: rotate the [b, h, s, d] view
        qo, ko = ops.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return qo.transpose(1, 2), ko.transpose(1, 2)
    return ops.rope(q, k, cos, sin)


def kvant_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    **kwargs,
):
    """An attention function for ``transformers``' ``AttentionInterface``:
    kvant's FlashAttention for causal attention without padding (the mask
    function then gives ``None``), torch's SDPA for anything else (padding
    masks, dropout, soft-capping)."""
    causal = getattr(module, "is_causal", True)
    if attention_mask is None and dropout == 0.0 and kwargs.get("softcap") is None and causal:
        out = ops.flash_attn(query, key, value, causal=True, scale=scaling, window=sliding_window)
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window, **kwargs
    )


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("kvant", kvant_attention_forward)
    AttentionMaskInterface.register("kvant", sdpa_mask)


def _cache_field(cls: type) -> Optional[str]:
    """The name an output dataclass gives its KV cache, if it has one."""
    declared = getattr(cls, "__dataclass_fields__", {})
    return next((k for k in ("cache", "past_key_values") if k in declared), None)


def _causal_lm_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    logits_to_keep=0,
    **kwargs,
):
    """The causal LM forward with the loss from the fused linear
    cross-entropy while training (labels shifted as transformers'
    ``ForCausalLMLoss`` does; ``num_items_in_batch`` honoured)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    hidden = outputs.last_hidden_state
    softcap = getattr(self.config, "final_logit_softcapping", None)
    loss, logits = None, None
    if labels is not None and self.training:
        ignore_index = kwargs.get("ignore_index", -100)
        shift_labels = kwargs.get("shift_labels")
        if shift_labels is None:
            padded = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = padded[..., 1:].contiguous()
        n_items = kwargs.get("num_items_in_batch")
        h = hidden.reshape(-1, hidden.shape[-1])
        loss = ops.linear_cross_entropy(
            h,
            self.lm_head.weight,
            shift_labels.reshape(-1),
            bias=self.lm_head.bias,
            ignore_index=ignore_index,
            reduction="sum" if n_items is not None else "mean",
            softcap=softcap,
            # Hugging Face's loss is float32 (its logits are upcast first).
            loss_dtype=torch.float32,
        )
        if n_items is not None:
            loss = loss / (n_items.to(loss.device) if torch.is_tensor(n_items) else n_items)
    else:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
    # The KV cache under the name each output class declares: `cache` from
    # transformers 5.25 (reading `past_key_values` there logs a deprecation
    # warning on every forward), `past_key_values` before.
    src, dst = _cache_field(type(outputs)), _cache_field(CausalLMOutputWithPast)
    extra = {dst: outputs.get(src)} if src and dst else {}
    return CausalLMOutputWithPast(
        loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions, **extra
    )


def _apply(
    module_name: str,
    prefix: str,
    norm_cls: type,
    mlp_cls: type,
    rope: bool,
    rms_norm: bool,
    mlp: bool,
    fused_linear_cross_entropy: bool,
    attention: bool,
    model: Optional[torch.nn.Module],
) -> None:
    m = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    hf_norm, hf_mlp = getattr(m, f"{prefix}RMSNorm"), getattr(m, f"{prefix}MLP")
    if rope:
        m.apply_rotary_pos_emb = kvant_rotary_pos_emb
    if rms_norm:
        setattr(m, f"{prefix}RMSNorm", norm_cls)
    if mlp:
        setattr(m, f"{prefix}MLP", mlp_cls)
    if fused_linear_cross_entropy:
        getattr(m, f"{prefix}ForCausalLM").forward = _causal_lm_forward
    if attention:
        _register_attention()
    if model is None:
        return
    # A model already built: convert its modules (same attributes, so the
    # weights stay where they are).
    for sub in model.modules():
        if rms_norm and isinstance(sub, hf_norm):
            eps = getattr(sub, "variance_epsilon", getattr(sub, "eps", 1e-6))
            sub.__class__ = norm_cls
            sub.variance_epsilon = eps
        elif mlp and isinstance(sub, hf_mlp):
            sub.__class__ = mlp_cls
    if fused_linear_cross_entropy and type(model).__name__ == f"{prefix}ForCausalLM":
        model.forward = _causal_lm_forward.__get__(model, type(model))
    if attention:
        model.set_attn_implementation("kvant")


def _patcher(module_name: str, prefix: str, norm_cls: type, mlp_cls: type, doc: str):
    """The public ``apply_kvant_kernel_to_*`` function of one model family."""

    def apply(
        rope: bool = True,
        rms_norm: bool = True,
        mlp: bool = True,
        fused_linear_cross_entropy: bool = True,
        attention: bool = False,
        model: Optional[torch.nn.Module] = None,
        **legacy,
    ) -> None:
        # Liger's spelling of the MLP switch: swiglu= (geglu= for Gemma).
        mlp = legacy.pop("swiglu", legacy.pop("geglu", mlp))
        if legacy:
            raise TypeError(f"unexpected arguments: {sorted(legacy)}")
        _apply(module_name, prefix, norm_cls, mlp_cls, rope, rms_norm, mlp, fused_linear_cross_entropy, attention, model)

    apply.__name__ = apply.__qualname__ = f"apply_kvant_kernel_to_{module_name}"
    apply.__doc__ = doc
    return apply


apply_kvant_kernel_to_llama = _patcher(
    "llama",
    "Llama",
    knn.LlamaRMSNorm,
    knn.SwiGLUMLP,
    """Llama (and SmolLM2, Mistral-style Llama checkpoints): RoPE, RMSNorm,
    SwiGLU MLP (``mlp=``, or Liger's ``swiglu=``) and the fused linear
    cross-entropy loss; ``attention=True`` also registers kvant's
    FlashAttention as ``attn_implementation="kvant"`` (pass it to
    ``from_pretrained``/the config, or give ``model=``).""",
)
apply_kvant_kernel_to_qwen2 = _patcher(
    "qwen2", "Qwen2", knn.LlamaRMSNorm, knn.SwiGLUMLP, "Qwen2 / Qwen2.5, as ``apply_kvant_kernel_to_llama``."
)
apply_kvant_kernel_to_qwen3 = _patcher(
    "qwen3", "Qwen3", knn.LlamaRMSNorm, knn.SwiGLUMLP, "Qwen3 (q/k norms included), as ``apply_kvant_kernel_to_llama``."
)
apply_kvant_kernel_to_gemma3 = _patcher(
    "gemma3",
    "Gemma3",
    knn.GemmaRMSNorm,
    knn.GeGLUMLP,
    """Gemma 3 text models: ``1 + w`` RMSNorm in float32, GeGLU (tanh) MLP
    (``mlp=``, or Liger's ``geglu=``), RoPE, and the fused linear
    cross-entropy with the final logit soft-capping.""",
)
