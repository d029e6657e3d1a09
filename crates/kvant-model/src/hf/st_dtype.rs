//! Safetensors element types.
//!
//! Every type the format defines is known here with its bit width, so the
//! byte range of every tensor can be validated when a file is opened, even
//! tensors kvant cannot compute with (an unused i64 buffer must not stop a
//! model from loading). Only asking for such a tensor is an error.

use kvant_core::DType;

/// A safetensors dtype and its size in bits (sub-byte float formats exist).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StDtype {
    name: &'static str,
    bits: u32,
}

/// Every dtype name of the safetensors format, with its width in bits.
const KNOWN: [(&str, u32); 20] = [
    ("BOOL", 8),
    ("U8", 8),
    ("I8", 8),
    ("F8_E5M2", 8),
    ("F8_E4M3", 8),
    ("F8_E8M0", 8),
    ("I16", 16),
    ("U16", 16),
    ("F16", 16),
    ("BF16", 16),
    ("I32", 32),
    ("U32", 32),
    ("F32", 32),
    ("F64", 64),
    ("I64", 64),
    ("U64", 64),
    ("C64", 64),
    ("F4", 4),
    ("F6_E2M3", 6),
    ("F6_E3M2", 6),
];

impl StDtype {
    pub fn parse(name: &str) -> Option<StDtype> {
        KNOWN
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(name, bits)| StDtype { name, bits })
    }

    pub fn name(self) -> &'static str {
        self.name
    }

    /// Bytes `elements` values occupy, or `None` when they do not fill whole
    /// bytes (possible only for sub-byte types).
    pub fn bytes_for(self, elements: u128) -> Option<u128> {
        let bits = elements.checked_mul(self.bits.into())?;
        (bits % 8 == 0).then_some(bits / 8)
    }

    /// The kvant type, for the float formats kvant computes with.
    pub fn to_dtype(self) -> Option<DType> {
        match self.name {
            "F32" => Some(DType::F32),
            "F16" => Some(DType::F16),
            "BF16" => Some(DType::BF16),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_mapping() {
        let bf16 = StDtype::parse("BF16").unwrap();
        assert_eq!(bf16.to_dtype(), Some(DType::BF16));
        assert_eq!(bf16.bytes_for(3), Some(6));
        let f4 = StDtype::parse("F4").unwrap();
        assert_eq!(f4.bytes_for(3), None);
        assert_eq!(f4.bytes_for(4), Some(2));
        assert_eq!(StDtype::parse("I64").unwrap().to_dtype(), None);
        assert_eq!(StDtype::parse("f32"), None);
        for d in [DType::F32, DType::F16, DType::BF16] {
            let st = StDtype::parse(d.name()).unwrap();
            assert_eq!(st.bytes_for(1), Some(d.block_bytes() as u128));
        }
    }
}
