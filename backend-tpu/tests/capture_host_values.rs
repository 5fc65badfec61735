//! What a compiled function may take from the host (Note [Host values]):
//! random numbers drawn inside it are fresh on every replay and equal to
//! eager ones; a host scalar that changes is never replayed stale (traced
//! every call, refused, or watched through a `HostScalar`); uploads are host
//! values; `verify` catches a function that breaks the rule; a failed trace
//! leaves the state it wrote as it was. Each runs on the CPU (a recorded
//! program) and on the PJRT device.
mod support;

use kiln_tensor::capture::HostValues;
use kiln_tensor::{constant, DType, Device, Generator, HostScalar, Tensor};
use kiln_tpu::Mode;
use std::cell::Cell;
use support::setup;

const TPU: Device = Device::Tpu(0);
/// Every test runs on both capture paths.
const DEVICES: [Device; 2] = [Device::Cpu, TPU];

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn dropout_draws_a_fresh_mask_on_every_replay_equal_to_eager() {
    setup();
    let runs = [(Device::Cpu, Mode::Strict), (TPU, Mode::Strict), (TPU, Mode::Debug), (TPU, Mode::Defer)];
    for (dev, mode) in runs {
        kiln_tpu::with_mode(mode, || {
            let g = Generator::new(dev).unwrap().manual_seed(5).unwrap();
            let mut f = kiln_tensor::capture::compile(dev, |xs: &[Tensor]| {
                constant(|| Ok(vec![xs[0].dropout_with(0.5, true, &g)?]))
            });
            let x = Tensor::ones(&[64], (DType::F32, dev)).unwrap();
            let masks: Vec<Vec<u32>> = (0..8).map(|_| bits(&f.call(std::slice::from_ref(&x)).unwrap()[0])).collect();
            let s = f.stats();
            assert_eq!((s.calls, s.traces, s.replays, s.host_value_traces), (8, 2, 6, 0), "{dev} {mode:?}: {s:?}");
            let mut distinct = masks.clone();
            distinct.sort();
            distinct.dedup();
            assert!(distinct.len() >= 7, "{dev} {mode:?}: {} distinct masks of 8", distinct.len());
            // The same seed eagerly, on the CPU: the same masks, call by call.
            let gc = Generator::new(Device::Cpu).unwrap().manual_seed(5).unwrap();
            let xc = Tensor::ones(&[64], DType::F32).unwrap();
            for (i, m) in masks.iter().enumerate() {
                assert_eq!(&bits(&xc.dropout_with(0.5, true, &gc).unwrap()), m, "{dev} {mode:?}: call {i}");
            }
            // The generator advanced exactly as the eager one did.
            assert_eq!(
                g.get_state().unwrap().to_vec::<i64>().unwrap(),
                gc.get_state().unwrap().to_vec::<i64>().unwrap()
            );
        });
    }
}

#[test]
fn a_host_scalar_that_changes_is_traced_again_never_replayed_stale() {
    setup();
    for dev in DEVICES {
        let scale = Cell::new(1.0);
        let mut f = kiln_tensor::capture::compile(dev, |xs: &[Tensor]| Ok(vec![xs[0].mul(scale.get())?]));
        let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap().to_device(dev).unwrap();
        for i in 0..8 {
            if i == 5 {
                scale.set(3.0);
            }
            let y = f.call(std::slice::from_ref(&x)).unwrap()[0].to_vec::<f32>().unwrap();
            let s = scale.get() as f32;
            assert_eq!(y, vec![s, 2.0 * s], "call {i}");
        }
        let s = f.stats().clone();
        assert_eq!((s.traces, s.replays, s.host_value_traces), (8, 0, 8), "{s:?}");
        let why = s.last_host_value.unwrap();
        assert!(why.contains("mul") && why.contains("host scalar 3"), "{why}");
    }
}

#[test]
fn host_values_can_be_refused_with_an_error_naming_the_op() {
    setup();
    for dev in DEVICES {
        let w = Tensor::from_vec(vec![1.0f32, 1.0], &[2]).unwrap().to_device(dev).unwrap();
        let mut f = kiln_tensor::capture::compile(dev, |_: &[Tensor]| {
            w.add_(1.0)?; // written before the refusal: put back when the trace fails
            Ok(vec![w.mul(2.5)?])
        })
        .host_values(HostValues::Refuse);
        let e = f.call(&[]).unwrap_err().to_string();
        assert!(e.contains("add: the host scalar 1 (float32)") && e.contains("HostValues::Refuse"), "{e}");
        assert!(e.contains("kiln::constant") && e.contains("kiln::HostScalar"), "{e}");
        assert!(!kiln_tensor::trace::is_tracing());
        assert_eq!(w.to_vec::<f32>().unwrap(), vec![1.0, 1.0], "the failed trace's write is undone");
        // Declared constants pass.
        let mut g = kiln_tensor::capture::compile(dev, |_: &[Tensor]| constant(|| Ok(vec![w.mul(2.5)?])))
            .host_values(HostValues::Refuse);
        for _ in 0..3 {
            assert_eq!(g.call(&[]).unwrap()[0].to_vec::<f32>().unwrap(), vec![2.5, 2.5]);
        }
        assert_eq!(g.stats().replays, 1);
    }
}

