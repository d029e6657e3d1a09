//! Arbitrary bytes into the safetensors reader. A file that opens must give
//! a view (or a clear unsupported-dtype error) for every tensor it lists.
#![no_main]

use kvant_core::Storage;
use kvant_model::hf::{HfError, SafetensorsFile};
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let storage = Storage::Owned(data.into());
    let Ok(f) = SafetensorsFile::from_storage(storage, Path::new("fuzz.safetensors")) else {
        return;
    };
    for name in f.names() {
        match f.tensor(name) {
            Ok(t) => std::hint::black_box(t.bytes().iter().fold(0u8, |a, &b| a ^ b)),
            Err(HfError::UnsupportedDtype { .. }) => 0,
            Err(e) => panic!("listed tensor {name:?} does not open: {e}"),
        };
    }
});
