//! The training kernels as Python functions over torch tensors.
//!
//! Each function takes its inputs and the outputs torch allocated (torch
//! owns and accounts for all memory), checks them (`crate::tensor`), and
//! runs the kernel with the GIL released on kvant's pool. Shapes are
//! checked by the kernels themselves (a mismatch is a `ValueError` naming
//! the argument); `python/kvant/ops.py` wraps these as torch custom ops
//! with autograd.

use crate::tensor::{detach_float, same_float, with_float, Dt, Tensors, View};
use kvant_kernels::{cpu, pool, KernelError};
use kvant_train::{cross_entropy, distill, flash, glu, linear_ce, norm, rope, Reduction};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

type Any<'py> = Bound<'py, PyAny>;

fn f32s(views: &[&View]) -> PyResult<()> {
    views.iter().try_for_each(|v| v.expect(Dt::F32).map(drop))
}

fn casting(s: &str) -> PyResult<norm::RmsCasting> {
    match s {
        "llama" => Ok(norm::RmsCasting::Llama),
        "gemma" => Ok(norm::RmsCasting::Gemma),
        _ => Err(PyValueError::new_err(format!(
            "casting must be 'llama' or 'gemma', got {s:?}"
        ))),
    }
}

fn rms_args(cols: usize, eps: f32, offset: f32, cast: &str) -> PyResult<norm::RmsNormArgs> {
    Ok(norm::RmsNormArgs {
        cols,
        eps,
        offset,
        casting: casting(cast)?,
    })
}

fn reduction(s: &str) -> PyResult<Reduction> {
    match s {
        "none" => Ok(Reduction::None),
        "sum" => Ok(Reduction::Sum),
        "mean" => Ok(Reduction::Mean),
        _ => Err(PyValueError::new_err(format!(
            "reduction must be 'none', 'sum' or 'mean', got {s:?}"
        ))),
    }
}

fn kl_reduction(s: &str) -> PyResult<distill::KlReduction> {
    match s {
        "none" => Ok(distill::KlReduction::None),
        "sum" => Ok(distill::KlReduction::Sum),
        "mean" => Ok(distill::KlReduction::Mean),
        "batchmean" => Ok(distill::KlReduction::BatchMean),
        _ => Err(PyValueError::new_err(format!(
            "reduction must be 'none', 'sum', 'mean' or 'batchmean', got {s:?}"
        ))),
    }
}

fn glu_kind(s: &str) -> PyResult<glu::Glu> {
    match s {
        "swiglu" => Ok(glu::Glu::Swi),
        "geglu" => Ok(glu::Glu::GeTanh),
        _ => Err(PyValueError::new_err(format!(
            "kind must be 'swiglu' or 'geglu', got {s:?}"
        ))),
    }
}

#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_fwd(
    py: Python<'_>,
    x: &Any<'_>,
    w: &Any<'_>,
    y: &Any<'_>,
    rstd: &Any<'_>,
    eps: f32,
    offset: f32,
    casting: &str,
) -> PyResult<()> {
    let mut t = Tensors::new();
    let (x, w) = (t.input(x, "x")?, t.input(w, "weight")?);
    let (y, rstd) = (t.out(y, "y")?, t.out(rstd, "rstd")?);
    let f = t.checked_float(&[&x, &w, &y], &[&rstd])?;
    let a = rms_args(x.last(), eps, offset, casting)?;
    detach_float!(py, t, f, E => {
        // SAFETY: the views were checked (dtype E, CPU, dense, no
        // written view overlapping another) and the tensors are held
        // by the caller for this call.
        unsafe { norm::rms_norm_fwd::<E>(cpu::tier(), a, norm::RmsFwd::new(x.slice(), w.slice(), y.slice_mut(), rstd.slice_mut())) }
    })
}

#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_bwd(
    py: Python<'_>,
    dy: &Any<'_>,
    x: &Any<'_>,
    w: &Any<'_>,
    rstd: &Any<'_>,
    dx: &Any<'_>,
    dw: &Any<'_>,
    eps: f32,
    offset: f32,
    casting: &str,
) -> PyResult<()> {
    let mut t = Tensors::new();
    let (dy, x, w, rstd) = (
        t.input(dy, "grad_output")?,
        t.input(x, "x")?,
        t.input(w, "weight")?,
        t.input(rstd, "rstd")?,
    );
    let (dx, dw) = (t.out(dx, "grad_x")?, t.out(dw, "grad_weight")?);
    let f = t.checked_float(&[&x, &dy, &w, &dx], &[&rstd, &dw])?;
    let a = rms_args(x.last(), eps, offset, casting)?;
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe {
            norm::rms_norm_bwd::<E>(cpu::tier(), a, norm::RmsBwd::new(dy.slice(), x.slice(), w.slice(), rstd.slice(), dx.slice_mut(), dw.slice_mut()))
        }
    })
}

