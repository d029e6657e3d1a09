//! One safetensors file: a u64 header length, a JSON header mapping tensor
//! names to dtype, shape and byte range, then the data section.
//!
//! The file is mapped once and tensors are views into the map. Every range
//! is validated at open time (ordered, inside the data section, exactly the
//! size its shape and dtype need), so a tensor view can never reach outside
//! its bytes, and a duplicated name in the JSON is an error rather than a
//! silent "last one wins".

use super::error::{HfError, Result};
use super::st_dtype::StDtype;
use kvant_core::{Storage, Tensor};
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Largest JSON header accepted (the limit the reference implementation uses).
pub const MAX_HEADER_LEN: usize = 100_000_000;

/// Key of the optional string-to-string metadata in the header.
const METADATA_KEY: &str = "__metadata__";

#[derive(Clone, Debug)]
struct Entry {
    dtype: StDtype,
    shape: Vec<usize>,
    /// Absolute offset of the data in the file.
    start: usize,
}

/// A mapped, validated safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    storage: Storage,
    entries: BTreeMap<String, Entry>,
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<SafetensorsFile> {
        let storage = Storage::map_file(path).map_err(|source| HfError::Map {
            path: path.to_path_buf(),
            source,
        })?;
        SafetensorsFile::from_storage(storage, path)
    }

    /// Parses safetensors bytes already in memory; `path` only labels errors.
    pub fn from_storage(storage: Storage, path: &Path) -> Result<SafetensorsFile> {
        let entries = parse_header(storage.as_bytes(), path)?;
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            storage,
            entries,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensor names in sorted order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Drops this process's resident pages of the file (see
    /// [`Storage::release_all_resident_pages`]).
    #[cfg(unix)]
    pub fn release_resident_pages(&self) {
        self.storage.release_all_resident_pages();
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries
            .get(name)
            .ok_or_else(|| HfError::MissingTensor {
                name: name.to_string(),
            })
    }

    /// A view of tensor `name` borrowing the mapped bytes.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let entry = self.entry(name)?;
        let dtype = entry
            .dtype
            .to_dtype()
            .ok_or_else(|| HfError::UnsupportedDtype {
                tensor: name.to_string(),
                dtype: entry.dtype.name(),
            })?;
        Tensor::new(
            dtype,
            entry.shape.clone(),
            self.storage.clone(),
            entry.start,
        )
        .map_err(|source| HfError::Tensor {
            tensor: name.to_string(),
            source,
        })
    }
}

impl SafetensorsFile {
    /// Tensor `name` as stored: its dtype, shape and bytes (validated
    /// against each other when the file opened), for the loaders of
    /// formats kvant assembles from several tensors (`super::scaled`).
    pub(crate) fn raw(&self, name: &str) -> Result<super::scaled::Raw<'_>> {
        let entry = self.entry(name)?;
        let elements: usize = entry.shape.iter().product();
        // The byte count was validated when the file opened.
        let len = entry
            .dtype
            .bytes_for(elements as u128)
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(0);
        let bytes = self
            .storage
            .slice(entry.start, len)
            .map_err(|source| HfError::Tensor {
                tensor: name.to_string(),
                source,
            })?;
        Ok(super::scaled::Raw {
            dtype: entry.dtype.name(),
            shape: &entry.shape,
            bytes,
        })
    }

    /// Tensor `name`'s values as integers (`I64`, `I32`, `U8`...: an
    /// index table such as DeepSeek-V4's `tid2eid`), with its shape.
    pub fn integers(&self, name: &str) -> Result<(Vec<i64>, Vec<usize>)> {
        let entry = self.entry(name)?;
        let width = match entry.dtype.name() {
            "I64" | "U64" => 8,
            "I32" | "U32" => 4,
            "I16" | "U16" => 2,
            "I8" | "U8" => 1,
            other => {
                return Err(HfError::UnsupportedDtype {
                    tensor: name.to_string(),
                    dtype: other_name(other),
                })
            }
        };
        let count: usize = entry.shape.iter().product();
        // The byte range was validated against the file when it opened.
        let bytes = self
            .storage
            .slice(entry.start, count * width)
            .map_err(|source| HfError::Tensor {
                tensor: name.to_string(),
                source,
            })?;
        let signed = entry.dtype.name().starts_with('I');
        let values = bytes
            .chunks_exact(width)
            .map(|b| {
                let mut le = [0u8; 8];
                le[..width].copy_from_slice(b);
                // Sign-extend the signed types from their top byte.
                if signed && b[width - 1] & 0x80 != 0 {
                    le[width..].fill(0xff);
                }
                i64::from_le_bytes(le)
            })
            .collect();
        Ok((values, entry.shape.clone()))
    }
}

