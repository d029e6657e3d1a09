"""kvant's training kernels as torch custom ops with autograd.

Every op is a ``torch.library.custom_op`` in the ``kvant`` namespace with a
fake (meta) implementation and a registered backward, so ``torch.compile``
traces through it and ``torch.library.opcheck`` accepts it. Torch allocates
every output; the Rust kernel fills it in place with the GIL released, on
torch's OpenMP threads (``torch.get_num_threads()`` of them, read at
import; see ``kvant/__init__.py``).

Inputs must be CPU tensors of float32 or bfloat16 (targets int64); the
native side checks device, dtype, density and aliasing and raises
``TypeError``/``ValueError`` otherwise. The functions at the bottom
(``rms_norm``, ``cross_entropy``, ...) are the public, torch-like API.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _kvant as _k

__all__ = [
    "rms_norm",
    "add_rms_norm",
    "layer_norm",
    "rope",
    "swiglu",
    "geglu",
    "cross_entropy",
    "linear_cross_entropy",
    "kl_div",
    "jsd",
    "linear_jsd",
    "flash_attn",
]

_FLOATS = (torch.float32, torch.bfloat16)


def _float_check(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} has dtype {t.dtype}; kvant takes torch.float32 and torch.bfloat16")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; kvant's kernels run on the CPU")


def _rows(t: Tensor) -> int:
    return t.numel() // max(t.shape[-1], 1) if t.dim() > 0 else 1


def _is_one(t: Tensor) -> bool:
    """``t`` is a real (not traced) scalar tensor holding 1: the usual
    ``loss.backward()``, where a gradient computed in the forward pass needs
    no scaling. Traced tensors (torch.compile) take the general path."""
    return type(t) is Tensor and t.numel() == 1 and t.item() == 1.0


def _scaled(g: Tensor, dloss: Tensor) -> Tensor:
    """``g · dloss`` for a gradient of a reduced loss: ``g`` itself when
    dloss is 1 (a pass over a logits- or weight-size buffer saved)."""
    return g if _is_one(dloss) else g * dloss.to(g.dtype)


def _no_aux_grads(ctx) -> None:
    """The op's extra outputs (statistics, gradients computed in the forward
    pass) never receive a gradient: without this autograd would hand the
    backward zeros of their sizes (a weight-size f32 buffer for the fused
    linear losses, a logits-size one for cross-entropy). The backward then
    gets None for an output no gradient reached, the main one included
    (gradcheck's undefined-gradient check), and returns None for all."""
    ctx.set_materialize_grads(False)


# --------------------------------------------------------------- RMSNorm


@torch.library.custom_op("kvant::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float, casting: str) -> Tuple[Tensor, Tensor]:
    x = x.contiguous()
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32)
    _k.rms_norm_fwd(x, weight.contiguous(), y, rstd, eps, offset, casting)
    return y, rstd


@_rms_norm.register_fake
def _(x, weight, eps, offset, casting):
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("kvant::rms_norm_backward", mutates_args=())
def _rms_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, eps: float, offset: float, casting: str
) -> Tuple[Tensor, Tensor]:
    dx = torch.empty_like(x)
    dw = torch.empty(weight.shape, dtype=torch.float32)
    _k.rms_norm_bwd((dy.contiguous(), x, weight.contiguous(), rstd), (dx, dw), (eps, offset, casting))
    return dx, dw.to(weight.dtype)


@_rms_norm_backward.register_fake
def _(dy, x, weight, rstd, eps, offset, casting):
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, offset, casting = inputs
    _no_aux_grads(ctx)
    ctx.save_for_backward(x.contiguous(), weight, output[1])
    ctx.args = (eps, offset, casting)


def _rms_norm_bwd(ctx, dy, _drstd):
    if dy is None:  # no gradient reached the output (see `_no_aux_grads`)
        return None, None, None, None, None
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.kvant.rms_norm_backward(dy, x, weight, rstd, *ctx.args)
    return dx, dw, None, None, None


_rms_norm.register_autograd(_rms_norm_bwd, setup_context=_rms_norm_setup)


# ---------------------------------------------------- fused add + RMSNorm