#[test]
fn a_watched_host_scalar_replays_until_it_changes() {
    setup();
    for dev in DEVICES {
        let scale = HostScalar::new("scale", 1.0);
        let mut f = kiln_tensor::capture::compile(dev, |xs: &[Tensor]| Ok(vec![xs[0].mul(&scale)?]));
        let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap().to_device(dev).unwrap();
        let run = |f: &mut kiln_tensor::capture::Compiled<_>| {
            f.call(std::slice::from_ref(&x)).unwrap()[0].to_vec::<f32>().unwrap()
        };
        for _ in 0..5 {
            assert_eq!(run(&mut f), vec![1.0, 2.0]);
        }
        assert_eq!((f.stats().traces, f.stats().replays), (2, 3));
        scale.set(3.0);
        for _ in 0..3 {
            assert_eq!(run(&mut f), vec![3.0, 6.0]);
        }
        let s = f.stats().clone();
        assert_eq!((s.retraces, s.host_value_traces), (1, 0), "{s:?}");
        assert!(s.last_retrace.as_deref().unwrap().contains("watched value scale changed"), "{s:?}");
        // Traced twice with the new value (stable again), then replayed.
        assert_eq!((s.traces, s.replays), (4, 4), "{s:?}");
        // error_on_retrace makes the change an error instead.
        let mut g =
            kiln_tensor::capture::compile(dev, |xs: &[Tensor]| Ok(vec![xs[0].mul(&scale)?])).error_on_retrace(true);
        for _ in 0..3 {
            g.call(std::slice::from_ref(&x)).unwrap();
        }
        scale.set(4.0);
        let e = g.call(std::slice::from_ref(&x)).unwrap_err().to_string();
        assert!(e.contains("retrace refused") && e.contains("scale"), "{e}");
    }
}

#[test]
fn uploads_inside_a_traced_function_are_host_values() {
    setup();
    for dev in DEVICES {
        let fill = Cell::new(2.0f32);
        let mut f = kiln_tensor::capture::compile(dev, |xs: &[Tensor]| {
            let m = Tensor::from_vec(vec![fill.get(); 2], &[2])?.to_device(dev)?;
            Ok(vec![xs[0].mul(&m)?])
        })
        .host_values(HostValues::Retrace);
        let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap().to_device(dev).unwrap();
        for i in 0..6 {
            if i == 3 {
                fill.set(5.0);
            }
            let y = f.call(std::slice::from_ref(&x)).unwrap()[0].to_vec::<f32>().unwrap();
            assert_eq!(y, vec![fill.get(), 2.0 * fill.get()], "call {i}");
        }
        let s = f.stats().clone();
        assert_eq!((s.replays, s.host_value_traces), (0, 6), "{s:?}");
        assert!(s.last_host_value.unwrap().contains("uploaded"));
    }
}

#[test]
fn verify_catches_a_constant_that_was_not_one() {
    setup();
    for dev in DEVICES {
        let scale = Cell::new(1.0);
        let mut f = kiln_tensor::capture::compile(dev, |xs: &[Tensor]| Ok(vec![xs[0].mul(scale.get())?]))
            .host_values(HostValues::Constant)
            .verify(true);
        let x = Tensor::ones(&[2], (DType::F32, dev)).unwrap();
        for _ in 0..4 {
            f.call(std::slice::from_ref(&x)).unwrap();
        }
        scale.set(3.0);
        let e = f.call(std::slice::from_ref(&x)).unwrap_err().to_string();
        assert!(e.contains("verify") && e.contains("a constant computed on the host changed"), "{e}");
        // Without verify the promise is the caller's: the traced value is replayed.
        let mut g = kiln_tensor::capture::compile(dev, |xs: &[Tensor]| Ok(vec![xs[0].mul(scale.get())?]))
            .host_values(HostValues::Constant);
        for _ in 0..3 {
            g.call(std::slice::from_ref(&x)).unwrap();
        }
        assert_eq!(g.stats().replays, 1);
    }
}

/// A trace that fails after writing state puts the state back, on either
/// tracer: the failed call leaves no half-done step behind.
#[test]
fn a_failed_trace_puts_back_the_state_it_wrote() {
    setup();
    for dev in DEVICES {
        let w = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap().to_device(dev).unwrap();
        let g = Generator::new(dev).unwrap().manual_seed(3).unwrap();
        let before = g.get_state().unwrap().to_vec::<i64>().unwrap();
        let mut f = kiln_tensor::capture::compile(dev, |xs: &[Tensor]| {
            w.add_(&xs[0])?; // written, then the trace fails
            w.mul_(&constant(|| xs[0].dropout_with(0.5, true, &g))?)?;
            let total = w.sum()?.item::<f32>()?; // reading data while tracing: an error
            Ok(vec![w.mul(total as f64)?])
        });
        let x = Tensor::ones(&[2], (DType::F32, dev)).unwrap();
        let e = f.call(std::slice::from_ref(&x)).unwrap_err().to_string();
        assert!(e.contains("inside a function traced by kiln::compile"), "{dev}: {e}");
        assert_eq!(w.to_vec::<f32>().unwrap(), vec![1.0, 2.0], "{dev}: the writes are undone");
        assert_eq!(g.get_state().unwrap().to_vec::<i64>().unwrap(), before, "{dev}: the generator too");
    }
}
