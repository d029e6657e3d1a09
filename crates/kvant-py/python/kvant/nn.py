"""kvant's kernels as ``torch.nn.Module``s.

The norm and MLP modules keep Hugging Face's attribute names (``weight``,
``variance_epsilon``, ``gate_proj``, ...) so that ``kvant.patch`` can swap
them into a model that is already built, keeping its weights."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from . import ops


class RMSNorm(nn.Module):
    """RMSNorm with ``offset + weight`` scaling and a casting mode
    (``'llama'`` or ``'gemma'``, see ``kvant.ops.rms_norm``)."""

    offset = 0.0
    casting = "llama"

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: Optional[float] = None, casting: Optional[str] = None):
        super().__init__()
        if offset is not None:
            self.offset = offset
        if casting is not None:
            self.casting = casting
        init = torch.zeros if self.offset == 1.0 else torch.ones
        self.weight = nn.Parameter(init(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.variance_epsilon, self.offset, self.casting)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}, casting={self.casting}"


class LlamaRMSNorm(RMSNorm):
    """Drop-in for Hugging Face's ``LlamaRMSNorm`` (and Qwen2/Qwen3's)."""


class GemmaRMSNorm(RMSNorm):
    """Drop-in for Hugging Face's ``Gemma3RMSNorm``: ``1 + weight``, all in float32."""

    offset = 1.0
    casting = "gemma"

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps)

    @property
    def eps(self) -> float:  # Gemma's attribute name
        return self.variance_epsilon

    @eps.setter
    def eps(self, v: float) -> None:
        self.variance_epsilon = v


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class SwiGLUMLP(nn.Module):
    """Drop-in for Hugging Face's ``LlamaMLP``: ``down(silu(gate(x)) * up(x))``
    with the gated product fused (its backward writes into the two
    projections' outputs instead of saving the activation)."""

    kind = "swiglu"

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.gate_proj(x), self.up_proj(x)
        h = ops.swiglu(a, b) if self.kind == "swiglu" else ops.geglu(a, b)
        return self.down_proj(h)


class GeGLUMLP(SwiGLUMLP):
    """Drop-in for Gemma's MLP (``gelu_pytorch_tanh`` gate)."""

    kind = "geglu"


class CrossEntropyLoss(nn.Module):
    def __init__(
        self,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
    ):
        super().__init__()
        self.ignore_index, self.label_smoothing, self.reduction = ignore_index, label_smoothing, reduction
        self.z_loss, self.softcap = z_loss, softcap

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return ops.cross_entropy(
            logits, target, self.ignore_index, self.label_smoothing, self.reduction, self.z_loss, self.softcap
        )


class FusedLinearCrossEntropyLoss(CrossEntropyLoss):
    """Liger's argument order: ``loss(lin_weight, x, target, bias=None)``."""

    def forward(self, lin_weight: Tensor, x: Tensor, target: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return ops.linear_cross_entropy(
            x, lin_weight, target, bias, self.ignore_index, self.label_smoothing, self.reduction, self.z_loss, self.softcap
        )


class KLDivLoss(nn.Module):
    def __init__(self, reduction: str = "batchmean", log_target: bool = False):
        super().__init__()
        self.reduction, self.log_target = reduction, log_target

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return ops.kl_div(input, target, self.reduction, self.log_target)


class JSD(nn.Module):
    def __init__(self, beta: float = 0.5, ignore_index: int = -100):
        super().__init__()
        self.beta, self.ignore_index = beta, ignore_index

    def forward(self, log_q: Tensor, log_p: Tensor, shift_labels: Optional[Tensor] = None) -> Tensor:
        return ops.jsd(log_q, log_p, shift_labels, self.beta, self.ignore_index)


class FusedLinearJSD(nn.Module):
    def __init__(self, jsd_beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0):
        super().__init__()
        self.beta, self.ignore_index, self.temperature = jsd_beta, ignore_index, temperature

    def forward(
        self,
        student_input: Tensor,
        student_weight: Tensor,
        teacher_input: Tensor,
        teacher_weight: Tensor,
        shift_labels: Optional[Tensor] = None,
    ) -> Tensor:
        return ops.linear_jsd(
            student_input, student_weight, teacher_input, teacher_weight, shift_labels, self.beta, self.ignore_index, self.temperature
        )
