//! Data alignment: where the data section and each tensor may start.
//!
//! The alignment comes from the `general.alignment` key (32 when absent). It
//! is a divisor in offset checks and a step in padding, so it is validated
//! once here rather than trusted at each use.

use super::error::{GgufError, Result};
use super::value::Value;

/// The key that overrides the default alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// Alignment when the file does not set one (GGUF_DEFAULT_ALIGNMENT).
pub const DEFAULT_ALIGNMENT: usize = 32;

/// Largest alignment accepted: above every page size a loader would align to
/// (16 MiB huge pages included); larger values only pad files with zeros.
pub const MAX_ALIGNMENT: usize = 1 << 24;

/// Validates a `general.alignment` value of any integer type.
pub(crate) fn alignment_from_value(value: &Value) -> Result<usize> {
    let raw = value.as_integer().ok_or_else(|| GgufError::WrongType {
        key: ALIGNMENT_KEY.to_string(),
        expected: "an integer",
        found: value.type_description(),
    })?;
    match usize::try_from(raw) {
        Ok(a) if a.is_power_of_two() && a <= MAX_ALIGNMENT => Ok(a),
        _ => Err(GgufError::BadAlignment {
            value: raw,
            max: MAX_ALIGNMENT,
        }),
    }
}

/// `n` rounded up to a multiple of `alignment` (a power of two), or `None`
/// on overflow.
pub(crate) fn align_up(n: usize, alignment: usize) -> Option<usize> {
    let mask = alignment.checked_sub(1)?;
    n.checked_add(mask).map(|v| v & !mask)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_powers_of_two_only() {
        assert_eq!(alignment_from_value(&Value::U32(64)).unwrap(), 64);
        assert_eq!(alignment_from_value(&Value::I64(1)).unwrap(), 1);
        for bad in [
            Value::U32(0),
            Value::U32(3),
            Value::I32(-32),
            Value::U64(1 << 40),
        ] {
            assert!(alignment_from_value(&bad).is_err(), "{bad:?}");
        }
        assert!(alignment_from_value(&Value::F32(32.0)).is_err());
    }

    #[test]
    fn rounds_up() {
        assert_eq!(align_up(0, 32), Some(0));
        assert_eq!(align_up(33, 32), Some(64));
        assert_eq!(align_up(64, 32), Some(64));
        assert_eq!(align_up(usize::MAX, 32), None);
    }
}
