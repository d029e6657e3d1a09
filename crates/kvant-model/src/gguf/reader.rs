//! Parsing of the GGUF header: magic, version, metadata, tensor infos, and
//! the validation of every tensor's byte range against the file.
//!
//! Layout (little-endian): `"GGUF"`, u32 version, u64 tensor count, u64
//! metadata count, the metadata entries, the tensor infos, padding to the
//! alignment, then the data section that tensor offsets are relative to.

use super::alignment::{align_up, alignment_from_value, ALIGNMENT_KEY, DEFAULT_ALIGNMENT};
use super::cursor::{checked_count, Cursor, Within};
use super::error::{GgufError, Result};
use super::tensor_info::TensorInfo;
use super::value::Value;
use super::value_reader::{read_str, read_value, read_value_type};
use kvant_core::{CoreError, DType};
use std::collections::HashMap;

pub const MAGIC: &[u8; 4] = b"GGUF";

/// Most dimensions a tensor may have (GGML_MAX_DIMS).
pub const MAX_DIMS: usize = 4;

/// Smallest metadata entry: key length, an empty key, type id, a 1-byte value.
const MIN_KV_LEN: usize = 8 + 4 + 1;

/// Smallest tensor info: name length, an empty name, n_dims, type id, offset.
const MIN_TENSOR_INFO_LEN: usize = 8 + 4 + 4 + 8;

/// The parsed and validated header.
pub(crate) struct Header {
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub key_index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    pub tensor_index: HashMap<String, usize>,
    pub alignment: usize,
    pub data_offset: usize,
}

pub(crate) fn parse(bytes: &[u8]) -> Result<Header> {
    let mut cur = Cursor::new(bytes);
    let magic = cur.take(4).within(|| "magic".to_string())?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic {
            found: magic.to_vec(),
        });
    }
    let version = read_version(&mut cur)?;
    let n_tensors = cur.u64().within(|| "tensor count".to_string())?;
    let n_kv = cur.u64().within(|| "metadata count".to_string())?;

    let (metadata, key_index) = read_metadata(&mut cur, n_kv)?;
    let alignment = match key_index.get(ALIGNMENT_KEY).and_then(|&i| metadata.get(i)) {
        Some((_, v)) => alignment_from_value(v)?,
        None => DEFAULT_ALIGNMENT,
    };
    let (tensors, tensor_index) = read_tensor_infos(&mut cur, n_tensors, alignment)?;
    // The position is at most the file length and the alignment at most
    // MAX_ALIGNMENT, so this only fails on a corrupt address space.
    let data_offset = align_up(cur.pos(), alignment).ok_or(GgufError::BadAlignment {
        value: alignment as i128,
        max: super::alignment::MAX_ALIGNMENT,
    })?;
    for t in &tensors {
        check_in_file(t, data_offset, bytes.len())?;
    }
    Ok(Header {
        version,
        metadata,
        key_index,
        tensors,
        tensor_index,
        alignment,
        data_offset,
    })
}

fn read_version(cur: &mut Cursor<'_>) -> Result<u32> {
    let version = cur.u32().within(|| "version".to_string())?;
    match version {
        2 | 3 => Ok(version),
        // A big-endian file stores the small version number byte-swapped.
        v if (1..=3).contains(&v.swap_bytes()) => Err(GgufError::BigEndian { version: v }),
        v => Err(GgufError::UnsupportedVersion { version: v }),
    }
}

type Metadata = (Vec<(String, Value)>, HashMap<String, usize>);

fn read_metadata(cur: &mut Cursor<'_>, n_kv: u64) -> Result<Metadata> {
    let n = checked_count(cur, n_kv, MIN_KV_LEN, || "metadata count".to_string())?;
    let mut metadata = Vec::with_capacity(n);
    let mut index = HashMap::with_capacity(n);
    for i in 0..n {
        let at = cur.pos();
        let key = read_str(cur, || format!("key of metadata entry {i}"))?;
        if index.contains_key(key) {
            return Err(GgufError::DuplicateKey {
                key: key.to_string(),
                offset: at,
            });
        }
        let ty = read_value_type(cur, key)?;
        let value = read_value(cur, ty, key)?;
        index.insert(key.to_string(), metadata.len());
        metadata.push((key.to_string(), value));
    }
    Ok((metadata, index))
}