/// The static name of a safetensors dtype (for errors).
fn other_name(name: &str) -> &'static str {
    StDtype::parse(name).map_or("unknown", StDtype::name)
}

/// The header's top-level object as (key, value) pairs in file order, so
/// duplicate keys can be detected (a map would silently keep the last).
struct Pairs(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for Pairs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Pairs, D::Error> {
        struct PairsVisitor;
        impl<'de> Visitor<'de> for PairsVisitor {
            type Value = Pairs;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Pairs, A::Error> {
                let mut out = Vec::new();
                while let Some(pair) = map.next_entry::<String, serde_json::Value>()? {
                    out.push(pair);
                }
                Ok(Pairs(out))
            }
        }
        d.deserialize_map(PairsVisitor)
    }
}

/// One tensor's header entry as written.
#[derive(Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

fn parse_header(bytes: &[u8], path: &Path) -> Result<BTreeMap<String, Entry>> {
    let (len_field, rest) = bytes.split_first_chunk::<8>().ok_or(HfError::Truncated {
        path: path.to_path_buf(),
        len: bytes.len(),
    })?;
    let header_len = u64::from_le_bytes(*len_field);
    let too_long = || HfError::HeaderTooLong {
        path: path.to_path_buf(),
        header_len,
        available: rest.len(),
        max: MAX_HEADER_LEN,
    };
    let n = usize::try_from(header_len).map_err(|_| too_long())?;
    if n > MAX_HEADER_LEN {
        return Err(too_long());
    }
    let (header, data) = rest.split_at_checked(n).ok_or_else(too_long)?;
    let Pairs(pairs) = serde_json::from_slice(header).map_err(|e| HfError::BadHeader {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let data_start = 8 + n;
    let mut entries = BTreeMap::new();
    let mut seen_metadata = false;
    for (name, value) in pairs {
        if name == METADATA_KEY {
            if seen_metadata || !value.is_object() {
                return Err(HfError::BadHeader {
                    path: path.to_path_buf(),
                    reason: format!("{METADATA_KEY} must appear at most once, as an object"),
                });
            }
            seen_metadata = true;
            continue;
        }
        let entry = parse_entry(&name, value, data.len(), data_start, path)?;
        if entries.insert(name.clone(), entry).is_some() {
            return Err(HfError::BadEntry {
                path: path.to_path_buf(),
                tensor: name,
                reason: "appears twice in the header".to_string(),
            });
        }
    }
    Ok(entries)
}

fn parse_entry(
    name: &str,
    value: serde_json::Value,
    data_len: usize,
    data_start: usize,
    path: &Path,
) -> Result<Entry> {
    let bad = |reason: String| HfError::BadEntry {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        reason,
    };
    let raw: RawEntry = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
    let dtype = StDtype::parse(&raw.dtype).ok_or_else(|| HfError::UnknownDtype {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        dtype: raw.dtype.clone(),
    })?;
    let [begin, end] = raw.data_offsets;
    if begin > end || end > data_len as u64 {
        return Err(HfError::OffsetsOutOfRange {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            begin,
            end,
            data_len,
        });
    }
    let shape = raw
        .shape
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<std::result::Result<Vec<usize>, _>>()
        .map_err(|_| bad(format!("shape {:?} does not fit in memory", raw.shape)))?;
    let elements = raw
        .shape
        .iter()
        .try_fold(1u128, |acc, &d| acc.checked_mul(d.into()))
        .ok_or_else(|| bad(format!("shape {:?} has too many elements", raw.shape)))?;
    let expected = dtype.bytes_for(elements).ok_or_else(|| {
        bad(format!(
            "{} {:?} does not fill whole bytes",
            dtype.name(),
            raw.shape
        ))
    })?;
    let actual = end - begin;
    if expected != u128::from(actual) {
        return Err(HfError::SizeMismatch {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            dtype: dtype.name(),
            shape: raw.shape,
            expected,
            actual,
        });
    }
    Ok(Entry {
        dtype,
        shape,
        // begin <= data_len, so this is inside the file and cannot overflow.
        start: data_start + begin as usize,
    })
}
