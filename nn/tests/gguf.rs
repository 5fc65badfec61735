//! GGUF files against the `gguf` package (llama.cpp's Python reader, writer
//! and quantizers): every type kiln reads dequantizes bit-exactly as the
//! package does, every file kiln writes holds exactly the bytes the package's
//! quantizers make, and malformed files are errors, never panics.
mod support;

use kiln::nn::io::gguf::{save_gguf, GgmlType, GgufFile, GgufTensor, GgufValue, GgufValueType};
use kiln::nn::io::{load_safetensors, save_safetensors};
use kiln::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;
use support::{f32_bits, gguf_reference, temp_dir};

#[test]
fn every_type_reads_as_the_gguf_package_dequantizes_it() {
    let dir = temp_dir("gguf-read");
    for seed in [1, 2] {
        let (file, reference) = (dir.join(format!("{seed}.gguf")), dir.join(format!("{seed}.safetensors")));
        gguf_reference(&["make".as_ref(), file.as_os_str(), reference.as_os_str(), seed.to_string().as_ref()]);
        let want = load_safetensors(&reference).unwrap();
        let f = GgufFile::open(&file).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.get("general.architecture").and_then(|v| v.as_str()), Some("llama"));
        assert_eq!(f.get("test.u32"), Some(&GgufValue::U32(7)));
        assert_eq!(f.get("test.str").and_then(|v| v.as_str()), Some("héllo"));
        assert_eq!(f.get("test.strings"), Some(&GgufValue::strings(["a", "", "ç"])));
        assert_eq!(f.get("test.f32"), Some(&GgufValue::F32(0.25)));
        let types: Vec<&str> = f.tensor_infos().iter().map(|t| t.ggml_type.name()).collect();
        for ty in ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
        {
            assert!(types.contains(&ty), "the reference file has no {ty} tensor: {types:?}");
        }
        assert_eq!(want.len(), f.tensor_infos().len());
        let mut packed = vec![];
        for (name, w) in &want {
            let got = f.tensor(name, None, Device::Cpu).unwrap();
            assert_eq!(got.shape(), w.shape(), "{name}");
            let ty = f.info(name).unwrap().ggml_type;
            assert!(f32_bits(&got) == f32_bits(w), "seed {seed}: {name} ({ty}) dequantizes differently");
            // The integer types kept packed hold the same values.
            if let Some(q) = f.packed_weight(name).unwrap() {
                assert!(f32_bits(&q.dequantize().unwrap()) == f32_bits(w), "seed {seed}: {name} ({ty}) packed differs");
                packed.push(ty.name());
            }
        }
        packed.sort();
        assert_eq!(packed, ["Q3_K", "Q4_0", "Q5_0", "Q6_K", "Q8_0"], "the matrices kept packed");
        // The 3-D tensor's shape is GGUF's ne reversed.
        assert_eq!(f.info("q.3d").unwrap().shape, vec![2, 3, 64]);
    }
}

/// Values that exercise the reference quantizers' corners: a zero block, a
/// block whose largest magnitude is negative, values that land on halves
/// (Q8_0 rounds them away from zero), and ordinary random values.
fn awkward(rows: usize, cols: usize, seed: u64) -> Tensor {
    let g = kiln::tensor::Generator::new(Device::Cpu).unwrap().manual_seed(seed).unwrap();
    let mut x = g.randn(&[rows, cols], DType::F32).unwrap().to_vec::<f32>().unwrap();
    let n = x.len().min(32);
    x[..n].fill(0.0);
    if rows > 1 && cols >= 32 {
        x[cols] = -3.0;
        for (i, v) in x[cols + 1..cols + 32].iter_mut().enumerate() {
            *v = (i as f32 - 15.0) * 0.375;
        }
    }
    if rows > 2 && cols >= 32 {
        x[2 * cols] = 127.0;
        for (i, v) in x[2 * cols + 1..2 * cols + 32].iter_mut().enumerate() {
            *v = i as f32 - 15.5;
        }
    }
    Tensor::from_vec(x, &[rows, cols]).unwrap()
}

