//! Reading the small side files of a model directory (JSON configs, the
//! chat template) with a size cap, so a hostile directory cannot make the
//! loader read gigabytes into memory.

use super::error::{HfError, Result};
use std::io::Read;
use std::path::Path;

/// Largest side file read into memory: tokenizer configs run to a few MB;
/// nothing legitimate comes near this.
pub const MAX_SIDE_FILE_LEN: u64 = 64 << 20;

/// Reads a whole file of at most [`MAX_SIDE_FILE_LEN`] bytes.
fn read_capped(path: &Path) -> Result<Vec<u8>> {
    let io = |source| HfError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    // Read one byte past the cap to tell "exactly at the cap" from "over it"
    // without trusting the size metadata reports.
    file.take(MAX_SIDE_FILE_LEN + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > MAX_SIDE_FILE_LEN {
        let len = std::fs::metadata(path)
            .map(|m| m.len())
            .unwrap_or(bytes.len() as u64);
        return Err(HfError::FileTooLarge {
            path: path.to_path_buf(),
            len,
            max: MAX_SIDE_FILE_LEN,
        });
    }
    Ok(bytes)
}

/// Parses a JSON file whose top level must be an object.
pub(crate) fn read_json_object(path: &Path, what: &'static str) -> Result<serde_json::Value> {
    let bytes = read_capped(path)?;
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|source| HfError::Json {
            path: path.to_path_buf(),
            source,
        })?;
    if !value.is_object() {
        return Err(HfError::NotAnObject {
            path: path.to_path_buf(),
            what,
        });
    }
    Ok(value)
}

/// [`read_json_object`] for a file that may be absent.
pub(crate) fn read_optional_json(
    path: &Path,
    what: &'static str,
) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    read_json_object(path, what).map(Some)
}

/// Reads an optional UTF-8 text file.
pub(crate) fn read_optional_text(path: &Path) -> Result<Option<String>> {
    if !path.exists() {
        return Ok(None);
    }
    let bytes = read_capped(path)?;
    String::from_utf8(bytes)
        .map(Some)
        .map_err(|_| HfError::NotUtf8 {
            path: path.to_path_buf(),
        })
}
