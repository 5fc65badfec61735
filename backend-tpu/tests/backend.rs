//! The PJRT backend on the XLA:CPU plugin: transfers of every dtype, views and
//! in-place writes on immutable buffers, the executable cache, Strict and
//! Debug modes (bounds checks, the NaN/Inf trap). The conformance suite in the
//! workspace's `tests/` runs every op on this device too.
mod support;

use kiln_tensor::{DType, Device, Error, HostBuffer, Tensor};
use kiln_tpu::{with_mode, Mode};
use support::setup;

const TPU: Device = Device::Tpu(0);

#[test]
fn every_dtype_round_trips() {
    setup();
    let bufs = [
        HostBuffer::Bool(vec![true, false, true]),
        HostBuffer::U8(vec![0, 7, 255]),
        HostBuffer::I8(vec![-128, 0, 127]),
        HostBuffer::I16(vec![-300, 0, 300]),
        HostBuffer::I32(vec![i32::MIN, 0, i32::MAX]),
        HostBuffer::I64(vec![i64::MIN, 0, i64::MAX]),
        HostBuffer::F16(vec![half::f16::from_f32(0.5), half::f16::NEG_INFINITY, half::f16::NAN]),
        HostBuffer::BF16(vec![half::bf16::from_f32(-1.5), half::bf16::MAX, half::bf16::from_f32(-0.0)]),
        HostBuffer::F32(vec![1.0, f32::MIN_POSITIVE, -0.0]),
        HostBuffer::F64(vec![std::f64::consts::PI, f64::MAX, f64::NEG_INFINITY]),
    ];
    for b in bufs {
        let t = Tensor::from_host(b.clone(), &[3], TPU).unwrap();
        assert_eq!(t.device(), TPU);
        let back = t.to_host().unwrap();
        assert_eq!(back.to_le_bytes(), b.to_le_bytes(), "{}", b.dtype());
    }
}

#[test]
fn views_alias_and_in_place_writes_reach_every_view() {
    setup();
    let x = Tensor::arange(0.0, 12.0, 1.0, (DType::F32, TPU)).unwrap().reshape(&[3, 4]).unwrap();
    let col = x.narrow(1, 1, 2).unwrap();
    let t = x.t().unwrap();
    let v0 = x.storage().version();
    col.add_(&Tensor::ones(&[3, 2], (DType::F32, TPU)).unwrap()).unwrap();
    assert!(x.storage().version() > v0, "an in-place write bumps the version");
    let want: Vec<f32> = vec![0., 2., 3., 3., 4., 6., 7., 7., 8., 10., 11., 11.];
    assert_eq!(x.to_vec::<f32>().unwrap(), want);
    // The transposed view reads the new buffer.
    assert_eq!(t.narrow(0, 1, 1).unwrap().to_vec::<f32>().unwrap(), vec![2., 6., 10.]);
    // A write whose source aliases the destination: x[:, 0] = x[:, 3].
    x.select(1, 0).unwrap().copy_(&x.select(1, 3).unwrap()).unwrap();
    assert_eq!(x.select(1, 0).unwrap().to_vec::<f32>().unwrap(), vec![3., 7., 11.]);
    // Strided and diagonal reads.
    assert_eq!(x.diagonal(0, 0, 1).unwrap().to_vec::<f32>().unwrap(), vec![3., 6., 11.]);
    let every_other = x.flatten(0, 1).unwrap().i(kiln_tensor::s(1, None, 2)).unwrap();
    assert_eq!(every_other.to_vec::<f32>().unwrap(), vec![2., 3., 6., 7., 10., 11.]);
}

#[test]
fn a_repeated_op_runs_the_cached_executable() {
    setup();
    let x = Tensor::ones(&[7, 5], (DType::F32, TPU)).unwrap();
    let _ = x.cos().unwrap();
    let before = kiln_tpu::stats().unwrap();
    for _ in 0..10 {
        let _ = x.cos().unwrap();
    }
    let after = kiln_tpu::stats().unwrap();
    assert!(after.hits >= before.hits + 10, "{before:?} -> {after:?}");
    kiln_tpu::sync().unwrap();
}

