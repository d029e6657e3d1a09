//! Typed reads of `config.json` values: absent or `null` is `None`, a
//! value of the wrong kind an error naming its key.

use super::error::{invalid, ConfigError, Result};
use serde_json::Value;

/// `cfg[key]` as a count: anything but a non-negative integer is an error.
pub(super) fn usize_at(cfg: &Value, key: &str) -> Result<Option<usize>> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .map(Some)
            .ok_or_else(|| invalid(key, format!("expected a non-negative integer, found {v}"))),
    }
}

/// `cfg[key]` as a count that must be there.
pub(super) fn required(cfg: &Value, key: &str) -> Result<usize> {
    usize_at(cfg, key)?.ok_or_else(|| ConfigError::Missing(key.into()))
}

/// `cfg[key]` as a number: anything but a number is an error.
pub(super) fn f32_at(cfg: &Value, key: &str) -> Result<Option<f32>> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|v| Some(v as f32))
            .ok_or_else(|| invalid(key, format!("expected a number, found {v}"))),
    }
}

/// `cfg[key]` as a switch; anything but a boolean reads as absent.
pub(super) fn flag(cfg: &Value, key: &str) -> Option<bool> {
    cfg.get(key).and_then(Value::as_bool)
}
