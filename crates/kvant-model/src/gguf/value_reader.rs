//! Decoding of metadata values, strings and (nested) arrays.
//!
//! Array counts and string lengths are checked against the bytes left before
//! any vector is sized, and nesting is bounded so a hostile file cannot
//! recurse deeply.

use super::cursor::{checked_count, Cursor, Within};
use super::error::{GgufError, Result};
use super::value::{Array, Value, ValueType};

/// Deepest array nesting accepted; no known writer nests deeper than two.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// Reads a length-prefixed UTF-8 string, borrowing from the header bytes.
pub(crate) fn read_str<'a>(cur: &mut Cursor<'a>, context: impl Fn() -> String) -> Result<&'a str> {
    let at = cur.pos();
    let len = cur.u64().within(&context)?;
    let n = checked_count(cur, len, 1, &context)?;
    let bytes = cur.take(n).within(&context)?;
    std::str::from_utf8(bytes).map_err(|_| GgufError::InvalidUtf8 {
        context: context(),
        offset: at,
    })
}

/// Reads a value id and resolves it.
pub(crate) fn read_value_type(cur: &mut Cursor<'_>, key: &str) -> Result<ValueType> {
    let at = cur.pos();
    let id = cur
        .u32()
        .within(|| format!("type of metadata key {key:?}"))?;
    ValueType::from_id(id).ok_or_else(|| GgufError::UnknownValueType {
        key: key.to_string(),
        id,
        offset: at,
    })
}