type TensorInfos = (Vec<TensorInfo>, HashMap<String, usize>);

fn read_tensor_infos(
    cur: &mut Cursor<'_>,
    n_tensors: u64,
    alignment: usize,
) -> Result<TensorInfos> {
    let n = checked_count(cur, n_tensors, MIN_TENSOR_INFO_LEN, || {
        "tensor count".to_string()
    })?;
    let mut infos = Vec::with_capacity(n);
    let mut index = HashMap::with_capacity(n);
    for i in 0..n {
        let at = cur.pos();
        let info = read_tensor_info(cur, i, alignment)?;
        if index.contains_key(&info.name) {
            return Err(GgufError::DuplicateTensor {
                name: info.name,
                offset: at,
            });
        }
        index.insert(info.name.clone(), infos.len());
        infos.push(info);
    }
    Ok((infos, index))
}

fn read_tensor_info(cur: &mut Cursor<'_>, i: usize, alignment: usize) -> Result<TensorInfo> {
    let name = read_str(cur, || format!("name of tensor info {i}"))?;
    let ctx = || format!("tensor info {name:?}");
    let dims_at = cur.pos();
    let n_dims = cur.u32().within(ctx)?;
    if n_dims as usize > MAX_DIMS {
        return Err(GgufError::TooManyDims {
            tensor: name.to_string(),
            n_dims,
            offset: dims_at,
            max: MAX_DIMS,
        });
    }
    let mut ggml_dims = Vec::with_capacity(MAX_DIMS);
    for _ in 0..n_dims {
        ggml_dims.push(cur.u64().within(ctx)?);
    }
    let type_at = cur.pos();
    let type_id = cur.u32().within(ctx)?;
    let dtype = DType::from_ggml_id(type_id).ok_or_else(|| GgufError::UnknownGgmlType {
        tensor: name.to_string(),
        id: type_id,
        offset: type_at,
    })?;
    let offset = cur.u64().within(ctx)?;

    // GGUF lists the innermost dimension first; kvant shapes are row-major.
    let raw_shape: Vec<u64> = ggml_dims.iter().rev().copied().collect();
    let (shape, byte_len) =
        shape_and_len(dtype, &raw_shape).map_err(|source| GgufError::BadShape {
            tensor: name.to_string(),
            shape: raw_shape.clone(),
            source,
        })?;
    if offset % alignment as u64 != 0 {
        return Err(GgufError::MisalignedTensor {
            tensor: name.to_string(),
            offset,
            alignment,
        });
    }
    Ok(TensorInfo {
        name: name.to_string(),
        dtype,
        shape,
        // Checked to fit (inside the file) by `check_in_file`; until then a
        // value beyond usize saturates and fails that check.
        offset: usize::try_from(offset).unwrap_or(usize::MAX),
        byte_len,
    })
}

/// Converts the shape to `usize`, checking the element count for overflow
/// and that rows are whole blocks; returns the shape and its byte length.
fn shape_and_len(dtype: DType, raw: &[u64]) -> std::result::Result<(Vec<usize>, usize), CoreError> {
    let overflow = || CoreError::ShapeOverflow {
        shape: raw
            .iter()
            .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
            .collect(),
    };
    let shape = raw
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<std::result::Result<Vec<usize>, _>>()
        .map_err(|_| overflow())?;
    let elements = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(overflow)?;
    dtype.bytes_for(shape.last().copied().unwrap_or(1))?;
    Ok((shape, dtype.bytes_for(elements)?))
}

fn check_in_file(t: &TensorInfo, data_offset: usize, file_size: usize) -> Result<()> {
    let start = data_offset as u128 + t.offset as u128;
    let end = start + t.byte_len as u128;
    if end > file_size as u128 {
        return Err(GgufError::TensorOutOfBounds {
            tensor: t.name.clone(),
            start,
            end,
            file_size,
        });
    }
    Ok(())
}
