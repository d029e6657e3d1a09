//! GGUF metadata values.
//!
//! Arrays are stored as typed vectors rather than `Vec<Value>`: a vocabulary
//! of 49 152 tokens is one `Vec<String>`, and score or token-type arrays are
//! plain `Vec<f32>` / `Vec<i32>` that accessors can lend out without copying.

use std::fmt;

/// The value type ids written before every metadata value (`gguf_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    pub const ALL: [ValueType; 13] = [
        ValueType::U8,
        ValueType::I8,
        ValueType::U16,
        ValueType::I16,
        ValueType::U32,
        ValueType::I32,
        ValueType::F32,
        ValueType::Bool,
        ValueType::String,
        ValueType::Array,
        ValueType::U64,
        ValueType::I64,
        ValueType::F64,
    ];

    /// The id stored in the file.
    pub fn id(self) -> u32 {
        match self {
            ValueType::U8 => 0,
            ValueType::I8 => 1,
            ValueType::U16 => 2,
            ValueType::I16 => 3,
            ValueType::U32 => 4,
            ValueType::I32 => 5,
            ValueType::F32 => 6,
            ValueType::Bool => 7,
            ValueType::String => 8,
            ValueType::Array => 9,
            ValueType::U64 => 10,
            ValueType::I64 => 11,
            ValueType::F64 => 12,
        }
    }

    pub fn from_id(id: u32) -> Option<ValueType> {
        ValueType::ALL.into_iter().find(|t| t.id() == id)
    }

    pub fn name(self) -> &'static str {
        match self {
            ValueType::U8 => "u8",
            ValueType::I8 => "i8",
            ValueType::U16 => "u16",
            ValueType::I16 => "i16",
            ValueType::U32 => "u32",
            ValueType::I32 => "i32",
            ValueType::F32 => "f32",
            ValueType::Bool => "bool",
            ValueType::String => "string",
            ValueType::Array => "array",
            ValueType::U64 => "u64",
            ValueType::I64 => "i64",
            ValueType::F64 => "f64",
        }
    }

    /// The fewest bytes one value of this type occupies in a file: the exact
    /// size for scalars, the length prefix for strings, and element type plus
    /// count for arrays. Counts read from a header are checked against this
    /// before anything is allocated.
    pub fn min_encoded_len(self) -> usize {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => 1,
            ValueType::U16 | ValueType::I16 => 2,
            ValueType::U32 | ValueType::I32 | ValueType::F32 => 4,
            ValueType::U64 | ValueType::I64 | ValueType::F64 | ValueType::String => 8,
            ValueType::Array => 4 + 8,
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A homogeneous metadata array. Nested arrays may differ in element type
/// from one another, as the format allows.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// The value of any integer type, widened so that no width or sign is
    /// lost: converters disagree on whether a count is u32, i32 or u64.
    pub fn as_integer(&self) -> Option<i128> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::I8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::U64(v) => Some(v.into()),
            Value::I64(v) => Some(v.into()),
            _ => None,
        }
    }

    /// A short description for error messages, e.g. `array of string`.
    pub fn type_description(&self) -> String {
        match self {
            Value::Array(a) => a.type_description(),
            other => other.value_type().name().to_string(),
        }
    }

    /// Array nesting depth: 0 for scalars, 1 for a flat array.
    pub fn depth(&self) -> usize {
        match self {
            Value::Array(a) => a.depth(),
            _ => 0,
        }
    }
}

impl Array {
    pub fn element_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements of an integer array, widened (see [`Value::as_integer`]);
    /// `None` for arrays of any other type.
    pub fn integers(&self) -> Option<Vec<i128>> {
        fn widen<T: Copy + Into<i128>>(v: &[T]) -> Option<Vec<i128>> {
            Some(v.iter().map(|&x| x.into()).collect())
        }
        match self {
            Array::U8(v) => widen(v),
            Array::I8(v) => widen(v),
            Array::U16(v) => widen(v),
            Array::I16(v) => widen(v),
            Array::U32(v) => widen(v),
            Array::I32(v) => widen(v),
            Array::U64(v) => widen(v),
            Array::I64(v) => widen(v),
            _ => None,
        }
    }

    pub fn type_description(&self) -> String {
        match self {
            Array::Array(inner) => match inner.first() {
                Some(first) => format!("array of {}", first.type_description()),
                None => "array of array".to_string(),
            },
            other => format!("array of {}", other.element_type()),
        }
    }

    pub fn depth(&self) -> usize {
        match self {
            Array::Array(inner) => 1 + inner.iter().map(Array::depth).max().unwrap_or(1),
            _ => 1,
        }
    }
}

macro_rules! value_from {
    ($($t:ty => $variant:ident),* $(,)?) => {$(
        impl From<$t> for Value {
            fn from(v: $t) -> Value {
                Value::$variant(v)
            }
        }
        impl From<Vec<$t>> for Array {
            fn from(v: Vec<$t>) -> Array {
                Array::$variant(v)
            }
        }
        impl From<Vec<$t>> for Value {
            fn from(v: Vec<$t>) -> Value {
                Value::Array(Array::$variant(v))
            }
        }
    )*};
}

value_from!(
    u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, String => String, u64 => U64, i64 => I64, f64 => F64,
);

impl From<&str> for Value {
    fn from(v: &str) -> Value {
        Value::String(v.to_string())
    }
}

impl From<Vec<&str>> for Value {
    fn from(v: Vec<&str>) -> Value {
        Value::Array(Array::String(v.into_iter().map(str::to_string).collect()))
    }
}

impl From<Array> for Value {
    fn from(v: Array) -> Value {
        Value::Array(v)
    }
}

impl From<Vec<Array>> for Value {
    fn from(v: Vec<Array>) -> Value {
        Value::Array(Array::Array(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_ids_round_trip_and_match_gguf_h() {
        for (i, t) in ValueType::ALL.into_iter().enumerate() {
            assert_eq!(t.id() as usize, i, "{t}");
            assert_eq!(ValueType::from_id(t.id()), Some(t));
        }
        assert_eq!(ValueType::from_id(13), None);
    }

    #[test]
    fn integers_widen_without_loss() {
        assert_eq!(Value::U64(u64::MAX).as_integer(), Some(u64::MAX.into()));
        assert_eq!(Value::I8(-3).as_integer(), Some(-3));
        assert_eq!(Value::F32(1.0).as_integer(), None);
        assert_eq!(Array::I16(vec![-1, 2]).integers(), Some(vec![-1, 2]));
        assert_eq!(Array::String(vec![]).integers(), None);
    }

    #[test]
    fn depth_and_description_of_nested_arrays() {
        let nested = Value::from(vec![Array::from(vec![1u8]), Array::from(vec![2u8])]);
        assert_eq!(nested.depth(), 2);
        assert_eq!(nested.type_description(), "array of array of u8");
        let deeper = Value::from(vec![Array::from(vec![1u8]), Array::Array(vec![])]);
        assert_eq!(deeper.depth(), 3);
        assert_eq!(Value::from(3u32).depth(), 0);
    }
}
