//! Safetensors files: files written by the reference implementation read back
//! as zero-copy views, and hostile headers (truncation, lengths, offsets,
//! sizes, dtypes, JSON) give clear errors, never a panic or a large
//! allocation (the last test reruns this file under an address-space limit).

mod hostile;

use kvant_core::{DType, Storage};
use kvant_model::hf::{HfError, SafetensorsFile};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::tensor::{serialize, TensorView};
use safetensors::Dtype;
use std::path::Path;

fn open(bytes: &[u8]) -> Result<SafetensorsFile, HfError> {
    SafetensorsFile::from_storage(
        Storage::Owned(bytes.to_vec().into()),
        Path::new("mem.safetensors"),
    )
}

type Spec = (&'static str, Dtype, Vec<usize>, Vec<u8>);

fn random_specs(rng: &mut ChaCha8Rng) -> Vec<Spec> {
    let mut bytes = |n: usize| (0..n).map(|_| rng.random()).collect::<Vec<u8>>();
    vec![
        (
            "model.embed_tokens.weight",
            Dtype::BF16,
            vec![7, 5],
            bytes(70),
        ),
        ("model.norm.weight", Dtype::F32, vec![13], bytes(52)),
        ("lm_head.weight", Dtype::F16, vec![3, 1, 9], bytes(54)),
        ("scalar", Dtype::F32, vec![], bytes(4)),
        ("empty", Dtype::F16, vec![0, 3], bytes(0)),
        ("position_ids", Dtype::I64, vec![1, 3], bytes(24)),
        ("mask", Dtype::U8, vec![5], bytes(5)),
    ]
}

fn write(specs: &[Spec]) -> Vec<u8> {
    let views: Vec<(&str, TensorView<'_>)> = specs
        .iter()
        .map(|(n, d, s, b)| (*n, TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    serialize(views, None).unwrap()
}

/// A file with a hand-written header (padded as the reference writer pads).
fn raw(header: &str, data: &[u8]) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend_from_slice(data);
    out
}

#[track_caller]
fn expect_err(bytes: &[u8], needles: &[&str]) -> HfError {
    let opened = |f: SafetensorsFile| {
        let names: Vec<_> = f.names().collect();
        format!("opened a hostile file with {names:?}")
    };
    hostile::err_naming(open(bytes), opened, needles)
}

#[test]
fn reference_files_read_back_as_views() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let specs = random_specs(&mut rng);
    let storage = Storage::Owned(write(&specs).into());
    let range = storage.as_bytes().as_ptr_range();
    let f = SafetensorsFile::from_storage(storage, Path::new("m.safetensors")).unwrap();
    let mut names: Vec<&str> = specs.iter().map(|s| s.0).collect();
    names.sort();
    assert_eq!(f.names().collect::<Vec<_>>(), names);
    for (name, dtype, shape, bytes) in &specs {
        let kvant = match dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => {
                let err = f.tensor(name).unwrap_err();
                let msg = format!("unsupported safetensors dtype {other:?} for tensor \"{name}\"");
                assert!(err.to_string().starts_with(&msg), "{err}");
                continue;
            }
        };
        let t = f.tensor(name).unwrap();
        assert_eq!(
            (t.dtype(), t.shape(), t.bytes()),
            (kvant, &shape[..], &bytes[..]),
            "{name}"
        );
        if !bytes.is_empty() {
            assert!(range.contains(&t.bytes().as_ptr()), "{name} was copied");
        }
    }
    assert!(matches!(
        f.tensor("absent"),
        Err(HfError::MissingTensor { .. })
    ));
}

#[test]
fn every_truncation_is_an_error() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let specs: Vec<Spec> = random_specs(&mut rng)
        .into_iter()
        .filter(|s| !s.3.is_empty())
        .collect();
    let bytes = write(&specs);
    for len in 0..bytes.len() {
        assert!(open(&bytes[..len]).is_err(), "prefix of {len} bytes opened");
    }
    assert!(open(&bytes).is_ok());
}