#[test]
fn files_kiln_writes_hold_the_gguf_package_bytes() {
    let dir = temp_dir("gguf-write");
    let metadata: Vec<(String, GgufValue)> = vec![
        ("general.architecture".into(), GgufValue::String("llama".into())),
        ("test.u8".into(), GgufValue::U8(200)),
        ("test.i8".into(), GgufValue::I8(-5)),
        ("test.u16".into(), GgufValue::U16(60000)),
        ("test.i16".into(), GgufValue::I16(-30000)),
        ("test.u32".into(), GgufValue::U32(4_000_000_000)),
        ("test.i32".into(), GgufValue::I32(-2_000_000_000)),
        ("test.f32".into(), GgufValue::F32(1.5)),
        ("test.bool".into(), GgufValue::Bool(true)),
        ("test.string".into(), GgufValue::String("naïve ☃".into())),
        ("test.u64".into(), GgufValue::U64(1 << 40)),
        ("test.i64".into(), GgufValue::I64(-(1 << 40))),
        ("test.f64".into(), GgufValue::F64(0.1)),
        ("test.strings".into(), GgufValue::strings(["x", "", "yz"])),
        ("test.ints".into(), GgufValue::Array(GgufValueType::I32, vec![GgufValue::I32(1), GgufValue::I32(-2)])),
        ("test.empty".into(), GgufValue::Array(GgufValueType::F32, vec![])),
    ];
    let mut source = BTreeMap::new();
    let mut tensors = vec![];
    for (i, (ty, shape)) in [
        (GgmlType::F32, vec![5, 33]),
        (GgmlType::F16, vec![5, 33]),
        (GgmlType::BF16, vec![3, 7]),
        (GgmlType::Q8_0, vec![7, 96]),
        (GgmlType::Q4_0, vec![7, 96]),
        (GgmlType::Q8_0, vec![2, 3, 64]),
        (GgmlType::Q4_0, vec![64]),
    ]
    .into_iter()
    .enumerate()
    {
        let n: usize = shape.iter().product();
        let x = awkward(n / shape[shape.len() - 1], shape[shape.len() - 1], i as u64)
            .reshape(&shape.iter().map(|&d| d as isize).collect::<Vec<_>>())
            .unwrap();
        let name = format!("t{i}.{}", ty.name());
        source.insert(name.clone(), x.clone());
        tensors.push(GgufTensor::new(name, x, ty));
    }
    let file = dir.join("kiln.gguf");
    save_gguf(&file, &metadata, &tensors).unwrap();
    let src = dir.join("source.safetensors");
    save_safetensors(&src, &source, None).unwrap();
    let printed = gguf_reference(&["check".as_ref(), file.as_os_str(), src.as_os_str()]);
    let meta: serde_json::Value = serde_json::from_str(printed.trim()).unwrap();
    let want = serde_json::json!({
        "general.architecture": ["STRING", "llama"],
        "test.u8": ["UINT8", 200], "test.i8": ["INT8", -5], "test.u16": ["UINT16", 60000],
        "test.i16": ["INT16", -30000], "test.u32": ["UINT32", 4_000_000_000u32],
        "test.i32": ["INT32", -2_000_000_000], "test.f32": ["FLOAT32", 1.5], "test.bool": ["BOOL", true],
        "test.string": ["STRING", "naïve ☃"], "test.u64": ["UINT64", 1u64 << 40],
        "test.i64": ["INT64", -(1i64 << 40)], "test.f64": ["FLOAT64", 0.1],
        "test.strings": ["ARRAY", ["STRING", ["x", "", "yz"]]],
        "test.ints": ["ARRAY", ["INT32", [1, -2]]],
        "test.empty": ["ARRAY", ["FLOAT32", []]],
    });
    assert_eq!(meta, want);

    // kiln reads its own file back: metadata as written, plain types exact,
    // quantized ones within half a step of the source.
    let f = GgufFile::open(&file).unwrap();
    assert_eq!(f.metadata(), &metadata[..]);
    for t in &tensors {
        let got = f.tensor(&t.name, Some(DType::F32), Device::Cpu).unwrap();
        assert_eq!(got.shape(), t.tensor.shape());
        let (a, b) = (got.to_vec::<f32>().unwrap(), t.tensor.to_vec::<f32>().unwrap());
        match t.ggml_type {
            GgmlType::F32 => assert_eq!(a, b),
            GgmlType::F16 | GgmlType::BF16 => {
                let round = t.tensor.to_dtype(t.ggml_type.read_dtype().unwrap()).unwrap();
                assert_eq!(f32_bits(&got), f32_bits(&round), "{}", t.name)
            }
            ty => {
                // Q8_0: half a step of amax / 127, plus the f16 rounding of
                // the scale over 127 steps; Q4_0: a whole step of amax / 8
                // (its scale is the signed extreme over -8, so values of the
                // other sign reach +8, which clips to code 15).
                let bound = |amax: f32| match ty {
                    GgmlType::Q8_0 => amax / 254.0 + amax * 2f32.powi(-11),
                    _ => amax / 8.0 + amax * 2f32.powi(-11),
                };
                for (blk_a, blk_b) in a.chunks(32).zip(b.chunks(32)) {
                    let amax = blk_b.iter().fold(0f32, |m, v| m.max(v.abs()));
                    for (x, y) in blk_a.iter().zip(blk_b) {
                        assert!((x - y).abs() <= bound(amax), "{}: {x} vs {y}", t.name);
                    }
                }
            }
        }
    }
}