fn gather_out_of_range() -> Result<Tensor, Error> {
    let x = Tensor::arange(0.0, 6.0, 1.0, (DType::F32, TPU)).unwrap().reshape(&[2, 3]).unwrap();
    let idx = Tensor::from_vec(vec![0i64, 2, 1, 7], &[2, 2]).unwrap().to_device(TPU).unwrap();
    x.gather(1, &idx)
}

#[test]
fn debug_mode_turns_an_out_of_range_gather_index_into_an_error() {
    setup();
    // XLA would clamp index 7 to 2 and return a wrong value; kiln names the op and the index.
    for m in [Mode::Debug, Mode::Strict] {
        let e = with_mode(m, gather_out_of_range).unwrap_err();
        assert!(matches!(e, Error::Index { .. }), "{m:?}: {e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("gather") && msg.contains("index 7 is out of bounds for dimension 1 with size 3"),
            "{msg}"
        );
    }
    let ok = with_mode(Mode::Debug, || {
        let x = Tensor::arange(0.0, 6.0, 1.0, (DType::F32, TPU)).unwrap().reshape(&[2, 3]).unwrap();
        let idx = Tensor::from_vec(vec![2i64, 0, 1, 1], &[2, 2]).unwrap().to_device(TPU).unwrap();
        x.gather(1, &idx).unwrap().to_vec::<f32>().unwrap()
    });
    assert_eq!(ok, vec![2., 0., 4., 4.]);
}

#[test]
fn debug_mode_can_trap_the_first_non_finite_value() {
    setup();
    with_mode(Mode::Debug, || {
        kiln_tpu::set_nan_trap(true);
        let x = Tensor::from_vec(vec![1.0f32, 0.0, 4.0], &[3]).unwrap().to_device(TPU).unwrap();
        let fine = x.sqrt().unwrap();
        let e = fine.log().unwrap_err().to_string();
        assert!(e.contains("log") && e.contains("NaN or infinite"), "{e}");
        kiln_tpu::set_nan_trap(false);
        assert!(fine.log().unwrap().to_vec::<f32>().unwrap()[1].is_infinite());
    });
}

#[test]
fn modes_parse_and_apply_per_thread() {
    assert_eq!(Mode::parse("DEBUG"), Some(Mode::Debug));
    assert_eq!(Mode::parse("strict"), Some(Mode::Strict));
    assert_eq!(Mode::parse("fast"), None);
    for m in [Mode::Strict, Mode::Debug, Mode::Defer] {
        assert_eq!(Mode::parse(m.name()), Some(m));
    }
    with_mode(Mode::Debug, || {
        assert_eq!(kiln_tpu::mode(), Mode::Debug);
        let other = std::thread::spawn(kiln_tpu::mode).join().unwrap();
        assert_ne!(other, Mode::Debug, "a thread's mode does not leak into others (unless KILN_TPU_MODE says so)");
    });
}

#[test]
fn devices_beyond_the_plugins_are_refused() {
    setup();
    let n = kiln_tensor::backend_for(kiln_tensor::DeviceKind::Tpu).unwrap().device_count();
    let e = Tensor::zeros(&[2], (DType::F32, Device::Tpu(n))).unwrap_err().to_string();
    assert!(e.contains(&format!("tpu:{n} does not exist")), "{e}");
    if n > 1 {
        let y = Tensor::ones(&[2], (DType::F32, Device::Tpu(1))).unwrap();
        assert_eq!((&y + &y).to_vec::<f32>().unwrap(), vec![2., 2.]);
    }
}

#[test]
fn deferred_in_place_writes_keep_views_and_order() {
    setup();
    with_mode(Mode::Defer, || {
        let x = Tensor::zeros(&[2, 3], (DType::F32, TPU)).unwrap();
        let row = x.select(0, 1).unwrap();
        let before = x.deep_clone().unwrap(); // read before the write
        row.add_(&Tensor::ones(&[3], (DType::F32, TPU)).unwrap()).unwrap();
        let doubled = x.mul(2.0).unwrap(); // read after the write
        x.narrow(1, 0, 1).unwrap().fill_(5.0).unwrap(); // write after read
        assert_eq!(before.to_vec::<f32>().unwrap(), vec![0.0; 6]);
        assert_eq!(doubled.to_vec::<f32>().unwrap(), vec![0., 0., 0., 2., 2., 2.]);
        assert_eq!(x.to_vec::<f32>().unwrap(), vec![5., 0., 0., 5., 1., 1.]);
        assert_eq!(row.to_vec::<f32>().unwrap(), vec![5., 1., 1.]);
    });
}

