//! Typed metadata accessors.
//!
//! Real files disagree on integer widths (a head count may be u32, i32 or
//! u64 depending on the converter), so integer accessors accept any integer
//! type whose value fits the target, and float accessors accept f32 or f64.
//! Absent keys are `Ok(None)`; present keys of the wrong type are errors
//! naming the key, never silently ignored.

use super::error::{GgufError, Result};
use super::file::GgufFile;
use super::value::{Array, Value};
use std::borrow::Cow;

/// The key every model file sets to its architecture name.
pub const ARCHITECTURE_KEY: &str = "general.architecture";

impl GgufFile {
    pub fn get(&self, key: &str) -> Option<&Value> {
        let &i = self.header.key_index.get(key)?;
        self.header.metadata.get(i).map(|(_, v)| v)
    }

    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get_int(key, "u64")
    }

    pub fn get_u32(&self, key: &str) -> Result<Option<u32>> {
        self.get_int(key, "u32")
    }

    pub fn get_usize(&self, key: &str) -> Result<Option<usize>> {
        self.get_int(key, "usize")
    }

    pub fn get_i64(&self, key: &str) -> Result<Option<i64>> {
        self.get_int(key, "i64")
    }

    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(v)) => Ok(Some(*v)),
            Some(Value::F64(v)) => Ok(Some(*v as f32)),
            Some(other) => Err(wrong_type(key, "a float", other.type_description())),
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(v)) => Ok(Some(*v)),
            Some(other) => Err(wrong_type(key, "a bool", other.type_description())),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(v)) => Ok(Some(v)),
            Some(other) => Err(wrong_type(key, "a string", other.type_description())),
        }
    }

    pub fn get_str_array(&self, key: &str) -> Result<Option<&[String]>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(Array::String(v))) => Ok(Some(v)),
            Some(other) => Err(wrong_type(
                key,
                "an array of string",
                other.type_description(),
            )),
        }
    }

    pub fn get_bool_array(&self, key: &str) -> Result<Option<&[bool]>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(Array::Bool(v))) => Ok(Some(v)),
            Some(other) => Err(wrong_type(
                key,
                "an array of bool",
                other.type_description(),
            )),
        }
    }

    /// Borrowed when stored as f32, converted when stored as f64.
    pub fn get_f32_array(&self, key: &str) -> Result<Option<Cow<'_, [f32]>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(Array::F32(v))) => Ok(Some(Cow::Borrowed(v))),
            Some(Value::Array(Array::F64(v))) => {
                Ok(Some(Cow::Owned(v.iter().map(|&x| x as f32).collect())))
            }
            Some(other) => Err(wrong_type(
                key,
                "an array of float",
                other.type_description(),
            )),
        }
    }

    /// Borrowed when stored as i32; other integer arrays are converted, each
    /// element checked to fit.
    pub fn get_i32_array(&self, key: &str) -> Result<Option<Cow<'_, [i32]>>> {
        let array = match self.get(key) {
            None => return Ok(None),
            Some(Value::Array(Array::I32(v))) => return Ok(Some(Cow::Borrowed(v))),
            Some(Value::Array(a)) => a,
            Some(other) => {
                return Err(wrong_type(
                    key,
                    "an array of integer",
                    other.type_description(),
                ))
            }
        };
        let wide = array
            .integers()
            .ok_or_else(|| wrong_type(key, "an array of integer", array.type_description()))?;
        let converted = wide
            .into_iter()
            .enumerate()
            .map(|(i, v)| {
                i32::try_from(v).map_err(|_| GgufError::OutOfRange {
                    key: format!("{key}[{i}]"),
                    value: v.to_string(),
                    target: "i32",
                })
            })
            .collect::<Result<Vec<i32>>>()?;
        Ok(Some(Cow::Owned(converted)))
    }

    /// The `general.architecture` string, which every model file must have.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str(ARCHITECTURE_KEY)?
            .ok_or_else(|| GgufError::MissingKey {
                key: ARCHITECTURE_KEY.to_string(),
            })
    }

    fn get_int<T: TryFrom<i128>>(&self, key: &str, target: &'static str) -> Result<Option<T>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        let wide = value
            .as_integer()
            .ok_or_else(|| wrong_type(key, "an integer", value.type_description()))?;
        T::try_from(wide)
            .map(Some)
            .map_err(|_| GgufError::OutOfRange {
                key: key.to_string(),
                value: wide.to_string(),
                target,
            })
    }
}

fn wrong_type(key: &str, expected: &'static str, found: String) -> GgufError {
    GgufError::WrongType {
        key: key.to_string(),
        expected,
        found,
    }
}
