//! GgufWriter -> GgufFile round trips for every value type and dtype, the
//! typed accessors' tolerance rules, and agreement with the reference writer
//! (gguf-py) through a committed fixture.

mod common;

use kvant_core::{DType, Storage};
use kvant_model::gguf::{
    Array, GgufError, GgufFile, GgufWriter, Value, ValueType, MAX_ARRAY_DEPTH,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::PathBuf;

fn parse(bytes: Vec<u8>) -> GgufFile {
    GgufFile::from_storage(Storage::Owned(bytes.into())).unwrap()
}

fn write(w: &GgufWriter) -> GgufFile {
    parse(w.to_bytes().unwrap())
}

fn fixture_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf/all_types.gguf")
}

/// One value of every type, including nested and empty arrays.
fn every_value(rng: &mut ChaCha8Rng) -> Vec<(String, Value)> {
    let n = rng.random_range(1..40);
    let mut vals: Vec<(&str, Value)> = vec![
        ("u8", Value::U8(rng.random())),
        ("i8", Value::I8(rng.random())),
        ("u16", Value::U16(rng.random())),
        ("i16", Value::I16(rng.random())),
        ("u32", Value::U32(rng.random())),
        ("i32", Value::I32(rng.random())),
        ("f32", Value::F32(rng.random())),
        ("bool", Value::Bool(rng.random())),
        ("string", Value::from("ünïcode ✓ \0 nul")),
        ("u64", Value::U64(rng.random())),
        ("i64", Value::I64(rng.random())),
        ("f64", Value::F64(rng.random())),
        ("empty_string", Value::from("")),
        (
            "a.u8",
            Value::from((0..n).map(|_| rng.random::<u8>()).collect::<Vec<_>>()),
        ),
        (
            "a.i8",
            Value::from((0..n).map(|_| rng.random::<i8>()).collect::<Vec<_>>()),
        ),
        (
            "a.u16",
            Value::from((0..n).map(|_| rng.random::<u16>()).collect::<Vec<_>>()),
        ),
        (
            "a.i16",
            Value::from((0..n).map(|_| rng.random::<i16>()).collect::<Vec<_>>()),
        ),
        (
            "a.u32",
            Value::from((0..n).map(|_| rng.random::<u32>()).collect::<Vec<_>>()),
        ),
        (
            "a.i32",
            Value::from((0..n).map(|_| rng.random::<i32>()).collect::<Vec<_>>()),
        ),
        (
            "a.f32",
            Value::from((0..n).map(|_| rng.random::<f32>()).collect::<Vec<_>>()),
        ),
        (
            "a.bool",
            Value::from((0..n).map(|_| rng.random::<bool>()).collect::<Vec<_>>()),
        ),
        (
            "a.string",
            Value::from((0..n).map(|i| "x".repeat(i)).collect::<Vec<_>>()),
        ),
        (
            "a.u64",
            Value::from((0..n).map(|_| rng.random::<u64>()).collect::<Vec<_>>()),
        ),
        (
            "a.i64",
            Value::from((0..n).map(|_| rng.random::<i64>()).collect::<Vec<_>>()),
        ),
        (
            "a.f64",
            Value::from((0..n).map(|_| rng.random::<f64>()).collect::<Vec<_>>()),
        ),
        ("a.empty", Value::Array(Array::F64(vec![]))),
        ("a.empty_nested", Value::Array(Array::Array(vec![]))),
        (
            "a.nested",
            Value::from(vec![
                Array::from(vec![1u32, 2]),
                Array::from(vec!["mixed".to_string()]),
                Array::Array(vec![Array::from(vec![true]), Array::I8(vec![])]),
            ]),
        ),
    ];
    let mut deepest = Array::from(vec![7u8]);
    for _ in 1..MAX_ARRAY_DEPTH {
        deepest = Array::Array(vec![deepest]);
    }
    vals.push(("a.deepest", Value::Array(deepest)));
    vals.into_iter()
        .map(|(k, v)| (format!("test.{k}"), v))
        .collect()
}

#[test]
fn every_value_type_round_trips_in_order() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for version in [2, 3] {
        let values = every_value(&mut rng);
        let mut w = GgufWriter::new();
        w.set_version(version).unwrap();
        for (k, v) in &values {
            w.add(k.clone(), v.clone()).unwrap();
        }
        let g = write(&w);
        assert_eq!(g.version(), version);
        let read: Vec<(String, Value)> = g
            .metadata()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        assert_eq!(read, values);
        for (k, v) in &values {
            assert_eq!(g.get(k), Some(v), "{k}");
        }
        assert_eq!(g.get("test.absent"), None);
        assert!(g.tensor_infos().is_empty());
    }
    // Every type appears at the top level and as an array element.
    let values = every_value(&mut rng);
    for t in ValueType::ALL {
        assert!(values.iter().any(|(_, v)| v.value_type() == t), "{t}");
        let as_elem = values
            .iter()
            .any(|(_, v)| matches!(v, Value::Array(a) if a.element_type() == t));
        assert!(as_elem, "array of {t}");
    }
}