#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_fwd(
    py: Python<'_>,
    x: &Any<'_>,
    residual: &Any<'_>,
    w: &Any<'_>,
    y: &Any<'_>,
    sum: &Any<'_>,
    rstd: &Any<'_>,
    eps: f32,
    offset: f32,
    casting: &str,
) -> PyResult<()> {
    let mut t = Tensors::new();
    let (x, r, w) = (
        t.input(x, "x")?,
        t.input(residual, "residual")?,
        t.input(w, "weight")?,
    );
    let (y, s, rstd) = (t.out(y, "y")?, t.out(sum, "sum")?, t.out(rstd, "rstd")?);
    let f = t.checked_float(&[&x, &r, &w, &y, &s], &[&rstd])?;
    let a = rms_args(x.last(), eps, offset, casting)?;
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe {
            let t = norm::RmsFwd { residual: Some(r.slice()), sum: Some(s.slice_mut()), ..norm::RmsFwd::new(x.slice(), w.slice(), y.slice_mut(), rstd.slice_mut()) };
            norm::rms_norm_fwd::<E>(cpu::tier(), a, t)
        }
    })
}

#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_bwd(
    py: Python<'_>,
    dy: &Any<'_>,
    dsum: &Any<'_>,
    sum: &Any<'_>,
    w: &Any<'_>,
    rstd: &Any<'_>,
    ds: &Any<'_>,
    dw: &Any<'_>,
    eps: f32,
    offset: f32,
    casting: &str,
) -> PyResult<()> {
    let mut t = Tensors::new();
    let (dy, dsum, s, w, rstd) = (
        t.input(dy, "grad_output")?,
        t.input(dsum, "grad_sum")?,
        t.input(sum, "sum")?,
        t.input(w, "weight")?,
        t.input(rstd, "rstd")?,
    );
    let (ds, dw) = (t.out(ds, "grad_x")?, t.out(dw, "grad_weight")?);
    let f = t.checked_float(&[&s, &dy, &dsum, &w, &ds], &[&rstd, &dw])?;
    let a = rms_args(s.last(), eps, offset, casting)?;
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe {
            let t = norm::RmsBwd { dsum: Some(dsum.slice()), ..norm::RmsBwd::new(dy.slice(), s.slice(), w.slice(), rstd.slice(), ds.slice_mut(), dw.slice_mut()) };
            norm::rms_norm_bwd::<E>(cpu::tier(), a, t)
        }
    })
}

#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_fwd(
    py: Python<'_>,
    x: &Any<'_>,
    w: &Any<'_>,
    b: &Any<'_>,
    y: &Any<'_>,
    mean: &Any<'_>,
    rstd: &Any<'_>,
    eps: f32,
) -> PyResult<()> {
    let mut t = Tensors::new();
    let (x, w, b) = (t.input(x, "x")?, t.input(w, "weight")?, t.input(b, "bias")?);
    let (y, mean, rstd) = (t.out(y, "y")?, t.out(mean, "mean")?, t.out(rstd, "rstd")?);
    let f = t.checked_float(&[&x, &w, &b, &y], &[&mean, &rstd])?;
    let cols = x.last();
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe {
            let t = norm::LnFwd { x: x.slice(), w: w.slice(), b: b.slice(), y: y.slice_mut(), mean: mean.slice_mut(), rstd: rstd.slice_mut() };
            norm::layer_norm_fwd::<E>(cpu::tier(), cols, eps, t)
        }
    })
}

