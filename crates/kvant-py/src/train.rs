//! The training kernels as Python functions over torch tensors.
//!
//! Each function takes its inputs and the outputs torch allocated (torch
//! owns and accounts for all memory), checks them (`crate::tensor`), and
//! runs the kernel with the GIL released on kvant's pool. Shapes are
//! checked by the kernels themselves (a mismatch is a `ValueError` naming
//! the argument); `python/kvant/ops.py` wraps these as torch custom ops
//! with autograd.

use crate::tensor::{detach_float, same_float, with_float, Tensors, View};
use kvant_kernels::{cpu, pool, KernelError};
use kvant_train::{cross_entropy, distill, flash, glu, linear_ce, norm, rope, Reduction};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

type Any<'py> = Bound<'py, PyAny>;

/// The value `s` names among `choices`, or a `ValueError` listing them
/// ("`what` must be 'a', 'b' or 'c', got ...").
fn choice<T: Copy>(what: &str, s: &str, choices: &[(&str, T)]) -> PyResult<T> {
    if let Some(&(_, v)) = choices.iter().find(|(name, _)| *name == s) {
        return Ok(v);
    }
    let names: Vec<String> = choices.iter().map(|(n, _)| format!("'{n}'")).collect();
    let listed = match names.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    };
    Err(PyValueError::new_err(format!(
        "{what} must be {listed}, got {s:?}"
    )))
}

fn rms_args(cols: usize, eps: f32, offset: f32, cast: &str) -> PyResult<norm::RmsNormArgs> {
    let castings = [
        ("llama", norm::RmsCasting::Llama),
        ("gemma", norm::RmsCasting::Gemma),
    ];
    Ok(norm::RmsNormArgs {
        cols,
        eps,
        offset,
        casting: choice("casting", cast, &castings)?,
    })
}

fn reduction(s: &str) -> PyResult<Reduction> {
    let reductions = [
        ("none", Reduction::None),
        ("sum", Reduction::Sum),
        ("mean", Reduction::Mean),
    ];
    choice("reduction", s, &reductions)
}

fn kl_reduction(s: &str) -> PyResult<distill::KlReduction> {
    use distill::KlReduction as K;
    let reductions = [
        ("none", K::None),
        ("sum", K::Sum),
        ("mean", K::Mean),
        ("batchmean", K::BatchMean),
    ];
    choice("reduction", s, &reductions)
}

fn glu_kind(s: &str) -> PyResult<glu::Glu> {
    choice(
        "kind",
        s,
        &[("swiglu", glu::Glu::Swi), ("geglu", glu::Glu::GeTanh)],
    )
}

/// RMSNorm forward; with `residual` and `sum` given, the fused residual
/// add first (`sum = x + residual`, normalised).
#[pyfunction]
#[pyo3(signature = (x, w, y, rstd, eps, offset, casting, residual = None, sum = None))]
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
    residual: Option<&Any<'_>>,
    sum: Option<&Any<'_>>,
) -> PyResult<()> {
    let mut t = Tensors::new();
    let (x, r, w) = (
        t.input(x, "x")?,
        t.input_opt(residual, "residual")?,
        t.input(w, "weight")?,
    );
    let (y, s, rstd) = (t.out(y, "y")?, t.out_opt(sum, "sum")?, t.out(rstd, "rstd")?);
    let floats: Vec<&View> = [Some(&x), r.as_ref(), Some(&w), Some(&y), s.as_ref()]
        .into_iter()
        .flatten()
        .collect();
    let f = t.checked_float(&floats, &[&rstd])?;
    let a = rms_args(x.last(), eps, offset, casting)?;
    detach_float!(py, t, f, E => {
        // SAFETY: the views were checked (dtype E, CPU, dense, no
        // written view overlapping another) and the tensors are held
        // by the caller for this call.
        unsafe {
            let t = norm::RmsFwd {
                residual: r.as_ref().map(|r| r.slice()),
                sum: s.as_ref().map(|s| s.slice_mut()),
                ..norm::RmsFwd::new(x.slice(), w.slice(), y.slice_mut(), rstd.slice_mut())
            };
            norm::rms_norm_fwd::<E>(cpu::tier(), a, t)
        }
    })
}

