//! Arbitrary bytes into the GGUF reader. A file that parses must have every
//! accessor and tensor view work, and must survive a rewrite by GgufWriter
//! unchanged (write, parse, write again gives the same bytes).
#![no_main]

use kvant_core::Storage;
use kvant_model::gguf::{GgufFile, GgufWriter};
use libfuzzer_sys::fuzz_target;

fn parse(bytes: &[u8]) -> Option<GgufFile> {
    GgufFile::from_storage(Storage::Owned(bytes.into())).ok()
}

/// The writer refuses some files the reader accepts (e.g. long tensor
/// names), so `None` there is fine.
fn rewrite(g: &GgufFile) -> Option<Vec<u8>> {
    let mut w = GgufWriter::new();
    w.set_version(g.version()).ok()?;
    for (k, v) in g.metadata() {
        w.add(k, v.clone()).ok()?;
    }
    let tensors: Vec<_> = g.tensor_infos().iter().map(|i| g.tensor(&i.name)).collect();
    for (info, t) in g.tensor_infos().iter().zip(&tensors) {
        let t = t.as_ref().ok()?;
        w.add_tensor(info.name.clone(), info.dtype, &info.shape, t.bytes())
            .ok()?;
    }
    w.to_bytes().ok()
}

fuzz_target!(|data: &[u8]| {
    let Some(g) = parse(data) else { return };
    let _ = (
        g.architecture(),
        g.version(),
        g.file_size(),
        g.alignment(),
        g.data_offset(),
    );
    for (k, v) in g.metadata() {
        assert!(g.get(k).is_some_and(|got| std::ptr::eq(got, v)));
        let _ = (
            g.get_u64(k),
            g.get_u32(k),
            g.get_usize(k),
            g.get_i64(k),
            g.get_f32(k),
        );
        let _ = (g.get_bool(k), g.get_str(k), g.get_str_array(k));
        let _ = (g.get_f32_array(k), g.get_i32_array(k));
    }
    for info in g.tensor_infos() {
        let t = g.tensor(&info.name).expect("a validated tensor opens");
        assert_eq!(t.byte_len(), info.byte_len);
        assert_eq!(t.shape(), &info.shape[..]);
        std::hint::black_box(t.bytes().iter().fold(0u8, |a, &b| a ^ b));
    }
    if let Some(first) = rewrite(&g) {
        let again = parse(&first).expect("writer output parses");
        assert_eq!(rewrite(&again).as_deref(), Some(&first[..]));
    }
});