#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_bwd(
    py: Python<'_>,
    dy: &Any<'_>,
    x: &Any<'_>,
    w: &Any<'_>,
    mean: &Any<'_>,
    rstd: &Any<'_>,
    dx: &Any<'_>,
    dw: &Any<'_>,
    db: &Any<'_>,
) -> PyResult<()> {
    let mut t = Tensors::new();
    let (dy, x, w, mean, rstd) = (
        t.input(dy, "grad_output")?,
        t.input(x, "x")?,
        t.input(w, "weight")?,
        t.input(mean, "mean")?,
        t.input(rstd, "rstd")?,
    );
    let (dx, dw, db) = (
        t.out(dx, "grad_x")?,
        t.out(dw, "grad_weight")?,
        t.out(db, "grad_bias")?,
    );
    let f = t.checked_float(&[&x, &dy, &w, &dx], &[&mean, &rstd, &dw, &db])?;
    let cols = x.last();
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe {
            let t = norm::LnBwd {
                dy: dy.slice(), x: x.slice(), w: w.slice(), mean: mean.slice(), rstd: rstd.slice(),
                dx: dx.slice_mut(), dw: dw.slice_mut(), db: db.slice_mut(),
            };
            norm::layer_norm_bwd::<E>(cpu::tier(), cols, t)
        }
    })
}