/// RMSNorm backward: `saved` is (grad_output, x, weight, rstd), `grads`
/// (grad_x, grad_weight), `options` (eps, offset, casting); with `dsum`
/// given, the fused residual add's (`x` is then the saved sum and
/// `grad_x` the gradient of both addends).
#[pyfunction]
#[pyo3(signature = (saved, grads, options, dsum = None))]
pub fn rms_norm_bwd<'py>(
    py: Python<'py>,
    saved: [Any<'py>; 4],
    grads: [Any<'py>; 2],
    options: (f32, f32, String),
    dsum: Option<&Any<'py>>,
) -> PyResult<()> {
    let (eps, offset, casting) = options;
    let [dy, x, w, rstd] = &saved;
    let mut t = Tensors::new();
    let (dy, dsum, x, w, rstd) = (
        t.input(dy, "grad_output")?,
        t.input_opt(dsum, "grad_sum")?,
        t.input(x, "x")?,
        t.input(w, "weight")?,
        t.input(rstd, "rstd")?,
    );
    let (dx, dw) = (
        t.out(&grads[0], "grad_x")?,
        t.out(&grads[1], "grad_weight")?,
    );
    let floats: Vec<&View> = [Some(&x), Some(&dy), dsum.as_ref(), Some(&w), Some(&dx)]
        .into_iter()
        .flatten()
        .collect();
    let f = t.checked_float(&floats, &[&rstd, &dw])?;
    let a = rms_args(x.last(), eps, offset, &casting)?;
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe {
            let t = norm::RmsBwd {
                dsum: dsum.as_ref().map(|d| d.slice()),
                ..norm::RmsBwd::new(dy.slice(), x.slice(), w.slice(), rstd.slice(), dx.slice_mut(), dw.slice_mut())
            };
            norm::rms_norm_bwd::<E>(cpu::tier(), a, t)
        }
    })
}

/// LayerNorm forward: `inputs` (x, weight, bias) in, `outputs` (y,
/// mean, rstd) out.
#[pyfunction]
pub fn layer_norm_fwd<'py>(
    py: Python<'py>,
    inputs: [Any<'py>; 3],
    outputs: [Any<'py>; 3],
    eps: f32,
) -> PyResult<()> {
    let ([x, w, b], [y, mean, rstd]) = (&inputs, &outputs);
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

/// LayerNorm backward: `saved` (grad_output, x, weight, mean, rstd) in,
/// `grads` (grad_x, grad_weight, grad_bias) out.
#[pyfunction]
pub fn layer_norm_bwd<'py>(
    py: Python<'py>,
    saved: [Any<'py>; 5],
    grads: [Any<'py>; 3],
) -> PyResult<()> {
    let ([dy, x, w, mean, rstd], [dx, dw, db]) = (&saved, &grads);
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

/// The cross-entropy family's options as the wrappers pass them:
/// `(ignore_index, label_smoothing, z_loss, softcap, reduction)`.
type CeOpts = (i64, f32, f32, Option<f32>, String);

/// Options of the cross-entropy family.
fn ce_options(
    (ignore_index, label_smoothing, z_loss, softcap, red): CeOpts,
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
        reduction: reduction(&red)?,
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
    let red = reduction.to_string();
    let o = ce_options((ignore_index, label_smoothing, z_loss, softcap, red))?;
    let mut t = Tensors::new();
    let logits = t.input(logits, "logits")?;
    let targets = t.input(targets, "target")?;
    let losses = t.out(losses, "losses")?;
    let grad = t.out_opt(grad, "grad")?;
    let mut floats = vec![&logits];
    floats.extend(grad.as_ref());
    let f = t.checked_typed(&floats, &[&targets], &[&losses])?;
    let vocab = logits.last();
    let r = detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe {
            let a = cross_entropy::CeArgs { targets: targets.slice(), vocab, options: o };
            let grad = grad.as_ref().map(|g| g.slice_mut());
            cross_entropy::cross_entropy_fwd_into::<E>(pool::global(), cpu::tier(), &a, logits.slice(), losses.slice_mut(), grad)
        }
    })?;
    Ok((r.loss, r.z_loss, r.counted))
}

/// Fused linear cross-entropy (`options` as [`CeOpts`]). Returns (loss,
/// z_loss, counted); gradients are written when `grad_x` and `grad_weight`
/// are given.
#[pyfunction]
#[pyo3(signature = (x, weight, bias, targets, losses, grad_x, grad_weight, grad_bias, row_scale, options))]
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
    options: CeOpts,
) -> PyResult<(f32, f32, usize)> {
    let o = ce_options(options)?;
    let mut t = Tensors::new();
    let (x, w) = (t.input(x, "x")?, t.input(weight, "weight")?);
    let bias = t.input_opt(bias, "bias")?;
    let targets = t.input(targets, "target")?;
    let row_scale = t.input_opt(row_scale, "row_scale")?;
    let losses = t.out(losses, "losses")?;
    let dx = t.out_opt(grad_x, "grad_x")?;
    let dw = t.out_opt(grad_weight, "grad_weight")?;
    let db = t.out_opt(grad_bias, "grad_bias")?;
    let mut floats = vec![&x, &w];
    floats.extend(bias.as_ref());
    floats.extend(dx.as_ref());
    let mut f32s = vec![&losses];
    f32s.extend([&dw, &db, &row_scale].into_iter().flatten());
    let f = t.checked_typed(&floats, &[&targets], &f32s)?;
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
    let f = t.checked_typed(&[&q, &p, &dq], &labels.iter().collect::<Vec<_>>(), &[])?;
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

/// Fused linear JSD (distillation): `student` and `teacher` are each
/// (input, weight), `options` (beta, ignore_index, temperature). Returns
/// (loss, counted); the student's gradients are written into `grads`
/// (input, weight) when given.
#[pyfunction]
#[pyo3(signature = (student, teacher, labels, options, grads))]
pub fn linear_jsd<'py>(
    py: Python<'py>,
    student: (Any<'py>, Any<'py>),
    teacher: (Any<'py>, Any<'py>),
    labels: Option<&Any<'py>>,
    options: (f32, i64, f32),
    grads: (Option<Any<'py>>, Option<Any<'py>>),
) -> PyResult<(f32, usize)> {
    let ((beta, ignore_index, temperature), (grad_x, grad_weight)) = (options, grads);
    check_beta(beta)?;
    if !(temperature > 0.0 && temperature.is_finite()) {
        return Err(PyValueError::new_err(
            "temperature must be a positive number",
        ));
    }
    let mut t = Tensors::new();
    let (xs, ws) = (
        t.input(&student.0, "student_input")?,
        t.input(&student.1, "student_weight")?,
    );
    let (xt, wt) = (
        t.input(&teacher.0, "teacher_input")?,
        t.input(&teacher.1, "teacher_weight")?,
    );
    let labels = t.input_opt(labels, "shift_labels")?;
    let dx = t.out_opt(grad_x.as_ref(), "grad_input")?;
    let dw = t.out_opt(grad_weight.as_ref(), "grad_weight")?;
    let mut floats = vec![&xs, &ws, &xt, &wt];
    floats.extend(dx.as_ref());
    let (labels_, dw_): (Vec<_>, Vec<_>) = (labels.iter().collect(), dw.iter().collect());
    let f = t.checked_typed(&floats, &labels_, &dw_)?;
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

/// Query, key and value, as the wrappers pass them (one tuple).
type Qkv<'py> = (Any<'py>, Any<'py>, Any<'py>);
/// FlashAttention's options: softmax scale, causal mask, sliding window.
type FlashOpts = (f32, bool, Option<usize>);

/// Registers q, k and v (read) with `t`.
fn flash_inputs(t: &mut Tensors, (q, k, v): &Qkv<'_>) -> PyResult<[View; 3]> {
    Ok([
        t.input(q, "query")?,
        t.input(k, "key")?,
        t.input(v, "value")?,
    ])
}

/// The call's shape, from q, k and v's views and the options.
fn flash_shape(
    [q, k, v]: &[View; 3],
    (scale, causal, window): FlashOpts,
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
pub fn flash_attn_fwd<'py>(
    py: Python<'py>,
    qkv: Qkv<'py>,
    out: &Any<'py>,
    lse: &Any<'py>,
    opts: FlashOpts,
) -> PyResult<()> {
    let mut t = Tensors::new();
    let qkv = flash_inputs(&mut t, &qkv)?;
    let (o, lse) = (t.out(out, "out")?, t.out(lse, "lse")?);
    let [q, k, v] = &qkv;
    let f = t.checked_float(&[q, k, v, &o], &[&lse])?;
    let s = flash_shape(&qkv, opts)?;
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe {
            let a = flash::FlashFwd { shape: s, q: q.slice(), k: k.slice(), v: v.slice(), out: o.slice_mut(), lse: lse.slice_mut() };
            flash::flash_attn_fwd::<E>(cpu::tier(), a)
        }
    })
}