#[test]
fn writing_refuses_what_gguf_cannot_hold() {
    let dir = temp_dir("gguf-write-bad");
    let x = Tensor::ones(&[2, 64], DType::F32).unwrap();
    let err = |tensors: &[GgufTensor], meta: &[(String, GgufValue)]| {
        let p = dir.join("bad.gguf");
        let e = save_gguf(&p, meta, tensors).unwrap_err().to_string();
        assert!(!p.exists(), "a failed save left {}", p.display());
        e
    };
    let long = "w".repeat(64);
    assert!(err(&[GgufTensor::new(&long, x.clone(), GgmlType::F32)], &[]).contains("at most 63 bytes"));
    let twice = [GgufTensor::new("w", x.clone(), GgmlType::F32), GgufTensor::new("w", x.clone(), GgmlType::F16)];
    assert!(err(&twice, &[]).contains("given twice"));
    assert!(err(&[GgufTensor::new("w", x.clone(), GgmlType::Q4_K)], &[]).contains("not Q4_K"));
    let odd = Tensor::ones(&[2, 40], DType::F32).unwrap();
    assert!(err(&[GgufTensor::new("w", odd, GgmlType::Q8_0)], &[]).contains("hold 32 elements"));
    let ints = Tensor::zeros(&[2, 32], DType::I64).unwrap();
    assert!(err(&[GgufTensor::new("w", ints, GgmlType::F32)], &[]).contains("floating-point"));
    let scalar = Tensor::ones(&[], DType::F32).unwrap();
    assert!(err(&[GgufTensor::new("w", scalar, GgmlType::F32)], &[]).contains("1 to 4 dimensions"));
    let mixed = GgufValue::Array(GgufValueType::U32, vec![GgufValue::U32(1), GgufValue::I32(2)]);
    assert!(err(&[], &[("k".into(), mixed)]).contains("holds a I32"));
    let align = GgufValue::U32(48);
    assert!(err(&[], &[("general.alignment".into(), align)]).contains("power of two"));
}

/// A small valid file: two tensors, a string array, an alignment of 32.
fn small_file(dir: &Path) -> Vec<u8> {
    let p = dir.join("small.gguf");
    let meta = vec![
        ("general.architecture".to_string(), GgufValue::String("llama".into())),
        ("tokenizer.ggml.tokens".to_string(), GgufValue::strings(["a", "b"])),
    ];
    let t = vec![
        GgufTensor::new("wa", Tensor::ones(&[3, 32], DType::F32).unwrap(), GgmlType::Q8_0),
        GgufTensor::new("wb", Tensor::ones(&[5], DType::F32).unwrap(), GgmlType::F32),
    ];
    save_gguf(&p, &meta, &t).unwrap();
    std::fs::read(&p).unwrap()
}

/// The byte offset of tensor info `name`'s fields after its name.
fn info_at(bytes: &[u8], name: &str) -> usize {
    let mut pat = (name.len() as u64).to_le_bytes().to_vec();
    pat.extend(name.as_bytes());
    bytes.windows(pat.len()).position(|w| w == pat).unwrap() + pat.len()
}

