//! The float8 dtypes (`float8_e4m3fn`, `float8_e5m2`) through the tensor API on
//! every device and mode: casts with PyTorch's rounding and overflow rules,
//! data movement, printing, safetensors in and out, the refusal of arithmetic,
//! and `scaled_mm`.
mod common;

use common::assert_err;
use kiln::prelude::*;
use kiln::tensor::{f8e4m3fn, f8e5m2, HostBuffer};

/// Values around every rounding boundary of both formats, the overflow
/// thresholds, specials and a spread of magnitudes.
fn samples() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        -1.5,
        448.0,
        464.0,
        464.5,
        479.9,
        480.0,
        -500.0,
        57344.0,
        61439.0,
        61440.0,
        65536.0,
        1e9,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        2f32.powi(-10),
        3.0 * 2f32.powi(-10),
        2f32.powi(-17),
        1e-30,
    ];
    for c in 0..=255u8 {
        for x in [f8e4m3fn::from_bits(c).to_f32(), f8e5m2::from_bits(c).to_f32()] {
            if x.is_finite() {
                v.extend([x, x * 1.0625, x * 0.96875, -x * 1.03125]);
            }
        }
    }
    v
}

/// The codes of a float8 tensor, every NaN as its format's canonical 0x7F
/// (its sign kept): devices are free to pick any NaN payload.
fn bits(t: &Tensor) -> Vec<u8> {
    match t.to_host().unwrap() {
        HostBuffer::F8E4M3FN(v) => v.iter().map(|x| x.to_bits()).collect(),
        HostBuffer::F8E5M2(v) => v.iter().map(|x| if x.is_nan() { x.to_bits() | 0x7F } else { x.to_bits() }).collect(),
        other => panic!("not a float8 buffer: {:?}", other.dtype()),
    }
}

/// Asserts equal codes, naming the first few that differ and their inputs.
fn assert_codes(got: &[u8], want: &[u8], xs: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let bad: Vec<String> = (0..got.len())
        .filter(|&i| got[i] != want[i])
        .take(8)
        .map(|i| format!("{:e}: got 0x{:02X}, want 0x{:02X}", xs[i], got[i], want[i]))
        .collect();
    assert!(bad.is_empty(), "{what}: {}", bad.join("; "));
}

#[test]
fn casts_round_like_pytorch_on_every_device() {
    let xs = samples();
    let want4: Vec<u8> = xs.iter().map(|&x| f8e4m3fn::from_f32(x).to_bits()).collect();
    let want5: Vec<u8> = xs.iter().map(|&x| f8e5m2::from_f32(x).to_bits()).collect();
    // Spot checks of the rules themselves (the exhaustive ones are the unit tests of `float8`).
    let at = |x: f32| xs.iter().position(|&y| y.to_bits() == x.to_bits()).unwrap();
    assert_eq!(want4[at(464.0)], 0x7E, "464 ties to even: 448");
    assert_eq!(want4[at(464.5)] & 0x7F, 0x7F, "past 464 rounds to NaN, PyTorch does not saturate");
    assert_eq!(want4[at(f32::INFINITY)], 0x7F);
    assert_eq!(want5[at(61440.0)], 0x7C, "61440 ties to even: inf");
    assert_eq!(want5[at(f32::NEG_INFINITY)], 0xFC);
    common::for_each_device_and_mode(|dev, mode| {
        let x = Tensor::new(xs.clone()).unwrap().to_device(dev).unwrap();
        let a = x.to_dtype(DType::F8E4M3FN).unwrap();
        let b = x.to_dtype(DType::F8E5M2).unwrap();
        assert_eq!(a.dtype(), DType::F8E4M3FN);
        assert_codes(&bits(&a), &want4, &xs, &format!("{dev} {mode}: f32 -> float8_e4m3fn"));
        assert_codes(&bits(&b), &want5, &xs, &format!("{dev} {mode}: f32 -> float8_e5m2"));
        // Back to f32: exact.
        let back: Vec<f32> = a.to_dtype(DType::F32).unwrap().to_vec().unwrap();
        for (i, (&g, &w)) in back.iter().zip(&want4).enumerate() {
            let e = f8e4m3fn::from_bits(w).to_f32();
            assert!(g.to_bits() == e.to_bits() || (g.is_nan() && e.is_nan()), "{dev} {mode}: element {i}");
        }
        // From bf16 and f64 (through f32, as PyTorch), and from integers.
        let from_bf16 = x.to_dtype(DType::BF16).unwrap().to_dtype(DType::F8E4M3FN).unwrap();
        let via: Vec<u8> = x
            .to_dtype(DType::BF16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|&v| f8e4m3fn::from_f32(v).to_bits())
            .collect();
        assert_codes(&bits(&from_bf16), &via, &xs, &format!("{dev} {mode}: bf16 -> float8_e4m3fn"));
        let ints = Tensor::new([-3i64, 0, 17, 1000]).unwrap().to_device(dev).unwrap();
        let f: Vec<f32> = ints.to_dtype(DType::F8E4M3FN).unwrap().to_dtype(DType::F32).unwrap().to_vec().unwrap();
        assert!(f[..3] == [-3.0, 0.0, 16.0] && f[3].is_nan(), "{dev} {mode}: {f:?}");
        let back: Vec<i64> = Tensor::new([2.5f32, -7.0, 0.75])
            .unwrap()
            .to_device(dev)
            .unwrap()
            .to_dtype(DType::F8E5M2)
            .unwrap()
            .to_dtype(DType::I64)
            .unwrap()
            .to_vec()
            .unwrap();
        assert_eq!(back, [2, -7, 0], "{dev} {mode}: float8 -> int64 truncates");
    });
}

