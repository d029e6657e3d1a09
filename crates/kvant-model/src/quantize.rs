//! Requantizing a GGUF file (`kvant quantize`), as llama.cpp's
//! `llama-quantize --pure` does: every float weight matrix becomes Q8_0,
//! Q4_0 or Q4_K (Q5_0 where its rows are not whole 256-value blocks, as
//! llama.cpp falls back), rounded as ggml's reference quantizer rounds it;
//! vectors, routers and tensors already quantized are copied as they are,
//! and the metadata is kept with `general.file_type` set to the new type.

use crate::gguf::{GgufFile, GgufWriter, Value};
use crate::ModelError;
use kvant_core::{DType, Tensor};
use kvant_kernels::quant::{quantize_tensor, quantized_type};
use std::path::Path;

const FILE_TYPE_KEY: &str = "general.file_type";
const QUANT_VERSION_KEY: &str = "general.quantization_version";
/// ggml's quantization format version of the legacy and k-quant blocks.
const QUANT_VERSION: u32 = 2;

/// What [`quantize_gguf`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuantizeReport {
    pub quantized: usize,
    /// Of those, tensors that took the fallback type (Q4_K's Q5_0).
    pub fallback: usize,
    pub kept: usize,
    pub bytes_in: usize,
    pub bytes_out: usize,
}

/// llama.cpp's `llama_ftype` of a whole file of `to`.
fn file_type(to: DType) -> Result<u32, ModelError> {
    match to {
        DType::Q8_0 => Ok(7),
        DType::Q4_0 => Ok(2),
        // What llama-quantize writes for `Q4_K` (its Q4_K_M), `--pure` too.
        DType::Q4_K => Ok(15),
        other => Err(ModelError::QuantizeTarget(other)),
    }
}

/// The type `name`'s tensor becomes for `to` ([`quantized_type`]) when it
/// is a weight matrix to quantize: float, at least two dimensions, and not
/// a router (llama.cpp keeps `ffn_gate_inp` in f32: rounding there flips
/// expert choices); `None`: copied.
fn target(name: &str, t: &Tensor, to: DType) -> Option<DType> {
    match t.shape().len() >= 2 && !name.contains("ffn_gate_inp") {
        true => quantized_type(t, to),
        false => None,
    }
}

/// Writes `src` with its weight matrices quantized to `to` (Q8_0, Q4_0 or
/// Q4_K)
/// to `dst`, through a temporary file beside it, so `dst` is never left
/// half written. `calls` `progress(done, total)` after each tensor.
pub fn quantize_gguf(
    src: &Path,
    dst: &Path,
    to: DType,
    mut progress: impl FnMut(usize, usize),
) -> Result<QuantizeReport, ModelError> {
    let ftype = file_type(to)?;
    let g = GgufFile::open(src)?;
    let mut w = GgufWriter::new();
    let (mut has_file_type, mut has_version) = (false, false);
    for (k, v) in g.metadata() {
        match k {
            FILE_TYPE_KEY => {
                has_file_type = true;
                w.add(k, Value::U32(ftype))?
            }
            QUANT_VERSION_KEY => {
                has_version = true;
                w.add(k, Value::U32(QUANT_VERSION))?
            }
            _ => w.add(k, v.clone())?,
        }
    }
    if !has_file_type {
        w.add(FILE_TYPE_KEY, Value::U32(ftype))?;
    }
    if !has_version {
        w.add(QUANT_VERSION_KEY, Value::U32(QUANT_VERSION))?;
    }
    let infos = g.tensor_infos();
    let mut report = QuantizeReport::default();
    let mut out: Vec<Tensor> = Vec::with_capacity(infos.len());
    for (i, info) in infos.iter().enumerate() {
        let t = g.tensor(&info.name)?;
        report.bytes_in += t.byte_len();
        let t = match target(&info.name, &t, to) {
            Some(q) => {
                report.quantized += 1;
                report.fallback += usize::from(q != to);
                quantize_tensor(&t, q)?
            }
            None => {
                report.kept += 1;
                t
            }
        };
        report.bytes_out += t.byte_len();
        out.push(t);
        progress(i + 1, infos.len());
    }
    for (info, t) in infos.iter().zip(&out) {
        w.add_tensor(info.name.clone(), t.dtype(), &info.shape, t.bytes())?;
    }
    let partial = dst.with_extension("gguf.partial");
    w.write_file(&partial)?;
    std::fs::rename(&partial, dst).map_err(|e| ModelError::Write {
        path: dst.display().to_string(),
        source: e,
    })?;
    Ok(report)
}