#[test]
fn malformed_files_are_errors_not_panics() {
    let dir = temp_dir("gguf-hostile");
    let good = small_file(&dir);
    let p = dir.join("h.gguf");
    let open = |bytes: &[u8]| {
        std::fs::write(&p, bytes).unwrap();
        GgufFile::open(&p).map(|_| ()).map_err(|e| e.to_string())
    };
    assert_eq!(open(&good), Ok(()));
    // Every truncation of the file is an error, up to the padding after the
    // last tensor (5 float32 = 20 bytes, padded to 32).
    for n in 0..good.len() - 12 {
        assert!(open(&good[..n]).is_err(), "a file cut at {n} of {} bytes opened", good.len());
    }
    let patch = |at: usize, with: &[u8]| {
        let mut b = good.clone();
        b[at..at + with.len()].copy_from_slice(with);
        open(&b).unwrap_err()
    };
    assert!(patch(0, b"GGUG").contains("not a GGUF file"));
    assert!(patch(4, &1u32.to_le_bytes()).contains("version 1"));
    assert!(patch(4, &3u32.to_be_bytes()).contains("big-endian"));
    assert!(patch(8, &u64::MAX.to_le_bytes()).contains("tensor count"));
    assert!(patch(16, &(1u64 << 60).to_le_bytes()).contains("metadata count"));
    // The first key's length.
    assert!(patch(24, &(1u64 << 50).to_le_bytes()).contains("string length"));
    // The first value's type (after the 8-byte length and "general.architecture").
    assert!(patch(24 + 8 + 20, &99u32.to_le_bytes()).contains("unknown value type 99"));
    let a = info_at(&good, "wa");
    // a: n_dims, ne0, ne1, type, offset.
    assert!(patch(a, &9u32.to_le_bytes()).contains("9 dimensions"));
    assert!(patch(a + 4, &33u64.to_le_bytes()).contains("blocks hold 32 elements"));
    assert!(patch(a + 4, &(1u64 << 63).to_le_bytes()).contains("size overflows"));
    assert!(patch(a + 20, &77u32.to_le_bytes()).contains("unknown ggml type 77"));
    assert!(patch(a + 24, &8u64.to_le_bytes()).contains("not a multiple of the alignment"));
    assert!(patch(a + 24, &(1u64 << 20).to_le_bytes()).contains("truncated or corrupt"));
    let b = info_at(&good, "wb");
    assert!(patch(b - 1, b"a").contains("appears twice"));
    // A type kiln does not dequantize opens, and reading it names the type.
    let mut iq = good.clone();
    // 3 x 32 Q8_0 = 102 bytes; as IQ4_NL (32 per 18 bytes) = 54 bytes, inside the data.
    iq[a + 20..a + 24].copy_from_slice(&GgmlType::IQ4_NL.id().to_le_bytes());
    std::fs::write(&p, &iq).unwrap();
    let f = GgufFile::open(&p).unwrap();
    let e = f.tensor("wa", None, Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("IQ4_NL, which kiln cannot dequantize"), "{e}");
}

#[test]
fn tokenizers_in_gguf_files_encode_as_the_tokenizers_package_does() {
    use kiln::nn::data::{HfTokenizer, Tokenizer};
    use kiln::nn::io::gguf::{tokenizer_metadata, GgufTensor};
    let text = support::fixture_dir("llama").join("../../data/tinyshakespeare.txt");
    for pre in ["qwen2", "llama-bpe", "gpt-2"] {
        let dir = temp_dir(&format!("gguf-tok-{pre}"));
        gguf_reference(&["tokenizer".as_ref(), dir.as_os_str(), pre.as_ref(), text.as_os_str()]);
        let expected: Vec<(String, Vec<u32>)> =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
        // As llama.cpp's converter stores it (written by the gguf package).
        let from_gguf = HfTokenizer::from_gguf(dir.join("tokenizer.gguf")).unwrap();
        // And as kiln writes it from the tokenizer.json.
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap()).unwrap();
        let meta = tokenizer_metadata(&json).unwrap();
        let ours = dir.join("kiln.gguf");
        save_gguf(&ours, &meta, &[] as &[GgufTensor]).unwrap();
        let theirs = GgufFile::open(dir.join("tokenizer.gguf")).unwrap();
        for (k, v) in &meta {
            assert_eq!(theirs.get(k), Some(v), "{pre}: {k} differs from the converter's");
        }
        let round_trip = HfTokenizer::from_gguf(&ours).unwrap();
        for (text, ids) in &expected {
            assert_eq!(&from_gguf.encode(text).unwrap(), ids, "{pre}: {text:?}");
            assert_eq!(&round_trip.encode(text).unwrap(), ids, "{pre}: {text:?} (kiln's file)");
            let back = from_gguf.decode(ids).unwrap();
            assert_eq!(&from_gguf.encode(&back).unwrap(), ids, "{pre}: decode({text:?})");
        }
    }
    // What GGUF cannot name is an error, not a tokenizer that splits differently.
    let odd = serde_json::json!({"model": {"type": "WordPiece"}});
    assert!(tokenizer_metadata(&odd).unwrap_err().to_string().contains("WordPiece"));
}

/// Packing refuses bytes that do not hold the shape, shapes whose size
/// overflows, and types that do not stay packed, with errors.
#[test]
fn packing_refuses_what_does_not_fit() {
    use kiln::nn::io::gguf::pack_blocks;
    let block = vec![0u8; GgmlType::Q8_0.type_size()];
    assert!(pack_blocks(GgmlType::Q8_0, &block, 1, 32).is_ok());
    assert!(pack_blocks(GgmlType::Q8_0, &block, 2, 32).is_err(), "too few bytes");
    assert!(pack_blocks(GgmlType::Q8_0, &block, 1, 16).is_err(), "a partial block");
    assert!(pack_blocks(GgmlType::Q8_0, &block, usize::MAX / 16, 32).is_err(), "a size that overflows");
    assert!(pack_blocks(GgmlType::Q4_K, &block, 1, 32).is_err(), "a type with minimums");
    assert!(pack_blocks(GgmlType::Q8_0, &[], 0, 32).is_ok_and(|q| q.shape == [0, 32]), "no rows");
}