#[test]
fn float8_tensors_move_but_refuse_arithmetic() {
    common::for_each_device_and_mode(|dev, mode| {
        let x = Tensor::arange(0.0, 12.0, 1.0, (DType::F32, dev)).unwrap().reshape(&[3, 4]).unwrap();
        let q = x.to_dtype(DType::F8E4M3FN).unwrap();
        let t = q.t().unwrap().contiguous().unwrap();
        assert_eq!(t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), x.t().unwrap().to_vec::<f32>().unwrap());
        let c = Tensor::cat(&[&q, &q.narrow(0, 1, 1).unwrap()], 0).unwrap();
        assert_eq!(c.dtype(), DType::F8E4M3FN);
        assert_eq!(c.shape(), &[4, 4]);
        let idx = Tensor::new([2i64, 0]).unwrap().to_device(dev).unwrap();
        let sel = q.index_select(0, &idx).unwrap().to_dtype(DType::F32).unwrap();
        assert_eq!(sel.to_vec::<f32>().unwrap(), [8.0, 9.0, 10.0, 11.0, 0.0, 1.0, 2.0, 3.0], "{dev} {mode}");
        let z = Tensor::zeros(&[2], (DType::F8E5M2, dev)).unwrap();
        assert_eq!(bits(&z), [0, 0]);
        // A scatter that replaces moves values (a float8 KV cache's writes); one that adds computes.
        let rows = Tensor::new([[1i64; 4], [0; 4]]).unwrap().to_device(dev).unwrap();
        let src = q.narrow(0, 0, 2).unwrap().contiguous().unwrap();
        let s = q.scatter(0, &rows, &src).unwrap().to_dtype(DType::F32).unwrap();
        let want = [4.0, 5.0, 6.0, 7.0, 0.0, 1.0, 2.0, 3.0, 8.0, 9.0, 10.0, 11.0];
        assert_eq!(s.to_vec::<f32>().unwrap(), want, "{dev} {mode}");
        for r in [q.add(&q), q.exp(), q.sum(), q.matmul(&q.t().unwrap()), q.mul(2.0), q.scatter_add(0, &rows, &src)] {
            let e = assert_err(r, &["float8_e4m3fn", "to_dtype"]);
            assert!(e.contains("not implemented"), "{dev} {mode}: {e}");
        }
    });
}