/// Bytes of `elements` values of `dtype` (whole blocks), random.
fn random_bytes(rng: &mut ChaCha8Rng, dtype: DType, shape: &[usize]) -> Vec<u8> {
    let n = dtype.bytes_for(shape.iter().product()).unwrap();
    (0..n).map(|_| rng.random()).collect()
}

#[test]
fn every_dtype_round_trips_at_several_alignments() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for alignment in [1u32, 8, 32, 64, 4096] {
        let mut w = GgufWriter::new();
        w.add("general.alignment", alignment).unwrap();
        w.add("general.architecture", "llama").unwrap();
        let mut expect = Vec::new();
        // Every type with a GGUF id (F8_B128 is kvant's own: see below).
        let types = DType::ALL.into_iter().filter(|d| d.ggml_id().is_some());
        for (i, dtype) in types.enumerate() {
            let rows = rng.random_range(1..6);
            let row = dtype.block_size() * rng.random_range(1..4)
                + if dtype.is_quantized() { 0 } else { 1 };
            let shapes = [
                vec![rows, row],
                vec![row],
                vec![2, 1, rows, row],
                vec![3, rows, row],
            ];
            let shape = shapes[i % shapes.len()].clone();
            let data = random_bytes(&mut rng, dtype, &shape);
            let name = format!("blk.{i}.{}", dtype.name());
            w.add_tensor(name.clone(), dtype, &shape, data.clone())
                .unwrap();
            expect.push((name, dtype, shape, data));
        }
        let g = write(&w);
        assert_eq!(g.alignment(), alignment as usize);
        assert_eq!(g.data_offset() % alignment as usize, 0);
        assert_eq!(g.architecture().unwrap(), "llama");
        assert_eq!(g.tensor_infos().len(), expect.len());
        for ((name, dtype, shape, data), info) in expect.iter().zip(g.tensor_infos()) {
            assert_eq!(&info.name, name);
            assert_eq!(info.offset % alignment as usize, 0, "{name}");
            assert_eq!(info.elements(), shape.iter().product::<usize>() as u64);
            let t = g.tensor(name).unwrap();
            assert_eq!(t.dtype(), *dtype);
            assert_eq!(t.shape(), &shape[..]);
            assert_eq!(t.bytes(), &data[..], "{name} at alignment {alignment}");
            assert_eq!(g.tensor_info(name), Some(info));
        }
    }
    // A type GGUF has no id for is the writer's typed error, not a file
    // another reader would misread.
    let mut w = GgufWriter::new();
    w.add("general.architecture", "llama").unwrap();
    let data = vec![0u8; DType::F8_B128.block_bytes()];
    w.add_tensor("w".to_string(), DType::F8_B128, &[1, 128], data)
        .unwrap();
    let err = w.to_bytes().expect_err("written");
    assert!(err.to_string().contains("no type"), "{err}");
}

#[test]
fn tensors_borrow_the_file_bytes() {
    let mut w = GgufWriter::new();
    w.add_tensor("a", DType::F32, &[3], vec![0u8; 12]).unwrap();
    let storage = Storage::Owned(w.to_bytes().unwrap().into());
    let base = storage.as_bytes().as_ptr_range();
    let g = GgufFile::from_storage(storage).unwrap();
    let t = g.tensor("a").unwrap();
    assert!(base.contains(&t.bytes().as_ptr()));
    assert_eq!(g.file_size(), (base.end as usize) - (base.start as usize));
}

#[test]
fn writes_and_opens_files_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let mut w = GgufWriter::new();
    w.add("k", 5u64).unwrap();
    w.add_tensor("w", DType::Q8_0, &[2, 32], vec![9u8; 68])
        .unwrap();
    w.write_file(&path).unwrap();
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.get_u64("k").unwrap(), Some(5));
    assert_eq!(g.tensor("w").unwrap().bytes(), &[9u8; 68][..]);
    let missing = GgufFile::open(&dir.path().join("nope.gguf")).unwrap_err();
    assert!(missing.to_string().contains("nope.gguf"), "{missing}");
}

