//! Writing GGUF files: for tests that craft files, and for conversion.
//!
//! The byte layout matches the reference Python writer (gguf-py): metadata
//! and tensor infos in insertion order, the header padded to the alignment,
//! and every tensor's data padded to the alignment, the last one included.
//! Everything the reader would reject is rejected here first, so a file this
//! writer produces always reads back.

use super::alignment::{align_up, alignment_from_value, ALIGNMENT_KEY, DEFAULT_ALIGNMENT};
use super::error::{GgufError, Result};
use super::reader::{MAGIC, MAX_DIMS};
use super::value::{Array, Value};
use super::value_reader::MAX_ARRAY_DEPTH;
use kvant_core::DType;
use std::borrow::Cow;
use std::collections::HashSet;
use std::io::Write;
use std::path::Path;

/// Longest tensor name llama.cpp accepts (GGML_MAX_NAME less the NUL); kept
/// so that files kvant writes load elsewhere too.
pub const MAX_TENSOR_NAME_LEN: usize = 63;

/// The format version written unless told otherwise.
pub const DEFAULT_VERSION: u32 = 3;

struct PendingTensor<'a> {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    data: Cow<'a, [u8]>,
}

/// Collects metadata and tensors, then writes them out in one pass. Tensor
/// data may be borrowed (e.g. from a mapped checkpoint) for `'a`.
pub struct GgufWriter<'a> {
    version: u32,
    alignment: usize,
    metadata: Vec<(String, Value)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor<'a>>,
    names: HashSet<String>,
}

impl Default for GgufWriter<'_> {
    fn default() -> Self {
        GgufWriter::new()
    }
}

impl<'a> GgufWriter<'a> {
    pub fn new() -> Self {
        GgufWriter {
            version: DEFAULT_VERSION,
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            keys: HashSet::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
        }
    }

    /// Version 2 and 3 share one layout; only the number differs.
    pub fn set_version(&mut self, version: u32) -> Result<()> {
        if !matches!(version, 2 | 3) {
            return Err(GgufError::BadWriterVersion { version });
        }
        self.version = version;
        Ok(())
    }

    /// Adds a metadata entry. Setting `general.alignment` also changes the
    /// alignment the data is written with.
    pub fn add(&mut self, key: impl Into<String>, value: impl Into<Value>) -> Result<()> {
        let key = key.into();
        let value = value.into();
        let reject = |reason: String| GgufError::BadWriterValue {
            key: key.clone(),
            reason,
        };
        if self.keys.contains(&key) {
            return Err(reject("key already added".to_string()));
        }
        if value.depth() > MAX_ARRAY_DEPTH {
            return Err(reject(format!(
                "arrays nested deeper than {MAX_ARRAY_DEPTH} levels"
            )));
        }
        if key == ALIGNMENT_KEY {
            self.alignment = alignment_from_value(&value)?;
        }
        self.keys.insert(key.clone());
        self.metadata.push((key, value));
        Ok(())
    }