/// Rotates a 4-D `x` [batch, heads, seq, head_dim] (any strides, the last
/// dimension contiguous) by the [cb, seq, rot_dim/2] tables: in place, or
/// into `out` (same shape and strides; `x` only read).
#[pyfunction]
#[pyo3(signature = (x, out, cos, sin, rot_dim, interleaved, inverse))]
#[allow(clippy::too_many_arguments)]
pub fn rope_apply(
    py: Python<'_>,
    x: &Any<'_>,
    out: Option<&Any<'_>>,
    cos: &Any<'_>,
    sin: &Any<'_>,
    rot_dim: usize,
    interleaved: bool,
    inverse: bool,
) -> PyResult<()> {
    let mut t = Tensors::new();
    let x = match out {
        Some(_) => t.strided_input(x, "x")?,
        None => t.strided_out(x, "x")?,
    };
    let out = out.map(|o| t.strided_out(o, "out")).transpose()?;
    let (cos, sin) = (t.input(cos, "cos")?, t.input(sin, "sin")?);
    let f = t.checked_float(&[&x, &cos, &sin], &[])?;
    if let Some(o) = &out {
        same_float(&[&x, o])?;
        if o.shape != x.shape || o.strides != x.strides {
            return Err(PyValueError::new_err(format!(
                "out must have x's shape {:?} and strides {:?}, got {:?} and {:?}",
                x.shape, x.strides, o.shape, o.strides
            )));
        }
    }
    let (&[batch, heads, seq, head_dim], &[sb, sh, ss, _]) = (&x.shape[..], &x.strides[..]) else {
        return Err(PyValueError::new_err(format!(
            "x must be 4-D [batch, heads, seq, head_dim], got shape {:?}",
            x.shape
        )));
    };
    let per_batch_tables = cos.shape.first().is_some_and(|&b| b == batch && batch > 1);
    let s = rope::RopeShape {
        batch,
        heads,
        seq,
        head_dim,
        rot_dim,
        strides: [sb, sh, ss],
        per_batch_tables,
        layout: match interleaved {
            true => rope::RopeLayout::Interleaved,
            false => rope::RopeLayout::HalfSplit,
        },
    };
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`; `x`'s (and `out`'s, the same
        // strides) span covers every strided element and the kernel
        // checks its rows do not overlap.
        unsafe {
            let t = match &out {
                Some(o) => rope::RopeIo { x: o.slice_mut(), src: Some(x.slice()), cos: cos.slice(), sin: sin.slice() },
                None => rope::RopeIo { x: x.slice_mut(), src: None, cos: cos.slice(), sin: sin.slice() },
            };
            rope::rope_apply::<E>(cpu::tier(), t, &s, inverse)
        }
    })
}

#[pyfunction]
pub fn glu_fwd(py: Python<'_>, kind: &str, a: &Any<'_>, b: &Any<'_>, c: &Any<'_>) -> PyResult<()> {
    let kind = glu_kind(kind)?;
    let mut t = Tensors::new();
    let (a, b, c) = (t.input(a, "a")?, t.input(b, "b")?, t.out(c, "c")?);
    let f = t.checked_float(&[&a, &b, &c], &[])?;
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe { glu::glu_fwd::<E>(cpu::tier(), kind, glu::GluFwd::new(a.slice(), b.slice(), c.slice_mut())) }
    })
}

/// Overwrites `a` with its gradient and `b` with its.
#[pyfunction]
pub fn glu_bwd(py: Python<'_>, kind: &str, dc: &Any<'_>, a: &Any<'_>, b: &Any<'_>) -> PyResult<()> {
    let kind = glu_kind(kind)?;
    let mut t = Tensors::new();
    let (dc, a, b) = (t.input(dc, "grad_output")?, t.out(a, "a")?, t.out(b, "b")?);
    let f = t.checked_float(&[&a, &b, &dc], &[])?;
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe { glu::glu_bwd::<E>(cpu::tier(), kind, glu::GluBwd::new(dc.slice(), a.slice_mut(), b.slice_mut())) }
    })
}

/// Options of the cross-entropy family.
fn ce_options(
    ignore_index: i64,
    label_smoothing: f32,
    z_loss: f32,
    softcap: Option<f32>,
    red: &str,
) -> PyResult<cross_entropy::CeOptions> {
    if !(0.0..=1.0).contains(&label_smoothing) {
        return Err(PyValueError::new_err(format!(
            "label_smoothing must be in [0, 1], got {label_smoothing}"
        )));
    }
    if softcap.is_some_and(|c| !(c > 0.0 && c.is_finite())) {
        return Err(PyValueError::new_err("softcap must be a positive number"));
    }
    if !z_loss.is_finite() || z_loss < 0.0 {
        return Err(PyValueError::new_err("z_loss must be >= 0"));
    }
    Ok(cross_entropy::CeOptions {
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
        reduction: reduction(red)?,
    })
}

/// Returns (loss, z_loss, counted); with `grad` given, the gradient of the
/// reduced loss is written there (the logits are only read).
#[pyfunction]
#[pyo3(signature = (logits, targets, losses, grad, ignore_index, label_smoothing, z_loss, softcap, reduction))]
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_fwd(
    py: Python<'_>,
    logits: &Any<'_>,
    targets: &Any<'_>,
    losses: &Any<'_>,
    grad: Option<&Any<'_>>,
    ignore_index: i64,
    label_smoothing: f32,
    z_loss: f32,
    softcap: Option<f32>,
    reduction: &str,
) -> PyResult<(f32, f32, usize)> {
    let o = ce_options(ignore_index, label_smoothing, z_loss, softcap, reduction)?;
    let mut t = Tensors::new();
    let logits = t.input(logits, "logits")?;
    let targets = t.input(targets, "target")?;
    let losses = t.out(losses, "losses")?;
    let grad = t.out_opt(grad, "grad")?;
    t.checked()?;
    let mut floats = vec![&logits];
    floats.extend(grad.as_ref());
    let f = same_float(&floats)?;
    targets.expect(Dt::I64)?;
    f32s(&[&losses])?;
    let vocab = logits.last();
    let r = py
        .detach(|| {
            with_float!(f, E => {
                // SAFETY: as in `rms_norm_fwd`.
                unsafe {
                    let a = cross_entropy::CeArgs { targets: targets.slice(), vocab, options: o };
                    cross_entropy::cross_entropy_fwd_into::<E>(
                        pool::global(),
                        cpu::tier(),
                        &a,
                        logits.slice(),
                        losses.slice_mut(),
                        grad.as_ref().map(|g| g.slice_mut()),
                    )
                }
            })
        })
        .map_err(|e| t.error(e))?;
    Ok((r.loss, r.z_loss, r.counted))
}

/// Fused linear cross-entropy. Returns (loss, z_loss, counted); gradients
/// are written when `grad_x` and `grad_weight` are given.
#[pyfunction]
#[pyo3(signature = (x, weight, bias, targets, losses, grad_x, grad_weight, grad_bias, row_scale, ignore_index, label_smoothing, z_loss, softcap, reduction))]
#[allow(clippy::too_many_arguments)]
pub fn linear_cross_entropy(
    py: Python<'_>,
    x: &Any<'_>,
    weight: &Any<'_>,
    bias: Option<&Any<'_>>,
    targets: &Any<'_>,
    losses: &Any<'_>,
    grad_x: Option<&Any<'_>>,
    grad_weight: Option<&Any<'_>>,
    grad_bias: Option<&Any<'_>>,
    row_scale: Option<&Any<'_>>,
    ignore_index: i64,
    label_smoothing: f32,
    z_loss: f32,
    softcap: Option<f32>,
    reduction: &str,
) -> PyResult<(f32, f32, usize)> {
    let o = ce_options(ignore_index, label_smoothing, z_loss, softcap, reduction)?;
    let mut t = Tensors::new();
    let (x, w) = (t.input(x, "x")?, t.input(weight, "weight")?);
    let bias = t.input_opt(bias, "bias")?;
    let targets = t.input(targets, "target")?;
    let row_scale = t.input_opt(row_scale, "row_scale")?;
    let losses = t.out(losses, "losses")?;
    let dx = t.out_opt(grad_x, "grad_x")?;
    let dw = t.out_opt(grad_weight, "grad_weight")?;
    let db = t.out_opt(grad_bias, "grad_bias")?;
    t.checked()?;
    let mut floats = vec![&x, &w];
    floats.extend(bias.as_ref());
    floats.extend(dx.as_ref());
    let f = same_float(&floats)?;
    targets.expect(Dt::I64)?;
    f32s(&[&losses])?;
    for v in [&dw, &db, &row_scale].into_iter().flatten() {
        v.expect(Dt::F32)?;
    }
    let (hidden, vocab) = (x.last(), w.shape.first().copied().unwrap_or(0));
    let r = py
        .detach(|| {
            with_float!(f, E => {
                // SAFETY: as in `rms_norm_fwd`.
                unsafe {
                    let grads = match (&dx, &dw) {
                        (Some(dx), Some(dw)) => Some(linear_ce::LinearCeGrads::<E> {
                            dx: dx.slice_mut(),
                            dw: dw.slice_mut(),
                            dbias: db.as_ref().map(|d| d.slice_mut()),
                        }),
                        (None, None) => None,
                        _ => return Err(KernelError::InvalidShape {
                            op: "linear_cross_entropy",
                            why: "grad_x and grad_weight come together".into(),
                        }),
                    };
                    let a = linear_ce::LinearCeArgs::<E> {
                        x: x.slice(), w: w.slice(), bias: bias.as_ref().map(|b| b.slice()), hidden,
                        ce: cross_entropy::CeArgs { targets: targets.slice(), vocab, options: o },
                        row_scale: row_scale.as_ref().map(|r| r.slice()), chunk: None,
                    };
                    linear_ce::linear_cross_entropy::<E>(&a, losses.slice_mut(), grads)
                }
            })
        })
        .map_err(|e| t.error(e))?;
    Ok((r.loss, r.z_loss, r.counted))
}

/// Generalised JSD over log-probabilities; the student gradient goes to
/// `grad_log_q`. Returns (loss, counted).
#[pyfunction]
#[pyo3(signature = (log_q, log_p, labels, beta, ignore_index, grad_log_q))]
pub fn jsd_fwd(
    py: Python<'_>,
    log_q: &Any<'_>,
    log_p: &Any<'_>,
    labels: Option<&Any<'_>>,
    beta: f32,
    ignore_index: i64,
    grad_log_q: &Any<'_>,
) -> PyResult<(f32, usize)> {
    check_beta(beta)?;
    let mut t = Tensors::new();
    let (q, p) = (t.input(log_q, "input")?, t.input(log_p, "target")?);
    let labels = t.input_opt(labels, "shift_labels")?;
    let dq = t.out(grad_log_q, "grad_input")?;
    let f = t.checked_float(&[&q, &p, &dq], &[])?;
    if let Some(l) = &labels {
        l.expect(Dt::I64)?;
    }
    let vocab = q.last();
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe {
            let a = distill::JsdArgs { labels: labels.as_ref().map(|l| l.slice()), vocab, beta, ignore_index };
            distill::jsd_fwd::<E>(pool::global(), cpu::tier(), &a, q.slice(), p.slice(), dq.slice_mut())
        }
    })
}

fn check_beta(beta: f32) -> PyResult<()> {
    match (0.0..=1.0).contains(&beta) {
        true => Ok(()),
        false => Err(PyValueError::new_err(format!(
            "beta must be in [0, 1], got {beta}"
        ))),
    }
}

/// torch's `kl_div(input, target)`; for reduction 'none' the elementwise
/// losses go to `elementwise`. Returns the reduced loss.
#[pyfunction]
pub fn kl_div_fwd(
    py: Python<'_>,
    input: &Any<'_>,
    target: &Any<'_>,
    log_target: bool,
    reduction: &str,
    elementwise: &Any<'_>,
) -> PyResult<f32> {
    let red = kl_reduction(reduction)?;
    let mut t = Tensors::new();
    let (i, tg) = (t.input(input, "input")?, t.input(target, "target")?);
    let e = t.out(elementwise, "elementwise")?;
    let f = t.checked_float(&[&i, &tg, &e], &[])?;
    let vocab = i.last();
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe {
            let a = distill::KlArgs { vocab, log_target, reduction: red };
            distill::kl_div_fwd::<E>(pool::global(), cpu::tier(), &a, i.slice(), tg.slice(), e.slice_mut())
        }
    })
}

#[pyfunction]
#[pyo3(signature = (target, log_target, reduction, grad_out, grad_elementwise, grad_input))]
pub fn kl_div_bwd(
    py: Python<'_>,
    target: &Any<'_>,
    log_target: bool,
    reduction: &str,
    grad_out: f32,
    grad_elementwise: Option<&Any<'_>>,
    grad_input: &Any<'_>,
) -> PyResult<()> {
    let red = kl_reduction(reduction)?;
    let mut t = Tensors::new();
    let tg = t.input(target, "target")?;
    let ge = t.input_opt(grad_elementwise, "grad_output")?;
    let di = t.out(grad_input, "grad_input")?;
    let mut floats = vec![&tg, &di];
    floats.extend(ge.as_ref());
    let f = t.checked_float(&floats, &[])?;
    let vocab = tg.last();
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe {
            let a = distill::KlArgs { vocab, log_target, reduction: red };
            distill::kl_div_bwd::<E>(&a, tg.slice(), grad_out, ge.as_ref().map(|g| g.slice()), di.slice_mut())
        }
    })
}

/// Fused linear JSD (distillation). Returns (loss, counted); student
/// gradients are written when given.
#[pyfunction]
#[pyo3(signature = (x_s, w_s, x_t, w_t, labels, beta, ignore_index, temperature, grad_x, grad_weight))]
#[allow(clippy::too_many_arguments)]
pub fn linear_jsd(
    py: Python<'_>,
    x_s: &Any<'_>,
    w_s: &Any<'_>,
    x_t: &Any<'_>,
    w_t: &Any<'_>,
    labels: Option<&Any<'_>>,
    beta: f32,
    ignore_index: i64,
    temperature: f32,
    grad_x: Option<&Any<'_>>,
    grad_weight: Option<&Any<'_>>,
) -> PyResult<(f32, usize)> {
    check_beta(beta)?;
    if !(temperature > 0.0 && temperature.is_finite()) {
        return Err(PyValueError::new_err(
            "temperature must be a positive number",
        ));
    }
    let mut t = Tensors::new();
    let (xs, ws) = (
        t.input(x_s, "student_input")?,
        t.input(w_s, "student_weight")?,
    );
    let (xt, wt) = (
        t.input(x_t, "teacher_input")?,
        t.input(w_t, "teacher_weight")?,
    );
    let labels = t.input_opt(labels, "shift_labels")?;
    let dx = t.out_opt(grad_x, "grad_input")?;
    let dw = t.out_opt(grad_weight, "grad_weight")?;
    let mut floats = vec![&xs, &ws, &xt, &wt];
    floats.extend(dx.as_ref());
    let f = t.checked_float(&floats, &[])?;
    if let Some(d) = &dw {
        d.expect(Dt::F32)?;
    }
    if let Some(l) = &labels {
        l.expect(Dt::I64)?;
    }
    let (hs, ht, vocab) = (xs.last(), xt.last(), ws.shape.first().copied().unwrap_or(0));
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe {
            let jsd = distill::JsdArgs { labels: labels.as_ref().map(|l| l.slice()), vocab, beta, ignore_index };
            let a = linear_ce::LinearJsdArgs::<E> {
                x_s: xs.slice(), w_s: ws.slice(), x_t: xt.slice(), w_t: wt.slice(),
                hs, ht, jsd, temperature, chunk: None,
            };
            linear_ce::linear_jsd::<E>(&a, dx.as_ref().map(|d| d.slice_mut()), dw.as_ref().map(|d| d.slice_mut()))
        }
    })
}

fn flash_shape(
    q: &View,
    k: &View,
    v: &View,
    scale: f32,
    causal: bool,
    window: Option<usize>,
) -> PyResult<flash::FlashShape> {
    let bad = || {
        PyValueError::new_err(format!(
            "q, k, v must be [batch, heads, seq, dim] with one batch and k, v of one length; got {:?}, {:?}, {:?}",
            q.shape, k.shape, v.shape
        ))
    };
    let (&[b, hq, sq, d], &[bk, hk, sk, dk], &[bv, hv, sv, dv]) =
        (&q.shape[..], &k.shape[..], &v.shape[..])
    else {
        return Err(bad());
    };
    if b != bk || b != bv || hk != hv || sk != sv || d != dk {
        return Err(bad());
    }
    if !scale.is_finite() {
        return Err(PyValueError::new_err("scale must be finite"));
    }
    Ok(flash::FlashShape {
        batch: b,
        q_heads: hq,
        kv_heads: hk,
        q_len: sq,
        kv_len: sk,
        head_dim: d,
        v_dim: dv,
        scale,
        causal,
        window,
    })
}

#[pyfunction]
#[pyo3(signature = (q, k, v, out, lse, scale, causal, window))]
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_fwd(
    py: Python<'_>,
    q: &Any<'_>,
    k: &Any<'_>,
    v: &Any<'_>,
    out: &Any<'_>,
    lse: &Any<'_>,
    scale: f32,
    causal: bool,
    window: Option<usize>,
) -> PyResult<()> {
    let mut t = Tensors::new();
    let (q, k, v) = (
        t.input(q, "query")?,
        t.input(k, "key")?,
        t.input(v, "value")?,
    );
    let (o, lse) = (t.out(out, "out")?, t.out(lse, "lse")?);
    let f = t.checked_float(&[&q, &k, &v, &o], &[&lse])?;
    let s = flash_shape(&q, &k, &v, scale, causal, window)?;
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe {
            flash::flash_attn_fwd::<E>(kvant_kernels::cpu::tier(), flash::FlashFwd {
                shape: s, q: q.slice(), k: k.slice(), v: v.slice(), out: o.slice_mut(), lse: lse.slice_mut(),
            })
        }
    })
}

#[pyfunction]
#[pyo3(signature = (q, k, v, out, dout, lse, dq, dk, dv, scale, causal, window))]
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_bwd(
    py: Python<'_>,
    q: &Any<'_>,
    k: &Any<'_>,
    v: &Any<'_>,
    out: &Any<'_>,
    dout: &Any<'_>,
    lse: &Any<'_>,
    dq: &Any<'_>,
    dk: &Any<'_>,
    dv: &Any<'_>,
    scale: f32,
    causal: bool,
    window: Option<usize>,
) -> PyResult<()> {
    let mut t = Tensors::new();
    let (q, k, v) = (
        t.input(q, "query")?,
        t.input(k, "key")?,
        t.input(v, "value")?,
    );
    let (o, d_o, lse) = (
        t.input(out, "out")?,
        t.input(dout, "grad_out")?,
        t.input(lse, "lse")?,
    );
    let (dq, dk, dv) = (
        t.out(dq, "grad_query")?,
        t.out(dk, "grad_key")?,
        t.out(dv, "grad_value")?,
    );
    let f = t.checked_float(&[&q, &k, &v, &o, &d_o, &dq, &dk, &dv], &[&lse])?;
    let s = flash_shape(&q, &k, &v, scale, causal, window)?;
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe {
            flash::flash_attn_bwd::<E>(kvant_kernels::cpu::tier(), flash::FlashBwd {
                shape: s, q: q.slice(), k: k.slice(), v: v.slice(), out: o.slice(), dout: d_o.slice(),
                lse: lse.slice(), dq: dq.slice_mut(), dk: dk.slice_mut(), dv: dv.slice_mut(),
            })
        }
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rms_norm_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(add_rms_norm_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(add_rms_norm_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(layer_norm_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(layer_norm_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(rope_apply, m)?)?;
    m.add_function(wrap_pyfunction!(glu_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(glu_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(cross_entropy_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(linear_cross_entropy, m)?)?;
    m.add_function(wrap_pyfunction!(jsd_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(kl_div_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(kl_div_bwd, m)?)?;
    m.add_function(wrap_pyfunction!(linear_jsd, m)?)?;
    m.add_function(wrap_pyfunction!(flash_attn_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(flash_attn_bwd, m)?)?;
    Ok(())
}