#[test]
fn integer_accessors_tolerate_width_and_sign() {
    let mut w = GgufWriter::new();
    w.add("u8", 9u8).unwrap();
    w.add("i32", 9i32).unwrap();
    w.add("u64", 9u64).unwrap();
    w.add("neg", -1i32).unwrap();
    w.add("big", u64::MAX).unwrap();
    w.add("f", 2.5f64).unwrap();
    w.add("s", "text").unwrap();
    let g = write(&w);
    for key in ["u8", "i32", "u64"] {
        assert_eq!(g.get_u32(key).unwrap(), Some(9), "{key}");
        assert_eq!(g.get_u64(key).unwrap(), Some(9), "{key}");
        assert_eq!(g.get_usize(key).unwrap(), Some(9), "{key}");
        assert_eq!(g.get_i64(key).unwrap(), Some(9), "{key}");
    }
    assert_eq!(g.get_i64("neg").unwrap(), Some(-1));
    assert_eq!(g.get_u64("big").unwrap(), Some(u64::MAX));
    for (key, err) in [
        ("neg", g.get_u32("neg").unwrap_err()),
        ("big", g.get_u32("big").unwrap_err()),
        ("big", g.get_i64("big").unwrap_err()),
    ] {
        assert!(matches!(err, GgufError::OutOfRange { .. }), "{err}");
        assert!(err.to_string().contains(key), "{err}");
    }
    assert_eq!(g.get_f32("f").unwrap(), Some(2.5));
    assert_eq!(g.get_u32("absent").unwrap(), None);
    for err in [
        g.get_u32("s").unwrap_err(),
        g.get_f32("u8").unwrap_err(),
        g.get_bool("s").unwrap_err(),
        g.get_str("u64").unwrap_err(),
        g.get_str_array("s").unwrap_err(),
    ] {
        assert!(matches!(err, GgufError::WrongType { .. }), "{err}");
    }
    let err = g.architecture().unwrap_err();
    assert!(err.to_string().contains("general.architecture"), "{err}");
}

#[test]
fn array_accessors_borrow_or_convert() {
    let mut w = GgufWriter::new();
    w.add("i32", vec![1i32, -2]).unwrap();
    w.add("u32", vec![1u32, 2]).unwrap();
    w.add("u32_big", vec![1u32, u32::MAX]).unwrap();
    w.add("f32", vec![0.5f32]).unwrap();
    w.add("f64", vec![0.25f64]).unwrap();
    w.add("strs", vec!["a", "b"]).unwrap();
    w.add("bools", vec![true]).unwrap();
    let g = write(&w);
    assert!(matches!(
        g.get_i32_array("i32").unwrap(),
        Some(std::borrow::Cow::Borrowed(&[1, -2]))
    ));
    assert_eq!(g.get_i32_array("u32").unwrap().unwrap().as_ref(), &[1, 2]);
    let err = g.get_i32_array("u32_big").unwrap_err();
    assert!(err.to_string().contains("u32_big[1]"), "{err}");
    assert!(matches!(
        g.get_f32_array("f32").unwrap(),
        Some(std::borrow::Cow::Borrowed(&[0.5]))
    ));
    assert_eq!(g.get_f32_array("f64").unwrap().unwrap().as_ref(), &[0.25]);
    assert_eq!(
        g.get_str_array("strs").unwrap(),
        Some(&["a".to_string(), "b".to_string()][..])
    );
    for err in [
        g.get_i32_array("bools").unwrap_err(),
        g.get_i32_array("strs").unwrap_err(),
        g.get_f32_array("i32").unwrap_err(),
        g.get_str_array("f32").unwrap_err(),
    ] {
        assert!(matches!(err, GgufError::WrongType { .. }), "{err}");
    }
    assert_eq!(g.get_f32_array("absent").unwrap(), None);
}

#[test]
fn writer_rejects_what_the_reader_would() {
    let mut w = GgufWriter::new();
    w.add("k", 1u8).unwrap();
    assert!(matches!(
        w.add("k", 2u8),
        Err(GgufError::BadWriterValue { .. })
    ));
    for bad in [0u32, 3, 1 << 30] {
        assert!(w.add("general.alignment", bad).is_err(), "{bad}");
    }
    let mut deep = Array::from(vec![1u8]);
    for _ in 0..MAX_ARRAY_DEPTH {
        deep = Array::Array(vec![deep]);
    }
    assert!(w.add("deep", deep).is_err());
    assert!(w.set_version(1).is_err());
    assert!(w.set_version(4).is_err());

    w.add_tensor("t", DType::F32, &[2], vec![0u8; 8]).unwrap();
    let long_name = "n".repeat(64);
    let cases: Vec<(&str, DType, Vec<usize>, usize)> = vec![
        ("t", DType::F32, vec![2], 8),
        ("short", DType::F32, vec![3], 8),
        ("partial_block", DType::Q4_0, vec![2, 16], 18),
        ("dims", DType::F32, vec![1, 1, 1, 1, 1], 4),
        ("overflow", DType::F32, vec![usize::MAX, 2], 0),
        (&long_name, DType::F32, vec![1], 4),
    ];
    for (name, dtype, shape, len) in cases {
        let err = w
            .add_tensor(name, dtype, &shape, vec![0u8; len])
            .unwrap_err();
        assert!(
            matches!(err, GgufError::BadWriterTensor { .. }),
            "{name}: {err}"
        );
    }
    // The file is still valid after rejected additions.
    let g = write(&w);
    assert_eq!(g.tensor_infos().len(), 1);
    assert_eq!(g.get_u64("k").unwrap(), Some(1));
}