#[test]
fn header_length_and_json() {
    expect_err(&[1, 2, 3], &["too short"]);
    for len in [u64::MAX, 1 << 40, 200_000_000, 17] {
        let mut b = raw("{}", &[0; 8]);
        b[..8].copy_from_slice(&len.to_le_bytes());
        let err = expect_err(&b, &["header claims"]);
        assert!(matches!(err, HfError::HeaderTooLong { .. }), "{err}");
    }
    for bad in ["", "{", "[]", "null", "{\"a\":}", "\u{0}"] {
        let err = expect_err(&raw(bad, &[]), &["mem.safetensors"]);
        assert!(matches!(err, HfError::BadHeader { .. }), "{bad:?}: {err}");
    }
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    expect_err(&raw(&format!("{{\"x\": {deep}}}"), &[]), &[]);
    for meta in [
        r#"{"__metadata__": 3}"#,
        r#"{"__metadata__": {}, "__metadata__": {}}"#,
    ] {
        let err = expect_err(&raw(meta, &[]), &["__metadata__"]);
        assert!(matches!(err, HfError::BadHeader { .. }));
    }
    assert!(open(&raw(r#"{"__metadata__": {"format": "pt"}}"#, &[]))
        .unwrap()
        .names()
        .next()
        .is_none());
}

#[test]
fn bad_entries() {
    let entry = |body: &str| raw(&format!("{{\"w\": {body}}}"), &[0u8; 16]);
    let bad_entries = [
        "3",
        "{}",
        r#"{"dtype": "F32", "shape": [4]}"#,
        r#"{"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}"#,
        r#"{"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}"#,
        r#"{"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}"#,
        r#"{"dtype": 32, "shape": [1], "data_offsets": [0, 4]}"#,
        r#"{"dtype": "F32", "shape": [18446744073709551615, 18446744073709551615, 16], "data_offsets": [0, 4]}"#,
        r#"{"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}"#,
    ];
    for body in bad_entries {
        let err = expect_err(&entry(body), &["\"w\""]);
        assert!(matches!(err, HfError::BadEntry { .. }), "{body}: {err}");
    }
    for dtype in ["F33", "f32", "", "Q4_0"] {
        let body = format!(r#"{{"dtype": "{dtype}", "shape": [1], "data_offsets": [0, 4]}}"#);
        let err = expect_err(&entry(&body), &["\"w\"", &format!("{dtype:?}")]);
        assert!(matches!(err, HfError::UnknownDtype { .. }), "{err}");
    }
    for (begin, end) in [
        (8u64, 4u64),
        (0, 17),
        (16, 20),
        (u64::MAX - 3, u64::MAX),
        (0, u64::MAX),
    ] {
        let body = format!(r#"{{"dtype": "F32", "shape": [1], "data_offsets": [{begin}, {end}]}}"#);
        let err = expect_err(&entry(&body), &["\"w\"", "data_offsets"]);
        assert!(matches!(err, HfError::OffsetsOutOfRange { .. }), "{err}");
    }
    for (shape, end) in [
        ("[2, 2]", 12),
        ("[3]", 16),
        ("[]", 0),
        ("[9223372036854775808, 4]", 16),
    ] {
        let body = format!(r#"{{"dtype": "F32", "shape": {shape}, "data_offsets": [0, {end}]}}"#);
        let err = expect_err(&entry(&body), &["\"w\"", "needs"]);
        assert!(
            matches!(err, HfError::SizeMismatch { .. }),
            "{shape}: {err}"
        );
    }
    let twice = r#"{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                    "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}"#;
    let err = expect_err(&raw(twice, &[0u8; 2]), &["\"w\"", "twice"]);
    assert!(matches!(err, HfError::BadEntry { .. }));
}

#[test]
fn random_corruptions_never_panic() {
    let mut rng = ChaCha8Rng::seed_from_u64(99);
    let original = write(&random_specs(&mut ChaCha8Rng::seed_from_u64(5)));
    let mut opened = 0;
    for _ in 0..3000 {
        let mut b = original.clone();
        let at = rng.random_range(0..b.len());
        match rng.random_range(0..4) {
            0 => b[at] = rng.random(),
            1 => b[at] = b"0123456789[]{},\":-."[rng.random_range(0..19)],
            2 => b.truncate(at),
            _ => b[at..].iter_mut().take(3).for_each(|x| *x = b'9'),
        }
        if let Ok(f) = open(&b) {
            opened += 1;
            for name in f.names() {
                if let Ok(t) = f.tensor(name) {
                    assert_eq!(t.bytes().len(), t.byte_len());
                }
            }
        }
    }
    assert!(opened > 0 && opened < 3000, "opened {opened}");
}

/// Address-space limit for the rerun: far above what these kilobyte files
/// need, far below any allocation sized by a hostile header field.
const ULIMIT_KIB: u64 = 1 << 20;

#[test]
fn hostile_cases_run_under_a_small_address_space_limit() {
    hostile::rerun_under_address_limit(ULIMIT_KIB);
}