@torch.library.custom_op("kvant::add_rms_norm", mutates_args=())
def _add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float, casting: str
) -> Tuple[Tensor, Tensor, Tensor]:
    x, residual = x.contiguous(), residual.contiguous()
    y, s = torch.empty_like(x), torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32)
    _k.rms_norm_fwd(x, weight.contiguous(), y, rstd, eps, offset, casting, residual, s)
    return y, s, rstd


@_add_rms_norm.register_fake
def _(x, residual, weight, eps, offset, casting):
    return torch.empty_like(x), torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("kvant::add_rms_norm_backward", mutates_args=())
def _add_rms_norm_backward(
    dy: Tensor, dsum: Tensor, s: Tensor, weight: Tensor, rstd: Tensor, eps: float, offset: float, casting: str
) -> Tuple[Tensor, Tensor]:
    ds = torch.empty_like(s)
    dw = torch.empty(weight.shape, dtype=torch.float32)
    _k.rms_norm_bwd((dy.contiguous(), s, weight.contiguous(), rstd), (ds, dw), (eps, offset, casting), dsum.contiguous())
    return ds, dw.to(weight.dtype)


@_add_rms_norm_backward.register_fake
def _(dy, dsum, s, weight, rstd, eps, offset, casting):
    return torch.empty_like(s), torch.empty_like(weight)


def _add_rms_norm_setup(ctx, inputs, output):
    _x, _r, weight, eps, offset, casting = inputs
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.args = (eps, offset, casting)


def _add_rms_norm_bwd(ctx, dy, dsum, _drstd):
    s, weight, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(s)
    if dsum is None:
        dsum = torch.zeros_like(s)
    ds, dw = torch.ops.kvant.add_rms_norm_backward(dy, dsum, s, weight, rstd, *ctx.args)
    return ds, ds, dw, None, None, None


_add_rms_norm.register_autograd(_add_rms_norm_bwd, setup_context=_add_rms_norm_setup)


# ------------------------------------------------------------- LayerNorm


@torch.library.custom_op("kvant::layer_norm", mutates_args=())
def _layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    x = x.contiguous()
    y = torch.empty_like(x)
    mean = torch.empty(x.shape[:-1], dtype=torch.float32)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32)
    _k.layer_norm_fwd((x, weight.contiguous(), bias.contiguous()), (y, mean, rstd), eps)
    return y, mean, rstd


@_layer_norm.register_fake
def _(x, weight, bias, eps):
    r = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x), r, torch.empty_like(r)


@torch.library.custom_op("kvant::layer_norm_backward", mutates_args=())
def _layer_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor
) -> Tuple[Tensor, Tensor, Tensor]:
    dx = torch.empty_like(x)
    dw = torch.empty(weight.shape, dtype=torch.float32)
    db = torch.empty(weight.shape, dtype=torch.float32)
    _k.layer_norm_bwd((dy.contiguous(), x, weight.contiguous(), mean, rstd), (dx, dw, db))
    return dx, dw.to(weight.dtype), db.to(weight.dtype)


@_layer_norm_backward.register_fake
def _(dy, x, weight, mean, rstd):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


def _layer_norm_setup(ctx, inputs, output):
    x, weight, _bias, _eps = inputs
    _no_aux_grads(ctx)
    ctx.save_for_backward(x.contiguous(), weight, output[1], output[2])


def _layer_norm_bwd(ctx, dy, _dm, _dr):
    if dy is None:
        return None, None, None, None
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = torch.ops.kvant.layer_norm_backward(dy, x, weight, mean, rstd)
    return dx, dw, db, None


_layer_norm.register_autograd(_layer_norm_bwd, setup_context=_layer_norm_setup)


# ------------------------------------------------------------------ RoPE


def _rope_tables(cos: Tensor, sin: Tensor, dtype: torch.dtype, interleaved: bool) -> Tuple[Tensor, Tensor]:
    """Hugging Face's [b, s, rot] cos/sin (each frequency twice) as the
    kernel's [b, s, rot/2] tables."""
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    if cos.dim() == 4:  # [b, 1, s, rot] (already unsqueezed)
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    if interleaved:
        cos, sin = cos[..., ::2], sin[..., ::2]
    else:
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
    return cos.to(dtype).contiguous(), sin.to(dtype).contiguous()


