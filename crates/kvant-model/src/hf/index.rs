//! `model.safetensors.index.json`: which shard file holds each tensor.
//!
//! Shard names come from the file, so each must be a plain file name: an
//! index must not make the loader map `../../somewhere/else`.

use super::error::{HfError, Result};
use super::files::read_json_object;
use std::collections::BTreeMap;
use std::path::{Component, Path};

/// The index file name transformers writes for sharded checkpoints.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Reads the index's `weight_map`: tensor name to shard file name.
pub(crate) fn read_weight_map(path: &Path) -> Result<BTreeMap<String, String>> {
    let index = read_json_object(path, "the index")?;
    let map = index
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| HfError::NotAnObject {
            path: path.to_path_buf(),
            what: "weight_map",
        })?;
    let mut out = BTreeMap::new();
    for (tensor, shard) in map {
        let shard = shard.as_str().ok_or_else(|| HfError::BadShardName {
            index: path.to_path_buf(),
            shard: shard.to_string(),
        })?;
        if !is_plain_file_name(shard) {
            return Err(HfError::BadShardName {
                index: path.to_path_buf(),
                shard: shard.to_string(),
            });
        }
        out.insert(tensor.clone(), shard.to_string());
    }
    Ok(out)
}

/// True for a single normal path component (no separators, `.` or `..`).
fn is_plain_file_name(name: &str) -> bool {
    let mut parts = Path::new(name).components();
    matches!((parts.next(), parts.next()), (Some(Component::Normal(p)), None) if p == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_must_stay_in_the_directory() {
        assert!(is_plain_file_name("model-00001-of-00002.safetensors"));
        for bad in [
            "",
            ".",
            "..",
            "../x.safetensors",
            "/etc/passwd",
            "a/b",
            "a/",
        ] {
            assert!(!is_plain_file_name(bad), "{bad:?}");
        }
    }
}