#[test]
fn reads_the_reference_writers_fixture() {
    let g = GgufFile::open(&fixture_path()).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.alignment(), 64);
    assert_eq!(g.architecture().unwrap(), "llama");
    assert_eq!(g.get("test.u8"), Some(&Value::U8(200)));
    assert_eq!(g.get("test.i8"), Some(&Value::I8(-100)));
    assert_eq!(g.get("test.u16"), Some(&Value::U16(60000)));
    assert_eq!(g.get("test.i16"), Some(&Value::I16(-30000)));
    assert_eq!(g.get("test.u32"), Some(&Value::U32(4_000_000_000)));
    assert_eq!(g.get("test.i32"), Some(&Value::I32(-2_000_000_000)));
    assert_eq!(g.get("test.f32"), Some(&Value::F32(1.5)));
    assert_eq!(g.get("test.bool"), Some(&Value::Bool(true)));
    assert_eq!(g.get_str("test.string").unwrap(), Some("héllo ✓"));
    assert_eq!(g.get("test.u64"), Some(&Value::U64((1 << 63) + 5)));
    assert_eq!(g.get("test.i64"), Some(&Value::I64(-(1 << 62))));
    assert_eq!(g.get("test.f64"), Some(&Value::F64(std::f64::consts::PI)));
    let arr = |k: &str| match g.get(&format!("test.arr.{k}")) {
        Some(Value::Array(a)) => a.clone(),
        other => panic!("{k}: {other:?}"),
    };
    assert_eq!(arr("u8"), Array::U8(vec![1, 2, 255]));
    assert_eq!(arr("i8"), Array::I8(vec![-1, 127]));
    assert_eq!(arr("u16"), Array::U16(vec![65535]));
    assert_eq!(arr("i16"), Array::I16(vec![-5, 5, 0]));
    assert_eq!(arr("u32"), Array::U32(vec![7, 4_000_000_000]));
    assert_eq!(arr("i32"), Array::I32(vec![-3, 49151]));
    assert_eq!(arr("f32"), Array::F32(vec![0.25, -2.0]));
    assert_eq!(arr("bool"), Array::Bool(vec![true, false, true]));
    assert_eq!(
        arr("string"),
        Array::from(vec!["a".to_string(), String::new(), "ü".to_string()])
    );
    assert_eq!(arr("u64"), Array::U64(vec![u64::MAX]));
    assert_eq!(arr("i64"), Array::I64(vec![i64::MIN, 1]));
    assert_eq!(arr("f64"), Array::F64(vec![1e-300, 2.5]));
    assert_eq!(
        arr("nested"),
        Array::Array(vec![Array::I32(vec![1, 2]), Array::I32(vec![3])])
    );
    assert_eq!(
        arr("nested_str"),
        Array::Array(vec![
            Array::from(vec!["x".to_string()]),
            Array::from(vec!["y".to_string(), "z".to_string()])
        ])
    );
    // Every kvant dtype is present, with the deterministic bytes the script wrote.
    let infos = g.tensor_infos();
    let in_gguf = DType::ALL.into_iter().filter(|d| d.ggml_id().is_some());
    for dtype in in_gguf.chain([DType::I32]) {
        assert!(infos.iter().any(|t| t.dtype == dtype), "{dtype}");
    }
    for (i, info) in infos.iter().enumerate() {
        let t = g.tensor(&info.name).unwrap();
        let expect: Vec<u8> = (0..t.byte_len())
            .map(|j| ((7 * j + 13 * i) % 251) as u8)
            .collect();
        assert_eq!(t.bytes(), &expect[..], "{}", info.name);
    }
    assert_eq!(g.tensor_info("t.4d").unwrap().shape, vec![2, 1, 3, 2]);
    assert_eq!(g.tensor_info("t.q4_k").unwrap().shape, vec![1, 512]);
}

#[test]
fn writer_reproduces_the_reference_file_byte_for_byte() {
    let original = std::fs::read(fixture_path()).unwrap();
    let g = parse(original.clone());
    assert_eq!(common::rewritten(&g), original);
}
