//! Creation and conversion: zeros/ones/full/arange/linspace/eye, the seeded random
//! constructors, from_vec/from_slice/new, ndarray in and out, `*_like`, `to_dtype`
//! between every pair of dtypes, `item`, `to_vec` and `to_device`.
use crate::common::{assert_err, assert_exact, f64s};
use crate::{on_devices, t};
use half::{bf16, f16};
use kiln::prelude::*;
use std::sync::Mutex;

/// The generator is global: tests that seed it and draw from it run one at a time.
pub(crate) static RNG: Mutex<()> = Mutex::new(());

#[test]
fn zeros_ones_full_every_dtype() {
    on_devices(|dev| {
        for dt in DType::ALL {
            let z = Tensor::zeros(&[2, 3], (dt, dev))?;
            assert_exact(&z, dt, &[2, 3], &[0.0; 6]);
            assert_eq!(z.device(), dev);
            assert!(z.is_contiguous() && !z.is_view());
            assert_exact(&Tensor::ones(&[3], (dt, dev))?, dt, &[3], &[1.0; 3]);
            let seven = if dt == DType::Bool { 1.0 } else { 7.0 };
            assert_exact(&Tensor::full(&[2, 1], 7, (dt, dev))?, dt, &[2, 1], &[seven; 2]);
        }
        // Defaults: float32 on the CPU.
        let d = Tensor::zeros(&[2], DType::F32)?;
        assert_eq!((d.dtype(), d.device()), (DType::F32, Device::Cpu));
        assert_exact(&Tensor::full(&[], -2.5, (DType::F64, dev))?, DType::F64, &[], &[-2.5]);
        assert_exact(&Tensor::zeros(&[0, 3], (DType::F32, dev))?, DType::F32, &[0, 3], &[]);
        assert_exact(&Tensor::scalar(3, (DType::I32, dev))?, DType::I32, &[], &[3.0]);
        Ok(())
    });
}

#[test]
fn arange_follows_pytorch() {
    on_devices(|dev| {
        assert_exact(&Tensor::arange(0.0, 5.0, 2.0, (DType::I64, dev))?, DType::I64, &[3], &[0.0, 2.0, 4.0]);
        assert_exact(&Tensor::arange(5.0, 0.0, -2.0, (DType::I32, dev))?, DType::I32, &[3], &[5.0, 3.0, 1.0]);
        // ceil((end - start) / step) elements.
        let a = Tensor::arange(1.0, 2.0, 0.25, (DType::F32, dev))?;
        assert_exact(&a, DType::F32, &[4], &[1.0, 1.25, 1.5, 1.75]);
        assert_exact(&Tensor::arange(3.0, 3.0, 1.0, (DType::F32, dev))?, DType::F32, &[0], &[]);
        assert_err(Tensor::arange(0.0, 1.0, 0.0, DType::F32), &["arange", "step"]);
        assert_err(Tensor::arange(0.0, 5.0, -1.0, DType::F32), &["arange", "inconsistent with step sign"]);
        Ok(())
    });
}

#[test]
fn linspace_and_eye() {
    on_devices(|dev| {
        let l = Tensor::linspace(0.0, 1.0, 5, (DType::F32, dev))?;
        assert_exact(&l, DType::F32, &[5], &[0.0, 0.25, 0.5, 0.75, 1.0]);
        assert_eq!(l.device(), dev);
        // PyTorch fills from both ends: the last element is exactly `end`.
        let l = Tensor::linspace(-1.0, 0.3, 7, (DType::F64, dev))?;
        assert_eq!(*f64s(&l).last().unwrap(), 0.3);
        assert_eq!(f64s(&l)[0], -1.0);
        assert_exact(&Tensor::linspace(2.0, 9.0, 1, (DType::F32, dev))?, DType::F32, &[1], &[2.0]);
        assert_exact(&Tensor::linspace(2.0, 9.0, 0, (DType::F32, dev))?, DType::F32, &[0], &[]);
        let e = Tensor::eye(3, (DType::I64, dev))?;
        assert_exact(&e, DType::I64, &[3, 3], &[1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]);
        assert_eq!(e.device(), dev);
        assert_exact(&Tensor::eye(2, (DType::Bool, dev))?, DType::Bool, &[2, 2], &[1.0, 0.0, 0.0, 1.0]);
        Ok(())
    });
}