#[test]
fn a_deferred_op_reads_its_input_as_it_was_when_recorded() {
    setup();
    let x = Tensor::ones(&[4], (DType::F32, TPU)).unwrap();
    kiln_tpu::sync().unwrap();
    with_mode(Mode::Defer, || {
        let y = x.mul(2.0).unwrap(); // recorded: reads x as it is now
        with_mode(Mode::Strict, || x.fill_(5.0).unwrap()); // an eager write before the program runs
        let z = x.add(1.0).unwrap(); // recorded after the write: reads the new value
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![2.0; 4]);
        assert_eq!(z.to_vec::<f32>().unwrap(), vec![6.0; 4]);
        assert_eq!(x.to_vec::<f32>().unwrap(), vec![5.0; 4]);
    });
}

#[test]
fn a_deferred_value_is_computed_when_another_thread_reads_it() {
    setup();
    let x = Tensor::arange(0.0, 4.0, 1.0, (DType::F32, TPU)).unwrap();
    let (y, w) = with_mode(Mode::Defer, || {
        let w = x.deep_clone().unwrap();
        w.mul_(10.0).unwrap(); // a deferred in-place write of a deferred value
        (x.exp().unwrap().log().unwrap().add(1.0).unwrap(), w)
    });
    let got = std::thread::spawn(move || (y.to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap())).join().unwrap();
    assert_eq!(got, (vec![1.0, 2.0, 3.0, 4.0], vec![0.0, 10.0, 20.0, 30.0]));
}

#[test]
fn deferred_index_errors_surface_at_the_op() {
    setup();
    let e = with_mode(Mode::Defer, gather_out_of_range).unwrap_err().to_string();
    assert!(e.contains("index 7 is out of bounds for dimension 1 with size 3"), "{e}");
}

#[test]
fn copies_between_devices_skip_the_host() {
    setup();
    let n = kiln_tensor::backend_for(kiln_tensor::DeviceKind::Tpu).unwrap().device_count();
    assert!(n >= 2, "the XLA:CPU plugin is set up with several devices, got {n}");
    let one = Device::Tpu(1);
    let before = kiln_tpu::stats().unwrap().device_copy_bytes;
    let x = Tensor::arange(0.0, 12.0, 1.0, DType::F32).unwrap().reshape(&[3, 4]).unwrap().to_device(TPU).unwrap();
    let y = x.to_device(one).unwrap();
    assert_eq!((y.device(), y.shape()), (one, &[3usize, 4][..]));
    assert_eq!(y.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
    // A view (transposed, narrowed) arrives as its own elements, contiguous.
    let v = x.t().unwrap().narrow(0, 1, 2).unwrap();
    let w = v.to_device(one).unwrap();
    assert!(w.is_contiguous());
    assert_eq!(w.to_vec::<f32>().unwrap(), v.to_vec::<f32>().unwrap());
    // Other dtypes, an empty tensor, and the way back, computed on.
    let b = x.to_dtype(DType::BF16).unwrap().to_device(one).unwrap();
    assert_eq!(b.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
    let i = Tensor::new([[1i64, -2], [3, i64::MAX]]).unwrap().to_device(TPU).unwrap().to_device(one).unwrap();
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![1, -2, 3, i64::MAX]);
    let e = Tensor::zeros(&[0, 3], (DType::F32, TPU)).unwrap().to_device(one).unwrap();
    assert_eq!((e.shape(), e.device()), (&[0usize, 3][..], one));
    let back = w.to_device(TPU).unwrap();
    assert_eq!(
        (&back + &v).to_vec::<f32>().unwrap(),
        v.to_vec::<f32>().unwrap().iter().map(|a| 2.0 * a).collect::<Vec<_>>()
    );
    // Every copy went device to device: 48 + 24 + 24 (bf16) + 32 + 0 + 24 bytes.
    let copied = kiln_tpu::stats().unwrap().device_copy_bytes - before;
    assert_eq!(copied, 48 + 24 + 24 + 32 + 24);
}
