//! `kiln::compile` on the CPU (a recorded program, interpreted) and on the
//! PJRT device (a compiled one): a function traced once, replayed with fresh
//! inputs, state updated in place, guards and retraces, and the errors it raises.
mod support;

use kiln_tensor::{DType, Device, Tensor};
use support::{setup, vec_on};

/// Every test runs on both capture paths.
const DEVICES: [Device; 2] = [Device::Cpu, Device::Tpu(0)];

/// Equal within float32 rounding (a fused program may contract `a - b * c` into one rounding).
fn close(a: &Tensor, b: &Tensor, what: &str) {
    let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "{what}: {a:?} vs {b:?}");
    }
}

#[test]
fn a_step_with_state_replays_and_matches_eager() {
    setup();
    for dev in DEVICES {
        // w <- w - 0.1 * (x * w), returns sum(w): state updated in place, a fresh result.
        let w = vec_on(vec![1.0, 2.0, 3.0], dev);
        let w_eager = vec_on(vec![1.0, 2.0, 3.0], dev);
        let mut step = kiln_tensor::capture::compile(dev, |xs: &[Tensor]| {
            let g = xs[0].mul(&w)?;
            w.sub_(&kiln_tensor::constant(|| g.mul(0.1))?)?; // a literal: a declared constant
            Ok(vec![w.sum()?, g])
        });
        for i in 0..6 {
            let x = vec_on(vec![i as f32, 1.0, -0.5], dev);
            let out = step.call(std::slice::from_ref(&x)).unwrap();
            let g = x.mul(&w_eager).unwrap();
            w_eager.sub_(&g.mul(0.1).unwrap()).unwrap();
            close(&out[0], &w_eager.sum().unwrap(), &format!("sum, call {i}"));
            close(&out[1], &g, &format!("g, call {i}"));
            close(&w, &w_eager, &format!("w, call {i}"));
        }
        let s = step.stats();
        assert_eq!((s.calls, s.traces, s.replays, s.retraces), (6, 2, 4, 0), "{s:?}");
    }
}

#[test]
fn a_guard_change_retraces_with_its_reason_and_can_be_refused() {
    setup();
    for dev in DEVICES {
        let mut f = kiln_tensor::capture::compile(dev, |xs: &[Tensor]| Ok(vec![xs[0].exp()?.sum()?]));
        for _ in 0..3 {
            f.call(&[Tensor::ones(&[4], (DType::F32, dev)).unwrap()]).unwrap();
        }
        assert_eq!(f.stats().retraces, 0);
        let y = f.call(&[Tensor::ones(&[2, 3], (DType::F32, dev)).unwrap()]).unwrap();
        assert!((y[0].item::<f32>().unwrap() - 6.0 * std::f32::consts::E).abs() < 1e-4);
        let s = f.stats().clone();
        assert_eq!(s.retraces, 1);
        assert_eq!(
            s.last_retrace.as_deref(),
            Some(format!("input 0 changed from [4] float32 on {dev} to [2, 3] float32 on {dev}").as_str())
        );
        // Back to the first shape: its trace is still cached.
        f.call(&[Tensor::ones(&[4], (DType::F32, dev)).unwrap()]).unwrap();
        assert_eq!(f.stats().retraces, 1);

        let mut strict =
            kiln_tensor::capture::compile(dev, |xs: &[Tensor]| Ok(vec![xs[0].neg()?])).error_on_retrace(true);
        for _ in 0..2 {
            strict.call(&[Tensor::ones(&[4], (DType::F32, dev)).unwrap()]).unwrap();
        }
        let e = strict.call(&[Tensor::ones(&[5], (DType::I64, dev)).unwrap()]).unwrap_err().to_string();
        assert!(e.contains("retrace refused") && e.contains("input 0 changed from [4] float32"), "{e}");
    }
}

#[test]
fn reading_data_while_tracing_is_an_error() {
    setup();
    for dev in DEVICES {
        let mut f = kiln_tensor::capture::compile(dev, |xs: &[Tensor]| {
            let s = xs[0].sum()?;
            let v = s.item::<f32>()?; // not allowed: the value does not exist yet
            Ok(vec![xs[0].mul(v as f64)?])
        });
        let e = f.call(&[Tensor::ones(&[3], (DType::F32, dev)).unwrap()]).unwrap_err().to_string();
        assert!(e.contains("item() of a tensor of shape [] inside a function traced by kiln::compile"), "{e}");
        assert!(!kiln_tensor::trace::is_tracing(), "a failed trace ends the capture");
    }
}

#[test]
fn a_host_value_that_changes_keeps_the_function_traced() {
    setup();
    for dev in DEVICES {
        let mut lr = 1.0;
        let w = vec_on(vec![0.0; 2], dev);
        let mut step = kiln_tensor::capture::compile(dev, |_xs: &[Tensor]| {
            lr *= 0.5; // a host scalar changing every call: never replayed stale
            w.add_(&Tensor::full(&[2], lr, (DType::F32, dev))?)?;
            Ok(vec![])
        });
        for _ in 0..4 {
            step.call(&[]).unwrap();
        }
        assert_eq!(step.stats().replays, 0);
        assert_eq!(w.to_vec::<f32>().unwrap(), vec![0.9375, 0.9375]);
    }
}

/// A compiled function called inside another one's trace runs inline: its
/// ops are part of the outer program, whose replays then compute them too.
#[test]
fn a_compiled_function_inside_a_traced_one_runs_inline() {
    setup();
    for dev in DEVICES {
        let w = vec_on(vec![1.0, 2.0, 3.0], dev);
        let mut inner = kiln_tensor::capture::compile(dev, |xs: &[Tensor]| Ok(vec![xs[0].mul(&xs[0])?]));
        // Traced and replayed on its own first: a replay inside the outer trace would escape it.
        let x = vec_on(vec![1.0, 1.0, 1.0], dev);
        for _ in 0..3 {
            inner.call(std::slice::from_ref(&x)).unwrap();
        }
        assert_eq!(inner.stats().replays, 1);
        let mut outer = kiln_tensor::capture::compile(dev, |xs: &[Tensor]| {
            let sq = inner.call(&[xs[0].clone()])?;
            w.add_(&sq[0])?;
            Ok(vec![w.sum()?])
        });
        let mut want = [1.0f32, 2.0, 3.0];
        for i in 0..5 {
            let x = vec_on(vec![i as f32, 1.0, -2.0], dev);
            let out = outer.call(std::slice::from_ref(&x)).unwrap();
            for (k, v) in [i as f32, 1.0, -2.0].iter().enumerate() {
                want[k] += v * v;
            }
            assert_eq!(w.to_vec::<f32>().unwrap(), want, "{dev} call {i}");
            assert_eq!(out[0].item::<f32>().unwrap(), want.iter().sum::<f32>(), "{dev} call {i}");
        }
        let s = outer.stats();
        assert_eq!((s.traces, s.replays), (2, 3), "{dev}: {s:?}");
    }
}