#[test]
fn random_constructors_are_seeded_and_in_range() {
    let _g = RNG.lock().unwrap_or_else(|e| e.into_inner());
    on_devices(|dev| {
        kiln::manual_seed(1234);
        let a = Tensor::rand(&[200], (DType::F32, dev))?;
        let b = Tensor::randn(&[4, 50], (DType::F64, dev))?;
        let c = Tensor::randint(-3, 4, &[300], (DType::I64, dev))?;
        kiln::manual_seed(1234);
        let a2 = Tensor::rand(&[200], (DType::F32, dev))?;
        let b2 = Tensor::randn(&[4, 50], (DType::F64, dev))?;
        let c2 = Tensor::randint(-3, 4, &[300], (DType::I64, dev))?;
        assert_eq!(f64s(&a), f64s(&a2), "same seed, same rand");
        assert_eq!(f64s(&b), f64s(&b2), "same seed, same randn");
        assert_eq!(f64s(&c), f64s(&c2), "same seed, same randint");
        assert_eq!((a.dtype(), b.dtype(), c.dtype()), (DType::F32, DType::F64, DType::I64));
        assert_eq!(b.shape(), &[4, 50]);
        assert_eq!(a.device(), dev);

        let av = f64s(&a);
        assert!(av.iter().all(|&x| (0.0..1.0).contains(&x)), "rand in [0, 1)");
        assert!(av.windows(2).any(|w| w[0] != w[1]), "rand is not constant");
        let cv = f64s(&c);
        assert!(cv.iter().all(|&x| (-3.0..4.0).contains(&x) && x.fract() == 0.0), "randint in [low, high)");
        for k in -3..4 {
            assert!(cv.contains(&(k as f64)), "randint never drew {k} in 300 draws");
        }
        let bv = f64s(&b);
        let mean = bv.iter().sum::<f64>() / bv.len() as f64;
        let var = bv.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / bv.len() as f64;
        assert!(mean.abs() < 0.3 && (0.6..1.5).contains(&var), "randn moments: mean {mean}, var {var}");

        // Another seed gives another stream.
        kiln::manual_seed(99);
        assert_ne!(f64s(&Tensor::rand(&[200], (DType::F32, dev))?), av);
        let r = Tensor::rand(&[3], (DType::BF16, dev))?;
        assert_eq!(r.dtype(), DType::BF16);
        let like = a.rand_like()?;
        assert_eq!((like.shape(), like.dtype(), like.device()), (a.shape(), DType::F32, dev));
        let like = b.randn_like()?;
        assert_eq!((like.shape(), like.dtype()), (b.shape(), DType::F64));
        Ok(())
    });
    assert_err(Tensor::rand(&[2], DType::I64), &["rand", "floating point", "int64"]);
    assert_err(Tensor::randn(&[2], DType::Bool), &["randn", "floating point"]);
    assert_err(Tensor::randint(5, 5, &[2], DType::I64), &["randint", "from=5 >= to=5"]);
}

#[test]
fn from_vec_slice_and_new() -> Result<()> {
    let a = Tensor::from_vec(vec![1i32, 2, 3, 4, 5, 6], &[2, 3])?;
    assert_exact(&a, DType::I32, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    assert_eq!(a.device(), Device::Cpu);
    let b = Tensor::from_slice(&[bf16::from_f32(1.5), bf16::from_f32(-2.0)], &[2])?;
    assert_exact(&b, DType::BF16, &[2], &[1.5, -2.0]);
    let h = Tensor::from_slice(&[f16::from_f32(0.5)], &[])?;
    assert_exact(&h, DType::F16, &[], &[0.5]);
    assert_exact(&Tensor::from_vec(vec![true, false], &[2, 1])?, DType::Bool, &[2, 1], &[1.0, 0.0]);
    assert_exact(&Tensor::from_vec(Vec::<f32>::new(), &[0])?, DType::F32, &[0], &[]);
    assert_err(Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[2, 2]), &["from_vec", "[2, 2]", "size 3"]);

    assert_exact(&Tensor::new(2.5f64)?, DType::F64, &[], &[2.5]);
    assert_exact(&Tensor::new([1u8, 255])?, DType::U8, &[2], &[1.0, 255.0]);
    assert_exact(&Tensor::new([[1i8, -2], [3, -4]])?, DType::I8, &[2, 2], &[1.0, -2.0, 3.0, -4.0]);
    let cube = Tensor::new([[[1i16], [2]], [[3], [4]]])?;
    assert_exact(&cube, DType::I16, &[2, 2, 1], &[1.0, 2.0, 3.0, 4.0]);
    assert_exact(&Tensor::new(vec![1i64, 2])?, DType::I64, &[2], &[1.0, 2.0]);
    assert_exact(&Tensor::new(&[0.5f32, 1.5][..])?, DType::F32, &[2], &[0.5, 1.5]);
    Ok(())
}

