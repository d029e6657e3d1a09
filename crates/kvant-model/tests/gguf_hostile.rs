//! Hostile GGUF files: every truncation, oversized counts and lengths, bad
//! type ids, bad dimensions, offsets and alignments. Each must give a clear
//! error (naming the key or tensor where there is one), never a panic or a
//! count-sized allocation; the last test reruns this file under a small
//! address-space limit to prove the second part.

mod hostile;

use kvant_core::{DType, Storage};
use kvant_model::gguf::{Array, GgufError, GgufFile, GgufWriter, Value, MAX_ARRAY_DEPTH};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::PathBuf;

fn parse(bytes: &[u8]) -> Result<GgufFile, GgufError> {
    GgufFile::from_storage(Storage::Owned(bytes.to_vec().into()))
}

/// A small valid file with one field of each kind the cases below corrupt.
fn base() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add("general.architecture", "llama").unwrap();
    w.add("str", "hello").unwrap();
    w.add("arr", vec![1u32, 2, 3]).unwrap();
    w.add("nest", vec![Array::from(vec![1u8]), Array::from(vec![2u8])])
        .unwrap();
    w.add("flag", true).unwrap();
    w.add("strs", vec!["x", "yz"]).unwrap();
    w.add_tensor("a", DType::F32, &[2, 3], vec![1u8; 24])
        .unwrap();
    w.add_tensor("b", DType::Q4_0, &[1, 32], vec![2u8; 18])
        .unwrap();
    w.to_bytes().unwrap()
}