/// Reads one value of type `ty` for metadata key `key`.
pub(crate) fn read_value(cur: &mut Cursor<'_>, ty: ValueType, key: &str) -> Result<Value> {
    let ctx = || format!("value of metadata key {key:?}");
    Ok(match ty {
        ValueType::U8 => Value::U8(cur.u8().within(ctx)?),
        ValueType::I8 => Value::I8(i8::from_le_bytes(cur.array().within(ctx)?)),
        ValueType::U16 => Value::U16(u16::from_le_bytes(cur.array().within(ctx)?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(cur.array().within(ctx)?)),
        ValueType::U32 => Value::U32(cur.u32().within(ctx)?),
        ValueType::I32 => Value::I32(i32::from_le_bytes(cur.array().within(ctx)?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(cur.array().within(ctx)?)),
        ValueType::U64 => Value::U64(cur.u64().within(ctx)?),
        ValueType::I64 => Value::I64(i64::from_le_bytes(cur.array().within(ctx)?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(cur.array().within(ctx)?)),
        ValueType::Bool => {
            let at = cur.pos();
            Value::Bool(to_bool(cur.u8().within(ctx)?, key, at)?)
        }
        ValueType::String => Value::String(read_str(cur, ctx)?.to_string()),
        ValueType::Array => Value::Array(read_array(cur, key, 1)?),
    })
}

fn to_bool(byte: u8, key: &str, offset: usize) -> Result<bool> {
    match byte {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(GgufError::InvalidBool {
            key: key.to_string(),
            byte,
            offset,
        }),
    }
}

/// Reads an array (element type, count, elements) at nesting level `depth`.
fn read_array(cur: &mut Cursor<'_>, key: &str, depth: usize) -> Result<Array> {
    if depth > MAX_ARRAY_DEPTH {
        return Err(GgufError::NestingTooDeep {
            key: key.to_string(),
            offset: cur.pos(),
            max: MAX_ARRAY_DEPTH,
        });
    }
    let ctx = || format!("array of metadata key {key:?}");
    let elem = read_value_type(cur, key)?;
    let count = cur.u64().within(ctx)?;
    let n = checked_count(cur, count, elem.min_encoded_len(), ctx)?;
    Ok(match elem {
        ValueType::U8 => Array::U8(cur.take(n).within(ctx)?.to_vec()),
        ValueType::I8 => Array::I8(fixed(cur, n, i8::from_le_bytes).within(ctx)?),
        ValueType::U16 => Array::U16(fixed(cur, n, u16::from_le_bytes).within(ctx)?),
        ValueType::I16 => Array::I16(fixed(cur, n, i16::from_le_bytes).within(ctx)?),
        ValueType::U32 => Array::U32(fixed(cur, n, u32::from_le_bytes).within(ctx)?),
        ValueType::I32 => Array::I32(fixed(cur, n, i32::from_le_bytes).within(ctx)?),
        ValueType::F32 => Array::F32(fixed(cur, n, f32::from_le_bytes).within(ctx)?),
        ValueType::U64 => Array::U64(fixed(cur, n, u64::from_le_bytes).within(ctx)?),
        ValueType::I64 => Array::I64(fixed(cur, n, i64::from_le_bytes).within(ctx)?),
        ValueType::F64 => Array::F64(fixed(cur, n, f64::from_le_bytes).within(ctx)?),
        ValueType::Bool => {
            let start = cur.pos();
            let bytes = cur.take(n).within(ctx)?;
            let mut out = Vec::with_capacity(n);
            for (i, &b) in bytes.iter().enumerate() {
                out.push(to_bool(b, key, start + i)?);
            }
            Array::Bool(out)
        }
        ValueType::String => {
            let mut out = Vec::with_capacity(n);
            for i in 0..n {
                out.push(
                    read_str(cur, || format!("element {i} of metadata key {key:?}"))?.to_string(),
                );
            }
            Array::String(out)
        }
        ValueType::Array => {
            let mut out = Vec::with_capacity(n);
            for _ in 0..n {
                out.push(read_array(cur, key, depth + 1)?);
            }
            Array::Array(out)
        }
    })
}

/// Reads `n` fixed-size little-endian values in one bounds check.
fn fixed<T, const N: usize>(
    cur: &mut Cursor<'_>,
    n: usize,
    decode: fn([u8; N]) -> T,
) -> super::cursor::ShortResult<Vec<T>> {
    // `n` was checked against the remaining bytes with `N` bytes per item, so
    // the product cannot overflow; saturate anyway to let `take` report it.
    let bytes = cur.take(n.saturating_mul(N))?;
    Ok(bytes
        .chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            decode(a)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le(parts: &[&[u8]]) -> Vec<u8> {
        parts.concat()
    }

    #[test]
    fn reads_nested_arrays() {
        // array of 2 arrays: [u16; 1] and [string; 1]
        let bytes = le(&[
            &9u32.to_le_bytes(),
            &2u64.to_le_bytes(),
            &2u32.to_le_bytes(),
            &1u64.to_le_bytes(),
            &7u16.to_le_bytes(),
            &8u32.to_le_bytes(),
            &1u64.to_le_bytes(),
            &2u64.to_le_bytes(),
            b"hi",
        ]);
        let v = read_value(&mut Cursor::new(&bytes), ValueType::Array, "k").unwrap();
        assert_eq!(
            v,
            Value::from(vec![Array::U16(vec![7]), Array::String(vec!["hi".into()])])
        );
    }

    #[test]
    fn rejects_deep_nesting_without_recursing_further() {
        let mut bytes = Vec::new();
        for _ in 0..MAX_ARRAY_DEPTH + 1 {
            bytes.extend(9u32.to_le_bytes());
            bytes.extend(1u64.to_le_bytes());
        }
        bytes.extend([0u8; 64]);
        let err = read_value(&mut Cursor::new(&bytes), ValueType::Array, "deep").unwrap_err();
        assert!(matches!(err, GgufError::NestingTooDeep { .. }), "{err}");
    }

    #[test]
    fn rejects_bad_bool_and_utf8() {
        let err = read_value(&mut Cursor::new(&[2]), ValueType::Bool, "b").unwrap_err();
        assert!(err.to_string().contains("\"b\""), "{err}");
        let bytes = le(&[&2u64.to_le_bytes(), &[0xff, 0xfe]]);
        let err = read_value(&mut Cursor::new(&bytes), ValueType::String, "s").unwrap_err();
        assert!(matches!(err, GgufError::InvalidUtf8 { .. }), "{err}");
    }
}