@torch.library.custom_op("kvant::rope", mutates_args=())
def _rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, inverse: bool) -> Tuple[Tensor, Tensor]:
    rot = 2 * cos.shape[-1]
    outs = []
    for x in (q, k):
        # Out of place into x's own layout (a [b, s, h, d] projection viewed
        # as [b, h, s, d] stays so): one read of x and one write.
        if x.dim() > 0 and x.stride(-1) != 1:
            x = x.contiguous()
        o = torch.empty_like(x)
        if o.stride() != x.stride():
            # Not dense (a slice with gaps): empty_like made o contiguous.
            x = x.contiguous()
        _k.rope_apply(x, o, cos, sin, rot, interleaved, inverse)
        outs.append(o)
    return outs[0], outs[1]


@_rope.register_fake
def _(q, k, cos, sin, interleaved, inverse):
    return torch.empty_like(q), torch.empty_like(k)


def _rope_setup(ctx, inputs, output):
    _q, _k2, cos, sin, interleaved, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.args = (interleaved, not inverse)


def _rope_bwd(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq, dk = torch.ops.kvant.rope(dq, dk, cos, sin, *ctx.args)
    return dq, dk, None, None, None, None


_rope.register_autograd(_rope_bwd, setup_context=_rope_setup)


# ------------------------------------------------------------ SwiGLU / GeGLU


@torch.library.custom_op("kvant::glu", mutates_args=())
def _glu(a: Tensor, b: Tensor, kind: str) -> Tensor:
    a, b = a.contiguous(), b.contiguous()
    c = torch.empty_like(a)
    _k.glu_fwd(kind, a, b, c)
    return c


@_glu.register_fake
def _(a, b, kind):
    return torch.empty_like(a)


@torch.library.custom_op("kvant::glu_backward_", mutates_args=("a", "b"))
def _glu_backward_(dc: Tensor, a: Tensor, b: Tensor, kind: str) -> None:
    _k.glu_bwd(kind, dc.contiguous(), a, b)


@_glu_backward_.register_fake
def _(dc, a, b, kind):
    return None


def _glu_setup(ctx, inputs, output):
    a, b, kind = inputs
    ctx.save_for_backward(a.contiguous(), b.contiguous())
    ctx.kind = kind


def _glu_bwd(ctx, dc):
    # Liger's trick: the gradients overwrite the saved activations, so the
    # backward allocates nothing (a and b must not be read after backward).
    a, b = ctx.saved_tensors
    torch.ops.kvant.glu_backward_(dc, a, b, ctx.kind)
    return a, b, None


_glu.register_autograd(_glu_bwd, setup_context=_glu_setup)


# ------------------------------------------------------------- cross-entropy

_REDUCTIONS = ("none", "sum", "mean")


@torch.library.custom_op("kvant::cross_entropy", mutates_args=())
def _cross_entropy(
    logits: Tensor,
    target: Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    reduction: str,
    want_grad: bool,
) -> Tuple[Tensor, Tensor]:
    """(loss, grad): loss is per row for 'none'; grad is d loss / d logits
    (per row unscaled for 'none'), written in the forward pass, or empty."""
    logits = logits.contiguous()
    # The kernel reads the logits once and writes the gradient beside them:
    # no copy of the logits, which must stay as the caller left them.
    grad = torch.empty_like(logits) if want_grad else None
    losses = torch.empty(_rows(logits), dtype=torch.float32)
    loss, _z, _n = _k.cross_entropy_fwd(
        logits,
        target.contiguous().view(-1),
        losses,
        grad,
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
        reduction,
    )
    out = losses.view(target.shape) if reduction == "none" else torch.tensor(loss, dtype=torch.float32)
    return out.to(logits.dtype), grad if grad is not None else logits.new_empty(0)


@_cross_entropy.register_fake
def _(logits, target, ignore_index, label_smoothing, z_loss, softcap, reduction, want_grad):
    out = logits.new_empty(target.shape) if reduction == "none" else logits.new_empty(())
    return out, torch.empty_like(logits) if want_grad else logits.new_empty(0)


def _ce_setup(ctx, inputs, output):
    _no_aux_grads(ctx)
    ctx.reduction = inputs[6]
    ctx.save_for_backward(output[1])


def _ce_bwd(ctx, dloss, _dgrad):
    if dloss is None:
        return (None,) * 8
    (grad,) = ctx.saved_tensors
    if ctx.reduction == "none":
        g = grad * dloss.unsqueeze(-1).to(grad.dtype)
    else:
        g = _scaled(grad, dloss)
    return g, None, None, None, None, None, None, None


_cross_entropy.register_autograd(_ce_bwd, setup_context=_ce_setup)


# ------------------------------------------------- fused linear cross-entropy


@torch.library.custom_op("kvant::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    reduction: str,
    want_grad: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, dx, dw, db): the loss in float32 (the kernel's own sum; the
    public function casts it), gradients of the reduced loss computed in
    the forward pass (empty for 'none', whose backward recomputes them
    scaled by grad_output, or without want_grad)."""
    h = x.shape[-1]
    x2 = x.contiguous().view(-1, h)
    w = weight.contiguous()
    t = target.contiguous().view(-1)
    b = bias.contiguous() if bias is not None else None
    losses = torch.empty(x2.shape[0], dtype=torch.float32)
    grads = want_grad and reduction != "none"
    dx = torch.empty_like(x2) if grads else None
    dw = torch.empty(w.shape, dtype=torch.float32) if grads else None
    db = torch.empty(w.shape[0], dtype=torch.float32) if grads and b is not None else None
    loss, _z, _n = _k.linear_cross_entropy(
        x2, w, b, t, losses, dx, dw, db, None, (ignore_index, label_smoothing, z_loss, softcap, reduction)
    )
    out = losses.view(target.shape) if reduction == "none" else torch.tensor(loss, dtype=torch.float32)
    return (
        out,
        dx.view(x.shape) if dx is not None else x.new_empty(0),
        dw if dw is not None else x.new_empty(0, dtype=torch.float32),
        db if db is not None else x.new_empty(0, dtype=torch.float32),
    )


@_linear_cross_entropy.register_fake
def _(x, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap, reduction, want_grad):
    shape = target.shape if reduction == "none" else ()
    out = x.new_empty(shape, dtype=torch.float32)
    grads = want_grad and reduction != "none"
    dx = torch.empty_like(x) if grads else x.new_empty(0)
    dw = weight.new_empty(weight.shape, dtype=torch.float32) if grads else x.new_empty(0, dtype=torch.float32)
    db = (
        weight.new_empty(weight.shape[0], dtype=torch.float32)
        if grads and bias is not None
        else x.new_empty(0, dtype=torch.float32)
    )
    return out, dx, dw, db


@torch.library.custom_op("kvant::linear_cross_entropy_backward", mutates_args=())
def _linear_cross_entropy_backward(
    row_scale: Tensor,
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients for reduction 'none': row i's gradient times row_scale[i]."""
    h = x.shape[-1]
    x2 = x.contiguous().view(-1, h)
    w = weight.contiguous()
    b = bias.contiguous() if bias is not None else None
    losses = torch.empty(x2.shape[0], dtype=torch.float32)
    dx = torch.empty_like(x2)
    dw = torch.empty(w.shape, dtype=torch.float32)
    db = torch.empty(w.shape[0], dtype=torch.float32) if b is not None else None
    _k.linear_cross_entropy(
        x2,
        w,
        b,
        target.contiguous().view(-1),
        losses,
        dx,
        dw,
        db,
        row_scale.contiguous().view(-1).float(),
        (ignore_index, label_smoothing, z_loss, softcap, "none"),
    )
    return dx.view(x.shape), dw, db if db is not None else x.new_empty(0, dtype=torch.float32)


@_linear_cross_entropy_backward.register_fake
def _(row_scale, x, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap):
    db = weight.new_empty(weight.shape[0], dtype=torch.float32) if bias is not None else x.new_empty(0, dtype=torch.float32)
    return torch.empty_like(x), weight.new_empty(weight.shape, dtype=torch.float32), db


def _lce_setup(ctx, inputs, output):
    x, weight, target, bias, ignore_index, smoothing, z_loss, softcap, reduction, _want = inputs
    _no_aux_grads(ctx)
    ctx.reduction = reduction
    ctx.has_bias = bias is not None
    ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
    ctx.args = (ignore_index, smoothing, z_loss, softcap)
    if reduction == "none":
        ctx.save_for_backward(x, weight, target, bias)
    else:
        ctx.save_for_backward(output[1], output[2], output[3])


def _lce_bwd(ctx, dloss, _a, _b, _c):
    if dloss is None:
        return (None,) * 10
    if ctx.reduction == "none":
        x, weight, target, bias = ctx.saved_tensors
        dx, dw, db = torch.ops.kvant.linear_cross_entropy_backward(dloss, x, weight, target, bias, *ctx.args)
    else:
        dx, dw, db = ctx.saved_tensors
        dx, dw, db = _scaled(dx, dloss), _scaled(dw, dloss), _scaled(db, dloss)
    dw = dw.to(ctx.dtypes[0])
    db = db.to(ctx.dtypes[1]) if ctx.has_bias else None
    return dx, dw, None, db, None, None, None, None, None, None


_linear_cross_entropy.register_autograd(_lce_bwd, setup_context=_lce_setup)


# ------------------------------------------------------------ KL divergence

_KL_REDUCTIONS = ("none", "sum", "mean", "batchmean")


@torch.library.custom_op("kvant::kl_div", mutates_args=())
def _kl_div(input: Tensor, target: Tensor, reduction: str, log_target: bool) -> Tensor:
    i, t = input.contiguous(), target.contiguous()
    elementwise = torch.empty_like(i) if reduction == "none" else i.new_empty(0)
    loss = _k.kl_div_fwd(i, t, log_target, reduction, elementwise)
    if reduction == "none":
        return elementwise
    return torch.tensor(loss, dtype=torch.float32).to(input.dtype)


@_kl_div.register_fake
def _(input, target, reduction, log_target):
    return torch.empty_like(input) if reduction == "none" else input.new_empty(())


@torch.library.custom_op("kvant::kl_div_backward", mutates_args=())
def _kl_div_backward(dloss: Tensor, target: Tensor, reduction: str, log_target: bool) -> Tensor:
    t = target.contiguous()
    di = torch.empty_like(t)
    if reduction == "none":
        _k.kl_div_bwd(t, log_target, reduction, 1.0, dloss.contiguous().to(t.dtype), di)
    else:
        _k.kl_div_bwd(t, log_target, reduction, float(dloss), None, di)
    return di


@_kl_div_backward.register_fake
def _(dloss, target, reduction, log_target):
    return torch.empty_like(target)


def _kl_setup(ctx, inputs, output):
    _i, target, reduction, log_target = inputs
    ctx.save_for_backward(target)
    ctx.args = (reduction, log_target)


def _kl_bwd(ctx, dloss):
    (target,) = ctx.saved_tensors
    return torch.ops.kvant.kl_div_backward(dloss, target, *ctx.args), None, None, None


_kl_div.register_autograd(_kl_bwd, setup_context=_kl_setup)


# -------------------------------------------------------------------- JSD


@torch.library.custom_op("kvant::jsd", mutates_args=())
def _jsd(log_q: Tensor, log_p: Tensor, shift_labels: Optional[Tensor], beta: float, ignore_index: int) -> Tuple[Tensor, Tensor]:
    q, p = log_q.contiguous(), log_p.contiguous()
    dq = torch.empty_like(q)
    labels = shift_labels.contiguous().view(-1) if shift_labels is not None else None
    loss, _n = _k.jsd_fwd(q, p, labels, beta, ignore_index, dq)
    return torch.tensor(loss, dtype=torch.float32).to(log_q.dtype), dq


@_jsd.register_fake
def _(log_q, log_p, shift_labels, beta, ignore_index):
    return log_q.new_empty(()), torch.empty_like(log_q)


def _jsd_setup(ctx, inputs, output):
    _no_aux_grads(ctx)
    ctx.save_for_backward(output[1])


def _jsd_bwd(ctx, dloss, _dg):
    if dloss is None:
        return (None,) * 5
    (dq,) = ctx.saved_tensors
    return _scaled(dq, dloss), None, None, None, None


_jsd.register_autograd(_jsd_bwd, setup_context=_jsd_setup)


@torch.library.custom_op("kvant::linear_jsd", mutates_args=())
def _linear_jsd(
    student_input: Tensor,
    student_weight: Tensor,
    teacher_input: Tensor,
    teacher_weight: Tensor,
    shift_labels: Optional[Tensor],
    beta: float,
    ignore_index: int,
    temperature: float,
    want_grad: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    hs, ht = student_input.shape[-1], teacher_input.shape[-1]
    xs = student_input.contiguous().view(-1, hs)
    xt = teacher_input.contiguous().view(-1, ht)
    labels = shift_labels.contiguous().view(-1) if shift_labels is not None else None
    dx = torch.empty_like(xs) if want_grad else None
    dw = torch.empty(student_weight.shape, dtype=torch.float32) if want_grad else None
    loss, _n = _k.linear_jsd(
        (xs, student_weight.contiguous()),
        (xt, teacher_weight.contiguous()),
        labels,
        (beta, ignore_index, temperature),
        (dx, dw),
    )
    return (
        torch.tensor(loss, dtype=torch.float32).to(student_input.dtype),
        dx.view(student_input.shape) if dx is not None else student_input.new_empty(0),
        dw if dw is not None else student_input.new_empty(0, dtype=torch.float32),
    )


@_linear_jsd.register_fake
def _(student_input, student_weight, teacher_input, teacher_weight, shift_labels, beta, ignore_index, temperature, want_grad):
    dx = torch.empty_like(student_input) if want_grad else student_input.new_empty(0)
    dw = (
        student_weight.new_empty(student_weight.shape, dtype=torch.float32)
        if want_grad
        else student_input.new_empty(0, dtype=torch.float32)
    )
    return student_input.new_empty(()), dx, dw


def _ljsd_setup(ctx, inputs, output):
    _no_aux_grads(ctx)
    ctx.wdtype = inputs[1].dtype
    ctx.save_for_backward(output[1], output[2])


def _ljsd_bwd(ctx, dloss, _a, _b):
    if dloss is None:
        return (None,) * 9
    dx, dw = ctx.saved_tensors
    return _scaled(dx, dloss), _scaled(dw, dloss).to(ctx.wdtype), None, None, None, None, None, None, None


_linear_jsd.register_autograd(_ljsd_bwd, setup_context=_ljsd_setup)


# ---------------------------------------------------------- FlashAttention


@torch.library.custom_op("kvant::flash_attn", mutates_args=())
def _flash_attn(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, window: Optional[int]
) -> Tuple[Tensor, Tensor]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = torch.empty(q.shape[:-1], dtype=torch.float32)
    _k.flash_attn_fwd((q, k, v), out, lse, (scale, causal, window))
    return out, lse


@_flash_attn.register_fake
def _(q, k, v, scale, causal, window):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("kvant::flash_attn_backward", mutates_args=())
def _flash_attn_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
    window: Optional[int],
) -> Tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _k.flash_attn_bwd((q, k, v), (out, dout.contiguous(), lse), (dq, dk, dv), (scale, causal, window))
    return dq, dk, dv


@_flash_attn_backward.register_fake
def _(dout, q, k, v, out, lse, scale, causal, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_setup(ctx, inputs, output):
    q, k, v, scale, causal, window = inputs
    _no_aux_grads(ctx)
    ctx.save_for_backward(q.contiguous(), k.contiguous(), v.contiguous(), output[0], output[1])
    ctx.args = (scale, causal, window)


def _flash_bwd(ctx, dout, _dlse):
    if dout is None:
        return (None,) * 6
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.kvant.flash_attn_backward(dout, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None


_flash_attn.register_autograd(_flash_bwd, setup_context=_flash_setup)


# ================================================================ public API


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0, casting: str = "llama") -> Tensor:
    """RMSNorm over the last dimension: ``x / rms(x) * (offset + weight)``.

    ``casting='llama'`` rounds the normalised x to x's dtype before the
    weight multiplies it (Hugging Face Llama); ``'gemma'`` computes in
    float32 and rounds once (Gemma, with ``offset=1``)."""
    _float_check("x", x)
    _float_check("weight", weight)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)")
    return torch.ops.kvant.rms_norm(x, weight, float(eps), float(offset), casting)[0]


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0, casting: str = "llama"
) -> Tuple[Tensor, Tensor]:
    """``s = x + residual``; returns ``(rms_norm(s), s)`` in one pass."""
    for n, t in (("x", x), ("residual", residual), ("weight", weight)):
        _float_check(n, t)
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}, x {tuple(x.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)")
    y, s, _ = torch.ops.kvant.add_rms_norm(x, residual, weight, float(eps), float(offset), casting)
    return y, s


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension with weight and bias."""
    for n, t in (("x", x), ("weight", weight), ("bias", bias)):
        _float_check(n, t)
    if weight.shape != x.shape[-1:] or bias.shape != x.shape[-1:]:
        raise ValueError(f"weight and bias must have shape ({x.shape[-1]},)")
    return torch.ops.kvant.layer_norm(x, weight, bias, float(eps))[0]


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tuple[Tensor, Tensor]:
    """Rotary embedding of q [b, hq, s, d] and k [b, hk, s, d] with Hugging
    Face's cos/sin ([b or 1, s, rot], each frequency twice: halves for the
    half-split layout, pairs for ``interleaved``); the first ``rot``
    dimensions rotate (partial rotary), the rest pass through."""
    for n, t in (("q", q), ("k", k)):
        _float_check(n, t)
        if t.dim() != 4:
            raise ValueError(f"{n} must be [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    c, s = _rope_tables(cos, sin, q.dtype, interleaved)
    return torch.ops.kvant.rope(q, k, c, s, bool(interleaved), False)


def _glu_checked(a: Tensor, b: Tensor, kind: str) -> Tensor:
    _float_check("a", a)
    _float_check("b", b)
    if a.shape != b.shape:
        raise ValueError(f"gate and up differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    return torch.ops.kvant.glu(a, b, kind)


def swiglu(a: Tensor, b: Tensor) -> Tensor:
    """``silu(a) * b``; the backward overwrites a and b with their gradients."""
    return _glu_checked(a, b, "swiglu")


def geglu(a: Tensor, b: Tensor) -> Tensor:
    """``gelu_tanh(a) * b``; the backward overwrites a and b with their gradients."""
    return _glu_checked(a, b, "geglu")


def _ce_args(reduction: str, label_smoothing: float, softcap: Optional[float]) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")


def _target_check(target: Tensor, rows: int) -> None:
    if not isinstance(target, Tensor) or target.dtype != torch.int64:
        raise TypeError("target must be an int64 tensor")
    if target.numel() != rows:
        raise ValueError(f"target has {target.numel()} elements, expected {rows}")


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
) -> Tensor:
    """Cross-entropy over the last dimension of ``logits`` [..., V] (torch's
    semantics for ignore_index, label_smoothing and reduction), plus
    Liger's z-loss (``z_loss * lse**2`` per row) and logit soft-capping.
    The gradient is computed in the forward pass (online softmax)."""
    _float_check("logits", logits)
    _ce_args(reduction, label_smoothing, softcap)
    _target_check(target, _rows(logits))
    want = logits.requires_grad and torch.is_grad_enabled()
    t = target.reshape(logits.shape[:-1])
    return torch.ops.kvant.cross_entropy(
        logits, t, int(ignore_index), float(label_smoothing), float(z_loss), softcap, reduction, want
    )[0]


def linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    loss_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """``cross_entropy(x @ weight.T + bias, target)`` without materialising
    the logits: rows are processed in chunks and both gradients are
    computed in the forward pass (the weight gradient in float32).

    The loss comes back in ``loss_dtype``: x's dtype by default, as
    ``F.cross_entropy`` of x-typed logits; ``torch.float32`` gives the
    kernel's float32 sum unrounded, as Hugging Face's loss (computed from
    logits upcast to float32) is."""
    _float_check("x", x)
    _float_check("weight", weight)
    if bias is not None:
        _float_check("bias", bias)
    _ce_args(reduction, label_smoothing, softcap)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be [vocab, {x.shape[-1]}], got {tuple(weight.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    _target_check(target, _rows(x))
    want = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if loss_dtype is not None and not loss_dtype.is_floating_point:
        raise ValueError(f"loss_dtype must be a floating-point dtype, got {loss_dtype}")
    t = target.reshape(x.shape[:-1])
    loss = torch.ops.kvant.linear_cross_entropy(
        x, weight, t, bias, int(ignore_index), float(label_smoothing), float(z_loss), softcap, reduction, want
    )[0]
    return loss.to(loss_dtype or x.dtype)


def kl_div(input: Tensor, target: Tensor, reduction: str = "batchmean", log_target: bool = False) -> Tensor:
    """``torch.nn.functional.kl_div`` (input is log-probabilities)."""
    _float_check("input", input)
    _float_check("target", target)
    if reduction not in _KL_REDUCTIONS:
        raise ValueError(f"reduction must be one of {_KL_REDUCTIONS}, got {reduction!r}")
    if input.shape != target.shape:
        raise ValueError(f"input {tuple(input.shape)} and target {tuple(target.shape)} differ")
    return torch.ops.kvant.kl_div(input, target, reduction, bool(log_target))


def jsd(
    log_q: Tensor, log_p: Tensor, shift_labels: Optional[Tensor] = None, beta: float = 0.5, ignore_index: int = -100
) -> Tensor:
    """Liger's generalised Jensen-Shannon divergence between the student's
    log-probabilities ``log_q`` and the teacher's ``log_p`` ([N, V]),
    averaged over the rows whose label is not ignore_index."""
    _float_check("input", log_q)
    _float_check("target", log_p)
    if log_q.shape != log_p.shape or log_q.dim() != 2:
        raise ValueError("input and target must be [N, V] of one shape")
    if shift_labels is not None:
        _target_check(shift_labels, log_q.shape[0])
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return torch.ops.kvant.jsd(log_q, log_p, shift_labels, float(beta), int(ignore_index))[0]


def linear_jsd(
    student_input: Tensor,
    student_weight: Tensor,
    teacher_input: Tensor,
    teacher_weight: Tensor,
    shift_labels: Optional[Tensor] = None,
    beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
) -> Tensor:
    """JSD between the student's and the teacher's heads (``x @ W.T /
    temperature``, log-softmax) without materialising either logits."""
    for n, t in (
        ("student_input", student_input),
        ("student_weight", student_weight),
        ("teacher_input", teacher_input),
        ("teacher_weight", teacher_weight),
    ):
        _float_check(n, t)
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError("student and teacher heads must have one vocabulary")
    if shift_labels is not None:
        _target_check(shift_labels, _rows(student_input))
    if not temperature > 0:
        raise ValueError("temperature must be positive")
    want = torch.is_grad_enabled() and (student_input.requires_grad or student_weight.requires_grad)
    return torch.ops.kvant.linear_jsd(
        student_input,
        student_weight,
        teacher_input,
        teacher_weight,
        shift_labels,
        float(beta),
        int(ignore_index),
        float(temperature),
        want,
    )[0]


def flash_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    scale: Optional[float] = None,
    window: Optional[int] = None,
) -> Tensor:
    """Softmax attention of q [b, hq, sq, d] over k, v [b, hk, sk, d] (hq a
    multiple of hk: grouped-query), causal (bottom-right aligned) and
    optionally a sliding window of ``window`` keys; saves only the
    log-sum-exp and recomputes in the backward."""
    for n, t in (("q", q), ("k", k), ("v", v)):
        _float_check(n, t)
        if t.dim() != 4:
            raise ValueError(f"{n} must be [batch, heads, seq, dim], got {tuple(t.shape)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key heads ({k.shape[1]})")
    if window is not None and window < 1:
        raise ValueError("window must be at least 1")
    s = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.kvant.flash_attn(q, k, v, s, bool(causal), window)[0]