    /// Adds a tensor with a row-major `shape` and its raw bytes in `dtype`'s
    /// storage layout.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: &[usize],
        data: impl Into<Cow<'a, [u8]>>,
    ) -> Result<()> {
        let name = name.into();
        let data = data.into();
        let reject = |reason: String| GgufError::BadWriterTensor {
            tensor: name.clone(),
            reason,
        };
        if self.names.contains(&name) {
            return Err(reject("tensor already added".to_string()));
        }
        if name.len() > MAX_TENSOR_NAME_LEN {
            return Err(reject(format!(
                "name longer than {MAX_TENSOR_NAME_LEN} bytes"
            )));
        }
        if shape.len() > MAX_DIMS {
            return Err(reject(format!(
                "{} dimensions, at most {MAX_DIMS}",
                shape.len()
            )));
        }
        let elements = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| reject(format!("shape {shape:?} overflows")))?;
        let row = shape.last().copied().unwrap_or(1);
        dtype.bytes_for(row).map_err(|e| reject(e.to_string()))?;
        let expected = dtype
            .bytes_for(elements)
            .map_err(|e| reject(e.to_string()))?;
        if data.len() != expected {
            return Err(reject(format!(
                "{dtype} {shape:?} needs {expected} bytes, got {}",
                data.len()
            )));
        }
        self.names.insert(name.clone());
        self.tensors.push(PendingTensor {
            name,
            dtype,
            shape: shape.to_vec(),
            data,
        });
        Ok(())
    }

    /// Writes the whole file to `out`.
    fn write_to(&self, out: &mut impl Write) -> Result<()> {
        out.write_all(&self.header_bytes()?)
            .map_err(GgufError::Write)?;
        for t in &self.tensors {
            out.write_all(&t.data).map_err(GgufError::Write)?;
            out.write_all(&vec![0u8; self.padding(t.data.len())?])
                .map_err(GgufError::Write)?;
        }
        out.flush().map_err(GgufError::Write)
    }

    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.write_to(&mut out)?;
        Ok(out)
    }

    pub fn write_file(&self, path: &Path) -> Result<()> {
        let file = std::fs::File::create(path).map_err(GgufError::Write)?;
        self.write_to(&mut std::io::BufWriter::new(file))
    }

    /// Everything before the data section, padding included.
    fn header_bytes(&self) -> Result<Vec<u8>> {
        let mut h = Vec::new();
        h.extend_from_slice(MAGIC);
        h.extend(self.version.to_le_bytes());
        h.extend((self.tensors.len() as u64).to_le_bytes());
        h.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(&mut h, key);
            h.extend(value.value_type().id().to_le_bytes());
            put_value(&mut h, value);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            put_str(&mut h, &t.name);
            h.extend((t.shape.len() as u32).to_le_bytes());
            for &d in t.shape.iter().rev() {
                h.extend((d as u64).to_le_bytes());
            }
            let id = t
                .dtype
                .ggml_id()
                .ok_or_else(|| GgufError::BadWriterTensor {
                    tensor: t.name.clone(),
                    reason: format!("GGUF has no type for {}", t.dtype),
                })?;
            h.extend(id.to_le_bytes());
            h.extend((offset as u64).to_le_bytes());
            offset = offset
                .checked_add(t.data.len() + self.padding(t.data.len())?)
                .ok_or_else(|| GgufError::BadWriterTensor {
                    tensor: t.name.clone(),
                    reason: "data section exceeds the address space".to_string(),
                })?;
        }
        let pad = self.padding(h.len())?;
        h.resize(h.len() + pad, 0);
        Ok(h)
    }

    fn padding(&self, len: usize) -> Result<usize> {
        align_up(len, self.alignment)
            .map(|end| end - len)
            .ok_or(GgufError::BadAlignment {
                value: self.alignment as i128,
                max: super::alignment::MAX_ALIGNMENT,
            })
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend(v.to_le_bytes()),
        Value::U16(v) => out.extend(v.to_le_bytes()),
        Value::I16(v) => out.extend(v.to_le_bytes()),
        Value::U32(v) => out.extend(v.to_le_bytes()),
        Value::I32(v) => out.extend(v.to_le_bytes()),
        Value::F32(v) => out.extend(v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(v) => put_str(out, v),
        Value::Array(a) => put_array(out, a),
        Value::U64(v) => out.extend(v.to_le_bytes()),
        Value::I64(v) => out.extend(v.to_le_bytes()),
        Value::F64(v) => out.extend(v.to_le_bytes()),
    }
}

/// Element type, count, then the elements (nested arrays repeat this form).
fn put_array(out: &mut Vec<u8>, array: &Array) {
    out.extend(array.element_type().id().to_le_bytes());
    out.extend((array.len() as u64).to_le_bytes());
    match array {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::U16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::I16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::U32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::I32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::F32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::Bool(v) => v.iter().for_each(|&x| out.push(u8::from(x))),
        Array::String(v) => v.iter().for_each(|s| put_str(out, s)),
        Array::Array(v) => v.iter().for_each(|a| put_array(out, a)),
        Array::U64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::I64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::F64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
    }
}