#[test]
fn ndarray_round_trip() {
    on_devices(|dev| {
        let x = crate::iota(&[2, 3], dev);
        let a = x.to_ndarray::<f32>()?;
        assert_eq!(a.shape(), &[2, 3]);
        assert_eq!(a[&[1, 2][..]], 5.0);
        // A transposed (non-standard layout) array comes in in its logical order.
        let back = Tensor::try_from(&a.t())?;
        assert_exact(&back, DType::F32, &[3, 2], &[0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        let owned = Tensor::from_ndarray(a.t().to_owned())?;
        assert_exact(&owned, DType::F32, &[3, 2], &[0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        let b: Tensor = Tensor::try_from(&a)?;
        assert_exact(&b, DType::F32, &[2, 3], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        // A view tensor reads out in its logical order.
        let v = x.t()?.to_ndarray::<f32>()?;
        assert_eq!(v.shape(), &[3, 2]);
        assert_eq!(v.iter().copied().collect::<Vec<_>>(), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        assert_err(x.to_ndarray::<f64>(), &["to_vec", "float64", "float32"]);
        Ok(())
    });
}

/// `from_ndarray` takes a standard-layout array's buffer as the tensor's
/// storage, and `view_ndarray` shows a CPU tensor's elements in place, with
/// its strides, while writers wait.
#[test]
fn ndarray_without_copies() -> Result<()> {
    let a = kiln::tensor::ndarray::Array::from_shape_vec((2, 3), vec![0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
    let ptr = a.as_ptr();
    let x = Tensor::from_ndarray(a)?;
    assert_exact(&x, DType::F32, &[2, 3], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    {
        let v = x.view_ndarray::<f32>()?;
        assert_eq!(v.view().as_ptr(), ptr, "the array's buffer is the tensor's storage");
        assert_eq!(v.view().shape(), &[2, 3]);
    }
    // Views keep their strides and offset: transposed, sliced, broadcast.
    let tt = x.t()?;
    let v = tt.view_ndarray::<f32>()?;
    assert_eq!(v.view().shape(), &[3, 2]);
    assert_eq!(v.view().as_ptr(), ptr);
    assert_eq!(v.view().iter().copied().collect::<Vec<_>>(), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    let row = x.narrow(0, 1, 1)?.squeeze_dim(0)?;
    let r = row.view_ndarray::<f32>()?;
    assert_eq!(r.view().iter().copied().collect::<Vec<_>>(), vec![3.0, 4.0, 5.0]);
    let wide = row.unsqueeze(0)?.expand(&[4, 3])?;
    let w = wide.view_ndarray::<f32>()?;
    assert_eq!(w.view().shape(), &[4, 3]);
    assert_eq!(w.view().sum(), 48.0);
    // A sliced-away or off-the-front array still comes in by value.
    let mut b = kiln::tensor::ndarray::Array::from_shape_vec(4, vec![1i64, 2, 3, 4]).unwrap();
    b.slice_collapse(kiln::tensor::ndarray::s![1..3]);
    assert_exact(&Tensor::from_ndarray(b)?, DType::I64, &[2], &[2.0, 3.0]);
    // Empty tensors and scalars.
    let e = Tensor::zeros(&[0, 3], DType::F32)?;
    assert_eq!(e.view_ndarray::<f32>()?.view().shape(), &[0, 3]);
    let s = Tensor::new(7.0f64)?;
    assert_eq!(s.view_ndarray::<f64>()?.view().sum(), 7.0);
    // Wrong element type: an error, not a reinterpretation.
    assert_err(x.view_ndarray::<f64>().map(|_| ()), &["view_ndarray", "float64", "float32"]);
    drop((v, r, w));
    // While a view lives, a writer on another thread waits for it.
    let held = x.view_ndarray::<f32>()?;
    let writer = {
        let x = x.clone();
        std::thread::spawn(move || x.fill_(9.0).map(|_| ()))
    };
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(held.view()[[0, 0]], 0.0, "the write waits for the view");
    drop(held);
    writer.join().unwrap()?;
    assert_eq!(x.view_ndarray::<f32>()?.view()[[1, 2]], 9.0);
    Ok(())
}

#[test]
fn view_ndarray_refuses_device_tensors() {
    on_devices(|dev| {
        let x = Tensor::zeros(&[2], (DType::F32, dev))?;
        if dev == Device::Cpu {
            assert_eq!(x.view_ndarray::<f32>()?.view().len(), 2);
        } else {
            assert_err(x.view_ndarray::<f32>().map(|_| ()), &["view_ndarray", "CPU"]);
        }
        Ok(())
    });
}

#[test]
fn like_constructors_keep_shape_dtype_device() {
    on_devices(|dev| {
        let x = t([[1i32, 2, 3]], dev);
        for (y, want) in
            [(x.zeros_like()?, 0.0), (x.ones_like()?, 1.0), (x.empty_like()?, 0.0), (x.full_like(-4)?, -4.0)]
        {
            assert_exact(&y, DType::I32, &[1, 3], &[want; 3]);
            assert_eq!(y.device(), dev);
            assert!(!y.shares_storage(&x));
        }
        // `*_like` of a view is a fresh contiguous tensor of the view's shape.
        let v = crate::iota(&[2, 3], dev).t()?;
        let z = v.zeros_like()?;
        assert_eq!((z.shape(), z.strides()), (&[3, 2][..], &[2, 1][..]));
        Ok(())
    });
}

/// Values that every dtype holds exactly (bool: non-zero is true).
// Exact in every dtype, float8 included.
const CAST_VALUES: [f64; 4] = [0.0, 1.0, 3.0, 96.0];

fn make(dt: DType, dev: Device) -> Result<Tensor> {
    Tensor::from_vec(CAST_VALUES.to_vec(), &[4])?.to_dtype(dt)?.to_device(dev)
}

#[test]
fn to_dtype_every_pair() {
    on_devices(|dev| {
        for from in DType::ALL {
            let x = make(from, dev)?;
            let src: Vec<f64> = if from == DType::Bool {
                CAST_VALUES.iter().map(|&v| (v != 0.0) as u8 as f64).collect()
            } else {
                CAST_VALUES.to_vec()
            };
            assert_exact(&x, from, &[4], &src);
            for to in DType::ALL {
                let y = x.to_dtype(to)?;
                let want: Vec<f64> = if to == DType::Bool {
                    src.iter().map(|&v| (v != 0.0) as u8 as f64).collect()
                } else {
                    src.clone()
                };
                assert_exact(&y, to, &[4], &want);
                assert_eq!(y.device(), dev, "{from} -> {to} stays on the device");
                if to == from {
                    assert!(y.same(&x), "to_dtype to the same dtype returns the tensor itself");
                } else {
                    assert!(!y.shares_storage(&x), "{from} -> {to} copies");
                }
            }
        }
        // A strided view converts in its logical order.
        let v = crate::iota(&[2, 3], dev).t()?.to_dtype(DType::I16)?;
        assert_exact(&v, DType::I16, &[3, 2], &[0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        Ok(())
    });
}

#[test]
fn to_dtype_rounding_and_truncation() {
    on_devices(|dev| {
        // f32 -> bf16 rounds to nearest, ties to even; past the largest bf16 -> inf; NaN stays NaN.
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7 (rounds to even: 1); 1 + 3 * 2^-8 is halfway
        // between 1 + 2^-7 and 1 + 2^-6 (rounds to even: 1 + 2^-6); one f32 ulp above a tie rounds up.
        let tie = 1.0 + 2f32.powi(-8);
        let tie_odd = 1.0 + 3.0 * 2f32.powi(-8);
        let above_tie = f32::from_bits(tie.to_bits() + 1);
        let x = t([tie, tie_odd, -tie, above_tie, f32::MAX, -3.4e38, 3.3895e38, f32::NAN, 1e-40], dev);
        let b = x.to_dtype(DType::BF16)?;
        let want = [1.0, 1.015625, -1.0, 1.0078125, f64::INFINITY, f64::NEG_INFINITY, 3.3895313892515355e38];
        assert_eq!(b.dtype(), DType::BF16);
        let got = f64s(&b);
        for (i, w) in want.iter().enumerate() {
            assert_eq!(got[i], *w, "bf16 of element {i}");
        }
        assert!(got[7].is_nan(), "NaN stays NaN");
        // A subnormal rounds like any other value: 1e-40 has f32 bits 0x000116C2 -> bf16 0x0001.
        assert_eq!(bf16::from_f64(got[8]).to_bits(), 0x0001, "subnormal rounding");
        // bf16 -> f32 is exact.
        assert_exact(&b.to_dtype(DType::F32)?.i(0..2)?, DType::F32, &[2], &[1.0, 1.015625]);
        // f32 -> f16: RNE, overflow to inf.
        let h = t([70000.0f32, 1.0 + 1.0 / 2048.0, -0.0], dev).to_dtype(DType::F16)?;
        assert_exact(&h, DType::F16, &[3], &[f64::INFINITY, 1.0, -0.0]);

        // Float -> int truncates toward zero.
        let f = t([-2.7f32, -0.5, 0.5, 2.7, 127.9], dev);
        assert_exact(&f.to_dtype(DType::I64)?, DType::I64, &[5], &[-2.0, 0.0, 0.0, 2.0, 127.0]);
        assert_exact(&f.to_dtype(DType::I8)?, DType::I8, &[5], &[-2.0, 0.0, 0.0, 2.0, 127.0]);
        let pos = t([0.9f64, 200.5], dev);
        assert_exact(&pos.to_dtype(DType::U8)?, DType::U8, &[2], &[0.0, 200.0]);
        // Float -> bool: non-zero (NaN included) is true, -0.0 is false.
        let z = t([0.0f32, -0.0, 0.1, f32::NAN, f32::NEG_INFINITY], dev).to_dtype(DType::Bool)?;
        assert_exact(&z, DType::Bool, &[5], &[0.0, 0.0, 1.0, 1.0, 1.0]);
        // int -> narrower int wraps like C (two's complement).
        assert_exact(&t([300i64, -1], dev).to_dtype(DType::U8)?, DType::U8, &[2], &[44.0, 255.0]);
        assert_exact(&t([200i32], dev).to_dtype(DType::I8)?, DType::I8, &[1], &[-56.0]);
        // Large int64 survive a round trip through int64 exactly.
        let big = t([9_007_199_254_740_993i64], dev);
        assert_eq!(big.to_dtype(DType::I64)?.to_vec::<i64>()?, vec![9_007_199_254_740_993]);
        assert_eq!(big.to_dtype(DType::F64)?.to_vec::<f64>()?, vec![9_007_199_254_740_992.0]);
        Ok(())
    });
}

#[test]
fn item_and_to_vec() {
    on_devices(|dev| {
        assert_eq!(t(3.5f32, dev).item::<f32>()?, 3.5);
        assert_eq!(t([[7i64]], dev).item::<i64>()?, 7);
        assert!(t(true, dev).item::<bool>()?);
        assert_eq!(t([2u8], dev).item_f64()?, 2.0);
        assert_eq!(crate::iota(&[2, 3], dev).i((1, 2))?.item::<f32>()?, 5.0);
        assert_err(
            t([1.0f32, 2.0], dev).item::<f32>(),
            &["item", "a Tensor with 2 elements cannot be converted to Scalar"],
        );
        assert_err(t([1.0f32, 2.0], dev).item_f64(), &["2 elements"]);
        assert_err(t(1.0f32, dev).item::<f64>(), &["float64", "float32"]);
        assert_err(t([1i32, 2], dev).to_vec::<i64>(), &["to_vec", "int64", "int32"]);
        assert_err(t([1.0f32], dev).to_vec::<bf16>(), &["to_vec", "bfloat16", "float32"]);
        assert_eq!(t([1i32, 2], dev).to_vec::<i32>()?, vec![1, 2]);
        assert_eq!(t([true, false], dev).to_vec_f64()?, vec![1.0, 0.0]);
        Ok(())
    });
}

#[test]
fn to_device_round_trip_and_unknown_device() {
    on_devices(|dev| {
        let x = crate::iota(&[2, 3], dev).to_dtype(DType::BF16)?;
        for other in crate::devices() {
            let y = x.to_device(other)?;
            assert_eq!((y.device(), y.dtype(), y.shape()), (other, DType::BF16, x.shape()));
            assert_eq!(f64s(&y), f64s(&x));
            if other == dev {
                assert!(y.same(&x), "to_device to the same device returns the tensor itself");
            }
        }
        // A strided view moves in its logical order.
        let v = crate::iota(&[2, 3], dev).t()?.to_device(Device::Cpu)?;
        assert_eq!(v.to_vec::<f32>()?, vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        assert_err(x.to_device(Device::Tpu(97)), &["tpu:97"]);
        assert_err(Tensor::zeros(&[1], (DType::F32, Device::PrivateUse1(5))), &["privateuse1:5"]);
        Ok(())
    });
}
