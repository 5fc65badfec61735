//! `Display` prints like PyTorch's `repr`: element formatting, nesting, line
//! wrapping, summarisation, and the dtype/device/grad suffixes.
use crate::{iota, on_devices, t};
use kiln::prelude::*;

/// PyTorch's suffix for the device, empty on the CPU.
fn dev_suffix(dev: Device) -> String {
    if dev == Device::Cpu {
        String::new()
    } else {
        format!(", device='{dev}'")
    }
}

#[test]
fn floats_like_pytorch() {
    on_devices(|dev| {
        let d = dev_suffix(dev);
        assert_eq!(
            t([[1.0f32, 2.0], [3.0, 4.0]], dev).to_string(),
            format!("tensor([[1., 2.],\n        [3., 4.]]{d})")
        );
        assert_eq!(t([0.5f32, -1.25, 10.0], dev).to_string(), format!("tensor([ 0.5000, -1.2500, 10.0000]{d})"));
        assert_eq!(t([1e-5f32, 1.0], dev).to_string(), format!("tensor([1.0000e-05, 1.0000e+00]{d})"));
        assert_eq!(t([1.0f32, 1e9], dev).to_string(), format!("tensor([1.0000e+00, 1.0000e+09]{d})"));
        assert_eq!(t([0.1f32, 1000.0], dev).to_string(), format!("tensor([1.0000e-01, 1.0000e+03]{d})"));
        assert_eq!(
            t([f32::NAN, 1.0, f32::INFINITY, f32::NEG_INFINITY], dev).to_string(),
            format!("tensor([nan, 1., inf, -inf]{d})")
        );
        assert_eq!(t([0.0f32, -0.0], dev).to_string(), format!("tensor([0., -0.]{d})"));
        assert_eq!(t(2.5f32, dev).to_string(), format!("tensor(2.5000{d})"));
        assert_eq!(t(-3.0f32, dev).to_string(), format!("tensor(-3.{d})"));
        assert_eq!(t([0.3333333f32], dev).to_string(), format!("tensor([0.3333]{d})"));
        assert_eq!(format!("{:.2}", t([0.3333333f32, 2.0], dev)), format!("tensor([0.33, 2.00]{d})"));
        Ok(())
    });
}

#[test]
fn ints_bools_and_dtype_suffixes() {
    on_devices(|dev| {
        let d = dev_suffix(dev);
        assert_eq!(t([1i64, -20, 3], dev).to_string(), format!("tensor([  1, -20,   3]{d})"));
        assert_eq!(t([1i32, 2], dev).to_string(), format!("tensor([1, 2]{d}, dtype=int32)"));
        assert_eq!(t([7u8], dev).to_string(), format!("tensor([7]{d}, dtype=uint8)"));
        assert_eq!(t([true, false], dev).to_string(), format!("tensor([ True, False]{d})"));
        assert_eq!(t([1.5f64], dev).to_string(), format!("tensor([1.5000]{d}, dtype=float64)"));
        let h = t([1.0f32, 2.5], dev).to_dtype(DType::BF16)?;
        assert_eq!(h.to_string(), format!("tensor([1.0000, 2.5000]{d}, dtype=bfloat16)"));
        let h = t([1.0f32, 2.0], dev).to_dtype(DType::F16)?;
        assert_eq!(h.to_string(), format!("tensor([1., 2.]{d}, dtype=float16)"));
        assert_eq!(t(i64::MIN, dev).to_string(), format!("tensor(-9223372036854775808{d})"));
        Ok(())
    });
}

#[test]
fn nesting_views_and_empty_tensors() {
    on_devices(|dev| {
        let d = dev_suffix(dev);
        let x = iota(&[2, 2, 2], dev);
        let want = format!("tensor([[[0., 1.],\n         [2., 3.]],\n\n        [[4., 5.],\n         [6., 7.]]]{d})");
        assert_eq!(x.to_string(), want);
        // A view prints its own (logical) elements.
        let v = iota(&[2, 3], dev).t()?;
        assert_eq!(v.to_string(), format!("tensor([[0., 3.],\n        [1., 4.],\n        [2., 5.]]{d})"));
        assert_eq!(iota(&[2, 3], dev).i((.., 1))?.to_string(), format!("tensor([1., 4.]{d})"));
        assert_eq!(Tensor::zeros(&[0], (DType::F32, dev))?.to_string(), format!("tensor([]{d})"));
        assert_eq!(Tensor::zeros(&[2, 0], (DType::F32, dev))?.to_string(), format!("tensor([]{d}, size=(2, 0))"));
        assert_eq!(Tensor::zeros(&[0], (DType::I64, dev))?.to_string(), format!("tensor([]{d}, dtype=int64)"));
        Ok(())
    });
}

#[test]
fn long_rows_wrap_and_large_tensors_are_summarised() {
    on_devices(|dev| {
        let d = dev_suffix(dev);
        // 14 items of width 3 (+2 for ", ") fit in 80 columns after the 7-column indent.
        let want = format!(
            "tensor([ 0.,  1.,  2.,  3.,  4.,  5.,  6.,  7.,  8.,  9., 10., 11., 12., 13.,\n        \
             14., 15., 16., 17., 18., 19.]{d})"
        );
        assert_eq!(iota(&[20], dev).to_string(), want);
        let big = Tensor::arange(1000.0, 3000.0, 1.0, (DType::F32, dev))?;
        assert_eq!(big.to_string(), format!("tensor([1000., 1001., 1002.,  ..., 2997., 2998., 2999.]{d})"));
        // The notation is chosen from the printed elements only: 1999 / 1 > 1000 means
        // scientific, and 6 items of width 10 fill a line (PyTorch prints the same).
        let big = iota(&[2000], dev);
        assert_eq!(
            big.to_string(),
            format!(
                "tensor([0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 1.9970e+03, 1.9980e+03,\n        1.9990e+03]{d})"
            )
        );
        let m = iota(&[100, 11], dev).to_dtype(DType::I32)?;
        let s = m.to_string();
        let lines: Vec<&str> = s.lines().collect();
        assert!(lines.len() >= 7, "3 rows, `...`, 3 rows:\n{s}");
        assert_eq!(lines[0], "tensor([[   0,    1,    2,  ...,    8,    9,   10],");
        assert_eq!(lines[1], "        [  11,   12,   13,  ...,   19,   20,   21],");
        assert_eq!(lines[3], "        ...,");
        assert!(lines[6].starts_with("        [1089, 1090, 1091,  ..., 1097, 1098, 1099]]"), "{s}");
        if dev == Device::Cpu {
            assert_eq!(lines[6], "        [1089, 1090, 1091,  ..., 1097, 1098, 1099]], dtype=int32)");
        } else {
            // The device suffix pushes the dtype past 80 columns: PyTorch moves it to a new line.
            assert!(s.ends_with(",\n       dtype=int32)"), "{s}");
        }
        // Exactly 1000 elements are printed in full.
        assert!(!iota(&[1000], dev).to_string().contains("..."));
        Ok(())
    });
}

#[test]
fn grad_suffixes() {
    on_devices(|dev| {
        let d = dev_suffix(dev);
        let w = t([1.0f32, 2.0], dev);
        w.requires_grad_(true)?;
        assert_eq!(w.to_string(), format!("tensor([1., 2.]{d}, requires_grad=True)"));
        let y = w.mul(2.0)?;
        let s = y.to_string();
        assert!(s.starts_with("tensor([2., 4.]") && s.contains(", grad_fn=<") && s.ends_with("Backward>)"), "{s}");
        assert_eq!(w.detach().to_string(), format!("tensor([1., 2.]{d})"));
        Ok(())
    });
}