/// `saved` is the forward's `out`, the gradient reaching it and the
/// forward's `lse`; writes the gradients of q, k and v into `grads`.
#[pyfunction]
pub fn flash_attn_bwd<'py>(
    py: Python<'py>,
    qkv: Qkv<'py>,
    saved: Qkv<'py>,
    grads: Qkv<'py>,
    opts: FlashOpts,
) -> PyResult<()> {
    let mut t = Tensors::new();
    let qkv = flash_inputs(&mut t, &qkv)?;
    let (o, d_o, lse) = (
        t.input(&saved.0, "out")?,
        t.input(&saved.1, "grad_out")?,
        t.input(&saved.2, "lse")?,
    );
    let (dq, dk, dv) = (
        t.out(&grads.0, "grad_query")?,
        t.out(&grads.1, "grad_key")?,
        t.out(&grads.2, "grad_value")?,
    );
    let [q, k, v] = &qkv;
    let f = t.checked_float(&[q, k, v, &o, &d_o, &dq, &dk, &dv], &[&lse])?;
    let s = flash_shape(&qkv, opts)?;
    detach_float!(py, t, f, E => {
        // SAFETY: as in `rms_norm_fwd`.
        unsafe {
            let a = flash::FlashBwd {
                shape: s, q: q.slice(), k: k.slice(), v: v.slice(), out: o.slice(), dout: d_o.slice(), lse: lse.slice(),
                dq: dq.slice_mut(), dk: dk.slice_mut(), dv: dv.slice_mut(),
            };
            flash::flash_attn_bwd::<E>(cpu::tier(), a)
        }
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rms_norm_fwd, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm_bwd, m)?)?;
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