/// Offset just past the length-prefixed string `s` (a key or tensor name).
fn after(bytes: &[u8], s: &str) -> usize {
    let mut needle = (s.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(s.as_bytes());
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap();
    at + needle.len()
}

fn put_u32(bytes: &mut [u8], at: usize, v: u32) {
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// The base file with the byte(s) at `delta` from the end of string `key`
/// overwritten.
fn set_u8(key: &str, delta: isize, v: u8) -> Vec<u8> {
    let mut b = base();
    let at = after(&b, key).checked_add_signed(delta).unwrap();
    b[at] = v;
    b
}

fn set_u32(key: &str, delta: isize, v: u32) -> Vec<u8> {
    let mut b = base();
    let at = after(&b, key).checked_add_signed(delta).unwrap();
    put_u32(&mut b, at, v);
    b
}

fn set_u64(key: &str, delta: isize, v: u64) -> Vec<u8> {
    let mut b = base();
    let at = after(&b, key).checked_add_signed(delta).unwrap();
    put_u64(&mut b, at, v);
    b
}

fn patched(f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut b = base();
    f(&mut b);
    b
}

/// Parses `bytes`, expects an error whose message contains every `needle`.
#[track_caller]
fn expect_err(bytes: &[u8], needles: &[&str]) -> GgufError {
    hostile::err_naming(
        parse(bytes),
        |g| format!("parsed a hostile file: {g:?}"),
        needles,
    )
}

#[test]
fn base_file_is_valid() {
    let g = parse(&base()).unwrap();
    assert_eq!(g.tensor_infos().len(), 2);
    assert_eq!(g.get_str("str").unwrap(), Some("hello"));
}

#[test]
fn every_truncation_is_an_error() {
    for bytes in [base(), std::fs::read(fixture()).unwrap()] {
        // Only the padding after the last tensor may be cut.
        let g = parse(&bytes).unwrap();
        let end = g
            .tensor_infos()
            .iter()
            .map(|t| g.data_offset() + t.offset + t.byte_len)
            .max()
            .unwrap();
        for len in 0..bytes.len() {
            assert_eq!(
                parse(&bytes[..len]).is_ok(),
                len >= end,
                "prefix of {len} bytes"
            );
        }
    }
}

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf/all_types.gguf")
}

#[test]
fn bad_magic_and_versions() {
    let err = expect_err(&patched(|b| b[0] = b'X'), &["magic"]);
    assert!(matches!(err, GgufError::BadMagic { .. }));
    expect_err(b"", &["magic"]);
    expect_err(b"GGUF", &["version"]);
    for v in [0u32, 1, 4, 0xffff_ffff] {
        let err = expect_err(&patched(|b| put_u32(b, 4, v)), &["version"]);
        assert!(
            matches!(err, GgufError::UnsupportedVersion { version } if version == v),
            "{err}"
        );
    }
    for v in [2u32, 3] {
        let err = expect_err(&patched(|b| put_u32(b, 4, v.swap_bytes())), &["big-endian"]);
        assert!(matches!(err, GgufError::BigEndian { .. }));
    }
    // Version 2 has the same layout as 3.
    assert_eq!(parse(&patched(|b| put_u32(b, 4, 2))).unwrap().version(), 2);
}

#[test]
fn huge_counts_are_rejected_before_allocating() {
    for huge in [u64::MAX, 1 << 40, 1 << 33, 100_000] {
        let err = expect_err(&patched(|b| put_u64(b, 8, huge)), &["tensor count"]);
        assert!(matches!(err, GgufError::CountTooLarge { .. }), "{err}");
        let err = expect_err(&patched(|b| put_u64(b, 16, huge)), &["metadata count"]);
        assert!(matches!(err, GgufError::CountTooLarge { .. }), "{err}");
        let err = expect_err(&set_u64("str", 4, huge), &["\"str\""]);
        assert!(matches!(err, GgufError::CountTooLarge { .. }), "{err}");
        let err = expect_err(&set_u64("arr", 8, huge), &["\"arr\""]);
        assert!(matches!(err, GgufError::CountTooLarge { .. }), "{err}");
        let err = expect_err(&set_u64("nest", 8, huge), &["\"nest\""]);
        assert!(matches!(err, GgufError::CountTooLarge { .. }), "{err}");
        let err = expect_err(&set_u64("nest", 20, huge), &["\"nest\""]);
        assert!(matches!(err, GgufError::CountTooLarge { .. }), "{err}");
        let err = expect_err(&set_u64("strs", 16, huge), &["\"strs\""]);
        assert!(matches!(err, GgufError::CountTooLarge { .. }), "{err}");
        // A key length and a tensor-name length.
        let err = expect_err(&set_u64("flag", -12, huge), &["metadata entry"]);
        assert!(matches!(err, GgufError::CountTooLarge { .. }), "{err}");
        let err = expect_err(&set_u64("b", -9, huge), &["tensor info 1"]);
        assert!(matches!(err, GgufError::CountTooLarge { .. }), "{err}");
    }
    // A string just one byte longer than what is left.
    let err = expect_err(
        &patched(|b| {
            let at = after(b, "str") + 4;
            let left = b.len() - at - 8;
            put_u64(b, at, left as u64 + 1);
        }),
        &["\"str\""],
    );
    assert!(matches!(err, GgufError::CountTooLarge { .. }), "{err}");
}

#[test]
fn bad_value_types_bools_and_utf8() {
    for id in [13u32, 99, u32::MAX] {
        let err = expect_err(&set_u32("flag", 0, id), &["\"flag\"", &id.to_string()]);
        assert!(matches!(err, GgufError::UnknownValueType { .. }));
        let err = expect_err(&set_u32("arr", 4, id), &["\"arr\""]);
        assert!(matches!(err, GgufError::UnknownValueType { .. }));
    }
    let err = expect_err(&set_u8("flag", 4, 2), &["\"flag\"", "bool"]);
    assert!(matches!(err, GgufError::InvalidBool { byte: 2, .. }));
    let err = expect_err(&set_u8("str", 12, 0xff), &["\"str\"", "UTF-8"]);
    assert!(matches!(err, GgufError::InvalidUtf8 { .. }));
    let err = expect_err(&set_u8("flag", -1, 0xc3), &["metadata entry", "UTF-8"]);
    assert!(matches!(err, GgufError::InvalidUtf8 { .. }));
    // Changing a u32 array to u64 elements makes it run past its bytes into
    // the next entry; whatever follows must still fail cleanly.
    expect_err(&set_u32("arr", 4, 10), &[]);
}

#[test]
fn deep_nesting_is_bounded() {
    // MAX_ARRAY_DEPTH + 1 nested array headers, each holding one element.
    let mut w = GgufWriter::new();
    w.add("deep", Value::Array(Array::U8(vec![]))).unwrap();
    let mut b = w.to_bytes().unwrap();
    let at = after(&b, "deep") + 4;
    let mut nested = Vec::new();
    for _ in 0..MAX_ARRAY_DEPTH + 1 {
        nested.extend(9u32.to_le_bytes());
        nested.extend(1u64.to_le_bytes());
    }
    nested.extend(0u32.to_le_bytes());
    nested.extend(0u64.to_le_bytes());
    b.splice(at..at + 12, nested);
    let err = expect_err(&b, &["\"deep\"", "nested"]);
    assert!(matches!(err, GgufError::NestingTooDeep { .. }));
}

#[test]
fn duplicate_keys_and_tensors() {
    let err = expect_err(
        &patched(|b| {
            let at = after(b, "str") - 3;
            b[at..at + 3].copy_from_slice(b"arr");
        }),
        &["\"arr\"", "twice"],
    );
    assert!(matches!(err, GgufError::DuplicateKey { .. }));
    let err = expect_err(&set_u8("b", -1, b'a'), &["\"a\"", "twice"]);
    assert!(matches!(err, GgufError::DuplicateTensor { .. }));
}

#[test]
fn bad_tensor_infos() {
    // Tensor "a" F32 [2, 3]: after its name come n_dims (+0), the dims
    // innermost first (+4: 3, +12: 2), the type id (+20) and the offset (+24).
    for n in [5u32, 64, u32::MAX] {
        let err = expect_err(&set_u32("a", 0, n), &["\"a\"", "dimensions"]);
        assert!(matches!(err, GgufError::TooManyDims { .. }));
    }
    for id in [4u32, 5, 9, 31, 1000, u32::MAX] {
        let err = expect_err(&set_u32("a", 20, id), &["\"a\"", &id.to_string()]);
        assert!(matches!(err, GgufError::UnknownGgmlType { .. }));
    }
    for (inner, outer) in [(1u64 << 40, 1u64 << 40), (u64::MAX, 2), (3, u64::MAX / 2)] {
        let err = expect_err(
            &patched(|b| {
                let at = after(b, "a") + 4;
                put_u64(b, at, inner);
                put_u64(b, at + 8, outer);
            }),
            &["\"a\""],
        );
        assert!(matches!(err, GgufError::BadShape { .. }), "{err}");
    }
    // A plausible shape whose bytes run past the end of the file.
    let err = expect_err(&set_u64("a", 12, 1 << 20), &["\"a\"", "outside"]);
    assert!(matches!(err, GgufError::TensorOutOfBounds { .. }));
    // A quantized row that is not whole blocks.
    let err = expect_err(&set_u64("b", 4, 16), &["\"b\"", "block"]);
    assert!(matches!(err, GgufError::BadShape { .. }));
    for off in [u64::MAX - 31, 1 << 40, 4096] {
        let err = expect_err(&set_u64("a", 24, off), &["\"a\"", "outside"]);
        assert!(matches!(err, GgufError::TensorOutOfBounds { .. }), "{err}");
    }
    let err = expect_err(&set_u64("a", 24, 4), &["\"a\"", "alignment"]);
    assert!(matches!(err, GgufError::MisalignedTensor { .. }));
}

#[test]
fn bad_alignments() {
    // Written under a neighbouring key (the writer refuses bad alignments),
    // then renamed in place.
    let with_alignment = |v: Value| {
        let mut w = GgufWriter::new();
        w.add("general.alignmenX", v).unwrap();
        w.add_tensor("a", DType::F32, &[8], vec![0u8; 32]).unwrap();
        let mut b = w.to_bytes().unwrap();
        let at = after(&b, "general.alignmenX") - 1;
        b[at] = b't';
        b
    };
    assert!(parse(&with_alignment(Value::U32(32))).is_ok());
    for v in [
        Value::U32(0),
        Value::U32(3),
        Value::U32(48),
        Value::U64(1 << 40),
        Value::I32(-32),
    ] {
        let err = expect_err(&with_alignment(v.clone()), &["general.alignment"]);
        assert!(
            matches!(err, GgufError::BadAlignment { .. }),
            "{v:?}: {err}"
        );
    }
    let err = expect_err(
        &with_alignment(Value::String("32".into())),
        &["general.alignment"],
    );
    assert!(matches!(err, GgufError::WrongType { .. }));
}

/// Touches everything a loader would read, so hidden panics surface.
fn touch_everything(g: &GgufFile) {
    let _ = g.architecture();
    for (k, v) in g.metadata() {
        let _ = (
            g.get_u64(k),
            g.get_u32(k),
            g.get_usize(k),
            g.get_i64(k),
            g.get_f32(k),
        );
        let _ = (
            g.get_bool(k),
            g.get_str(k),
            g.get_str_array(k),
            g.get_f32_array(k),
            g.get_i32_array(k),
        );
        // Identity, not equality: a corrupted f32 may be NaN.
        assert!(g.get(k).is_some_and(|got| std::ptr::eq(got, v)), "{k}");
    }
    for info in g.tensor_infos() {
        let t = g.tensor(&info.name).unwrap();
        assert_eq!(t.byte_len(), info.byte_len);
        assert_eq!(t.shape(), &info.shape[..]);
    }
}

#[test]
fn random_corruptions_never_panic() {
    let mut rng = ChaCha8Rng::seed_from_u64(1234);
    let originals = [base(), std::fs::read(fixture()).unwrap()];
    let interesting = [
        0u64,
        1,
        2,
        3,
        31,
        32,
        255,
        u32::MAX as u64,
        1 << 32,
        1 << 62,
        u64::MAX,
    ];
    let mut parsed = 0;
    for i in 0..4000 {
        let mut b = originals[i % 2].clone();
        for _ in 0..rng.random_range(1..4) {
            if b.is_empty() {
                break;
            }
            let at = rng.random_range(0..b.len());
            match rng.random_range(0..3) {
                0 => b[at] = rng.random(),
                1 if at + 8 <= b.len() => put_u64(
                    &mut b,
                    at,
                    interesting[rng.random_range(0..interesting.len())],
                ),
                _ => b.truncate(at),
            }
        }
        if let Ok(g) = parse(&b) {
            touch_everything(&g);
            parsed += 1;
        }
    }
    // Some corruptions hit only tensor data or values, so both outcomes occur.
    assert!(parsed > 0 && parsed < 4000, "parsed {parsed}");
}

/// Address-space limit for the rerun: far above what parsing kilobyte files
/// needs (test threads, stacks and allocator arenas included), far below
/// what any count-sized allocation from the cases above would ask for.
const ULIMIT_KIB: u64 = 1 << 20;

#[test]
fn hostile_cases_run_under_a_small_address_space_limit() {
    hostile::rerun_under_address_limit(ULIMIT_KIB);
}

/// A hostile layer count in any architecture's metadata is a config error
/// naming the key, before anything is built per layer (a `block_count` of
/// 2^64 - 1 once made a per-layer list of that length: "capacity
/// overflow"). Every fixture GGUF, and every config.json.
#[test]
fn hostile_layer_counts_are_config_errors() {
    use kvant_model::config::ModelConfig;
    let models = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models");
    let mut ggufs = 0;
    for entry in std::fs::read_dir(models.join("gguf")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "gguf") {
            continue;
        }
        let g = GgufFile::open(&path).unwrap();
        let Some(arch) = g
            .get_str("general.architecture")
            .unwrap()
            .map(str::to_string)
        else {
            continue;
        };
        let key = format!("{arch}.block_count");
        for n in [u64::MAX, 1 << 40] {
            let mut w = GgufWriter::new();
            for (k, v) in g.metadata() {
                match k == key {
                    true => w.add(k, Value::U64(n)).unwrap(),
                    false => w.add(k, v.clone()).unwrap(),
                }
            }
            let bent = parse(&w.to_bytes().unwrap()).unwrap();
            let err = ModelConfig::from_gguf(&bent).expect_err(&key).to_string();
            assert!(err.contains(&key), "{}: {err}", path.display());
        }
        ggufs += 1;
    }
    assert!(ggufs >= 10, "{ggufs} fixture GGUFs");
    let mut dirs = 0;
    for entry in std::fs::read_dir(&models).unwrap() {
        let config = entry.unwrap().path().join("config.json");
        let Ok(text) = std::fs::read_to_string(&config) else {
            continue;
        };
        let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
        let target = match cfg.get_mut("text_config") {
            Some(t) if t.get("num_hidden_layers").is_some() => t,
            _ => &mut cfg,
        };
        if target.get("num_hidden_layers").is_none() {
            continue;
        }
        target["num_hidden_layers"] = serde_json::json!(u64::MAX);
        let err = ModelConfig::from_hf_json(&cfg)
            .expect_err("num_hidden_layers")
            .to_string();
        assert!(
            err.contains("num_hidden_layers"),
            "{}: {err}",
            config.display()
        );
        dirs += 1;
    }
    assert!(dirs >= 10, "{dirs} fixture configs");
}