#[test]
fn float8_prints_and_round_trips_through_safetensors() {
    let x = Tensor::new([0.1f32, 448.0, -3.0]).unwrap().to_dtype(DType::F8E4M3FN).unwrap();
    assert_eq!(format!("{x}"), "tensor([ 1.0156e-01,  4.4800e+02, -3.0000e+00], dtype=float8_e4m3fn)");
    let y = Tensor::new([1.0f32, 57344.0]).unwrap().to_dtype(DType::F8E5M2).unwrap();
    assert_eq!(DType::from_name("float8_e5m2"), Some(DType::F8E5M2));
    assert_eq!(DType::from_name("F8_E4M3"), Some(DType::F8E4M3FN));
    let dir = std::env::temp_dir().join(format!("kiln-f8-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("f8.safetensors");
    let map: std::collections::BTreeMap<String, Tensor> =
        [("a".to_string(), x.clone()), ("b".to_string(), y.clone())].into();
    kiln::nn::io::save_safetensors(&path, &map, None).unwrap();
    let f = kiln::nn::io::SafetensorsFile::open(&path).unwrap();
    assert_eq!(f.info("a").unwrap().0, safetensors::Dtype::F8_E4M3);
    assert_eq!(f.info("b").unwrap().0, safetensors::Dtype::F8_E5M2);
    let back = kiln::nn::io::load_safetensors(&path).unwrap();
    assert_eq!(back["a"].dtype(), DType::F8E4M3FN);
    assert_eq!(bits(&back["a"]), bits(&x));
    assert_eq!(bits(&back["b"]), bits(&y));
    let wide = f.tensor("a", Some(DType::F32), Device::Cpu).unwrap();
    assert_eq!(wide.to_vec::<f32>().unwrap(), [0.1015625, 448.0, -3.0]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn scaled_mm_matches_the_dequantized_product() {
    let (m, k, n) = (5usize, 32usize, 3usize);
    let (mi, ki, ni) = (m as isize, k as isize, n as isize);
    let a32: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37).collect();
    let b32: Vec<f32> = (0..k * n).map(|i| ((i * 53 % 19) as f32 - 9.0) * 0.21).collect();
    let sa: Vec<f32> = (0..m).map(|i| 0.5 + i as f32 * 0.25).collect();
    let sb = [2.0f32, 0.125, 3.0];
    common::for_each_device_and_mode(|dev, mode| {
        let a = Tensor::new(a32.clone()).unwrap().reshape(&[mi, ki]).unwrap().to_device(dev).unwrap();
        let b = Tensor::new(b32.clone()).unwrap().reshape(&[ki, ni]).unwrap().to_device(dev).unwrap();
        let (qa, qb) = (a.to_dtype(DType::F8E4M3FN).unwrap(), b.to_dtype(DType::F8E5M2).unwrap());
        let s_a = Tensor::new(sa.clone()).unwrap().reshape(&[mi, 1]).unwrap().to_device(dev).unwrap();
        let s_b = Tensor::new(sb).unwrap().reshape(&[1, ni]).unwrap().to_device(dev).unwrap();
        let got: Vec<f32> = qa.scaled_mm(&qb, &s_a, &s_b, DType::F32).unwrap().to_vec().unwrap();
        // Reference: the exact f8 values, products summed in f64, scaled.
        let da: Vec<f64> = a32.iter().map(|&x| f8e4m3fn::from_f32(x).to_f64()).collect();
        let db: Vec<f64> = b32.iter().map(|&x| f8e5m2::from_f32(x).to_f64()).collect();
        for i in 0..m {
            for j in 0..n {
                let acc: f64 = (0..k).map(|p| da[i * k + p] * db[p * n + j]).sum();
                let want = acc * (sa[i] as f64 * sb[j] as f64);
                let g = got[i * n + j] as f64;
                assert!((g - want).abs() <= 1e-5 * want.abs().max(1.0), "{dev} {mode}: [{i},{j}] {g} vs {want}");
            }
        }
        let one = Tensor::new([0.5f32]).unwrap().to_device(dev).unwrap();
        let y = qa.scaled_mm(&qb, &one, &one, DType::BF16).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        assert_err(qb.t().unwrap().scaled_mm(&qb, &one, &one, DType::F32), &["two float8_e5m2"]);
        assert_err(a.scaled_mm(&qb, &one, &one, DType::F32), &["float8", "float32"]);
        assert_err(qa.scaled_mm(&qa, &one, &one, DType::F32), &["cannot be multiplied", "5x32"]);
        assert_err(qa.scaled_mm(&qb, &s_b, &s_a, DType::F32), &["tensor-wise", "row-wise"]);
        assert_err(qa.scaled_mm(&qb, &one, &one, DType::I32), &["out_dtype"]);
    });
}
